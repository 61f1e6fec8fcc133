//! The searching attacker in the test suite (docs/testing.md, "The
//! searching attacker"): for each invariant, a search of a fixed budget
//! from the pinned seed, seeded with the review's strategies, within the
//! test suite's bounds on inputs; the invariant must hold against the
//! most harmful strategy it finds. `cargo xtask redteam` searches longer
//! and with the largest inputs. `GPUFRAC_REDTEAM_REPORT_ONLY=1` reports
//! a broken invariant instead of failing; `GPUFRAC_REDTEAM_SEED` searches
//! from another seed.

use gpufrac_redteam::attack::Space;
use gpufrac_redteam::check::log_of;
use gpufrac_redteam::check::verdict;
use gpufrac_redteam::search::{Plan, SEED, report};
use gpufrac_redteam::{
    Bounds, Cohort, Invariant, Play, Strategy, cohort, evaluate, holds, search, seeds,
};

/// Strategies played per invariant (and a quarter more to simplify the
/// best): about 12 s of CPU each in a debug build.
const BUDGET: usize = 64;

fn seed() -> u64 {
    std::env::var("GPUFRAC_REDTEAM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEED)
}

fn searched(inv: Invariant) {
    let seed = seed();
    let seeds = seeds();
    let plan = Plan {
        invariant: inv,
        seed,
        budget: BUDGET,
        bounds: Bounds::QUICK,
        space: Space::all(),
        seeds: &seeds,
    };
    let found = search(&plan, None);
    eprintln!("{}", report(&found, seed));
    verdict(
        &found.outcome,
        &format!(" against {}", found.strategy.describe()),
    );
}

#[test]
fn fairness_holds_against_the_searching_attacker() {
    searched(Invariant::Fairness);
}

#[test]
fn service_holds_against_the_searching_attacker() {
    searched(Invariant::Service);
}

#[test]
fn no_idle_gpu_against_the_searching_attacker() {
    searched(Invariant::Idle);
}

#[test]
fn logs_hold_against_the_searching_attacker() {
    searched(Invariant::Logs);
}

#[test]
fn no_state_left_by_the_searching_attacker() {
    searched(Invariant::State);
}

#[test]
fn queue_order_holds_against_the_searching_attacker() {
    searched(Invariant::Queue);
}

/// The harness itself: a search is the same strategy and the same harm
/// on every run from one seed (what makes the verdict the same on every
/// machine).
#[test]
fn a_search_finds_the_same_on_every_run() {
    let seeds = seeds();
    let plan = Plan {
        invariant: Invariant::Fairness,
        seed: 7,
        budget: 14,
        bounds: Bounds::QUICK,
        space: Space::all(),
        seeds: &seeds[..2],
    };
    let a = search(&plan, None);
    let b = search(&plan, None);
    assert_eq!(a.strategy, b.strategy);
    assert_eq!(a.outcome.harm, b.outcome.harm);
    assert_eq!(a.outcome.figures, b.outcome.figures);
}

/// The harness itself: with an attacker that does nothing, the victim
/// keeps its whole part of the GPU, answers come at once, the GPU never
/// idles while it waits, nothing is left behind and the queue keeps its
/// order: a measure that blamed the broker for the victim's own load
/// would fail here.
#[test]
fn an_attacker_that_does_nothing_harms_nobody() {
    for inv in [
        Invariant::Fairness,
        Invariant::Service,
        Invariant::Idle,
        Invariant::State,
        Invariant::Queue,
    ] {
        let o = evaluate(inv, &Strategy::default(), &Bounds::QUICK);
        assert!(
            o.harm <= inv.threshold() / 4.0,
            "{}: harm {} with no attacker: {}",
            inv.name(),
            o.harm,
            o.figures
        );
    }
}

/// The slow writer the search may play: its `Name` frames arrive whole,
/// a piece each time it comes on (the broker names the lease, so the
/// pieces were put together), and writers that leave partial frames in
/// the broker's buffers on every connection of a user leave the victim
/// served and its lines logged.
#[test]
fn slow_writers_frames_arrive_whole_and_leave_the_victim_served() {
    let trickle = |kib, bytes, members| Strategy {
        cohorts: vec![Cohort {
            members,
            period_ms: 2,
            ..cohort(Play::Trickle { kib, bytes })
        }],
    };
    let lines = log_of(Invariant::Service, &trickle(1, 64, 1), &Bounds::QUICK);
    assert!(
        lines.iter().any(|l| l.message == "lease named"),
        "no Name frame of 1 KiB sent 64 bytes at a time arrived whole: {:?}",
        lines.iter().map(|l| &l.text).collect::<Vec<_>>()
    );
    for s in [trickle(32, 1, 64), trickle(32, 16384, 64)] {
        holds(Invariant::Service, &s);
        holds(Invariant::Logs, &s);
    }
}
