//! Queue order: whole GPUs lowest first, smaller requests before bigger
//! ones, and a request past the escalation limit first of all, holding
//! the GPUs it waits for back from younger ones until it fits.

use super::*;

#[test]
fn whole_gpus_go_lowest_first_and_third_waits_for_first_freed() {
    let mut q = two_80g();
    for id in 1..=3 {
        q.submit(0, id, whole(1)).unwrap();
    }
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(1, vec![0]), (2, vec![1])]);
    assert_eq!(l[0].uuids, vec!["GPU-0000".to_string()]);
    assert_eq!(l[0].mem_cap, None);
    assert_eq!(q.waiting(0).len(), 1);
    q.release(SEC, 2);
    assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![1])]);
    assert!(q.waiting(SEC).is_empty());
}

#[test]
fn small_overtakes_big() {
    let mut q = two_80g();
    q.submit(0, 1, whole(1)).unwrap();
    q.poll(0);
    q.submit(1, 2, mem(10)).unwrap();
    q.submit(2, 3, whole(2)).unwrap();
    q.submit(3, 4, whole(1)).unwrap();
    let w: Vec<_> = q.waiting(3).iter().map(|w| (w.id, w.position)).collect();
    // An earlier fraction first, then by whole GPUs needed; the big one
    // is last.
    assert_eq!(w, vec![(2, 1), (4, 2), (3, 3)]);
    // Only GPU 1 is free: the fraction takes it first, so the 1-GPU job
    // (which needs it whole) waits, and so does the big one.
    assert_eq!(placed(&q.poll(3)), vec![(2, vec![1])]);
    q.release(4, 1);
    assert_eq!(placed(&q.poll(4)), vec![(4, vec![0])]);
    assert_eq!(q.position(4, 3), Some(1));
}

/// A fraction goes before whole-GPU requests that came after it, never
/// before one that came earlier; whole-GPU requests go fewest GPUs first
/// whenever they came.
#[test]
fn a_fraction_goes_after_every_earlier_whole_gpu_request() {
    let mut q = two_80g();
    q.submit(0, 1, whole(2)).unwrap();
    q.poll(0);
    let arrivals = [
        (2, whole(2)),
        (3, mem(1)),
        (4, whole(1)),
        (5, mem(2)),
        (6, whole(2)),
    ];
    for (t, (id, r)) in arrivals.into_iter().enumerate() {
        q.submit(t as Nanos + 1, id, r).unwrap();
    }
    let w: Vec<_> = q.waiting(9).iter().map(|w| w.id).collect();
    assert_eq!(w, vec![4, 2, 3, 5, 6]);
}

/// The attack, as a rule rather than an example: `--gpu-memory` of a
/// GPU's whole memory less a little (16 GiB less 1 MiB, less a byte,
/// ...) was ordered as a fraction, ahead of an earlier `--gpus 1`, and
/// took the GPU when it freed. A fraction now goes after every earlier
/// whole-GPU request and never takes the GPUs one waits for, whatever
/// its size.
#[test]
fn a_gpus_memory_less_a_little_does_not_jump_an_earlier_whole_gpu() {
    for k in [0, 1, 4096, 1 << 20, GIB - 1] {
        let mut q = Queue::new(gpus(&[16 * GIB]), QueueConfig::default());
        q.submit(0, 1, whole(1)).unwrap();
        assert_eq!(q.poll(0).len(), 1);
        q.submit(SEC, 2, whole(1)).unwrap();
        q.submit(2 * SEC, 3, req(Want::Memory(16 * GIB - k)))
            .unwrap();
        let w: Vec<_> = q.waiting(2 * SEC).iter().map(|w| w.id).collect();
        assert_eq!(w, vec![2, 3], "16 GiB less {k} bytes");
        q.release(3 * SEC, 1);
        assert_eq!(placed(&q.poll(3 * SEC)), vec![(2, vec![0])], "less {k}");
        q.release(4 * SEC, 2);
        assert_eq!(placed(&q.poll(4 * SEC)), vec![(3, vec![0])], "less {k}");
    }
}

/// A fraction that fits beside a running fraction still may not take
/// what an earlier whole-GPU request waits for: with GPU 0 busy with a
/// fraction and GPU 1 held whole, `--gpus 1` waits for GPU 0, which
/// takes no more fractions, and gets it when its fraction ends.
#[test]
fn fractions_do_not_backfill_onto_a_gpu_an_earlier_whole_request_waits_for() {
    let mut q = two_80g();
    q.submit(0, 1, mem(10)).unwrap();
    q.submit(0, 2, whole(1)).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0]), (2, vec![1])]);
    q.submit(SEC, 3, whole(1)).unwrap();
    q.submit(2 * SEC, 4, mem(10)).unwrap();
    assert!(q.poll(2 * SEC).is_empty(), "GPU 0 is held for request 3");
    let err = q.try_now(2 * SEC, 5, mem(1)).unwrap_err();
    assert!(err.reason.contains("whole GPUs"), "{err}");
    q.release(3 * SEC, 1);
    assert_eq!(placed(&q.poll(3 * SEC)), vec![(3, vec![0])]);
}

#[test]
fn escalation_lets_big_through_and_blocks_younger_small_ones() {
    let cfg = QueueConfig {
        escalate_after: 10 * SEC,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
    // Other users' jobs, which end in their own time.
    q.submit(0, 1, by(1000, whole(1))).unwrap();
    q.submit(0, 2, by(1001, whole(1))).unwrap();
    assert_eq!(q.poll(0).len(), 2);
    q.submit(SEC, 10, whole(2)).unwrap();
    q.submit(2 * SEC, 3, whole(1)).unwrap();
    // Before escalation a small one overtakes the big one.
    q.release(3 * SEC, 1);
    assert_eq!(placed(&q.poll(3 * SEC)), vec![(3, vec![0])]);
    q.submit(15 * SEC, 4, whole(1)).unwrap();
    q.submit(15 * SEC, 5, mem(1)).unwrap();
    let w = q.waiting(15 * SEC);
    assert_eq!(w[0].id, 10);
    assert!(w[0].escalated);
    assert!(!w[1].escalated);
    // GPU 0 frees up, but the escalated big job still cannot fit; the
    // younger small ones must not take what it is waiting for.
    q.release(20 * SEC, 3);
    assert!(q.poll(20 * SEC).is_empty());
    let err = q.try_now(20 * SEC, 6, mem(1)).unwrap_err();
    assert!(err.reason.contains("escalation limit"), "{err}");
    q.release(21 * SEC, 2);
    assert_eq!(placed(&q.poll(21 * SEC)), vec![(10, vec![0, 1])]);
    let w: Vec<_> = q.waiting(21 * SEC).iter().map(|w| w.id).collect();
    assert_eq!(
        w,
        vec![4, 5],
        "the fraction came after the whole-GPU request"
    );
    q.release(30 * SEC, 10);
    assert_eq!(
        placed(&q.poll(30 * SEC)),
        vec![(4, vec![0]), (5, vec![1])],
        "escalated by now too, FIFO among themselves"
    );
}

#[test]
fn escalated_requests_are_fifo_among_themselves() {
    let cfg = QueueConfig {
        escalate_after: 10 * SEC,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
    q.submit(0, 1, whole(2)).unwrap();
    assert_eq!(q.poll(0).len(), 1);
    q.submit(SEC, 2, whole(2)).unwrap();
    q.submit(2 * SEC, 3, whole(1)).unwrap();
    q.submit(20 * SEC, 4, mem(1)).unwrap();
    let w: Vec<_> = q
        .waiting(20 * SEC)
        .iter()
        .map(|w| (w.id, w.position, w.escalated, w.waited))
        .collect();
    assert_eq!(
        w,
        vec![
            (2, 1, true, 19 * SEC),
            (3, 2, true, 18 * SEC),
            (4, 3, false, 0)
        ]
    );
}
