//! A bounded ring of recent samples of the broker's status: per GPU
//! (utilisation, memory allocated and committed), per user and per job
//! on each GPU (the share each should get and the share it got), and the
//! queue's length. The core records one sample a second whoever is
//! watching, and serves the ring with the status, so that `gpufrac top`
//! draws history from the moment it opens.
//!
//! Pure, in virtual time: a status in, series out. Bounded three ways:
//! `DEPTH` samples; per user and GPU at most `per_user` series (what the
//! per-user lease budget lets one user have there: its part, its
//! processes outside any job and one series per lease), and `MAX_SERIES`
//! in all (root and the device plugin book leases outside any budget). A
//! series past a bound is not kept, and counted in `dropped`; one whose
//! user or job has been gone for the whole ring is forgotten.

use std::collections::{BTreeMap, VecDeque};

use crate::status::{GpuHistory, History, ShareHistory, Status};

type Nanos = u64;

/// One sample a second.
pub const EVERY: Nanos = 1_000_000_000;
/// Three minutes of samples.
pub const DEPTH: usize = gpufrac_common::status::HISTORY_DEPTH;
/// Share series kept in all, whatever the budgets.
pub const MAX_SERIES: usize = 4096;

/// A user's part (`job` unset) or one of its jobs on one GPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ShareKey {
    gpu: String,
    uid: u32,
    /// None: the user's part as a whole; Some(None): its processes
    /// outside any job; Some(Some(pid)): the job of that run.
    job: Option<Option<u32>>,
}

#[derive(Clone, Debug, Default)]
struct ShareSeries {
    /// The sample it last got a value in.
    seq: u64,
    pod: Option<String>,
    target: VecDeque<Option<f32>>,
    achieved: VecDeque<Option<f32>>,
}

#[derive(Clone, Debug, Default)]
struct GpuSeries {
    seq: u64,
    utilization: VecDeque<Option<u32>>,
    allocated: VecDeque<Option<u64>>,
    committed: VecDeque<Option<u64>>,
}

/// The ring.
#[derive(Clone, Debug)]
pub struct Ring {
    per_user: usize,
    /// When the newest sample was taken.
    last: Option<Nanos>,
    /// Samples held: the length of every series.
    len: usize,
    /// Samples taken since the start.
    seq: u64,
    queue: VecDeque<u32>,
    gpus: BTreeMap<String, GpuSeries>,
    shares: BTreeMap<ShareKey, ShareSeries>,
    /// Series not kept since the start, past a bound.
    dropped: u32,
}

impl Ring {
    /// A ring keeping at most `per_user` series per user and GPU.
    pub fn new(per_user: usize) -> Ring {
        Ring {
            per_user: per_user.max(2),
            last: None,
            len: 0,
            seq: 0,
            queue: VecDeque::new(),
            gpus: BTreeMap::new(),
            shares: BTreeMap::new(),
            dropped: 0,
        }
    }

    /// When the next sample is due.
    pub fn due(&self) -> Nanos {
        self.last.map_or(0, |t| t + EVERY)
    }

    /// Takes a sample of `st`, the status at `now`, with `queued`
    /// requests waiting (`st` need not list them).
    pub fn record(&mut self, now: Nanos, st: &Status, queued: usize) {
        self.last = Some(now);
        self.seq += 1;
        // Once full, every series loses its oldest value as it gains one.
        let full = self.len == DEPTH;
        // What every series held before this sample: a series new in it
        // gets as many gaps.
        let before = self.len;
        if !full {
            self.len += 1;
        }
        push(
            &mut self.queue,
            u32::try_from(queued).unwrap_or(u32::MAX),
            full,
        );
        let seq = self.seq;
        for g in &st.gpus {
            let allocated = g.processes.iter().map(|p| p.mem_used).sum();
            let s = self
                .gpus
                .entry(g.uuid.clone())
                .or_insert_with(|| GpuSeries {
                    seq: 0,
                    utilization: gaps(before),
                    allocated: gaps(before),
                    committed: gaps(before),
                });
            // The same UUID twice in one status: the first counts.
            if s.seq == seq {
                continue;
            }
            s.seq = seq;
            push(&mut s.utilization, g.utilization, full);
            push(&mut s.allocated, Some(allocated), full);
            push(&mut s.committed, Some(g.committed_mem), full);
        }
        for g in &st.gpus {
            for u in &g.users {
                let key = ShareKey {
                    gpu: g.uuid.clone(),
                    uid: u.uid,
                    job: None,
                };
                let at = (before, full);
                self.share(at, key, None, u.share_target, u.share_achieved);
                for j in &u.jobs {
                    let key = ShareKey {
                        gpu: g.uuid.clone(),
                        uid: u.uid,
                        job: Some(j.job),
                    };
                    self.share(at, key, j.pod.clone(), j.share_target, j.share_achieved);
                }
            }
        }
        // Every series gets a value or a gap, so that all stay aligned.
        for s in self.gpus.values_mut().filter(|s| s.seq != seq) {
            s.seq = seq;
            push(&mut s.utilization, None, full);
            push(&mut s.allocated, None, full);
            push(&mut s.committed, None, full);
        }
        for s in self.shares.values_mut().filter(|s| s.seq != seq) {
            s.seq = seq;
            push(&mut s.target, None, full);
            push(&mut s.achieved, None, full);
        }
        // Forgotten once gone for the whole ring.
        self.shares
            .retain(|_, s| s.achieved.iter().any(Option::is_some));
        self.gpus
            .retain(|_, s| s.allocated.iter().any(Option::is_some));
    }

    /// This sample's value of one share series, made if it may be.
    /// `at`: what every series held before this sample, and whether the
    /// ring is full.
    fn share(
        &mut self,
        (before, full): (usize, bool),
        key: ShareKey,
        pod: Option<String>,
        target: f64,
        achieved: f64,
    ) {
        let seq = self.seq;
        if !self.shares.contains_key(&key) {
            let mine = self
                .shares
                .keys()
                .filter(|k| k.uid == key.uid && k.gpu == key.gpu)
                .count();
            if mine >= self.per_user || self.shares.len() >= MAX_SERIES {
                self.dropped = self.dropped.saturating_add(1);
                return;
            }
            // Gaps for the samples before this one, as if it had been
            // there (and lost its oldest) all along.
            self.shares.insert(
                key.clone(),
                ShareSeries {
                    seq: 0,
                    pod: None,
                    target: gaps(before),
                    achieved: gaps(before),
                },
            );
        }
        let Some(s) = self.shares.get_mut(&key) else {
            return;
        };
        // A status that lists a job twice: the first counts.
        if s.seq == seq {
            return;
        }
        s.seq = seq;
        s.pod = pod.or(s.pod.take());
        push(&mut s.target, Some(fraction(target)), full);
        push(&mut s.achieved, Some(fraction(achieved)), full);
    }

    /// The ring as status serves it, at `now`, with at most `samples`
    /// values per series (the newest).
    pub fn view(&self, now: Nanos, samples: usize) -> History {
        let n = samples.min(self.len);
        let tail = |len: usize| len.saturating_sub(n);
        History {
            every_s: EVERY as f64 / 1e9,
            samples: n as u32,
            age_s: self
                .last
                .map_or(0.0, |t| now.saturating_sub(t) as f64 / 1e9),
            queue: self
                .queue
                .iter()
                .skip(tail(self.queue.len()))
                .copied()
                .collect(),
            gpus: self
                .gpus
                .iter()
                .map(|(uuid, s)| GpuHistory {
                    uuid: uuid.clone(),
                    utilization: last(&s.utilization, n),
                    allocated: last(&s.allocated, n),
                    committed: last(&s.committed, n),
                })
                .collect(),
            shares: self
                .shares
                .iter()
                .map(|(k, s)| ShareHistory {
                    gpu: k.gpu.clone(),
                    uid: k.uid,
                    level: if k.job.is_some() { "job" } else { "user" }.into(),
                    job: k.job.flatten(),
                    pod: s.pod.clone(),
                    target: last(&s.target, n),
                    achieved: last(&s.achieved, n),
                })
                .collect(),
            dropped: self.dropped,
        }
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.len
    }
}

fn gaps<T: Clone>(n: usize) -> VecDeque<Option<T>> {
    std::iter::repeat_n(None, n).collect()
}

/// Appends `v`, dropping the oldest value once the ring is full.
fn push<T>(q: &mut VecDeque<T>, v: T, full: bool) {
    if full {
        q.pop_front();
    }
    q.push_back(v);
}

fn last<T: Clone>(q: &VecDeque<T>, n: usize) -> Vec<T> {
    q.iter().skip(q.len().saturating_sub(n)).cloned().collect()
}

/// A share to a tenth of a percent: what a view can show, in a few
/// characters of JSON.
fn fraction(f: f64) -> f32 {
    if f.is_finite() {
        ((f.clamp(0.0, 1.0) * 1000.0).round() / 1000.0) as f32
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{GpuStatus, JobShare, ProcStatus, UserShare};

    const S: Nanos = EVERY;

    fn gpu(uuid: &str, util: u32, users: Vec<UserShare>) -> GpuStatus {
        GpuStatus {
            uuid: uuid.into(),
            utilization: Some(util),
            committed_mem: 4 << 30,
            processes: vec![ProcStatus {
                mem_used: 1 << 30,
                ..ProcStatus::default()
            }],
            users,
            ..GpuStatus::default()
        }
    }

    fn user(uid: u32, achieved: f64, jobs: &[Option<u32>]) -> UserShare {
        UserShare {
            uid,
            share_target: 0.5,
            share_achieved: achieved,
            jobs: jobs
                .iter()
                .map(|&job| JobShare {
                    job,
                    share_target: 0.5 / jobs.len() as f64,
                    share_achieved: achieved / jobs.len() as f64,
                    ..JobShare::default()
                })
                .collect(),
            ..UserShare::default()
        }
    }

    fn status(gpus: Vec<GpuStatus>) -> Status {
        Status {
            gpus,
            ..Status::default()
        }
    }

    #[test]
    fn samples_are_aligned_and_gaps_are_null() {
        let mut r = Ring::new(66);
        assert_eq!(r.due(), 0);
        r.record(
            0,
            &status(vec![gpu("GPU-a", 10, vec![user(1000, 0.7, &[Some(41)])])]),
            0,
        );
        assert_eq!(r.due(), S);
        // A second user arrives, and a job of the first leaves.
        r.record(
            S,
            &status(vec![gpu(
                "GPU-a",
                90,
                vec![user(1000, 0.6, &[None]), user(0, 0.3, &[Some(7)])],
            )]),
            2,
        );
        let h = r.view(S + S / 2, DEPTH);
        assert_eq!(h.samples, 2);
        assert_eq!(h.age_s, 0.5);
        assert_eq!(h.queue, vec![0, 2]);
        assert_eq!(h.gpus[0].utilization, vec![Some(10), Some(90)]);
        assert_eq!(h.gpus[0].allocated, vec![Some(1 << 30); 2]);
        assert_eq!(h.gpus[0].committed, vec![Some(4 << 30); 2]);
        let find = |uid, level: &str, job: Option<u32>| {
            h.shares
                .iter()
                .find(|s| s.uid == uid && s.level == level && s.job == job)
                .unwrap_or_else(|| panic!("no series {uid} {level} {job:?}: {h:?}"))
        };
        assert_eq!(
            find(1000, "user", None).achieved,
            vec![Some(0.7), Some(0.6)]
        );
        assert_eq!(find(1000, "job", Some(41)).achieved, vec![Some(0.7), None]);
        assert_eq!(find(1000, "job", None).achieved, vec![None, Some(0.6)]);
        assert_eq!(find(0, "user", None).target, vec![None, Some(0.5)]);
        assert_eq!(find(0, "job", Some(7)).achieved, vec![None, Some(0.3)]);
        for s in &h.shares {
            assert_eq!(s.target.len(), 2);
            assert_eq!(s.achieved.len(), 2);
        }
    }

    #[test]
    fn the_ring_keeps_its_depth_and_forgets_what_left() {
        let mut r = Ring::new(66);
        r.record(
            0,
            &status(vec![gpu("GPU-a", 1, vec![user(5, 1.0, &[Some(9)])])]),
            0,
        );
        for i in 1..=(DEPTH as u64 + 10) {
            r.record(i * S, &status(vec![gpu("GPU-b", i as u32, vec![])]), 0);
        }
        assert_eq!(r.len(), DEPTH);
        let h = r.view((DEPTH as u64 + 10) * S, DEPTH);
        assert_eq!(h.samples as usize, DEPTH);
        assert_eq!(h.queue.len(), DEPTH);
        // GPU-a and user 5 have been gone for longer than the ring holds.
        assert_eq!(
            h.gpus.len(),
            1,
            "{:?}",
            h.gpus.iter().map(|g| &g.uuid).collect::<Vec<_>>()
        );
        assert!(h.shares.is_empty());
        let util = &h.gpus[0].utilization;
        assert_eq!(util.len(), DEPTH);
        assert_eq!(util.last(), Some(&Some(DEPTH as u32 + 10)));
        assert_eq!(util.first(), Some(&Some(11)));
        // A shorter view is the newest samples.
        let short = r.view(0, 3);
        assert_eq!(short.gpus[0].utilization, util[DEPTH - 3..].to_vec());
    }

    #[test]
    fn one_user_cannot_grow_the_ring_past_its_budget() {
        let mut r = Ring::new(4);
        // 50 jobs of user 65534 and one of user 1000 on the same GPU.
        let jobs: Vec<Option<u32>> = (0..50).map(Some).collect();
        let st = status(vec![gpu(
            "GPU-a",
            0,
            vec![user(65534, 0.5, &jobs), user(1000, 0.5, &[Some(1)])],
        )]);
        for i in 0..5 {
            r.record(i * S, &st, 0);
        }
        let h = r.view(5 * S, DEPTH);
        let of = |uid| h.shares.iter().filter(|s| s.uid == uid).count();
        assert_eq!(of(65534), 4);
        // The other user's part and job are kept whatever the first did.
        assert_eq!(of(1000), 2);
        assert_eq!(h.dropped, 47 * 5);
        for s in &h.shares {
            assert_eq!(s.achieved.len(), 5);
        }
    }

    #[test]
    fn shares_are_kept_to_a_tenth_of_a_percent() {
        assert_eq!(fraction(0.28734), 0.287);
        assert_eq!(fraction(f64::NAN), 0.0);
        assert_eq!(fraction(1.7), 1.0);
        assert_eq!(serde_json::to_string(&fraction(0.3)).unwrap(), "0.3");
    }
}
