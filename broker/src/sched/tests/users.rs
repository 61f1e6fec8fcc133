//! Fairness kept by users, in time (SPEC §2, invariant 8): a user's debt
//! and wake-up credit are the user's, whatever its connections and
//! processes do; `high` buys latency, never throughput. Each attack of the
//! fourth review first, then the properties, with generated attackers
//! beside a scripted victim.

use super::*;
use proptest::prelude::*;

/// Processes of a user outside any job form one unit, as the broker
/// makes them.
const UNIT: GroupId = 1 << 63;
const W: f64 = 50.0;

impl Sim {
    /// A process of `user`, outside any job, of `class`.
    fn user_proc(&mut self, id: ClientId, user: UserId, class: Priority) {
        self.add_class(id, W, None, class);
        self.s
            .set_unit(self.now, id, UNIT | user, None, None, Some((user, 1.0)));
        self.pump();
    }
}

/// The attack: sixteen connections of one user take turns (each, revoked,
/// goes idle and the next asks in its place), so each came back from idle
/// with a connection's wake-up credit and a sixteenth of its user's debt:
/// the victim kept 0.57 s of 8 s with the scheduler's state per
/// connection. One user's debt is one, however many connections carry it.
#[test]
fn sixteen_connections_taking_turns_get_one_users_part() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 2, N);
    sim.residual.insert(1, B);
    sim.start(1);
    let ring: Vec<ClientId> = (100..116).collect();
    for (i, &id) in ring.iter().enumerate() {
        sim.user_proc(id, 1, N);
        sim.then.insert(id, ring[(i + 1) % ring.len()]);
    }
    sim.start(ring[0]);
    sim.busy.remove(&ring[0]);
    let end = 8 * SEC;
    sim.run_until(end);
    let victim = sim.gpu_held(1) as f64 / end as f64;
    let attacker: Nanos = ring.iter().map(|&id| sim.gpu_held(id)).sum();
    let attacker = attacker as f64 / end as f64;
    assert!(
        victim > 0.47,
        "the victim held {victim:.3} of the GPU beside 16 connections taking turns ({attacker:.3})"
    );
    assert!(attacker < 0.53, "the rotating user held {attacker:.3}");
}

/// The attack: one user's `high` and `normal` processes beside another
/// user's `normal` one got 5.71 s against 1.87 s: priority bought
/// throughput. A user's time in `high` is charged to the user's part.
#[test]
fn a_users_high_and_normal_processes_get_one_users_part() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 1, Priority::High);
    sim.user_proc(2, 1, N);
    sim.user_proc(3, 2, N);
    for id in 1..=3 {
        sim.residual.insert(id, B);
        sim.start(id);
    }
    let end = 8 * SEC;
    sim.run_until(end);
    let share = |id| sim.gpu_held(id) as f64 / end as f64;
    let (attacker, victim) = (share(1) + share(2), share(3));
    assert!(
        (victim - 0.5).abs() < 0.03,
        "victim {victim:.3} beside a user's high and normal processes ({attacker:.3})"
    );
}

/// An interactive `high` process beside its own user's batch job and
/// another user's: every request gets the GPU at once, and the user still
/// gets one user's part.
#[test]
fn an_interactive_high_process_takes_the_gpu_at_once_beside_its_users_batch() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 1, N);
    sim.user_proc(2, 2, N);
    sim.user_proc(3, 1, Priority::High);
    for id in [1, 2] {
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(SEC);
    let (a0, b0) = (sim.gpu_held(1) + sim.gpu_held(3), sim.gpu_held(2));
    for k in 0..200 {
        let t = SEC + k * 20 * MS;
        sim.run_until(t);
        sim.s.acquire(t, 3);
        sim.pump();
        assert_eq!(sim.s.holder(), Some(3), "request {k} at {t} waited");
        sim.run_until(t + MS);
        sim.s.release(sim.now, 3);
        sim.s.drained(sim.now, 3);
        sim.pump();
    }
    let span = (sim.now - SEC) as f64;
    let a = (sim.gpu_held(1) + sim.gpu_held(3) - a0) as f64 / span;
    let b = (sim.gpu_held(2) - b0) as f64 / span;
    assert!((a - 0.5).abs() < 0.03, "user with the high process: {a:.3}");
    assert!((b - 0.5).abs() < 0.03, "other user: {b:.3}");
}

/// The attack (found by the red-team search): a user whose process works
/// 20 ms of every 40 ms beside a busy one. With a full slice of wake-up
/// credit at every return it took its whole on-time, half the GPU, where
/// the GPU's own time-slicer gives it half of the time it asks, a
/// quarter. Credit is earned at a tenth of the time away, so the victim
/// keeps over nine tenths of its part.
#[test]
fn a_user_working_half_of_each_period_gets_half_of_the_time_it_asks() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 1, N);
    sim.user_proc(2, 2, N);
    sim.residual.insert(2, B);
    sim.start(2);
    sim.residual.insert(1, B);
    let (from, end) = (SEC, 9 * SEC);
    sim.run_until(from);
    let (a0, v0) = (sim.gpu_held(1), sim.gpu_held(2));
    let mut t = from;
    while t < end {
        sim.run_until(t);
        sim.start(1);
        sim.run_until(t + 20 * MS);
        sim.busy.remove(&1);
        sim.s.release(sim.now, 1);
        sim.s.drained(sim.now, 1);
        sim.pump();
        t += 40 * MS;
    }
    sim.run_until(end);
    let span = (end - from) as f64;
    let a = (sim.gpu_held(1) - a0) as f64 / span;
    let v = (sim.gpu_held(2) - v0) as f64 / span;
    // Fair: half of each on-time, all of each off-time.
    let fair = 0.5 * 0.5 + 0.5;
    assert!(
        v > 0.9 * fair,
        "the busy victim held {v:.3} of the GPU (fair {fair:.2}) beside a 50% duty cycle ({a:.3})"
    );
}

/// An interactive `normal` process (1 ms every 20 ms) beside a busy user:
/// its time away earns it a slice of credit within a few requests, and
/// from then on every request takes the GPU at once.
#[test]
fn an_interactive_normal_process_takes_the_gpu_at_once_once_it_has_earned_credit() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 1, N);
    sim.user_proc(2, 2, N);
    sim.residual.insert(2, B);
    sim.start(2);
    sim.run_until(SEC);
    let mut waited = Vec::new();
    for k in 0..100 {
        let t = SEC + k * 20 * MS;
        sim.run_until(t);
        sim.s.acquire(t, 1);
        sim.pump();
        if sim.s.holder() != Some(1) {
            waited.push(k);
        }
        sim.run_until(t + MS);
        sim.s.release(sim.now, 1);
        sim.s.drained(sim.now, 1);
        sim.pump();
    }
    assert!(
        waited.iter().all(|&k| k < 10),
        "requests that did not take the GPU at once: {waited:?}"
    );
}

/// The attack (found by the red-team search): a `high` process of another
/// user, back with a slice of credit, took the GPU at once from the
/// victim's `high` process idle in its grant; the victim's next burst,
/// asked as its grant was being taken, waited for that credit to be spent
/// (24 ms). A `high` holder the GPU was taken from at once, that asks
/// again before letting go, is served within `wake` like one that woke.
#[test]
fn a_high_burst_asked_as_its_grant_is_taken_waits_no_more_than_a_wake() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.user_proc(1, 1, Priority::High);
    sim.user_proc(2, 2, Priority::High);
    sim.residual.insert(2, B);
    // The attacker works a little, then is away long enough to earn a
    // slice of credit, while the victim holds its grant idle.
    sim.start(2);
    sim.run_until(10 * MS);
    sim.busy.remove(&2);
    sim.s.release(sim.now, 2);
    sim.s.drained(sim.now, 2);
    sim.pump();
    sim.start(1);
    sim.run_until(400 * MS);
    assert_eq!(sim.s.holder(), Some(1));
    // Busy in the model: revoked, it asks again and then lets go.
    sim.start(2);
    assert_eq!(
        sim.s.holder(),
        Some(2),
        "the attacker's credit takes the GPU"
    );
    let asked = sim.now;
    let mut t = asked;
    while sim.s.holder() != Some(1) && t < asked + 100 * MS {
        t += 100 * US;
        sim.run_until(t);
    }
    assert!(
        t - asked <= SchedConfig::default().wake,
        "the victim's burst waited {} us",
        (t - asked) / US
    );
}

/// The same when the grant is taken not by a waker behind it but for a
/// newcomer once the victim's run alone is paid for, at once or at the
/// end of the slice it still had: the attacker away just long enough for
/// credit short of a preemption (two `high` connections of one attacker
/// taking turns kept the victim's burst waiting 14.7 ms for that credit;
/// when the victim's run alone ended 12 µs after the waker came, 20 ms).
#[test]
fn a_high_burst_asked_as_its_grant_is_taken_for_a_newcomer_waits_no_more_than_a_wake() {
    // When the attacker comes back: 40 ms after the victim's grant (its
    // run alone is paid for), or 19.9 ms after (it ends with its slice).
    for back in [40 * MS, 19_900 * US] {
        let mut sim = Sim::new(SchedConfig::default());
        sim.user_proc(1, 1, Priority::High);
        sim.user_proc(2, 2, Priority::High);
        sim.residual.insert(2, B);
        sim.start(2);
        sim.run_until(10 * MS);
        sim.busy.remove(&2);
        sim.s.release(sim.now, 2);
        sim.s.drained(sim.now, 2);
        sim.pump();
        sim.start(1);
        sim.run_until(10 * MS + back);
        assert_eq!(sim.s.holder(), Some(1));
        sim.start(2);
        let asked = sim.now;
        let mut t = asked;
        while sim.s.holder() != Some(2) && t < asked + 100 * MS {
            t += 10 * US;
            sim.run_until(t);
        }
        assert!(t - asked <= MS, "back after {back} ns: the attacker waited");
        // Busy in the model: revoked, the victim asks again and then
        // lets go.
        let mut t = sim.now;
        let taken = t;
        while sim.s.holder() != Some(1) && t < taken + 100 * MS {
            t += 100 * US;
            sim.run_until(t);
        }
        assert!(
            t - taken <= SchedConfig::default().wake,
            "back after {back} ns: the victim's burst waited {} us",
            (t - taken) / US
        );
    }
}

/// Two busy users of one class hand the GPU over at the end of slices,
/// whatever their class: a holder owes another user's waker the GPU
/// within a wake period only when it woke (a `high` holder made to yield
/// and then asking again as a waker had two busy `high` users hand over
/// every 2 ms).
#[test]
fn two_busy_users_hand_over_at_the_end_of_slices() {
    for class in [Priority::High, N] {
        let mut sim = Sim::new(SchedConfig::default());
        sim.user_proc(1, 1, class);
        sim.user_proc(2, 2, class);
        for id in [1, 2] {
            sim.residual.insert(id, B);
            sim.start(id);
        }
        let end = 2 * SEC;
        sim.run_until(end);
        let slices = (end / SchedConfig::default().timeslice) as usize;
        for id in [1, 2] {
            let n = sim.grants_to(id).len();
            assert!(
                n <= slices / 2 + 2,
                "{class:?}: {n} grants to {id} in {} slices",
                slices
            );
        }
    }
}

/// The bench's contending rows in virtual time, with no host to delay
/// anyone: `n` processes of one user always ask (each holds `hold`, lets
/// go, and asks again at once; a revoke is answered after `answer`), and
/// another user's process asks every 20 ms and holds 100 us. Returns how
/// long each of its requests waited for its grant.
fn another_users_waits(n: u64, hold: Nanos, answer: Nanos, end: Nanos) -> Vec<Nanos> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Ev {
        Release(ClientId),
        Acquire(ClientId),
    }
    let mut s = Scheduler::new(SchedConfig::default());
    let other: ClientId = n;
    for id in 0..=n {
        let user = if id == other { 2 } else { 1 };
        s.add_client(0, id, W, None, N);
        s.set_unit(0, id, UNIT | user, None, None, Some((user, 1.0)));
    }
    let mut due: BinaryHeap<Reverse<(Nanos, Ev)>> = (0..n)
        .map(|id| Reverse((0, Ev::Acquire(id))))
        .chain((1..end / (20 * MS)).map(|k| Reverse((k * 20 * MS + 7 * US, Ev::Acquire(other)))))
        .collect();
    let (mut held, mut asked, mut waits) = (BTreeSet::new(), None, Vec::new());
    let mut now = 0;
    loop {
        while let Some(a) = s.poll_action() {
            match a {
                Action::Grant { client, .. } if held.insert(client) => {
                    if client == other {
                        waits.extend(asked.take().map(|t| now - t));
                    }
                    let hold = if client == other { 100 * US } else { hold };
                    due.push(Reverse((now + hold, Ev::Release(client))));
                }
                Action::Grant { .. } => {}
                Action::Revoke { client, .. } => {
                    due.push(Reverse((now + answer, Ev::Release(client))));
                }
            }
        }
        let next = due.peek().map(|Reverse((t, _))| *t);
        let timer = s.next_timeout().filter(|&t| next.is_none_or(|n| t < n));
        now = match timer.or(next) {
            Some(t) if t <= end => t,
            _ => return waits,
        };
        if timer.is_some() {
            s.handle_timeout(now);
            continue;
        }
        match due.pop().expect("next").0.1 {
            Ev::Release(id) if held.remove(&id) => {
                s.release(now, id);
                s.drained(now, id);
                if id != other {
                    due.push(Reverse((now, Ev::Acquire(id))));
                }
            }
            Ev::Release(_) => {}
            Ev::Acquire(id) => {
                if id == other {
                    asked = Some(now);
                }
                s.acquire(now, id);
            }
        }
    }
}

/// Another user's request beside a user's many processes that always
/// ask (bench section 4's rows) waits for the holder's quantum at most
/// (`wake`, as the GPU's time-slicer would), however many processes ask
/// and however late the holder answers: with holders that let go after
/// 100 us it waits out the rest of that hold, never the line of 64 or
/// 1,000. The bench's own figure, 0.5 to 5 ms on a 2-core machine, adds
/// the host's: how late it wakes the broker, the holder and the client.
#[test]
fn another_users_request_waits_a_quantum_at_most_whatever_the_population() {
    let wake = SchedConfig::default().wake;
    for n in [64, 1000] {
        for (hold, answer) in [(100 * US, 0), (3 * MS, 5 * MS), (30 * MS, 5 * MS)] {
            let waits = another_users_waits(n, hold, answer, SEC / 2);
            assert_eq!(waits.len(), 24, "{n} holding {hold} ns: requests served");
            let most = waits.iter().max().copied().unwrap_or(0);
            assert!(
                most <= hold.min(wake),
                "beside {n} processes holding {hold} ns and answering a revoke after \
                 {answer} ns another user waited {most} ns"
            );
        }
    }
}

/// What an attacker's connection does next.
#[derive(Debug, Clone, Copy)]
enum Move {
    /// Opens (or re-registers) a connection of this class.
    Open(u8, Priority),
    Close(u8),
    /// Asks for the GPU with work to do: on a revoke it asks again.
    Work(u8),
    /// Asks, and on a revoke hands over to another of its connections.
    Pass(u8, u8),
    /// Stops launching: releases (with its work drained).
    Stop(u8),
    /// Releases without ever saying its work drained.
    Leave(u8),
    Wait(Nanos),
}

fn moves() -> impl Strategy<Value = Vec<Move>> {
    let conn = 0..12u8;
    let class = proptest::sample::select(Priority::ALL.to_vec());
    let mv = prop_oneof![
        2 => (conn.clone(), class).prop_map(|(c, k)| Move::Open(c, k)),
        1 => conn.clone().prop_map(Move::Close),
        3 => conn.clone().prop_map(Move::Work),
        2 => (conn.clone(), conn.clone()).prop_map(|(a, b)| Move::Pass(a, b)),
        2 => conn.clone().prop_map(Move::Stop),
        1 => conn.clone().prop_map(Move::Leave),
        4 => prop_oneof![0..2 * MS, 0..30 * MS, 0..300 * MS].prop_map(Move::Wait),
    ];
    prop::collection::vec(mv, 1..120)
}

/// The victim is client 1 of user 2, busy from the start; the attacker's
/// connections are clients 100.. of user 1, which play `moves` in a loop
/// until `end`. Returns the victim's time holding the GPU.
fn play(cfg: SchedConfig, moves: &[Move], end: Nanos) -> (Sim, Nanos) {
    let mut sim = Sim::new(cfg);
    sim.user_proc(1, 2, N);
    sim.residual.insert(1, B);
    sim.start(1);
    let id = |c: u8| 100 + ClientId::from(c);
    let mut open = BTreeSet::new();
    'outer: loop {
        for &m in moves {
            if sim.now >= end {
                break 'outer;
            }
            match m {
                Move::Open(c, k) => {
                    sim.user_proc(id(c), 1, k);
                    sim.residual.insert(id(c), B);
                    open.insert(c);
                }
                Move::Close(c) => {
                    sim.s.remove_client(sim.now, id(c));
                    sim.busy.remove(&id(c));
                    sim.then.remove(&id(c));
                    open.remove(&c);
                    sim.pump();
                }
                Move::Work(c) if open.contains(&c) => {
                    sim.then.remove(&id(c));
                    sim.start(id(c));
                }
                Move::Pass(a, b) if open.contains(&a) && open.contains(&b) && a != b => {
                    sim.busy.remove(&id(a));
                    sim.then.insert(id(a), id(b));
                    sim.s.acquire(sim.now, id(a));
                    sim.s.drained(sim.now, id(a));
                    sim.pump();
                }
                Move::Stop(c) | Move::Leave(c) if open.contains(&c) => {
                    sim.busy.remove(&id(c));
                    sim.then.remove(&id(c));
                    sim.s.release(sim.now, id(c));
                    if matches!(m, Move::Stop(_)) {
                        sim.s.drained(sim.now, id(c));
                    }
                    sim.pump();
                }
                Move::Wait(d) => sim.run_until((sim.now + d).min(end)),
                _ => {}
            }
        }
        // A script without waits still lets time pass.
        sim.run_until((sim.now + MS).min(end));
    }
    sim.run_until(end);
    let held = sim.gpu_held(1);
    (sim, held)
}

/// The slack of the property below: what an attacker can borrow from a
/// victim over any horizon, not per connection nor per event: its user's
/// credit (a bank keeps at most a slice), a `high` warp (a slice) and the
/// slice a holder may run ahead of its deadline before it is revoked, and
/// a slice to spare for the drains behind revokes. (The worst of
/// 800 random attackers came within 3 ms of half the GPU, of ~1,000
/// busy/idle cycles timed in each class within 14 ms.)
fn slack(cfg: &SchedConfig) -> Nanos {
    4 * cfg.timeslice
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever one attacker user does with however many connections
    /// (opening, closing, idling, handing over between connections,
    /// asking in any class, releasing without a drain report), a busy
    /// victim user keeps at least half the GPU over the horizon, less a
    /// slack that does not grow with the horizon or the connections.
    #[test]
    fn a_busy_users_part_holds_whatever_another_user_does(
        moves in moves(),
        high_share in prop_oneof![Just(0.5), Just(1.0)],
    ) {
        let cfg = SchedConfig { high_share, ..SchedConfig::default() };
        let end = 4 * SEC;
        let (_, held) = play(cfg, &moves, end);
        prop_assert!(
            held + slack(&cfg) >= end / 2,
            "victim held {held} ns of {end}, moves {moves:?}"
        );
    }

    /// However a user mixes `high` and `normal` busy processes, it gets
    /// one user's part beside another user's busy processes, whatever the
    /// class's ceiling: priority buys latency, never throughput.
    #[test]
    fn high_does_not_raise_a_users_share(
        classes in prop::collection::vec(
            prop_oneof![Just(Priority::High), Just(N)], 1..5),
        others in 1..4usize,
        high_share in prop_oneof![Just(0.5), Just(1.0)],
    ) {
        let cfg = SchedConfig { high_share, ..SchedConfig::default() };
        let mut sim = Sim::new(cfg);
        let mut mine = Vec::new();
        for (i, &k) in classes.iter().enumerate() {
            let id = 10 + i as ClientId;
            sim.user_proc(id, 1, k);
            mine.push(id);
        }
        let theirs: Vec<ClientId> = (0..others).map(|i| 50 + i as ClientId).collect();
        for &id in &theirs {
            sim.user_proc(id, 2, N);
        }
        for &id in mine.iter().chain(&theirs) {
            sim.residual.insert(id, B);
            sim.start(id);
        }
        let end = 8 * SEC;
        sim.run_until(end);
        let part = |ids: &[ClientId]| {
            ids.iter().map(|&id| sim.gpu_held(id)).sum::<Nanos>() as f64 / end as f64
        };
        let (a, b) = (part(&mine), part(&theirs));
        prop_assert!(a < 0.52, "{classes:?} got {a:.3} beside {others} normal ({b:.3})");
        prop_assert!(b > 0.48, "{others} normal got {b:.3} beside {classes:?} ({a:.3})");
    }
}
