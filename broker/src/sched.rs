//! Per-GPU compute timeslice scheduler (SPEC §2).
//!
//! A pure state machine: no I/O, no clock, no threads. Every entry point takes
//! the current monotonic time so the whole policy can be driven in virtual
//! time by tests and by the socket layer alike. Outputs are queued as
//! [`Action`]s (drained with [`Scheduler::poll_action`]) and the caller arms a
//! timer for [`Scheduler::next_timeout`].
//!
//! Policy in one paragraph: at most one holder per GPU. Time is charged on
//! measured hold time (grant → release, drain and overrun included) into a
//! per-client virtual time scaled by its weight; the GPU goes to the waiting
//! client with the least virtual time, FIFO among equals. A lone client holds
//! an open-ended grant; once someone else becomes eligible it is given a
//! deadline and revoked when it passes. `GPU_COMPUTE_LIMIT` is a sliding-window
//! budget that is enforced even on an otherwise idle GPU.
//!
//! Protocol notes for the socket layer:
//! - A `Grant` for a grant id the client already holds is an *update* (it
//!   became contended, or an expired slice was extended or made open-ended);
//!   a new grant id is a new grant. A shim that has already released a grant
//!   must ignore late updates and revokes carrying that id.
//! - A revoked client that still has work should send `acquire` before (or
//!   together with) its `release`: the release then re-queues it at its
//!   charged virtual time *before* the next holder is chosen. A plain release
//!   makes it idle, and an idle client that comes back forfeits any lead it
//!   had, so weights only hold for clients that re-queue this way.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// Monotonic nanoseconds, chosen by the caller.
pub type Nanos = u64;
/// One connected process.
pub type ClientId = u64;
/// Identifies one grant, so late updates and revokes can be told apart from a
/// new grant by the client.
pub type GrantId = u64;

const MS: Nanos = 1_000_000;

/// Hold intervals kept per client. Only the last `window` matters; the cap
/// keeps a client that spins acquire/release from growing memory without
/// bound.
const MAX_HISTORY: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedConfig {
    /// Contended slice length (`--timeslice`).
    pub timeslice: Nanos,
    /// Sliding window for `GPU_COMPUTE_LIMIT` and for achieved share.
    pub window: Nanos,
    /// How long a revoked holder may take to drain and release before the GPU
    /// is handed to the next waiter anyway. The overrun is charged either way,
    /// so a short grace costs only isolation (two contexts briefly share the
    /// engine), never fairness; a long one stalls everybody behind a
    /// SIGSTOPped or hung holder.
    pub grace: Nanos,
}

impl Default for SchedConfig {
    /// 50 ms slices, a 1 s window, and a 200 ms grace: four slices, enough
    /// for a few queued kernels to drain, short enough that a stuck holder
    /// stalls the others for only a fraction of a second.
    fn default() -> Self {
        SchedConfig {
            timeslice: 50 * MS,
            window: 1000 * MS,
            grace: 200 * MS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// `slice: None` is open-ended (uncontended, unlimited). A grant id the
    /// client already holds makes this an update of that grant.
    Grant {
        client: ClientId,
        grant: GrantId,
        slice: Option<Nanos>,
    },
    /// Stop launching, drain, then `release`.
    Revoke { client: ClientId, grant: GrantId },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientState {
    Idle,
    Waiting,
    Holding,
    /// Revoked and not yet released. Stays so after the grace period too
    /// (then `hung` in its status): it is still charged, but no longer the
    /// holder.
    Revoking,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    pub client: ClientId,
    pub weight: f64,
    pub limit: Option<f64>,
    pub state: ClientState,
    /// Fraction of the last window (or of its lifetime, if younger) during
    /// which the client held a grant.
    pub achieved: f64,
    /// weight / sum of weights of active (waiting, holding or revoking)
    /// clients; 0 for an idle client.
    pub target: f64,
    pub total_held: Nanos,
    /// Revoked, past its grace, still not released.
    pub hung: bool,
}

#[derive(Debug, Clone)]
struct Outstanding {
    id: GrantId,
    start: Nanos,
    /// Virtual time is charged incrementally up to here, so that a long
    /// uncontended hold is already paid for when a competitor arrives and is
    /// clamped to the virtual clock.
    charged_to: Nanos,
    deadline: Option<Nanos>,
    revoked_at: Option<Nanos>,
    hung: bool,
}

#[derive(Debug, Clone)]
struct Client {
    weight: f64,
    limit: Option<f64>,
    state: ClientState,
    vtime: f64,
    /// FIFO stamp, taken each time the client starts waiting.
    seq: u64,
    added_at: Nanos,
    grant: Option<Outstanding>,
    /// Set by `acquire` while revoking: the release re-queues instead of
    /// idling.
    wants_again: bool,
    /// Closed hold intervals, oldest first, non-overlapping.
    history: VecDeque<(Nanos, Nanos)>,
    total_closed: Nanos,
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedConfig,
    clients: BTreeMap<ClientId, Client>,
    holder: Option<ClientId>,
    /// Never decreases; tracks the least virtual time among active clients.
    /// Clients that (re)activate start no lower, so idling banks no credit.
    vclock: f64,
    next_seq: u64,
    next_grant: GrantId,
    actions: VecDeque<Action>,
    /// Latest time seen; earlier `now` arguments are clamped to it so a
    /// caller's clock hiccup cannot make durations underflow.
    now: Nanos,
}

fn sanitize_weight(weight: f64) -> f64 {
    // Only ratios matter; a weight that cannot be compared is treated as the
    // default rather than poisoning every comparison with NaN.
    if weight.is_finite() && weight > 0.0 {
        weight
    } else {
        1.0
    }
}

fn sanitize_limit(limit: Option<f64>) -> Option<f64> {
    // The shim validates GPU_COMPUTE_LIMIT; anything that still arrives out of
    // range is not a ceiling the scheduler can honour: >= 100% is no ceiling,
    // and <= 0 would park the client forever.
    limit.filter(|l| l.is_finite() && *l > 0.0 && *l < 1.0)
}

fn overlap(s: Nanos, e: Nanos, lo: Nanos, hi: Nanos) -> Nanos {
    e.min(hi).saturating_sub(s.max(lo))
}

impl Client {
    fn usage(&self, cfg: &SchedConfig, now: Nanos) -> Nanos {
        let lo = now.saturating_sub(cfg.window);
        let closed: Nanos = self
            .history
            .iter()
            .map(|&(s, e)| overlap(s, e, lo, now))
            .sum();
        let open = self
            .grant
            .as_ref()
            .map_or(0, |g| overlap(g.start, now, lo, now));
        closed + open
    }

    fn budget(&self, cfg: &SchedConfig) -> Option<Nanos> {
        self.limit
            .map(|l| ((l * cfg.window as f64) as Nanos).max(1))
    }

    /// Smallest slice worth granting to a limited client: a fifth of a
    /// timeslice (or of the budget, if smaller). Without a floor a client
    /// hovering at its budget would get a stream of nanosecond grants, each
    /// paying a full revoke/drain round trip; a full slice as floor would let
    /// its share of some windows sag by a whole slice below the limit.
    fn quantum(&self, cfg: &SchedConfig) -> Option<Nanos> {
        self.budget(cfg).map(|b| (b.min(cfg.timeslice) / 5).max(1))
    }

    fn remaining(&self, cfg: &SchedConfig, now: Nanos) -> Option<Nanos> {
        self.budget(cfg)
            .map(|b| b.saturating_sub(self.usage(cfg, now)))
    }

    fn eligible(&self, cfg: &SchedConfig, now: Nanos) -> bool {
        match (self.remaining(cfg, now), self.quantum(cfg)) {
            (Some(r), Some(q)) => r >= q,
            _ => true,
        }
    }

    /// Earliest instant at which a waiting (not holding) limited client
    /// becomes eligible, computed with the same integer arithmetic as
    /// `eligible` so that a timer armed for it never fires early.
    fn eligible_at(&self, cfg: &SchedConfig, now: Nanos) -> Option<Nanos> {
        let (budget, quantum) = (self.budget(cfg)?, self.quantum(cfg)?);
        let allowed = budget - quantum;
        let used = self.usage(cfg, now);
        if used <= allowed || self.grant.is_some() {
            return None;
        }
        // As the window's left edge slides forward, usage drops by the held
        // time it passes over; find where that reaches the excess.
        let excess = used - allowed;
        let lo = now.saturating_sub(cfg.window);
        let mut acc = 0;
        for &(s, e) in &self.history {
            let s = s.max(lo);
            if e <= s {
                continue;
            }
            let len = e - s;
            if acc + len >= excess {
                return Some(s + (excess - acc) + cfg.window);
            }
            acc += len;
        }
        None
    }

    fn total_held(&self, now: Nanos) -> Nanos {
        self.total_closed
            + self
                .grant
                .as_ref()
                .map_or(0, |g| now.saturating_sub(g.start))
    }

    fn close_interval(&mut self, start: Nanos, end: Nanos) {
        self.total_closed += end - start;
        if end == start {
            return;
        }
        match self.history.back_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => self.history.push_back((start, end)),
        }
        if self.history.len() > MAX_HISTORY {
            // Merge the two oldest, keeping their total and the later end:
            // usage in the window stays exact now and only ever slides out
            // slightly early later.
            let (s1, e1) = self.history.pop_front().expect("len > cap");
            let (s2, e2) = self.history.pop_front().expect("len > cap");
            let total = (e1 - s1) + (e2 - s2);
            self.history.push_front((e2 - total, e2));
        }
    }

    fn prune(&mut self, cfg: &SchedConfig, now: Nanos) {
        let lo = now.saturating_sub(cfg.window);
        while self.history.front().is_some_and(|&(_, e)| e <= lo) {
            self.history.pop_front();
        }
    }

    fn is_active(&self) -> bool {
        !matches!(self.state, ClientState::Idle)
    }
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Self {
        // Zero-length slices or windows would make deadlines fire at the
        // instant they are set and the timer loop spin.
        let cfg = SchedConfig {
            timeslice: cfg.timeslice.max(1),
            window: cfg.window.max(1),
            grace: cfg.grace,
        };
        Scheduler {
            cfg,
            clients: BTreeMap::new(),
            holder: None,
            vclock: 0.0,
            next_seq: 0,
            next_grant: 1,
            actions: VecDeque::new(),
            now: 0,
        }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Registers a client, idle. Re-adding a known id updates its weight and
    /// limit in place (time already held stays charged at the old weight).
    pub fn add_client(&mut self, now: Nanos, id: ClientId, weight: f64, limit: Option<f64>) {
        let now = self.clock(now);
        self.settle(now);
        let (weight, limit) = (sanitize_weight(weight), sanitize_limit(limit));
        if let Some(c) = self.clients.get_mut(&id) {
            c.weight = weight;
            c.limit = limit;
        } else {
            self.clients.insert(
                id,
                Client {
                    weight,
                    limit,
                    state: ClientState::Idle,
                    vtime: self.vclock,
                    seq: 0,
                    added_at: now,
                    grant: None,
                    wants_again: false,
                    history: VecDeque::new(),
                    total_closed: 0,
                },
            );
        }
        self.reschedule(now);
    }

    /// Disconnect. A holder's GPU goes to the next waiter at once.
    pub fn remove_client(&mut self, now: Nanos, id: ClientId) {
        if self.clients.remove(&id).is_none() {
            return;
        }
        let now = self.clock(now);
        if self.holder == Some(id) {
            self.holder = None;
        }
        self.reschedule(now);
    }

    /// The client wants to launch work.
    pub fn acquire(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let vclock = self.vclock;
        let seq = self.next_seq;
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {
                c.vtime = c.vtime.max(vclock);
                c.state = ClientState::Waiting;
                c.seq = seq;
                self.next_seq += 1;
            }
            ClientState::Revoking => c.wants_again = true,
            ClientState::Waiting | ClientState::Holding => {}
        }
        self.reschedule(now);
    }

    /// The client gave the GPU back: after a revoke, or early because it ran
    /// out of work. From a waiting client it withdraws the request.
    pub fn release(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let seq = self.next_seq;
        let cfg = self.cfg;
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {}
            ClientState::Waiting => c.state = ClientState::Idle,
            ClientState::Holding | ClientState::Revoking => {
                let g = c.grant.take().expect("holding implies a grant");
                c.close_interval(g.start, now);
                c.prune(&cfg, now);
                if std::mem::take(&mut c.wants_again) {
                    c.state = ClientState::Waiting;
                    c.seq = seq;
                    self.next_seq += 1;
                } else {
                    c.state = ClientState::Idle;
                }
                if self.holder == Some(id) {
                    self.holder = None;
                }
            }
        }
        self.reschedule(now);
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Earliest instant at which `handle_timeout` has something to do;
    /// always later than the last time passed in, so a timer loop cannot spin.
    pub fn next_timeout(&self) -> Option<Nanos> {
        let now = self.now;
        let mut next: Option<Nanos> = None;
        let mut consider = |t: Nanos| next = Some(next.map_or(t, |n| n.min(t)));
        let mut waiter_times_matter = true;
        if let Some(g) = self.holder_grant() {
            if let Some(r) = g.revoked_at {
                consider(r.saturating_add(self.cfg.grace));
                waiter_times_matter = false;
            } else if let Some(d) = g.deadline {
                consider(d);
                waiter_times_matter = false;
            }
        }
        // Only an idle GPU or an open-ended holder reacts to a waiter's budget
        // coming back; otherwise the pending deadline re-evaluates anyway.
        if waiter_times_matter {
            for c in self.clients.values() {
                if c.state == ClientState::Waiting
                    && let Some(t) = c.eligible_at(&self.cfg, now)
                {
                    consider(t);
                }
            }
        }
        next
    }

    pub fn handle_timeout(&mut self, now: Nanos) {
        let now = self.clock(now);
        let cfg = self.cfg;
        for c in self.clients.values_mut() {
            c.prune(&cfg, now);
        }
        self.reschedule(now);
    }

    pub fn status(&self, now: Nanos) -> Vec<ClientStatus> {
        let now = now.max(self.now);
        let active_weight: f64 = self
            .clients
            .values()
            .filter(|c| c.is_active())
            .map(|c| c.weight)
            .sum();
        self.clients
            .iter()
            .map(|(&id, c)| {
                let span = self.cfg.window.min(now - c.added_at);
                let achieved = if span == 0 {
                    0.0
                } else {
                    c.usage(&self.cfg, now) as f64 / span as f64
                };
                ClientStatus {
                    client: id,
                    weight: c.weight,
                    limit: c.limit,
                    state: c.state,
                    achieved,
                    target: if c.is_active() {
                        c.weight / active_weight
                    } else {
                        0.0
                    },
                    total_held: c.total_held(now),
                    hung: c.grant.as_ref().is_some_and(|g| g.hung),
                }
            })
            .collect()
    }

    /// The client the GPU currently belongs to (holding, or revoked and still
    /// within its grace). A hung client is no longer the holder.
    pub fn holder(&self) -> Option<ClientId> {
        self.holder
    }

    pub fn state(&self, id: ClientId) -> Option<ClientState> {
        self.clients.get(&id).map(|c| c.state)
    }

    fn clock(&mut self, now: Nanos) -> Nanos {
        self.now = self.now.max(now);
        self.now
    }

    fn holder_grant(&self) -> Option<&Outstanding> {
        self.holder
            .and_then(|h| self.clients.get(&h))
            .and_then(|c| c.grant.as_ref())
    }

    /// Charges every outstanding grant (hung ones included) up to `now` and
    /// advances the virtual clock.
    fn settle(&mut self, now: Nanos) {
        for c in self.clients.values_mut() {
            if let Some(g) = c.grant.as_mut() {
                let dt = now.saturating_sub(g.charged_to);
                c.vtime += dt as f64 / c.weight;
                g.charged_to = now;
            }
        }
        // Hung clients are left out: they are off the GPU's books and must
        // not hold the clock back for everyone else.
        let min_active = self
            .clients
            .iter()
            .filter(|&(&id, c)| c.state == ClientState::Waiting || Some(id) == self.holder)
            .map(|(_, c)| c.vtime)
            .min_by(f64::total_cmp);
        if let Some(m) = min_active {
            self.vclock = self.vclock.max(m);
        }
    }

    /// Least virtual time among eligible waiters other than `except`; Some
    /// means the GPU is contended.
    fn best_waiter(&self, now: Nanos, except: ClientId) -> Option<f64> {
        self.clients
            .iter()
            .filter(|&(&id, c)| {
                id != except && c.state == ClientState::Waiting && c.eligible(&self.cfg, now)
            })
            .map(|(_, c)| c.vtime)
            .min_by(f64::total_cmp)
    }

    fn pick(&self, now: Nanos) -> Option<ClientId> {
        self.clients
            .iter()
            .filter(|(_, c)| c.state == ClientState::Waiting && c.eligible(&self.cfg, now))
            .min_by(|a, b| a.1.vtime.total_cmp(&b.1.vtime).then(a.1.seq.cmp(&b.1.seq)))
            .map(|(&id, _)| id)
    }

    /// Brings the state to a fixed point for `now`; every step either makes
    /// progress or stops, so the loop is short.
    fn reschedule(&mut self, now: Nanos) {
        self.settle(now);
        for _ in 0..self.clients.len() * 2 + 4 {
            if !self.step(now) {
                return;
            }
        }
    }

    fn step(&mut self, now: Nanos) -> bool {
        let Some(h) = self.holder else {
            return match self.pick(now) {
                Some(next) => {
                    self.grant_to(now, next);
                    true
                }
                None => false,
            };
        };
        let cfg = self.cfg;
        let best = self.best_waiter(now, h);
        let contended = best.is_some();
        let c = self.clients.get_mut(&h).expect("holder is registered");
        let remaining = c.remaining(&cfg, now);
        let quantum = c.quantum(&cfg);
        let vtime = c.vtime;
        let weight = c.weight;
        let g = c.grant.as_mut().expect("holder has a grant");
        if let Some(r) = g.revoked_at {
            if r.saturating_add(cfg.grace) <= now {
                g.hung = true;
                self.holder = None;
                return true;
            }
            return false;
        }
        let (gid, start) = (g.id, g.start);
        let action = match g.deadline {
            Some(d) if d <= now => {
                // A holder that would be picked again anyway (strictly ahead
                // of every eligible waiter; ties go to the waiter, as FIFO
                // would) keeps the GPU — for the real time that brings its
                // virtual time level with the best waiter's, not a whole
                // slice (which would double the waiters' wait for a deficit
                // of one drain), but at least a fifth of a slice, so that a
                // small deficit does not cost a drain and an immediate
                // re-grant.
                let ext = best.map(|b| {
                    (((b - vtime).max(0.0) * weight) as Nanos)
                        .clamp(cfg.timeslice / 5, cfg.timeslice)
                });
                if best.is_some_and(|b| vtime >= b) {
                    None
                } else if let (Some(r), Some(q)) = (remaining, quantum) {
                    let cap = ext.unwrap_or(Nanos::MAX);
                    (r >= q).then(|| Some(r.min(cfg.timeslice).min(cap)))
                } else if contended {
                    Some(Some(ext.unwrap_or(cfg.timeslice)))
                } else {
                    Some(None)
                }
            }
            Some(_) => return false,
            None if contended || remaining.is_some() => {
                // A newcomer waits for the holder's first timeslice to run
                // out, counted from its grant; a holder that already had that
                // much is revoked now, since its long solo run is charged and
                // the newcomer starts level with it.
                let d = start.saturating_add(cfg.timeslice).max(now);
                let d = match remaining {
                    Some(r) => d.min(now + r),
                    None => d,
                };
                (d > now).then_some(Some(d - now))
            }
            None => return false,
        };
        match action {
            Some(slice) => {
                g.deadline = slice.map(|s| now + s);
                self.actions.push_back(Action::Grant {
                    client: h,
                    grant: gid,
                    slice,
                });
            }
            None => {
                g.revoked_at = Some(now);
                g.deadline = None;
                c.state = ClientState::Revoking;
                self.actions.push_back(Action::Revoke {
                    client: h,
                    grant: gid,
                });
            }
        }
        true
    }

    fn grant_to(&mut self, now: Nanos, id: ClientId) {
        let cfg = self.cfg;
        let contended = self.best_waiter(now, id).is_some();
        let gid = self.next_grant;
        self.next_grant += 1;
        let c = self.clients.get_mut(&id).expect("picked client exists");
        let slice = match c.remaining(&cfg, now) {
            Some(r) => Some(r.min(cfg.timeslice)),
            None => contended.then_some(cfg.timeslice),
        };
        c.state = ClientState::Holding;
        c.grant = Some(Outstanding {
            id: gid,
            start: now,
            charged_to: now,
            deadline: slice.map(|s| now + s),
            revoked_at: None,
            hung: false,
        });
        self.holder = Some(id);
        self.actions.push_back(Action::Grant {
            client: id,
            grant: gid,
            slice,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const SEC: Nanos = 1000 * MS;

    fn drain(s: &mut Scheduler) -> Vec<Action> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    fn grant(client: ClientId, grant: GrantId, slice: Option<Nanos>) -> Action {
        Action::Grant {
            client,
            grant,
            slice,
        }
    }

    fn status_of(s: &Scheduler, now: Nanos, id: ClientId) -> ClientStatus {
        s.status(now)
            .into_iter()
            .find(|c| c.client == id)
            .expect("known client")
    }

    /// Virtual-time model of shims: a busy client always has work, so on a
    /// revoke it asks again at once and releases after `drain`; a stuck
    /// client ignores revokes.
    struct Sim {
        s: Scheduler,
        now: Nanos,
        drain: Nanos,
        busy: BTreeSet<ClientId>,
        stuck: BTreeSet<ClientId>,
        releases: Vec<(Nanos, ClientId)>,
        log: Vec<(Nanos, Action)>,
    }

    impl Sim {
        fn new(cfg: SchedConfig) -> Self {
            Sim {
                s: Scheduler::new(cfg),
                now: 0,
                drain: MS,
                busy: BTreeSet::new(),
                stuck: BTreeSet::new(),
                releases: Vec::new(),
                log: Vec::new(),
            }
        }

        fn add(&mut self, id: ClientId, weight: f64, limit: Option<f64>) {
            self.s.add_client(self.now, id, weight, limit);
            self.pump();
        }

        fn start(&mut self, id: ClientId) {
            self.busy.insert(id);
            self.s.acquire(self.now, id);
            self.pump();
        }

        /// The client runs out of work: it withdraws if waiting and hands
        /// back at its next revoke.
        fn stop(&mut self, id: ClientId) {
            self.busy.remove(&id);
            if self.s.state(id) == Some(ClientState::Waiting) {
                self.s.release(self.now, id);
            }
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
                    self.releases.push((self.now + self.drain, client));
                }
            }
        }

        fn run_until(&mut self, end: Nanos) {
            for _ in 0..10_000_000 {
                self.pump();
                let ev = self.releases.iter().map(|e| e.0).min();
                let t = [ev, self.s.next_timeout()].into_iter().flatten().min();
                match t {
                    Some(t) if t <= end => {
                        assert!(t >= self.now, "time went backwards");
                        self.now = t;
                        let (due, later): (Vec<_>, Vec<_>) =
                            self.releases.iter().partition(|e| e.0 <= t);
                        self.releases = later;
                        for (_, c) in due {
                            self.s.release(t, c);
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

        fn held(&self, id: ClientId) -> Nanos {
            status_of(&self.s, self.now, id).total_held
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
                    } if client == id && seen.insert(grant) => Some((t, slice)),
                    _ => None,
                })
                .collect()
        }
    }

    fn assert_shares(weights: &[f64]) {
        let mut sim = Sim::new(SchedConfig::default());
        for (i, &w) in weights.iter().enumerate() {
            sim.add(i as ClientId, w, None);
        }
        for i in 0..weights.len() {
            sim.start(i as ClientId);
        }
        sim.run_until(10 * SEC);
        let sum: f64 = weights.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let share = sim.held(i as ClientId) as f64 / (10 * SEC) as f64;
            let want = w / sum;
            assert!(
                (share - want).abs() < 0.01,
                "client {i}: share {share:.4}, want {want:.4} (weights {weights:?})"
            );
        }
        // The GPU never sat idle while everyone had work.
        let total: Nanos = (0..weights.len()).map(|i| sim.held(i as ClientId)).sum();
        assert!(total >= 10 * SEC - MS, "total held {total}");
    }

    #[test]
    fn two_equal_clients_converge_to_half() {
        assert_shares(&[50.0, 50.0]);
    }

    #[test]
    fn weights_70_30_converge() {
        assert_shares(&[70.0, 30.0]);
    }

    #[test]
    fn three_clients_1_1_2_converge() {
        assert_shares(&[1.0, 1.0, 2.0]);
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
    fn lone_client_gets_open_ended_grant_and_is_never_revoked() {
        let mut sim = Sim::new(SchedConfig::default());
        sim.add(1, 1.0, None);
        sim.start(1);
        sim.run_until(10 * SEC);
        assert_eq!(sim.log, vec![(0, grant(1, 1, None))]);
        assert_eq!(sim.s.next_timeout(), None);
        assert_eq!(sim.held(1), 10 * SEC);
        let st = status_of(&sim.s, sim.now, 1);
        assert!((st.achieved - 1.0).abs() < 1e-9);
    }

    #[test]
    fn contention_turns_open_grant_into_slice_then_revokes() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        assert_eq!(drain(&mut s), vec![grant(1, 1, None)]);
        s.acquire(10 * MS, 2);
        // The holder learns it is contended; its first timeslice still
        // counts from the grant.
        assert_eq!(drain(&mut s), vec![grant(1, 1, Some(40 * MS))]);
        assert_eq!(s.next_timeout(), Some(50 * MS));
        s.handle_timeout(50 * MS);
        assert_eq!(
            drain(&mut s),
            vec![Action::Revoke {
                client: 1,
                grant: 1
            }]
        );
        assert_eq!(s.state(1), Some(ClientState::Revoking));
        assert_eq!(s.holder(), Some(1));
        s.release(52 * MS, 1);
        // 1 released without asking again, so it went idle: 2 is alone and
        // its grant is open-ended.
        assert_eq!(drain(&mut s), vec![grant(2, 2, None)]);
    }

    #[test]
    fn newcomer_after_long_solo_run_revokes_at_once() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        drain(&mut s);
        s.acquire(2 * SEC, 2);
        assert_eq!(
            drain(&mut s),
            vec![Action::Revoke {
                client: 1,
                grant: 1
            }]
        );
        s.acquire(2 * SEC, 1);
        s.release(2 * SEC + MS, 1);
        // Both want it; the newcomer starts level with the solo runner, which
        // has since paid for its drain, so the newcomer goes first and gets a
        // contended slice.
        assert_eq!(drain(&mut s), vec![grant(2, 2, Some(50 * MS))]);
    }

    #[test]
    fn idle_early_release_hands_over_immediately() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        s.acquire(10 * MS, 2);
        drain(&mut s);
        s.release(20 * MS, 1);
        assert_eq!(drain(&mut s), vec![grant(2, 2, None)]);
        assert_eq!(s.holder(), Some(2));
        assert_eq!(s.state(1), Some(ClientState::Idle));
        assert_eq!(status_of(&s, 20 * MS, 1).total_held, 20 * MS);
    }

    #[test]
    fn removing_holder_grants_next_at_once() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.add_client(0, 3, 1.0, None);
        s.acquire(0, 1);
        s.acquire(MS, 2);
        s.acquire(2 * MS, 3);
        drain(&mut s);
        s.remove_client(30 * MS, 1);
        // 3 is still waiting behind 2, so 2's grant is a contended slice.
        assert_eq!(drain(&mut s), vec![grant(2, 2, Some(50 * MS))]);
        assert_eq!(s.holder(), Some(2));
        assert_eq!(s.state(1), None);
        // A waiting client that disconnects just leaves the queue.
        s.remove_client(31 * MS, 3);
        assert!(drain(&mut s).is_empty());
    }

    #[test]
    fn hung_holder_loses_gpu_after_grace_and_is_charged() {
        let cfg = SchedConfig::default();
        let mut sim = Sim::new(cfg);
        sim.add(1, 1.0, None);
        sim.add(2, 1.0, None);
        sim.stuck.insert(1);
        sim.start(1);
        sim.start(2);
        sim.run_until(SEC);
        // Revoked at the end of its first slice, moved on after the grace.
        assert_eq!(sim.grants_to(2), vec![(50 * MS + cfg.grace, None)]);
        assert_eq!(sim.s.holder(), Some(2));
        let st = status_of(&sim.s, sim.now, 1);
        assert_eq!(st.state, ClientState::Revoking);
        assert!(st.hung);
        assert_eq!(st.total_held, SEC);
        // The hang ends: it still has work, so it re-queues.
        sim.stuck.remove(&1);
        sim.s.acquire(SEC, 1);
        sim.s.release(SEC, 1);
        sim.pump();
        assert_eq!(sim.held(1), SEC);
        sim.run_until(3 * SEC);
        // 1 held for a full second, 2 only for 750 ms: 2 keeps the GPU until
        // it has caught up.
        let next_for_1 = sim.grants_to(1)[1].0;
        assert!(next_for_1 >= SEC + 240 * MS, "regranted at {next_for_1}");
        let (h1, h2) = (sim.held(1), sim.held(2));
        assert!(h1.abs_diff(h2) <= 60 * MS, "{h1} vs {h2}");
    }

    #[test]
    fn overrun_is_charged() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        s.acquire(0, 2);
        assert_eq!(
            drain(&mut s),
            vec![grant(1, 1, None), grant(1, 1, Some(50 * MS))]
        );
        s.handle_timeout(50 * MS);
        drain(&mut s);
        // 30 ms overrun past the slice.
        s.acquire(50 * MS, 1);
        s.release(80 * MS, 1);
        assert_eq!(drain(&mut s), vec![grant(2, 2, Some(50 * MS))]);
        assert_eq!(status_of(&s, 80 * MS, 1).total_held, 80 * MS);
        // 2 has been charged 50 ms against 1's 80 ms, so it keeps the GPU
        // for the 30 ms that level them, instead of being revoked.
        s.handle_timeout(130 * MS);
        assert_eq!(drain(&mut s), vec![grant(2, 2, Some(30 * MS))]);
        s.handle_timeout(160 * MS);
        assert_eq!(
            drain(&mut s),
            vec![Action::Revoke {
                client: 2,
                grant: 2
            }]
        );
    }

    #[test]
    fn heavier_holder_keeps_gpu_without_a_revoke_while_ahead() {
        let mut sim = Sim::new(SchedConfig::default());
        sim.add(1, 3.0, None);
        sim.add(2, 1.0, None);
        sim.start(1);
        sim.start(2);
        sim.run_until(SEC);
        let revokes = |id| {
            sim.log
                .iter()
                .filter(|(_, a)| matches!(a, Action::Revoke { client, .. } if *client == id))
                .count()
        };
        // 1 runs three slices per turn, so it is revoked about as often as
        // 2, not three times as often.
        assert!(
            revokes(1) <= revokes(2) + 1,
            "{} vs {}",
            revokes(1),
            revokes(2)
        );
        let share = sim.held(1) as f64 / SEC as f64;
        assert!((share - 0.75).abs() < 0.03, "{share}");
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
            // Drain overrun can push a window a little over; the grant floor
            // can leave it a little under.
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
        let share = sim.held(1) as f64 / sim.now as f64;
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
        let s1 = sim.held(1) as f64 / (10 * SEC) as f64;
        let s2 = sim.held(2) as f64 / (10 * SEC) as f64;
        assert!((s1 - 0.2).abs() < 0.01, "{s1}");
        assert!((s2 - 0.8).abs() < 0.01, "{s2}");
    }

    #[test]
    fn limited_client_idles_gpu_until_budget_returns() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, Some(0.1));
        s.acquire(0, 1);
        assert_eq!(drain(&mut s), vec![grant(1, 1, Some(50 * MS))]);
        s.handle_timeout(50 * MS);
        // Alone and 50 ms of budget left: extended, not revoked.
        assert_eq!(drain(&mut s), vec![grant(1, 1, Some(50 * MS))]);
        s.handle_timeout(100 * MS);
        assert_eq!(
            drain(&mut s),
            vec![Action::Revoke {
                client: 1,
                grant: 1
            }]
        );
        s.acquire(100 * MS, 1);
        s.release(100 * MS, 1);
        assert!(drain(&mut s).is_empty());
        assert_eq!(s.holder(), None);
        // A grant is worth making again once a fifth of a slice of budget
        // is back, i.e. once [0, 10 ms) has left the window.
        assert_eq!(s.next_timeout(), Some(SEC + 10 * MS));
        s.handle_timeout(SEC + 10 * MS - 1);
        assert!(drain(&mut s).is_empty());
        s.handle_timeout(SEC + 10 * MS);
        assert_eq!(drain(&mut s), vec![grant(1, 2, Some(10 * MS))]);
        // Alone, it keeps extending as old usage slides out of the window.
        s.handle_timeout(SEC + 20 * MS);
        assert_eq!(drain(&mut s), vec![grant(1, 2, Some(10 * MS))]);
    }

    #[test]
    fn limited_waiter_does_not_contend_until_eligible() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, Some(0.05));
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        drain(&mut s);
        s.handle_timeout(50 * MS);
        drain(&mut s);
        s.acquire(50 * MS, 1);
        s.release(50 * MS, 1);
        // 2 is alone among the eligible: open-ended.
        s.acquire(60 * MS, 2);
        assert_eq!(drain(&mut s), vec![grant(2, 2, None)]);
        assert_eq!(s.next_timeout(), Some(SEC + 10 * MS));
        s.handle_timeout(SEC + 10 * MS);
        // 1's budget is back: 2 has had far more than a slice, so it goes.
        assert_eq!(
            drain(&mut s),
            vec![Action::Revoke {
                client: 2,
                grant: 2
            }]
        );
    }

    #[test]
    fn returning_client_gets_no_hoarded_credit() {
        let mut sim = Sim::new(SchedConfig::default());
        sim.add(1, 1.0, None);
        sim.add(2, 1.0, None);
        sim.start(1);
        sim.start(2);
        sim.run_until(2 * SEC);
        sim.stop(2);
        sim.run_until(7 * SEC);
        let (a1, a2) = (sim.held(1), sim.held(2));
        sim.start(2);
        // A brand-new client arriving now starts level too.
        sim.add(3, 1.0, None);
        sim.start(3);
        sim.run_until(8 * SEC);
        let (d1, d2, d3) = (sim.held(1) - a1, sim.held(2) - a2, sim.held(3));
        for (name, d) in [("1", d1), ("2", d2), ("3", d3)] {
            let share = d as f64 / SEC as f64;
            assert!(
                (share - 1.0 / 3.0).abs() < 0.03,
                "client {name}: {share} of the second after 2 came back"
            );
        }
    }

    #[test]
    fn unknown_ids_are_ignored() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.acquire(0, 1);
        drain(&mut s);
        s.acquire(MS, 99);
        s.release(MS, 99);
        s.remove_client(MS, 99);
        s.handle_timeout(MS);
        assert!(drain(&mut s).is_empty());
        assert_eq!(s.holder(), Some(1));
        assert_eq!(s.state(99), None);
        assert_eq!(s.status(MS).len(), 1);
        // Releasing when idle, acquiring while holding: no-ops.
        s.acquire(2 * MS, 1);
        assert!(drain(&mut s).is_empty());
        s.release(3 * MS, 1);
        s.release(4 * MS, 1);
        assert!(drain(&mut s).is_empty());
    }

    #[test]
    fn bad_weights_and_limits_are_sanitized() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, f64::NAN, Some(f64::NAN));
        s.add_client(0, 2, -3.0, Some(1.5));
        s.add_client(0, 3, 0.0, Some(0.0));
        for st in s.status(0) {
            assert_eq!(st.weight, 1.0);
            assert_eq!(st.limit, None);
        }
        // Re-adding updates in place.
        s.add_client(0, 1, 30.0, Some(0.5));
        let st = status_of(&s, 0, 1);
        assert_eq!((st.weight, st.limit), (30.0, Some(0.5)));
    }

    #[test]
    fn limit_set_on_open_ended_holder_slices_it() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        s.acquire(0, 1);
        assert_eq!(drain(&mut s), vec![grant(1, 1, None)]);
        s.add_client(10 * MS, 1, 1.0, Some(0.5));
        assert_eq!(drain(&mut s), vec![grant(1, 1, Some(40 * MS))]);
    }

    #[test]
    fn zero_grace_moves_on_in_the_same_step() {
        let cfg = SchedConfig {
            grace: 0,
            ..SchedConfig::default()
        };
        let mut s = Scheduler::new(cfg);
        s.add_client(0, 1, 1.0, None);
        s.add_client(0, 2, 1.0, None);
        s.acquire(0, 1);
        s.acquire(0, 2);
        drain(&mut s);
        s.handle_timeout(50 * MS);
        assert_eq!(
            drain(&mut s),
            vec![
                Action::Revoke {
                    client: 1,
                    grant: 1
                },
                grant(2, 2, None)
            ]
        );
        assert!(s.next_timeout().is_none());
    }

    #[test]
    fn history_stays_bounded() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(0, 1, 1.0, None);
        let mut t = 0;
        for _ in 0..10_000 {
            s.acquire(t, 1);
            s.release(t + 10, 1);
            t += 20;
        }
        let c = &s.clients[&1];
        assert!(c.history.len() <= MAX_HISTORY);
        assert_eq!(c.total_closed, 100_000);
        // Everything happened within the window, so usage is exact.
        assert_eq!(c.usage(&s.cfg, t), 100_000);
        s.handle_timeout(t + 2 * SEC);
        assert!(s.clients[&1].history.is_empty());
    }

    #[test]
    fn earlier_now_is_clamped() {
        let mut s = Scheduler::new(SchedConfig::default());
        s.add_client(SEC, 1, 1.0, None);
        s.acquire(SEC, 1);
        s.release(0, 1);
        assert_eq!(status_of(&s, 0, 1).total_held, 0);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Add(ClientId, f64, Option<f64>),
            Remove(ClientId),
            Acquire(ClientId),
            Release(ClientId),
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
                    ]
                )
                    .prop_map(|(i, w, l)| Op::Add(i, w, l)),
                id.clone().prop_map(Op::Remove),
                id.clone().prop_map(Op::Acquire),
                id.clone().prop_map(Op::Release),
                (0..120 * MS).prop_map(Op::Advance),
                Just(Op::Timeout),
            ]
        }

        fn config() -> impl Strategy<Value = SchedConfig> {
            (0..60 * MS, 0..2 * SEC, 0..300 * MS).prop_map(|(timeslice, window, grace)| {
                SchedConfig {
                    timeslice,
                    window,
                    grace,
                }
            })
        }

        fn check(s: &Scheduler, now: Nanos) {
            let st = s.status(now);
            let holding: Vec<_> = st
                .iter()
                .filter(|c| c.state == ClientState::Holding)
                .map(|c| c.client)
                .collect();
            assert!(holding.len() <= 1, "two holders: {holding:?}");
            if let Some(&h) = holding.first() {
                assert_eq!(s.holder(), Some(h));
            }
            if let Some(h) = s.holder() {
                let c = st.iter().find(|c| c.client == h).expect("holder known");
                assert!(matches!(
                    c.state,
                    ClientState::Holding | ClientState::Revoking
                ));
                assert!(!c.hung);
            }
            for c in &st {
                assert!((0.0..=1.0 + 1e-9).contains(&c.achieved), "{c:?}");
            }
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
                        Op::Add(i, w, l) => s.add_client(now, i, w, l),
                        Op::Remove(i) => s.remove_client(now, i),
                        Op::Acquire(i) => s.acquire(now, i),
                        Op::Release(i) => s.release(now, i),
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
}
