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
//!   Weighted fair shares (virtual time) apply within a class. While a
//!   lower class could use the GPU, `high` holds it for at most
//!   `high_share` of each window (Linux's real-time throttling), so no
//!   client can stall the others by asking for `high`: past its share a
//!   `high` holder is revoked like any other, and passed over if it does
//!   not let go.
//! - **Wake-up preemption**: a client that comes back from idle starts up to
//!   one timeslice behind the class's virtual clock (never ahead of what it
//!   had used), so an interactive process that used less than its share
//!   takes the GPU at once instead of waiting for the holder's slice to end.
//!   A busy newcomer gets the same one-time credit, which is bounded.
//! - **Fair among users first**, then among a user's units (its jobs, and
//!   its processes outside any job), then among a unit's processes
//!   (`set_user`, `set_group`, `reweigh`): ten jobs or ten processes of one
//!   user still get one user's part.
//! - **Liveness**: the broker cannot see whether a holder still launches,
//!   so while anyone waits no grant is open-ended: a holder whose slice ran
//!   out is recalled even when only lower classes wait (a busy one asks
//!   again and is granted back at once; for two wake periods meanwhile the
//!   GPU stays with its class), and one that does not answer is passed
//!   over (and shown hung after `grace`). The `high` class's share is
//!   charged only while one of its clients holds the GPU, never for a
//!   revoked or hung one.
//! - Between busy clients of one class, slices of `timeslice` (extended
//!   while the holder is still behind), so switches stay rare.
//! - `GPU_COMPUTE_LIMIT` is a sliding-window budget enforced even on an
//!   otherwise idle GPU; a unit's limit (a job's `--gpu-limit`) is one
//!   budget for all its members together, however many there are.
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
//!
//! Rooms: `types` (configuration, actions, what status shows), `grants`
//! (who holds the GPU: the step loop, grants and revokes), `limits`
//! (ceilings: a client's, its unit's, the `high` class's share), `meter`
//! (time on the GPU in a window), `status`; this file holds the state and
//! the entry points.

mod grants;
mod index;
mod limits;
mod meter;
mod status;
mod types;

use std::collections::{BTreeMap, VecDeque};

use index::{Index, Indexed};
use meter::Meter;

pub use gpufrac_common::config::Priority;
pub use types::{
    Action, ClientId, ClientState, ClientStatus, GrantId, GroupId, Nanos, SchedConfig, UserId,
    Weights, parse_weight, priority_name,
};

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
    /// Revoked only because its slice ran out while lower classes waited
    /// (liveness): the GPU stays with its class until it releases (a busy
    /// holder asks again and is granted at once), for `recall_hold` at
    /// most.
    recall: bool,
    /// Granted to a client that had been idle: its first slice is a burst
    /// (a request, a notebook cell) that must be queued whole, or the GPU's
    /// time-slicer would switch to others' leftover work at every gap.
    burst: bool,
}

#[derive(Debug, Clone)]
struct Client {
    /// The weight the client declared (or was given).
    own: f64,
    /// The unit that holds a share: a job (lease) or a user. Defaults to
    /// the client's own id, a unit of one.
    group: GroupId,
    /// The unit's weight when imposed (a lease's `--gpu-compute`); else
    /// the largest `own` among its active members.
    unit_weight: Option<f64>,
    /// The user the unit belongs to, and the user's weight; None: the
    /// unit stands for itself (weighed by its own unit weight), as a
    /// caller that knows no users has it.
    user: Option<(UserId, f64)>,
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
    /// On the GPU: holding, revoking or draining.
    meter: Meter,
    /// GPU time charged so far, ns.
    charged: f64,
    /// What it has put in the scheduler's index.
    idx: Indexed,
}

/// A unit with a ceiling of its own (a job's `--gpu-limit`): all its
/// members together stay within it, however many of them there are, and
/// however many sit idle.
#[derive(Debug, Clone, Default)]
struct Unit {
    limit: Option<f64>,
    /// On the GPU while any member is.
    meter: Meter,
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
    /// Units with a limit, and their time on the GPU (kept while the
    /// window still sees it, members or not).
    units: BTreeMap<GroupId, Unit>,
    /// The `high` class's time on the GPU, for its share of the window.
    high: Meter,
    next_seq: u64,
    next_grant: GrantId,
    actions: VecDeque<Action>,
    /// Charges are settled up to here.
    settled_at: Nanos,
    /// Latest time seen; earlier `now` arguments are clamped to it so a
    /// caller's clock hiccup cannot make durations underflow.
    now: Nanos,
    ix: Index,
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

/// Whose part a unit shares: an explicit user, or the unit itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum UserKey {
    User(UserId),
    Unit(GroupId),
}

/// A user's part, as a weight: a user of weight 1 weighs as a unit of
/// 100 (a lease of `--gpu-compute 100%`), so that callers that know no
/// users and those that do give weights of the same size.
const USER_SCALE: f64 = 100.0;

/// A unit's active members, for its weight and their split of it.
#[derive(Debug, Clone, Copy, Default)]
struct UnitSum {
    own_sum: f64,
    own_max: f64,
    imposed: Option<f64>,
}

impl UnitSum {
    fn add(&mut self, c: &Client) {
        self.own_sum += c.own;
        self.own_max = self.own_max.max(c.own);
        self.imposed = self.imposed.or(c.unit_weight);
    }

    /// The unit's weight among its user's units; 0 while it has no one.
    fn weight(&self) -> f64 {
        if self.own_sum > 0.0 {
            self.imposed.unwrap_or(self.own_max)
        } else {
            0.0
        }
    }
}

impl Client {
    fn user_key(&self) -> UserKey {
        match self.user {
            Some((u, _)) => UserKey::User(u),
            None => UserKey::Unit(self.group),
        }
    }

    fn on_gpu(&self) -> bool {
        matches!(self.state, ClientState::Holding | ClientState::Revoking)
            || self.draining_since.is_some()
    }

    /// Opens or closes the on-GPU interval after a state change.
    fn refresh_run(&mut self, now: Nanos) {
        self.meter.set(self.on_gpu(), now);
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
            units: BTreeMap::new(),
            high: Meter::default(),
            next_seq: 0,
            next_grant: 1,
            actions: VecDeque::new(),
            settled_at: 0,
            now: 0,
            ix: Index::default(),
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
                    own: weight,
                    group: id,
                    unit_weight: None,
                    user: None,
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
                    meter: Meter::default(),
                    charged: 0.0,
                    idx: Indexed::default(),
                },
            );
        }
        self.reindex(id);
        self.reschedule(now);
    }

    /// Puts a client in a unit (a job or a user) whose members split the
    /// unit's weight: `unit_weight` imposes it, `None` takes the largest
    /// weight among the unit's active members. `unit_limit` is a ceiling
    /// (a fraction of each window) for all the unit's members together,
    /// whatever their number. A unit's virtual time and usage history
    /// outlive its members' connections.
    pub fn set_group(
        &mut self,
        now: Nanos,
        id: ClientId,
        group: GroupId,
        unit_weight: Option<f64>,
        unit_limit: Option<f64>,
    ) {
        let user = self.clients.get(&id).and_then(|c| c.user);
        self.set_unit(now, id, group, unit_weight, unit_limit, user);
    }

    /// `set_group` and `set_user` in one event: the unit, and the user it
    /// belongs to (None: the unit stands for itself).
    pub fn set_unit(
        &mut self,
        now: Nanos,
        id: ClientId,
        group: GroupId,
        unit_weight: Option<f64>,
        unit_limit: Option<f64>,
        user: Option<(UserId, f64)>,
    ) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let c = self.clients.get_mut(&id).expect("checked above");
        c.user = user.map(|(u, w)| (u, sanitize_weight(w)));
        c.group = group;
        c.unit_weight = unit_weight.map(sanitize_weight);
        if let Some(d) = self.departed.remove(&(group, c.class.index())) {
            c.vtime = c.vtime.max(d.vtime);
            c.meter.adopt_history(d.history);
        }
        let unit_limit = sanitize_limit(unit_limit);
        match self.units.get_mut(&group) {
            Some(u) => u.limit = unit_limit,
            None if unit_limit.is_some() => {
                self.units.insert(
                    group,
                    Unit {
                        limit: unit_limit,
                        meter: Meter::default(),
                    },
                );
            }
            None => {}
        }
        self.reindex(id);
        self.reschedule(now);
    }

    /// Puts a client's unit under a user: users with work share the GPU
    /// by `weight` (within each class), then each user's units share the
    /// user's part by their unit weights, then a unit's members share the
    /// unit's part by their own weights. A user who splits work into many
    /// units or many processes still gets one user's part.
    pub fn set_user(&mut self, now: Nanos, id: ClientId, user: UserId, weight: f64) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let c = self.clients.get_mut(&id).expect("checked above");
        c.user = Some((user, sanitize_weight(weight)));
        self.reindex(id);
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
            self.unindex(id, &c);
            c.meter.set(false, now);
            let ahead = c.vtime > self.vclock[c.class.index()];
            let used = c.meter.usage(self.cfg.window, now) > 0;
            if c.group != id && (ahead || used) {
                let d = self.departed.entry((c.group, c.class.index())).or_default();
                d.vtime = d.vtime.max(c.vtime);
                if d.history.is_empty() {
                    d.history = c.meter.take_history();
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
        // One timeslice of its GPU time, in virtual time.
        let credit = cfg.timeslice as f64 / self.weight(&self.clients[&id]);
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {
                let floor = self.vclock[c.class.index()] - credit;
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
        self.reindex(id);
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
        self.reindex(id);
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
        self.reindex(id);
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
        let bounded = self.high_bounded(now);
        let holder_class = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .map(|c| c.class);
        let hold = self.recall_hold();
        for c in self.ix.granted.iter().map(|id| &self.clients[id]) {
            if let Some(g) = &c.grant
                && let Some(r) = g.revoked_at
                && !g.hung
            {
                consider(r.saturating_add(self.cfg.grace));
                if g.recall {
                    consider(r.saturating_add(hold));
                }
            }
        }
        for c in self.ix.on_gpu.iter().map(|id| &self.clients[id]) {
            if c.draining_since.is_some() {
                consider(c.drain_until);
            }
        }
        // Only an idle GPU, an open-ended holder or a holder of a lower
        // class reacts to a waiter's budget coming back; a pending
        // deadline re-evaluates anyway.
        for &(_, _, _, id) in &self.ix.waiting {
            let c = &self.clients[&id];
            if (waiter_times_matter || holder_class.is_some_and(|h| c.class > h))
                && let Some(t) = self.fits_at(c, now, bounded)
            {
                consider(t);
            }
        }
        next
    }

    pub fn handle_timeout(&mut self, now: Nanos) {
        let now = self.clock(now);
        let w = self.cfg.window;
        let clients = &mut self.clients;
        self.ix.metered.retain(|id| {
            let m = &mut clients
                .get_mut(id)
                .expect("metered clients are registered")
                .meter;
            m.prune(w, now);
            !m.is_empty()
        });
        for u in self.units.values_mut() {
            u.meter.prune(w, now);
        }
        self.high.prune(w, now);
        self.reschedule(now);
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
    /// GPU evenly among those with work, each by the weight the last event
    /// left it) and advances the virtual clocks.
    fn settle(&mut self, now: Nanos) {
        let dt = now.saturating_sub(self.settled_at);
        self.settled_at = self.settled_at.max(now);
        let n = self.ix.on_gpu.len();
        if dt > 0 && n > 0 {
            let share = dt as f64 / n as f64;
            let on: Vec<ClientId> = self.ix.on_gpu.iter().copied().collect();
            for id in on {
                let w = self.weight(&self.clients[&id]);
                let c = self
                    .clients
                    .get_mut(&id)
                    .expect("on the GPU means registered");
                c.vtime += share / w;
                c.charged += share;
                self.reindex(id);
            }
        }
        let holder = self.holder.map(|h| &self.clients[&h]);
        for class in Priority::ALL {
            // Revoking clients are left out: they are off the GPU's books
            // as far as the order goes and must not hold the clock back.
            let min_active = self
                .ix
                .waiting_in(class)
                .next()
                .map(|k| k.1.0)
                .into_iter()
                .chain(holder.filter(|c| c.class == class).map(|c| c.vtime))
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
}

#[cfg(test)]
mod tests;
