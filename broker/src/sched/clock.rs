//! The fair clock: every write of virtual time is here (the algorithm
//! is stated in `sched`'s own documentation).
//!
//! A flow is a user's work in a band (for a unit with no user, the
//! unit's). Its virtual time `v` is charged by its clients' GPU time over
//! its weight; the band's `V` is the competing flows' weighted average,
//! and a flow's lag `w·(V − v)` is the GPU time its user is owed. A
//! request warped by `x` GPU ns (a `high` burst's) is eligible owing up
//! to `x` and its deadline is `x` earlier; it is charged as any other, so
//! its user repays it. Lag and deadlines are the user's: its debt is one
//! however many connections carry its work, and no client's deadline is
//! stretched by a sliver of its user's weight.
//!
//! Within a flow, clients are ordered by a virtual time of their own
//! (their GPU time over their part of the user), `high` first; a client
//! starts competing no earlier than its competing siblings' least
//! (`floor`), so coming and going buys nothing within its user either.
//!
//! A flow that stops competing leaves its lag in its bank, taken back when
//! it competes again: a debt forgiven at a tenth of the time away (an
//! interactive user is level again after a short pause, one that works
//! half of each period cannot take its whole on-time back), a credit kept
//! up to one request of the longest kind, and the lag of a flow a ceiling
//! kept out (`parked`) whole: it still wants the GPU.

use std::collections::{BTreeMap, BTreeSet};

// Floats as ordered keys. It orders NaN and -0.0 unlike `total_cmp`; the
// values keyed are neither (virtual times start at +0.0 and move by
// finite sums and differences, and a bank's size is an `abs`).
use ordered_float::OrderedFloat as Key;

use super::{ClientId, GroupId, Nanos, Priority, UserId};

/// `low`, then `high` and `normal` together.
pub(super) const BANDS: usize = 2;

pub(super) fn band(p: Priority) -> usize {
    match p {
        Priority::Low => 0,
        Priority::Normal | Priority::High => 1,
    }
}

/// How fast a flow with nothing competing has its debt forgiven, as a
/// part of real time.
const FORGIVE: f64 = 0.1;

/// Flows with nothing registered, kept for their bank: at most this many
/// (the least owing go first).
const MAX_KEPT: usize = 1024;

/// Only ratios of weights matter; one that cannot be compared is taken as
/// the default rather than poisoning every comparison with NaN.
pub(super) fn sanitize_weight(w: f64) -> f64 {
    if w.is_finite() && w > 0.0 { w } else { 1.0 }
}

/// Whose part a unit shares: an explicit user, or the unit itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum UserKey {
    User(UserId),
    Unit(GroupId),
}

/// A flow: a user's (or a lone unit's) work in a band.
pub(super) type UserRef = (usize, UserKey);

/// A user's part, as a weight: a user of weight 1 weighs as a unit of
/// 100 (a lease of `--gpu-compute 100%`), so that callers that know no
/// users and those that do give weights of the same size.
const USER_SCALE: f64 = 100.0;

/// What the clock weighs a client by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Member {
    pub band: usize,
    pub user: UserKey,
    pub unit: GroupId,
    /// Its own weight among its unit's members.
    pub own: f64,
    /// Its unit's weight when imposed (a lease's `--gpu-compute`); else
    /// the largest `own` among the unit's competing members.
    pub unit_weight: Option<f64>,
    /// Its user's weight (for `UserKey::User`).
    pub user_weight: f64,
    /// `high`: first within its user.
    pub high: bool,
}

impl Member {
    pub(super) fn flow(&self) -> UserRef {
        (self.band, self.user)
    }
}

/// A total of weights with the largest of them.
#[derive(Debug, Clone, Default)]
struct Sum {
    total: f64,
    /// Each weight's bits (positive floats order as their bits), counted.
    each: BTreeMap<u64, usize>,
}

impl Sum {
    fn add(&mut self, w: f64) {
        self.total += w;
        *self.each.entry(w.to_bits()).or_default() += 1;
    }

    fn remove(&mut self, w: f64) {
        if let Some(n) = self.each.get_mut(&w.to_bits()) {
            *n -= 1;
            if *n == 0 {
                self.each.remove(&w.to_bits());
            }
        }
        // Exact again once empty, whatever rounding the sums gathered.
        self.total = if self.each.is_empty() {
            0.0
        } else {
            self.total - w
        };
    }

    fn max(&self) -> Option<f64> {
        self.each.keys().next_back().map(|&b| f64::from_bits(b))
    }
}

/// A unit's competing members.
#[derive(Debug, Clone, Default)]
struct Unit {
    own: Sum,
    imposed: Option<f64>,
}

impl Unit {
    fn weight(&self) -> f64 {
        self.imposed.or(self.own.max()).unwrap_or(0.0)
    }
}

/// The weights of a flow's competing clients, by unit and user (and, in
/// `entitled`, of its asking ones).
#[derive(Debug, Clone, Default)]
pub(super) struct Weights {
    units: BTreeMap<GroupId, Unit>,
    /// The sum of the competing units' weights.
    unit_sum: f64,
    /// The competing clients' user weights.
    user: Sum,
}

impl Weights {
    pub(super) fn add(&mut self, m: &Member) {
        let unit = self.units.entry(m.unit).or_default();
        let before = unit.weight();
        unit.own.add(m.own);
        unit.imposed = m.unit_weight.or(unit.imposed);
        self.unit_sum += unit.weight() - before;
        self.user.add(m.user_weight);
    }

    pub(super) fn remove(&mut self, m: &Member) {
        if let Some(unit) = self.units.get_mut(&m.unit) {
            let before = unit.weight();
            unit.own.remove(m.own);
            let after = if unit.own.each.is_empty() {
                self.units.remove(&m.unit);
                0.0
            } else {
                unit.weight()
            };
            self.unit_sum = if self.units.is_empty() {
                0.0
            } else {
                self.unit_sum + after - before
            };
        }
        self.user.remove(m.user_weight);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Whether `unit` has a member.
    pub(super) fn has(&self, unit: GroupId) -> bool {
        self.units.contains_key(&unit)
    }

    /// How much of the flow's part each unit's weight takes (1 over the
    /// units' sum, times the flow's weight over its own: one for a flow
    /// that is a unit), 0 for a flow with no unit.
    pub(super) fn per_unit_weight(&self, key: UserKey) -> f64 {
        let r = self.flow(key) / self.unit_sum;
        if r.is_finite() { r } else { 0.0 }
    }

    /// How much of the unit's part each member's own weight takes (its
    /// weight over its members' sum), 0 for a unit with no member.
    pub(super) fn per_own_weight(&self, unit: GroupId) -> f64 {
        let Some(u) = self.units.get(&unit) else {
            return 0.0;
        };
        let r = u.weight() / u.own.total;
        if r.is_finite() { r } else { 0.0 }
    }

    /// The flow's weight in its band.
    pub(super) fn flow(&self, key: UserKey) -> f64 {
        sanitize_weight(match key {
            UserKey::User(_) => USER_SCALE * self.user.max().unwrap_or(0.0),
            UserKey::Unit(_) => self.unit_sum,
        })
    }

    /// A competing member's part of its flow: its unit's part of the
    /// units, times its own part of the unit's members.
    fn within(&self, m: &Member) -> f64 {
        let Some(unit) = self.units.get(&m.unit) else {
            return 1.0;
        };
        sanitize_weight((unit.weight() / self.unit_sum) * (m.own / unit.own.total))
    }
}

/// A competing flow's place in its band.
#[derive(Debug, Clone, Copy)]
struct On {
    w: f64,
    v: f64,
    /// Its current request's virtual deadline.
    deadline: f64,
    /// Its current request's length, GPU ns: when its virtual time
    /// reaches the deadline (less the warp), the request is done and the
    /// next, as long and unwarped, starts there.
    req: f64,
    /// GPU ns the current request's deadline was brought forward by (a
    /// `high` burst's warp).
    warp: f64,
}

impl On {
    /// A new request of `req` GPU ns from its present virtual time less
    /// `warp` GPU ns.
    fn request(&mut self, req: f64, warp: f64) {
        (self.req, self.warp) = (req, warp);
        self.deadline = self.v + (req - warp) / self.w;
    }

    /// Whether its virtual time has run through the current request.
    fn done(&self) -> bool {
        self.v >= self.deadline + self.warp / self.w
    }
}

/// What a flow left when it stopped competing.
#[derive(Debug, Clone, Copy, Default)]
struct Bank {
    /// GPU ns: positive, owed to it; negative, owed by it.
    lag: f64,
    /// Since when nothing of it competes.
    away_since: Option<Nanos>,
    /// Left while a ceiling kept some of its clients out: taken back
    /// whole, neither capped nor forgiven.
    kept: bool,
}

/// The order within a flow.
#[derive(Debug, Clone, Default)]
struct Inner {
    /// Competing clients by their virtual time within the flow.
    competing: BTreeSet<(Key<f64>, ClientId)>,
    /// Waiters, `high` first, then by virtual time.
    waiting: BTreeSet<(bool, Key<f64>, ClientId)>,
    /// No client starts competing behind this (the least virtual time
    /// of those competing, never going back).
    floor: f64,
}

/// A user's (or a lone unit's) work in one band.
#[derive(Debug, Clone, Default)]
struct Flow {
    on: Option<On>,
    /// In the band's run queue (a client of it waits): its FIFO stamp.
    queued: Option<u64>,
    bank: Bank,
    /// Registered clients.
    members: usize,
    /// Clients a ceiling keeps out.
    parked: usize,
    weights: Weights,
    inner: Inner,
}

/// A client's place in its flow.
#[derive(Debug, Clone, Copy)]
struct Entity {
    m: Member,
    /// Its virtual time within its flow.
    vt: f64,
    competing: bool,
    waiting: bool,
    parked: bool,
    /// GPU ns its waiting request may owe and still be eligible.
    warp: f64,
}

impl Entity {
    /// Its place among its flow's waiters.
    fn order(&self, id: ClientId) -> (bool, Key<f64>, ClientId) {
        (!self.m.high, Key(self.vt), id)
    }
}

/// One band's run queue.
#[derive(Debug, Clone, Default)]
struct Band {
    /// Over competing flows: Σw, and Σw·(v − base).
    sum_w: f64,
    sum_wv: f64,
    base: f64,
    /// `V` when nothing competes.
    idle_v: f64,
    /// Queued flows by deadline, then FIFO.
    queue: BTreeSet<(Key<f64>, u64, UserKey)>,
    /// Queued flows by virtual time.
    by_v: BTreeSet<(Key<f64>, UserKey)>,
    /// GPU ns per ns charged to its competing flows now (set after each
    /// event), for when a flow becomes eligible.
    rate: f64,
}

impl Band {
    fn v(&self) -> f64 {
        if self.sum_w > 0.0 {
            self.base + self.sum_wv / self.sum_w
        } else {
            self.idle_v
        }
    }

    fn add(&mut self, w: f64, v: f64) {
        self.sum_w += w;
        self.sum_wv += w * (v - self.base);
    }

    fn remove(&mut self, w: f64, v: f64) {
        let before = self.v();
        self.sum_w -= w;
        self.sum_wv -= w * (v - self.base);
        if self.sum_w <= 1e-12 {
            // Nothing competes: exact zeros again, `V` kept for the next.
            (self.sum_w, self.sum_wv, self.idle_v, self.base) = (0.0, 0.0, before, before);
        }
    }

    /// Keeps the sums' offsets small: `V` is read as base + Σw(v−base)/Σw.
    fn rebase(&mut self) {
        let v = self.v();
        if (v - self.base).abs() > 1e6 {
            self.sum_wv -= self.sum_w * (v - self.base);
            self.base = v;
        }
    }
}

/// The fair clock of one GPU.
#[derive(Debug, Clone, Default)]
pub(super) struct FairClock {
    bands: [Band; BANDS],
    entities: super::ById<Entity>,
    flows: BTreeMap<UserRef, Flow>,
    /// Flows with nothing registered, kept for their bank.
    kept: BTreeSet<UserRef>,
    /// The last FIFO stamp given.
    seq: u64,
    /// The longest request: the most credit a bank keeps.
    longest: f64,
    /// `charge`'s flows and their time, kept to spare an allocation.
    charging: Vec<(UserRef, f64)>,
}

impl FairClock {
    pub fn new(longest: Nanos) -> FairClock {
        FairClock {
            longest: longest as f64,
            ..FairClock::default()
        }
    }

    /// Registers `id`, or changes what it is weighed by. Within its flow
    /// it keeps its place; moved to another flow (band or user), it
    /// leaves the old one as a client that stops competing would, and
    /// the caller puts it back (returns true).
    pub fn set_member(&mut self, id: ClientId, m: Member, now: Nanos) -> bool {
        let Some(&e) = self.entities.get(&id) else {
            let e = Entity {
                m,
                vt: 0.0,
                competing: false,
                waiting: false,
                parked: false,
                warp: 0.0,
            };
            self.entities.insert(id, e);
            self.count(m.flow(), true);
            return false;
        };
        if e.m.flow() != m.flow() {
            self.set_competing(id, false, false, now);
            self.count(e.m.flow(), false);
            self.entity(id).m = m;
            self.entity(id).vt = 0.0;
            self.count(m.flow(), true);
            return true;
        }
        let r = m.flow();
        if e.waiting {
            self.flow(r).inner.waiting.remove(&e.order(id));
        }
        self.entity(id).m = m;
        if e.competing {
            let f = self.flow(r);
            f.weights.remove(&e.m);
            f.weights.add(&m);
            self.reweigh(r);
        }
        if e.waiting {
            let order = self.entities[&id].order(id);
            self.flow(r).inner.waiting.insert(order);
        }
        false
    }

    /// Forgets `id` (it left).
    pub fn remove(&mut self, id: ClientId, now: Nanos) {
        self.set_competing(id, false, false, now);
        if let Some(e) = self.entities.remove(&id) {
            self.count(e.m.flow(), false);
        }
    }

    /// Starts or stops `id` competing (`parked`: kept out by a ceiling).
    /// The first of a flow to compete brings the flow in with its bank;
    /// the last to stop takes it out and leaves its lag there.
    pub fn set_competing(&mut self, id: ClientId, on: bool, parked: bool, now: Nanos) {
        let Some(&e) = self.entities.get(&id) else {
            return;
        };
        let r = e.m.flow();
        let parked = parked && !on;
        if e.parked != parked {
            let f = self.flow(r);
            f.parked = if parked { f.parked + 1 } else { f.parked - 1 };
        }
        let e = Entity { parked, ..e };
        *self.entity(id) = e;
        if e.competing == on {
            return;
        }
        if !on {
            self.set_queued(id, None);
        }
        let f = self.flow(r);
        if on {
            let vt = e.vt.max(f.inner.floor);
            f.weights.add(&e.m);
            f.inner.competing.insert((Key(vt), id));
            let first = f.inner.competing.len() == 1;
            *self.entity(id) = Entity {
                vt,
                competing: true,
                ..e
            };
            if first {
                self.join(r, now);
            } else {
                self.reweigh(r);
            }
        } else {
            f.weights.remove(&e.m);
            f.inner.competing.remove(&(Key(e.vt), id));
            let last = f.inner.competing.is_empty();
            self.entity(id).competing = false;
            if last {
                self.leave(r, now);
            } else {
                self.raise_floor(r);
                self.reweigh(r);
            }
        }
    }

    /// Puts a competing `id` among its flow's waiters, with a request of
    /// `request` GPU ns warped by `warp` GPU ns (its deadline that much
    /// earlier, and its flow eligible owing that much), or takes it
    /// out (None). A flow that was not queued starts a new request; one
    /// already queued keeps its own, or takes this one's deadline if
    /// earlier (a burst's shorter request shortens its user's).
    pub fn set_queued(&mut self, id: ClientId, request: Option<(Nanos, f64)>) {
        let Some(&e) = self.entities.get(&id) else {
            return;
        };
        let r = e.m.flow();
        if e.waiting {
            self.flow(r).inner.waiting.remove(&e.order(id));
            self.entity(id).waiting = false;
        }
        self.entity(id).warp = 0.0;
        let (Some((request, warp)), true) = (request, e.competing) else {
            if self.flow(r).inner.waiting.is_empty() {
                self.set_flow_queued(r, false);
            }
            return;
        };
        // One warped request per flow at a time: a user's connections or
        // processes coming as bursts in turn do not each borrow the warp.
        let warp = if self.flows[&r].on.is_some_and(|o| o.warp > 0.0) {
            0.0
        } else {
            warp
        };
        self.flow(r).inner.waiting.insert(e.order(id));
        *self.entity(id) = Entity {
            waiting: true,
            warp,
            ..e
        };
        let was = self.flows[&r].queued.is_some();
        self.set_flow_queued(r, true);
        // A warped request stays its flow's until charged through (the
        // burst's, waiting or running: a sibling queuing behind it, its
        // holder, does not take its deadline away).
        self.refile(r, |o| {
            let fresh = o.v + (request as f64 - warp) / o.w;
            if (!was && o.warp == 0.0) || fresh < o.deadline {
                o.request(request as f64, warp);
            }
        });
    }

    /// A new request of `request` GPU ns for the flow of `id`, its
    /// holder.
    pub fn start_request(&mut self, id: ClientId, request: Nanos) {
        if let Some((r, _)) = self.competing(id) {
            self.refile(r, |o| o.request(request as f64, 0.0));
        }
    }

    /// Charges each `id` its `gpu` ns of GPU time: its own virtual time
    /// within its flow, and its flow's. A flow's place is moved once for
    /// all its clients' time: a user's many processes on the GPU at once
    /// (each draining what it launched before its grant) cost the event
    /// one move of the user, not one for each of them.
    pub fn charge(&mut self, charges: impl IntoIterator<Item = (ClientId, f64)>) {
        let mut flows = std::mem::take(&mut self.charging);
        for (id, gpu) in charges {
            let Some(r) = self.charge_within(id, gpu) else {
                continue;
            };
            match flows.iter_mut().find(|(f, _)| *f == r) {
                Some((_, total)) => *total += gpu,
                None => flows.push((r, gpu)),
            }
        }
        for (r, gpu) in flows.drain(..) {
            self.charge_flow(r, gpu);
        }
        self.charging = flows;
    }

    /// `id`'s own virtual time, charged `gpu`; its flow, while the flow
    /// competes (else its bank is, at once).
    fn charge_within(&mut self, id: ClientId, gpu: f64) -> Option<UserRef> {
        let e = self.entities.get_mut(&id)?;
        let r = e.m.flow();
        if !e.competing {
            self.flows.entry(r).or_default().bank.lag -= gpu;
            return None;
        }
        let f = self.flows.get_mut(&r).expect("competing");
        let before = *e;
        e.vt += gpu / f.weights.within(&e.m);
        f.inner.competing.remove(&(Key(before.vt), id));
        f.inner.competing.insert((Key(e.vt), id));
        if e.waiting {
            f.inner.waiting.remove(&before.order(id));
            f.inner.waiting.insert(e.order(id));
        }
        Some(r)
    }

    /// A competing flow charged `gpu` ns, its clients' already.
    fn charge_flow(&mut self, r: UserRef, gpu: f64) {
        // A deadline is never behind its flow's virtual time less its
        // warp: a flow charged through its request starts the next,
        // unwarped (a flow its many clients keep queued keeps no stale
        // deadline).
        self.refile(r, |o| {
            o.v += gpu / o.w;
            if o.done() {
                o.request(o.req, 0.0);
            }
        });
        let band = &mut self.bands[r.0];
        band.sum_wv += gpu;
        band.rebase();
        self.raise_floor(r);
    }

    /// The GPU ns per ns its band's competing flows are charged now.
    pub fn set_rate(&mut self, b: usize, rate: f64) {
        self.bands[b].rate = rate;
    }

    /// The lag of `id`'s flow in GPU ns (0 if it does not compete).
    pub fn lag(&self, id: ClientId) -> f64 {
        self.competing(id).map_or(0.0, |(r, _)| self.flow_lag(r))
    }

    fn flow_lag(&self, r: UserRef) -> f64 {
        self.flows[&r]
            .on
            .map_or(0.0, |on| on.w * (self.bands[r.0].v() - on.v))
    }

    /// What `id`'s flow may owe and still be eligible: its request's
    /// warp while it waits.
    fn borrow(&self, id: ClientId) -> f64 {
        self.entities.get(&id).map_or(0.0, |e| e.warp)
    }

    /// Whether `id`'s flow is owed at least nothing (within a
    /// nanosecond), or for a warped waiter, owes no more than its warp.
    pub fn eligible(&self, id: ClientId) -> bool {
        self.lag(id) >= -1.0 - self.borrow(id)
    }

    /// The virtual time of `id`'s flow (infinite if it does not compete).
    pub fn vtime(&self, id: ClientId) -> f64 {
        self.competing(id).map_or(f64::INFINITY, |(_, on)| on.v)
    }

    /// The virtual deadline of the request of `id`'s flow (infinite if it
    /// does not compete).
    pub fn deadline(&self, id: ClientId) -> f64 {
        self.competing(id)
            .map_or(f64::INFINITY, |(_, on)| on.deadline)
    }

    /// Whether `a` comes before `b` within their flow (`high` first, then
    /// the one that used less of its part), or level with it (`ties`).
    pub fn precedes(&self, a: ClientId, b: ClientId, ties: bool) -> bool {
        let key = |id| self.entities.get(&id).map(|e| (!e.m.high, Key(e.vt)));
        match (key(a), key(b)) {
            (Some(x), Some(y)) => x < y || (ties && x == y),
            _ => false,
        }
    }

    /// Band `b`'s waiters, flow by flow: the eligible flows by deadline
    /// (`eligible`), or all by virtual time; within each flow, in its
    /// order. `skip`: the flow of this client is left out.
    pub fn waiters(
        &self,
        b: usize,
        eligible: bool,
        skip: Option<ClientId>,
    ) -> impl Iterator<Item = ClientId> + '_ {
        let skip = skip.and_then(|id| self.entities.get(&id)).map(|e| e.m.user);
        // One of the two orders, without boxing it: this runs at every
        // pick.
        let band = &self.bands[b];
        let by_deadline = eligible.then(|| band.queue.iter().map(|q| q.2));
        let by_v = (!eligible).then(|| band.by_v.iter().map(|q| q.1));
        by_deadline
            .into_iter()
            .flatten()
            .chain(by_v.into_iter().flatten())
            .filter(move |&u| Some(u) != skip)
            .filter(move |&u| !eligible || self.flow_eligible((b, u)))
            .flat_map(move |u| self.flow_waiters((b, u)))
    }

    /// Band `b`'s queued flows by deadline, each as its first waiter,
    /// leaving out the flow of `skip`.
    pub fn firsts(&self, b: usize, skip: ClientId) -> impl Iterator<Item = ClientId> + '_ {
        let skip = self.entities.get(&skip).map(|e| e.m.user);
        self.bands[b]
            .queue
            .iter()
            .filter(move |q| Some(q.2) != skip)
            .filter_map(move |q| self.flow_waiters((b, q.2)).next())
    }

    /// The waiters of `id`'s flow but `id`, in the flow's order.
    pub fn sibling_waiters(&self, id: ClientId) -> impl Iterator<Item = ClientId> + '_ {
        let r = self.entities.get(&id).map(|e| e.m.flow());
        r.into_iter()
            .flat_map(|r| self.flow_waiters(r))
            .filter(move |&w| w != id)
    }

    fn flow_waiters(&self, r: UserRef) -> impl Iterator<Item = ClientId> + '_ {
        self.flows
            .get(&r)
            .into_iter()
            .flat_map(|f| f.inner.waiting.iter().map(|w| w.2))
    }

    /// Whether a queued flow is eligible for its first waiter.
    fn flow_eligible(&self, r: UserRef) -> bool {
        let first = self.flow_waiters(r).next();
        self.flow_lag(r) >= -1.0 - first.map_or(0.0, |id| self.borrow(id))
    }

    /// Whether band `b` has a queued flow.
    pub fn queued(&self, b: usize) -> bool {
        !self.bands[b].queue.is_empty()
    }

    /// In how many ns `id`'s flow becomes eligible at the band's present
    /// rate (None: not while nothing is charged).
    pub fn eligible_in(&self, id: ClientId) -> Option<Nanos> {
        let (r, on) = self.competing(id)?;
        let band = &self.bands[r.0];
        let behind = on.v - self.borrow(id) / on.w - band.v();
        if behind <= 0.0 {
            return Some(0);
        }
        (band.rate > 0.0).then(|| (behind * band.sum_w / band.rate).ceil() as Nanos + 1)
    }

    /// Its weight within its band, as it is now or would be if it joined
    /// (what status shows, scaled as a user's weight): its flow's, times
    /// its part of the flow.
    pub fn weight(&self, id: ClientId) -> f64 {
        let Some(e) = self.entities.get(&id) else {
            return 0.0;
        };
        let Some(f) = self.flows.get(&e.m.flow()) else {
            return 0.0;
        };
        if e.competing {
            return f.weights.flow(e.m.user) * f.weights.within(&e.m);
        }
        // As if it joined: its unit with it, the sums with its unit.
        let unit = f.weights.units.get(&e.m.unit);
        let before = unit.map_or(0.0, Unit::weight);
        let mut u = unit.cloned().unwrap_or_default();
        u.own.add(e.m.own);
        u.imposed = e.m.unit_weight.or(u.imposed);
        let unit_sum = f.weights.unit_sum - before + u.weight();
        let user = f.weights.user.max().unwrap_or(0.0).max(e.m.user_weight);
        let flow = match e.m.user {
            UserKey::User(_) => USER_SCALE * user,
            UserKey::Unit(_) => unit_sum,
        };
        sanitize_weight(flow * (u.weight() / unit_sum) * (e.m.own / u.own.total))
    }

    fn entity(&mut self, id: ClientId) -> &mut Entity {
        self.entities.get_mut(&id).expect("registered")
    }

    fn flow(&mut self, r: UserRef) -> &mut Flow {
        self.flows.entry(r).or_default()
    }

    /// `id`'s flow and its place in its band, while the flow competes.
    fn competing(&self, id: ClientId) -> Option<(UserRef, On)> {
        let r = self.entities.get(&id)?.m.flow();
        Some((r, self.flows.get(&r)?.on?))
    }

    /// Changes a competing flow's place (`f` on its `On`), keeping the
    /// band's queues in order; the band's sums are the caller's.
    fn refile(&mut self, r: UserRef, f: impl FnOnce(&mut On)) {
        let flow = self.flows.get_mut(&r).expect("a flow");
        let Some(on) = flow.on.as_mut() else {
            return;
        };
        let band = &mut self.bands[r.0];
        if let Some(seq) = flow.queued {
            band.queue.remove(&(Key(on.deadline), seq, r.1));
            band.by_v.remove(&(Key(on.v), r.1));
        }
        f(on);
        if let Some(seq) = flow.queued {
            band.queue.insert((Key(on.deadline), seq, r.1));
            band.by_v.insert((Key(on.v), r.1));
        }
    }

    /// Puts a competing flow in its band's run queue, behind those of
    /// the same deadline already there, or takes it out.
    fn set_flow_queued(&mut self, r: UserRef, queued: bool) {
        let Some(flow) = self.flows.get_mut(&r) else {
            return;
        };
        let (Some(on), true) = (flow.on, flow.queued.is_some() != queued) else {
            return;
        };
        let band = &mut self.bands[r.0];
        match flow.queued.take() {
            Some(seq) => {
                band.queue.remove(&(Key(on.deadline), seq, r.1));
                band.by_v.remove(&(Key(on.v), r.1));
            }
            None => {
                self.seq += 1;
                flow.queued = Some(self.seq);
                band.queue.insert((Key(on.deadline), self.seq, r.1));
                band.by_v.insert((Key(on.v), r.1));
            }
        }
    }

    /// A flow starts competing: placed so that its lag is its bank
    /// (a debt forgiven for its time away, a credit capped, unless it was
    /// kept out by a ceiling).
    fn join(&mut self, r: UserRef, now: Nanos) {
        let longest = self.longest;
        let f = self.flow(r);
        let bank = std::mem::take(&mut f.bank);
        let away = bank.away_since.map_or(0, |t| now.saturating_sub(t));
        let lag = if bank.kept {
            bank.lag
        } else if bank.lag < 0.0 {
            (bank.lag + FORGIVE * away as f64).min(0.0)
        } else {
            bank.lag.min(longest)
        };
        let w = f.weights.flow(r.1);
        // Placed with lag `l` among others weighing W: v = V − l(W+w)/(wW),
        // so that its lag is `l` once `V` counts it too.
        let band = &mut self.bands[r.0];
        let (vv, big_w) = (band.v(), band.sum_w);
        let v = if big_w > 0.0 {
            vv - lag * (big_w + w) / (w * big_w)
        } else {
            vv
        };
        band.add(w, v);
        let mut on = On {
            w,
            v,
            deadline: v,
            req: longest,
            warp: 0.0,
        };
        on.request(longest, 0.0);
        self.flow(r).on = Some(on);
    }

    /// A flow stops competing: its lag goes to its bank.
    fn leave(&mut self, r: UserRef, now: Nanos) {
        let lag = self.flow_lag(r);
        self.set_flow_queued(r, false);
        let f = self.flow(r);
        let Some(on) = f.on.take() else {
            return;
        };
        f.bank = Bank {
            lag: f.bank.lag + lag,
            away_since: Some(now),
            kept: f.parked > 0,
        };
        self.bands[r.0].remove(on.w, on.v);
    }

    /// The flow's floor follows its least competing virtual time up.
    fn raise_floor(&mut self, r: UserRef) {
        let inner = &mut self.flow(r).inner;
        if let Some(&(Key(least), _)) = inner.competing.first() {
            inner.floor = inner.floor.max(least);
        }
    }

    /// Sets a competing flow's weight from its clients', keeping its lag
    /// (and the band's `V` unmoved) and its request's remaining length.
    fn reweigh(&mut self, r: UserRef) {
        let Some(f) = self.flows.get(&r) else {
            return;
        };
        let w = f.weights.flow(r.1);
        let Some(on) = f.on.filter(|on| on.w != w) else {
            return;
        };
        let vv = self.bands[r.0].v();
        let v = vv - (vv - on.v) * on.w / w;
        let deadline = v + (on.deadline - on.v) * on.w / w;
        self.bands[r.0].remove(on.w, on.v);
        self.bands[r.0].add(w, v);
        self.refile(r, |o| {
            *o = On {
                w,
                v,
                deadline,
                ..*o
            }
        });
    }

    /// A client registers in flow `r` (`joins`) or leaves it. A flow with
    /// nothing registered is kept only for its bank, and at most
    /// `MAX_KEPT` of them (the one owing least goes first).
    fn count(&mut self, r: UserRef, joins: bool) {
        let f = self.flow(r);
        if joins {
            f.members += 1;
            self.kept.remove(&r);
            return;
        }
        f.members -= 1;
        if f.members > 0 {
            return;
        }
        if f.bank.lag.abs() < 1.0 {
            self.flows.remove(&r);
        } else {
            self.kept.insert(r);
        }
        if self.kept.len() > MAX_KEPT
            && let Some(&r) = self
                .kept
                .iter()
                .min_by_key(|r| Key(self.flows[r].bank.lag.abs()))
        {
            self.kept.remove(&r);
            self.flows.remove(&r);
        }
    }
}
