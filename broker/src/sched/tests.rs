use super::*;
use std::collections::{BTreeMap as Map, BTreeSet};

const SEC: Nanos = 1000 * MS;
const N: Priority = Priority::Normal;

fn drain(s: &mut Scheduler) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn grant(client: ClientId, grant: GrantId, slice: Option<Nanos>, bound: Nanos) -> Action {
    Action::Grant {
        client,
        grant,
        slice,
        bound,
        // A slice means a waiter of the holder's class.
        waiters: slice.is_some(),
    }
}

fn grant_w(client: ClientId, grant: GrantId, bound: Nanos) -> Action {
    Action::Grant {
        client,
        grant,
        slice: None,
        bound,
        waiters: true,
    }
}

fn revoke(client: ClientId, grant: GrantId) -> Action {
    Action::Revoke { client, grant }
}

fn status_of(s: &Scheduler, now: Nanos, id: ClientId) -> ClientStatus {
    s.status(now)
        .into_iter()
        .find(|c| c.client == id)
        .expect("known client")
}

const B: Nanos = 250 * US;
/// The bound of a burst grant's first slice.
const BB: Nanos = B * BURST_BOUND;

/// Virtual-time model of shims: a busy client always has work, so on a
/// revoke it asks again and releases at once; its queued work then
/// drains for `residual` (its kernel length, or the in-flight bound);
/// a stuck client ignores revokes.
struct Sim {
    s: Scheduler,
    now: Nanos,
    residual: Map<ClientId, Nanos>,
    busy: BTreeSet<ClientId>,
    stuck: BTreeSet<ClientId>,
    drains: Vec<(Nanos, ClientId)>,
    log: Vec<(Nanos, Action)>,
}

impl Sim {
    fn new(cfg: SchedConfig) -> Self {
        Sim {
            s: Scheduler::new(cfg),
            now: 0,
            residual: Map::new(),
            busy: BTreeSet::new(),
            stuck: BTreeSet::new(),
            drains: Vec::new(),
            log: Vec::new(),
        }
    }

    fn add(&mut self, id: ClientId, weight: f64, limit: Option<f64>) {
        self.add_class(id, weight, limit, N);
    }

    fn add_class(&mut self, id: ClientId, weight: f64, limit: Option<f64>, p: Priority) {
        self.s.add_client(self.now, id, weight, limit, p);
        self.pump();
    }

    fn start(&mut self, id: ClientId) {
        self.busy.insert(id);
        self.s.acquire(self.now, id);
        // What it launched with its request has run.
        self.s.drained(self.now, id);
        self.pump();
    }

    fn pump(&mut self) {
        while let Some(a) = self.s.poll_action() {
            self.log.push((self.now, a));
            if let Action::Revoke { client, .. } = a {
                if self.stuck.contains(&client) {
                    continue;
                }
                if self.busy.contains(&client) {
                    self.s.acquire(self.now, client);
                }
                self.s.release(self.now, client);
                let r = self.residual.get(&client).copied().unwrap_or(0);
                self.drains.push((self.now + r, client));
            }
        }
    }

    fn run_until(&mut self, end: Nanos) {
        for _ in 0..10_000_000 {
            self.pump();
            let ev = self.drains.iter().map(|e| e.0).min();
            let t = [ev, self.s.next_timeout()].into_iter().flatten().min();
            match t {
                Some(t) if t <= end => {
                    assert!(t >= self.now, "time went backwards");
                    self.now = t;
                    let (due, later): (Vec<_>, Vec<_>) = self.drains.iter().partition(|e| e.0 <= t);
                    self.drains = later;
                    for (_, c) in due {
                        self.s.drained(t, c);
                        self.pump();
                    }
                    if self.s.next_timeout().is_some_and(|x| x <= t) {
                        self.s.handle_timeout(t);
                    }
                }
                _ => {
                    self.now = end;
                    self.s.handle_timeout(end);
                    self.pump();
                    return;
                }
            }
        }
        panic!("simulation did not make progress");
    }

    fn gpu(&self, id: ClientId) -> Nanos {
        status_of(&self.s, self.now, id).gpu_time
    }

    /// New grants (not updates) to `id`: time and initial slice.
    fn grants_to(&self, id: ClientId) -> Vec<(Nanos, Option<Nanos>)> {
        let mut seen = BTreeSet::new();
        self.log
            .iter()
            .filter_map(|&(t, a)| match a {
                Action::Grant {
                    client,
                    grant,
                    slice,
                    ..
                } if client == id && seen.insert(grant) => Some((t, slice)),
                _ => None,
            })
            .collect()
    }
}

fn assert_shares(weights: &[f64], residual: Nanos) {
    let mut sim = Sim::new(SchedConfig::default());
    for (i, &w) in weights.iter().enumerate() {
        sim.add(i as ClientId, w, None);
        sim.residual.insert(i as ClientId, residual);
    }
    for i in 0..weights.len() {
        sim.start(i as ClientId);
    }
    let end = 20 * SEC;
    sim.run_until(end);
    let sum: f64 = weights.iter().sum();
    for (i, &w) in weights.iter().enumerate() {
        let share = sim.gpu(i as ClientId) as f64 / end as f64;
        let want = w / sum;
        assert!(
            (share - want).abs() < 0.01,
            "client {i}: share {share:.4}, want {want:.4} (weights {weights:?}, residual {residual})"
        );
    }
    // The GPU never sat idle while everyone had work.
    let total: Nanos = (0..weights.len()).map(|i| sim.gpu(i as ClientId)).sum();
    assert!(total >= end - MS, "total charged {total}");
}

#[test]
fn equal_clients_converge_to_half() {
    assert_shares(&[50.0, 50.0], B);
}

/// Ten processes of one unit (a job, or a user) split one share: a lone
/// unit beside them still gets half the GPU.
#[test]
fn a_unit_of_ten_gets_one_share() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(0, 100.0, None);
    sim.s.set_group(0, 0, 500, None, None);
    for id in 1..=10 {
        sim.add(id, 100.0, None);
        sim.s.set_group(0, id, 600, None, None);
        sim.residual.insert(id, B);
    }
    sim.residual.insert(0, B);
    for id in 0..=10 {
        sim.start(id);
    }
    let end = 20 * SEC;
    sim.run_until(end);
    let lone = sim.gpu(0) as f64 / end as f64;
    assert!((lone - 0.5).abs() < 0.02, "lone unit got {lone:.3}");
    // An imposed unit weight (a lease's --gpu-compute) sets the split.
    let mut sim = Sim::new(SchedConfig::default());
    for id in 0..4 {
        sim.add(id, 50.0, None);
        sim.s.set_group(
            0,
            id,
            if id == 0 { 700 } else { 800 },
            Some(if id == 0 { 75.0 } else { 25.0 }),
            None,
        );
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    let first = sim.gpu(0) as f64 / end as f64;
    assert!((first - 0.75).abs() < 0.02, "the 75% unit got {first:.3}");
}

/// A process that disconnects and reconnects every 250 ms comes back
/// into its unit at the unit's virtual time and usage history, not with
/// a fresh start.
#[test]
fn reconnecting_does_not_reset_a_units_history() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 50.0, None);
    sim.s.set_group(0, 1, 900, None, None);
    sim.residual.insert(1, B);
    sim.start(1);
    let mut id = 100;
    sim.add(id, 50.0, None);
    sim.s.set_group(0, id, 901, None, None);
    sim.start(id);
    let end = 20 * SEC;
    while sim.now + 250 * MS < end {
        let t = sim.now + 250 * MS;
        sim.run_until(t);
        sim.s.remove_client(t, id);
        id += 1;
        sim.add(id, 50.0, None);
        sim.s.set_group(t, id, 901, None, None);
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    let victim = sim.gpu(1) as f64 / end as f64;
    assert!(
        victim > 0.47,
        "the steady process got {victim:.3} beside a reconnecting one"
    );
}

/// A limit's usage history also survives a reconnect within the unit.
#[test]
fn a_limit_survives_reconnects() {
    let mut sim = Sim::new(SchedConfig::default());
    let mut id = 1;
    sim.add(id, 50.0, Some(0.2));
    sim.s.set_group(0, id, 42, None, None);
    sim.residual.insert(id, B);
    sim.start(id);
    let end = 10 * SEC;
    let mut used = 0;
    while sim.now + 100 * MS < end {
        let t = sim.now + 100 * MS;
        sim.run_until(t);
        used += sim.gpu(id);
        sim.s.remove_client(t, id);
        id += 1;
        sim.add(id, 50.0, Some(0.2));
        sim.s.set_group(t, id, 42, None, None);
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    used += sim.gpu(id);
    let share = used as f64 / end as f64;
    assert!(
        share < 0.23,
        "a 20% limit reconnecting every 100 ms used {share:.3}"
    );
}

#[test]
fn weights_70_30_converge() {
    assert_shares(&[70.0, 30.0], B);
}

#[test]
fn three_clients_1_1_2_converge() {
    assert_shares(&[1.0, 1.0, 2.0], B);
}

/// 120 ms kernels: every handover leaves a whole kernel running beside
/// the next holder's. Charging the GPU time really used keeps 70/30.
#[test]
fn weights_hold_when_kernels_outlive_the_handover() {
    assert_shares(&[70.0, 30.0], 120 * MS);
    assert_shares(&[70.0, 30.0], 6 * MS);
    assert_shares(&[1.0, 1.0, 2.0], 120 * MS);
}

#[test]
fn achieved_and_target_reported() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 70.0, None);
    sim.add(2, 30.0, None);
    sim.add(3, 1.0, None);
    sim.start(1);
    sim.start(2);
    sim.run_until(5 * SEC);
    let st = sim.s.status(sim.now);
    assert!((st[0].achieved - 0.7).abs() < 0.03, "{st:?}");
    assert!((st[1].achieved - 0.3).abs() < 0.03, "{st:?}");
    assert!((st[0].target - 0.7).abs() < 1e-9);
    assert!((st[1].target - 0.3).abs() < 1e-9);
    assert_eq!(st[2].state, ClientState::Idle);
    assert_eq!(st[2].target, 0.0);
    assert_eq!(st[2].achieved, 0.0);
}

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
        status_of(&s, 30 * MS, 1).gpu_time,
        status_of(&s, 30 * MS, 2).gpu_time,
    );
    s.drained(32 * MS, 1);
    let after = (
        status_of(&s, 32 * MS, 1).gpu_time,
        status_of(&s, 32 * MS, 2).gpu_time,
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
    // 1 waits again: 2's grant becomes a contended slice.
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(20 * MS), BB)]);
    // Past its first slice, 2 is behind by 1's solo second: it keeps the
    // GPU, now bounded.
    s.handle_timeout(2 * SEC + 20 * MS);
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(20 * MS), B)]);
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

#[test]
fn a_waker_ahead_of_the_holder_waits_a_quantum_then_the_order_decides() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, N);
    // 2 runs alone for a second, then 1 runs: 2 is far ahead.
    s.acquire(0, 2);
    s.release(SEC, 2);
    s.drained(SEC, 2);
    s.acquire(SEC, 1);
    drain(&mut s);
    s.acquire(SEC + MS, 2);
    // Not preempted: 2's credit is one slice, and it is ahead by more.
    // But it waits no longer than the GPU's quantum for its turn to be
    // weighed (1 is still in its first burst: the burst's bound).
    assert_eq!(drain(&mut s), vec![grant(1, 2, Some(2 * MS), BB)]);
    assert_eq!(s.holder(), Some(1));
    // Then 1, far behind, keeps the GPU for most of a slice more.
    s.handle_timeout(SEC + 3 * MS);
    let a = drain(&mut s);
    assert!(
        matches!(a[..], [Action::Grant { client: 1, grant: 2, slice: Some(s), .. }] if s >= 10 * MS),
        "{a:?}"
    );
    assert_eq!(s.holder(), Some(1));
}

#[test]
fn high_takes_the_gpu_at_once_and_keeps_it_while_it_has_work() {
    // Without the class's bound (`high_share` 1.0), as it was before it.
    let unbounded = SchedConfig {
        high_share: 1.0,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(unbounded);
    s.add_client(0, 1, 1.0, None, N);
    s.add_client(0, 2, 1.0, None, Priority::High);
    s.acquire(0, 1);
    drain(&mut s);
    s.handle_timeout(5 * SEC);
    drain(&mut s);
    s.acquire(5 * SEC, 2);
    // No other high client: nothing can take the GPU from 2, no bound.
    assert_eq!(drain(&mut s), vec![revoke(1, 1), grant(2, 2, None, 0)]);
    s.acquire(5 * SEC, 1);
    s.release(5 * SEC, 1);
    // A normal waiter does not contend with a high holder: open-ended,
    // but it is told someone waits, so it hands back when idle.
    assert_eq!(drain(&mut s), vec![grant_w(2, 2, 0)]);
    s.handle_timeout(10 * SEC);
    assert!(drain(&mut s).is_empty());
    assert_eq!(s.holder(), Some(2));
    s.release(10 * SEC, 2);
    assert_eq!(drain(&mut s), vec![grant(1, 3, None, B)]);
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
    assert!((s1 + s2 - 0.5).abs() < 0.02, "high got {s1} + {s2}");
    assert!((s3 - 0.5).abs() < 0.02, "normal got {s3}");
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
    let held = victim.total_held;
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

/// A job's `--gpu-limit` bounds its members together, however many there
/// are: idle members neither dilute it nor add to it.
#[test]
fn a_units_limit_holds_for_its_members_together() {
    for (busy, idle) in [(1, 0), (1, 9), (3, 0), (2, 200)] {
        let mut sim = Sim::new(SchedConfig::default());
        let n = busy + idle;
        for id in 0..n {
            sim.add(id, 50.0, None);
            sim.s.set_group(0, id, 77, None, Some(0.3));
            sim.residual.insert(id, B);
        }
        for id in 0..busy {
            sim.start(id);
        }
        let end = 10 * SEC;
        sim.run_until(end);
        let total: Nanos = (0..n).map(|i| sim.gpu(i)).sum();
        let share = total as f64 / end as f64;
        assert!(
            (share - 0.3).abs() < 0.02,
            "{busy} busy and {idle} idle members got {share} of a 30% limit"
        );
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

#[test]
fn shares_apply_within_a_class() {
    // Without the class's bound (`high_share` 1.0), as it was before it.
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
    sim.run_until(10 * SEC);
    let s1 = sim.gpu(1) as f64 / (10 * SEC) as f64;
    let s2 = sim.gpu(2) as f64 / (10 * SEC) as f64;
    assert!((s1 - 0.7).abs() < 0.01, "{s1}");
    assert!((s2 - 0.3).abs() < 0.01, "{s2}");
    assert!(sim.gpu(3) < 10 * MS, "{}", sim.gpu(3));
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
    assert_eq!(status_of(&s, SEC + 5 * MS, 1).total_held, 5 * MS);
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
        vec![grant(1, 1, None, BB), grant(1, 1, Some(2 * MS), BB)]
    );
    s.remove_client(10 * MS, 1);
    // 3 is still waiting behind 2, so 2's grant is a contended slice.
    assert_eq!(drain(&mut s), vec![grant(2, 2, Some(20 * MS), BB)]);
    assert_eq!(s.holder(), Some(2));
    assert_eq!(s.state(1), None);
    // A waiting client that disconnects just leaves the queue; 2 now
    // has nobody waiting.
    s.remove_client(11 * MS, 3);
    assert_eq!(
        drain(&mut s),
        vec![Action::Grant {
            client: 2,
            grant: 2,
            slice: Some(19 * MS),
            bound: 0,
            waiters: false
        }]
    );
    // 2 is alone: past its burst, still no bound.
    s.handle_timeout(30 * MS);
    assert_eq!(drain(&mut s), vec![grant(2, 2, None, 0)]);
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
    assert!(st.gpu_time.abs_diff(want) < MS, "{} vs {want}", st.gpu_time);
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
    assert_eq!(st.gpu_time, 110 * MS);
}

#[test]
fn limit_alone_holds_its_share_of_each_window() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, Some(0.3));
    sim.start(1);
    let mut saw_idle = false;
    for tenth in 10..=100 {
        sim.run_until(tenth * SEC / 10);
        let a = status_of(&sim.s, sim.now, 1).achieved;
        assert!(
            (0.285..=0.305).contains(&a),
            "window ending {tenth}/10 s: {a}"
        );
        if sim.s.holder().is_none() {
            saw_idle = true;
            assert!(sim.s.next_timeout().is_some());
        }
    }
    assert!(saw_idle, "an over-budget lone client leaves the GPU idle");
    assert!(sim.grants_to(1).iter().all(|g| g.1.is_some()));
    let share = sim.gpu(1) as f64 / sim.now as f64;
    assert!((share - 0.3).abs() < 0.005, "{share}");
}

#[test]
fn limit_caps_a_client_under_contention_too() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, Some(0.2));
    sim.add(2, 1.0, None);
    sim.start(1);
    sim.start(2);
    sim.run_until(10 * SEC);
    let s1 = sim.gpu(1) as f64 / (10 * SEC) as f64;
    let s2 = sim.gpu(2) as f64 / (10 * SEC) as f64;
    assert!((s1 - 0.2).abs() < 0.01, "{s1}");
    assert!((s2 - 0.8).abs() < 0.01, "{s2}");
}

#[test]
fn limit_set_on_open_ended_holder_slices_it() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, 0)]);
    s.add_client(10 * MS, 1, 1.0, Some(0.5), N);
    assert_eq!(
        drain(&mut s),
        vec![Action::Grant {
            client: 1,
            grant: 1,
            slice: Some(10 * MS),
            bound: 0,
            waiters: false
        }]
    );
}

#[test]
fn unknown_ids_are_ignored() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    drain(&mut s);
    s.acquire(MS, 99);
    s.release(MS, 99);
    s.drained(MS, 99);
    s.remove_client(MS, 99);
    s.handle_timeout(MS);
    assert!(drain(&mut s).is_empty());
    assert_eq!(s.holder(), Some(1));
    assert_eq!(s.state(99), None);
    assert_eq!(s.status(MS).len(), 1);
    s.acquire(2 * MS, 1);
    assert!(drain(&mut s).is_empty());
}

#[test]
fn bad_weights_and_limits_are_sanitized() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, f64::NAN, Some(f64::NAN), N);
    s.add_client(0, 2, -3.0, Some(1.5), N);
    s.add_client(0, 3, 0.0, Some(0.0), N);
    for st in s.status(0) {
        assert_eq!(st.weight, 1.0);
        assert_eq!(st.limit, None);
    }
    s.add_client(0, 1, 30.0, Some(0.5), Priority::Low);
    let st = status_of(&s, 0, 1);
    assert_eq!(
        (st.weight, st.limit, st.priority),
        (30.0, Some(0.5), Priority::Low)
    );
}

#[test]
fn history_stays_bounded() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    let mut t = 0;
    for _ in 0..10_000 {
        s.acquire(t, 1);
        s.release(t + 10, 1);
        s.drained(t + 10, 1);
        t += 20;
    }
    let c = &s.clients[&1];
    assert_eq!(c.meter.total(t), 100_000);
    assert_eq!(c.meter.usage(s.cfg.window, t), 100_000);
    s.handle_timeout(t + 2 * SEC);
    assert!(s.clients[&1].meter.is_empty());
}

#[test]
fn earlier_now_is_clamped() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(SEC, 1, 1.0, None, N);
    s.acquire(SEC, 1);
    s.release(0, 1);
    s.drained(0, 1);
    assert_eq!(status_of(&s, 0, 1).total_held, 0);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Add(ClientId, f64, Option<f64>, Priority),
        Remove(ClientId),
        Acquire(ClientId),
        Release(ClientId),
        Drained(ClientId),
        Group(ClientId, GroupId, Option<f64>, Option<f64>),
        Advance(Nanos),
        Timeout,
    }

    fn op() -> impl Strategy<Value = Op> {
        let id = 0..6u64;
        prop_oneof![
            (
                id.clone(),
                prop_oneof![Just(1.0), Just(30.0), Just(0.0), Just(f64::NAN)],
                prop_oneof![
                    Just(None),
                    Just(Some(0.3)),
                    Just(Some(0.01)),
                    Just(Some(2.0))
                ],
                proptest::sample::select(Priority::ALL.to_vec()),
            )
                .prop_map(|(i, w, l, p)| Op::Add(i, w, l, p)),
            id.clone().prop_map(Op::Remove),
            id.clone().prop_map(Op::Acquire),
            id.clone().prop_map(Op::Release),
            id.clone().prop_map(Op::Drained),
            (
                id.clone(),
                100..103u64,
                prop_oneof![Just(None), Just(Some(25.0)), Just(Some(f64::INFINITY))],
                prop_oneof![
                    Just(None),
                    Just(Some(0.3)),
                    Just(Some(0.02)),
                    Just(Some(7.0))
                ],
            )
                .prop_map(|(i, g, w, l)| Op::Group(i, g, w, l)),
            (0..120 * MS).prop_map(Op::Advance),
            Just(Op::Timeout),
        ]
    }

    fn config() -> impl Strategy<Value = SchedConfig> {
        (
            0..60 * MS,
            0..2 * SEC,
            0..300 * MS,
            0..MS,
            0..SEC,
            0..5 * MS,
            prop_oneof![Just(0.5), Just(1.0), Just(0.05)],
        )
            .prop_map(
                |(timeslice, window, grace, bound, drain_timeout, wake, high_share)| SchedConfig {
                    timeslice,
                    window,
                    grace,
                    bound,
                    drain_timeout,
                    wake,
                    high_share,
                },
            )
    }

    fn check(s: &Scheduler, now: Nanos) {
        let st = s.status(now);
        let holding: Vec<_> = st
            .iter()
            .filter(|c| c.state == ClientState::Holding)
            .map(|c| c.client)
            .collect();
        assert!(holding.len() <= 1, "two holders: {holding:?}");
        assert_eq!(s.holder(), holding.first().copied());
        // Nobody waits on an idle GPU for nothing.
        if s.holder().is_none() {
            assert!(s.best_waiter(s.now, None).is_none());
        }
        for c in &st {
            assert!((0.0..=1.0 + 1e-9).contains(&c.achieved), "{c:?}");
            assert!(c.weight.is_finite() && c.weight > 0.0, "{c:?}");
        }
        // The charges never exceed the time that has passed.
        let total: Nanos = st.iter().map(|c| c.gpu_time).sum();
        assert!(total <= now + st.len() as Nanos, "{total} > {now}");
        if let Some(t) = s.next_timeout() {
            assert!(t > s.now, "timer at {t} not after {}", s.now);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn never_two_holders_never_panics(cfg in config(), ops in prop::collection::vec(op(), 1..200)) {
            let mut s = Scheduler::new(cfg);
            let mut now = 0;
            for op in ops {
                match op {
                    Op::Add(i, w, l, p) => s.add_client(now, i, w, l, p),
                    Op::Remove(i) => s.remove_client(now, i),
                    Op::Acquire(i) => s.acquire(now, i),
                    Op::Release(i) => s.release(now, i),
                    Op::Drained(i) => s.drained(now, i),
                    Op::Group(i, g, w, l) => s.set_group(now, i, g, w, l),
                    Op::Advance(dt) => now += dt,
                    Op::Timeout => s.handle_timeout(now),
                }
                while let Some(a) = s.poll_action() {
                    if let Action::Grant { client, .. } = a {
                        prop_assert!(s.state(client).is_some());
                    }
                }
                check(&s, now);
            }
        }
    }
}
