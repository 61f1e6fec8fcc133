//! The driver's per-process work as evidence at a recall, over the wire:
//! it is a connection's only where the connection is its process's one
//! on that GPU.

use super::*;
use crate::procs::{GpuSample, Telemetry};
use gpufrac_common::wire::uuid_string;

/// A sample in which the driver saw `pids` keep GPU 0 busy all the time.
fn working(pids: &[u32]) -> Telemetry {
    Telemetry {
        gpus: [(
            uuid_string(&uuid(1)),
            GpuSample {
                utilization: Some(1),
                working: Some(pids.iter().map(|&p| (p, 100)).collect()),
                ..Default::default()
            },
        )]
        .into(),
    }
}

/// Alice's `normal` connection holds without work and answers each
/// recall by asking again, beside Bob's busy `low` process; the driver
/// sees Alice's process at work every 500 ms (in the attack, because a
/// second connection of that process works a moment each second).
/// Returns Bob's grants in 6 s.
fn low_grants_beside(second_connection: bool) -> usize {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (a, b) = (t.spawn(1), t.spawn(1));
    let holder = t.connect_shim(a, ALICE);
    t.register(holder, Priority::Normal);
    if second_connection {
        let w = t.connect_shim(a, ALICE);
        t.register(w, Priority::Normal);
    }
    let low = t.connect_shim(b, BOB);
    t.register(low, Priority::Low);
    let acquire = ClientMsg::Acquire { uuid: uuid(1) };
    let release = ClientMsg::Release {
        uuid: uuid(1),
        held_ns: 0,
    };
    t.send(holder, &acquire);
    t.turn();
    t.send(low, &acquire);
    t.turn();
    let mut grants = 0;
    let start = t.now;
    while t.now < start + 6 * SEC {
        if (t.now - start).is_multiple_of(500 * MS) {
            t.b.telemetry(t.now, working(&[a]));
        }
        for id in [holder, low] {
            let ms = t.recv(id);
            if id == low {
                grants += ms
                    .iter()
                    .filter(|m| matches!(m, ServerMsg::Grant { .. }))
                    .count();
            }
            if ms.iter().any(|m| matches!(m, ServerMsg::Revoke { .. })) {
                // As a busy shim answers: asks again, then lets go.
                t.send(id, &acquire);
                t.send(id, &release);
            }
        }
        t.advance(MS);
    }
    grants
}

const MS: Nanos = 1_000_000;

/// The attack: a pretender holding beside a connection of its own
/// process that works a moment each second was granted back at each
/// recall on its process's evidence, and `low` waited on an idle GPU for
/// good. Work counts for a connection only where it is its process's
/// one on the GPU: the pretender is judged as one never seen at work.
#[test]
fn a_pretender_beside_a_working_connection_of_its_process_has_no_evidence() {
    assert!(
        low_grants_beside(true) >= 3,
        "low was not granted beside a pretender whose process's other connection works"
    );
}

/// A process with one connection that the driver sees at work keeps the
/// GPU from `low` at each recall, as before.
#[test]
fn a_process_with_one_connection_seen_at_work_keeps_the_gpu() {
    assert_eq!(low_grants_beside(false), 0);
}
