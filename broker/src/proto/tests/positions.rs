//! What waiting runs are told of their place: exact up to 10, within a
//! tenth beyond (told at most once a `retell_after` its place there), and
//! a message only when it moved that far. Before, every
//! change of the queue told each request behind it its new place: a queue
//! of 1,000 with 100 requests a second arriving and leaving sent its
//! waiting runs about 720,000 updates in 14 s.

use super::*;

use crate::proto::ledger::POSITION_TICK;
use crate::queue::{FAR_PER_WALK, RETELL_EVERY, retell_after};
use gpufrac_common::wire::{EXACT_POSITIONS, position_worth_telling};

/// The places a connection was told since the last look.
fn told(t: &mut T, id: ConnId) -> Vec<u32> {
    t.recv(id)
        .into_iter()
        .filter_map(|m| match m {
            ServerMsg::Queued { position, .. } => Some(position),
            _ => None,
        })
        .collect()
}

/// A queue of `N` runs behind a holder of the only GPU churns: each round
/// one request leaves (the head, or one from the middle) and a new one
/// arrives at the back. Each run's last message says its place exactly
/// up to 10 after every round, and within a tenth beyond once its
/// `retell_after` passed (and the walks reached it, `FAR_PER_WALK` a
/// walk); beyond 10, a run is told at most once a `retell_after` its
/// place. Since a place only falls here, a run is told at most once per
/// place up to 10 and once per step of a tenth beyond (the places a
/// request at 300 is told on its way to the front: about 48), where
/// before it was told every place it passed. No round tells more than
/// `FAR_PER_WALK` runs beyond the tenth place, though all `N` arrived at
/// once and fall due together.
#[test]
fn a_churning_queue_tells_each_run_its_place_only_when_it_moved_a_tenth() {
    const N: usize = 300;
    let mut cfg = cfg();
    cfg.budgets.queued = 4 * N;
    cfg.budgets.leases = 4 * N;
    cfg.budgets.connections = 4 * N;
    let mut t = T::new(cfg, &[16 * GIB]);
    let p = t.spawn(1);
    let holder = t.connect_as(p, ALICE);
    t.lease(holder, 0, 16 * GIB, false);
    t.turn();
    assert!(leased(&t.recv(holder)).is_some());
    // The runs in queue order, each with what it was told so far and
    // when it was last told.
    type Run = (ConnId, Vec<u32>, Nanos);
    let mut line: Vec<Run> = Vec::new();
    let arrive = |t: &mut T, line: &mut Vec<Run>| {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.lease(c, 0, GIB, false);
        line.push((c, Vec::new(), t.now));
    };
    for _ in 0..N {
        arrive(&mut t, &mut line);
    }
    t.advance(POSITION_TICK);
    for (c, said, _) in &mut line {
        said.extend(told(&mut t, *c));
    }
    let mut gone: Vec<Vec<u32>> = Vec::new();
    let mut worst = 0;
    for round in 0..2 * N {
        // The head, or one from the middle, leaves.
        let k = if round % 2 == 0 {
            0
        } else {
            (round * 7) % line.len()
        };
        let (c, said, _) = line.remove(k);
        t.b.hangup(c);
        gone.push(said);
        arrive(&mut t, &mut line);
        // Places are told once a tick: a round is one.
        t.advance(POSITION_TICK);
        let mut sent = 0;
        for (place, (c, said, at)) in line.iter_mut().enumerate() {
            let now = told(&mut t, *c);
            let place = place as u32 + 1;
            sent += now.len();
            if !now.is_empty() {
                // (Read a round after the message went, at most.)
                assert!(
                    place <= EXACT_POSITIONS
                        || said.is_empty()
                        || t.now + POSITION_TICK >= *at + retell_after(place),
                    "round {round}: a run at place {place} told again after {} ns",
                    t.now - *at
                );
                *at = t.now;
            }
            said.extend(now);
            let last = said.last().copied();
            // Up to 10, exact at every tick; beyond, within a tenth once
            // a `retell_after` has passed, and the walks that tell at most
            // `FAR_PER_WALK` each have reached it.
            let spread = N.div_ceil(FAR_PER_WALK) as Nanos * POSITION_TICK;
            let late = place <= EXACT_POSITIONS || t.now >= *at + retell_after(place) + spread;
            assert!(
                !late || !position_worth_telling(last, place),
                "round {round}: a run at place {place} last told {last:?}"
            );
        }
        worst = worst.max(sent);
    }
    // Each place told to a run differs from the one before by a step.
    let bound = |first: u32| {
        let tenths = (f64::from(first) / f64::from(EXACT_POSITIONS)).ln() / 1.1f64.ln();
        EXACT_POSITIONS as usize + tenths.max(0.0).ceil() as usize + 1
    };
    for said in gone.iter().chain(line.iter().map(|(_, s, _)| s)) {
        if let Some(&first) = said.first() {
            assert!(
                said.len() <= bound(first),
                "told {} places starting at {first}: {said:?}",
                said.len()
            );
        }
    }
    eprintln!("figure: at most {worst} messages in one round of {N} waiting");
    assert!(
        worst <= FAR_PER_WALK + EXACT_POSITIONS as usize + 1,
        "{worst} messages in one round of {N} waiting"
    );
}

/// A new request is told its place at once (its token with it): a
/// fraction without a walk, as the last; any other by a walk. Places that
/// moved are told once a `POSITION_TICK`, not at each change.
#[test]
fn a_new_request_is_told_at_once_and_moved_ones_once_a_tick() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let holder = t.connect_as(p, ALICE);
    t.lease(holder, 0, 16 * GIB, false);
    t.turn();
    assert!(leased(&t.recv(holder)).is_some());
    let mut line = Vec::new();
    for (k, gpus, mem) in [(1, 0, GIB), (2, 0, GIB), (3, 1, 0), (4, 0, GIB)] {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.lease(c, gpus, mem, false);
        t.turn();
        assert_eq!(told(&mut t, c), [k], "arrival {k} told at once");
        line.push(c);
    }
    // The head leaves: the others moved up, and hear so at the tick.
    t.b.hangup(line.remove(0));
    t.turn();
    assert!(line.iter().all(|&c| told(&mut t, c).is_empty()));
    t.advance(POSITION_TICK);
    let now: Vec<Vec<u32>> = line.iter().map(|&c| told(&mut t, c)).collect();
    assert_eq!(now, [vec![1], vec![2], vec![3]]);
}

/// Beyond the tenth place a run is told at most once every 5 s, and 50 ms
/// per place beyond the 100th: a queue whose every place moves tells its
/// far places a number of times a second that grows with the log of its
/// length (about 64 for a thousand, 110 for ten thousand), where one
/// message per run every 5 s grew with the length (200 and 2,000).
#[test]
fn far_places_are_told_at_a_rate_that_grows_with_the_log_of_the_queue() {
    assert_eq!(retell_after(EXACT_POSITIONS + 1), RETELL_EVERY);
    assert_eq!(retell_after(100), RETELL_EVERY);
    assert_eq!(retell_after(1000), 10 * RETELL_EVERY);
    let per_s = |n: u32| -> f64 {
        (EXACT_POSITIONS + 1..=n)
            .map(|p| 1e9 / retell_after(p) as f64)
            .sum()
    };
    let (thousand, ten_thousand) = (per_s(1000), per_s(10_000));
    eprintln!("figure: {thousand:.0} and {ten_thousand:.0} far places told a second");
    assert!((60.0..70.0).contains(&thousand), "{thousand}");
    assert!(ten_thousand - thousand < 50.0, "{ten_thousand}");
}
