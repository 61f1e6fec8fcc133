//! What the core is handed rather than asks for: the driver's view of each
//! GPU, sampled by the shell, and job tokens, from an injected source.

use std::collections::VecDeque;

use super::*;
use crate::procs::{GpuSample, Telemetry};
use gpufrac_common::wire::uuid_string;

fn sample(uuid: &str, utilization: Option<u32>, processes: &[(u32, u64)]) -> Telemetry {
    Telemetry {
        gpus: [(
            uuid.to_owned(),
            GpuSample {
                utilization,
                processes: Some(processes.to_vec()),
                ..Default::default()
            },
        )]
        .into(),
    }
}

/// Status shows the driver's view as last handed over, and nothing before
/// the first sample: the core has no driver of its own to ask.
#[test]
fn status_shows_the_last_sample() {
    let mut t = T::new(cfg(), &[16 * GIB, 16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    let st = t.status();
    assert_eq!(st.gpus[0].utilization, None);
    assert_eq!(st.gpus[0].processes[0].driver_mem, None);

    let gpu0 = uuid_string(&uuid(1));
    t.b.telemetry(
        t.now,
        sample(&gpu0, Some(42), &[(pid, 3 * GIB), (9999, GIB)]),
    );
    let st = t.status();
    assert_eq!(st.gpus[0].utilization, Some(42));
    assert_eq!(st.gpus[0].processes[0].driver_mem, Some(3 * GIB));
    assert_eq!(st.gpus[1].utilization, None, "GPU 1 was not sampled");

    // A later sample replaces the earlier whole: a process the driver no
    // longer lists has no driver memory.
    t.b.telemetry(t.now + SEC, sample(&gpu0, Some(7), &[]));
    let st = t.status();
    assert_eq!(st.gpus[0].utilization, Some(7));
    assert_eq!(st.gpus[0].processes[0].driver_mem, None);
}

/// The sampler is asked about every GPU status shows, and no other.
#[test]
fn the_shell_samples_each_gpu_status_shows() {
    let t = T::new(cfg(), &[16 * GIB, 8 * GIB]);
    let want = vec![uuid_string(&uuid(1)), uuid_string(&uuid(2))];
    assert_eq!(t.b.telemetry_uuids(), want);
    let shown: Vec<String> = t.status().gpus.iter().map(|g| g.uuid.clone()).collect();
    assert_eq!(shown, want);
}

/// Tokens come from the source the core was built with; one that is 0 (no
/// token, on the wire) or already a job's is passed over.
#[test]
fn tokens_come_from_the_injected_source_never_zero_nor_taken() {
    let seq = Rc::new(RefCell::new(VecDeque::from([0, 77, 77, 0, 78, 79])));
    let s = seq.clone();
    let source: Tokens = Box::new(move || s.borrow_mut().pop_front().expect("a token"));
    let mut t = T::build(cfg(), &[16 * GIB, 16 * GIB], Default::default(), source);
    let mut got = Vec::new();
    for _ in 0..2 {
        let pid = t.spawn(1);
        let c = t.connect_as(pid, ALICE);
        t.lease(c, 1, 0, false);
        t.advance(SEC);
        got.push(leased(&t.recv(c)).expect("leased"));
    }
    assert_eq!(got, [77, 78]);
    assert_eq!(seq.borrow().len(), 1, "drawn until a usable token came");
}

/// A process the driver lists that is not under the shim shows as
/// unmanaged with its memory, is taken from what is free, and keeps a job
/// from being placed into that memory until it lets go of it; a
/// registered process is never unmanaged.
#[test]
fn memory_outside_the_shim_is_shown_and_not_placed_into() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let gpu0 = uuid_string(&uuid(1));
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    let mut s = sample(&gpu0, Some(5), &[(pid, GIB), (9999, 3 * GIB)]);
    s.gpus.get_mut(&gpu0).unwrap().memory = Some(crate::procs::DriverMemory {
        total: 16 * GIB,
        free: 12 * GIB,
        used: 4 * GIB,
    });
    t.b.telemetry(t.now, s);
    let st = t.status();
    let g = &st.gpus[0];
    assert_eq!(
        g.unmanaged,
        [crate::status::UnmanagedProc {
            pid: 9999,
            mem: 3 * GIB
        }]
    );
    assert_eq!((g.unmanaged_processes, g.unmanaged_mem), (1, 3 * GIB));
    assert_eq!(g.driver.map(|d| d.free), Some(12 * GIB));
    assert_eq!(
        g.free_mem,
        12 * GIB,
        "books less what the driver says is held"
    );

    // 14 GiB fits the books (nothing committed) but not the GPU.
    let run = t.spawn(1);
    let r = t.connect_as(run, BOB);
    t.lease(r, 0, 14 * GIB, false);
    t.advance(SEC);
    assert!(leased(&t.recv(r)).is_none(), "placed into held memory");
    let why = &t.status().queue[0].why;
    assert!(
        why.contains("3.00 GiB held by processes outside gpufrac"),
        "{why}"
    );

    // The process lets go: the job is placed at once.
    t.b.telemetry(t.now, sample(&gpu0, Some(5), &[(pid, GIB)]));
    t.advance(SEC);
    assert!(
        leased(&t.recv(r)).is_some(),
        "not placed once the memory was free"
    );
    assert!(t.status().gpus[0].unmanaged.is_empty());
}
