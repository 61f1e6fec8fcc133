//! The ring of recent samples (`history.rs`) as the core keeps and serves
//! it: a sample a second whether anyone asks or not, on the first status
//! page only; and why each queued request waits, in status.

use super::*;
use crate::procs::{GpuSample, Telemetry};
use crate::status::Status;
use gpufrac_common::wire::uuid_string;

fn page(t: &T, from: usize) -> Status {
    serde_json::from_str(&t.b.status_json(t.now, from)).expect("status JSON")
}

#[test]
fn a_sample_a_second_whoever_watches() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let gpu0 = uuid_string(&uuid(1));
    let (a, b) = (t.spawn(1), t.spawn(1));
    let ca = t.connect_shim(a, ALICE);
    t.register(ca, Priority::Normal);
    let cb = t.connect_shim(b, BOB);
    t.register(cb, Priority::Normal);
    for util in [10, 20, 30, 40, 50] {
        let sample = GpuSample {
            utilization: Some(util),
            ..Default::default()
        };
        t.b.telemetry(
            t.now,
            Telemetry {
                gpus: [(gpu0.clone(), sample)].into(),
            },
        );
        t.advance(SEC);
    }
    // Nobody asked for status meanwhile; the ring has a sample a second.
    let h = page(&t, 0)
        .history
        .expect("the first page carries the ring");
    assert!((5..=7).contains(&h.samples), "{}", h.samples);
    assert_eq!(h.every_s, 1.0);
    assert_eq!(h.queue.len(), h.samples as usize);
    let g = h
        .gpus
        .iter()
        .find(|g| g.uuid == gpu0)
        .expect("GPU 0's series");
    let util: Vec<u32> = g.utilization.iter().flatten().copied().collect();
    assert!(util.ends_with(&[20, 30, 40, 50]), "{util:?}");
    // Each user's part, and its processes outside any job.
    for uid in [ALICE, BOB] {
        for level in ["user", "job"] {
            let s = h
                .shares
                .iter()
                .find(|s| s.uid == uid && s.level == level)
                .unwrap_or_else(|| panic!("no {level} series of {uid}: {h:?}"));
            assert_eq!(s.achieved.len(), h.samples as usize);
            assert!(s.target.iter().flatten().count() >= 5);
        }
    }
    // Later pages leave it out.
    assert_eq!(page(&t, 1).history, None);
}

#[test]
fn a_queued_request_says_why_it_waits() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (r1, r2) = (t.spawn(1), t.spawn(1));
    let c1 = t.connect_as(r1, ALICE);
    t.lease(c1, 0, 12 * GIB, false);
    t.advance(SEC / 10);
    assert!(leased(&t.recv(c1)).is_some());
    let c2 = t.connect_as(r2, BOB);
    t.lease(c2, 0, 8 * GIB, false);
    t.advance(SEC / 10);
    let st = page(&t, 0);
    let q = &st.queue[0];
    assert_eq!((q.pid, q.uid), (r2, BOB));
    assert_eq!((q.want_mem, q.want_gpus), (Some(8 * GIB), None));
    assert_eq!(
        q.why,
        format!(
            "needs 8.00 GiB on one GPU; GPU 0: 4.00 GiB free of 16.00 GiB \
             (the rest held by job {r1})"
        )
    );
    assert_eq!(q.waits_for, vec![0]);
    assert_eq!(st.leases[0].uid, ALICE);
    // The ring's sample counts it without saying why (its status leaves
    // the queue's entries out).
    t.advance(SEC);
    let h = page(&t, 0)
        .history
        .expect("the first page carries the ring");
    assert_eq!(h.queue.last(), Some(&1), "{:?}", h.queue);
}
