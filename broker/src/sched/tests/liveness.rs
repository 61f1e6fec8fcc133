//! Liveness (SPEC §2, invariant 3): every grant, in every class, is taken
//! back from a holder with no work in flight within a bounded idle time,
//! and a class's share of the window is charged only for time its live
//! holders use; revoked and hung holders charge nobody else.

use super::*;
use proptest::prelude::*;

/// The attack: a `normal` client that is granted once and then neither
/// launches nor releases (the broker cannot tell it from a busy one)
/// once kept a `low` client with work off an idle GPU for good.
#[test]
fn an_idle_normal_holder_does_not_keep_low_off_the_gpu() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 50.0, None);
    sim.add_class(2, 50.0, None, Priority::Low);
    sim.stuck.insert(1);
    sim.start(1);
    sim.residual.insert(2, B);
    sim.start(2);
    let cfg = *sim.s.config();
    // Recalled at the end of a slice; passed over once it has not
    // answered for two wake periods, and shown hung after the grace.
    sim.run_until(cfg.timeslice + 2 * cfg.wake);
    assert_eq!(sim.s.holder(), Some(2));
    sim.run_until(cfg.timeslice + cfg.grace);
    assert!(status_of(&sim.s, sim.now, 1).hung);
    sim.run_until(10 * SEC);
    let held = status_of(&sim.s, sim.now, 2).times.total_held;
    assert!(
        held >= 10 * SEC - cfg.timeslice - 2 * cfg.wake,
        "low held {held} ns of 10 s"
    );
}

/// A busy holder is recalled like any other while a lower class waits,
/// but asks again and has the GPU back at once: the lower class gets no
/// sliver, and the holder loses nothing but a round trip per slice.
#[test]
fn a_busy_holder_recalled_for_a_lower_class_keeps_the_gpu() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 50.0, None);
    sim.add_class(2, 50.0, None, Priority::Low);
    sim.residual.insert(1, B);
    sim.start(1);
    sim.start(2);
    sim.run_until(5 * SEC);
    assert!(sim.grants_to(2).is_empty(), "low was granted");
    let held = status_of(&sim.s, sim.now, 1).times.total_held;
    assert_eq!(held, 5 * SEC);
}

/// The attack of the review: a `high` client granted once that never
/// releases, beside an idle `normal` holder, used to keep the class's
/// share of each window used up, so a victim's busy `high` server got
/// 2 ms in 8 s with the GPU idle. A hung holder's time is its own.
#[test]
fn a_hung_high_holder_does_not_use_up_the_class_share() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 50.0, None, Priority::High);
    sim.stuck.insert(1);
    sim.start(1);
    sim.run_until(SEC);
    sim.add(2, 50.0, None);
    sim.stuck.insert(2);
    sim.start(2);
    sim.add_class(3, 50.0, None, Priority::High);
    sim.residual.insert(3, B);
    sim.start(3);
    let start = sim.now;
    sim.run_until(start + 8 * SEC);
    let held = status_of(&sim.s, sim.now, 3).times.total_held;
    // Work-conserving: the normal holder is hung, so `high` is not held
    // to its share and the victim has the GPU but for the first recalls.
    assert!(held >= 7 * SEC, "victim high held {held} ns of 8 s");
    assert!(status_of(&sim.s, sim.now, 1).hung);
    assert!(status_of(&sim.s, sim.now, 2).hung);
}

/// With a live `normal` client beside it, the victim's class still gets
/// its whole share: a hung `high` holder does not eat into it.
#[test]
fn the_class_share_goes_to_live_high_holders() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add_class(1, 50.0, None, Priority::High);
    sim.stuck.insert(1);
    sim.start(1);
    sim.add(2, 50.0, None);
    sim.residual.insert(2, B);
    sim.start(2);
    sim.add_class(3, 50.0, None, Priority::High);
    sim.residual.insert(3, B);
    sim.start(3);
    sim.run_until(SEC);
    let (v0, n0) = (sim.gpu_held(3), sim.gpu_held(2));
    sim.run_until(11 * SEC);
    let victim = (sim.gpu_held(3) - v0) as f64 / (10 * SEC) as f64;
    let normal = (sim.gpu_held(2) - n0) as f64 / (10 * SEC) as f64;
    assert!((victim - 0.5).abs() < 0.03, "victim high got {victim:.3}");
    assert!((normal - 0.5).abs() < 0.03, "normal got {normal:.3}");
}

#[derive(Debug, Clone)]
struct Attacker {
    class: Priority,
    /// When it asks for the GPU (then never lets go of a grant).
    at: Nanos,
}

fn attacker() -> impl Strategy<Value = Attacker> {
    (proptest::sample::select(Priority::ALL.to_vec()), 0..3 * SEC)
        .prop_map(|(class, at)| Attacker { class, at })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Whatever class each attacker asks for and whenever it does, a
    /// client holding a grant without ever using or releasing it costs a
    /// busy victim of any class at most one slice and two wake periods,
    /// and what a real client in its place would be owed: in the victim's
    /// band (`high` and `normal` share one) the catch-up credit a client
    /// waking up gets (a slice) and, for `high`, its warp (the two slices
    /// BVT lets it borrow), both of GPU time charged, which the deemed
    /// work of hung holders splits; and beside a `high` victim the rest of
    /// one window that a lower class is owed, rounded up to a slice (the class
    /// comes back when a whole slice fits its share). The broker cannot
    /// tell an attacker from a real client until that is spent; after
    /// that it is passed over for good.
    #[test]
    fn holders_that_never_let_go_cost_a_victim_a_bounded_time(
        victim in proptest::sample::select(Priority::ALL.to_vec()),
        attackers in prop::collection::vec(attacker(), 1..5),
        high_share in prop_oneof![Just(0.5), Just(0.2), Just(1.0)],
    ) {
        let cfg = SchedConfig { high_share, ..SchedConfig::default() };
        let mut sim = Sim::new(cfg);
        sim.add_class(0, 50.0, None, victim);
        sim.residual.insert(0, B);
        sim.start(0);
        let mut attackers = attackers;
        attackers.sort_by_key(|a| a.at);
        for (i, a) in attackers.iter().enumerate() {
            let id = i as ClientId + 1;
            sim.run_until(a.at);
            sim.stuck.insert(id);
            sim.add_class(id, 50.0, None, a.class);
            sim.start(id);
        }
        let end = 4 * SEC;
        sim.run_until(end);
        let held = sim.gpu_held(0);
        // A lower class waiting beside a `high` victim is owed the rest
        // of a window once (real-time throttling: the broker cannot tell
        // an attacker's request from a real one until it is granted), and
        // one of the victim's band its catch-up credit (and a `high` one
        // its warp).
        let band = crate::sched::clock::band;
        let lost: Nanos = attackers
            .iter()
            .map(|a| {
                let throttled = if victim == Priority::High && a.class < victim {
                    ((1.0 - high_share) * cfg.window as f64) as Nanos + cfg.timeslice
                } else {
                    0
                };
                // Credit and warp are GPU time charged, which the deemed
                // work of hung holders splits: one client and each
                // attacker at most.
                let split = attackers.len() as Nanos + 1;
                let owed = match band(a.class).cmp(&band(victim)) {
                    std::cmp::Ordering::Equal => cfg.timeslice * split,
                    _ => 0,
                };
                cfg.timeslice + 2 * cfg.wake + throttled + owed
            })
            .sum::<Nanos>()
            + MS;
        prop_assert!(
            held + lost >= end,
            "victim {victim:?} held {held} ns of {end}, attackers {attackers:?}"
        );
    }
}
