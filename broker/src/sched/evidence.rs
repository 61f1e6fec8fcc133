//! Evidence of work: what the driver's per-process samples say of a
//! client, for the one question the broker cannot answer itself: does a
//! holder that keeps asking still launch work?
//!
//! While a lower band waits, a holder of a higher band is recalled at the
//! end of each slice (liveness) and a busy one asks again and is granted
//! back at once, so that `low` stays a scavenger. A holder with no work
//! could answer the same way and keep `low` off an idle GPU for good. So,
//! while a lower band waits and the GPU reports per-process work (NVML's
//! process utilisation, sampled by the shell), one condition joins the
//! ceilings of every client of a higher band, checked wherever ceilings
//! are (a grant, an extension, a recall's answer): the driver's samples
//! over the last `evidence` show its process busy at least
//! `WORK_PER_HELD` of the time the client was on the GPU, or its user has
//! benefit of the doubt left. The doubt is a ceiling of its own, the
//! user's: a bucket of half of `evidence` (a sample period) of holding
//! without such evidence (while a lower band waits or holds), refilled at
//! `DOUBT_RATE` of real time and granted a slice at a time, so that a busy
//! process that just started holds until its first sample shows its work,
//! one whose user's doubt is spent still gets a slice (and so a sample)
//! within a fraction of a second, and rotating connections or processes
//! (each new, without evidence) buys nothing: its user holds without
//! evidence at most `DOUBT_RATE` of the time in the long run.
//!
//! The driver counts work by process: the core reports it for a
//! connection only where that connection was its process's one on the
//! GPU since the previous sample (a shim keeps one), or a pretender beside
//! a working connection of its own process would borrow that one's work;
//! and no span credits more work than the time the client held. Without
//! a source of evidence (MIG instances, drivers without per-process
//! utilisation, no NVML, or samples that stopped coming) nothing is
//! judged: a holder that answers every recall keeps `low` off the GPU as
//! a busy one would.

use std::collections::{BTreeMap, VecDeque};

use super::ceilings::Ceiling;
use super::clock::UserRef;
use super::{ClientId, Nanos, SchedConfig};

/// The least work a process must show for its time on the GPU: a
/// quarter (a busy process keeps it busy nearly all the time it holds;
/// work, not one sample above zero, is the evidence).
const WORK_PER_HELD: f64 = 0.25;

/// How fast a user's benefit of the doubt comes back, as a part of real
/// time: a bucket, so a busy new process of a user whose doubt was spent
/// gets a slice within a fraction of a second, not a window later.
const DOUBT_RATE: f64 = 0.05;

/// A user's benefit of the doubt: what is left of it, as of `at`, and
/// whether it is being spent since.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    level: f64,
    at: Nanos,
    spending: bool,
}

impl Bucket {
    fn level(&self, now: Nanos, cap: f64) -> f64 {
        let dt = now.saturating_sub(self.at) as f64;
        let rate = DOUBT_RATE - if self.spending { 1.0 } else { 0.0 };
        (self.level + rate * dt).clamp(0.0, cap)
    }

    fn set(&mut self, spending: bool, now: Nanos, cap: f64) {
        self.level = self.level(now, cap);
        self.at = now;
        self.spending = spending;
    }
}

/// What the driver's samples said of one client's process, against the
/// time the client was on the GPU: per sample within `evidence`, when it
/// came, the time on the GPU since the one before, and the work the
/// driver saw in that span.
#[derive(Clone, Debug, Default)]
struct Record {
    /// Its time on the GPU (its meter's total) at the last sample.
    held_at: Nanos,
    spans: VecDeque<(Nanos, Nanos, f64)>,
}

impl Record {
    fn add(&mut self, now: Nanos, held: Nanos, work: f64, keep: Nanos) {
        let on = held.saturating_sub(std::mem::replace(&mut self.held_at, held));
        // Its process's work beyond the time it was on the GPU is not its
        // own (a sibling connection's, gone before the sample): evidence
        // never exceeds the time held.
        let work = work.min(on as f64);
        if on > 0 {
            self.spans.push_back((now, on, work));
        }
        while self
            .spans
            .front()
            .is_some_and(|s| s.0.saturating_add(keep) <= now)
        {
            self.spans.pop_front();
        }
    }

    fn proven(&self, now: Nanos, keep: Nanos) -> bool {
        let (on, work) = self
            .spans
            .iter()
            .filter(|s| now < s.0.saturating_add(keep))
            .fold((0.0, 0.0), |(h, w), s| (h + s.1 as f64, w + s.2));
        work > 0.0 && work >= WORK_PER_HELD * on
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Evidence {
    cfg: SchedConfig,
    /// Samples come until then: the GPU reports per-process work.
    until: Nanos,
    records: BTreeMap<ClientId, Record>,
    /// Per user with any spent, its benefit of the doubt.
    doubt: BTreeMap<UserRef, Bucket>,
    doubting: Option<UserRef>,
}

impl Evidence {
    pub fn new(cfg: SchedConfig) -> Evidence {
        Evidence {
            cfg,
            ..Evidence::default()
        }
    }

    /// Whether the GPU reports per-process work: a sample came within
    /// `evidence`.
    pub fn judging(&self, now: Nanos) -> bool {
        now < self.until
    }

    /// When judging ends unless another sample comes.
    pub fn next_timeout(&self) -> Nanos {
        self.until
    }

    /// A sample at `now`: each client's time on the GPU so far, and how
    /// busy (percent) the driver saw its process since the last sample.
    pub fn sample(&mut self, now: Nanos, clients: impl Iterator<Item = (ClientId, Nanos, u32)>) {
        let keep = self.cfg.evidence;
        let last = self.until.saturating_sub(keep);
        let span = now.saturating_sub(last).min(keep) as f64;
        self.until = now.saturating_add(keep);
        for (id, held, pct) in clients {
            let work = span * f64::from(pct.min(100)) / 100.0;
            let r = self.records.entry(id).or_default();
            r.add(now, held, work, keep);
            if r.spans.is_empty() && held == 0 {
                self.records.remove(&id);
            }
        }
        let (cap, doubting) = (self.cap(), self.doubting);
        self.doubt
            .retain(|r, b| b.level(now, cap) < cap || Some(*r) == doubting);
    }

    pub fn forget(&mut self, id: ClientId) {
        self.records.remove(&id);
    }

    /// Whether the samples within `evidence` showed `id`'s process busy at
    /// least `WORK_PER_HELD` of its time on the GPU.
    pub fn proven(&self, id: ClientId, now: Nanos) -> bool {
        self.records
            .get(&id)
            .is_some_and(|r| r.proven(now, self.cfg.evidence))
    }

    /// Whether `id` is judged and its work not evidenced: held to its
    /// user's benefit of the doubt (while a lower band waits).
    pub fn doubted(&self, id: ClientId, now: Nanos) -> bool {
        self.judging(now) && !self.proven(id, now)
    }

    /// Whether `user` has `len` of benefit of the doubt left.
    pub fn has_doubt(&self, user: UserRef, len: Nanos, now: Nanos) -> bool {
        self.level(user, now) >= len as f64
    }

    /// `user`'s benefit of the doubt left (full for a user never doubted).
    fn level(&self, user: UserRef, now: Nanos) -> f64 {
        let cap = self.cap();
        self.doubt.get(&user).map_or(cap, |b| b.level(now, cap))
    }

    fn cap(&self) -> f64 {
        (self.cfg.evidence / 2) as f64
    }

    /// The doubt ceiling of a client of user `user` that has no evidence,
    /// while a lower band waits and the GPU reports per-process work.
    pub fn ceiling(&self, user: UserRef, now: Nanos) -> Ceiling {
        let level = self.level(user, now);
        let quantum = self.cfg.timeslice.min(self.cfg.evidence / 2);
        let short = (quantum as f64 - level).max(0.0);
        Ceiling {
            remaining: level as Nanos,
            quantum,
            back_at: now + (short / DOUBT_RATE).ceil() as Nanos,
        }
    }

    /// Runs the doubt meter of `user` (a holder without evidence, or a
    /// recalled one whose band keeps the GPU for its answer, while a
    /// lower band waits), and stops the others'.
    pub fn sync(&mut self, user: Option<UserRef>, now: Nanos) {
        if user == self.doubting {
            return;
        }
        let cap = self.cap();
        if let Some(b) = self.doubting.and_then(|r| self.doubt.get_mut(&r)) {
            b.set(false, now, cap);
        }
        if let Some(r) = user {
            let full = Bucket {
                level: cap,
                at: now,
                spending: false,
            };
            self.doubt.entry(r).or_insert(full).set(true, now, cap);
        }
        self.doubting = user;
    }
}
