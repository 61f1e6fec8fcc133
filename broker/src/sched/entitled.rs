//! What each client was entitled to, and how long its ceilings held it
//! back: a stable measure of starvation. A client's target share is
//! integrated over the time it asked (waited or held) in the highest
//! band anyone asks in: compared with its GPU time, what is left is time
//! it was owed and did not get. A target that flaps while a `high`
//! client comes and goes averages out instead of flapping an alert, and
//! what a higher band was entitled to is never counted as owed. Time an
//! asking client was kept out by its own limit, its job's, the `high`
//! class's share or its want of evidence (`ceilings`: parked) is counted
//! as held back instead, and owed nothing.
//!
//! The share is the hierarchy's, among the asking clients of the band
//! (parked ones too: they still want their part): its user's weight over
//! the asking users', its unit's over the user's asking units', its own
//! over its unit's asking members'. It is integrated exactly and in
//! constant time per event, however many clients ask: a clock per level
//! (band, user, unit) runs at the level's rate against the level above,
//! `dt` over the band's total weight at the top, so a client's
//! entitlement is its own weight times how far its unit's clock ran while
//! it asked, and an event moves only the clocks of the one client it
//! concerns (a change of a level's rate starts its clock afresh from
//! where it stands; every other member's reading stays true).

use std::collections::{BTreeMap, HashMap};

use super::clock::{BANDS, Member, UserRef, Weights};
use super::{ClientId, GroupId, Nanos};

/// A clock that runs at `rate` against its parent's reading: `base` when
/// the parent read `from`.
#[derive(Debug, Clone, Copy, Default)]
struct Lin {
    base: f64,
    from: f64,
    rate: f64,
}

impl Lin {
    fn at(&self, parent: f64) -> f64 {
        self.base + self.rate * (parent - self.from)
    }

    /// From now (the parent reading `parent`), runs at `rate`.
    fn set_rate(&mut self, parent: f64, rate: f64) {
        *self = Lin {
            base: self.at(parent),
            from: parent,
            rate,
        };
    }
}

/// A band's clocks: `g` runs at 1 over the band's asking weight, `t` at
/// 1, both only while the band is the highest that asks.
#[derive(Debug, Clone, Copy, Default)]
struct Band {
    asking: usize,
    /// The sum of its asking flows' weights.
    weight: f64,
    g: f64,
    t: f64,
}

/// A flow's asking members by unit, its clock against its band's `g`,
/// and each unit's against it.
#[derive(Debug, Clone, Default)]
struct Flow {
    weights: Weights,
    weight: f64,
    clock: Lin,
    units: HashMap<GroupId, Lin>,
}

/// How a client asks: its place and whether its ceilings keep it out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Asks {
    pub m: Member,
    pub parked: bool,
}

/// A client's sums, and while it asks, its clock's reading when they
/// were last brought up to date (its unit's, or its band's `t` while
/// parked).
#[derive(Debug, Clone, Copy, Default)]
struct Acct {
    owed: f64,
    held_back: f64,
    asks: Option<(Asks, f64)>,
}

/// The entitlement clocks of one GPU's scheduler.
#[derive(Debug, Clone, Default)]
pub(super) struct Entitled {
    at: Nanos,
    bands: [Band; BANDS],
    flows: BTreeMap<UserRef, Flow>,
    clients: HashMap<ClientId, Acct>,
}

impl Entitled {
    /// The highest band anyone asks in.
    fn top(&self) -> Option<usize> {
        (0..BANDS).rev().find(|&b| self.bands[b].asking > 0)
    }

    /// Band `b`'s clocks (`g`, `t`) as they read at `now`.
    fn band_at(&self, b: usize, now: Nanos) -> (f64, f64) {
        let band = &self.bands[b];
        let dt = now.saturating_sub(self.at) as f64;
        if self.top() != Some(b) || dt == 0.0 {
            return (band.g, band.t);
        }
        let g = if band.weight > 0.0 {
            dt / band.weight
        } else {
            0.0
        };
        (band.g + g, band.t + dt)
    }

    fn advance(&mut self, now: Nanos) {
        if let Some(b) = self.top() {
            (self.bands[b].g, self.bands[b].t) = self.band_at(b, now);
        }
        self.at = self.at.max(now);
    }

    /// The reading of the clock of `m`'s unit at `now`.
    fn unit_at(&self, m: &Member, now: Nanos) -> f64 {
        let (g, _) = self.band_at(m.band, now);
        let Some(f) = self.flows.get(&m.flow()) else {
            return 0.0;
        };
        let unit = f.units.get(&m.unit).copied().unwrap_or_default();
        unit.at(f.clock.at(g))
    }

    /// What a client asking as `a` since its clock read `from` has
    /// gathered by `now`: (owed, held back), ns.
    fn gathered(&self, a: &Asks, from: f64, now: Nanos) -> (f64, f64) {
        if a.parked {
            (0.0, self.band_at(a.m.band, now).1 - from)
        } else {
            (a.m.own * (self.unit_at(&a.m, now) - from), 0.0)
        }
    }

    /// Client `id`'s (owed, held back) so far, ns.
    pub fn of(&self, id: ClientId, now: Nanos) -> (f64, f64) {
        let Some(c) = self.clients.get(&id) else {
            return (0.0, 0.0);
        };
        let (o, h) = c
            .asks
            .map_or((0.0, 0.0), |(a, from)| self.gathered(&a, from, now));
        (c.owed + o, c.held_back + h)
    }

    /// Client `id` asks as `asks` from `now` (None: it does not ask).
    pub fn set(&mut self, id: ClientId, asks: Option<Asks>, now: Nanos) {
        let old = self.clients.get(&id).and_then(|c| c.asks);
        if old.map(|(a, _)| a) == asks {
            return;
        }
        self.advance(now);
        let (owed, held) = self.of(id, now);
        if let Some((a, _)) = old {
            self.join(&a.m, false);
        }
        let asks = asks.map(|a| {
            self.join(&a.m, true);
            let from = if a.parked {
                self.bands[a.m.band].t
            } else {
                self.unit_at(&a.m, now)
            };
            (a, from)
        });
        self.clients.insert(
            id,
            Acct {
                owed,
                held_back: held,
                asks,
            },
        );
    }

    /// Client `id` is gone.
    pub fn forget(&mut self, id: ClientId, now: Nanos) {
        self.set(id, None, now);
        self.clients.remove(&id);
    }

    /// `m` joins its flow's asking members (`on`) or leaves them: its
    /// unit's and flow's clocks start afresh at their new rates, and its
    /// band's weight follows its flow's. The band's clocks were brought
    /// up to date first.
    fn join(&mut self, m: &Member, on: bool) {
        let band = &mut self.bands[m.band];
        let g = band.g;
        let f = self.flows.entry(m.flow()).or_default();
        let flow_g = f.clock.at(g);
        if on {
            f.weights.add(m);
            band.asking += 1;
        } else {
            f.weights.remove(m);
            band.asking -= 1;
        }
        if f.weights.has(m.unit) {
            let rate = f.weights.per_own_weight(m.unit);
            f.units.entry(m.unit).or_default().set_rate(flow_g, rate);
        } else {
            f.units.remove(&m.unit);
        }
        if f.weights.is_empty() {
            band.weight -= f.weight;
            self.flows.remove(&m.flow());
        } else {
            let weight = f.weights.flow(m.user);
            band.weight += weight - f.weight;
            f.weight = weight;
            f.clock.set_rate(g, f.weights.per_unit_weight(m.user));
        }
        // Exact again once empty, whatever rounding the sums gathered.
        if band.asking == 0 {
            band.weight = 0.0;
        }
    }
}
