//! Per-GPU compute scheduler (docs/design.md, "The broker").
//!
//! A pure state machine: no I/O, no clock, no threads. Every entry point takes
//! the current monotonic time so the whole policy can be driven in virtual
//! time by tests and by the socket layer alike. Outputs are queued as
//! [`Action`]s (drained with [`Scheduler::poll_action`]) and the caller arms a
//! timer for [`Scheduler::next_timeout`].
//!
//! The policy, built around two rules: sharing through gpufrac never makes a
//! process wait longer than the GPU's own time-slicer would, and shares hold
//! whatever the kernel length.
//!
//! - **One holder may launch**, but a handover never waits for the previous
//!   holder's queued work: the revoke and the next grant leave in the same
//!   step. What the old holder still has queued runs on, interleaved by the
//!   GPU's time-slicer (which preempts within a quantum of ~2 ms), and the
//!   grant carries a *bound* on how much unfinished work a holder may keep
//!   queued while others share the GPU, so that what is left at a handover is
//!   short.
//! - **Charged by GPU time used**, not by time held: a client is on the GPU
//!   from its grant until its queued work has drained (`drained`), and while
//!   several are on it the time-slicer splits the GPU evenly, so each is
//!   charged `dt / n`. Long kernels that outlive a handover are paid for by
//!   their owner; weights then hold for 50 µs and 120 ms kernels alike.
//! - **Priority classes** (`high`, `normal`, `low`): a waiter of a higher
//!   class takes the GPU at once; `low` runs only when no one else wants it.
//!   Weighted fair shares (virtual time) apply within a class.
//! - **Wake-up preemption**: a client that comes back from idle starts up to
//!   one timeslice behind the class's virtual clock (never ahead of what it
//!   had used), so an interactive process that used less than its share
//!   takes the GPU at once instead of waiting for the holder's slice to end.
//!   A busy newcomer gets the same one-time credit, which is bounded.
//! - Between busy clients of one class, slices of `timeslice` (extended
//!   while the holder is still behind), so switches stay rare.
//! - `GPU_COMPUTE_LIMIT` is a sliding-window budget enforced even on an
//!   otherwise idle GPU.
//!
//! Protocol notes for the socket layer:
//! - A `Grant` for a grant id the client already holds is an *update* (it
//!   became contended, its slice was extended, its bound changed); a new id
//!   is a new grant. A shim ignores updates and revokes for an id it has
//!   already released.
//! - A revoked client that still has work sends `acquire` (before or after
//!   its `release`): it then waits at its charged virtual time.
//! - After a `release`, the client reports `drained` once its queued work
//!   has finished; until then it is charged as on the GPU (at most
//!   `drain_timeout`).

use std::collections::{BTreeMap, VecDeque};

pub use gpufrac_common::config::Priority;
use serde::{Deserialize, Serialize};

/// Monotonic nanoseconds, chosen by the caller.
pub type Nanos = u64;
/// One connected process.
pub type ClientId = u64;
/// Identifies one grant, so late updates and revokes can be told apart from a
/// new grant by the client.
pub type GrantId = u64;
/// A unit of fairness (a job or a user); chosen by the caller.
pub type GroupId = u64;

/// Units whose members all left, remembered while their virtual time is
/// still ahead of the class clock: at most this many.
const MAX_DEPARTED: usize = 1024;

/// What a unit leaves behind when its last member disconnects, so that
/// reconnecting does not wipe its history (a client that reconnected every
/// 250 ms once got a fresh start each time).
#[derive(Debug, Clone, Default)]
struct Departed {
    vtime: f64,
    history: VecDeque<(Nanos, Nanos)>,
}

const MS: Nanos = 1_000_000;
const US: Nanos = 1_000;
/// How many bounds of work a burst grant may keep queued.
const BURST_BOUND: Nanos = 8;

/// Hold intervals kept per client. Only the last `window` matters; the cap
/// keeps a client that spins acquire/release from growing memory without
/// bound.
const MAX_HISTORY: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedConfig {
    /// Contended slice between busy clients of one class (`--timeslice`).
    pub timeslice: Nanos,
    /// Sliding window for `GPU_COMPUTE_LIMIT` and for achieved share.
    pub window: Nanos,
    /// A revoked holder that has not released after this is reported hung.
    /// The GPU has already moved on at the revoke; it is charged either way.
    pub grace: Nanos,
    /// Most unfinished work a holder may keep queued while others share the
    /// GPU (`--inflight`); 0: no bound. It is what a newcomer may have to
    /// wait for beyond the time-slicer's own quantum, and what a handover
    /// leaves running.
    pub bound: Nanos,
    /// Longest a released client is charged for its queued work without
    /// saying it has drained.
    pub drain_timeout: Nanos,
    /// Longest a client that wakes up waits for a holder of its class,
    /// when it is not behind enough to take the GPU at once: about the
    /// GPU's own time-slice quantum.
    pub wake: Nanos,
}

impl Default for SchedConfig {
    /// 20 ms slices (a handover costs about a round trip and a hardware
    /// context switch, so 20 ms keeps switching under 1%), a 1 s window, a
    /// 200 ms grace, 250 µs of queued work, 5 s to drain.
    fn default() -> Self {
        SchedConfig {
            timeslice: 20 * MS,
            window: 1000 * MS,
            grace: 200 * MS,
            bound: 250 * US,
            drain_timeout: 5000 * MS,
            wake: 2 * MS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// `slice: None` is open-ended (uncontended, unlimited). A grant id the
    /// client already holds makes this an update of that grant. `bound` is
    /// the most unfinished work it may keep queued (0: none).
    Grant {
        client: ClientId,
        grant: GrantId,
        slice: Option<Nanos>,
        bound: Nanos,
        /// Someone else (of any class) wants the GPU: an idle holder hands
        /// it back early.
        waiters: bool,
    },
    /// Stop launching, then `release` (without waiting for queued work).
    Revoke { client: ClientId, grant: GrantId },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientState {
    Idle,
    Waiting,
    Holding,
    /// Revoked and not yet released (then `hung` past the grace). It is
    /// no longer the holder, but still charged.
    Revoking,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    pub client: ClientId,
    pub weight: f64,
    pub limit: Option<f64>,
    #[serde(with = "priority_name")]
    pub priority: Priority,
    pub state: ClientState,
    /// Fraction of the last window (or of its lifetime, if younger) during
    /// which the client was on the GPU (holding, or its work draining).
    pub achieved: f64,
    /// weight / sum of weights of active clients of the highest active
    /// class; 0 for an idle client or one of a lower class.
    pub target: f64,
    /// Time on the GPU (holding or draining), wall clock.
    pub total_held: Nanos,
    /// GPU time charged: wall time on the GPU, split evenly while several
    /// clients' work shared it.
    pub gpu_time: Nanos,
    /// Released, with queued work still running.
    pub draining: bool,
    /// Revoked, past its grace, still not released.
    pub hung: bool,
}

/// Priorities by name in status JSON (`"high"`), as users spell them.
pub mod priority_name {
    use super::Priority;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &Priority, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Priority, D::Error> {
        let s = String::deserialize(d)?;
        Priority::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown priority {s:?}")))
    }
}

#[derive(Debug, Clone)]
struct Outstanding {
    id: GrantId,
    start: Nanos,
    deadline: Option<Nanos>,
    revoked_at: Option<Nanos>,
    hung: bool,
    /// The bound last sent with this grant.
    bound: Nanos,
    /// `waiters` last sent with this grant.
    waiters: bool,
    /// Granted to a client that had been idle: its first slice is a burst
    /// (a request, a notebook cell) that must be queued whole, or the GPU's
    /// time-slicer would switch to others' leftover work at every gap.
    burst: bool,
}

#[derive(Debug, Clone)]
struct Client {
    /// Effective weight: the unit's weight split among its active members
    /// in proportion to `own` (see `reweigh`).
    weight: f64,
    /// The weight the client declared (or was given).
    own: f64,
    /// The unit that holds a share: a job (lease) or a user. Defaults to
    /// the client's own id, a unit of one.
    group: GroupId,
    /// The unit's weight when imposed (a lease's `--gpu-compute`); else
    /// the largest `own` among its active members.
    unit_weight: Option<f64>,
    limit: Option<f64>,
    class: Priority,
    state: ClientState,
    vtime: f64,
    /// FIFO stamp, taken each time the client starts waiting.
    seq: u64,
    added_at: Nanos,
    grant: Option<Outstanding>,
    /// Set by `acquire` while revoking: the release re-queues instead of
    /// idling.
    wants_again: bool,
    /// Released with work still queued, since then.
    draining_since: Option<Nanos>,
    /// Charged as draining at most until then without a `drained`.
    drain_until: Nanos,
    /// On the GPU (holding, revoking or draining) since then.
    run_start: Option<Nanos>,
    /// Closed on-GPU intervals, oldest first, non-overlapping.
    history: VecDeque<(Nanos, Nanos)>,
    total_closed: Nanos,
    /// GPU time charged so far, ns.
    charged: f64,
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedConfig,
    clients: BTreeMap<ClientId, Client>,
    holder: Option<ClientId>,
    /// Per class, never decreasing; tracks the least virtual time among the
    /// class's active clients. Clients that (re)activate start at most one
    /// timeslice lower, so idling banks little credit.
    vclock: [f64; 3],
    /// A client that just woke up and may preempt the holder.
    woke: Option<ClientId>,
    /// Clients that left idle and have not been granted since.
    waking: std::collections::BTreeSet<ClientId>,
    /// Per (unit, class): what departed members of a unit left behind.
    departed: BTreeMap<(GroupId, usize), Departed>,
    next_seq: u64,
    next_grant: GrantId,
    actions: VecDeque<Action>,
    /// Charges are settled up to here.
    settled_at: Nanos,
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
    fn on_gpu(&self) -> bool {
        matches!(self.state, ClientState::Holding | ClientState::Revoking)
            || self.draining_since.is_some()
    }

    /// Opens or closes the on-GPU interval after a state change.
    fn refresh_run(&mut self, now: Nanos) {
        match (self.on_gpu(), self.run_start) {
            (true, None) => self.run_start = Some(now),
            (false, Some(s)) => {
                self.run_start = None;
                self.close_interval(s, now);
            }
            _ => {}
        }
    }

    fn usage(&self, cfg: &SchedConfig, now: Nanos) -> Nanos {
        let lo = now.saturating_sub(cfg.window);
        let closed: Nanos = self
            .history
            .iter()
            .map(|&(s, e)| overlap(s, e, lo, now))
            .sum();
        let open = self.run_start.map_or(0, |s| overlap(s, now, lo, now));
        closed + open
    }

    fn budget(&self, cfg: &SchedConfig) -> Option<Nanos> {
        self.limit
            .map(|l| ((l * cfg.window as f64) as Nanos).max(1))
    }

    /// Smallest slice worth granting to a limited client: a fifth of a
    /// timeslice (or of the budget, if smaller). Without a floor a client
    /// hovering at its budget would get a stream of nanosecond grants.
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

    /// Earliest instant at which a waiting limited client becomes eligible,
    /// computed with the same integer arithmetic as `eligible` so that a
    /// timer armed for it never fires early. None while it is still on the
    /// GPU (its usage still grows) or already eligible.
    fn eligible_at(&self, cfg: &SchedConfig, now: Nanos) -> Option<Nanos> {
        let (budget, quantum) = (self.budget(cfg)?, self.quantum(cfg)?);
        let allowed = budget - quantum;
        let used = self.usage(cfg, now);
        if used <= allowed || self.run_start.is_some() {
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
        self.total_closed + self.run_start.map_or(0, |s| now.saturating_sub(s))
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

    /// One timeslice of this client's GPU time, in virtual time.
    fn credit(&self, cfg: &SchedConfig) -> f64 {
        cfg.timeslice as f64 / self.weight
    }
}

/// The waiter that would be picked: highest class, then least virtual time,
/// then FIFO.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    id: ClientId,
    class: Priority,
    vtime: f64,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Self {
        // Zero-length slices or windows would make deadlines fire at the
        // instant they are set and the timer loop spin.
        let cfg = SchedConfig {
            timeslice: cfg.timeslice.max(1),
            window: cfg.window.max(1),
            drain_timeout: cfg.drain_timeout.max(1),
            wake: cfg.wake.max(1),
            ..cfg
        };
        Scheduler {
            cfg,
            clients: BTreeMap::new(),
            holder: None,
            vclock: [0.0; 3],
            woke: None,
            waking: std::collections::BTreeSet::new(),
            departed: BTreeMap::new(),
            next_seq: 0,
            next_grant: 1,
            actions: VecDeque::new(),
            settled_at: 0,
            now: 0,
        }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Registers a client, idle. Re-adding a known id updates its weight,
    /// limit and class in place (time already used stays charged as it was).
    pub fn add_client(
        &mut self,
        now: Nanos,
        id: ClientId,
        weight: f64,
        limit: Option<f64>,
        class: Priority,
    ) {
        let now = self.clock(now);
        self.settle(now);
        let (weight, limit) = (sanitize_weight(weight), sanitize_limit(limit));
        if let Some(c) = self.clients.get_mut(&id) {
            c.own = weight;
            c.limit = limit;
            if c.class != class && c.state == ClientState::Waiting {
                c.vtime = c.vtime.max(self.vclock[class.index()]);
            }
            c.class = class;
        } else {
            self.clients.insert(
                id,
                Client {
                    weight,
                    own: weight,
                    group: id,
                    unit_weight: None,
                    limit,
                    class,
                    state: ClientState::Idle,
                    vtime: self.vclock[class.index()],
                    seq: 0,
                    added_at: now,
                    grant: None,
                    wants_again: false,
                    draining_since: None,
                    drain_until: 0,
                    run_start: None,
                    history: VecDeque::new(),
                    total_closed: 0,
                    charged: 0.0,
                },
            );
        }
        self.reschedule(now);
    }

    /// Puts a client in a unit (a job or a user) whose members split the
    /// unit's weight: `unit_weight` imposes it, `None` takes the largest
    /// weight among the unit's active members. A unit's virtual time and
    /// usage history outlive its members' connections.
    pub fn set_group(
        &mut self,
        now: Nanos,
        id: ClientId,
        group: GroupId,
        unit_weight: Option<f64>,
    ) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let c = self.clients.get_mut(&id).expect("checked above");
        c.group = group;
        c.unit_weight = unit_weight.map(sanitize_weight);
        if let Some(d) = self.departed.remove(&(group, c.class.index())) {
            c.vtime = c.vtime.max(d.vtime);
            if c.history.is_empty() {
                c.history = d.history;
            }
        }
        self.reschedule(now);
    }

    /// Disconnect. A holder's GPU goes to the next waiter at once, and the
    /// process's queued work is gone with it.
    pub fn remove_client(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        if let Some(mut c) = self.clients.remove(&id) {
            if let Some(s) = c.run_start.take() {
                c.close_interval(s, now);
            }
            let ahead = c.vtime > self.vclock[c.class.index()];
            let used = c.usage(&self.cfg, now) > 0;
            if c.group != id && (ahead || used) {
                let d = self.departed.entry((c.group, c.class.index())).or_default();
                d.vtime = d.vtime.max(c.vtime);
                if d.history.is_empty() {
                    d.history = std::mem::take(&mut c.history);
                }
                if self.departed.len() > MAX_DEPARTED {
                    let oldest = self
                        .departed
                        .iter()
                        .min_by(|a, b| a.1.vtime.total_cmp(&b.1.vtime))
                        .map(|(k, _)| *k);
                    if let Some(k) = oldest {
                        self.departed.remove(&k);
                    }
                }
            }
        }
        self.waking.remove(&id);
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
        let seq = self.next_seq;
        let cfg = self.cfg;
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {
                let floor = self.vclock[c.class.index()] - c.credit(&cfg);
                c.vtime = c.vtime.max(floor);
                c.state = ClientState::Waiting;
                // A shim launches a little with its request, before any
                // grant: that work is on the GPU (and charged) until it
                // reports it drained or is granted — at most two wake
                // periods (it is bounded to about that much work), so that
                // a lost report cannot keep a waiting client charged.
                if c.draining_since.is_none() {
                    c.draining_since = Some(now);
                    c.drain_until = now.saturating_add(cfg.wake.saturating_mul(2));
                }
                c.refresh_run(now);
                c.seq = seq;
                self.next_seq += 1;
                self.woke = Some(id);
                self.waking.insert(id);
            }
            ClientState::Revoking => c.wants_again = true,
            ClientState::Waiting | ClientState::Holding => {}
        }
        self.reschedule(now);
    }

    /// The client stopped launching: after a revoke, or early because it ran
    /// out of work. Its queued work may still run (see `drained`). From a
    /// waiting client it withdraws the request.
    pub fn release(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let seq = self.next_seq;
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {}
            ClientState::Waiting => {
                c.state = ClientState::Idle;
                self.waking.remove(&id);
            }
            ClientState::Holding | ClientState::Revoking => {
                c.grant = None;
                c.draining_since = Some(now);
                c.drain_until = now.saturating_add(self.cfg.drain_timeout);
                if std::mem::take(&mut c.wants_again) {
                    c.state = ClientState::Waiting;
                    c.seq = seq;
                    self.next_seq += 1;
                } else {
                    c.state = ClientState::Idle;
                }
                c.refresh_run(now);
                if self.holder == Some(id) {
                    self.holder = None;
                }
            }
        }
        self.reschedule(now);
    }

    /// Everything the client queued before its last release has finished.
    pub fn drained(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let c = self.clients.get_mut(&id).expect("checked above");
        c.draining_since = None;
        c.refresh_run(now);
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
        let mut consider = |t: Nanos| {
            if t > now {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        let mut waiter_times_matter = true;
        if let Some(g) = self.holder_grant() {
            if let Some(d) = g.deadline {
                consider(d);
                waiter_times_matter = false;
            }
            if g.burst {
                consider(g.start.saturating_add(self.cfg.timeslice));
            }
        }
        for c in self.clients.values() {
            if let Some(g) = &c.grant
                && let Some(r) = g.revoked_at
                && !g.hung
            {
                consider(r.saturating_add(self.cfg.grace));
            }
            if c.draining_since.is_some() {
                consider(c.drain_until);
            }
            // Only an idle GPU or an open-ended holder reacts to a waiter's
            // budget coming back; a pending deadline re-evaluates anyway.
            if waiter_times_matter
                && c.state == ClientState::Waiting
                && let Some(t) = c.eligible_at(&self.cfg, now)
            {
                consider(t);
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
        let top = self
            .clients
            .values()
            .filter(|c| c.is_active())
            .map(|c| c.class)
            .max();
        let active_weight: f64 = self
            .clients
            .values()
            .filter(|c| c.is_active() && Some(c.class) == top)
            .map(|c| c.weight)
            .sum();
        // Charges since the last settle, as settle would make them.
        let n = self.clients.values().filter(|c| c.on_gpu()).count().max(1);
        let pending = now.saturating_sub(self.settled_at) as f64 / n as f64;
        self.clients
            .iter()
            .map(|(&id, c)| {
                let span = self.cfg.window.min(now - c.added_at);
                let achieved = if span == 0 {
                    0.0
                } else {
                    (c.usage(&self.cfg, now) as f64 / span as f64).min(1.0)
                };
                let charged = c.charged + if c.on_gpu() { pending } else { 0.0 };
                ClientStatus {
                    client: id,
                    weight: c.weight,
                    limit: c.limit,
                    priority: c.class,
                    state: c.state,
                    achieved,
                    target: if c.is_active() && Some(c.class) == top {
                        c.weight / active_weight
                    } else {
                        0.0
                    },
                    total_held: c.total_held(now),
                    gpu_time: charged as Nanos,
                    draining: c.draining_since.is_some(),
                    hung: c.grant.as_ref().is_some_and(|g| g.hung),
                }
            })
            .collect()
    }

    /// The client that may launch now.
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

    /// Charges everyone on the GPU up to `now` (the time-slicer splits the
    /// GPU evenly among those with work) and advances the virtual clocks.
    /// Splits each unit's weight among its active members in proportion
    /// to their own weights; an inactive member is weighed as if it were
    /// about to join (so its wake-up credit is what it would get).
    fn reweigh(&mut self) {
        let mut units: BTreeMap<GroupId, (f64, f64)> = BTreeMap::new();
        for c in self.clients.values() {
            if c.is_active() || c.on_gpu() {
                let u = units.entry(c.group).or_insert((0.0, 0.0));
                u.0 += c.own;
                u.1 = u.1.max(c.own);
            }
        }
        for c in self.clients.values_mut() {
            let active = c.is_active() || c.on_gpu();
            let (sum, max) = units.get(&c.group).copied().unwrap_or((0.0, 0.0));
            let sum = if active { sum } else { sum + c.own };
            let unit = c.unit_weight.unwrap_or(max.max(c.own));
            c.weight = sanitize_weight(unit * c.own / sum);
        }
    }

    fn settle(&mut self, now: Nanos) {
        self.reweigh();
        let dt = now.saturating_sub(self.settled_at);
        self.settled_at = self.settled_at.max(now);
        let n = self.clients.values().filter(|c| c.on_gpu()).count();
        if dt > 0 && n > 0 {
            let share = dt as f64 / n as f64;
            for c in self.clients.values_mut().filter(|c| c.on_gpu()) {
                c.vtime += share / c.weight;
                c.charged += share;
            }
        }
        for class in Priority::ALL {
            // Revoking clients are left out: they are off the GPU's books
            // as far as the order goes and must not hold the clock back.
            let min_active = self
                .clients
                .iter()
                .filter(|&(&id, c)| {
                    c.class == class && (c.state == ClientState::Waiting || Some(id) == self.holder)
                })
                .map(|(_, c)| c.vtime)
                .min_by(f64::total_cmp);
            if let Some(m) = min_active {
                let v = &mut self.vclock[class.index()];
                *v = v.max(m);
            }
        }
        // A unit that is no longer ahead of its class needs no memory.
        let (vclock, lo) = (self.vclock, now.saturating_sub(self.cfg.window));
        self.departed.retain(|&(_, class), d| {
            d.history.retain(|&(_, e)| e > lo);
            d.vtime > vclock[class] || !d.history.is_empty()
        });
    }

    /// The eligible waiter that would be picked, other than `except`.
    fn best_waiter(&self, now: Nanos, except: Option<ClientId>) -> Option<Candidate> {
        self.clients
            .iter()
            .filter(|&(&id, c)| {
                Some(id) != except && c.state == ClientState::Waiting && c.eligible(&self.cfg, now)
            })
            .min_by(|a, b| {
                b.1.class
                    .cmp(&a.1.class)
                    .then(a.1.vtime.total_cmp(&b.1.vtime))
                    .then(a.1.seq.cmp(&b.1.seq))
            })
            .map(|(&id, c)| Candidate {
                id,
                class: c.class,
                vtime: c.vtime,
            })
    }

    /// The bound `id` gets as holder: only while someone who could take the
    /// GPU from it or follow it is registered (a client of its class or
    /// higher); during the first slice of a burst, eight times as much (a
    /// request of many short kernels is queued whole, while a batch job that
    /// wakes up still cannot queue seconds of work).
    fn bound_for(&self, now: Nanos, id: ClientId) -> Nanos {
        let Some(c) = self.clients.get(&id) else {
            return 0;
        };
        let in_burst = c
            .grant
            .as_ref()
            .is_some_and(|g| g.burst && now < g.start.saturating_add(self.cfg.timeslice));
        let others = self
            .clients
            .iter()
            .any(|(&o, oc)| o != id && oc.class >= c.class);
        match (others, in_burst) {
            (false, _) => 0,
            (true, false) => self.cfg.bound,
            (true, true) => self.cfg.bound.saturating_mul(BURST_BOUND),
        }
    }

    /// Brings the state to a fixed point for `now`; every step either makes
    /// progress or stops, so the loop is short.
    fn reschedule(&mut self, now: Nanos) {
        self.settle(now);
        let cfg = self.cfg;
        for c in self.clients.values_mut() {
            if let Some(g) = c.grant.as_mut()
                && let Some(r) = g.revoked_at
                && r.saturating_add(cfg.grace) <= now
            {
                g.hung = true;
            }
            if c.draining_since.is_some() && c.drain_until <= now {
                c.draining_since = None;
                c.refresh_run(now);
            }
        }
        for _ in 0..self.clients.len() * 2 + 4 {
            if !self.step(now) {
                break;
            }
        }
        self.woke = None;
        self.reweigh();
    }

    fn revoke(&mut self, now: Nanos, h: ClientId) {
        let c = self.clients.get_mut(&h).expect("holder is registered");
        let g = c.grant.as_mut().expect("holder has a grant");
        g.revoked_at = Some(now);
        g.deadline = None;
        c.state = ClientState::Revoking;
        let gid = g.id;
        self.holder = None;
        self.actions.push_back(Action::Revoke {
            client: h,
            grant: gid,
        });
    }

    fn step(&mut self, now: Nanos) -> bool {
        let Some(h) = self.holder else {
            return match self.best_waiter(now, None) {
                Some(next) => {
                    self.grant_to(now, next.id);
                    true
                }
                None => false,
            };
        };
        let cfg = self.cfg;
        let bound = self.bound_for(now, h);
        let best = self.best_waiter(now, Some(h));
        // Anyone at all waiting (any class): an idle holder hands back.
        let waiters = best.is_some();
        let woke = self.woke.take();
        let c = self.clients.get(&h).expect("holder is registered");
        let (class, vtime, weight) = (c.class, c.vtime, c.weight);
        // A waiter of a higher class takes the GPU at once; one that just
        // woke up behind the holder in virtual time does too.
        // (Behind by more than a quarter slice of the holder's time, so that
        // two clients waking together do not take the GPU from each other.)
        let gran = cfg.timeslice as f64 / 4.0 / weight;
        if let Some(w) = best
            && (w.class > class
                || (w.class == class && woke == Some(w.id) && w.vtime + gran < vtime))
        {
            self.revoke(now, h);
            return true;
        }
        // One that woke up without being behind waits no longer than the
        // GPU's own time-slicer would make it wait: the holder's slice ends
        // within `wake`, and the usual order decides then.
        let woke_here = woke.is_some_and(|id| {
            self.clients.get(&id).is_some_and(|w| {
                w.class == class && w.state == ClientState::Waiting && w.eligible(&cfg, now)
            })
        });
        let wake_by = now.saturating_add(cfg.wake);
        // Lower classes do not contend with the holder.
        let best = best.filter(|w| w.class == class);
        let contended = best.is_some();
        let remaining = c.remaining(&cfg, now);
        let quantum = c.quantum(&cfg);
        let g = c.grant.as_ref().expect("holder has a grant");
        let (gid, start, deadline) = (g.id, g.start, g.deadline);
        let unchanged = g.bound == bound && g.waiters == waiters;
        // What to do: Some(slice) grants (or updates) with that slice,
        // None revokes.
        let action: Option<Option<Nanos>> = match deadline {
            Some(d) if d <= now => {
                // A holder still behind the best waiter keeps the GPU for
                // the real time that brings it level (at least a fifth of a
                // slice, so a small deficit does not cost a switch).
                let ext = best.map(|b| {
                    (((b.vtime - vtime).max(0.0) * weight) as Nanos)
                        .clamp(cfg.timeslice / 5, cfg.timeslice)
                });
                if best.is_some_and(|b| vtime >= b.vtime) {
                    None
                } else if let (Some(r), Some(q)) = (remaining, quantum) {
                    (r >= q).then(|| Some(r.min(cfg.timeslice).min(ext.unwrap_or(Nanos::MAX))))
                } else if contended {
                    Some(Some(ext.unwrap_or(cfg.timeslice)))
                } else {
                    Some(None)
                }
            }
            Some(d) if woke_here && d > wake_by => Some(Some(cfg.wake)),
            Some(d) => {
                if unchanged {
                    return false;
                }
                Some(Some(d - now))
            }
            None if contended || remaining.is_some() => {
                // A newcomer waits for the holder's first timeslice to run
                // out, counted from its grant; a holder that already had that
                // much is revoked now: its solo run is paid for.
                let d = start.saturating_add(cfg.timeslice).max(now);
                let d = match remaining {
                    Some(r) => d.min(now + r),
                    None => d,
                };
                let d = if woke_here { d.min(wake_by) } else { d };
                (d > now).then_some(Some(d - now))
            }
            None => {
                if unchanged {
                    return false;
                }
                Some(None)
            }
        };
        match action {
            Some(slice) => {
                let c = self.clients.get_mut(&h).expect("holder is registered");
                let g = c.grant.as_mut().expect("holder has a grant");
                g.deadline = slice.map(|s| now + s);
                g.bound = bound;
                g.waiters = waiters;
                self.actions.push_back(Action::Grant {
                    client: h,
                    grant: gid,
                    slice,
                    bound,
                    waiters,
                });
            }
            None => self.revoke(now, h),
        }
        true
    }

    fn grant_to(&mut self, now: Nanos, id: ClientId) {
        let cfg = self.cfg;
        let burst = self.waking.remove(&id);
        let class = self.clients[&id].class;
        let best = self.best_waiter(now, Some(id));
        let contended = best.is_some_and(|w| w.class >= class);
        let waiters = best.is_some();
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
            deadline: slice.map(|s| now + s),
            revoked_at: None,
            hung: false,
            bound: 0,
            waiters: false,
            burst,
        });
        // Its own earlier work now counts as part of the holding.
        c.draining_since = None;
        c.refresh_run(now);
        self.holder = Some(id);
        let bound = self.bound_for(now, id);
        if let Some(g) = self.clients.get_mut(&id).and_then(|c| c.grant.as_mut()) {
            g.bound = bound;
            g.waiters = waiters;
        }
        self.actions.push_back(Action::Grant {
            client: id,
            grant: gid,
            slice,
            bound,
            waiters,
        });
    }
}

#[cfg(test)]
mod tests {
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
                        let (due, later): (Vec<_>, Vec<_>) =
                            self.drains.iter().partition(|e| e.0 <= t);
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
        sim.s.set_group(0, 0, 500, None);
        for id in 1..=10 {
            sim.add(id, 100.0, None);
            sim.s.set_group(0, id, 600, None);
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
        sim.s.set_group(0, 1, 900, None);
        sim.residual.insert(1, B);
        sim.start(1);
        let mut id = 100;
        sim.add(id, 50.0, None);
        sim.s.set_group(0, id, 901, None);
        sim.start(id);
        let end = 20 * SEC;
        while sim.now + 250 * MS < end {
            let t = sim.now + 250 * MS;
            sim.run_until(t);
            sim.s.remove_client(t, id);
            id += 1;
            sim.add(id, 50.0, None);
            sim.s.set_group(t, id, 901, None);
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
        sim.s.set_group(0, id, 42, None);
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
            sim.s.set_group(t, id, 42, None);
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
        let mut s = Scheduler::new(SchedConfig::default());
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
        let mut sim = Sim::new(SchedConfig::default());
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
        assert!(c.history.len() <= MAX_HISTORY);
        assert_eq!(c.total_closed, 100_000);
        assert_eq!(c.usage(&s.cfg, t), 100_000);
        s.handle_timeout(t + 2 * SEC);
        assert!(s.clients[&1].history.is_empty());
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
            Group(ClientId, GroupId, Option<f64>),
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
                    prop_oneof![Just(None), Just(Some(25.0)), Just(Some(f64::INFINITY))]
                )
                    .prop_map(|(i, g, w)| Op::Group(i, g, w)),
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
            )
                .prop_map(|(timeslice, window, grace, bound, drain_timeout, wake)| {
                    SchedConfig {
                        timeslice,
                        window,
                        grace,
                        bound,
                        drain_timeout,
                        wake,
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
                        Op::Group(i, g, w) => s.set_group(now, i, g, w),
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
