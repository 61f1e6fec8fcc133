//! What the core counts for metrics as it happens: grant latency from an
//! Acquire to its Grant, a queued request's wait for its lease, refusals
//! by user and reason.

use super::*;
use crate::stats::Refusal;

const MS: Nanos = 1_000_000;

fn refusals(t: &T, why: Refusal) -> u64 {
    let i = Refusal::ALL.iter().position(|r| *r == why).unwrap();
    t.b.stats().refusals_by_reason()[i]
}

/// The GPU free, a grant comes at once; held by another, it comes when
/// the holder gives the GPU back after its revoke: that wait is observed,
/// in the class of the process that waited.
#[test]
fn grant_latency_runs_from_the_acquire_to_the_grant() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let holder = t.connect_shim(p1, ALICE);
    t.register(holder, Priority::Normal);
    t.send(holder, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(granted(&t.recv(holder)));
    let waiter = t.connect_shim(p2, BOB);
    t.register(waiter, Priority::Low);
    let asked = t.now;
    t.send(waiter, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(!granted(&t.recv(waiter)), "the GPU is held");
    // The holder is revoked at the end of its timeslice and gives the GPU
    // back; the waiter's grant is looked for every millisecond.
    loop {
        assert!(t.now - asked < 10 * SEC, "never granted");
        t.advance(MS);
        if t.recv(holder)
            .iter()
            .any(|m| matches!(m, ServerMsg::Revoke { .. }))
        {
            t.send(
                holder,
                &ClientMsg::Release {
                    uuid: uuid(1),
                    held_ns: 0,
                },
            );
            t.turn();
        }
        if granted(&t.recv(waiter)) {
            break;
        }
    }
    let waited = (t.now - asked) as f64 / 1e9;
    let s = t.b.stats();
    let normal = &s.grant_latency[Priority::Normal.index()];
    let low = &s.grant_latency[Priority::Low.index()];
    assert_eq!((normal.count(), normal.sum_seconds()), (1, 0.0));
    assert_eq!(low.count(), 1);
    // Granted within the last millisecond looked at.
    let got = low.sum_seconds();
    assert!(got <= waited && got > waited - 0.001, "{got} {waited}");
    assert_eq!(s.waiting(), 0);
}

/// A process that withdraws its request, or goes, leaves nothing waiting
/// behind it.
#[test]
fn a_request_withdrawn_or_gone_is_not_waited_for() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2, p3) = (t.spawn(1), t.spawn(1), t.spawn(1));
    let holder = t.connect_shim(p1, ALICE);
    t.register(holder, Priority::Normal);
    t.send(holder, &ClientMsg::Acquire { uuid: uuid(1) });
    for (pid, uid) in [(p2, BOB), (p3, BOB)] {
        let c = t.connect_shim(pid, uid);
        t.register(c, Priority::Normal);
        t.send(c, &ClientMsg::Acquire { uuid: uuid(1) });
        assert_eq!(t.b.stats().waiting(), 1);
        if pid == p2 {
            t.send(
                c,
                &ClientMsg::Release {
                    uuid: uuid(1),
                    held_ns: 0,
                },
            );
        } else {
            t.b.hangup(c);
            t.turn();
        }
        assert_eq!(t.b.stats().waiting(), 0);
    }
    assert_eq!(
        t.b.stats().grant_latency[Priority::Normal.index()].count(),
        1,
        "the holder's own grant only"
    );
}

#[test]
fn a_queued_requests_wait_is_observed_when_it_is_placed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (first, second, _) = t.bob_waits_behind_alice("");
    t.advance(10 * SEC);
    assert!(leased(&t.recv(second)).is_none(), "waits for the GPU");
    t.b.hangup(first);
    t.advance(SEC);
    assert!(leased(&t.recv(second)).is_some());
    // Each user's: the first was placed at once, the second when the
    // first went.
    let w = &t.b.stats().queue_wait;
    assert_eq!(w[&ALICE].count(), 1);
    assert_eq!(w[&ALICE].sum_seconds(), 0.0);
    assert_eq!(w[&ALICE].buckets().next(), Some((0, 1)), "in the 0 bucket");
    assert_eq!(w[&BOB].count(), 1);
    assert_eq!(w[&BOB].sum_seconds(), 10.0);
}

#[test]
fn refusals_are_counted_by_their_reason() {
    let mut c = cfg();
    c.budgets.connections = 3;
    let mut t = T::new(c, &[16 * GIB]);
    let pids: Vec<u32> = (0..6).map(|_| t.spawn(1)).collect();
    // Held, so a --no-wait request finds no room.
    let holder = t.connect_as(pids[0], ALICE);
    t.lease(holder, 1, 0, false);
    t.advance(SEC);
    let c = t.connect_as(pids[1], BOB);
    t.lease(c, 1, 0, true);
    t.turn();
    assert!(refused(&t.recv(c)).is_some());
    assert_eq!(refusals(&t, Refusal::NoRoom), 1);
    // More GPUs than the node has: never satisfiable.
    let c = t.connect_as(pids[2], BOB);
    t.lease(c, 4, 0, false);
    t.turn();
    assert!(refused(&t.recv(c)).is_some());
    assert_eq!(refusals(&t, Refusal::Unsatisfiable), 1);
    // A GPU this node does not have.
    let c = t.connect_shim(pids[3], BOB);
    let mut reg = register(Priority::Normal);
    if let ClientMsg::Register { devices, .. } = &mut reg {
        devices[0].uuid = uuid(99);
    }
    t.send(c, &reg);
    t.turn();
    assert_eq!(refusals(&t, Refusal::UnknownGpu), 1);
    // Past the user's connections (three open: the refused ones closed
    // by their clients or not).
    while t.try_connect(pids[4], BOB).is_some() {}
    assert_eq!(refusals(&t, Refusal::ConnectionLimit), 1);
    let total: u64 = t.b.stats().refusals_by_reason().iter().sum();
    assert_eq!(total, 4, "nothing else counted");
    // All of them Bob's.
    let bobs: u64 = t.b.stats().refusals[&BOB].iter().sum();
    assert_eq!(bobs, 4);
}

/// A run's summary: its job's queue wait, GPU time and what it was owed,
/// peak memory, cap and refusals, those of a process that left included;
/// told to the job's user only, whoever else holds the token.
#[test]
fn a_jobs_summary_is_its_users_and_counts_what_left_it() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let holder = t.connect_as(p1, ALICE);
    t.lease(holder, 1, 0, false);
    t.advance(SEC);
    assert!(leased(&t.recv(holder)).is_some());
    let run = t.connect_as(p2, BOB);
    t.lease(run, 0, 4 * GIB, false);
    t.advance(2 * SEC);
    t.b.hangup(holder);
    t.advance(SEC / 10);
    let token = leased(&t.recv(run)).expect("placed once the GPU was free");
    // Its process: 1 GiB, one refusal, a second on the GPU; then it exits.
    let child = t.spawn(p2);
    let shim = t.connect_shim(child, BOB);
    t.register(shim, Priority::Normal);
    t.send(
        shim,
        &ClientMsg::Usage {
            uuid: uuid(1),
            used: GIB,
            peak: GIB,
            ooms: 1,
        },
    );
    t.send(shim, &ClientMsg::Acquire { uuid: uuid(1) });
    t.advance(SEC);
    t.b.hangup(shim);
    t.advance(SEC / 10);
    let ask = |t: &mut T, uid: u32| {
        let p = t.spawn(1);
        let c = t.connect_as(p, uid);
        t.send(c, &ClientMsg::Summary { job: token });
        t.turn();
        t.recv(c)
    };
    let got = ask(&mut t, BOB);
    let json = got
        .iter()
        .find_map(|m| match m {
            ServerMsg::SummaryReply { json } => Some(json.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{got:?}"));
    let s: crate::status::JobSummary = serde_json::from_str(&json).unwrap();
    assert_eq!(s.job, p2);
    assert!((s.queued_s - 2.0).abs() < 0.2, "{s:?}");
    assert!((0.9..=1.2).contains(&s.gpu_s), "{s:?}");
    assert!((0.9..=1.2).contains(&s.owed_s), "{s:?}");
    assert_eq!((s.peak_mem, s.mem_cap, s.refusals), (GIB, Some(4 * GIB), 1));
    // Another user holding the token is told nothing.
    let other = ask(&mut t, ALICE);
    assert!(
        refused(&other).is_some_and(|r| r.contains("no such job")),
        "{other:?}"
    );
}
