//! Grants and handovers: open-ended grants alone, bounds once others are
//! registered, handovers that never wait for queued work, wake-up
//! preemption, early releases, disconnects, holders that never let go, and
//! work never reported drained.

use super::*;

#[test]
fn lone_client_gets_open_ended_unbounded_grant_and_is_never_revoked() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, None);
    sim.start(1);
    sim.run_until(10 * SEC);
    assert_eq!(sim.log, vec![(0, grant(1, 1, None, 0))]);
    assert_eq!(sim.s.next_timeout(), None);
    assert_eq!(sim.gpu(1), 10 * SEC);
    let st = status_of(&sim.s, sim.now, 1);
    assert!((st.achieved - 1.0).abs() < 1e-9);
}

#[test]
fn a_second_registered_client_bounds_the_holder_and_leaving_unbounds_it() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, 0)]);
    // Idle, but it could wake at any moment: keep the holder's queue
    // short (a burst's bound first, then the bound).
    s.add_client(MS, 2, 1.0, None, N);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, BB)]);
    assert_eq!(s.next_timeout(), Some(20 * MS));
    s.handle_timeout(20 * MS);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, B)]);
    s.remove_client(30 * MS, 2);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, 0)]);
    // A lower class cannot take the GPU from it: no bound for that.
    s.add_client(40 * MS, 3, 1.0, None, Priority::Low);
    assert!(drain(&mut s).is_empty());
}

#[test]
fn handover_does_not_wait_for_the_old_holders_work() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    s.acquire(0, 1);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, BB)]);
    s.handle_timeout(20 * MS);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, B)]);
    // 2 has used nothing and 1 has used 30 ms: 2 is behind and takes
    // the GPU now, in the same step as the revoke. Its burst is not
    // bounded.
    s.acquire(30 * MS, 2);
    assert_eq!(drain(&mut s), vec![revoke(1, 1), grant(2, 2, None, BB)]);
    assert_eq!(s.state(1), Some(ClientState::Revoking));
    assert_eq!(s.holder(), Some(2));
    // 1's queued work drains alongside 2's: both are charged half.
    s.release(30 * MS, 1);
    assert!(status_of(&s, 30 * MS, 1).draining);
    let before = (
        status_of(&s, 30 * MS, 1).times.gpu_time,
        status_of(&s, 30 * MS, 2).times.gpu_time,
    );
    s.drained(32 * MS, 1);
    let after = (
        status_of(&s, 32 * MS, 1).times.gpu_time,
        status_of(&s, 32 * MS, 2).times.gpu_time,
    );
    assert_eq!(after.0 - before.0, MS);
    assert_eq!(after.1 - before.1, MS);
    assert!(!status_of(&s, 32 * MS, 1).draining);
}

#[test]
fn newcomer_after_long_solo_run_takes_the_gpu_at_once() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    s.acquire(0, 1);
    drain(&mut s);
    s.acquire(2 * SEC, 2);
    assert_eq!(drain(&mut s), vec![revoke(1, 1), grant(2, 2, None, BB)]);
    s.acquire(2 * SEC, 1);
    s.release(2 * SEC, 1);
    // 1 waits again: 2's grant becomes a contended slice, its burst's
    // request (a fifth of a slice).
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(4 * MS), BB)]);
    // Alone, 1 was level with its band: no debt for its solo run, no
    // credit for 2. Then the order decides: 1's turn.
    s.handle_timeout(2 * SEC + 4 * MS);
    assert_eq!(drain(&mut s), vec![revoke(2, 2), grant(1, 3, None, B)]);
}

#[test]
fn an_interactive_client_preempts_a_busy_holder_on_every_wakeup() {
    // A burst of 0.5 ms every 20 ms beside a busy batch client at equal
    // weight: every burst gets the GPU the moment it asks.
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, None);
    sim.add(2, 1.0, None);
    sim.residual.insert(1, B);
    sim.start(1);
    sim.run_until(100 * MS);
    for k in 0..50u64 {
        let t = 100 * MS + k * 20 * MS;
        sim.run_until(t);
        sim.s.acquire(t, 2);
        sim.pump();
        assert_eq!(sim.s.holder(), Some(2), "burst {k} waits");
        sim.run_until(t + 500 * US);
        sim.s.release(sim.now, 2);
        sim.s.drained(sim.now, 2);
        sim.pump();
        assert_eq!(sim.s.holder(), Some(1), "batch resumes after burst {k}");
    }
    // The batch client keeps nearly all the rest.
    let end = sim.now;
    let batch = sim.gpu(1) as f64 / end as f64;
    assert!(batch > 0.95, "batch {batch}");
}

/// A waker whose deadline is no earlier than the holder's (both woke
/// level, the holder first) waits no longer than the GPU's own quantum
/// (`wake`) from the holder's grant; then it has its burst's request,
/// and the order decides.
#[test]
fn a_waker_level_with_the_holder_gets_the_gpu_within_a_quantum() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    // 2 runs alone for a second (level with its band all along), then 1.
    s.acquire(0, 2);
    s.release(SEC, 2);
    s.drained(SEC, 2);
    s.acquire(SEC, 1);
    drain(&mut s);
    s.acquire(SEC + MS, 2);
    // Not owed more than 1: it does not preempt at once; 1's slice is
    // its burst's request.
    assert_eq!(drain(&mut s), vec![grant(1, 2, Some(3 * MS), BB)]);
    assert_eq!(s.holder(), Some(1));
    assert_eq!(s.next_timeout(), Some(SEC + 2 * MS));
    s.handle_timeout(SEC + 2 * MS);
    assert_eq!(
        drain(&mut s),
        vec![revoke(1, 2), grant(2, 3, None, BB)],
        "the holder's quantum"
    );
    // 1 is busy: it asks again. 2's grant is its burst's request...
    s.acquire(SEC + 2 * MS, 1);
    s.release(SEC + 2 * MS, 1);
    assert_eq!(drain(&mut s), vec![grant(2, 3, Some(4 * MS), BB)]);
    // ... and then 1, behind, has the GPU back for a slice.
    s.handle_timeout(SEC + 6 * MS);
    assert_eq!(drain(&mut s), vec![revoke(2, 3), grant(1, 4, None, B)]);
    s.acquire(SEC + 6 * MS, 2);
    s.release(SEC + 6 * MS, 2);
    assert_eq!(drain(&mut s), vec![grant(1, 4, Some(20 * MS), B)]);
}

/// Queued work that runs on after a release is its owner's: a waker
/// whose work ran beside the holder for 200 ms was charged half of it,
/// as the holder was, so it comes back level (neither owed nor owing),
/// and takes the GPU from a holder that has had its quantum.
#[test]
fn a_waker_whose_work_ran_on_was_charged_for_it() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    s.acquire(0, 2);
    s.release(SEC, 2);
    s.acquire(SEC, 1);
    s.drained(SEC + 200 * MS, 2);
    drain(&mut s);
    assert_eq!(
        status_of(&s, SEC + 200 * MS, 2).times.gpu_time,
        SEC + 100 * MS
    );
    assert_eq!(status_of(&s, SEC + 200 * MS, 1).times.gpu_time, 100 * MS);
    s.acquire(SEC + 200 * MS, 2);
    assert!(s.clock.lag(2).abs() < 1.0, "lag {}", s.clock.lag(2));
    assert_eq!(drain(&mut s), vec![revoke(1, 2), grant(2, 3, None, BB)]);
}

#[test]
fn idle_early_release_hands_over_immediately() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    s.acquire(0, 2);
    s.release(SEC, 2);
    s.drained(SEC, 2);
    s.acquire(SEC, 1);
    // 2 is ahead, so it waits for 1's slice...
    s.acquire(SEC + MS, 2);
    drain(&mut s);
    assert_eq!(s.holder(), Some(1));
    // ...unless 1 runs out of work first.
    s.release(SEC + 5 * MS, 1);
    assert_eq!(drain(&mut s), vec![grant(2, 3, None, BB)]);
    assert_eq!(s.holder(), Some(2));
    assert_eq!(s.state(1), Some(ClientState::Idle));
    s.drained(SEC + 5 * MS, 1);
    assert_eq!(status_of(&s, SEC + 5 * MS, 1).times.total_held, 5 * MS);
}

#[test]
fn removing_holder_grants_next_at_once() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    s.add_client(0, 3, 1.0, None, N);
    s.acquire(0, 1);
    s.acquire(0, 2);
    s.acquire(0, 3);
    assert_eq!(
        drain(&mut s),
        vec![grant(1, 1, None, BB), grant(1, 1, Some(4 * MS), BB)]
    );
    s.remove_client(10 * MS, 1);
    // 3 is still waiting behind 2, so 2's grant is contended: its burst.
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(4 * MS), BB)]);
    assert_eq!(s.holder(), Some(2));
    assert_eq!(s.state(1), None);
    // A waiting client that disconnects just leaves the queue; 2 now
    // has nobody waiting: open-ended, and alone, unbounded.
    s.remove_client(11 * MS, 3);
    assert_eq!(drain(&mut s), vec![grant(2, 2, None, 0)]);
    assert_eq!(s.next_timeout(), None);
}

#[test]
fn stuck_holder_is_passed_over_at_once_marked_hung_and_charged() {
    let cfg = SchedConfig::default();
    let mut sim = Sim::new(cfg);
    sim.add(1, 1.0, None);
    sim.add(2, 1.0, None);
    sim.stuck.insert(1);
    sim.start(1);
    sim.start(2);
    sim.run_until(SEC);
    // 2 woke beside it: revoked a quantum later; the GPU moved on then.
    assert_eq!(sim.grants_to(2), vec![(2 * MS, None)]);
    assert_eq!(sim.s.holder(), Some(2));
    let st = status_of(&sim.s, sim.now, 1);
    assert_eq!(st.state, ClientState::Revoking);
    assert!(st.hung);
    // Charged as on the GPU all along (half of it since the handover).
    let want = 2 * MS + (SEC - 2 * MS) / 2;
    assert!(
        st.times.gpu_time.abs_diff(want) < MS,
        "{} vs {want}",
        st.times.gpu_time
    );
    // The hang ends: it still has work, so it re-queues.
    sim.stuck.remove(&1);
    sim.s.acquire(SEC, 1);
    sim.s.release(SEC, 1);
    sim.s.drained(SEC, 1);
    sim.pump();
    sim.run_until(3 * SEC);
    let (g1, g2) = (sim.gpu(1), sim.gpu(2));
    assert!(g1.abs_diff(g2) <= 60 * MS, "{g1} vs {g2}");
}

#[test]
fn a_release_without_drained_is_charged_until_the_timeout() {
    let cfg = SchedConfig {
        drain_timeout: 100 * MS,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(cfg);
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    s.release(10 * MS, 1);
    assert_eq!(s.next_timeout(), Some(110 * MS));
    s.handle_timeout(110 * MS);
    let st = status_of(&s, 200 * MS, 1);
    assert!(!st.draining);
    assert_eq!(st.times.gpu_time, 110 * MS);
}

/// A busy client answers a revoke with Release and Acquire in either
/// order (the shim asks first; a client may let go first): the broker's
/// decisions are the same, grant for grant, whichever order its messages
/// came in. (A rule once held on one order only: a burst taken for
/// another user stayed a burst when its client let go first.)
#[test]
fn a_revoked_busy_client_is_served_alike_whichever_order_it_answers_in() {
    let run = |release_first: bool| {
        let mut sim = Sim::new(SchedConfig::default());
        sim.release_first = release_first;
        sim.add(1, 1.0, None);
        sim.add(2, 1.0, None);
        sim.add_class(3, 1.0, None, Priority::High);
        for id in [1, 2] {
            sim.residual.insert(id, B);
            sim.start(id);
        }
        // A third client's bursts, each 1 ms of work, every 7 ms: it
        // takes the GPU from busy holders, some of them in their bursts.
        for k in 0..100 {
            let t = 3 * MS + k * 7 * MS;
            sim.run_until(t);
            sim.s.acquire(t, 3);
            sim.s.drained(t, 3);
            sim.pump();
            sim.run_until(t + MS);
            sim.s.release(sim.now, 3);
            sim.s.drained(sim.now, 3);
            sim.pump();
        }
        sim.run_until(SEC);
        sim.log
    };
    let (asks_first, lets_go_first) = (run(false), run(true));
    assert!(asks_first.len() > 200, "{} actions", asks_first.len());
    assert_eq!(asks_first, lets_go_first);
}
