//! The core's timers as one table: each part reports its next deadline
//! under its name, `Broker::next_timeout` is the table's minimum and
//! `Broker::handle_timeout` hands each due timer to its part.
//! Named, a part's deadline is its own to report: no part scans another's
//! state to find when it is next due.

use super::Nanos;

/// Whose deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Timer {
    /// A GPU's scheduler (a slice's end, a revoke's bound).
    Scheduler,
    /// The queue's tick while anyone waits, the end of a recovery.
    Jobs,
    /// Connections past their deadlines, restored jobs whose run died,
    /// users' voices to forget.
    Sweep,
    /// A held status request's user's budget refilling.
    Status,
    /// The state's next write.
    Save,
    /// The next sample of status's history.
    History,
}

const TIMERS: usize = 6;

/// The earliest deadline of each part.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Timers([Option<Nanos>; TIMERS]);

impl Timers {
    /// `timer` has something to do at `at` (the earliest is kept).
    pub fn set(&mut self, timer: Timer, at: Option<Nanos>) {
        let slot = &mut self.0[timer as usize];
        *slot = match (*slot, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// The earliest deadline of all.
    pub fn next(&self) -> Option<Nanos> {
        self.0.iter().flatten().copied().min()
    }

    /// The timers due at `now`, in the table's order.
    pub fn due(&self, now: Nanos) -> Vec<Timer> {
        const ALL: [Timer; TIMERS] = [
            Timer::Scheduler,
            Timer::Jobs,
            Timer::Sweep,
            Timer::Status,
            Timer::Save,
            Timer::History,
        ];
        ALL.into_iter()
            .filter(|&t| self.0[t as usize].is_some_and(|at| at <= now))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_timeout_is_the_earliest_of_every_parts_earliest() {
        let mut t = Timers::default();
        assert_eq!(t.next(), None, "nothing to do: the shell sleeps");
        t.set(Timer::History, Some(50));
        t.set(Timer::Status, Some(30));
        t.set(Timer::Status, Some(40));
        t.set(Timer::Status, None);
        t.set(Timer::Jobs, None);
        assert_eq!(t.next(), Some(30), "a part's earliest kept");
        t.set(Timer::Scheduler, Some(10));
        assert_eq!(t.next(), Some(10));
        assert_eq!(t.due(9), []);
        assert_eq!(t.due(30), [Timer::Scheduler, Timer::Status]);
        assert_eq!(t.due(u64::MAX).len(), 3);
    }
}
