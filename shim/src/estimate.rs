//! The in-flight estimate: from the gaps between consecutive completions
//! of this process's launches on a device (measured by `inflight.rs` with
//! driver events), the GPU time one launch takes, and so how many launches
//! may be in flight under a bound of `bound` ns of queued work. Pure
//! arithmetic, tested on its own.

/// Most launches tracked at once per device, whatever the estimate.
pub const MAX_IN_FLIGHT: usize = 64;

/// Estimated GPU time per launch on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// ns; 0: no sample yet.
    ns: u64,
}

impl Estimate {
    pub const NONE: Estimate = Estimate { ns: 0 };

    #[cfg(test)]
    fn ns(self) -> u64 {
        self.ns
    }

    /// Learns from the gap between two consecutive completions. Down at
    /// once, up slowly: time-slicing against other processes only ever
    /// stretches the gap between two completions, and an estimate inflated
    /// that way would split a short request into launches the GPU runs one
    /// by one, switching away between them.
    pub fn learn(&mut self, gap_ns: u64) {
        self.ns = if self.ns == 0 || gap_ns < self.ns {
            gap_ns.max(1)
        } else {
            self.ns + (gap_ns - self.ns) / 16
        };
    }

    /// Launches allowed in flight under `bound` ns: at least two for short
    /// kernels, so the GPU always has the next one queued, and one for
    /// kernels longer than the bound.
    pub fn allowed(self, bound: u64) -> usize {
        match self.ns {
            0 => 2,
            e if e >= bound => 1,
            e => ((bound / e) as usize).clamp(2, MAX_IN_FLIGHT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn without_a_sample_two_may_be_queued() {
        assert_eq!(Estimate::NONE.allowed(2 * MS), 2);
    }

    #[test]
    fn the_bound_is_divided_by_the_estimate() {
        let mut e = Estimate::NONE;
        e.learn(100_000);
        assert_eq!(e.ns(), 100_000);
        assert_eq!(e.allowed(2 * MS), 20);
        // Tiny kernels: capped, so a burst cannot queue without end.
        e.learn(10);
        assert_eq!(e.allowed(2 * MS), MAX_IN_FLIGHT);
        // A kernel longer than the bound goes out alone.
        let mut long = Estimate::NONE;
        long.learn(120 * MS);
        assert_eq!(long.allowed(2 * MS), 1);
        // Just under the bound: still two, so the GPU never idles.
        let mut near = Estimate::NONE;
        near.learn(2 * MS - 1);
        assert_eq!(near.allowed(2 * MS), 2);
    }

    #[test]
    fn down_at_once_up_slowly() {
        let mut e = Estimate::NONE;
        e.learn(MS);
        // One gap stretched by another process's slice moves it a little.
        e.learn(17 * MS);
        assert_eq!(e.ns(), 2 * MS);
        e.learn(MS / 2);
        assert_eq!(e.ns(), MS / 2);
        // A zero gap (two completions at once) still counts as 1 ns.
        e.learn(0);
        assert_eq!(e.ns(), 1);
    }
}
