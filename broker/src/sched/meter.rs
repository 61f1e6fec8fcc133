//! Time on the GPU over a sliding window: of one client, of a unit (a job
//! with a `--gpu-limit`), or of the `high` class. The scheduler opens and
//! closes the meter's interval whenever what it measures goes on or off the
//! GPU; budgets are read from it with the same integer arithmetic that
//! arms their timers, so a timer never fires early.

use std::collections::VecDeque;

use super::Nanos;

/// Closed intervals kept. Only the last window matters; the cap keeps a
/// client that spins acquire/release from growing memory without bound.
pub(super) const MAX_HISTORY: usize = 256;

fn overlap(s: Nanos, e: Nanos, lo: Nanos, hi: Nanos) -> Nanos {
    e.min(hi).saturating_sub(s.max(lo))
}

#[derive(Debug, Clone, Default)]
pub(super) struct Meter {
    /// Closed intervals, oldest first, non-overlapping.
    history: VecDeque<(Nanos, Nanos)>,
    /// Open since then.
    run_start: Option<Nanos>,
    total_closed: Nanos,
}

impl Meter {
    /// Opens or closes the interval: `on` is whether what is measured is
    /// on the GPU now.
    pub fn set(&mut self, on: bool, now: Nanos) {
        match (on, self.run_start) {
            (true, None) => self.run_start = Some(now),
            (false, Some(s)) => {
                self.run_start = None;
                self.close(s, now);
            }
            _ => {}
        }
    }

    fn close(&mut self, start: Nanos, end: Nanos) {
        let end = end.max(start);
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

    /// Time on the GPU within `(now - window, now]`.
    pub fn usage(&self, window: Nanos, now: Nanos) -> Nanos {
        let lo = now.saturating_sub(window);
        let closed: Nanos = self
            .history
            .iter()
            .map(|&(s, e)| overlap(s, e, lo, now))
            .sum();
        let open = self.run_start.map_or(0, |s| overlap(s, now, lo, now));
        closed + open
    }

    /// All time on the GPU since the meter was made.
    pub fn total(&self, now: Nanos) -> Nanos {
        self.total_closed + self.run_start.map_or(0, |s| now.saturating_sub(s))
    }

    /// Earliest instant at which usage in the window is down to `allowed`
    /// if what is measured went off the GPU now (a meter still running
    /// only makes it later); None when it is already there.
    pub fn down_to_at(&self, window: Nanos, now: Nanos, allowed: Nanos) -> Option<Nanos> {
        let used = self.usage(window, now);
        if used <= allowed {
            return None;
        }
        // As the window's left edge slides forward, usage drops by the
        // held time it passes over; find where that reaches the excess.
        let excess = used - allowed;
        let lo = now.saturating_sub(window);
        let open = self.run_start.map(|s| (s, now));
        let mut acc = 0;
        for (s, e) in self.history.iter().copied().chain(open) {
            let s = s.max(lo);
            if e <= s {
                continue;
            }
            let len = e - s;
            if acc + len >= excess {
                return Some(s + (excess - acc) + window);
            }
            acc += len;
        }
        None
    }

    /// Forgets intervals that ended before the window.
    pub fn prune(&mut self, window: Nanos, now: Nanos) {
        let lo = now.saturating_sub(window);
        while self.history.front().is_some_and(|&(_, e)| e <= lo) {
            self.history.pop_front();
        }
    }

    /// Nothing left that the window could still see.
    pub fn is_empty(&self) -> bool {
        self.history.is_empty() && self.run_start.is_none()
    }

    /// What a departing member leaves to its unit's next one.
    pub fn take_history(&mut self) -> VecDeque<(Nanos, Nanos)> {
        std::mem::take(&mut self.history)
    }

    pub fn adopt_history(&mut self, history: VecDeque<(Nanos, Nanos)>) {
        if self.history.is_empty() {
            self.history = history;
        }
    }
}

/// A budget of `fraction` of each window, as ns (at least 1).
pub(super) fn budget(fraction: f64, window: Nanos) -> Nanos {
    ((fraction * window as f64) as Nanos).max(1)
}
