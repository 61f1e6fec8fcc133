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
//! - **Fair among users first**, then among a user's units (its jobs, and
//!   its processes outside any job), then among a unit's processes
//!   (`set_unit`): hierarchical virtual time (the fair tree, `tree`), a
//!   virtual time per user, per unit within it and per process within
//!   that, each charged by its weight at its level. A user's debt and its
//!   wake-up credit are the user's: they outlive its processes and
//!   connections, so ten jobs, ten processes or a thousand connections
//!   that take turns still get one user's part.
//! - **Wake-up credit, per user, earned**: a user that starts competing
//!   again (none of its clients waits or holds) keeps the lag it had behind
//!   the band's clock when it left, plus credit earned at a tenth of the
//!   time away, up to one timeslice of its own (never ahead of what it had
//!   used; `woken`), so an interactive user that uses less than its share
//!   takes the GPU at once instead of waiting for the holder's slice to
//!   end, and one that works half of each period cannot take its whole
//!   on-time back. A connection of a user already competing gets no
//!   credit against other users.
//! - **Never longer than the time-slicer**: a waker not behind enough to
//!   take the GPU at once is owed it within `wake` by the user that held
//!   it then (across that user's own changes of holder), unless it is over
//!   a slice ahead of the holder (`owed`, `yields_to`); handed over, it
//!   has a quantum (a fifth of a slice), then the usual order decides.
//! - **Priority buys latency, never throughput** (Borrowed Virtual Time):
//!   `high` and `normal` share one virtual time per user; a `high` waiter is
//!   placed two slices of its own ahead of it (a warp) and takes the GPU at
//!   once when that puts it behind the holder, but every moment it holds is
//!   charged to its user like any other, so a busy `high` user gets one
//!   user's part. While a lower class could use the GPU, `high` holds it
//!   for at most `high_share` of each window (Linux's real-time
//!   throttling) on top of that, kept by users (`high`). `low` runs only
//!   when no one above has a request to grant.
//! - **Liveness**: the broker cannot see whether a holder still launches,
//!   so while anyone waits no grant is open-ended: a holder whose slice ran
//!   out is recalled even when only `low` waits (a busy one asks again and
//!   is granted back at once; for two wake periods meanwhile the GPU stays
//!   with its band; once in four slices for one the driver saw at
//!   work), and one that does not answer is passed over (and shown hung
//!   after `grace`). The `high` class's share is charged only
//!   while one of its clients holds the GPU (and a lower class waits),
//!   never for a revoked or hung one.
//! - Between busy clients of one band, slices of `timeslice` (extended
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
//! Rooms: `types` (configuration, actions, what status shows), `tree` (the
//! fair tree's nodes and their waiters), `index` (what an event looks up
//! without a scan, and the hierarchy's weights), `grants` (who holds the
//! GPU: the step loop, grants and revokes), `limits` (ceilings: a
//! client's, its unit's), `high` (the `high` class's share, by users),
//! `meter` (time on the
//! GPU in a window), `status`; this file holds the state and the entry
//! points.

mod entitled;
mod evidence;
mod grants;
mod high;
mod index;
mod limits;
mod meter;
mod status;
mod tree;
mod types;

use std::collections::{BTreeMap, VecDeque};

use index::{Index, Indexed};
use meter::Meter;
use tree::{BANDS, Level, UnitRef, UserRef, Vt, band};

pub use gpufrac_common::config::Priority;
pub use types::{
    Action, ClientId, ClientState, ClientStatus, GrantId, GroupId, Nanos, SchedConfig, UserId,
    Weights, parse_weight,
};

const MS: Nanos = 1_000_000;
const US: Nanos = 1_000;
/// How many bounds of work a burst grant may keep queued.
const BURST_BOUND: Nanos = 8;
/// A `high` waiter's warp, in slices of its own GPU time: more than a
/// holder's lead over the clock (a slice, and the quarter slice a waker
/// must be behind by), so an interactive `high` process takes the GPU at
/// once even when its user is as busy as the holder's.
const WARP_SLICES: f64 = 2.0;

/// How fast a node that does not compete earns wake-up credit, as a part
/// of real time (`woken`).
const WAKE_ACCRUAL: f64 = 0.1;

/// A waker, when its quantum is up, and the user (in a band) that owes
/// it the GPU: the one that held it when the waker came.
type Owed = (ClientId, Nanos, UserRef);

impl Outstanding {
    /// Recalled, and its band keeps the GPU for its answer until
    /// `recall_hold` after the revoke.
    fn awaits_recall_answer(&self, now: Nanos, hold: Nanos) -> bool {
        self.recall
            && self
                .revoked_at
                .is_some_and(|r| now < r.saturating_add(hold))
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
    /// Revoked only because its slice ran out while a lower band waited
    /// (liveness): the GPU stays with its band until it releases (a busy
    /// holder asks again and is granted at once), for `recall_hold` at
    /// most.
    recall: bool,
    /// Revoked for a waiter that took the GPU at once, or at the end of
    /// its run alone (not at the end of a contended slice).
    preempted: bool,
    /// It held alone (an open-ended grant) and its slice now ends for a
    /// waker of its band: a revoke at that end is `preempted`.
    solo: bool,
    /// How long its first slice runs once another contends: a slice, or
    /// a quantum for a waker handed the GPU it was owed.
    first: Nanos,
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
    /// Its virtual time among its unit's members (the unit's and the
    /// user's are the tree's).
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
    /// Its target share integrated over the time it was busy within its
    /// ceilings, and the time its ceilings held it back while busy, ns
    /// (`entitled`).
    entitled: f64,
    held_back: f64,
    /// What it has put in the scheduler's index.
    idx: Indexed,
    /// What the driver's samples said of its process's work, against
    /// its time on the GPU (`evidence`).
    work: evidence::Record,
    /// When it was last recalled (`evidence::recall_due`).
    recalled_at: Option<Nanos>,
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
    /// A client that just started waiting, and the highest level of the
    /// tree that started competing with it: it may preempt the holder.
    woke: Option<(ClientId, Level)>,
    /// Clients that left idle and have not been granted since.
    waking: std::collections::BTreeSet<ClientId>,
    /// Units with a limit, and their time on the GPU (kept while the
    /// window still sees it, members or not).
    units: BTreeMap<GroupId, Unit>,
    /// The `high` class's and its users' time on the GPU taken from a
    /// lower class, for its share of the window.
    high: high::High,
    next_seq: u64,
    next_grant: GrantId,
    actions: VecDeque<Action>,
    /// Charges are settled up to here.
    settled_at: Nanos,
    /// Each busy client's part of the time since the last event
    /// (`entitled`).
    parts: Vec<(ClientId, entitled::Part)>,
    /// Latest time seen; earlier `now` arguments are clamped to it so a
    /// caller's clock hiccup cannot make durations underflow.
    now: Nanos,
    /// Memberless nodes of the tree were last pruned then.
    pruned_at: Nanos,
    ix: Index,
    /// The driver reports per-process work until then (`work_seen`).
    evidence_until: Nanos,
    /// Per user, time held without evidence of work while a lower band
    /// waited (its benefit of the doubt, `evidence`), and whose meter runs.
    doubt: BTreeMap<UserRef, Meter>,
    doubting: Option<UserRef>,
    /// Per user (in a band), not granted before then: its holder answered
    /// a recall by asking again without evidence of work (`evidence`). The
    /// user's, so that a new connection or process of it waits too.
    deferred: BTreeMap<UserRef, evidence::Deferral>,
    /// A waker of another user than the holder's, owed the GPU by the
    /// holder's user (`Owed`): the holder's deadline is no later than its
    /// quantum, and it yields to the waker then (`Scheduler::yields_to`).
    owed: Option<Owed>,
    /// The waker a holder just yielded to: it has the GPU next if it still
    /// waits and may run, whoever comes first in the order (the yielding
    /// holder's own sibling did).
    handoff: Option<ClientId>,
    /// Per band: after the last event its holder's user had no other
    /// user's waiter that may run beside it, so until this event the
    /// band's clock followed that user (`refresh`).
    alone: [bool; BANDS],
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

    /// Its user in the fair tree (in its band).
    fn user_ref(&self) -> UserRef {
        (band(self.class), self.user_key())
    }

    /// Its unit in the fair tree.
    fn path(&self) -> UnitRef {
        (band(self.class), self.user_key(), self.group)
    }

    /// How far ahead of a node's virtual time a request of this client is
    /// placed, for a node of `weight` at its level: `warp` ns of that
    /// node's GPU time for `high`, none otherwise.
    fn warp(&self, warp: f64, weight: f64) -> f64 {
        if self.class == Priority::High {
            warp / weight
        } else {
            0.0
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
            evidence: cfg.evidence.max(1),
            ..cfg
        };
        Scheduler {
            cfg,
            clients: BTreeMap::new(),
            holder: None,
            woke: None,
            waking: std::collections::BTreeSet::new(),
            units: BTreeMap::new(),
            high: high::High::default(),
            next_seq: 0,
            next_grant: 1,
            actions: VecDeque::new(),
            settled_at: 0,
            parts: Vec::new(),
            now: 0,
            pruned_at: 0,
            ix: Index::default(),
            evidence_until: 0,
            doubt: BTreeMap::new(),
            doubting: None,
            deferred: BTreeMap::new(),
            owed: None,
            handoff: None,
            alone: [false; BANDS],
        }
    }

    #[cfg(test)]
    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// The warp of a `high` request, in ns of GPU time (see `Client::warp`).
    fn warp(&self) -> f64 {
        WARP_SLICES * self.cfg.timeslice as f64
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
                    vtime: 0.0,
                    seq: 0,
                    added_at: now,
                    grant: None,
                    wants_again: false,
                    draining_since: None,
                    drain_until: 0,
                    meter: Meter::default(),
                    charged: 0.0,
                    idx: Indexed::default(),
                    work: evidence::Record::default(),
                    recalled_at: None,
                    entitled: 0.0,
                    held_back: 0.0,
                },
            );
        }
        self.moved(id);
        self.reindex(id);
        self.reschedule(now);
    }

    /// Puts a client in a unit (a job or a user) whose members split the
    /// unit's weight: `unit_weight` imposes it, `None` takes the largest
    /// weight among the unit's active members. `unit_limit` is a ceiling
    /// (a fraction of each window) for all the unit's members together,
    /// whatever their number. A unit's virtual time and usage history
    /// outlive its members' connections.
    #[cfg(test)]
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
        self.moved(id);
        self.reindex(id);
        self.reschedule(now);
    }

    /// Puts a client's unit under a user: users with work share the GPU
    /// by `weight` (within each band), then each user's units share the
    /// user's part by their unit weights, then a unit's members share the
    /// unit's part by their own weights. A user who splits work into many
    /// units or many processes still gets one user's part.
    #[cfg(test)]
    pub fn set_user(&mut self, now: Nanos, id: ClientId, user: UserId, weight: f64) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        let c = self.clients.get_mut(&id).expect("checked above");
        c.user = Some((user, sanitize_weight(weight)));
        self.moved(id);
        self.reindex(id);
        self.reschedule(now);
    }

    /// After a change of class, unit or user: a client whose unit in the
    /// tree changed joins the new one at the unit's clock (its own virtual
    /// time orders it only among that unit's members) and takes up the
    /// usage history a departed member left there. A waiting client
    /// starts competing there as one that woke up would.
    fn moved(&mut self, id: ClientId) {
        let c = &self.clients[&id];
        let p = c.path();
        if c.idx.path == Some(p) {
            return;
        }
        let waiting = c.state == ClientState::Waiting;
        self.ix.tree.ensure(p);
        let x = self.ix.tree.units.get_mut(&p).expect("ensured");
        let (clock, left) = (x.n.clock, std::mem::take(&mut x.left));
        let c = self.clients.get_mut(&id).expect("known client");
        c.vtime = clock;
        c.meter.adopt_history(left);
        if waiting {
            self.compete(id);
        }
    }

    /// A client is about to wait: the nodes of its branch that were not
    /// competing (no client below them waits or holds) start where
    /// `woken` places them behind their parent's clock: a user's wake-up
    /// credit is the user's, a unit's and a process's only order them
    /// within their user. Returns the highest level that starts
    /// competing.
    fn compete(&mut self, id: ClientId) -> Level {
        let c = &self.clients[&id];
        let (p, l) = (c.path(), self.levels(c));
        let (ts, now) = (self.cfg.timeslice as f64, self.now);
        let held = self
            .holder
            .filter(|&h| h != id)
            .and_then(|h| self.clients.get(&h))
            .map(Client::path);
        let t = &mut self.ix.tree;
        t.ensure(p);
        let user_on =
            t.users[&(p.0, p.1)].n.waiting > 0 || held.is_some_and(|q| (q.0, q.1) == (p.0, p.1));
        let unit_on = t.units[&p].n.waiting > 0 || held == Some(p);
        if !user_on {
            let clock = t.clock[p.0];
            let n = &mut t.users.get_mut(&(p.0, p.1)).expect("ensured").n;
            n.vtime = woken(n, clock, ts, l.user, now);
        }
        if !unit_on {
            let clock = t.users[&(p.0, p.1)].n.clock;
            let n = &mut t.units.get_mut(&p).expect("ensured").n;
            n.vtime = woken(n, clock, ts, l.unit, now);
        }
        let floor = t.units[&p].n.clock - ts / l.own;
        t.stale.push(p);
        let c = self.clients.get_mut(&id).expect("known client");
        c.vtime = c.vtime.max(floor);
        match (user_on, unit_on) {
            (false, _) => Level::User,
            (true, false) => Level::Unit,
            (true, true) => Level::Client,
        }
    }

    /// Disconnect. A holder's GPU goes to the next waiter at once, and the
    /// process's queued work is gone with it.
    pub fn remove_client(&mut self, now: Nanos, id: ClientId) {
        if !self.clients.contains_key(&id) {
            return;
        }
        let now = self.clock(now);
        self.settle(now);
        // A holder that leaves is judged as one that lets go: a new
        // process each millisecond, the last exiting as the next asked,
        // handed the GPU on within its user and was never judged (a
        // `low` victim waited on an idle GPU 55% of the time, all of it
        // without the harness's bound on the broker's work).
        self.judge_letting_go(now, id);
        if let Some(mut c) = self.clients.remove(&id) {
            c.meter.set(false, now);
            // Its own limit's window survives a reconnect: the next member
            // of its unit takes the history up.
            if c.meter.usage(self.cfg.window, now) > 0
                && let Some(x) = self.ix.tree.units.get_mut(&c.path())
                && x.left.is_empty()
            {
                x.left = c.meter.take_history();
            }
            self.unindex(id, &c);
            self.ix.tree.evict();
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
        match self.clients[&id].state {
            ClientState::Idle => {
                let level = self.compete(id);
                let c = self.clients.get_mut(&id).expect("checked above");
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
                self.woke = Some((id, level));
                self.waking.insert(id);
            }
            ClientState::Revoking => {
                self.clients
                    .get_mut(&id)
                    .expect("checked above")
                    .wants_again = true;
            }
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
        // A holder that lets go by itself is judged as at a revoke: one
        // without work that let go within each slice and asked again was
        // never revoked, so never judged (`evidence`).
        self.judge_letting_go(now, id);
        let seq = self.next_seq;
        let c = self.clients.get_mut(&id).expect("checked above");
        match c.state {
            ClientState::Idle => {}
            ClientState::Waiting => {
                c.state = ClientState::Idle;
                self.waking.remove(&id);
            }
            ClientState::Holding | ClientState::Revoking => {
                let preempted = c.grant.take().is_some_and(|g| g.preempted);
                c.draining_since = Some(now);
                c.drain_until = now.saturating_add(self.cfg.drain_timeout);
                if std::mem::take(&mut c.wants_again) {
                    c.state = ClientState::Waiting;
                    c.seq = seq;
                    self.next_seq += 1;
                    // A `high` holder the GPU was taken from for another
                    // (`preempted`), that asked again before letting go,
                    // is served within `wake` as one that woke up (an
                    // interactive burst asked as its idle grant was taken
                    // waited 24 ms for the taker's credit); not one whose
                    // slice ran out, or two busy ones would hand over
                    // every `wake`.
                    if preempted && c.class == Priority::High {
                        self.woke = Some((id, Level::Client));
                    }
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

    /// A sample of the driver's per-process work: the processes of
    /// `busy` ran kernels on this GPU since the previous sample, each
    /// keeping it busy that many percent of the time. That a sample comes
    /// at all says that the GPU reports per-process work (for `evidence`
    /// from now): while a lower band waits, a holder is then granted past
    /// its slice only on work in proportion to the time it held
    /// (`evidence`).
    pub fn work_seen(&mut self, now: Nanos, busy: impl IntoIterator<Item = (ClientId, u32)>) {
        let now = self.clock(now);
        self.settle(now);
        let last = self.evidence_until.saturating_sub(self.cfg.evidence);
        let span = now.saturating_sub(last).min(self.cfg.evidence);
        self.evidence_until = now.saturating_add(self.cfg.evidence);
        let busy: BTreeMap<ClientId, u32> = busy.into_iter().collect();
        let keep = self.cfg.evidence;
        let mut proven = Vec::new();
        for (&id, c) in self.clients.iter_mut() {
            let pct = busy.get(&id).copied().unwrap_or(0);
            c.work.add(now, c.meter.total(now), span, pct, keep);
            if c.work.proven(now, keep) {
                proven.push(id);
            }
        }
        for id in proven {
            self.evidence_of(now, id);
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
        let holder_band = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .map(|c| band(c.class));
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
        // band reacts to a waiter's budget coming back; a pending
        // deadline re-evaluates anyway. A `high` holder's meters start
        // when a lower waiter's budget comes back (`sync_high`).
        let high_holds = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .is_some_and(|c| c.class == Priority::High);
        for id in self.ix.waiting.iter().flatten() {
            let c = &self.clients[id];
            if (waiter_times_matter
                || holder_band.is_some_and(|h| band(c.class) > h)
                || (high_holds && c.class < Priority::High))
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
        self.prune_doubt(now);
        // Tidying only (the number kept is bounded anyway): once a window.
        if now >= self.pruned_at.saturating_add(w) {
            self.pruned_at = now;
            self.ix.tree.prune(w, now);
        }
        self.reschedule(now);
    }

    fn clock(&mut self, now: Nanos) -> Nanos {
        self.now = self.now.max(now);
        self.ix.tree.now = self.now;
        self.now
    }

    fn holder_grant(&self) -> Option<&Outstanding> {
        self.holder
            .and_then(|h| self.clients.get(&h))
            .and_then(|c| c.grant.as_ref())
    }

    /// Charges everyone on the GPU up to `now` (the time-slicer splits the
    /// GPU evenly among those with work), each level of its branch by its
    /// weight there as the last event left it, and advances the clocks.
    /// A client's virtual time is charged as one of those on the GPU of
    /// its band or above: lower bands' clients left on the GPU (revoked,
    /// not yet answering, or draining) do not thin a higher band's charge
    /// (status's GPU time stays the even split). Thinned,
    /// a band's clock crawled while sixteen `low` connections that never
    /// answered a revoke sat on the GPU, and a `high` user's warp, a fixed
    /// two slices of virtual time, bought it seventeen times as much of
    /// the GPU: its whole on-time against a busy `normal` user (the victim
    /// kept 73% of its fair part).
    fn settle(&mut self, now: Nanos) {
        let dt = now.saturating_sub(self.settled_at);
        self.settled_at = self.settled_at.max(now);
        self.accrue_entitled(dt);
        let n = self.ix.on_gpu.len();
        if dt > 0 && n > 0 {
            let mut at_or_above = [0usize; BANDS];
            for c in self.ix.on_gpu.iter().map(|id| &self.clients[id]) {
                for k in at_or_above.iter_mut().take(band(c.class) + 1) {
                    *k += 1;
                }
            }
            let on: Vec<ClientId> = self.ix.on_gpu.iter().copied().collect();
            for id in on {
                let c = &self.clients[&id];
                let share = dt as f64 / at_or_above[band(c.class)].max(1) as f64;
                // The GPU time status reports stays the time-slicer's even
                // split, which adds up to the time that passed.
                let even = dt as f64 / n as f64;
                let (l, p) = (self.levels(c), c.path());
                let t = &mut self.ix.tree;
                if let Some(x) = t.users.get_mut(&(p.0, p.1)) {
                    x.n.vtime += share / l.user;
                }
                if let Some(x) = t.units.get_mut(&p) {
                    x.n.vtime += share / l.unit;
                }
                t.stale.push(p);
                let c = self
                    .clients
                    .get_mut(&id)
                    .expect("on the GPU means registered");
                c.vtime += share / l.own;
                c.charged += even;
                self.reindex(id);
            }
        }
        self.refresh();
    }

    /// Brings the places and clocks of the tree's stale nodes up to date,
    /// bottom up: a unit's clock over its waiters and the holder if it is
    /// the holder's, its place among its user's units (with the warp of
    /// its best `high` waiter), then the same for its user once all the
    /// user's stale units are done, then the bands' clocks. A clock is
    /// over virtual times as charged, never warped ones (BVT's scheduler
    /// virtual time): a node that starts competing is placed a slice
    /// behind it, and a `high` node's warp (two slices) stays ahead of
    /// that credit. Over warped places, a newcomer beside a `high`
    /// holder started the warp and a slice behind the `high` user's own
    /// time, and held the GPU from its next burst for a whole slice.
    fn refresh(&mut self) {
        // Alone since the last event, a band's holder's user was its clock
        // all along: a waiter whose ceiling lifts now does not hold the
        // clock back to where it was then (a `high` burst waited 60 ms).
        for b in 0..BANDS {
            // Once per event: by the next refresh, this event may have
            // brought a waiter.
            if std::mem::take(&mut self.alone[b])
                && let Some(h) = self.held_place(b)
            {
                let t = &mut self.ix.tree;
                t.clock[b] = t.clock[b].max(h);
            }
        }
        if self.ix.tree.stale.is_empty() {
            return;
        }
        // Sorted, a user's units come together, before the user.
        let mut stale = std::mem::take(&mut self.ix.tree.stale);
        stale.sort_unstable();
        stale.dedup();
        let mut bands = [false; BANDS];
        // Nodes competing now or until this event: their lag is kept from
        // their parents' clocks as this event leaves them.
        let mut on_units = Vec::new();
        let mut on_users = Vec::new();
        for (i, &p) in stale.iter().enumerate() {
            if self.refresh_unit(p) {
                on_units.push(p);
            }
            let r = (p.0, p.1);
            if stale.get(i + 1).is_none_or(|q| (q.0, q.1) != r) {
                if self.refresh_user(r) {
                    on_users.push(r);
                }
                bands[r.0] = true;
            }
        }
        let bounded = self.high_bounded(self.now);
        for (b, _) in bands.iter().enumerate().filter(|(_, on)| **on) {
            let held = self.held_place(b);
            // Over users with a waiter that may run (over the others only
            // while none may and none holds): one its ceilings keep out
            // (a `--high-share` spent, a deferral, a limit) held the clock
            // back while another user ran alone, which then came back
            // over a slice ahead of everyone and was not owed the GPU (a
            // `high` burst waited 82 ms, and 60 ms).
            let users = &self.ix.tree.top_real[b];
            let waiting = users
                .iter()
                .find(|e| self.may_run((b, e.1), bounded))
                .map(|e| e.0.0);
            let t = &mut self.ix.tree;
            let over = least(waiting, held).or_else(|| t.top_real[b].first().map(|e| e.0.0));
            if let Some(m) = over {
                t.clock[b] = t.clock[b].max(m);
            }
        }
        // After the clocks: read before them, a holder alone since the
        // last event (the clock following it, unrefreshed) left with a
        // lag from a clock as old as that event, and came back that far
        // behind (a `high` burst waited 28 ms).
        let (t, now) = (&mut self.ix.tree, self.now);
        for p in on_units {
            let parent = t.users.get(&(p.0, p.1)).map(|u| u.n.clock);
            if let (Some(parent), Some(x)) = (parent, t.units.get_mut(&p)) {
                x.n.off = (now, parent);
            }
        }
        for r in on_users {
            let parent = t.clock[r.0];
            if let Some(x) = t.users.get_mut(&r) {
                x.n.off = (now, parent);
            }
        }
        // The buffer's room is kept for the next event.
        stale.clear();
        self.ix.tree.stale = stale;
    }

    /// The least place of the users holding band `b` (its holder, and
    /// holders revoked that have not answered).
    fn held_place(&self, b: usize) -> Option<f64> {
        self.granted()
            .filter(|h| band(h.class) == b)
            .map(|h| {
                let r = (b, h.user_key());
                self.ix.tree.users.get(&r).map_or(0.0, |x| x.n.vtime)
            })
            .min_by(f64::total_cmp)
    }

    /// For each band, whether its holder's user is alone until the next
    /// event: no other user has a waiter that may run (`refresh`).
    pub(super) fn note_alone(&mut self) {
        let bounded = self.high_bounded(self.now);
        for b in 0..BANDS {
            let holder = self
                .holder
                .and_then(|h| self.clients.get(&h))
                .filter(|c| band(c.class) == b)
                .map(Client::user_key);
            self.alone[b] = holder.is_some_and(|u| {
                !self.ix.tree.top_real[b]
                    .iter()
                    .any(|e| e.1 != u && self.may_run((b, e.1), bounded))
            });
        }
    }

    /// Whether user `r` has a waiter its ceilings let run now.
    fn may_run(&self, r: UserRef, bounded: bool) -> bool {
        let t = &self.ix.tree;
        t.users.get(&r).is_some_and(|u| {
            u.units.iter().any(|g| {
                t.units.get(&(r.0, r.1, g.2)).is_some_and(|x| {
                    x.clients
                        .iter()
                        .any(|e| self.fits(&self.clients[&e.2], self.now, bounded))
                })
            })
        })
    }

    /// A unit's clock and place (a unit dropped as its last member left
    /// has none; its user's and band's clocks are refreshed all the same).
    /// Returns whether it competes now or did until this event.
    fn refresh_unit(&mut self, p: UnitRef) -> bool {
        let Some(x) = self.ix.tree.units.get(&p) else {
            return false;
        };
        let warp = self.warp();
        let w = self.ix.unit_weight(p);
        let held = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .filter(|h| h.path() == p)
            .map(|h| h.vtime);
        let m = least(x.real.first().map(|e| e.0.0), held);
        let key =
            (x.n.waiting > 0).then(|| Vt(x.n.vtime - if x.n.high > 0 { warp / w } else { 0.0 }));
        // Competing now, or until this event (it had a place): its lag is
        // kept from here if it stops.
        let on = held.is_some() || x.n.waiting > 0 || x.n.entry.is_some();
        let x = self.ix.tree.units.get_mut(&p).expect("looked up above");
        if let Some(m) = m {
            x.n.clock = x.n.clock.max(m);
        }
        self.ix.tree.place_unit(p, key);
        on
    }

    /// A user's clock and place; whether it competes now or did until
    /// this event.
    fn refresh_user(&mut self, r: UserRef) -> bool {
        let Some(x) = self.ix.tree.users.get(&r) else {
            return false;
        };
        let warp = self.warp();
        let held = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .filter(|h| h.user_ref() == r)
            .map(|h| self.ix.tree.units.get(&h.path()).map_or(0.0, |x| x.n.vtime));
        let m = least(x.real.first().map(|e| e.0.0), held);
        let w = self.ix.user_weight(r.0, r.1);
        let key =
            (x.n.waiting > 0).then(|| Vt(x.n.vtime - if x.n.high > 0 { warp / w } else { 0.0 }));
        let on = held.is_some() || x.n.waiting > 0 || x.n.entry.is_some();
        let x = self.ix.tree.users.get_mut(&r).expect("looked up above");
        if let Some(m) = m {
            x.n.clock = x.n.clock.max(m);
        }
        self.ix.tree.place_user(r, key);
        on
    }
}

/// Where a node that starts competing again is placed, for a node of
/// `weight` at its level whose parent's clock is now `clock`: it keeps the
/// lag it had behind its parent's clock when it last competed (as EEVDF
/// keeps a sleeper's lag: time away earns nothing by itself, a node that
/// was ahead is still ahead), plus `WAKE_ACCRUAL` of the real time since,
/// up to one `slice` of its own GPU time behind the clock, and never ahead
/// of what it had used. The credit is what lets a process that used less
/// than its part take the GPU at once; earned at a tenth of real time, it
/// cannot pay for more than a tenth of anyone's part (a user whose process
/// works half of each period with the full slice of credit at every return
/// took its whole on-time, a third of a busy victim's part).
fn woken(n: &tree::Node, clock: f64, slice: f64, weight: f64, now: Nanos) -> f64 {
    let (at, then) = n.off;
    let earned = WAKE_ACCRUAL * now.saturating_sub(at) as f64 / weight;
    let kept = n.vtime + (clock - then).max(0.0) - earned;
    n.vtime.max(kept).max(clock - slice / weight)
}

impl Scheduler {
    /// The holder, and holders revoked that have not answered yet (and
    /// are not hung): they still compete, so a band's clock is over them
    /// too. Over the holder alone, the clock jumped at each handover over
    /// the revoked holder's place to the next one's, until it asked again;
    /// a user coming back then kept its lag from a clock that had run
    /// ahead. Unit and user clocks stay over the holder alone: taking revoked
    /// holders into them too left a busy process 0.17 s of 4 s beside 128
    /// connections churning at `low` (tests/service.rs).
    fn granted(&self) -> impl Iterator<Item = &Client> {
        self.ix
            .granted
            .iter()
            .filter_map(|id| self.clients.get(id))
            .filter(|c| c.grant.as_ref().is_some_and(|g| !g.hung))
    }
}

/// The lesser of two places, either of which may be missing.
fn least(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.into_iter().chain(b).min_by(f64::total_cmp)
}

#[cfg(test)]
mod tests;
