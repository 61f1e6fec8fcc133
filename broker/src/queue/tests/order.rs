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
    q.submit(1, 2, whole(2)).unwrap();
    q.submit(2, 3, whole(1)).unwrap();
    q.submit(3, 4, mem(10)).unwrap();
    let w: Vec<_> = q.waiting(3).iter().map(|w| (w.id, w.position)).collect();
    // Fractions first, then by whole GPUs needed; the big one is last.
    assert_eq!(w, vec![(4, 1), (3, 2), (2, 3)]);
    // Only GPU 1 is free: the fraction takes it first, so the 1-GPU job
    // (which needs it whole) waits, and so does the big one.
    assert_eq!(placed(&q.poll(3)), vec![(4, vec![1])]);
    q.release(4, 1);
    assert_eq!(placed(&q.poll(4)), vec![(3, vec![0])]);
    assert_eq!(q.position(4, 2), Some(1));
}

/// The attack: `--gpu-memory 16G` on a 16 GiB GPU was ordered as a
/// fraction, so it went ahead of an earlier `--gpus 1` and took the GPU
/// whole (the `--gpus 1` job waited 5.6 s behind it on a real broker, and
/// would wait for as long as such requests keep coming, up to the
/// escalation limit). A request for all of a GPU's memory needs the GPU
/// as much as `--gpus 1` does, and waits its turn among whole-GPU
/// requests.
#[test]
fn a_request_for_a_whole_gpus_memory_does_not_jump_an_earlier_whole_gpu() {
    let mut q = Queue::new(gpus(&[16 * GIB]), QueueConfig::default());
    q.submit(0, 1, whole(1)).unwrap();
    assert_eq!(q.poll(0).len(), 1);
    q.submit(SEC, 2, whole(1)).unwrap();
    q.submit(2 * SEC, 3, mem(16)).unwrap();
    let w: Vec<_> = q
        .waiting(2 * SEC)
        .iter()
        .map(|w| (w.id, w.position))
        .collect();
    assert_eq!(w, vec![(2, 1), (3, 2)], "FIFO among whole-GPU requests");
    q.release(3 * SEC, 1);
    assert_eq!(placed(&q.poll(3 * SEC)), vec![(2, vec![0])]);
    q.release(4 * SEC, 2);
    assert_eq!(placed(&q.poll(4 * SEC)), vec![(3, vec![0])]);
}

/// What counts is the part of a GPU a request needs: with a 16 GiB and
/// an 8 GiB GPU, 8 GiB is half of the bigger one (a fraction, which goes
/// ahead of an earlier `--gpus 1`), 16 GiB all of it (which does not).
#[test]
fn memory_is_a_whole_gpu_only_where_no_gpu_would_have_room_to_spare() {
    let mut q = Queue::new(gpus(&[16 * GIB, 8 * GIB]), QueueConfig::default());
    q.submit(0, 1, whole(2)).unwrap();
    assert_eq!(q.poll(0).len(), 1);
    q.submit(SEC, 2, whole(1)).unwrap();
    q.submit(2 * SEC, 3, mem(16)).unwrap();
    q.submit(3 * SEC, 4, mem(8)).unwrap();
    let w: Vec<_> = q.waiting(3 * SEC).iter().map(|w| w.id).collect();
    assert_eq!(w, vec![4, 2, 3]);
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
    assert_eq!(w, vec![5, 4]);
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
