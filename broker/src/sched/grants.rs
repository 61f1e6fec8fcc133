//! Who holds the GPU: the fixed-point loop that, after every event, picks
//! the next holder, grants, updates or revokes, and sets the bound on what
//! a holder may keep queued.

use super::tree::{BANDS, Level, band};
use super::{
    Action, BURST_BOUND, Client, ClientId, ClientState, Nanos, Outstanding, Priority, Scheduler,
    WARP_SLICES,
};

/// The waiter that would be picked: highest band, then the fair tree's
/// order (users, their units, their clients), then FIFO.
#[derive(Clone, Copy, Debug)]
pub(super) struct Candidate {
    pub(super) id: ClientId,
    class: Priority,
}

/// A holder and a waiter of one band, compared where their branches part:
/// their users' places if they are different users', their units' if
/// they are one user's, else their own (each with its own warp).
#[derive(Clone, Copy, Debug)]
struct Cmp {
    level: Level,
    holder: f64,
    waiter: f64,
    /// The holder's weight at that level: virtual time there is its GPU
    /// time over this.
    weight: f64,
}

impl Scheduler {
    /// The eligible waiter that would be picked, other than `except`;
    /// `bounded`: `high_bounded(now)`, which the callers need too.
    pub(super) fn best_waiter(
        &self,
        now: Nanos,
        except: Option<ClientId>,
        bounded: bool,
    ) -> Option<Candidate> {
        // The tree holds the waiters in that order: the first that fits.
        (0..BANDS)
            .rev()
            .find_map(|b| {
                self.ix
                    .tree
                    .waiters(b)
                    .map(|id| (id, &self.clients[&id]))
                    .find(|&(id, c)| Some(id) != except && self.fits(c, now, bounded))
            })
            .map(|(id, c)| Candidate { id, class: c.class })
    }

    /// Who gets an idle GPU. A band whose holder was recalled keeps the
    /// GPU for a moment (`recall_hold`) or until that holder answers: a
    /// busy one asks again and is granted at once, and a lower band gets
    /// no sliver in between. One that does not answer by then leaves the
    /// GPU to the lower band (it is found hung later, at the grace).
    pub(super) fn next_grantee(&self, now: Nanos, bounded: bool) -> Option<Candidate> {
        let w = self.best_waiter(now, None, bounded)?;
        let hold = self.recall_hold();
        let recalled = self
            .ix
            .granted
            .iter()
            .map(|id| &self.clients[id])
            .filter(|c| {
                c.grant
                    .as_ref()
                    .is_some_and(|g| g.awaits_recall_answer(now, hold))
            })
            .map(|c| band(c.class))
            .max();
        recalled.is_none_or(|r| band(w.class) >= r).then_some(w)
    }

    /// How long a recalled holder's band keeps the GPU waiting for its
    /// answer: two wake periods (a busy shim answers within a round trip
    /// and its bounded queued work), never more than the grace.
    pub(super) fn recall_hold(&self) -> Nanos {
        self.cfg.wake.saturating_mul(2).min(self.cfg.grace).max(1)
    }

    /// Compares holder `h` and waiter `w` (of one band) where their
    /// branches part.
    fn compare(&self, h: &Client, w: &Client) -> Cmp {
        let (hp, wp) = (h.path(), w.path());
        let warp = self.warp();
        let t = &self.ix.tree;
        if (hp.0, hp.1) != (wp.0, wp.1) {
            let at = |c: &Client, p: (usize, super::UserKey, u64)| {
                let weight = self.ix.user_weight(p.0, p.1);
                let v = t.users.get(&(p.0, p.1)).map_or(0.0, |x| x.n.vtime);
                (v - c.warp(warp, weight), weight)
            };
            let ((holder, weight), (waiter, _)) = (at(h, hp), at(w, wp));
            Cmp {
                level: Level::User,
                holder,
                waiter,
                weight,
            }
        } else if hp.2 != wp.2 {
            let at = |c: &Client, p| {
                let weight = self.ix.unit_weight(p);
                let v = t.units.get(&p).map_or(0.0, |x| x.n.vtime);
                (v - c.warp(warp, weight), weight)
            };
            let ((holder, weight), (waiter, _)) = (at(h, hp), at(w, wp));
            Cmp {
                level: Level::Unit,
                holder,
                waiter,
                weight,
            }
        } else {
            Cmp {
                level: Level::Client,
                holder: h.vtime - h.warp(warp, h.own),
                waiter: w.vtime - w.warp(warp, w.own),
                weight: h.own,
            }
        }
    }

    /// The bound `id` gets as holder: only while someone who could take the
    /// GPU from it or follow it is registered (a client of its band or
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
        // Itself among them.
        let others = self.ix.at_or_above(c.class) > 1;
        match (others, in_burst) {
            (false, _) => 0,
            (true, false) => self.cfg.bound,
            (true, true) => self.cfg.bound.saturating_mul(BURST_BOUND),
        }
    }

    /// Brings the state to a fixed point for `now`; every step either makes
    /// progress or stops, so the loop is short.
    pub(super) fn reschedule(&mut self, now: Nanos) {
        self.settle(now);
        self.sync_meters(now);
        let cfg = self.cfg;
        for id in &self.ix.granted {
            let c = self
                .clients
                .get_mut(id)
                .expect("granted clients are registered");
            let path = c.path();
            if let Some(g) = c.grant.as_mut()
                && let Some(r) = g.revoked_at
                && r.saturating_add(cfg.grace) <= now
                && !g.hung
            {
                g.hung = true;
                // It no longer holds its nodes' clocks back.
                self.ix.tree.stale.push(path);
            }
        }
        self.refresh();
        let drained: Vec<ClientId> = self
            .ix
            .on_gpu
            .iter()
            .copied()
            .filter(|id| {
                let c = &self.clients[id];
                c.draining_since.is_some() && c.drain_until <= now
            })
            .collect();
        for id in drained {
            let c = self
                .clients
                .get_mut(&id)
                .expect("on the GPU means registered");
            c.draining_since = None;
            c.refresh_run(now);
            self.reindex(id);
        }
        self.sync_meters(now);
        // Once per event, after everything that can change who is active
        // (steps only move clients between active states).
        self.reweigh();
        for _ in 0..self.clients.len() * 2 + 4 {
            if !self.step(now) {
                break;
            }
        }
        self.woke = None;
        self.sync_meters(now);
        self.note_alone();
        self.note_entitled(now);
    }

    /// Takes the GPU from holder `h`. A `recall` (its slice ran out while
    /// only a lower band waits) keeps the GPU with its band for its
    /// answer. While a lower band waits, any revoke judges the holder's
    /// evidence of work (`evidence`): without it, its user is deferred
    /// and the lower band may have the GPU (also when the holder's band
    /// hands over among its own members, which would otherwise keep the
    /// judgement from ever being made).
    fn revoke(&mut self, now: Nanos, h: ClientId, recall: bool) {
        let deferred = self.defer(now, h);
        let recall = recall && !deferred;
        let c = self.clients.get_mut(&h).expect("holder is registered");
        if recall {
            c.recalled_at = Some(now);
        }
        let g = c.grant.as_mut().expect("holder has a grant");
        g.revoked_at = Some(now);
        g.recall = recall;
        g.deadline = None;
        c.state = ClientState::Revoking;
        let gid = g.id;
        self.holder = None;
        self.reindex(h);
        self.actions.push_back(Action::Revoke {
            client: h,
            grant: gid,
        });
    }

    fn step(&mut self, now: Nanos) -> bool {
        let bounded = self.high_bounded(now);
        let Some(h) = self.holder else {
            let handoff = self.handoff.take().filter(|w| {
                self.clients
                    .get(w)
                    .is_some_and(|c| c.state == ClientState::Waiting && self.fits(c, now, bounded))
            });
            if let Some(w) = handoff {
                // A quantum, as the time-slicer would give it; then the
                // usual order decides (a full slice had the holder it took
                // the GPU from, a waker with credit, wait a slice for the
                // rest of its burst).
                self.grant_to(now, w, Some(self.cfg.timeslice / 5));
                return true;
            }
            return match self.next_grantee(now, bounded) {
                Some(next) => {
                    // A waker passed over for another user's client of its
                    // band (one that came at the same moment, ahead in
                    // the order) is owed the GPU by that user as if it
                    // had woken beside it.
                    let passed = self.woke.map(|(w, _)| w).filter(|&w| w != next.id);
                    self.grant_to(now, next.id, None);
                    if let Some(w) = passed
                        && self.owed.is_none()
                    {
                        self.owed = self.owed_to(&self.clients[&next.id], w, now, bounded);
                    }
                    true
                }
                None => false,
            };
        };
        let cfg = self.cfg;
        let bound = self.bound_for(now, h);
        let best = self.best_waiter(now, Some(h), bounded);
        // Anyone at all waiting (any class): an idle holder hands back.
        let waiters = best.is_some();
        let woke = self.woke.take();
        let c = self.clients.get(&h).expect("holder is registered");
        let class = c.class;
        // A waiter of a higher band takes the GPU at once. So does one
        // that just woke up behind the holder where their branches part,
        // if what woke is at that level or above it (a user's connection
        // waking gets no credit against another user's holder unless the
        // user itself comes back), or if it is `high` (its warp is its
        // credit). Behind by more than a quarter slice of the holder's
        // time, so that two waking together do not take the GPU from each
        // other.
        if let Some(w) = best {
            let wc = &self.clients[&w.id];
            let preempt = band(w.class) > band(class)
                || (band(w.class) == band(class)
                    && woke.is_some_and(|(id, level)| {
                        let x = self.compare(c, wc);
                        let gran = cfg.timeslice as f64 / 4.0 / x.weight;
                        id == w.id
                            && (w.class == Priority::High || level <= x.level)
                            && x.waiter + gran < x.holder
                    }));
            if preempt {
                self.revoke(now, h, false);
                self.mark_preempted(h);
                // For the grant that follows: a waker it passes over is
                // owed the GPU.
                self.woke = woke;
                return true;
            }
        }
        // One that woke up without being behind waits no longer than the
        // GPU's own time-slicer would make it wait: the holder's slice ends
        // within `wake`, and the usual order decides then.
        let woken = woke.map(|(id, _)| id).filter(|&id| {
            self.clients.get(&id).is_some_and(|w| {
                band(w.class) == band(class)
                    && w.state == ClientState::Waiting
                    && self.fits(w, now, bounded)
            })
        });
        let woke_here = woken.is_some();
        // A waker of another user is owed the GPU within `wake`, across
        // changes of holder within the holder's user (a sibling taking
        // the GPU at once had dropped the victim's turn); within one user
        // the order decides.
        self.owed = self.owed.filter(|&o| self.owes(c, o, now, bounded));
        if let Some(w) = woken
            && self.owed.is_none()
        {
            self.owed = self.owed_to(c, w, now, bounded);
        }
        let owed = self.owed;
        if let Some((w, by, _)) = owed
            && by <= now
        {
            // Its quantum is up: it has the GPU unless it is more than a
            // slice ahead of the holder (it took more than its part
            // lately).
            self.owed = None;
            if self.yields_to(c, w) {
                self.handoff = Some(w);
                self.revoke(now, h, false);
                return true;
            }
        }
        let owed_by = owed.map(|(_, by, _)| by).filter(|&by| by > now);
        let wake_by = now.saturating_add(cfg.wake);
        // Lower bands do not contend with the holder.
        let best = best.filter(|w| band(w.class) == band(class));
        let contended = best.is_some();
        let cmp = best.map(|b| self.compare(c, &self.clients[&b.id]));
        let remaining = self.remaining(c, now, bounded);
        let fits = self.fits(c, now, bounded);
        let g = c.grant.as_ref().expect("holder has a grant");
        let (gid, start, deadline, first) = (g.id, g.start, g.deadline, g.first);
        let mut solo = g.solo;
        let capped = owed_by.is_some_and(|by| deadline.is_none_or(|d| d > by));
        let unchanged = g.bound == bound && g.waiters == waiters && !capped;
        // Liveness: while anyone of a lower band waits, a holder's grant
        // is never open-ended; at its end the holder is recalled, since
        // the broker cannot see whether it still launches (a client that
        // holds the GPU without using it once kept a `low` waiter out
        // forever).
        let mut recall = false;
        let mut taken = false;
        // While a lower band waits, however far behind it stays, one grant
        // runs at most a slice of credit and the warp: a holder charged no
        // faster than a waiter of its band (both on the GPU, the waiter
        // still draining) never came level, and was extended slice after
        // slice while `low` waited on an idle GPU.
        let longest = (cfg.timeslice as f64 * (1.0 + WARP_SLICES)) as Nanos;
        // A holder still behind the best waiter keeps the GPU for the real
        // time that brings it level (at least a fifth of a slice, so a
        // small deficit does not cost a switch).
        let ext = cmp.map(|x| {
            (((x.waiter - x.holder).max(0.0) * x.weight) as Nanos)
                .clamp(cfg.timeslice / 5, cfg.timeslice)
        });
        // What to do: Some(slice) grants (or updates) with that slice,
        // None revokes.
        let action: Option<Option<Nanos>> = match deadline {
            Some(d) if d <= now && !contended && waiters => {
                if self.recall_due(c, now) {
                    recall = true;
                    None
                } else if let Some(r) = remaining {
                    fits.then(|| Some(r.min(cfg.timeslice)))
                } else {
                    Some(Some(cfg.timeslice))
                }
            }
            Some(d) if d <= now => {
                // The end of a run alone, cut for a newcomer: taken for
                // it, as at once.
                taken = std::mem::take(&mut solo);
                let lower = self.lower_band_waits(band(class));
                if cmp.is_some_and(|x| x.holder >= x.waiter)
                    || (lower && (now >= start.saturating_add(longest) || self.unproven(c, now)))
                {
                    None
                } else if let Some(r) = remaining {
                    fits.then(|| Some(r.min(cfg.timeslice).min(ext.unwrap_or(Nanos::MAX))))
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
            None if contended || waiters || remaining.is_some() => {
                // A newcomer waits for the holder's first timeslice to run
                // out, counted from its grant; a holder that already had that
                // much is revoked now: its solo run is paid for. A holder
                // only its ceilings cut short gets a slice from now.
                let mut d = start.saturating_add(first).max(now);
                if !contended && d == now {
                    d = now + cfg.timeslice;
                }
                // ... unless it is still behind the newcomer, as at the end
                // of any slice: a user that came back ahead of a holder
                // alone for a slice took the GPU at once, and working 20 ms
                // of every 40 ms kept its whole on-time.
                if d == now
                    && let (Some(e), Some(x)) = (ext, cmp)
                    && x.holder < x.waiter
                {
                    d = now + e;
                }
                // Revoked now for a newcomer (a waker, or a waiter whose
                // ceiling or deferral just ended): taken at once, as by a
                // waker that preempts. Or its run alone ends soon for a
                // waker. (Not for a holder it took the GPU from asking
                // again within a quantum, nor at the end of a contended
                // slice: two busy users would hand over every quantum.)
                taken = contended && d == now;
                solo = woke_here;
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
        // A deadline no later than what is owed to another user's waker.
        let action = match (action, owed_by) {
            (Some(s), Some(by)) if s.is_none_or(|s| now + s > by) => Some(Some(by - now)),
            (a, _) => a,
        };
        match action {
            Some(slice) => {
                let c = self.clients.get_mut(&h).expect("holder is registered");
                let g = c.grant.as_mut().expect("holder has a grant");
                g.deadline = slice.map(|s| now + s);
                g.bound = bound;
                g.waiters = waiters;
                g.solo = solo;
                self.actions.push_back(Action::Grant {
                    client: h,
                    grant: gid,
                    slice,
                    bound,
                    waiters,
                });
            }
            None => {
                self.revoke(now, h, recall);
                if taken {
                    self.mark_preempted(h);
                }
            }
        }
        true
    }

    /// `h`'s grant was taken for a waiter at once or at the end of its
    /// run alone (not at the end of a contended slice): a `high` holder
    /// that asks again before letting go is served as a waker
    /// (`release`).
    fn mark_preempted(&mut self, h: ClientId) {
        if let Some(g) = self.clients.get_mut(&h).and_then(|c| c.grant.as_mut()) {
            g.preempted = true;
        }
    }

    /// What holder `h`'s user owes waker `w` if `w` is another user's:
    /// the GPU within `wake` of now.
    fn owed_to(&self, h: &Client, w: ClientId, now: Nanos, bounded: bool) -> Option<super::Owed> {
        let o = (w, now.saturating_add(self.cfg.wake), h.user_ref());
        (self.clients[&w].user_ref() != o.2 && self.owes(h, o, now, bounded)).then_some(o)
    }

    /// Whether holder `h` still owes waker `w` the GPU: `h` is of the user
    /// that held it when `w` woke, and `w` still waits, in the holder's
    /// band, and may run.
    fn owes(&self, h: &Client, (w, _, by_user): super::Owed, now: Nanos, bounded: bool) -> bool {
        h.user_ref() == by_user
            && self.clients.get(&w).is_some_and(|wc| {
                wc.state == ClientState::Waiting
                    && band(wc.class) == band(h.class)
                    && self.fits(wc, now, bounded)
            })
    }

    /// Whether holder `h` yields to the waker `w` it owes when the waker's
    /// quantum is up: the GPU's own time-slicer would have let `w` run
    /// by then, so it does unless it is more than a slice of the holder's
    /// time ahead of it (it took more than its part lately: a user coming
    /// back keeps its lag, `woken`). A `high` waker beside a busy `high`
    /// holder of another user waited a whole slice for its burst.
    fn yields_to(&self, h: &Client, w: ClientId) -> bool {
        let x = self.compare(h, &self.clients[&w]);
        // Ahead of the clock, not of a holder behind it: a holder's user
        // its ceilings had kept out while the waker's ran alone is
        // behind the clock by all that time, and the waker, level with
        // it, waited for all of it (82 ms).
        let (p, t) = (h.path(), &self.ix.tree);
        let clock = match x.level {
            Level::User => t.clock[p.0],
            Level::Unit => t.users.get(&(p.0, p.1)).map_or(0.0, |u| u.n.clock),
            Level::Client => t.units.get(&p).map_or(0.0, |u| u.n.clock),
        };
        // The holder's place were it level with that clock.
        let even = clock - h.warp(self.warp(), x.weight);
        x.waiter < x.holder.max(even) + self.cfg.timeslice as f64 / x.weight
    }

    /// Grants to `id`, for at most `quantum` if given.
    fn grant_to(&mut self, now: Nanos, id: ClientId, quantum: Option<Nanos>) {
        let cfg = self.cfg;
        if self.owed.is_some_and(|(w, _, _)| w == id) {
            self.owed = None;
        }
        let burst = self.waking.remove(&id);
        let class = self.clients[&id].class;
        let bounded = self.high_bounded(now);
        let best = self.best_waiter(now, Some(id), bounded);
        let contended = best.is_some_and(|w| band(w.class) >= band(class));
        let waiters = best.is_some();
        let gid = self.next_grant;
        self.next_grant += 1;
        let remaining = self.remaining(&self.clients[&id], now, bounded);
        let c = self.clients.get_mut(&id).expect("picked client exists");
        let slice = match remaining {
            Some(r) => Some(r.min(cfg.timeslice)),
            None => (contended || waiters).then_some(cfg.timeslice),
        };
        let first = quantum.unwrap_or(cfg.timeslice).min(cfg.timeslice);
        let slice = slice.map(|s| s.min(first));
        c.state = ClientState::Holding;
        c.grant = Some(Outstanding {
            id: gid,
            start: now,
            deadline: slice.map(|s| now + s),
            revoked_at: None,
            hung: false,
            recall: false,
            bound: 0,
            waiters: false,
            preempted: false,
            solo: false,
            first,
            burst,
        });
        // Its own earlier work now counts as part of the holding.
        c.draining_since = None;
        c.refresh_run(now);
        self.holder = Some(id);
        self.reindex(id);
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
