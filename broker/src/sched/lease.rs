//! The lease machine: who holds the GPU, the grants out (the holder's and
//! those revoked and not let go yet), each one's slice, bound, burst,
//! recall and hung state, the work left draining after a release, and the
//! actions the socket layer carries out. It decides nothing about *who*
//! is owed the GPU (the fair clock does); it keeps what was decided and
//! when each grant's next instant comes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{Action, ClientId, GrantId, Nanos, SchedConfig};

/// How many bounds of work a burst grant may keep queued.
pub(super) const BURST_BOUND: Nanos = 8;

/// A holder the driver saw at work is recalled at most once in this many
/// slices while only a lower band waits, its slice extended in between:
/// a recall costs a busy holder a round trip with the GPU idle. One that
/// does not answer still loses the GPU at the first recall of each grant.
pub(super) const RECALL_SLICES: Nanos = 4;

#[derive(Debug, Clone)]
struct Grant {
    id: GrantId,
    band: usize,
    start: Nanos,
    /// Its first request's length, GPU ns.
    request: Nanos,
    deadline: Option<Nanos>,
    revoked_at: Option<Nanos>,
    hung: bool,
    /// Revoked because its slice ran out while only a lower band waited:
    /// its band keeps the GPU for its answer (`recall_hold`).
    recall: bool,
    /// The bound and `waiters` last sent.
    bound: Nanos,
    waiters: bool,
    /// Granted to a client that had been idle: its first slice is a burst
    /// (a request, a notebook cell) that may be queued whole, or the GPU's
    /// time-slicer would switch to others' leftover work at every gap.
    burst: bool,
}

/// What a grant or an update says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Terms {
    pub slice: Option<Nanos>,
    pub waiters: bool,
    /// Others of its band or above are registered: it is bounded.
    pub shared: bool,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Leases {
    cfg: SchedConfig,
    holder: Option<ClientId>,
    grants: BTreeMap<ClientId, Grant>,
    /// When a revoked grant's next instant comes: the end of its recall
    /// hold, then its grace.
    timers: BTreeSet<(Nanos, ClientId)>,
    /// Recalled holders whose answer their band waits for: until when,
    /// and their band.
    recalling: BTreeMap<ClientId, (Nanos, usize)>,
    /// Released clients whose queued work still runs, at most until then.
    draining: BTreeMap<ClientId, Nanos>,
    drains: BTreeSet<(Nanos, ClientId)>,
    actions: VecDeque<Action>,
    next_grant: GrantId,
    /// When each client was last recalled.
    recalled: BTreeMap<ClientId, Nanos>,
}

impl Leases {
    pub fn new(cfg: SchedConfig) -> Leases {
        Leases {
            cfg,
            next_grant: 1,
            ..Leases::default()
        }
    }

    pub fn holder(&self) -> Option<ClientId> {
        self.holder
    }

    pub fn poll(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// How long a recalled holder's band keeps the GPU waiting for its
    /// answer: two wake periods (a busy shim answers within a round trip
    /// and its bounded queued work), never more than the grace.
    pub fn recall_hold(&self) -> Nanos {
        self.cfg.wake.saturating_mul(2).min(self.cfg.grace).max(1)
    }

    /// The bound for these terms: none while it is alone in its band and
    /// above; during the first slice of a burst, eight times the bound.
    fn bound(&self, shared: bool, burst_now: bool) -> Nanos {
        match (shared, burst_now) {
            (false, _) => 0,
            (true, false) => self.cfg.bound,
            (true, true) => self.cfg.bound.saturating_mul(BURST_BOUND),
        }
    }

    /// Grants the GPU to `id` (of `band`, for a first request of
    /// `request` GPU ns) on `terms`; `burst`: it had been idle.
    pub fn grant(
        &mut self,
        now: Nanos,
        id: ClientId,
        (band, request): (usize, Nanos),
        burst: bool,
        t: Terms,
    ) {
        let gid = self.next_grant;
        self.next_grant += 1;
        let bound = self.bound(t.shared, burst);
        self.end_drain(id);
        self.grants.insert(
            id,
            Grant {
                id: gid,
                band,
                start: now,
                request,
                deadline: t.slice.map(|s| now + s),
                revoked_at: None,
                hung: false,
                recall: false,
                bound,
                waiters: t.waiters,
                burst,
            },
        );
        self.holder = Some(id);
        self.actions.push_back(Action::Grant {
            client: id,
            grant: gid,
            slice: t.slice,
            bound,
            waiters: t.waiters,
        });
    }

    /// The holder's grant on new terms; sends an update only when they
    /// changed. Returns whether it did.
    pub fn update(&mut self, now: Nanos, t: Terms) -> bool {
        let Some(h) = self.holder else {
            return false;
        };
        let ts = self.cfg.timeslice;
        let g = &self.grants[&h];
        let bound = self.bound(t.shared, g.burst && now < g.start.saturating_add(ts));
        let deadline = t.slice.map(|s| now + s);
        if (g.deadline, g.bound, g.waiters) == (deadline, bound, t.waiters) {
            return false;
        }
        let g = self.grants.get_mut(&h).expect("the holder's grant");
        (g.deadline, g.bound, g.waiters) = (deadline, bound, t.waiters);
        self.actions.push_back(Action::Grant {
            client: h,
            grant: g.id,
            slice: t.slice,
            bound,
            waiters: t.waiters,
        });
        true
    }

    /// Takes the GPU from the holder. A `recall` keeps it for its band
    /// until the holder answers or `recall_hold` passes.
    pub fn revoke(&mut self, now: Nanos, recall: bool) {
        let Some(h) = self.holder.take() else {
            return;
        };
        let hold = self.recall_hold();
        let g = self.grants.get_mut(&h).expect("the holder's grant");
        g.revoked_at = Some(now);
        g.recall = recall;
        g.deadline = None;
        let gid = g.id;
        if recall {
            let until = now + hold;
            self.recalled.insert(h, now);
            self.recalling.insert(h, (until, g.band));
            self.timers.insert((until, h));
        }
        self.timers.insert((now.saturating_add(self.cfg.grace), h));
        self.actions.push_back(Action::Revoke {
            client: h,
            grant: gid,
        });
    }

    /// `id` let go (or left): its grant ends; its queued work, if any,
    /// runs until `drain_until` at most.
    pub fn release(&mut self, id: ClientId, drain_until: Option<Nanos>) {
        if let Some(r) = self.grants.remove(&id).and_then(|g| g.revoked_at) {
            self.timers.remove(&(r + self.recall_hold(), id));
            self.timers.remove(&(r.saturating_add(self.cfg.grace), id));
        }
        self.recalling.remove(&id);
        self.holder.take_if(|h| *h == id);
        self.end_drain(id);
        if let Some(t) = drain_until {
            self.drain(id, t);
        }
    }

    /// `id`'s queued work runs on the GPU until it says it drained, at
    /// most until `until`.
    pub fn drain(&mut self, id: ClientId, until: Nanos) {
        self.end_drain(id);
        self.draining.insert(id, until);
        self.drains.insert((until, id));
    }

    /// `id` left: nothing of it is kept.
    pub fn forget(&mut self, id: ClientId) {
        self.release(id, None);
        self.recalled.remove(&id);
    }

    pub fn end_drain(&mut self, id: ClientId) {
        if let Some(t) = self.draining.remove(&id) {
            self.drains.remove(&(t, id));
        }
    }

    pub fn draining(&self, id: ClientId) -> bool {
        self.draining.contains_key(&id)
    }

    /// Drains past their timeout: charged no longer.
    pub fn drains_due(&mut self, now: Nanos) -> Vec<ClientId> {
        let due: Vec<ClientId> = self
            .drains
            .iter()
            .take_while(|&&(t, _)| t <= now)
            .map(|&(_, id)| id)
            .collect();
        for &id in &due {
            self.end_drain(id);
        }
        due
    }

    /// Marks the revoked grants past their grace hung (status shows them;
    /// a recalled one's band no longer waits for it).
    pub fn mark_hung(&mut self, now: Nanos) {
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                break;
            }
            self.timers.pop_first();
            if self.recalling.get(&id).is_some_and(|r| r.0 <= now) {
                self.recalling.remove(&id);
            }
            if let Some(g) = self.grants.get_mut(&id)
                && let Some(r) = g.revoked_at
                && r.saturating_add(self.cfg.grace) <= now
                && !g.hung
            {
                g.hung = true;
                self.recalling.remove(&id);
            }
        }
    }

    /// The clients on the GPU: with a grant out (holding, or revoked and
    /// not let go), or draining.
    pub fn on_gpu(&self) -> impl Iterator<Item = ClientId> + '_ {
        let draining = self
            .draining
            .keys()
            .filter(|id| !self.grants.contains_key(id));
        self.grants.keys().chain(draining).copied()
    }

    pub fn hung(&self, id: ClientId) -> bool {
        self.grants.get(&id).is_some_and(|g| g.hung)
    }

    /// The highest band whose recalled holder it still waits for, of
    /// those `holds` keeps waiting: no lower band is granted until then.
    pub fn recall_band(&self, now: Nanos, holds: impl Fn(ClientId) -> bool) -> Option<usize> {
        self.recalling
            .iter()
            .filter(|&(&id, r)| now < r.0 && holds(id))
            .map(|(_, r)| r.1)
            .max()
    }

    /// Recalled holders whose answer their band still waits for.
    pub fn awaits_recall(&self, now: Nanos) -> impl Iterator<Item = ClientId> + '_ {
        self.recalling
            .iter()
            .filter(move |(_, r)| now < r.0)
            .map(|(&id, _)| id)
    }

    /// Whether `id` holds a burst's grant.
    pub fn in_burst(&self, id: ClientId) -> bool {
        self.grants.get(&id).is_some_and(|g| g.burst)
    }

    /// The holder's grant: when it started, when its slice ends, and its
    /// first request's length.
    pub fn held(&self) -> Option<(ClientId, Nanos, Option<Nanos>, Nanos)> {
        let h = self.holder?;
        let g = &self.grants[&h];
        Some((h, g.start, g.deadline, g.request))
    }

    /// Whether holder `id`, its slice out while only a lower band waits,
    /// is recalled now: always unless its work is `evidenced`, then once
    /// in `RECALL_SLICES` slices.
    pub fn recall_due(&self, id: ClientId, now: Nanos, evidenced: bool) -> bool {
        let every = self.cfg.timeslice.saturating_mul(RECALL_SLICES);
        !evidenced
            || self
                .recalled
                .get(&id)
                .is_none_or(|&t| now >= t.saturating_add(every))
    }

    /// The lease machine's next instant: the holder's slice end and the
    /// end of its burst, a revoked grant's hold or grace, a drain's
    /// timeout.
    pub fn next_timeout(&self) -> Option<Nanos> {
        let held = self.holder.map(|h| &self.grants[&h]);
        let deadline = held.and_then(|g| g.deadline);
        let burst = held
            .filter(|g| g.burst && g.bound > self.cfg.bound)
            .map(|g| g.start.saturating_add(self.cfg.timeslice));
        [
            deadline,
            burst,
            self.timers.first().map(|t| t.0),
            self.drains.first().map(|t| t.0),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}
