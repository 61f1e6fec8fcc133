//! The coordinator: one event's opening and closing, what a client's
//! state puts in each part, and the fixed point after every event (who
//! holds the GPU, on what terms).

use super::ceilings::{Ceiling, Who};
use super::clock::{BANDS, band};
use super::lease::Terms;
use super::{ClientId, ClientState, Nanos, Priority, Scheduler};

/// How many flows, earliest deadline first, a holder's timer looks at
/// for one that would preempt it once eligible.
const LOOKAHEAD: usize = 64;

impl Scheduler {
    /// Opens an event at `now` (for client `id`, which must be
    /// registered: an event for an unknown one is ignored), charges the
    /// GPU's time up to it, runs `f`, and closes it: the fixed point, the
    /// meters, the timers.
    pub(super) fn event(
        &mut self,
        now: Nanos,
        id: Option<ClientId>,
        f: impl FnOnce(&mut Self, Nanos),
    ) {
        if id.is_some_and(|id| !self.clients.contains_key(&id)) {
            return;
        }
        self.now = self.now.max(now);
        let now = self.now;
        self.settle(now);
        f(self, now);
        self.reschedule(now);
    }

    /// Charges everyone on the GPU up to `now`: the time-slicer splits the
    /// GPU evenly among those with work, and a client's virtual time is
    /// charged as one of those on the GPU of its band or above (lower
    /// bands' clients left on it, hung or not, do not slow a higher
    /// band's clock). Status's GPU time stays the even split.
    fn settle(&mut self, now: Nanos) {
        let dt = now.saturating_sub(self.settled_at);
        self.settled_at = now;
        let above = self.above_on_gpu();
        if dt == 0 || above[0] == 0 {
            return;
        }
        let even = dt as f64 / above[0] as f64;
        let clients = &mut self.clients;
        self.clock.charge(self.lease.on_gpu().map(|id| {
            let c = clients.get_mut(&id).expect("on the GPU");
            c.charged += even;
            (id, dt as f64 / above[band(c.class)] as f64)
        }));
    }

    /// Per band, how many clients on the GPU are of that band or above
    /// (`[0]`: all of them). Kept by `sync`, not counted: this runs twice
    /// at every event, and a user's many processes that asked, each
    /// draining what it launched before its grant, are all on the GPU.
    fn above_on_gpu(&self) -> [usize; BANDS] {
        let mut above = self.tally.on_gpu;
        for b in (0..BANDS - 1).rev() {
            above[b] += above[b + 1];
        }
        debug_assert_eq!(
            above,
            self.count_above_on_gpu(),
            "the tally of those on the GPU"
        );
        above
    }

    /// `above_on_gpu`, counted from the lease: what the tally must say
    /// (checked in debug builds).
    fn count_above_on_gpu(&self) -> [usize; BANDS] {
        let mut above = [0; BANDS];
        for id in self.lease.on_gpu() {
            let b = band(self.clients[&id].class);
            above.iter_mut().take(b + 1).for_each(|k| *k += 1);
        }
        above
    }

    /// Puts client `id`'s state in the parts, changing only what moved:
    /// its registration and weights in the clock, whether it competes and
    /// waits in the run queue, its meters, its `high` work.
    pub(super) fn sync(&mut self, id: ClientId, now: Nanos) {
        let c = &self.clients[&id];
        let (old, m, class) = (c.synced, c.m, c.class);
        let on_gpu = matches!(c.state, ClientState::Holding | ClientState::Revoking)
            || self.lease.draining(id);
        if c.state != ClientState::Waiting {
            // Only a waiter is kept out.
            self.ceilings.unpark(id);
        }
        let parked = self.ceilings.parked(id);
        let waits = c.state == ClientState::Waiting && !parked;
        let asks = c.state != ClientState::Idle;
        // On the GPU, hung or not, it is charged as it uses it, and the
        // others are owed that much more: a hung client's time counts
        // against its user, once.
        let competes = waits || on_gpu;
        let high = (class == Priority::High && (c.state != ClientState::Idle || on_gpu))
            .then(|| (m.user, c.user_part()));
        let request = self.request(c);
        let moved = old.member != Some(m) && self.clock.set_member(id, m, now);
        if old.class != Some(class) {
            if let Some(k) = old.class {
                self.tally.registered[k.index()] -= 1;
            }
            self.tally.registered[class.index()] += 1;
        }
        self.clock.set_competing(id, competes, parked, now);
        let asking = asks.then_some(super::entitled::Asks { m, parked });
        self.entitled.set(id, asking, now);
        if old.queued != waits || old.class != Some(class) || moved {
            if old.queued {
                self.tally.queued[old.class.expect("queued").index()] -= 1;
            }
            if waits {
                self.tally.queued[class.index()] += 1;
            }
            self.clock.set_queued(id, waits.then_some(request));
        }
        if old.on_gpu != on_gpu {
            self.ceilings.unit_on_gpu(m.unit, on_gpu, now);
        }
        let was = old.class.filter(|_| old.on_gpu).map(band);
        let is = on_gpu.then_some(band(class));
        if was != is {
            if let Some(b) = was {
                self.tally.on_gpu[b] -= 1;
            }
            if let Some(b) = is {
                self.tally.on_gpu[b] += 1;
            }
        }
        if old.high != high {
            if let Some((u, w)) = old.high {
                self.ceilings.high_active(u, w, false);
            }
            if let Some((u, w)) = high {
                self.ceilings.high_active(u, w, true);
            }
        }
        let c = self.clients.get_mut(&id).expect("registered");
        c.meter.prune(self.cfg.window, now);
        c.meter.set(on_gpu, now);
        c.synced = super::Synced {
            member: Some(m),
            class: Some(class),
            queued: waits,
            on_gpu,
            high,
        };
    }

    /// A client's request, in GPU ns, and how far it is warped: a slice,
    /// or for one that was idle (a burst: a request, a notebook cell) a
    /// fifth of one, a tenth warped by `WARP_SLICES` at `high`. The
    /// shorter request is an earlier deadline: a burst goes before a busy
    /// holder's next slice, a `high` one before any other, priority as
    /// latency bought with its user's time.
    fn request(&self, c: &super::Client) -> (Nanos, f64) {
        let ts = self.cfg.timeslice;
        match (c.waking, c.class) {
            (false, _) => (ts, 0.0),
            (true, Priority::High) => (ts / 10, super::WARP_SLICES * ts as f64),
            (true, _) => (ts / 5, 0.0),
        }
    }

    /// Brings the state to a fixed point for `now`; every step either makes
    /// progress or stops, so the loop is short.
    fn reschedule(&mut self, now: Nanos) {
        self.lease.mark_hung(now);
        for id in self.lease.drains_due(now) {
            self.sync(id, now);
        }
        let due = self.ceilings.due(now, false);
        self.look_again(now, due);
        for _ in 0..2 {
            for _ in 0..self.clients.len() * 2 + 4 {
                if !self.step(now) {
                    break;
                }
            }
            // A lower class that starts or stops waiting changes what
            // keeps `high` and unproven holders out: the parked look again.
            let seen = (
                self.lower_wants(BANDS - 1),
                self.high_bounded(),
                self.evidence.judging(now),
            );
            if seen == self.seen {
                break;
            }
            self.seen = seen;
            self.unpark_all(now);
        }
        self.sync_meters(now);
        self.plan();
    }

    /// Every parked waiter looks again (something that kept them out may
    /// have gone).
    pub(super) fn unpark_all(&mut self, now: Nanos) {
        let due = self.ceilings.due(now, true);
        self.look_again(now, due);
    }

    /// Parked waiters whose instant came: back in the run queue if their
    /// ceilings let them run now, else parked again until the next (so
    /// that one kept out does not wait in the queue, gathering a claim,
    /// until a pick happens to look at it).
    fn look_again(&mut self, now: Nanos, due: Vec<ClientId>) {
        let bounded = self.high_bounded();
        for id in due {
            if self.fits_bounded(id, now, bounded) {
                self.sync(id, now);
            } else {
                self.park(now, id);
            }
        }
    }

    fn step(&mut self, now: Nanos) -> bool {
        let Some((h, start, deadline, request)) = self.lease.held() else {
            let picked = self.pick(now);
            if let Some(id) = picked {
                self.grant_to(now, id);
            }
            return picked.is_some();
        };
        let hb = band(self.clients[&h].class);
        if self.preempts(now, h, hb, start) {
            self.revoke(now, h, false);
            return true;
        }
        let end = self.slice_end(now, h, hb, start.saturating_add(request), deadline);
        if end.is_some_and(|d| d <= now) {
            return self.request_done(now, h, hb);
        }
        let terms = self.terms(h, end.map(|d| d - now));
        self.lease.update(now, terms)
    }

    /// When the holder's slice ends: open-ended while nobody waits and no
    /// ceiling binds; else the end of its slice (for one that was
    /// open-ended, `first`, the end of its first request, beside a waiter
    /// of its band; a slice from now if only a lower band waits and that
    /// passed), and no later than its ceilings allow.
    fn slice_end(
        &mut self,
        now: Nanos,
        h: ClientId,
        hb: usize,
        first: Nanos,
        deadline: Option<Nanos>,
    ) -> Option<Nanos> {
        let remaining = self.remaining(h, now);
        if !self.anyone_waits() && remaining.is_none() {
            return None;
        }
        let d = match deadline {
            Some(d) => d,
            None if first <= now && !self.clock.queued(hb) => now + self.cfg.timeslice,
            None => first,
        };
        Some(remaining.map_or(d, |r| d.min(now + r)))
    }

    /// The holder's request is done (its slice ran out, or its virtual
    /// time reached its deadline beside a waiter of its band): it keeps
    /// the GPU for a new request if it fits and is still the pick; beside
    /// only a lower band, it is recalled (liveness), or extended while its
    /// work is evidenced (a recall in `RECALL_SLICES` slices); alone, it
    /// runs on.
    fn request_done(&mut self, now: Nanos, h: ClientId, hb: usize) -> bool {
        let (request, _) = self.request(&self.clients[&h]);
        self.clock.start_request(h, request);
        // A holder uses what its ceilings leave to the last of it (the
        // least worth granting is for a new grant: a switch costs).
        if self.remaining(h, now) == Some(0) {
            self.revoke(now, h, false);
            return true;
        }
        if self.clock.queued(hb) {
            if !self.keeps(now, h, hb) {
                self.revoke(now, h, false);
                return true;
            }
        } else if self.lower_waits(hb) {
            let evidenced = self.evidence.judging(now) && self.evidence.proven(h, now);
            if self.lease.recall_due(h, now, evidenced) {
                self.revoke(now, h, true);
                return true;
            }
        }
        let terms = self.terms(h, self.slice(h, now, self.cfg.timeslice));
        self.lease.update(now, terms);
        true
    }

    /// Whether holder `h`, its request done, is still the pick: its flow
    /// eligible with a deadline no later than the best other eligible
    /// flow's (or, with none eligible, no further ahead than the nearest),
    /// and no waiter of its own flow before it.
    fn keeps(&mut self, now: Nanos, h: ClientId, hb: usize) -> bool {
        let flow = if let Some(w) = self.scan(now, Waiters::Band(hb, true, Some(h))) {
            self.clock.eligible(h) && !earlier(self.clock.deadline(w), self.clock.deadline(h))
        } else {
            match self.scan(now, Waiters::Band(hb, false, Some(h))) {
                Some(w) => self.clock.eligible(h) || self.clock.vtime(h) <= self.clock.vtime(w),
                None => true,
            }
        };
        flow && self
            .scan(now, Waiters::Siblings(h))
            .is_none_or(|s| !self.clock.precedes(s, h, false))
    }

    /// Whether a waiter takes the GPU from holder `h` (of band `hb`,
    /// granted at `start`) now: one of a higher band its ceilings let run;
    /// of another flow of its band, the pick if its deadline is earlier
    /// than the holder's (a holder in a burst of its class or above once
    /// it had the GPU's quantum, `wake`, since its grant), or if it was
    /// idle and the holder has had the quantum; of its own flow, a `high`
    /// one before a holder that is not, or one that was idle and used no
    /// more of its part than the holder, once the holder has had the
    /// quantum.
    fn preempts(&mut self, now: Nanos, h: ClientId, hb: usize, start: Nanos) -> bool {
        if (hb + 1..BANDS).any(|b| self.first_fit(now, b).is_some()) {
            return true;
        }
        let quantum = now >= start.saturating_add(self.cfg.wake);
        if let Some(s) = self.scan(now, Waiters::Siblings(h)) {
            let high = |id| self.clients[&id].class == Priority::High;
            if (high(s) && !high(h))
                || (self.short(s) && quantum && self.clock.precedes(s, h, true))
            {
                return true;
            }
        }
        let Some(w) = self.scan(now, Waiters::Band(hb, true, Some(h))) else {
            return false;
        };
        // A burst runs its first quantum before a waiter of its class or
        // below: a deadline earlier by a hair does not cut a short
        // request short (it waits no longer than the GPU's own
        // time-slicer would make it); `high` buys latency over the rest.
        let protected = !quantum && self.shields(h, w);
        (!protected && earlier(self.clock.deadline(w), self.clock.deadline(h)))
            || (self.short(w) && quantum)
    }

    /// Whether holder `h` is in a burst that waiter `w` waits out.
    fn shields(&self, h: ClientId, w: ClientId) -> bool {
        self.lease.in_burst(h) && self.clients[&w].class <= self.clients[&h].class
    }

    /// Whether `id`'s request is the short kind (it was idle).
    fn short(&self, id: ClientId) -> bool {
        self.clients[&id].waking
    }

    /// Who gets an idle GPU: of the highest band with a waiter that may
    /// run, the pick. A band whose holder was recalled keeps the GPU for
    /// the answer (`recall_hold`): a busy holder asks again and is granted
    /// at once, and a lower band gets no sliver in between. Kept, it runs
    /// nothing: its user's benefit of the doubt, kept while a whole hold
    /// of it is left (`sync_meters` spends it).
    pub(super) fn pick(&mut self, now: Nanos) -> Option<ClientId> {
        let (hold, c) = (self.lease.recall_hold(), &self.clients);
        let kept = |h| self.evidence.has_doubt(c[&h].m.flow(), hold, now);
        let floor = self.lease.recall_band(now, kept).unwrap_or(0);
        (floor..BANDS).rev().find_map(|b| self.first_fit(now, b))
    }

    /// Band `b`'s pick: of the eligible flow with the earliest deadline,
    /// or with none eligible (those on the GPU hold the least virtual
    /// times), of the one nearest to eligible, its first waiter.
    fn first_fit(&mut self, now: Nanos, b: usize) -> Option<ClientId> {
        self.scan(now, Waiters::Band(b, true, None))
            .or_else(|| self.scan(now, Waiters::Band(b, false, None)))
    }

    /// The first of `from` its ceilings let run; those its ceilings keep
    /// out on the way are parked.
    fn scan(&mut self, now: Nanos, from: Waiters) -> Option<ClientId> {
        let bounded = self.high_bounded();
        let mut unfit = Vec::new();
        let found = {
            let mut fit = |id: ClientId| {
                let ok = self.fits_bounded(id, now, bounded);
                if !ok {
                    unfit.push(id);
                }
                ok
            };
            match from {
                Waiters::Band(b, eligible, skip) => {
                    self.clock.waiters(b, eligible, skip).find(|&id| fit(id))
                }
                Waiters::Siblings(h) => self.clock.sibling_waiters(h).find(|&id| fit(id)),
            }
        };
        for id in unfit {
            self.park(now, id);
        }
        found
    }

    /// Keeps waiter `id` out of the run queue until its ceilings let it
    /// run again.
    fn park(&mut self, now: Nanos, id: ClientId) {
        let bounded = self.high_bounded();
        let until = self
            .ceilings_of(id, now, bounded)
            .iter()
            .filter(|x| !x.fits())
            .map(|x| x.back_at)
            .max()
            .unwrap_or(now)
            .max(now + 1);
        self.ceilings.park(id, until);
        // What it waits for now is its ceiling, not the GPU's quantum: it
        // comes back as no burst.
        self.clients.get_mut(&id).expect("registered").waking = false;
        self.sync(id, now);
    }

    fn grant_to(&mut self, now: Nanos, id: ClientId) {
        let (request, _) = self.request(&self.clients[&id]);
        let c = self.clients.get_mut(&id).expect("picked");
        let burst = std::mem::take(&mut c.waking);
        c.state = ClientState::Holding;
        let b = band(c.class);
        // Its request (and deadline) is the one it asked with.
        self.sync(id, now);
        let terms = self.terms(id, self.slice(id, now, request));
        self.lease.grant(now, id, (b, request), burst, terms);
    }

    fn revoke(&mut self, now: Nanos, h: ClientId, recall: bool) {
        self.lease.revoke(now, recall);
        self.clients.get_mut(&h).expect("the holder").state = ClientState::Revoking;
        self.sync(h, now);
    }

    /// A slice of `len` for `id`, cut to what its ceilings leave it;
    /// open-ended while none binds and nobody waits.
    fn slice(&self, id: ClientId, now: Nanos, len: Nanos) -> Option<Nanos> {
        match self.remaining(id, now) {
            Some(r) => Some(r.min(len)),
            None => self.anyone_waits().then_some(len),
        }
    }

    fn terms(&self, id: ClientId, slice: Option<Nanos>) -> Terms {
        let class = self.clients[&id].class;
        let above: usize = Priority::ALL
            .iter()
            .filter(|k| band(**k) >= band(class))
            .map(|k| self.tally.registered[k.index()])
            .sum();
        Terms {
            slice,
            waiters: self.anyone_waits(),
            shared: above > 1,
        }
    }

    fn anyone_waits(&self) -> bool {
        self.tally.queued.iter().any(|&n| n > 0)
    }

    /// Whether a client of a band below `b` waits in the run queue.
    fn lower_waits(&self, b: usize) -> bool {
        b > band(Priority::Low) && self.tally.queued[Priority::Low.index()] > 0
    }

    /// Whether a client of a band below `b` waits or holds the GPU: what
    /// the evidence condition serves (while a lower band holds, an
    /// unproven holder of a higher one does not take the GPU back).
    fn lower_wants(&self, b: usize) -> bool {
        self.lower_waits(b)
            || self
                .lease
                .holder()
                .is_some_and(|h| band(self.clients[&h].class) < b)
    }

    /// Whether the `high` class is held to its share of the window now:
    /// a client of a lower class holds the GPU or waits. Work-conserving:
    /// alone, `high` is not bounded.
    fn high_bounded(&self) -> bool {
        let lower_holds = self
            .lease
            .holder()
            .is_some_and(|h| self.clients[&h].class < Priority::High);
        let q = &self.tally.queued;
        self.cfg.high_share < 1.0
            && (lower_holds || q[Priority::Normal.index()] + q[Priority::Low.index()] > 0)
    }

    /// The ceilings on `id` now: its limits, the `high` share, and while a
    /// lower band waits and the driver reports per-process work, its
    /// user's benefit of the doubt unless its work is evidenced.
    fn ceilings_of(&self, id: ClientId, now: Nanos, bounded: bool) -> Vec<Ceiling> {
        let c = &self.clients[&id];
        let who = Who {
            limit: c.limit,
            meter: &c.meter,
            group: c.m.unit,
            high: (c.class == Priority::High).then(|| (c.m.user, c.user_part())),
        };
        let mut all = self.ceilings.of(&who, bounded, now);
        let b = band(c.class);
        if self.lower_wants(b) && self.evidence.doubted(id, now) {
            all.push(self.evidence.ceiling((b, c.m.user), now));
        }
        all
    }

    fn fits_bounded(&self, id: ClientId, now: Nanos, bounded: bool) -> bool {
        self.ceilings_of(id, now, bounded).iter().all(Ceiling::fits)
    }

    /// What the tightest of `id`'s ceilings leaves it; None: unbounded.
    fn remaining(&self, id: ClientId, now: Nanos) -> Option<Nanos> {
        let bounded = self.high_bounded();
        self.ceilings_of(id, now, bounded)
            .iter()
            .map(|x| x.remaining)
            .min()
    }

    /// Opens and closes the meters that run with who holds: the `high`
    /// share's (a `high` client holds while a lower class waits: a revoked
    /// or hung one, or work draining, is its own charge and nobody
    /// else's) and the doubt of a user holding without evidence while a
    /// lower band waits (or whose recalled holder its band waits for).
    fn sync_meters(&mut self, now: Nanos) {
        let holder = self
            .lease
            .holder()
            .map(|h| (h, &self.clients[&h]))
            .filter(|(_, c)| c.state == ClientState::Holding);
        // A `high` holder is bounded exactly when a lower class waits.
        let high = holder
            .filter(|(_, c)| c.class == Priority::High && self.high_bounded())
            .map(|(_, c)| (c.m.user, c.user_part()));
        self.ceilings.sync_high(high, now);
        // Unproven holding spends it; the GPU kept for an answer, always.
        let doubting = holder
            .map(|(h, _)| (h, false))
            .or_else(|| self.lease.awaits_recall(now).next().map(|h| (h, true)))
            .map(|(h, kept)| (h, kept, &self.clients[&h]))
            .filter(|&(h, kept, c)| {
                self.lower_waits(band(c.class)) && (kept || self.evidence.doubted(h, now))
            })
            .map(|(_, _, c)| c.m.flow());
        self.evidence.sync(doubting, now);
    }

    /// After the fixed point: the rate at which each band's clients are
    /// charged, and when a waiter comes to preempt the holder (it becomes
    /// eligible with an earlier deadline, or it was idle and the holder's
    /// quantum ends).
    fn plan(&mut self) {
        let above = self.above_on_gpu();
        for (b, &n_above) in above.iter().enumerate() {
            // Of band `b` itself: of it or above, less those above it.
            let n = n_above - above.get(b + 1).copied().unwrap_or(0);
            self.clock.set_rate(b, n as f64 / n_above.max(1) as f64);
        }
        self.timer = self.lease.held().and_then(|(h, start, _, _)| {
            let hb = band(self.clients[&h].class);
            let dh = self.clock.deadline(h);
            let quantum = start.saturating_add(self.cfg.wake);
            let sibling = self
                .clock
                .sibling_waiters(h)
                .next()
                .filter(|&s| self.short(s) && self.clock.precedes(s, h, true))
                .map(|_| quantum);
            let others = self
                .clock
                .firsts(hb, h)
                .take(LOOKAHEAD)
                .filter_map(|w| {
                    let short = self.short(w);
                    let sooner = earlier(self.clock.deadline(w), dh);
                    let at = self.now.saturating_add(self.clock.eligible_in(w)?);
                    (sooner || short).then(|| {
                        if short || self.shields(h, w) {
                            at.max(quantum)
                        } else {
                            at
                        }
                    })
                })
                .min();
            sibling.into_iter().chain(others).min()
        });
    }
}

/// Where a scan looks: band `b`'s waiters (of eligible flows by deadline,
/// or of all by virtual time; leaving out the flow of a client), or the
/// waiters of a client's own flow.
#[derive(Debug, Clone, Copy)]
enum Waiters {
    Band(usize, bool, Option<ClientId>),
    Siblings(ClientId),
}

/// Whether deadline `a` is earlier than `b` by more than rounding: two
/// flows placed at the same virtual time with the same request tie (the
/// holder keeps the GPU), whatever order their sums were made in.
fn earlier(a: f64, b: f64) -> bool {
    a < b - (b.abs() * 1e-12).max(1e-3)
}
