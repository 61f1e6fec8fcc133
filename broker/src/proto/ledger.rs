//! Jobs as one part: every job (`jobtable`), the queue they wait in, the
//! processes that sent a job's token before it existed, MIG leases whose
//! instance is being made and the work that makes them, and a recovery's
//! hold on new placements. It knows no connection's bytes: what it
//! decides comes out as values (leases placed, positions to tell, the
//! lease to hand a run) that the core sends.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use tracing::{info, warn};

use super::jobtable::Jobs;
use super::{ConnId, Nanos, Tokens, Work};
use crate::jobs::{Job, Phase};
use crate::queue::{self, Queue, Want};
use crate::statefile::Loaded;

/// Queue escalation has no timer of its own: re-checked this often while
/// anyone waits.
pub(super) const QUEUE_TICK: Nanos = 500_000_000;

/// Waiting runs are told their places at most this often: a place is for
/// a person to read, and a queue that churns (1,000 waiting, 100 a second
/// arriving and leaving) walked itself for places at every change.
pub(super) const POSITION_TICK: Nanos = 100_000_000;

/// A MIG lease whose instance is being made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Making {
    /// The connection of a `--no-wait` request, answered either way.
    pub no_wait: Option<ConnId>,
    /// Its job ended meanwhile: the lease is released once the instance
    /// is made (or not).
    pub abandoned: bool,
}

pub(in crate::proto) struct Ledger {
    queue: Queue,
    /// The queue changed since it was last polled (a request, a release, a
    /// run attached to its job, the end of a recovery): `poll` walks it
    /// then, and every `QUEUE_TICK` after `polled` (escalation and idle MIG
    /// instances change with time alone).
    dirty: bool,
    polled: Nanos,
    /// The queue was polled since its places were last told (at
    /// `told_at`): they are told again `POSITION_TICK` after that.
    untold: bool,
    told_at: Option<Nanos>,
    /// Every job, by token, with everything kept of it.
    jobs: Jobs,
    /// Connections of processes that sent a job's token (`Join`), by
    /// token: who may join a job when it comes to be.
    claims: BTreeMap<u64, BTreeSet<ConnId>>,
    /// MIG leases being made.
    making: BTreeMap<u64, Making>,
    work: VecDeque<Work>,
    /// After an untrusted state file: placements held until then, and why.
    recovery: Option<(Nanos, String)>,
    /// What the last place told waits for, in words: the runs of a queue
    /// mostly want the same, and formatting a size for each message
    /// stood out in the churning queue's profile.
    said: Option<(Want, String)>,
}

impl Ledger {
    pub fn new(queue: Queue, now: Nanos) -> Ledger {
        Ledger {
            queue,
            dirty: true,
            polled: now,
            untold: false,
            told_at: None,
            jobs: Jobs::default(),
            claims: BTreeMap::new(),
            making: BTreeMap::new(),
            work: VecDeque::new(),
            recovery: None,
            said: None,
        }
    }

    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }

    pub fn jobs_mut(&mut self) -> &mut Jobs {
        &mut self.jobs
    }

    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The queue, to change it: it is polled again at the next `poll`.
    pub fn queue_mut(&mut self) -> &mut Queue {
        self.dirty = true;
        &mut self.queue
    }

    /// What processes outside gpufrac hold on GPU `uuid`: the queue is
    /// polled again where that changed (a process that let go of its
    /// memory makes room as a lease's end does).
    pub fn set_outside(&mut self, uuid: &str, mem: u64) {
        self.dirty |= self.queue.set_outside(uuid, mem);
    }

    /// A token for a new job from `source`: never 0 (which means "none" on
    /// the wire) nor another job's.
    pub fn new_token(&self, source: &mut Tokens) -> u64 {
        loop {
            let t = source();
            if t != 0 && !self.jobs.contains_key(&t) {
                return t;
            }
        }
    }

    /// `id` sent `token`: it joins the job when the job comes to be.
    pub fn claim_token(&mut self, token: u64, id: ConnId) {
        self.claims.entry(token).or_default().insert(id);
    }

    /// `id` no longer claims `token`.
    pub fn unclaim_token(&mut self, token: u64, id: ConnId) {
        if let Some(ids) = self.claims.get_mut(&token) {
            ids.remove(&id);
            if ids.is_empty() {
                self.claims.remove(&token);
            }
        }
    }

    /// The connections that sent `token`.
    pub fn claimed(&self, token: u64) -> impl Iterator<Item = ConnId> + '_ {
        self.claims.get(&token).into_iter().flatten().copied()
    }

    #[cfg(test)]
    pub fn claims(&self) -> &BTreeMap<u64, BTreeSet<ConnId>> {
        &self.claims
    }

    /// A new job, run by `id`.
    pub fn attach(&mut self, job: Job, id: ConnId) {
        let t = job.token;
        self.jobs.insert(job);
        self.jobs.set_run(t, id);
        // Its run is told its position at the next poll.
        self.dirty = true;
    }

    /// Job `token` is run by `id` from now on (a run reconnected): if it
    /// waits, it is told its place again there.
    pub fn rerun(&mut self, token: u64, id: ConnId) {
        self.jobs.set_run(token, id);
        if matches!(
            self.jobs.get(&token).map(|j| &j.phase),
            Some(Phase::Queued { .. })
        ) {
            self.queue.retell(token);
        }
        self.dirty = true;
    }

    /// A placed lease whose MIG instance must first be made: the work to
    /// make it is queued, and true returned. False: it is granted as it is.
    pub fn make(&mut self, lease: &queue::Lease, no_wait: Option<ConnId>) -> bool {
        let Some(a) = lease.mig.as_ref().filter(|a| !a.steps.is_empty()) else {
            return false;
        };
        self.making.insert(
            lease.id,
            Making {
                no_wait,
                abandoned: false,
            },
        );
        self.work.push_back(Work::Mig {
            lease: lease.id,
            gpu: a.gpu,
            steps: a.steps.clone(),
        });
        true
    }

    /// What was being made for `lease`, now done (unknown: abandoned).
    pub fn made(&mut self, lease: u64) -> Making {
        self.making.remove(&lease).unwrap_or(Making {
            no_wait: None,
            abandoned: true,
        })
    }

    /// MIG devices of the instances that exist now.
    pub fn live_mig_uuids(&self) -> Vec<String> {
        self.queue
            .mig()
            .status()
            .into_iter()
            .flat_map(|g| g.instances.into_iter().filter_map(|i| i.uuid))
            .collect()
    }

    /// Work for the shell, in order.
    pub fn poll_work(&mut self) -> Option<Work> {
        self.work.pop_front()
    }

    /// Job `token`'s lease or place goes (its job ended). A lease whose
    /// instance is being made is released once it is made (or not); else
    /// the MIG instance it leaves idle, if any, is returned (to be said).
    pub fn release(&mut self, now: Nanos, token: u64) -> Option<crate::mig::Assignment> {
        if let Some(m) = self.making.get_mut(&token) {
            m.abandoned = true;
            return None;
        }
        let idle = self.queue.lease(token).and_then(|l| l.mig.clone());
        self.queue_mut().cancel(now, token);
        self.queue_mut().release(now, token);
        idle
    }

    /// When the queue is due (it changed, or a tick passed while anyone
    /// waits): the leases it placed (none while a recovery holds
    /// placements). None: not due.
    pub fn poll(&mut self, now: Nanos) -> Option<Vec<queue::Lease>> {
        if !self.dirty && now < self.polled + QUEUE_TICK {
            return None;
        }
        self.dirty = false;
        self.polled = now;
        self.untold = true;
        Some(if self.placing(now) {
            self.queue.poll(now)
        } else {
            Vec::new()
        })
    }

    /// Waiting runs whose place moved by a meaningful step (exact up to
    /// 10, within a tenth beyond): (run, token, position, what it waits
    /// for in words). The queue says whose, so a departure costs one walk
    /// and a few messages, not one to every request behind it.
    /// A new request is told at once; a moved one at most once a
    /// `POSITION_TICK` (beyond the tenth place, at most once every
    /// `queue::retell_after` its place).
    pub fn positions(&mut self, now: Nanos) -> Vec<(ConnId, u64, u32, String)> {
        let mut told = self.queue.take_fresh();
        if self.positions_due(now).is_some_and(|t| t <= now) {
            self.untold = false;
            // With nobody to tell, the tick is not spent.
            if self.queue.has_waiting() {
                self.told_at = Some(now);
                let (moved, left) = self.queue.positions_to_tell(now);
                told.extend(moved);
                // Those a walk left are told at the next tick.
                self.untold = left;
            }
        }
        let said = &mut self.said;
        told.into_iter()
            .filter_map(|(token, position, want)| {
                let run = self.jobs.run(&token)?;
                let words = match said {
                    Some((w, words)) if *w == want => words.clone(),
                    _ => said.insert((want, want.words())).1.clone(),
                };
                Some((run, token, position, words))
            })
            .collect()
    }

    /// Job `token`'s lease and its run, to tell the run.
    pub fn lease_to_tell(&self, token: u64) -> Option<(ConnId, &queue::Lease)> {
        Some((self.jobs.run(&token)?, self.queue.lease(token)?))
    }

    /// When this part next has something to do on its own: the queue's
    /// tick while anyone waits, the end of a recovery.
    pub fn next_timeout(&self, now: Nanos) -> Option<Nanos> {
        let queue = self.queue.has_waiting().then(|| {
            if self.dirty {
                now
            } else {
                self.polled + QUEUE_TICK
            }
        });
        let recovery = self.recovery.as_ref().map(|(until, _)| *until);
        queue
            .into_iter()
            .chain(recovery)
            .chain(self.positions_due(now))
            .min()
    }

    /// When the places are next told: at once for a request that waits
    /// for a walk to be told; else a tick after the last, if the queue
    /// changed since.
    fn positions_due(&self, now: Nanos) -> Option<Nanos> {
        if self.queue.must_walk() {
            return Some(now);
        }
        self.untold.then(|| {
            self.told_at
                .map_or(now, |t| t.saturating_add(POSITION_TICK))
        })
    }

    #[cfg(test)]
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// The queue changed since its places were told.
    #[cfg(test)]
    pub fn untold(&self) -> bool {
        self.untold
    }

    #[cfg(test)]
    pub fn polled(&self) -> Nanos {
        self.polled
    }

    /// When the places were last walked.
    #[cfg(test)]
    pub fn walked(&self) -> Option<Nanos> {
        self.told_at
    }

    #[cfg(test)]
    pub fn queue_in_test(&mut self) -> &mut Queue {
        &mut self.queue
    }

    /// New placements are made (no recovery holds them).
    pub fn placing(&self, now: Nanos) -> bool {
        self.recovery
            .as_ref()
            .is_none_or(|(until, _)| now >= *until)
    }

    /// Ends a recovery whose grace is over: placements resume.
    pub fn end_recovery(&mut self, now: Nanos) {
        if self
            .recovery
            .as_ref()
            .is_some_and(|(until, _)| now >= *until)
        {
            self.recovery = None;
            self.dirty = true;
            info!(
                jobs = self.jobs.len(),
                "recovery over: placing new leases again"
            );
        }
    }

    /// Why placements are held, for refusals and status.
    pub fn recovering_text(&self, now: Nanos) -> String {
        match &self.recovery {
            Some((until, why)) => format!(
                "the broker is recovering from a state file it could not trust ({why}); new placements \
                 are held for {:.0} s more, while running jobs claim their leases back",
                until.saturating_sub(now) as f64 / 1e9
            ),
            None => String::new(),
        }
    }

    /// Books, during a recovery, what a claimed job holds: on the MIG
    /// device among `held` if one exists now, else on the GPUs named there
    /// (the lease, and the MIG device's UUID if on one).
    pub fn claim_back(
        &mut self,
        token: u64,
        req: queue::Request,
        held: &[[u8; 16]],
    ) -> Result<(queue::Lease, Option<String>), queue::Refusal> {
        let named =
            |u: &str| gpufrac_common::wire::parse_uuid(u).is_some_and(|b| held.contains(&b));
        let mig = self.queue.mig().status().into_iter().find_map(|g| {
            g.instances
                .iter()
                .find_map(|i| i.uuid.clone().filter(|u| named(u)))
                .map(|u| (g.gpu.index, u))
        });
        match mig {
            Some((ix, uuid)) => self
                .queue
                .restore_mig(token, req, ix, &uuid)
                .map(|l| (l, Some(uuid))),
            None => {
                let gpus: Vec<u32> = self
                    .queue
                    .gpus()
                    .filter(|g| named(&g.uuid))
                    .map(|g| g.index)
                    .collect();
                self.queue_mut()
                    .restore(token, req, &gpus)
                    .map(|l| (l, None))
            }
        }
    }

    /// Books what a previous broker left (leases first, then the queue in
    /// its original order). Jobs whose `gpufrac run` is not `alive` are
    /// dropped. When the newest state could not be trusted, new
    /// placements are held for `grace`, while running jobs claim back what
    /// it lost.
    pub fn restore(
        &mut self,
        now: Nanos,
        loaded: Loaded,
        alive: impl Fn(&Job) -> bool,
        grace: Nanos,
    ) {
        if let Some(p) = &loaded.problem {
            warn!("{p}");
        }
        let (mut kept, mut dropped) = (0, 0);
        let mut saved = loaded.jobs;
        saved.sort_by_key(|j| match j.phase {
            Phase::Running { .. } | Phase::Unplaced => (0, 0),
            Phase::Queued { since } => (1, since),
        });
        for j in saved {
            if !alive(&j) || self.jobs.contains_key(&j.token) {
                dropped += 1;
                continue;
            }
            let ok = match (&j.phase, j.request()) {
                (Phase::Unplaced, _) => true,
                (
                    Phase::Running {
                        gpus,
                        mig: Some(uuid),
                    },
                    Some(req),
                ) => match gpus
                    .first()
                    .map(|&ix| self.queue_mut().restore_mig(j.token, req, ix, uuid))
                {
                    Some(Ok(_)) => true,
                    Some(Err(r)) => {
                        warn!(pid = j.pid, "cannot restore a MIG lease: {}", r.reason);
                        false
                    }
                    None => false,
                },
                (Phase::Running { gpus, mig: None }, Some(req)) => {
                    match self.queue_mut().restore(j.token, req, gpus) {
                        Ok(_) => true,
                        Err(r) => {
                            warn!(pid = j.pid, "cannot restore a lease: {}", r.reason);
                            false
                        }
                    }
                }
                (Phase::Queued { since }, Some(req)) => self
                    .queue
                    .submit_since((*since).min(now), j.token, req)
                    .is_ok(),
                _ => false,
            };
            if ok {
                kept += 1;
                let (token, running) = (j.token, matches!(j.phase, Phase::Running { .. }));
                self.jobs.insert(j);
                if running {
                    self.jobs.leased(token, now, 0);
                }
            } else {
                dropped += 1;
            }
        }
        if kept + dropped > 0 {
            info!(kept, dropped, "restored jobs from the state file");
        }
        if loaded.suspect {
            warn!(
                "the state file could not be trusted: new placements are held for {} s so that running \
                 jobs can claim their leases back (no GPU is booked twice)",
                grace / 1_000_000_000
            );
            let why = loaded
                .problem
                .unwrap_or_else(|| "the state file could not be trusted".into());
            self.recovery = Some((now + grace, why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::sample;
    use crate::mig::{Assignment, Range, Step};
    use crate::queue::{GpuInfo, QueueConfig};

    const GIB: u64 = 1 << 30;
    const S: Nanos = 1_000_000_000;

    /// A ledger over `n` GPUs of 80 GiB, at time 0.
    fn ledger(n: u32) -> Ledger {
        let gpus = (0..n)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{index:08}-0000-0000-0000-000000000000"),
                total_mem: 80 * GIB,
            })
            .collect();
        Ledger::new(Queue::new(gpus, QueueConfig::default()), 0)
    }

    /// Job `token`, waiting for one GPU since `since`.
    fn queued(token: u64, since: Nanos) -> Job {
        Job {
            phase: Phase::Queued { since },
            ..sample(token)
        }
    }

    fn submit(l: &mut Ledger, now: Nanos, job: Job, run: ConnId) {
        let req = job.request().expect("a job that asks for a GPU");
        l.queue_mut().submit(now, job.token, req).expect("queued");
        l.attach(job, run);
    }

    /// What the broker's pump does with the ledger: a poll, then the
    /// places told if due.
    fn pump(l: &mut Ledger, now: Nanos) -> Option<Vec<queue::Lease>> {
        let placed = l.poll(now);
        l.positions(now);
        placed
    }

    #[test]
    fn the_queue_is_walked_when_it_changed_or_a_tick_passed_while_anyone_waits() {
        let mut l = ledger(1);
        // Dirty from the start: a restored queue is placed at once.
        assert_eq!(pump(&mut l, 0).map(|p| p.len()), Some(0));
        assert_eq!(pump(&mut l, 0), None, "nothing changed");
        assert_eq!(l.next_timeout(0), None, "nobody waits");
        submit(&mut l, S, queued(7, S), 1);
        submit(&mut l, S, queued(8, S), 2);
        assert_eq!(l.next_timeout(S), Some(S), "changed: due now");
        let placed = pump(&mut l, S).expect("due");
        assert_eq!(placed.iter().map(|p| p.id).collect::<Vec<_>>(), [7]);
        // One still waits: escalation changes with time alone.
        assert_eq!(l.next_timeout(S), Some(S + QUEUE_TICK));
        assert_eq!(pump(&mut l, S + QUEUE_TICK - 1), None);
        assert!(pump(&mut l, S + QUEUE_TICK).is_some());
    }

    #[test]
    fn each_waiting_run_is_told_its_place_once_and_again_on_a_new_connection() {
        let mut l = ledger(1);
        submit(&mut l, 0, queued(7, 0), 1);
        submit(&mut l, 0, queued(8, 0), 2);
        l.poll(0);
        let told: Vec<(ConnId, u64)> = l.positions(0).iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(told, [(2, 8)], "the placed job waits for nothing");
        assert!(l.positions(0).is_empty(), "told once");
        // Its run reconnected: told again there.
        l.rerun(8, 3);
        assert_eq!(l.poll(0).map(|p| p.len()), Some(0), "rerun marks the queue");
        assert_eq!(l.next_timeout(0), Some(0), "told at once");
        let told: Vec<(ConnId, u64)> = l.positions(0).iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(told, [(3, 8)]);
        assert_eq!(
            l.lease_to_tell(7).map(|(id, q)| (id, q.gpus.clone())),
            Some((1, vec![0]))
        );
        assert!(l.lease_to_tell(8).is_none(), "a waiting job has no lease");
    }

    #[test]
    fn a_recovery_holds_placements_until_its_grace_ends() {
        let mut l = ledger(2);
        let grace = 30 * S;
        let loaded = Loaded {
            jobs: vec![sample(5)],
            problem: Some("checksum mismatch".into()),
            suspect: true,
        };
        l.restore(S, loaded, |_| true, grace);
        assert!(!l.placing(S));
        assert!(l.recovering_text(S).contains("checksum mismatch"));
        assert_eq!(
            l.lease_to_tell(5).map(|(_, q)| q.gpus.clone()),
            None,
            "no run yet"
        );
        assert!(l.queue().lease(5).is_some(), "the restored lease is booked");
        submit(&mut l, S, queued(9, S), 1);
        assert_eq!(
            pump(&mut l, S),
            Some(Vec::new()),
            "walked, nothing placed on the free GPU"
        );
        assert_eq!(
            l.next_timeout(S + 1),
            Some(S + QUEUE_TICK),
            "the queue's tick first"
        );
        pump(&mut l, S + QUEUE_TICK);
        l.end_recovery(S + grace - 1);
        assert!(!l.placing(S + grace - 1));
        l.end_recovery(S + grace);
        assert!(l.placing(S + grace) && l.recovering_text(S + grace).is_empty());
        // Over, the queue is walked at once: the free GPU is placed.
        assert_eq!(l.next_timeout(S + grace), Some(S + grace));
        let placed = pump(&mut l, S + grace).expect("due");
        assert_eq!(
            placed
                .iter()
                .map(|p| (p.id, p.gpus.clone()))
                .collect::<Vec<_>>(),
            [(9, vec![1])]
        );
    }

    #[test]
    fn a_restore_keeps_live_jobs_and_drops_dead_ones_and_duplicates() {
        let mut l = ledger(2);
        let dead = Job {
            pid: 13,
            ..sample(6)
        };
        let waiting = Job {
            phase: Phase::Queued { since: 5 * S },
            ..sample(7)
        };
        let loaded = Loaded {
            jobs: vec![waiting, sample(5), dead, sample(5)],
            problem: None,
            suspect: false,
        };
        l.restore(9 * S, loaded, |j| j.pid != 13, 30 * S);
        assert!(l.placing(9 * S), "a trusted state holds nothing");
        let mut kept: Vec<u64> = l.jobs().iter().map(|(&t, _)| t).collect();
        kept.sort_unstable();
        assert_eq!(kept, [5, 7]);
        assert_eq!(l.jobs().leased_at(&5), Some(9 * S), "held from the restore");
        // The waiting one keeps its age, and is placed on the free GPU.
        let placed = l.poll(9 * S).expect("due");
        assert_eq!(placed.iter().map(|p| p.id).collect::<Vec<_>>(), [7]);
    }

    #[test]
    fn claims_are_kept_by_token_and_forgotten_when_none_is_left() {
        let mut l = ledger(1);
        l.claim_token(4, 1);
        l.claim_token(4, 2);
        l.claim_token(5, 2);
        assert_eq!(l.claimed(4).collect::<Vec<_>>(), [1, 2]);
        l.unclaim_token(4, 1);
        l.unclaim_token(4, 2);
        l.unclaim_token(4, 9);
        assert_eq!(l.claimed(4).count(), 0);
        assert_eq!(l.claims().keys().collect::<Vec<_>>(), [&5]);
    }

    #[test]
    fn a_new_token_is_never_zero_nor_another_jobs() {
        let mut l = ledger(1);
        l.attach(sample(1), 1);
        let mut next = [0u64, 1, 0, 2].into_iter();
        let mut source: Tokens = Box::new(move || next.next().expect("enough tokens"));
        assert_eq!(l.new_token(&mut source), 2);
    }

    #[test]
    fn a_mig_lease_is_made_first_and_a_job_ending_meanwhile_abandons_it() {
        let mut l = ledger(1);
        let plain = queue::Lease {
            id: 3,
            gpus: vec![0],
            uuids: Vec::new(),
            mem_cap: None,
            mig: None,
        };
        assert!(!l.make(&plain, None), "nothing to make: granted as it is");
        let steps = vec![Step::Create {
            profile: 9,
            placement: Range { start: 0, size: 4 },
        }];
        let mig = queue::Lease {
            id: 4,
            mig: Some(Assignment {
                gpu: 0,
                gpu_uuid: String::new(),
                profile: 9,
                profile_name: "3g.40gb".into(),
                mem: 40 * GIB,
                placement: Range { start: 0, size: 4 },
                gi: None,
                uuid: None,
                steps: steps.clone(),
            }),
            ..plain
        };
        assert!(l.make(&mig, Some(8)));
        assert_eq!(
            l.poll_work(),
            Some(Work::Mig {
                lease: 4,
                gpu: 0,
                steps
            })
        );
        assert_eq!(l.poll_work(), None);
        assert_eq!(l.release(S, 4), None, "held until it is made");
        let m = l.made(4);
        assert_eq!((m.no_wait, m.abandoned), (Some(8), true));
        // Made twice (or never asked): nothing waits for it.
        assert!(l.made(4).abandoned);
    }
}
