//! Requests in and out: refusals of what could never fit and of ids in
//! use, `--no-wait`, cancelling, and a lease's details.

use super::*;

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
