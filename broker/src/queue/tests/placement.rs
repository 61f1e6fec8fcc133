//! Placement: memory fractions best-fit or spread, waiting until they
//! fit, whole GPUs and fractions exclusive without `--overprovision`, and
//! slots and `--overcommit` with it.

use super::*;

#[test]
fn memory_best_fit_packs() {
    let mut q = Queue::new(gpus(&[80 * GIB, 40 * GIB]), QueueConfig::default());
    q.submit(0, 1, mem(10)).unwrap();
    q.submit(0, 2, mem(35)).unwrap();
    q.submit(0, 3, mem(30)).unwrap();
    q.submit(0, 4, mem(50)).unwrap();
    let l = q.poll(0);
    // 10 → the smaller GPU; 35 no longer fits there; 30 fills it
    // exactly; 50 fits neither (45 left on GPU 0) and waits.
    assert_eq!(placed(&l), vec![(1, vec![1]), (2, vec![0]), (3, vec![1])]);
    assert_eq!(l[0].mem_cap, Some(10 * GIB));
    assert_eq!(q.waiting(0)[0].id, 4);
    let st = q.leases();
    assert_eq!(st[0].committed_mem, 35 * GIB);
    assert_eq!(st[1].committed_mem, 40 * GIB);
    assert_eq!(st[1].leases, vec![1, 3]);
    assert_eq!(st[1].slots_used, 0);
    q.release(SEC, 2);
    assert_eq!(placed(&q.poll(SEC)), vec![(4, vec![0])]);
}

#[test]
fn memory_spread_spreads() {
    let cfg = QueueConfig {
        placement: Placement::Spread,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB, 40 * GIB]), cfg);
    for id in 1..=4 {
        q.submit(0, id, mem(10)).unwrap();
    }
    assert_eq!(
        placed(&q.poll(0)),
        vec![(1, vec![0]), (2, vec![1]), (3, vec![0]), (4, vec![1])]
    );
}

#[test]
fn memory_waits_when_nothing_fits_and_is_placed_after_release() {
    let mut q = two_80g();
    q.submit(0, 1, mem(70)).unwrap();
    q.submit(0, 2, mem(70)).unwrap();
    q.submit(0, 3, mem(20)).unwrap();
    assert_eq!(q.poll(0).len(), 2);
    assert_eq!(q.position(0, 3), Some(1));
    assert!(q.poll(SEC).is_empty());
    q.release(2 * SEC, 2);
    assert_eq!(placed(&q.poll(2 * SEC)), vec![(3, vec![1])]);
}

#[test]
fn whole_and_fractions_exclude_each_other_without_overprovision() {
    let mut q = Queue::new(gpus(&[80 * GIB]), QueueConfig::default());
    q.submit(0, 1, mem(1)).unwrap();
    q.submit(0, 2, whole(1)).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    q.release(SEC, 1);
    assert_eq!(placed(&q.poll(SEC)), vec![(2, vec![0])]);
    assert_eq!(q.leases()[0].committed_mem, 80 * GIB);
    q.submit(SEC, 3, mem(1)).unwrap();
    assert!(q.poll(SEC).is_empty());
}

#[test]
fn overprovision_two_slots_per_gpu() {
    let cfg = QueueConfig {
        overprovision: 2,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB]), cfg);
    for id in 1..=3 {
        q.submit(0, id, whole(1)).unwrap();
    }
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(1, vec![0]), (2, vec![0])]);
    assert!(l.iter().all(|l| l.mem_cap == Some(40 * GIB)));
    let st = &q.leases()[0];
    assert_eq!((st.slots_used, st.slots_total), (2, 2));
    assert_eq!(st.committed_mem, 80 * GIB);
    assert_eq!(q.waiting(0)[0].id, 3);
    // A lease still takes at most one slot per physical GPU.
    assert!(q.submit(0, 4, whole(2)).is_err());
    q.release(SEC, 1);
    assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
}

#[test]
fn overprovision_mixes_slots_and_fractions_by_memory() {
    let cfg = QueueConfig {
        overprovision: 2,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB]), cfg);
    q.submit(0, 1, whole(1)).unwrap();
    q.submit(0, 2, mem(30)).unwrap();
    q.submit(0, 3, whole(1)).unwrap();
    // The slot lease takes 40 GiB, the fraction (after it, which came
    // first) 30 of the rest; the second slot would need 40 more and
    // waits.
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(1, vec![0]), (2, vec![0])]);
    assert_eq!(q.leases()[0].committed_mem, 70 * GIB);
    assert_eq!(q.position(0, 3), Some(1));
    q.release(SEC, 2);
    assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
}

#[test]
fn overcommit_lets_commitments_exceed_total() {
    let cfg = QueueConfig {
        overcommit: true,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
    for id in 1..=3 {
        q.submit(0, id, mem(60)).unwrap();
    }
    // Where it still fits first, then the least overcommitted GPU.
    assert_eq!(
        placed(&q.poll(0)),
        vec![(1, vec![0]), (2, vec![1]), (3, vec![0])]
    );
    assert_eq!(q.leases()[0].committed_mem, 120 * GIB);
    // Whole GPUs are still exclusive.
    q.submit(0, 4, whole(1)).unwrap();
    assert!(q.poll(0).is_empty());
}

/// Memory the driver says processes outside gpufrac hold is taken: a
/// fraction goes where the rest is free, a whole GPU is one with none of
/// it, and what waits says why; once the process is gone, both fit.
#[test]
fn memory_held_outside_gpufrac_is_taken() {
    let mut q = Queue::new(gpus(&[16 * GIB, 16 * GIB]), QueueConfig::default());
    assert!(q.set_outside("GPU-0000", 3 * GIB));
    assert!(!q.set_outside("GPU-0000", 3 * GIB), "unchanged");
    assert!(!q.set_outside("GPU-9999", GIB), "no such GPU");
    // A whole GPU goes to GPU 1, which has none of it; then the
    // fractions can only go to GPU 0, where 13 GiB are free.
    q.submit(0, 1, req(Want::Gpus(1))).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![1])]);
    q.submit(0, 2, mem(14)).unwrap();
    q.submit(0, 3, mem(13)).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(3, vec![0])]);
    let why: Vec<(u64, Why)> = q.why(0);
    assert!(
        why[0]
            .1
            .text
            .contains("3.00 GiB held by processes outside gpufrac"),
        "{why:?}"
    );
    q.release(SEC, 3);
    q.submit(SEC, 4, req(Want::Gpus(1))).unwrap();
    // 13 GiB free on GPU 0 now: the 14 GiB fraction still waits, and so
    // does the whole GPU.
    assert!(q.poll(SEC).is_empty());
    assert!(q.set_outside("GPU-0000", 0));
    assert_eq!(placed(&q.poll(2 * SEC)), vec![(2, vec![0])]);
    q.release(3 * SEC, 2);
    assert_eq!(placed(&q.poll(3 * SEC)), vec![(4, vec![0])]);
}
