//! What the core counts for metrics as it happens, where no status
//! snapshot could see it: how long each Acquire waited for its Grant,
//! how long each queued request waited for its lease, and the refusals
//! by reason. Pure counting in virtual time; `proto` updates it at the
//! few places where these events happen and the metrics room reads a
//! copy with each snapshot.

use std::collections::{BTreeMap, HashMap};

use gpufrac_common::config::Priority;

type Nanos = u64;
type ConnId = u64;

const MS: Nanos = 1_000_000;
const S: Nanos = 1_000 * MS;

/// Upper bounds of the grant latency buckets: from a handover without
/// contention (well under a millisecond) to a wait behind several
/// timeslices or a hung holder.
pub const GRANT_BUCKETS: [Nanos; 16] = [
    // A grant at once (under --mps, or to a holder asking again) is 0:
    // its own bucket, so that a quantile of such grants reads 0 rather
    // than a point within the first bucket.
    0,
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
pub const QUEUE_BUCKETS: [Nanos; 15] = [
    // Placed at once: 0, as for grants.
    0,
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

    /// Adds what `o` counted (a histogram of the same buckets).
    pub fn merge(&mut self, o: &Histogram) {
        debug_assert_eq!(self.bounds, o.bounds);
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.sum += o.sum;
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

/// Users counted one by one in the per-user counters; refusals and waits
/// of users past them are counted under `OTHER_UID` (metrics show them
/// as `user="other"`, as they do users past their own bound).
pub const MAX_COUNTED_USERS: usize = 1024;
pub const OTHER_UID: u32 = u32::MAX;

/// The core's counters since the broker started.
#[derive(Clone, Debug)]
pub struct Stats {
    /// Acquire to Grant, per priority class (`Priority::index`).
    pub grant_latency: [Histogram; 3],
    /// A queued `gpufrac run` request's wait for its lease, per user of
    /// the job.
    pub queue_wait: BTreeMap<u32, Histogram>,
    /// Refusals by user and reason, in `Refusal::ALL`'s order.
    pub refusals: BTreeMap<u32, [u64; Refusal::ALL.len()]>,
    /// Acquires not yet granted: (connection, GPU) → (when, class). At
    /// most one per device a connection registered; a connection's go
    /// with it (`forget`).
    asked: HashMap<(ConnId, usize), (Nanos, Priority)>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            grant_latency: std::array::from_fn(|_| Histogram::new(&GRANT_BUCKETS)),
            queue_wait: BTreeMap::new(),
            refusals: BTreeMap::new(),
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

    /// A queued request of a job of `uid` got its lease after waiting
    /// `waited`.
    pub fn queue_waited(&mut self, uid: u32, waited: Nanos) {
        let uid = counted(&self.queue_wait, uid);
        self.queue_wait
            .entry(uid)
            .or_insert_with(|| Histogram::new(&QUEUE_BUCKETS))
            .observe(waited);
    }

    /// The broker refused `uid` something, for `why`.
    pub fn refused(&mut self, uid: u32, why: Refusal) {
        let i = Refusal::ALL
            .iter()
            .position(|r| *r == why)
            .expect("every reason is in ALL");
        let uid = counted(&self.refusals, uid);
        self.refusals.entry(uid).or_default()[i] += 1;
    }

    /// Refusals by reason, all users together, in `Refusal::ALL`'s order.
    #[cfg(test)]
    pub fn refusals_by_reason(&self) -> [u64; Refusal::ALL.len()] {
        let mut all = [0; Refusal::ALL.len()];
        for counts in self.refusals.values() {
            for (a, n) in all.iter_mut().zip(counts) {
                *a += n;
            }
        }
        all
    }

    /// A copy without the pending requests, for the metrics room.
    pub fn counters(&self) -> Stats {
        Stats {
            grant_latency: self.grant_latency.clone(),
            queue_wait: self.queue_wait.clone(),
            refusals: self.refusals.clone(),
            asked: HashMap::new(),
        }
    }

    /// Acquires waiting for a grant (for tests of the bookkeeping).
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.asked.len()
    }
}

/// The key `uid` is counted under in `map`: its own while there is room
/// (or it has one), else `OTHER_UID`.
fn counted<V>(map: &BTreeMap<u32, V>, uid: u32) -> u32 {
    if map.contains_key(&uid) || map.len() < MAX_COUNTED_USERS {
        uid
    } else {
        OTHER_UID
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
        h.observe(0); // at once: the bucket of its own
        let b: Vec<(Nanos, u64)> = h.buckets().collect();
        assert_eq!(b[0], (0, 1));
        assert_eq!(b[1], (100_000, 2));
        assert_eq!(b[2], (250_000, 3));
        assert_eq!(b.last(), Some(&(30 * S, 3)));
        assert_eq!(h.count(), 4);
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
    fn refusals_are_counted_by_user_and_reason() {
        let mut s = Stats::default();
        s.refused(7, Refusal::NoRoom);
        s.refused(8, Refusal::NoRoom);
        s.refused(7, Refusal::Other);
        let by: Vec<(&str, u64)> = Refusal::ALL
            .iter()
            .map(|r| r.as_str())
            .zip(s.counters().refusals_by_reason())
            .collect();
        assert!(by.contains(&("no_room", 2)) && by.contains(&("other", 1)));
        assert_eq!(by.iter().map(|(_, n)| n).sum::<u64>(), 3);
        let seven = s.refusals[&7];
        assert_eq!(seven.iter().sum::<u64>(), 2);
    }

    /// Users past the bound are counted together, so that a node of many
    /// users (or one cycling through uids) keeps the counters bounded.
    #[test]
    fn users_past_the_bound_are_counted_as_other() {
        let mut s = Stats::default();
        for uid in 0..MAX_COUNTED_USERS as u32 + 10 {
            s.refused(uid, Refusal::NoRoom);
            s.queue_waited(uid, S);
        }
        assert_eq!(s.refusals.len(), MAX_COUNTED_USERS + 1);
        assert_eq!(s.refusals[&OTHER_UID].iter().sum::<u64>(), 10);
        assert_eq!(s.queue_wait[&OTHER_UID].count(), 10);
        // A user counted already keeps its own.
        s.refused(3, Refusal::Other);
        assert_eq!(s.refusals[&3].iter().sum::<u64>(), 2);
    }
}
