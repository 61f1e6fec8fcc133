//! MIG instances under `--mig dynamic`: memory goes to an instance first,
//! a failed instance waits again where it was, and refusals name the
//! largest profile.

use super::*;

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
