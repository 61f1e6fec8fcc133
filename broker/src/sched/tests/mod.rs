//! Scheduler unit tests, in virtual time, by topic. This file holds what
//! they share: action builders, and `Sim`, a model of busy, idle and stuck
//! shims.

mod classes;
mod clocks;
mod entitled;
mod evidence;
mod handover;
mod hierarchy;
mod high;
mod inputs;
mod limits;
mod liveness;
mod meter;
mod props;
mod shares;
mod users;

use super::*;
use std::collections::{BTreeMap as Map, BTreeSet};

const SEC: Nanos = 1000 * MS;
const N: Priority = Priority::Normal;

/// What only the tests ask of the scheduler.
impl Scheduler {
    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Puts a client in a unit (a job or a user) whose members split the
    /// unit's weight: `unit_weight` imposes it, `None` takes the largest
    /// weight among the unit's active members. `unit_limit` is a ceiling
    /// (a fraction of each window) for all the unit's members together,
    /// whatever their number.
    pub fn set_group(
        &mut self,
        now: Nanos,
        id: ClientId,
        group: GroupId,
        unit_weight: Option<f64>,
        unit_limit: Option<f64>,
    ) {
        let user = self.clients.get(&id).and_then(|c| match c.m.user {
            UserKey::User(u) => Some((u, c.m.user_weight)),
            UserKey::Unit(_) => None,
        });
        self.set_unit(now, id, group, unit_weight, unit_limit, user);
    }

    /// Puts a client's unit under a user: users with work share the GPU
    /// by `weight` (within each band), then each user's units share the
    /// user's part by their unit weights, then a unit's members share the
    /// unit's part by their own weights. A user who splits work into many
    /// units or many processes still gets one user's part.
    pub fn set_user(&mut self, now: Nanos, id: ClientId, user: UserId, weight: f64) {
        let Some(c) = self.clients.get(&id) else {
            return;
        };
        let (group, unit_weight) = (c.m.unit, c.m.unit_weight);
        let limit = self.ceilings.unit_limit(group);
        self.set_unit(now, id, group, unit_weight, limit, Some((user, weight)));
    }

    /// How long a recalled holder's band keeps the GPU for its answer.
    pub fn recall_hold(&self) -> Nanos {
        self.lease.recall_hold()
    }

    pub fn state(&self, id: ClientId) -> Option<ClientState> {
        self.clients.get(&id).map(|c| c.state)
    }
}

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
const BB: Nanos = B * super::lease::BURST_BOUND;

/// Virtual-time model of shims: a busy client always has work, so on a
/// revoke it asks again and releases at once; its queued work then
/// drains for `residual` (its kernel length, or the in-flight bound);
/// a stuck client ignores revokes; a client in `then`, revoked, goes idle
/// and another connection of its user asks in its place at once.
struct Sim {
    s: Scheduler,
    now: Nanos,
    residual: Map<ClientId, Nanos>,
    busy: BTreeSet<ClientId>,
    stuck: BTreeSet<ClientId>,
    then: Map<ClientId, ClientId>,
    drains: Vec<(Nanos, ClientId)>,
    log: Vec<(Nanos, Action)>,
    /// The driver's per-process samples, this often (None: no NVML).
    sample_every: Option<Nanos>,
    next_sample: Nanos,
    /// Clients whose process really runs kernels: a sample shows them if
    /// they were on the GPU since the previous one.
    works: BTreeSet<ClientId>,
    /// Clients whose process the driver shows this busy (percent) in
    /// every sample, whatever they hold.
    little: Map<ClientId, u32>,
    held_at_sample: Map<ClientId, Nanos>,
    /// Busy clients answer a revoke by letting go, then asking again
    /// (the shim asks first).
    release_first: bool,
}

impl Sim {
    fn new(cfg: SchedConfig) -> Self {
        Sim {
            s: Scheduler::new(cfg),
            now: 0,
            residual: Map::new(),
            busy: BTreeSet::new(),
            stuck: BTreeSet::new(),
            then: Map::new(),
            drains: Vec::new(),
            log: Vec::new(),
            sample_every: None,
            next_sample: 0,
            works: BTreeSet::new(),
            little: Map::new(),
            held_at_sample: Map::new(),
            release_first: false,
        }
    }

    /// Samples the driver's per-process work every `every` from now on.
    fn sample_every(&mut self, every: Nanos) {
        self.sample_every = Some(every);
        self.next_sample = self.now;
    }

    /// One sample: the working clients that were on the GPU since the
    /// previous one, busy all the time they were on it.
    fn sample(&mut self) {
        let st = self.s.status(self.now);
        let span = self.sample_every.unwrap_or(SEC).max(1);
        let mut seen = Vec::new();
        for c in &st {
            let before = self.held_at_sample.insert(c.client, c.times.total_held);
            let on = c.times.total_held - before.unwrap_or(0);
            if self.works.contains(&c.client) && on > 0 {
                seen.push((c.client, (on * 100).div_ceil(span).min(100) as u32));
            } else if let Some(&pct) = self.little.get(&c.client) {
                seen.push((c.client, pct));
            }
        }
        self.s.work_seen(self.now, seen);
        self.pump();
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
                let busy = self.busy.contains(&client);
                if busy && !self.release_first {
                    self.s.acquire(self.now, client);
                }
                self.s.release(self.now, client);
                if busy && self.release_first {
                    self.s.acquire(self.now, client);
                }
                let r = self.residual.get(&client).copied().unwrap_or(0);
                self.drains.push((self.now + r, client));
                if let Some(&next) = self.then.get(&client) {
                    self.s.acquire(self.now, next);
                    self.s.drained(self.now, next);
                }
            }
        }
    }

    fn run_until(&mut self, end: Nanos) {
        for _ in 0..10_000_000 {
            self.pump();
            let ev = self.drains.iter().map(|e| e.0).min();
            let sample = self.sample_every.map(|_| self.next_sample);
            let t = [ev, sample, self.s.next_timeout()]
                .into_iter()
                .flatten()
                .min();
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
                    if let Some(every) = self.sample_every
                        && self.next_sample <= t
                    {
                        self.next_sample = t + every;
                        self.sample();
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
        status_of(&self.s, self.now, id).times.gpu_time
    }

    /// Wall time on the GPU (not split with hung clients' deemed work).
    fn gpu_held(&self, id: ClientId) -> Nanos {
        status_of(&self.s, self.now, id).times.total_held
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
