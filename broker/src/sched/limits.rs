//! Ceilings on time on the GPU: a client's `GPU_COMPUTE_LIMIT`, its unit's
//! `--gpu-limit` (one budget for all members), and the `high` class's share
//! of each window while a lower class could use the GPU (Linux's real-time
//! throttling; kept by users in `high`).

use super::meter::{Meter, budget};
use super::{Client, Nanos, Priority, Scheduler};

/// One ceiling on a client's time on the GPU in the window.
pub(super) struct Ceiling<'a> {
    pub(super) budget: Nanos,
    /// The least worth granting against it: without a floor, a client
    /// hovering at its budget would get a stream of nanosecond grants.
    pub(super) quantum: Nanos,
    pub(super) meter: &'a Meter,
}

impl Ceiling<'_> {
    pub(super) fn remaining(&self, window: Nanos, now: Nanos) -> Nanos {
        self.budget.saturating_sub(self.meter.usage(window, now))
    }

    pub(super) fn fits(&self, window: Nanos, now: Nanos) -> bool {
        self.remaining(window, now) >= self.quantum
    }
}

impl Scheduler {
    /// Opens and closes the meters of units and of the `high` class after
    /// clients went on or off the GPU at `now` (every change within one
    /// call happens at the same instant, so doing it once per call is
    /// exact).
    pub(super) fn sync_meters(&mut self, now: Nanos) {
        self.sync_high(now);
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

    /// The ceilings on a client's time in the window: its own limit, its
    /// unit's, and, for a `high` client while the class is `bounded`, its
    /// user's part of the class's share or the class's leftover (`high`).
    /// The class's grants are no smaller than a timeslice, so that `high`
    /// and the others take turns in slices, not in slivers.
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
        let class = (bounded && c.class == Priority::High).then(|| self.high_ceiling(c));
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
