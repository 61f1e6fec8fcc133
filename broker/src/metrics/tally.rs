//! What metrics remember from one snapshot to the next: which users, jobs
//! and processes have series of their own (each label bounded: past the
//! bound they fold into `other`, or a process is left unlisted), and the
//! GPU time and memory refusals of processes that are gone, so that a
//! user's and a job's counters never go down when a process exits.

use std::collections::{HashMap, HashSet};

use crate::status::{GpuStatus, ProcStatus, Status};

type Nanos = u64;

/// Users with series of their own; the rest are `user="other"`. uids are
/// made by root, but a user namespace maps 65536 of them per user.
pub const MAX_USERS: usize = 100;
/// Jobs with series of their own; the rest are `job_id="other"`.
pub const MAX_JOBS: usize = 200;
/// Processes (per GPU) with series of their own; the rest are counted by
/// `gpufrac_processes_unlisted` and in their user's and job's series.
pub const MAX_PROCESSES: usize = 200;
/// A user with nothing on the node is forgotten (its counters start again
/// from 0 if it comes back) after this.
const FORGET_USER_AFTER: Nanos = 3_600_000_000_000;

/// A job as metrics name it: a pod's `namespace/name`, else its `gpufrac
/// run`'s pid (for a pod, the device plugin's pid, shared by all pods);
/// a user's processes outside any job are its job `none`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobKey {
    None,
    Run(u32),
    Pod(String),
}

impl JobKey {
    pub fn of(job: Option<u32>, pod: Option<&str>) -> JobKey {
        match (pod, job) {
            (Some(p), _) => JobKey::Pod(p.to_owned()),
            (None, Some(pid)) => JobKey::Run(pid),
            (None, None) => JobKey::None,
        }
    }

    fn label(&self) -> String {
        match self {
            JobKey::None => "none".into(),
            JobKey::Run(pid) => pid.to_string(),
            JobKey::Pod(p) => p.clone(),
        }
    }
}

/// GPU time and refusals, seconds and a count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    pub gpu_s: f64,
    pub refusals: u64,
    /// GPU time owed, and time held back by ceilings, seconds.
    pub entitled_s: f64,
    pub held_back_s: f64,
}

impl Totals {
    fn add(&mut self, o: Totals) {
        self.gpu_s += o.gpu_s;
        self.refusals += o.refusals;
        self.entitled_s += o.entitled_s;
        self.held_back_s += o.held_back_s;
    }
}

/// A process on a GPU as last seen.
#[derive(Clone, Debug)]
struct Seen {
    uid: u32,
    job: JobKey,
    totals: Totals,
}

/// Who a series is about, once bounded: a user (`None`: other) and a job
/// (`None`: other).
type UserKey = Option<u32>;

pub struct Tally {
    /// Users with series of their own, and when each was last seen.
    users: HashMap<u32, Nanos>,
    jobs: HashSet<(u32, JobKey)>,
    /// (GPU UUID, pid) of the processes listed one by one.
    procs: HashSet<(String, u32)>,
    seen: HashMap<(String, u32), Seen>,
    /// What processes that are gone had: per (GPU, user), and per (GPU,
    /// user, job) while the job lives.
    gone_user: HashMap<(String, UserKey), Totals>,
    gone_job: HashMap<(String, UserKey, Option<JobKey>), Totals>,
    names: HashMap<u32, String>,
    name_of: fn(u32) -> Option<String>,
    /// Each user's refusals at the last snapshot: a user is seen when
    /// refused anew.
    refusals: HashMap<u32, u64>,
}

/// The user a process is counted for on its GPU: its job's user (a job's
/// processes are its user's, whoever runs them), else its own.
pub fn owner(g: &GpuStatus, p: &ProcStatus) -> u32 {
    if p.job.is_some() {
        let key = JobKey::of(p.job, p.pod.as_deref());
        for u in &g.users {
            if u.jobs
                .iter()
                .any(|j| JobKey::of(j.job, j.pod.as_deref()) == key)
            {
                return u.uid;
            }
        }
    }
    p.uid
}

impl Tally {
    /// `name_of` turns a uid into a user name (`None`: the uid is shown).
    pub fn new(name_of: fn(u32) -> Option<String>) -> Tally {
        Tally {
            users: HashMap::new(),
            jobs: HashSet::new(),
            procs: HashSet::new(),
            seen: HashMap::new(),
            gone_user: HashMap::new(),
            gone_job: HashMap::new(),
            names: HashMap::new(),
            name_of,
            refusals: HashMap::new(),
        }
    }

    fn user_key(&self, uid: u32) -> UserKey {
        self.users.contains_key(&uid).then_some(uid)
    }

    fn job_key(&self, uid: u32, job: &JobKey) -> Option<JobKey> {
        self.jobs.contains(&(uid, job.clone())).then(|| job.clone())
    }

    /// The `user` label of `uid`.
    pub fn user(&self, uid: u32) -> String {
        match self.user_key(uid) {
            Some(u) => self.names.get(&u).cloned().unwrap_or_else(|| u.to_string()),
            None => "other".into(),
        }
    }

    /// The `job_id` label of a job of `uid`.
    pub fn job(&self, uid: u32, job: &JobKey) -> String {
        match self.job_key(uid, job) {
            Some(j) => j.label(),
            None => "other".into(),
        }
    }

    /// Whether the process `pid` on GPU `uuid` has series of its own.
    pub fn listed(&self, uuid: &str, pid: u32) -> bool {
        self.procs.contains(&(uuid.to_owned(), pid))
    }

    /// What gone processes had, per GPU and user: (GPU UUID, `user`
    /// label, totals). Written even where the user has no process left.
    pub fn gone_users(&self) -> impl Iterator<Item = (&str, String, Totals)> {
        self.gone_user
            .iter()
            .map(|((g, u), t)| (g.as_str(), self.label_of(*u), *t))
    }

    /// What gone processes of jobs had, per GPU: (GPU UUID, `user` label,
    /// `job_id` label, totals).
    pub fn gone_jobs(&self) -> impl Iterator<Item = (&str, String, String, Totals)> {
        self.gone_job.iter().map(|((g, u, j), t)| {
            let job = j.as_ref().map_or_else(|| "other".into(), JobKey::label);
            (g.as_str(), self.label_of(*u), job, *t)
        })
    }

    fn label_of(&self, u: UserKey) -> String {
        match u {
            Some(uid) => self.user(uid),
            None => "other".into(),
        }
    }

    /// Takes in a snapshot taken at `now`.
    pub fn fold(&mut self, now: Nanos, s: &Status) {
        let mut live_procs = Vec::new();
        let mut live_jobs = HashSet::new();
        for g in &s.gpus {
            for p in &g.processes {
                let uid = owner(g, p);
                let job = JobKey::of(p.job, p.pod.as_deref());
                self.see_user(now, uid);
                self.admit_job(uid, &job);
                live_jobs.insert((uid, job.clone()));
                let key = (g.uuid.clone(), p.pid);
                let totals = Totals {
                    gpu_s: p.gpu_time_s,
                    refusals: p.ooms,
                    entitled_s: p.entitled_s,
                    held_back_s: p.held_back_s,
                };
                if let Some(old) = self.seen.get(&key).cloned()
                    && (old.uid != uid
                        || old.job != job
                        || totals.gpu_s < old.totals.gpu_s
                        || totals.entitled_s < old.totals.entitled_s
                        || totals.refusals < old.totals.refusals)
                {
                    // Another process under a reused pid, or moved: what
                    // the one before had is kept as gone.
                    self.retire(&g.uuid, &old);
                }
                self.seen.insert(key.clone(), Seen { uid, job, totals });
                live_procs.push(key);
            }
        }
        for l in &s.leases {
            let job = JobKey::of(Some(l.pid), l.pod.as_deref());
            self.see_user(now, l.uid);
            self.admit_job(l.uid, &job);
            live_jobs.insert((l.uid, job));
        }
        for q in &s.queue {
            let job = JobKey::of(Some(q.pid), q.pod.as_deref());
            self.see_user(now, q.uid);
            self.admit_job(q.uid, &job);
            live_jobs.insert((q.uid, job));
        }
        let live: HashSet<&(String, u32)> = live_procs.iter().collect();
        let gone: Vec<((String, u32), Seen)> = self
            .seen
            .iter()
            .filter(|(k, _)| !live.contains(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, old) in gone {
            self.retire(&key.0, &old);
            self.seen.remove(&key);
        }
        // Listed processes stay listed while they live; newcomers are
        // listed while their GPU has room.
        self.procs.retain(|k| live.contains(k));
        let mut per_gpu: HashMap<&str, usize> = HashMap::new();
        for (g, _) in &self.procs {
            *per_gpu.entry(g.as_str()).or_default() += 1;
        }
        let mut new = Vec::new();
        for key in &live_procs {
            let n = per_gpu.entry(key.0.as_str()).or_default();
            if *n < MAX_PROCESSES && !self.procs.contains(key) {
                *n += 1;
                new.push(key.clone());
            }
        }
        self.procs.extend(new);
        self.jobs.retain(|k| live_jobs.contains(k));
        // A MIG instance is a GPU of its own, with a new UUID each time
        // one is made: what is kept of GPUs that are gone goes with them.
        let gpus: HashSet<&str> = s.gpus.iter().map(|g| g.uuid.as_str()).collect();
        self.gone_user.retain(|(g, _), _| gpus.contains(g.as_str()));
        self.gone_job
            .retain(|(g, _, _), _| gpus.contains(g.as_str()));
        // A job's gone totals last as long as the job; those folded into
        // `other` as long as their user.
        let (jobs, users) = (&self.jobs, &self.users);
        self.gone_job.retain(|(_, u, j), _| match (u, j) {
            (Some(u), Some(j)) => jobs.contains(&(*u, j.clone())),
            (Some(u), None) => users.contains_key(u),
            (None, _) => true,
        });
        let forget: Vec<u32> = self
            .users
            .iter()
            .filter(|(_, seen)| now.saturating_sub(**seen) > FORGET_USER_AFTER)
            .map(|(u, _)| *u)
            .collect();
        for u in forget {
            self.users.remove(&u);
            self.names.remove(&u);
            self.gone_user.retain(|(_, k), _| *k != Some(u));
            self.gone_job.retain(|(_, k, _), _| *k != Some(u));
        }
    }

    /// Takes in the refusals counted by `now`: a user refused since the
    /// last snapshot is seen, as one with a process is, so that its
    /// refusals are its own series while it is known.
    pub fn refused(&mut self, now: Nanos, stats: &crate::stats::Stats) {
        for (&uid, counts) in &stats.refusals {
            let n: u64 = counts.iter().sum();
            if self.refusals.insert(uid, n) != Some(n) && uid != crate::stats::OTHER_UID {
                self.see_user(now, uid);
            }
        }
    }

    fn see_user(&mut self, now: Nanos, uid: u32) {
        if let Some(t) = self.users.get_mut(&uid) {
            *t = now;
        } else if self.users.len() < MAX_USERS {
            self.users.insert(uid, now);
            if let Some(n) = (self.name_of)(uid) {
                self.names.insert(uid, n);
            }
        }
    }

    fn admit_job(&mut self, uid: u32, job: &JobKey) {
        if self.users.contains_key(&uid) && self.jobs.len() < MAX_JOBS {
            self.jobs.insert((uid, job.clone()));
        }
    }

    fn retire(&mut self, uuid: &str, old: &Seen) {
        let u = self.user_key(old.uid);
        self.gone_user
            .entry((uuid.to_owned(), u))
            .or_default()
            .add(old.totals);
        let j = self.job_key(old.uid, &old.job);
        self.gone_job
            .entry((uuid.to_owned(), u, j))
            .or_default()
            .add(old.totals);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{JobShare, LeaseEntry, UserShare};

    fn proc(pid: u32, uid: u32, job: Option<u32>, gpu_s: f64, ooms: u64) -> ProcStatus {
        ProcStatus {
            pid,
            uid,
            job,
            gpu_time_s: gpu_s,
            ooms,
            ..ProcStatus::default()
        }
    }

    fn status(procs: Vec<ProcStatus>) -> Status {
        // Every job's processes are counted for uid 7, whoever runs them.
        let jobs: Vec<JobShare> = procs
            .iter()
            .filter(|p| p.job.is_some())
            .map(|p| JobShare {
                job: p.job,
                ..JobShare::default()
            })
            .collect();
        Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                processes: procs,
                users: vec![UserShare {
                    uid: 7,
                    jobs,
                    ..UserShare::default()
                }],
                ..GpuStatus::default()
            }],
            ..Status::default()
        }
    }

    fn names(uid: u32) -> Option<String> {
        (uid == 7).then(|| "alice".into())
    }

    fn gone_user(t: &Tally, uuid: &str, user: &str) -> Totals {
        t.gone_users()
            .filter(|(g, u, _)| *g == uuid && u == user)
            .map(|(_, _, t)| t)
            .next()
            .unwrap_or_default()
    }

    fn gone_job(t: &Tally, uuid: &str, user: &str, job: &str) -> Totals {
        t.gone_jobs()
            .filter(|(g, u, j, _)| *g == uuid && u == user && j == job)
            .map(|(_, _, _, t)| t)
            .next()
            .unwrap_or_default()
    }

    #[test]
    fn a_gone_process_keeps_its_gpu_time_and_refusals_in_its_users_and_jobs_counters() {
        let mut t = Tally::new(names);
        t.fold(
            0,
            &status(vec![
                proc(10, 7, None, 1.5, 2),
                proc(11, 9, Some(50), 4.0, 1),
            ]),
        );
        assert_eq!(gone_user(&t, "GPU-1", "alice"), Totals::default());
        t.fold(1, &status(vec![proc(11, 9, Some(50), 5.0, 1)]));
        assert_eq!(
            gone_user(&t, "GPU-1", "alice"),
            Totals {
                gpu_s: 1.5,
                refusals: 2,
                ..Totals::default()
            }
        );
        // pid 11 ran for uid 9 in uid 7's job: counted for uid 7, and
        // uid 9 has no series of its own.
        assert_eq!(t.user(7), "alice");
        assert_eq!(t.user(9), "other");
        // The job ends with its process; its own totals go with it, its
        // user's stay.
        t.fold(2, &status(vec![]));
        assert_eq!(gone_user(&t, "GPU-1", "alice").gpu_s, 6.5);
        assert_eq!(gone_job(&t, "GPU-1", "alice", "50").gpu_s, 0.0);
    }

    #[test]
    fn a_reused_pid_is_another_process() {
        let mut t = Tally::new(names);
        t.fold(0, &status(vec![proc(10, 7, None, 3.0, 0)]));
        t.fold(1, &status(vec![proc(10, 7, None, 0.5, 0)]));
        assert_eq!(gone_user(&t, "GPU-1", "alice").gpu_s, 3.0);
        assert_eq!(gone_job(&t, "GPU-1", "alice", "none").gpu_s, 3.0);
    }

    #[test]
    fn users_jobs_and_processes_past_their_bounds_fold_into_other() {
        let mut t = Tally::new(names);
        let many: Vec<ProcStatus> = (0..MAX_USERS as u32 + 5)
            .map(|u| proc(1000 + u, 100 + u, None, 1.0, 0))
            .collect();
        t.fold(0, &status(many.clone()));
        assert_ne!(t.user(100), "other");
        assert_eq!(t.user(100 + MAX_USERS as u32 + 1), "other");
        let listed = many.iter().filter(|p| t.listed("GPU-1", p.pid)).count();
        assert_eq!(listed, MAX_PROCESSES.min(many.len()));
        // The gone processes of users past the bound are summed in one.
        t.fold(1, &status(vec![]));
        let other = gone_user(&t, "GPU-1", "other");
        assert_eq!(other.gpu_s, 5.0);
        assert_eq!(t.gone_users().count(), MAX_USERS + 1);

        let mut t = Tally::new(names);
        let leases = (0..MAX_JOBS as u32 + 3)
            .map(|i| LeaseEntry {
                pid: 5000 + i,
                uid: 7,
                ..LeaseEntry::default()
            })
            .collect();
        t.fold(
            0,
            &Status {
                leases,
                ..Status::default()
            },
        );
        assert_eq!(t.job(7, &JobKey::Run(5000)), "5000");
        assert_eq!(t.job(7, &JobKey::Run(5000 + MAX_JOBS as u32 + 1)), "other");
    }

    #[test]
    fn what_is_kept_of_a_gpu_goes_with_it() {
        let mut t = Tally::new(names);
        t.fold(0, &status(vec![proc(10, 7, None, 2.0, 0)]));
        t.fold(1, &status(vec![]));
        assert_eq!(t.gone_users().count(), 1);
        t.fold(2, &Status::default());
        assert_eq!(t.gone_users().count(), 0);
    }

    #[test]
    fn a_user_absent_for_an_hour_is_forgotten() {
        let mut t = Tally::new(names);
        t.fold(0, &status(vec![proc(10, 7, None, 2.0, 0)]));
        t.fold(1, &status(vec![]));
        t.fold(FORGET_USER_AFTER, &status(vec![]));
        assert_eq!(gone_user(&t, "GPU-1", "alice").gpu_s, 2.0, "not yet");
        t.fold(FORGET_USER_AFTER + 2, &status(vec![]));
        assert_eq!(t.gone_users().count(), 0);
        assert_eq!(t.user(7), "other", "its slot is free");
    }
}
