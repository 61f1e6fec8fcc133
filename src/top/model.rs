//! What `gpufrac top` shows: the broker's last status, each process's
//! history as top saw it since it opened (the broker's ring holds GPUs,
//! users and jobs, not processes), the container of each process, and the
//! rows of the process and queue panes as the view's sort and filter make
//! them.

use std::collections::{HashMap, VecDeque};

use gpufrac_common::status::{
    GpuHistory, GpuStatus, JobShare, ProcStatus, QueueEntry, ShareHistory, Status, UserShare,
};

use super::cgroup;
use crate::names;

/// Samples of a process's history kept: as many as the broker keeps of
/// the rest.
const DEPTH: usize = gpufrac_common::status::HISTORY_DEPTH;

/// A process's history since top opened, oldest first.
#[derive(Clone, Debug, Default)]
pub struct ProcHistory {
    pub achieved: VecDeque<Option<f32>>,
    pub used: VecDeque<Option<u64>>,
}

/// (GPU time owed, GPU time got), seconds, as each status said them: what
/// the `!` mark is worked out from (`short`).
pub type Owed = VecDeque<(f64, f64)>;

/// Samples of `Owed` kept: the mark looks at the last ten seconds.
const OWED_DEPTH: usize = 11;

/// A user's part of a GPU (`job` None) or one of its jobs (`Some(None)`:
/// its processes outside any job), or a process (`pid`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    Share {
        gpu: String,
        uid: u32,
        job: Option<Option<u32>>,
    },
    Proc {
        gpu: String,
        pid: u32,
    },
}

/// The order of the process pane (`s` cycles it, `S` reverses it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sort {
    Pid,
    User,
    Memory,
    Peak,
    Share,
    State,
}

impl Sort {
    pub const ALL: [Sort; 6] = [
        Sort::Pid,
        Sort::User,
        Sort::Memory,
        Sort::Peak,
        Sort::Share,
        Sort::State,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Sort::Pid => "pid",
            Sort::User => "user",
            Sort::Memory => "mem",
            Sort::Peak => "peak",
            Sort::Share => "share",
            Sort::State => "state",
        }
    }

    pub fn parse(s: &str) -> Result<Sort, String> {
        Sort::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Sort::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown sort key {s:?}; expected one of {}",
                    names.join(", ")
                )
            })
    }

    pub fn next(self) -> Sort {
        let i = Sort::ALL.iter().position(|&k| k == self).unwrap_or(0);
        Sort::ALL[(i + 1) % Sort::ALL.len()]
    }
}

/// One term of a filter: `user:NAME`, `job:PID`, `gpu:INDEX`,
/// `class:CLASS`, or words to find in a command, user, job or container.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Term {
    User(String),
    Job(String),
    Gpu(u32),
    Class(String),
    Text(String),
}

/// What `/` filters by: every term must match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    text: String,
    terms: Vec<Term>,
}

impl Filter {
    pub fn parse(s: &str) -> Result<Filter, String> {
        let mut terms = Vec::new();
        for word in s.split_whitespace() {
            let term = match word.split_once(':') {
                Some(("user", v)) => Term::User(v.to_owned()),
                Some(("job", v)) => Term::Job(v.to_owned()),
                Some(("gpu", v)) => Term::Gpu(v.parse().map_err(|_| {
                    format!("gpu:{v}: expected a GPU index, as status shows it, e.g. gpu:0")
                })?),
                Some(("class", v)) if ["high", "normal", "low"].contains(&v) => {
                    Term::Class(v.to_owned())
                }
                Some(("class", v)) => {
                    return Err(format!(
                        "class:{v}: expected class:high, class:normal or class:low"
                    ));
                }
                _ => Term::Text(word.to_lowercase()),
            };
            terms.push(term);
        }
        Ok(Filter {
            text: s.trim().to_owned(),
            terms,
        })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}

/// How the process pane is built.
#[derive(Clone, Debug)]
pub struct ViewOpts {
    /// Users, then jobs, then processes (else a flat table).
    pub tree: bool,
    pub sort: Sort,
    pub reverse: bool,
    pub filter: Filter,
    /// Only the processes and requests of `me`.
    pub mine: bool,
    pub me: u32,
}

impl Default for ViewOpts {
    fn default() -> Self {
        ViewOpts {
            tree: true,
            sort: Sort::Pid,
            reverse: false,
            filter: Filter::default(),
            mine: false,
            me: names::me(),
        }
    }
}

/// A row of the process pane, by position in the status it was built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    /// A GPU's heading, in the tree when more than one GPU has processes.
    Gpu {
        gpu: usize,
    },
    User {
        gpu: usize,
        user: usize,
    },
    Job {
        gpu: usize,
        user: usize,
        job: usize,
    },
    Proc {
        gpu: usize,
        proc: usize,
        depth: u8,
    },
    /// A process the driver lists on the GPU that is not under the shim
    /// (`unmanaged`): the memory it holds is nobody's lease.
    Other {
        gpu: usize,
        other: usize,
    },
}

#[derive(Default)]
pub struct Model {
    pub status: Status,
    /// Status fetches since top opened.
    pub samples: u64,
    /// When the last status came.
    pub received: Option<std::time::Instant>,
    procs: HashMap<(String, u32), ProcHistory>,
    containers: HashMap<u32, Option<String>>,
    owed: HashMap<Unit, Owed>,
}

impl Model {
    /// A new status: each process's history grows by one sample, and the
    /// containers of new processes are looked up.
    pub fn update(&mut self, status: Status) {
        self.samples += 1;
        self.received = Some(std::time::Instant::now());
        let mut seen = Vec::new();
        let mut owed = HashMap::new();
        for g in &status.gpus {
            for p in &g.processes {
                let key = (g.uuid.clone(), p.pid);
                let h = self.procs.entry(key.clone()).or_default();
                push(&mut h.achieved, Some(p.share_achieved as f32));
                push(&mut h.used, Some(p.mem_used));
                seen.push(key);
                let unit = Unit::Proc {
                    gpu: g.uuid.clone(),
                    pid: p.pid,
                };
                owed.insert(unit, (p.entitled_s, p.gpu_time_s));
            }
            for u in &g.users {
                let unit = |job| Unit::Share {
                    gpu: g.uuid.clone(),
                    uid: u.uid,
                    job,
                };
                owed.insert(unit(None), (u.entitled_s, u.gpu_time_s));
                for j in &u.jobs {
                    owed.insert(unit(Some(j.job)), (j.entitled_s, j.gpu_time_s));
                }
            }
        }
        // Units gone (or whose processes left, so that their sums went
        // down) start again.
        self.owed.retain(|k, _| owed.contains_key(k));
        for (k, now) in owed {
            let h = self.owed.entry(k).or_default();
            if h.back().is_some_and(|b| now.0 < b.0 || now.1 < b.1) {
                h.clear();
            }
            h.push_back(now);
            if h.len() > OWED_DEPTH {
                h.pop_front();
            }
        }
        // A process gone is not coming back under that pid.
        self.procs.retain(|k, _| seen.contains(k));
        let pids: Vec<u32> = seen.iter().map(|(_, p)| *p).collect();
        self.containers.retain(|p, _| pids.contains(p));
        for pid in pids {
            self.containers
                .entry(pid)
                .or_insert_with(|| cgroup::of(pid));
        }
        self.status = status;
    }

    /// Whether `unit` got less than it was owed over top's last ten
    /// samples (`short`).
    pub fn short(&self, unit: &Unit) -> bool {
        self.owed.get(unit).is_some_and(short)
    }

    pub fn proc_history(&self, gpu: &str, pid: u32) -> Option<&ProcHistory> {
        self.procs.get(&(gpu.to_owned(), pid))
    }

    /// Where the process runs: its pod as the broker knows it, else the
    /// container or Slurm job of its cgroup.
    pub fn container(&self, p: &ProcStatus) -> Option<String> {
        if let Some(pod) = &p.pod {
            return Some(format!("pod {}", crate::status::clean(pod)));
        }
        self.containers.get(&p.pid).cloned().flatten()
    }

    pub fn gpu_history(&self, uuid: &str) -> Option<&GpuHistory> {
        self.status
            .history
            .as_ref()?
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
    }

    /// The broker's history of a user's part of a GPU (`job` None), or of
    /// one of its jobs (`Some(None)`: its processes outside any job).
    pub fn share_history(
        &self,
        gpu: &str,
        uid: u32,
        job: Option<Option<u32>>,
    ) -> Option<&ShareHistory> {
        self.status.history.as_ref()?.shares.iter().find(|s| {
            s.gpu == gpu
                && s.uid == uid
                && match job {
                    None => s.level == "user",
                    Some(j) => s.level == "job" && s.job == j,
                }
        })
    }

    /// The user and job a process is counted under on its GPU: a job's
    /// processes are its user's, whoever runs them.
    pub fn unit_of(&self, g: &GpuStatus, p: &ProcStatus) -> Option<(usize, usize)> {
        g.users.iter().enumerate().find_map(|(ui, u)| {
            u.jobs
                .iter()
                .position(|j| member(u, j, p))
                .map(|ji| (ui, ji))
        })
    }

    fn proc_matches(&self, opts: &ViewOpts, g: &GpuStatus, p: &ProcStatus) -> bool {
        let owner = self.unit_of(g, p).map_or(p.uid, |(u, _)| g.users[u].uid);
        if opts.mine && p.uid != opts.me && owner != opts.me {
            return false;
        }
        let user = names::user(p.uid);
        let job = job_label(p.job, &p.pod);
        let container = self.container(p).unwrap_or_default();
        opts.filter.terms.iter().all(|t| match t {
            Term::User(u) => user == *u || p.uid.to_string() == *u || names::user(owner) == *u,
            Term::Job(j) => job
                .as_deref()
                .is_some_and(|l| l == j || l.contains(j.as_str())),
            Term::Gpu(i) => g.index == Some(*i),
            Term::Class(c) => p.priority == *c,
            Term::Text(w) => {
                [&p.command, &user, &container]
                    .iter()
                    .any(|f| f.to_lowercase().contains(w))
                    || job.as_deref().is_some_and(|l| l.contains(w.as_str()))
            }
        })
    }

    /// The rows of the process pane.
    pub fn rows(&self, opts: &ViewOpts) -> Vec<Row> {
        let gpus = &self.status.gpus;
        if !opts.tree {
            let mut rows: Vec<(usize, usize)> = gpus
                .iter()
                .enumerate()
                .flat_map(|(gi, g)| (0..g.processes.len()).map(move |pi| (gi, pi)))
                .filter(|&(gi, pi)| self.proc_matches(opts, &gpus[gi], &gpus[gi].processes[pi]))
                .collect();
            rows.sort_by(|&(ga, pa), &(gb, pb)| {
                let o = self.cmp_procs(opts.sort, &gpus[ga].processes[pa], &gpus[gb].processes[pb]);
                let o = o.then((ga, pa).cmp(&(gb, pb)));
                if opts.reverse { o.reverse() } else { o }
            });
            let mut rows: Vec<Row> = rows
                .into_iter()
                .map(|(gpu, proc)| Row::Proc {
                    gpu,
                    proc,
                    depth: 0,
                })
                .collect();
            for (gi, g) in gpus.iter().enumerate() {
                rows.extend(self.others(opts, gi, g));
            }
            return rows;
        }
        let busy = gpus
            .iter()
            .enumerate()
            .filter(|&(gi, g)| {
                g.processes.iter().any(|p| self.proc_matches(opts, g, p))
                    || !self.others(opts, gi, g).is_empty()
            })
            .count();
        let mut rows = Vec::new();
        for (gi, g) in gpus.iter().enumerate() {
            let visible: Vec<usize> = (0..g.processes.len())
                .filter(|&pi| self.proc_matches(opts, g, &g.processes[pi]))
                .collect();
            let others = self.others(opts, gi, g);
            if visible.is_empty() && others.is_empty() {
                continue;
            }
            if busy > 1 {
                rows.push(Row::Gpu { gpu: gi });
            }
            let mut placed = vec![false; g.processes.len()];
            let mut users: Vec<usize> = (0..g.users.len()).collect();
            users.sort_by(|&a, &b| {
                let o = cmp_users(opts.sort, &g.users[a], &g.users[b]).then(a.cmp(&b));
                if opts.reverse { o.reverse() } else { o }
            });
            for ui in users {
                let u = &g.users[ui];
                let mut user_rows = Vec::new();
                for (ji, j) in u.jobs.iter().enumerate() {
                    let mut procs: Vec<usize> = visible
                        .iter()
                        .copied()
                        .filter(|&pi| member(u, j, &g.processes[pi]))
                        .collect();
                    if procs.is_empty() {
                        continue;
                    }
                    procs.sort_by(|&a, &b| {
                        let o = self
                            .cmp_procs(opts.sort, &g.processes[a], &g.processes[b])
                            .then(a.cmp(&b));
                        if opts.reverse { o.reverse() } else { o }
                    });
                    user_rows.push(Row::Job {
                        gpu: gi,
                        user: ui,
                        job: ji,
                    });
                    for pi in procs {
                        placed[pi] = true;
                        user_rows.push(Row::Proc {
                            gpu: gi,
                            proc: pi,
                            depth: 2,
                        });
                    }
                }
                if !user_rows.is_empty() {
                    rows.push(Row::User { gpu: gi, user: ui });
                    rows.extend(user_rows);
                }
            }
            // Processes the levels do not list (MPS, or a broker without
            // them): as they are, after the tree.
            for pi in visible.into_iter().filter(|&pi| !placed[pi]) {
                rows.push(Row::Proc {
                    gpu: gi,
                    proc: pi,
                    depth: 0,
                });
            }
            rows.extend(others);
        }
        rows
    }

    /// GPU `gi`'s processes outside the shim, as the filter leaves them:
    /// nobody's (not under `u`), matched by their GPU, their pid or the
    /// word `other`.
    fn others(&self, opts: &ViewOpts, gi: usize, g: &GpuStatus) -> Vec<Row> {
        if opts.mine {
            return Vec::new();
        }
        (0..g.unmanaged.len())
            .filter(|&i| {
                let pid = g.unmanaged[i].pid.to_string();
                opts.filter.terms.iter().all(|t| match t {
                    Term::Gpu(n) => g.index == Some(*n),
                    Term::Text(w) => "other".contains(w.as_str()) || pid.contains(w.as_str()),
                    _ => false,
                })
            })
            .map(|other| Row::Other { gpu: gi, other })
            .collect()
    }

    fn cmp_procs(&self, sort: Sort, a: &ProcStatus, b: &ProcStatus) -> std::cmp::Ordering {
        match sort {
            Sort::Pid => a.pid.cmp(&b.pid),
            Sort::User => names::user(a.uid).cmp(&names::user(b.uid)),
            Sort::Memory => b.mem_used.cmp(&a.mem_used),
            Sort::Peak => b.mem_peak.cmp(&a.mem_peak),
            Sort::Share => b.share_achieved.total_cmp(&a.share_achieved),
            Sort::State => state_rank(&a.state).cmp(&state_rank(&b.state)),
        }
    }

    /// The queue's entries the filter and `u` leave, in queue order.
    pub fn queue_rows(&self, opts: &ViewOpts) -> Vec<usize> {
        (0..self.status.queue.len())
            .filter(|&i| queue_matches(opts, &self.status.queue[i]))
            .collect()
    }
}

fn queue_matches(opts: &ViewOpts, e: &QueueEntry) -> bool {
    if opts.mine && e.uid != opts.me {
        return false;
    }
    let user = names::user(e.uid);
    let job = job_label(Some(e.pid), &e.pod).unwrap_or_default();
    opts.filter.terms.iter().all(|t| match t {
        Term::User(u) => user == *u || e.uid.to_string() == *u,
        Term::Job(j) => job == *j || job.contains(j.as_str()),
        Term::Gpu(i) => e.waits_for.contains(i),
        // Classes are processes'; a request has none yet.
        Term::Class(_) => false,
        Term::Text(w) => [&e.command, &user, &job, &e.why]
            .iter()
            .any(|f| f.to_lowercase().contains(w)),
    })
}

/// Whether `p` is one of the processes counted under job `j` of user `u`.
fn member(u: &UserShare, j: &JobShare, p: &ProcStatus) -> bool {
    match j.job {
        Some(job) => p.job == Some(job) && p.pod == j.pod,
        None => p.job.is_none() && p.uid == u.uid,
    }
}

fn cmp_users(sort: Sort, a: &UserShare, b: &UserShare) -> std::cmp::Ordering {
    match sort {
        Sort::User => names::user(a.uid).cmp(&names::user(b.uid)),
        Sort::Share => b.share_achieved.total_cmp(&a.share_achieved),
        _ => a.uid.cmp(&b.uid),
    }
}

/// Holders first, then waiters: who has the GPU, who wants it.
fn state_rank(s: &str) -> u8 {
    match s {
        "holding" => 0,
        "revoking" => 1,
        "hung" => 2,
        "waiting" => 3,
        _ => 4,
    }
}

/// A job as top names it: `41` (its run's pid) or `pod ns/name`.
pub fn job_label(pid: Option<u32>, pod: &Option<String>) -> Option<String> {
    crate::status::job_name(pid, pod)
}

fn push<T>(q: &mut VecDeque<T>, v: T) {
    if q.len() == DEPTH {
        q.pop_front();
    }
    q.push_back(v);
}

/// Whether a unit got less than it was owed, over samples a second apart
/// (`Owed`): with at least five of them, it got less than what it was
/// owed by more than 5 points of the GPU and by more than a fifth of what
/// it was owed. What it was owed is its target share over the time it
/// was busy and its ceilings let it be granted, net of what a `high`
/// process was owed (the broker's `entitled_s`): a unit that was idle,
/// held at its own limit, or passed over for a `high` burst is not short,
/// and one that gets more than its target while others idle is not
/// either. The same measure as the `GpufracJobStarved` alert, over ten
/// seconds instead of ten minutes.
pub fn short(samples: &Owed) -> bool {
    if samples.len() < 5 {
        return false;
    }
    let (first, last) = (samples[0], samples[samples.len() - 1]);
    let secs = (samples.len() - 1) as f64;
    let (owed, got) = (last.0 - first.0, last.1 - first.1);
    owed - got > 0.05 * secs && owed - got > owed / 5.0
}
