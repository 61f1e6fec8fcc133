//! Evidence of work: what the driver's per-process samples say of
//! holders, for the one question the broker cannot answer itself, at a
//! recall: does the holder that asks again still launch work?
//!
//! While a lower band waits, a holder is recalled at the end of each slice
//! (liveness; once in `RECALL_SLICES` slices for one the driver saw at
//! work lately, since each answer costs a round trip on an idle GPU) and
//! a busy one asks again and is granted back at once, so that `low`
//! stays a scavenger. A holder with no work could answer the
//! same way, and keep `low` off an idle GPU for good. Where the GPU
//! reports per-process work (NVML's process utilisation, sampled by the
//! shell), a holder whose process the driver saw at work within
//! `evidence` is granted back at once; one it did not see goes behind the
//! waiting band at each recall, revoke, release of its own or leaving
//! (`defer`), once its user's benefit of the doubt is spent: for a
//! slice, then twice as long at each time in a row without evidence, up
//! to `evidence` (a holder that never works keeps a waiting `low` off an
//! idle GPU for about a slice a second). The deferral is its user's, so that a new
//! connection or process of the same user waits it out too; a sample
//! that shows the holder judged at work ends it, and its count is
//! forgotten a second after the last one ended, however it ended (a
//! sample that shows another of the user's processes at work does not end
//! it, and one that ends it keeps the count: a working process beside a
//! pretender of the same user would otherwise start the pretender's count
//! over).
//!
//! The benefit of the doubt is the user's, not the connection's or the
//! process's: a new process has no evidence until the next sample shows
//! it (up to one sample period and the sample's own time), and a user
//! may hold without evidence for half of `evidence` (a sample period) in
//! each `DOUBT_WINDOWS` of `evidence` (while a lower band waits), so that
//! a genuinely busy process that just started keeps the GPU until its
//! first sample, once in a while, and rotating
//! connections or processes, each new and so without evidence, buys
//! nothing more. Without a source of evidence (no NVML, MIG, a driver
//! that does not report per-process utilisation, or samples that stopped
//! coming) the broker cannot tell, and a recall is answered as before.

use super::meter::{Meter, budget};
use super::tree::{UserRef, band};
use super::{Client, ClientId, ClientState, Nanos, Priority, Scheduler};

/// A user's benefit of the doubt is half of `evidence` (a sample period)
/// of holding without evidence in each window of this many `evidence`s.
pub(super) const DOUBT_WINDOWS: Nanos = 10;

/// A holder the driver saw at work is recalled at most once in this many
/// slices while only a lower band waits; its slice is extended in
/// between. A recall costs a busy holder a round trip through the broker
/// on an idle GPU (its answer, then its grant back): 2-3 ms on a broker
/// busy with another user's churn, so at every 20 ms slice a tenth or
/// more of its GPU time, for nothing (one seen at work is granted back at
/// once anyway). One that does not answer still loses the GPU at the
/// first recall of each grant.
pub(super) const RECALL_SLICES: Nanos = 4;

/// The least work a process must show for its time on the GPU: a
/// quarter. A busy process keeps the GPU busy nearly all the time it
/// holds (the simulated driver, which counts a context's runs, shows
/// about 60% for one time-sliced with another), and one that runs a
/// 100 us kernel every 500 ms, 0.02%, held the GPU from a waiting `low`
/// process on the evidence of each sample above zero.
const WORK_PER_HELD: f64 = 0.25;

/// What the driver's samples said of one client's process, against the
/// time the client was on the GPU: per sample within `evidence`, when it
/// came, the time on the GPU since the one before, and the work the
/// driver saw in that span.
#[derive(Clone, Debug, Default)]
pub(super) struct Record {
    /// Its time on the GPU (its meter's total) at the last sample.
    held_at: Nanos,
    spans: std::collections::VecDeque<(Nanos, Nanos, f64)>,
}

impl Record {
    /// A sample at `now`: the process kept the GPU busy `pct` percent of
    /// the `span` before it; `held` is the client's time on the GPU so
    /// far. Spans older than `keep` are forgotten.
    pub(super) fn add(&mut self, now: Nanos, held: Nanos, span: Nanos, pct: u32, keep: Nanos) {
        let on = held.saturating_sub(std::mem::replace(&mut self.held_at, held));
        let work = span as f64 * f64::from(pct.min(100)) / 100.0;
        if on > 0 || work > 0.0 {
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

    /// Whether the samples within `keep` showed work, at least
    /// `WORK_PER_HELD` of the time on the GPU they cover.
    pub(super) fn proven(&self, now: Nanos, keep: Nanos) -> bool {
        let (on, work) = self
            .spans
            .iter()
            .filter(|s| now < s.0.saturating_add(keep))
            .fold((0.0, 0.0), |(h, w), s| (h + s.1 as f64, w + s.2));
        work > 0.0 && work >= WORK_PER_HELD * on
    }
}

/// A user deferred behind a waiting lower band: until when, and how many
/// recalls in a row found no evidence.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Deferral {
    until: Nanos,
    times: u32,
    /// The holder judged last: a sample that shows it at work ends the
    /// deferral (not one of another of the user's processes: a working
    /// process beside a pretender would start the pretender's count
    /// over).
    by: ClientId,
}

impl Scheduler {
    /// Whether the GPU reports per-process work: a sample came within
    /// `evidence`.
    pub(super) fn judging(&self, now: Nanos) -> bool {
        now < self.evidence_until
    }

    /// Whether the driver's samples within `evidence` showed `c`'s
    /// process at work in proportion to its time on the GPU.
    fn evidenced(&self, c: &Client, now: Nanos) -> bool {
        c.work.proven(now, self.cfg.evidence)
    }

    fn doubt_window(&self) -> Nanos {
        self.cfg.evidence.saturating_mul(DOUBT_WINDOWS)
    }

    /// Whether `c`'s user has held without evidence for its whole benefit
    /// of the doubt in the window.
    fn doubt_spent(&self, c: &Client, now: Nanos) -> bool {
        let w = self.doubt_window();
        self.doubt
            .get(&c.user_ref())
            .is_some_and(|m| m.usage(w, now) >= budget(1.0, self.cfg.evidence / 2))
    }

    /// At a recall of `h`, any revoke, its own release or its leaving,
    /// while a lower band waits: whether its user goes behind the waiting
    /// band (the driver has per-process samples, none showed `h` at work
    /// lately, and its user's benefit of the doubt is spent). For a slice
    /// the first time, then twice as long at each recall in a row without
    /// evidence, up to `evidence`: a holder that never works keeps a
    /// waiting `low` off an idle GPU for about a slice a second, and one
    /// that works is seen within a sample period.
    pub(super) fn defer(&mut self, now: Nanos, h: ClientId) -> bool {
        let c = &self.clients[&h];
        let defer = self.lower_band_waits(band(c.class)) && self.unproven(c, now);
        if defer {
            let key = c.user_ref();
            let slice = self.cfg.timeslice;
            let cap = self.cfg.evidence.max(slice);
            let d = self.deferred.entry(key).or_default();
            let span = slice.saturating_mul(1 << d.times.min(20)).min(cap);
            d.times = d.times.saturating_add(1);
            d.until = now.saturating_add(span);
            d.by = h;
        }
        defer
    }

    /// Whether `c` holds on its user's doubt alone, and that is spent: the
    /// driver reports per-process work, showed none of `c`'s lately, and
    /// its user has held without evidence for its whole benefit of the
    /// doubt in the window. While a lower band waits, such a holder is
    /// not extended either (`step`): one behind its own sibling was
    /// extended 4 ms at a time for two slices past its own, never judged,
    /// and eight such never-reading connections kept a `low` victim off
    /// an idle GPU 15% of the time.
    pub(super) fn unproven(&self, c: &Client, now: Nanos) -> bool {
        self.judging(now) && !self.evidenced(c, now) && self.doubt_spent(c, now)
    }

    /// A holder letting go of the GPU, by itself or by leaving, is judged
    /// as at a revoke (`defer`); a client not holding is not.
    pub(super) fn judge_letting_go(&mut self, now: Nanos, id: ClientId) {
        if self.clients[&id].state == ClientState::Holding {
            self.defer(now, id);
        }
    }

    /// Whether holder `c`, its slice out while only a lower band waits,
    /// is recalled (or its slice extended): always unless the driver saw
    /// it at work lately, then once in `RECALL_SLICES` slices.
    pub(super) fn recall_due(&self, c: &Client, now: Nanos) -> bool {
        let every = self.cfg.timeslice.saturating_mul(RECALL_SLICES);
        !(self.judging(now) && self.evidenced(c, now))
            || c.recalled_at.is_none_or(|t| now >= t.saturating_add(every))
    }

    /// Until when `c`'s user is deferred behind the waiting lower band (0:
    /// not deferred).
    pub(super) fn deferred_until(&self, c: &Client) -> Nanos {
        self.deferred.get(&c.user_ref()).map_or(0, |d| d.until)
    }

    /// Runs the doubt meter of the user whose holder holds without
    /// evidence while a lower band waits, or whose recalled holder's band
    /// keeps the GPU for its answer (called with the other meters): a
    /// holder that never read its recall kept the GPU idle for that while
    /// too, uncounted, and eight such connections of one process kept a
    /// `low` victim off an idle GPU 16.5% of the time.
    pub(super) fn sync_doubt(&mut self, now: Nanos) {
        let hold = self.recall_hold();
        let recalled = |c: &&Client| {
            c.grant
                .as_ref()
                .is_some_and(|g| !g.hung && g.awaits_recall_answer(now, hold))
        };
        let doubting = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .filter(|c| c.state == ClientState::Holding)
            .or_else(|| {
                self.ix
                    .granted
                    .iter()
                    .filter_map(|id| self.clients.get(id))
                    .find(recalled)
            })
            .filter(|c| {
                self.judging(now) && !self.evidenced(c, now) && self.lower_band_waits(band(c.class))
            })
            .map(Client::user_ref);
        if doubting == self.doubting {
            return;
        }
        if let Some(m) = self.doubting.and_then(|r| self.doubt.get_mut(&r)) {
            m.set(false, now);
        }
        if let Some(r) = doubting {
            self.doubt.entry(r).or_default().set(true, now);
        }
        self.doubting = doubting;
    }

    /// Whether a client of a band below `b` waits (`low` is the only
    /// band below another).
    pub(super) fn lower_band_waits(&self, b: usize) -> bool {
        b > band(Priority::Low) && !self.ix.waiting[Priority::Low.index()].is_empty()
    }

    /// A sample showed `id` at work: a deferral it caused ends. Its count
    /// is kept as after any deferral (`prune_doubt`): a working
    /// connection got itself judged beside its user's pretender, its
    /// sample ended the deferral, and the pretender's doubling started
    /// over at a slice (the GPU idle 15% of the time while `low` waited).
    pub(super) fn evidence_of(&mut self, now: Nanos, id: ClientId) {
        if let Some(c) = self.clients.get(&id) {
            let key = c.user_ref();
            if let Some(d) = self.deferred.get_mut(&key)
                && d.by == id
            {
                d.until = d.until.min(now);
            }
        }
    }

    /// Forgets doubt the window no longer sees, and deferrals past.
    pub(super) fn prune_doubt(&mut self, now: Nanos) {
        // A deferral's count is kept for `evidence` after it ends: the
        // next recall without evidence doubles it.
        let keep = self.cfg.evidence;
        self.deferred
            .retain(|_, d| d.until.saturating_add(keep) > now);
        let w = self.doubt_window();
        let doubting = self.doubting;
        self.doubt.retain(|r: &UserRef, m: &mut Meter| {
            m.prune(w, now);
            !m.is_empty() || Some(*r) == doubting
        });
    }
}
