//! What an escalated request holds back: only the GPUs it could use, only
//! as many as it needs, and nothing while its own user's lease blocks it
//! (no idle GPU while a request it could serve waits).

use super::*;
use proptest::prelude::*;

fn escalating() -> QueueConfig {
    QueueConfig {
        escalate_after: 10 * SEC,
        ..QueueConfig::default()
    }
}

/// The freeze of the review: an escalated `--gpus 2` beside its own
/// user's 1-byte lease on GPU 0 stopped placement for everyone, with
/// GPU 1 idle, `--no-wait` refused.
#[test]
fn a_users_own_lease_never_freezes_the_queue_for_others() {
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), escalating());
    q.submit(0, 1, by(65534, req(Want::Memory(1)))).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    q.submit(0, 2, by(65534, whole(2))).unwrap();
    assert!(q.poll(0).is_empty());
    let w = q.waiting(20 * SEC);
    assert!(w[0].escalated);
    // Its own user's younger request still waits behind it...
    q.submit(20 * SEC, 6, by(65534, whole(1))).unwrap();
    assert!(q.poll(20 * SEC).is_empty());
    q.cancel(20 * SEC, 6);
    // ...but another user's job gets the idle GPU, queued or not.
    q.submit(20 * SEC, 3, by(0, whole(1))).unwrap();
    assert_eq!(placed(&q.poll(20 * SEC)), vec![(3, vec![1])]);
    q.release(21 * SEC, 3);
    let l = q.try_now(21 * SEC, 4, by(0, whole(1))).unwrap();
    assert_eq!(l.gpus, vec![1]);
    // Once its own lease is gone, it waits for the others' like anyone.
    q.release(22 * SEC, 1);
    assert!(q.poll(22 * SEC).is_empty());
    q.submit(22 * SEC, 5, by(0, whole(1))).unwrap();
    assert!(q.poll(22 * SEC).is_empty(), "GPU 0 is held for request 2");
    q.release(23 * SEC, 4);
    assert_eq!(placed(&q.poll(23 * SEC)), vec![(2, vec![0, 1])]);
}

/// The freeze the property test found: a request stuck behind its own
/// user's older escalated one (which that user's own lease blocks) held
/// an idle GPU back from everyone, though it could not take the GPU
/// itself; another user's `--gpus 1` waited beside two idle GPUs.
#[test]
fn a_request_stuck_behind_its_own_users_never_holds_gpus_from_others() {
    let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), escalating());
    q.submit(0, 1, by(65534, req(Want::Memory(1)))).unwrap();
    assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
    q.submit(0, 2, by(65534, whole(2))).unwrap();
    assert!(q.poll(0).is_empty());
    q.submit(10 * SEC, 3, by(65534, mem(10))).unwrap();
    assert!(
        q.poll(10 * SEC).is_empty(),
        "behind its own user's request 2"
    );
    let w = q.waiting(20 * SEC);
    assert!(w.iter().all(|w| w.escalated));
    q.submit(20 * SEC, 4, by(0, whole(1))).unwrap();
    assert_eq!(placed(&q.poll(20 * SEC)), vec![(4, vec![1])]);
}

/// An escalated request holds back as many GPUs as it needs, free ones
/// first; the others stay open to younger requests.
#[test]
fn escalation_holds_back_only_what_it_needs() {
    let mut q = Queue::new(gpus(&[80 * GIB; 4]), escalating());
    for id in 1..=3 {
        q.submit(0, id, by(1000 + id as u32, mem(50))).unwrap();
    }
    assert_eq!(
        placed(&q.poll(0)),
        vec![(1, vec![0]), (2, vec![1]), (3, vec![2])]
    );
    q.submit(0, 10, whole(3)).unwrap();
    assert!(q.poll(0).is_empty());
    // Held for request 10: GPU 3 (free), then GPUs 0 and 1 (as few
    // leases as any, lowest index). GPU 2 stays open.
    q.submit(11 * SEC, 11, by(7, mem(1))).unwrap();
    assert_eq!(placed(&q.poll(11 * SEC)), vec![(11, vec![2])]);
    q.release(12 * SEC, 1);
    q.release(12 * SEC, 2);
    assert_eq!(placed(&q.poll(12 * SEC)), vec![(10, vec![0, 1, 3])]);
}

/// A memory request holds back one GPU: the one closest to fitting it,
/// and never one too small to ever hold it.
#[test]
fn an_escalated_fraction_holds_back_one_gpu_that_could_hold_it() {
    let mut q = Queue::new(gpus(&[16 * GIB, 80 * GIB, 80 * GIB]), escalating());
    q.submit(0, 1, by(1000, mem(60))).unwrap();
    q.submit(0, 2, by(1001, mem(70))).unwrap();
    assert_eq!(q.poll(0).len(), 2);
    q.submit(0, 10, mem(40)).unwrap();
    assert!(q.poll(0).is_empty());
    // GPU 1 (20 GiB left) is the closer; the 16 GiB GPU 0 and GPU 2 stay
    // open to smaller requests.
    q.submit(11 * SEC, 11, by(7, mem(8))).unwrap();
    q.submit(11 * SEC, 12, by(7, mem(9))).unwrap();
    assert_eq!(
        placed(&q.poll(11 * SEC)),
        vec![(11, vec![2]), (12, vec![0])]
    );
    q.release(12 * SEC, 1);
    assert_eq!(placed(&q.poll(12 * SEC)), vec![(10, vec![1])]);
}

#[derive(Debug, Clone)]
enum Op {
    Submit(u32, Want),
    Release(usize),
    Advance(Nanos),
    Poll,
}

fn op() -> impl Strategy<Value = Op> {
    let want = prop_oneof![
        (1..4u32).prop_map(Want::Gpus),
        (0..90u64).prop_map(|g| Want::Memory(g * GIB + 1)),
    ];
    prop_oneof![
        3 => (0..3u32, want).prop_map(|(u, w)| Op::Submit(u, w)),
        2 => any::<usize>().prop_map(Op::Release),
        1 => (0..20 * SEC).prop_map(Op::Advance),
        2 => Just(Op::Poll),
    ]
}

/// GPUs a waiting request needs to hold back: `--gpus N` N of them, a
/// fraction one.
fn need(r: &Request) -> usize {
    match r.want {
        Want::Gpus(n) => n as usize,
        Want::Memory(_) => 1,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// No idle GPU while a request it could serve waits. A GPU is *idle*
    /// when no lease holds any of it. A waiting request W *could serve*
    /// on an idle GPU g when it could be placed now on idle GPUs
    /// including g, reservations aside: a fraction of B when g holds at
    /// least B, a request of N whole GPUs when at least N GPUs are idle.
    /// After a poll, the idle GPUs W could serve are at most what the
    /// other requests that may hold GPUs back from W need (N for N GPUs,
    /// one for a fraction): the escalated ones, and the whole-GPU ones
    /// ahead of it (a fraction delays no earlier whole-GPU request); none
    /// when there are no such requests. Such a request may hold GPUs back
    /// from everyone unless it is *blocked by its own user* (every other
    /// user's lease gone, it still could not be placed); then only from
    /// its own user's requests.
    #[test]
    fn no_idle_gpu_while_a_request_it_could_serve_waits(
        totals in prop::collection::vec(prop_oneof![Just(16 * GIB), Just(80 * GIB)], 1..5),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut q = Queue::new(gpus(&totals), escalating());
        let (mut now, mut next) = (0, 0);
        let mut ids: Vec<RequestId> = Vec::new();
        for op in ops {
            match op {
                Op::Submit(u, w) => {
                    next += 1;
                    if q.submit(now, next, by(u, req(w))).is_ok() {
                        ids.push(next);
                    }
                }
                Op::Release(k) if !ids.is_empty() => {
                    let id = ids.remove(k % ids.len());
                    q.release(now, id);
                }
                Op::Advance(dt) => now += dt,
                Op::Poll => {}
                Op::Release(_) => {}
            }
            q.poll(now);
            let idle: Vec<usize> = (0..q.gpus.len()).filter(|&i| q.gpus[i].leases.is_empty()).collect();
            let serves = |r: &Request, g: usize| match r.want {
                Want::Gpus(n) => idle.len() >= n as usize,
                Want::Memory(b) => q.gpus[g].info.total_mem >= b,
            };
            let blocked_by_own = |r: &Request| {
                let mut alone = Queue::new(gpus(&totals), QueueConfig::default());
                for (id, h) in q.held.iter().filter(|(_, h)| h.req.uid == r.uid) {
                    let on: Vec<u32> = h.lease.gpus.clone();
                    alone.restore(*id, h.req.clone(), &on).expect("restores");
                }
                alone.plan(now, r, &[]).is_none()
            };
            let order = q.order(now);
            for (place, &i) in order.iter().enumerate() {
                let w = &q.waiting[i];
                let wanted = idle.iter().filter(|&&g| serves(&w.req, g)).count();
                let ahead: Vec<u64> = order[..place].iter().map(|&s| q.waiting[s].seq).collect();
                let owed: usize = q
                    .waiting
                    .iter()
                    .filter(|e| {
                        e.id != w.id
                            && (q.is_escalated(now, e)
                                || (matches!(e.req.want, Want::Gpus(_)) && ahead.contains(&e.seq)))
                    })
                    .filter(|e| e.req.uid == w.req.uid || !blocked_by_own(&e.req))
                    .map(|e| need(&e.req))
                    .sum();
                prop_assert!(
                    wanted <= owed,
                    "{wanted} idle GPUs could serve request {} (user {}), escalated and \
                     whole-GPU ones that may hold GPUs back from it need {owed}",
                    w.id,
                    w.req.uid
                );
            }
        }
    }
}
