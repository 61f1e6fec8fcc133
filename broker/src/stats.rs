//! What the core counts for metrics as it happens, where no status
//! snapshot could see it: how long each Acquire waited for its Grant,
//! how long each queued request waited for its lease, and the refusals
//! by reason. Pure counting in virtual time; `proto` updates it at the
//! few places where these events happen and the metrics room reads a
//! copy with each snapshot.

use std::collections::HashMap;

use gpufrac_common::config::Priority;

type Nanos = u64;
type ConnId = u64;

const MS: Nanos = 1_000_000;
const S: Nanos = 1_000 * MS;

/// Upper bounds of the grant latency buckets: from a handover without
/// contention (well under a millisecond) to a wait behind several
/// timeslices or a hung holder.
pub const GRANT_BUCKETS: [Nanos; 15] = [
    100_000,
    250_000,
    500_000,
    MS,
    2 * MS + MS / 2,
    5 * MS,
    10 * MS,
    25 * MS,
    50 * MS,
    100 * MS,
    250 * MS,
    500 * MS,
    S,
    5 * S,
    30 * S,
];

/// Upper bounds of the queue wait buckets: from a request placed at once
/// to one that waited past the default escalation limit (1 h).
pub const QUEUE_BUCKETS: [Nanos; 14] = [
    100 * MS,
    S,
    5 * S,
    15 * S,
    30 * S,
    60 * S,
    300 * S,
    900 * S,
    1800 * S,
    3600 * S,
    7200 * S,
    14_400 * S,
    43_200 * S,
    86_400 * S,
];

/// A Prometheus histogram of durations: a count per bucket (not
/// cumulative), the sum and the count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Histogram {
    bounds: &'static [Nanos],
    /// One more than `bounds`: the last counts what is above them all.
    counts: Vec<u64>,
    sum: u128,
}

impl Histogram {
    pub fn new(bounds: &'static [Nanos]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0,
        }
    }

    pub fn observe(&mut self, d: Nanos) {
        let i = self.bounds.partition_point(|&b| b < d);
        self.counts[i] += 1;
        self.sum += u128::from(d);
    }

    /// (upper bound in ns, observations at or below it), cumulative, as
    /// Prometheus's `le` buckets; `+Inf` is `count()`.
    pub fn buckets(&self) -> impl Iterator<Item = (Nanos, u64)> + '_ {
        self.bounds
            .iter()
            .copied()
            .zip(self.counts.iter().scan(0, |acc, c| {
                *acc += c;
                Some(*acc)
            }))
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The sum of all observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum as f64 / 1e9
    }
}

/// Why the broker said no: a bounded set, so that each is one series.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Refusal {
    /// A connection past its user's `--max-connections-per-user`.
    ConnectionLimit,
    /// A lease past its user's lease or queued-request limit.
    LeaseLimit,
    /// What the rules do not let this user ask (pinned leases, chosen
    /// tokens, `high` outside the allow-list).
    NotAllowed,
    /// A registration naming GPUs this node does not have.
    UnknownGpu,
    /// A `--no-wait` request that found no room.
    NoRoom,
    /// A request no GPU of this node could ever satisfy, or with invalid
    /// values: refused instead of queued for ever.
    Unsatisfiable,
    /// Any other request the broker could not take (a second lease on a
    /// connection, a claim it cannot verify, a process it cannot
    /// identify).
    Other,
}

impl Refusal {
    pub const ALL: [Refusal; 7] = [
        Refusal::ConnectionLimit,
        Refusal::LeaseLimit,
        Refusal::NotAllowed,
        Refusal::UnknownGpu,
        Refusal::NoRoom,
        Refusal::Unsatisfiable,
        Refusal::Other,
    ];

    /// Its label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::ConnectionLimit => "connection_limit",
            Refusal::LeaseLimit => "lease_limit",
            Refusal::NotAllowed => "not_allowed",
            Refusal::UnknownGpu => "unknown_gpu",
            Refusal::NoRoom => "no_room",
            Refusal::Unsatisfiable => "unsatisfiable",
            Refusal::Other => "other",
        }
    }
}

/// The core's counters since the broker started.
#[derive(Clone, Debug)]
pub struct Stats {
    /// Acquire to Grant, per priority class (`Priority::index`).
    pub grant_latency: [Histogram; 3],
    /// A queued `gpufrac run` request's wait for its lease.
    pub queue_wait: Histogram,
    /// Refusals by reason, in `Refusal::ALL`'s order.
    pub refusals: [u64; Refusal::ALL.len()],
    /// Acquires not yet granted: (connection, GPU) → (when, class). At
    /// most one per device a connection registered; a connection's go
    /// with it (`forget`).
    asked: HashMap<(ConnId, usize), (Nanos, Priority)>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            grant_latency: std::array::from_fn(|_| Histogram::new(&GRANT_BUCKETS)),
            queue_wait: Histogram::new(&QUEUE_BUCKETS),
            refusals: [0; Refusal::ALL.len()],
            asked: HashMap::new(),
        }
    }
}

impl Stats {
    /// Connection `id` asked for GPU `gpu`: its wait starts now, unless it
    /// already waits (a repeated Acquire changes nothing).
    pub fn acquired(&mut self, now: Nanos, id: ConnId, gpu: usize, class: Priority) {
        self.asked.entry((id, gpu)).or_insert((now, class));
    }

    /// `id` was granted `gpu`: the wait since its Acquire is observed (a
    /// grant with no Acquire before it is not a wait).
    pub fn granted(&mut self, now: Nanos, id: ConnId, gpu: usize) {
        if let Some((at, class)) = self.asked.remove(&(id, gpu)) {
            self.grant_latency[class.index()].observe(now.saturating_sub(at));
        }
    }

    /// `id` released `gpu` (or withdrew its request): nothing is waited for.
    pub fn released(&mut self, id: ConnId, gpu: usize) {
        self.asked.remove(&(id, gpu));
    }

    /// The connection is gone.
    pub fn forget(&mut self, id: ConnId) {
        self.asked.retain(|(c, _), _| *c != id);
    }

    /// A queued request got its lease after waiting `waited`.
    pub fn queue_waited(&mut self, waited: Nanos) {
        self.queue_wait.observe(waited);
    }

    pub fn refused(&mut self, why: Refusal) {
        let i = Refusal::ALL
            .iter()
            .position(|r| *r == why)
            .expect("every reason is in ALL");
        self.refusals[i] += 1;
    }

    /// A copy without the pending requests, for the metrics room.
    pub fn counters(&self) -> Stats {
        Stats {
            grant_latency: self.grant_latency.clone(),
            queue_wait: self.queue_wait.clone(),
            refusals: self.refusals,
            asked: HashMap::new(),
        }
    }

    /// Acquires waiting for a grant (for tests of the bookkeeping).
    pub fn waiting(&self) -> usize {
        self.asked.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_observation_in_the_first_bucket_that_holds_it() {
        let mut h = Histogram::new(&GRANT_BUCKETS);
        h.observe(100_000); // on a bound: in it (le is "less or equal")
        h.observe(100_001);
        h.observe(60 * S); // above them all: only in +Inf
        let b: Vec<(Nanos, u64)> = h.buckets().collect();
        assert_eq!(b[0], (100_000, 1));
        assert_eq!(b[1], (250_000, 2));
        assert_eq!(b.last(), Some(&(30 * S, 2)));
        assert_eq!(h.count(), 3);
        assert!((h.sum_seconds() - (60.0 + 0.000_200_001)).abs() < 1e-9);
    }

    #[test]
    fn a_grant_is_timed_from_the_first_acquire_and_only_once() {
        let mut s = Stats::default();
        s.acquired(10 * MS, 1, 0, Priority::High);
        // Asked again while waiting: still timed from the first.
        s.acquired(20 * MS, 1, 0, Priority::High);
        s.granted(13 * MS, 1, 0);
        let h = &s.grant_latency[Priority::High.index()];
        assert_eq!(h.count(), 1);
        assert!((h.sum_seconds() - 0.003).abs() < 1e-12);
        // A grant with no Acquire pending is no wait.
        s.granted(40 * MS, 1, 0);
        assert_eq!(s.grant_latency[Priority::High.index()].count(), 1);
        assert_eq!(s.grant_latency[Priority::Normal.index()].count(), 0);
    }

    #[test]
    fn what_is_released_or_whose_connection_went_is_not_waited_for() {
        let mut s = Stats::default();
        s.acquired(0, 1, 0, Priority::Normal);
        s.acquired(0, 1, 1, Priority::Normal);
        s.acquired(0, 2, 0, Priority::Normal);
        s.released(2, 0);
        s.forget(1);
        assert_eq!(s.waiting(), 0);
        s.granted(S, 1, 0);
        s.granted(S, 2, 0);
        assert_eq!(s.grant_latency[Priority::Normal.index()].count(), 0);
    }

    #[test]
    fn refusals_are_counted_by_reason() {
        let mut s = Stats::default();
        s.refused(Refusal::NoRoom);
        s.refused(Refusal::NoRoom);
        s.refused(Refusal::Other);
        let by: Vec<(&str, u64)> = Refusal::ALL
            .iter()
            .map(|r| r.as_str())
            .zip(s.counters().refusals)
            .collect();
        assert!(by.contains(&("no_room", 2)) && by.contains(&("other", 1)));
        assert_eq!(by.iter().map(|(_, n)| n).sum::<u64>(), 3);
    }
}
