//! Pinned requests (the device plugin's pods): they go to their GPUs,
//! hold them against newcomers, and bad pins are refused with what would
//! do.

use super::*;

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
