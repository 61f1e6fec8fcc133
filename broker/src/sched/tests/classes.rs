//! Priority classes: `high` takes the GPU at once but only its share of
//! the window while others wait, `low` runs on time nobody else wants, and
//! shares apply within a class.

use super::*;

/// `high` takes the GPU at once (its burst's request is the shortest, so
/// its deadline the earliest), and then its request is done: the order
/// is its virtual time like anyone's, and two busy clients of equal
/// weight, one `high`, share the GPU evenly. (It used to keep the GPU for
/// as long as it had work: priority bought throughput.)
#[test]
fn high_takes_the_gpu_at_once_and_keeps_it_only_for_its_request() {
    // Without the class's bound (`high_share` 1.0): the order alone.
    let unbounded = SchedConfig {
        high_share: 1.0,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(unbounded);
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, Priority::High);
    s.acquire(0, 1);
    // `high` shares its band: it could take the GPU, so 1 is bounded.
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, BB)]);
    s.handle_timeout(5 * SEC);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, B)]);
    s.acquire(5 * SEC, 2);
    assert_eq!(drain(&mut s), vec![revoke(1, 1), grant(2, 2, None, BB)]);
    s.acquire(5 * SEC, 1);
    s.release(5 * SEC, 1);
    s.drained(5 * SEC, 1);
    // 1 waits: 2's grant becomes its request, a tenth of a slice.
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(2 * MS), BB)]);
    s.handle_timeout(5 * SEC + 2 * MS);
    assert_eq!(drain(&mut s), vec![revoke(2, 2), grant(1, 3, None, B)]);
    // Both busy from here: even shares.
    let mut sim = Sim::new(unbounded);
    sim.add(1, 1.0, None);
    sim.add_class(2, 1.0, None, Priority::High);
    for i in [1, 2] {
        sim.residual.insert(i, B);
        sim.start(i);
    }
    sim.run_until(4 * SEC);
    let (a, b) = (sim.gpu(1), sim.gpu(2));
    assert!(a.abs_diff(b) <= 2 * SEC / 50, "{a} vs {b}");
}

/// Linux's real-time throttling, for the GPU: while a lower class waits,
/// busy `high` clients get half of each window between them (their shares
/// still apply among themselves), and the others the rest.
#[test]
fn high_gets_at_most_its_share_of_each_window_while_others_wait() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 70.0, None, Priority::High);
    sim.add_class(2, 30.0, None, Priority::High);
    sim.add(3, 100.0, None);
    for i in 1..=3 {
        sim.residual.insert(i, B);
        sim.start(i);
    }
    let end = 10 * SEC;
    sim.run_until(end);
    let share = |i| sim.gpu(i) as f64 / end as f64;
    let (s1, s2, s3) = (share(1), share(2), share(3));
    // Never above the share; a little below it, as here the share is
    // also `high`'s fair part, and a window in which the order gave it
    // less is not made up in the next (48%: 50% without the bound).
    assert!(s1 + s2 <= 0.5 + 0.005, "high got {s1} + {s2}");
    assert!(s1 + s2 >= 0.5 - 0.025, "high got {s1} + {s2}");
    assert!((s3 - 0.5).abs() < 0.025, "normal got {s3}");
    assert!((s1 / (s1 + s2) - 0.7).abs() < 0.03, "{s1} vs {s2}");
    // In slices of the order of a timeslice, not slivers.
    let high_grants = sim.grants_to(1).len() + sim.grants_to(2).len();
    assert!(high_grants < 600, "{high_grants} grants to high in 10 s");
}

/// The attack: a client asks for `high`, takes a grant and never gives it
/// back. While others wait it is revoked once the class's share of the
/// window is used up, passed over (hung), and the GPU goes on.
#[test]
fn a_high_holder_that_never_releases_is_passed_over() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 100.0, None, Priority::High);
    sim.add(2, 1.0, None);
    sim.stuck.insert(1);
    sim.start(1);
    sim.run_until(5 * SEC);
    assert_eq!(sim.s.holder(), Some(1), "alone, high is not bounded");
    sim.residual.insert(2, B);
    sim.start(2);
    sim.run_until(15 * SEC);
    assert_eq!(sim.s.holder(), Some(2));
    let st = status_of(&sim.s, sim.now, 1);
    assert_eq!(st.state, ClientState::Revoking);
    assert!(st.hung);
    let victim = status_of(&sim.s, sim.now, 2);
    // The stuck client held half of the window before 2 came: 2 waits
    // at most about half a window, then has the GPU (charged half of it
    // while the stuck client's work is deemed to share it).
    let held = victim.times.total_held;
    assert!(held >= 9 * SEC, "victim held {held} ns of 10 s");
}

/// An interactive `high` client, well inside its share, still takes the
/// GPU at once on every wake-up beside a busy normal one.
#[test]
fn an_interactive_high_client_within_its_share_is_never_delayed() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 50.0, None, Priority::High);
    sim.add(2, 50.0, None);
    sim.residual.insert(2, B);
    sim.start(2);
    for k in 0..250 {
        let t = k * 20 * MS;
        sim.run_until(t);
        sim.s.acquire(t, 1);
        sim.pump();
        assert_eq!(sim.s.holder(), Some(1), "burst {k} at {t} waited");
        sim.run_until(t + MS);
        sim.s.release(sim.now, 1);
        sim.s.drained(sim.now, 1);
        sim.pump();
    }
}

#[test]
fn low_runs_only_on_time_nobody_else_wants() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 1.0, None, Priority::Low);
    sim.add(2, 1.0, None);
    sim.start(1);
    sim.run_until(SEC);
    assert_eq!(sim.s.holder(), Some(1));
    sim.start(2);
    assert_eq!(
        sim.s.holder(),
        Some(2),
        "a normal client preempts low at once"
    );
    let low_before = sim.gpu(1);
    sim.run_until(3 * SEC);
    // While the normal client is busy, low gets nothing after its
    // queued work drained.
    assert!(sim.gpu(1) - low_before <= MS, "{}", sim.gpu(1) - low_before);
    sim.busy.remove(&2);
    sim.s.release(sim.now, 2);
    sim.s.drained(sim.now, 2);
    sim.pump();
    assert_eq!(sim.s.holder(), Some(1));
}

/// `high` and `normal` share one band by weight: 70 and 30 `high` beside
/// 100 `normal`, each its own unit and no ceiling on the class, get 35%,
/// 15% and 50%. (They used to get 70% and 30% and leave `normal`
/// nothing: priority bought throughput.)
#[test]
fn high_and_normal_share_the_gpu_by_weight() {
    // Without the class's bound (`high_share` 1.0): the warp alone.
    let unbounded = SchedConfig {
        high_share: 1.0,
        ..SchedConfig::default()
    };
    let mut sim = Sim::new(unbounded);
    sim.add_class(1, 70.0, None, Priority::High);
    sim.add_class(2, 30.0, None, Priority::High);
    sim.add(3, 100.0, None);
    for i in 1..=3 {
        sim.residual.insert(i, B);
        sim.start(i);
    }
    let end = 10 * SEC;
    sim.run_until(end);
    for (id, want) in [(1, 0.35), (2, 0.15), (3, 0.5)] {
        let got = sim.gpu(id) as f64 / end as f64;
        assert!(
            (got - want).abs() < 0.01,
            "client {id}: {got:.4}, want {want}"
        );
    }
}
