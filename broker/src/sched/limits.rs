//! Ceilings on time on the GPU: a client's `GPU_COMPUTE_LIMIT`, its unit's
//! `--gpu-limit` (one budget for all members), and the `high` class's share
//! of each window while a lower class could use the GPU (Linux's real-time
//! throttling).

use super::meter::{Meter, budget};
use super::{Client, ClientState, Nanos, Priority, Scheduler};

/// One ceiling on a client's time on the GPU in the window.
struct Ceiling<'a> {
    budget: Nanos,
    /// The least worth granting against it: without a floor, a client
    /// hovering at its budget would get a stream of nanosecond grants.
    quantum: Nanos,
    meter: &'a Meter,
}

impl Ceiling<'_> {
    fn remaining(&self, window: Nanos, now: Nanos) -> Nanos {
        self.budget.saturating_sub(self.meter.usage(window, now))
    }

    fn fits(&self, window: Nanos, now: Nanos) -> bool {
        self.remaining(window, now) >= self.quantum
    }
}

impl Scheduler {
    /// Opens and closes the meters of units and of the `high` class after
    /// clients went on or off the GPU at `now` (every change within one
    /// call happens at the same instant, so doing it once per call is
    /// exact).
    pub(super) fn sync_meters(&mut self, now: Nanos) {
        // The class's share is charged only while one of its clients
        // holds the GPU: a revoked or hung holder, or work a client says
        // is still draining, is its own charge and nobody else's (a hung
        // `high` client once used up the class's share for every other
        // `high` client, leaving the GPU idle).
        // Only the holder holds.
        let high_on = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .is_some_and(|c| c.class == Priority::High && c.state == ClientState::Holding);
        self.high.set(high_on, now);
        self.sync_doubt(now);
        if self.units.is_empty() {
            return;
        }
        let (clients, ix) = (&self.clients, &self.ix);
        for (g, u) in self.units.iter_mut() {
            let on = ix.on_gpu.iter().any(|id| clients[id].group == *g);
            u.meter.set(on, now);
        }
        // A unit nobody belongs to any more is kept only while the window
        // still sees its time.
        self.units
            .retain(|g, u| !u.meter.is_empty() || ix.has_members(*g));
    }

    /// Whether the `high` class is held to its share of the window now:
    /// some client of a lower class could use the GPU (holds it, or waits
    /// within its own ceilings). Work-conserving: alone, `high` is not
    /// bounded.
    pub(super) fn high_bounded(&self, now: Nanos) -> bool {
        let holds = |c: &Client| c.class < Priority::High && c.state == ClientState::Holding;
        self.cfg.high_share < 1.0
            && (self
                .holder
                .and_then(|h| self.clients.get(&h))
                .is_some_and(holds)
                || [Priority::Normal, Priority::Low].into_iter().any(|k| {
                    self.ix.waiting[k.index()]
                        .iter()
                        .any(|id| self.fits(&self.clients[id], now, false))
                }))
    }

    /// The ceilings on a client's time in the window: its own limit, its
    /// unit's, and, for a `high` client while the class is `bounded`, the
    /// class's share. The class's grants are no smaller than a timeslice,
    /// so that `high` and the others take turns in slices, not in slivers.
    fn ceilings<'a>(&'a self, c: &'a Client, bounded: bool) -> impl Iterator<Item = Ceiling<'a>> {
        let cfg = &self.cfg;
        let limited = |fraction: f64, meter: &'a Meter| {
            let budget = budget(fraction, cfg.window);
            Ceiling {
                budget,
                quantum: (budget.min(cfg.timeslice) / 5).max(1),
                meter,
            }
        };
        let own = c.limit.map(|l| limited(l, &c.meter));
        let unit = self
            .units
            .get(&c.group)
            .and_then(|u| u.limit.map(|l| limited(l, &u.meter)));
        let class = (bounded && c.class == Priority::High).then(|| {
            let budget = budget(cfg.high_share, cfg.window);
            Ceiling {
                budget,
                quantum: budget.min(cfg.timeslice),
                meter: &self.high,
            }
        });
        [own, unit, class].into_iter().flatten()
    }

    /// Whether `c` may be granted now, as far as its ceilings go (and
    /// a deferral, `evidence`).
    pub(super) fn fits(&self, c: &Client, now: Nanos, bounded: bool) -> bool {
        let w = self.cfg.window;
        now >= self.deferred_until(c) && self.ceilings(c, bounded).all(|x| x.fits(w, now))
    }

    /// What the tightest of `c`'s ceilings leaves it; None: unbounded.
    pub(super) fn remaining(&self, c: &Client, now: Nanos, bounded: bool) -> Option<Nanos> {
        let w = self.cfg.window;
        self.ceilings(c, bounded).map(|x| x.remaining(w, now)).min()
    }

    /// Earliest instant at which a waiting client that does not fit its
    /// ceilings will, computed with the same integer arithmetic as `fits`
    /// so that a timer armed for it never fires early. None when it fits,
    /// or while a meter in its way still runs (an event comes first).
    pub(super) fn fits_at(&self, c: &Client, now: Nanos, bounded: bool) -> Option<Nanos> {
        let w = self.cfg.window;
        let deferred = self.deferred_until(c);
        let mut at = (deferred > now).then_some(deferred);
        for x in self.ceilings(c, bounded).filter(|x| !x.fits(w, now)) {
            let t = x.meter.down_to_at(w, now, x.budget - x.quantum)?;
            at = Some(at.map_or(t, |a: Nanos| a.max(t)));
        }
        at
    }
}
