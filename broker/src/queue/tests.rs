use super::*;

const GIB: u64 = 1 << 30;
const SEC: Nanos = 1_000_000_000;

fn gpus(totals: &[u64]) -> Vec<GpuInfo> {
    totals
        .iter()
        .enumerate()
        .map(|(i, &t)| GpuInfo {
            index: i as u32,
            uuid: format!("GPU-{i:04}"),
            total_mem: t,
        })
        .collect()
}

fn req(want: Want) -> Request {
    Request {
        want,
        compute: None,
        limit: None,
        label: format!("job {want:?}"),
        job: 0,
        pin: Vec::new(),
        pod: None,
    }
}

/// A pod's request: `gib` on each GPU of `on` (positions, as `gpus`
/// names them).
fn pinned(on: &[(u32, u64)]) -> Request {
    let pin: Vec<Pinned> = on
        .iter()
        .map(|&(i, gib)| Pinned {
            uuid: format!("GPU-{i:04}"),
            mem: gib * GIB,
        })
        .collect();
    Request {
        want: Want::Memory(pin.iter().map(|p| p.mem).sum()),
        label: "pod ns/p".into(),
        pin,
        ..req(Want::Gpus(1))
    }
}

fn whole(n: u32) -> Request {
    req(Want::Gpus(n))
}

fn mem(gib: u64) -> Request {
    req(Want::Memory(gib * GIB))
}

fn placed(leases: &[Lease]) -> Vec<(RequestId, Vec<u32>)> {
    leases.iter().map(|l| (l.id, l.gpus.clone())).collect()
}

fn two_80g() -> Queue {
    Queue::new(gpus(&[80 * GIB, 80 * GIB]), QueueConfig::default())
}

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
    // Fractions first, then by GPUs needed; the big one is last.
    assert_eq!(w, vec![(4, 1), (3, 2), (2, 3)]);
    // Only GPU 1 is free: the fraction takes it first, so the 1-GPU job
    // (which needs it whole) waits, and so does the big one.
    assert_eq!(placed(&q.poll(3)), vec![(4, vec![1])]);
    q.release(4, 1);
    assert_eq!(placed(&q.poll(4)), vec![(3, vec![0])]);
    assert_eq!(q.position(4, 2), Some(1));
}

#[test]
fn escalation_lets_big_through_and_blocks_younger_small_ones() {
    let cfg = QueueConfig {
        escalate_after: 10 * SEC,
        ..QueueConfig::default()
    };
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
    q.submit(0, 1, whole(1)).unwrap();
    q.submit(0, 2, whole(1)).unwrap();
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
    assert!(err.reason.contains("escalation"), "{err}");
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
fn impossible_requests_are_refused_at_once() {
    let mut q = two_80g();
    let e = q.submit(0, 1, whole(3)).unwrap_err();
    assert!(
        e.reason
            .starts_with("requested 3 GPUs but this node has 2 (indices 0-1)"),
        "{e}"
    );
    let e = q.submit(0, 2, mem(100)).unwrap_err();
    assert!(
        e.reason
            .starts_with("requested 100.0 GiB but the largest GPU has 80.0 GiB"),
        "{e}"
    );
    assert!(q.submit(0, 3, whole(0)).is_err());
    assert!(q.submit(0, 4, req(Want::Memory(0))).is_err());
    let bad_limit = Request {
        limit: Some(1.5),
        ..whole(1)
    };
    assert!(q.submit(0, 5, bad_limit).is_err());
    let bad_share = Request {
        compute: Some(f64::NAN),
        ..whole(1)
    };
    assert!(q.submit(0, 6, bad_share).is_err());
    assert!(q.waiting(0).is_empty());
    assert!(q.try_now(0, 7, whole(3)).is_err());

    let mut empty = Queue::new(vec![], QueueConfig::default());
    assert!(
        empty
            .submit(0, 1, whole(1))
            .unwrap_err()
            .reason
            .contains("no GPUs")
    );

    let mut one = Queue::new(gpus(&[16 * GIB]), QueueConfig::default());
    let e = one.submit(0, 1, whole(2)).unwrap_err();
    assert!(
        e.reason
            .starts_with("requested 2 GPUs but this node has 1 (index 0)")
    );
    let e = one.submit(0, 2, req(Want::Memory(17 * GIB))).unwrap_err();
    assert!(e.reason.contains("16.0 GiB"), "{e}");
}

#[test]
fn duplicate_ids_are_refused() {
    let mut q = two_80g();
    q.submit(0, 1, whole(1)).unwrap();
    assert!(q.submit(0, 1, whole(1)).is_err());
    q.poll(0);
    assert!(q.submit(0, 1, whole(1)).is_err());
    assert!(q.try_now(0, 1, whole(1)).is_err());
}

#[test]
fn try_now_places_or_says_what_is_busy() {
    let mut q = two_80g();
    let of = |job, r| Request { job, ..r };
    let l = q.try_now(0, 1, of(101, whole(1))).unwrap();
    assert_eq!(l.gpus, vec![0]);
    q.try_now(0, 2, of(102, mem(30))).unwrap();
    let e = q.try_now(0, 3, whole(1)).unwrap_err();
    // Leases are named by their run's pid, as status shows them.
    assert!(e.reason.contains("GPU 0: held whole by job 101"), "{e}");
    assert!(e.reason.contains("GPU 1:"), "{e}");
    assert!(e.reason.contains("(job 102)"), "{e}");
    assert!(e.reason.contains("--no-wait"), "{e}");
    let e = q.try_now(0, 4, mem(60)).unwrap_err();
    assert!(e.reason.contains("--gpu-memory 60G"), "{e}");
    // Refused requests leave no trace.
    assert!(q.waiting(0).is_empty());
    assert_eq!(q.leases()[1].leases, vec![2]);
    q.try_now(0, 5, mem(50)).unwrap();
}

#[test]
fn cancel_removes_waiting_and_releases_a_granted_lease() {
    let mut q = Queue::new(gpus(&[80 * GIB]), QueueConfig::default());
    q.submit(0, 1, whole(1)).unwrap();
    q.submit(0, 2, whole(1)).unwrap();
    q.submit(0, 3, whole(1)).unwrap();
    q.poll(0);
    q.cancel(SEC, 2);
    assert_eq!(
        q.waiting(SEC).iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![3]
    );
    assert_eq!(q.position(SEC, 3), Some(1));
    // The run died right after being placed.
    q.cancel(SEC, 1);
    assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
    // Unknown ids are ignored.
    q.cancel(SEC, 42);
    q.release(SEC, 42);
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
    // The fraction goes first and leaves 50 GiB; the slot lease takes
    // 40 of it; the second slot would need 40 more and waits.
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(2, vec![0]), (1, vec![0])]);
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

#[test]
fn pinned_requests_go_to_their_gpu_and_hold_it_against_newcomers() {
    let mut q = two_80g();
    q.submit(0, 1, mem(70)).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    // The pod's 20 GiB on GPU 0 wait for job 1's room...
    q.submit(SEC, 2, pinned(&[(0, 20)])).unwrap();
    // ...and a 5 GiB job, which best fit would put into GPU 0's last
    // 10 GiB, goes to GPU 1 instead, as does --no-wait.
    q.submit(SEC, 3, mem(5)).unwrap();
    assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![1])]);
    assert_eq!(q.position(SEC, 2), Some(1));
    let l = q.try_now(SEC, 4, mem(5)).unwrap();
    assert_eq!(l.gpus, [1]);
    q.release(2 * SEC, 1);
    let l = q.poll(2 * SEC);
    assert_eq!(placed(&l), vec![(2, vec![0])]);
    assert_eq!(l[0].mem_cap, Some(20 * GIB));
    assert_eq!(q.leases()[0].committed_mem, 20 * GIB);
    // Pinned requests go before unescalated ones, FIFO among them.
    q.submit(3 * SEC, 5, whole(1)).unwrap();
    q.submit(4 * SEC, 6, pinned(&[(1, 80)])).unwrap();
    q.submit(5 * SEC, 7, pinned(&[(0, 60)])).unwrap();
    let order: Vec<RequestId> = q.waiting(5 * SEC).iter().map(|w| w.id).collect();
    assert_eq!(order, [6, 7, 5]);
    assert_eq!(placed(&q.poll(5 * SEC)), vec![(7, vec![0])]);
    // What is busy names a pod's lease by its pod once it has one.
    q.relabel(7, "container server", Some("ml/infer-0"));
    let e = q.try_now(6 * SEC, 8, mem(1)).unwrap_err();
    assert!(e.reason.contains("pod ml/infer-0"), "{e}");
}

#[test]
fn a_pinned_request_on_several_gpus_takes_each_its_own() {
    let mut q = two_80g();
    let l = q.try_now(0, 1, pinned(&[(1, 30), (0, 10)])).unwrap();
    assert_eq!((l.gpus.clone(), l.mem_cap), (vec![0, 1], None));
    let c: Vec<u64> = q.leases().iter().map(|g| g.committed_mem).collect();
    assert_eq!(c, [10 * GIB, 30 * GIB]);
    q.release(SEC, 1);
    assert!(q.leases().iter().all(|g| g.committed_mem == 0));
    // After a broker restart it is booked where its pins say, whatever
    // GPUs the saved lease listed.
    let l = q.restore(2, pinned(&[(1, 30), (0, 10)]), &[]).unwrap();
    assert_eq!(l.gpus, [0, 1]);
    let c: Vec<u64> = q.leases().iter().map(|g| g.committed_mem).collect();
    assert_eq!(c, [10 * GIB, 30 * GIB]);
}

#[test]
fn bad_pins_are_refused_with_what_would_do() {
    let mut q = two_80g();
    let mut r = pinned(&[(0, 10)]);
    r.pin[0].uuid = "GPU-ffff".into();
    let e = q.submit(0, 1, r).unwrap_err();
    assert!(
        e.reason.contains("GPU-ffff is not a GPU of this broker"),
        "{e}"
    );
    let e = q.submit(0, 2, pinned(&[(0, 10), (0, 5)])).unwrap_err();
    assert!(e.reason.contains("named twice"), "{e}");
    let e = q.submit(0, 3, pinned(&[(1, 81)])).unwrap_err();
    assert!(
        e.reason.contains("81.0 GiB on GPU 1, which has 80.0 GiB"),
        "{e}"
    );
    let mut r = pinned(&[(0, 10)]);
    r.want = Want::Gpus(1);
    let e = q.submit(0, 4, r).unwrap_err();
    assert!(e.reason.contains("sum of its pins"), "{e}");
    // A pinned GPU in MIG mode is named as such.
    let mut q = with_mig();
    let mut r = pinned(&[(0, 5)]);
    r.pin[0].uuid = q.mig().gpus().next().unwrap().uuid.clone();
    let e = q.submit(0, 5, r).unwrap_err();
    assert!(e.reason.contains("in MIG mode"), "{e}");
}

#[test]
fn lease_details_are_queryable() {
    let mut q = two_80g();
    let r = Request {
        compute: Some(30.0),
        limit: Some(0.5),
        label: "python train.py".into(),
        ..whole(2)
    };
    q.submit(0, 9, r.clone()).unwrap();
    q.poll(0);
    assert_eq!(q.lease(9).unwrap().gpus, vec![0, 1]);
    assert_eq!(q.lease_request(9), Some(&r));
    q.release(SEC, 9);
    assert!(q.lease(9).is_none());
    assert!(
        q.leases()
            .iter()
            .all(|g| g.committed_mem == 0 && g.slots_used == 0)
    );
}

/// GPU 1 (80 GiB) outside MIG mode, GPU 0 an A100-40GB in MIG mode.
fn with_mig() -> Queue {
    let mut q = Queue::new(
        vec![GpuInfo {
            index: 1,
            uuid: "GPU-0001".into(),
            total_mem: 80 * GIB,
        }],
        QueueConfig::default(),
    );
    q.set_mig(mig::Planner::new(vec![mig::models::a100_40gb(0)]));
    q
}

fn steps(l: &Lease) -> Vec<mig::Step> {
    l.mig.as_ref().unwrap().steps.clone()
}

#[test]
fn memory_goes_to_a_mig_instance_first_then_to_fractions() {
    let mut q = with_mig();
    q.submit(0, 1, mem(4)).unwrap();
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(1, vec![0])]);
    assert_eq!(l[0].mem_cap, Some(4864 << 20), "the instance's memory");
    assert_eq!(
        steps(&l[0]),
        vec![mig::Step::Create {
            profile: 19,
            placement: mig::Range { start: 6, size: 1 }
        }]
    );
    let done = q.mig_created(1, 7, "MIG-one".into()).unwrap();
    assert_eq!(done.mig.as_ref().unwrap().uuid.as_deref(), Some("MIG-one"));
    assert!(done.mig.as_ref().unwrap().steps.is_empty());
    assert_eq!(q.lease(1), Some(&done));
    // No profile holds 45 GiB: a fraction of GPU 1.
    q.submit(0, 2, mem(45)).unwrap();
    let l = q.poll(0);
    assert_eq!(placed(&l), vec![(2, vec![1])]);
    assert!(l[0].mig.is_none());
    assert_eq!(q.leases()[0].committed_mem, 45 * GIB);
    // The job ends: its instance stays, idle, and the next is given it
    // as it is.
    q.release(SEC, 1);
    q.submit(SEC, 3, mem(2)).unwrap();
    let l = q.poll(SEC);
    let a = l[0].mig.as_ref().unwrap();
    assert_eq!(
        (a.gi, a.uuid.as_deref(), a.steps.len()),
        (Some(7), Some("MIG-one"), 0)
    );
    // A whole GPU only ever means one outside MIG mode.
    q.release(SEC, 2);
    q.submit(SEC, 4, whole(1)).unwrap();
    assert_eq!(placed(&q.poll(SEC)), vec![(4, vec![1])]);
}

#[test]
fn a_failed_instance_waits_again_where_it_was() {
    let mut q = with_mig();
    // GPU 1 is taken whole, so memory can only go to MIG.
    q.submit(0, 1, whole(1)).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![1])]);
    q.submit(SEC, 2, mem(30)).unwrap();
    q.submit(2 * SEC, 3, mem(30)).unwrap();
    let l = q.poll(2 * SEC);
    assert_eq!(placed(&l), vec![(2, vec![0])]);
    assert_eq!(steps(&l[0]).len(), 1, "a 7g.40gb to create");
    assert_eq!(q.position(2 * SEC, 3), Some(1));
    let found = vec![(1, 5, mig::Range { start: 0, size: 4 }, vec!["MIG-x".into()])];
    assert!(q.mig_failed(3 * SEC, 2, Some(&found)));
    let w = q.waiting(3 * SEC);
    assert_eq!(
        w.iter().map(|w| (w.id, w.since)).collect::<Vec<_>>(),
        vec![(2, SEC), (3, 2 * SEC)],
        "back in its place, with its age"
    );
    assert!(q.lease(2).is_none());
    // The driver says a 4g.20gb (made by hand) is there: nothing holds
    // 30 GiB now; and the failed slices are avoided for a while anyway.
    assert!(q.poll(3 * SEC).is_empty());
    assert!(q.mig().avoiding(3 * SEC));
    // try_now leases are not queued again.
    let mut q = with_mig();
    let l = q.try_now(0, 9, mem(4)).unwrap();
    assert!(!steps(&l).is_empty());
    assert!(!q.mig_failed(0, 9, None));
    assert!(q.waiting(0).is_empty());
}

#[test]
fn mig_refusals_name_the_largest_profile() {
    let mut q = Queue::new(vec![], QueueConfig::default());
    q.set_mig(mig::Planner::new(vec![mig::models::a100_40gb(0)]));
    let e = q.submit(0, 1, mem(45)).unwrap_err();
    assert!(
        e.reason.starts_with(
            "requested 45.0 GiB but no MIG profile holds it: the largest is 7g.40gb (39.2 GiB, GPU 0), \
             and no GPU of this node is outside MIG mode; ask for at most --gpu-memory 39.25G"
        ),
        "{e}"
    );
    let e = q.submit(0, 2, whole(1)).unwrap_err();
    assert!(
        e.reason
            .contains("every GPU of this node is in MIG mode (GPU 0)"),
        "{e}"
    );
    assert!(
        e.reason
            .ends_with("ask for --gpu-memory instead, at most (the 7g.40gb profile of GPU 0): --gpu-memory 39.25G"),
        "{e}"
    );
    let mut q = with_mig();
    let e = q.submit(0, 3, mem(90)).unwrap_err();
    assert!(
        e.reason
            .contains("the largest GPU outside MIG mode has 80.0 GiB (GPU 1)"),
        "{e}"
    );
    assert!(
        e.reason.ends_with("ask for at most --gpu-memory 80G"),
        "{e}"
    );
    let e = q.submit(0, 4, whole(2)).unwrap_err();
    assert!(
        e.reason
            .contains("GPUs in MIG mode (GPU 0) are handed out only as MIG instances"),
        "{e}"
    );
    // Restored leases find their instance, or are refused.
    q.mig_sync(
        0,
        0,
        &[(
            3,
            19,
            mig::Range { start: 6, size: 1 },
            vec!["MIG-a".into()],
        )],
    );
    let l = q.restore_mig(5, mem(4), 0, "MIG-a").unwrap();
    assert_eq!((l.gpus.clone(), l.mem_cap), (vec![0], Some(4864 << 20)));
    assert!(q.restore_mig(6, mem(4), 0, "MIG-b").is_err());
    // What is busy, for --no-wait, names the MIG GPU too.
    q.submit(0, 7, whole(1)).unwrap();
    q.poll(0);
    let e = q.try_now(0, 8, mem(70)).unwrap_err();
    assert!(e.reason.contains("GPU 0 (MIG): 1 instances in use"), "{e}");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Submit(Want),
        /// GiB on the GPU at this position (mod the count), and on the
        /// next one too if the second is non-zero.
        Pin(usize, u64, u64),
        TryNow(Want),
        Release(usize),
        Cancel(usize),
        Advance(Nanos),
        Poll,
    }

    fn want() -> impl Strategy<Value = Want> {
        prop_oneof![
            (0..4u32).prop_map(Want::Gpus),
            (0..90u64).prop_map(|g| Want::Memory(g * GIB + 7)),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => want().prop_map(Op::Submit),
            1 => (any::<usize>(), 1..90u64, prop_oneof![Just(0u64), 1..30u64])
                .prop_map(|(g, a, b)| Op::Pin(g, a, b)),
            1 => want().prop_map(Op::TryNow),
            2 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::Cancel),
            1 => (0..20 * SEC).prop_map(Op::Advance),
            2 => Just(Op::Poll),
        ]
    }

    fn config() -> impl Strategy<Value = (Vec<u64>, QueueConfig)> {
        (
            prop::collection::vec(
                prop_oneof![Just(16 * GIB), Just(24 * GIB + 3), Just(80 * GIB)],
                0..4,
            ),
            1..4u32,
            prop_oneof![Just(Placement::BestFit), Just(Placement::Spread)],
            0..30 * SEC,
        )
            .prop_map(|(totals, f, placement, escalate_after)| {
                (
                    totals,
                    QueueConfig {
                        escalate_after,
                        overprovision: f,
                        overcommit: false,
                        placement,
                    },
                )
            })
    }

    fn check(q: &Queue, now: Nanos, just_polled: bool) {
        let f = q.cfg.overprovision;
        for (i, g) in q.gpus.iter().enumerate() {
            assert!(g.committed <= g.info.total_mem, "GPU {i} overcommitted");
            assert!(g.slots_used <= f);
            if f == 1 && g.slots_used == 1 {
                assert_eq!(g.leases.len(), 1, "whole GPU shared");
            }
            let (mut mem, mut slots, mut n) = (0, 0, 0);
            for h in q.held.values() {
                for s in h.shares.iter().filter(|s| s.gpu == i) {
                    mem += s.mem;
                    slots += u32::from(s.slot);
                    n += 1;
                }
            }
            assert_eq!((g.committed, g.slots_used, g.leases.len()), (mem, slots, n));
        }
        for (id, h) in &q.held {
            assert!(h.lease.gpus.windows(2).all(|w| w[0] < w[1]));
            assert!(!q.waiting.iter().any(|w| w.id == *id));
            match h.req.want {
                Want::Memory(_) if !h.req.pin.is_empty() => {
                    assert_eq!(h.lease.gpus.len(), h.req.pin.len());
                    let cap = h.req.pin[0].mem;
                    assert_eq!(h.lease.mem_cap, (h.req.pin.len() == 1).then_some(cap));
                    for p in &h.req.pin {
                        assert!(h.lease.uuids.contains(&p.uuid));
                    }
                }
                Want::Memory(b) => {
                    assert_eq!(h.lease.mem_cap, Some(b));
                    assert_eq!(h.lease.gpus.len(), 1);
                }
                Want::Gpus(n) => assert_eq!(h.lease.gpus.len(), n as usize),
            }
        }
        if just_polled {
            // Backfill is complete: up to the first blocked escalated
            // request, nothing still waiting fits (but where pinned
            // requests before it wait).
            let mut reserved = Vec::new();
            for i in q.order(now) {
                let w = &q.waiting[i];
                assert!(
                    q.plan(now, &w.req, &reserved).is_none(),
                    "request {} fits",
                    w.id
                );
                reserved.extend(w.req.pin.iter().filter_map(|p| q.gpu_of(&p.uuid)));
                if q.is_escalated(now, w) {
                    break;
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn commitments_stay_within_totals((totals, cfg) in config(), ops in prop::collection::vec(op(), 1..120)) {
            let mut q = Queue::new(gpus(&totals), cfg);
            let mut now = 0;
            let mut next_id = 0;
            let mut ids: Vec<RequestId> = Vec::new();
            for op in ops {
                let mut polled = false;
                match op {
                    Op::Submit(w) => {
                        next_id += 1;
                        if q.submit(now, next_id, req(w)).is_ok() {
                            ids.push(next_id);
                        }
                    }
                    Op::Pin(g, a, b) if !totals.is_empty() => {
                        let n = totals.len();
                        let mut on = vec![((g % n) as u32, a)];
                        if b > 0 && n > 1 {
                            on.push((((g + 1) % n) as u32, b));
                        }
                        next_id += 1;
                        if q.submit(now, next_id, pinned(&on)).is_ok() {
                            ids.push(next_id);
                        }
                    }
                    Op::TryNow(w) => {
                        next_id += 1;
                        if q.try_now(now, next_id, req(w)).is_ok() {
                            ids.push(next_id);
                        }
                    }
                    Op::Release(k) if !ids.is_empty() => {
                        let id = ids.remove(k % ids.len());
                        q.release(now, id);
                    }
                    Op::Cancel(k) if !ids.is_empty() => {
                        let id = ids.remove(k % ids.len());
                        q.cancel(now, id);
                    }
                    Op::Advance(dt) => now += dt,
                    Op::Poll => {
                        q.poll(now);
                        polled = true;
                    }
                    _ => {}
                }
                check(&q, now, polled);
                let w = q.waiting(now);
                prop_assert!(w.iter().enumerate().all(|(i, s)| s.position == i + 1));
            }
        }
    }
}
