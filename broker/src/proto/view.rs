//! Status: what `gpufrac status` shows and metrics are made from, paged so
//! that a page fits a frame whatever the node holds.

use std::collections::{BTreeMap, HashMap};

use gpufrac_common::wire;

use super::groups::DEFAULT_WEIGHT;
use super::{Broker, Nanos};
use crate::jobs::Phase;
use crate::mig::{self, Use};
use crate::queue::{Want, Why};
use crate::sched::{ClientState, Priority};
use crate::status::{
    GpuStatus, JobShare, LeaseEntry, MigInstance, MigStatus, ProcStatus, QueueEntry, Status,
    UserShare,
};

/// Where a process stands in the levels of fairness.
struct Unit {
    uid: u32,
    weight: f64,
    /// Its job's token.
    job: Option<u64>,
    /// Its own weight (`GPU_COMPUTE_SHARE`).
    own: f64,
}

/// The most of a status page the history may take: beyond, it is served
/// with fewer samples.
const HISTORY_ROOM: usize = wire::MAX_STATUS_JSON / 4;

/// Processes listed per status page; a page's JSON stays far below the
/// frame limit (a process entry is a few hundred bytes).
const STATUS_PAGE: usize = 1000;

impl Broker {
    pub fn status(&self, now: Nanos) -> Status {
        self.status_with(now, true)
    }

    /// The status without the queue's entries, for the history's sample
    /// each second, which counts them: each entry says why its request
    /// waits, a walk of the queue and a line of text per request, which
    /// made a broker with 1,000 requests waiting spend most of its idle
    /// time on samples that kept one number of them.
    pub fn status_brief(&self, now: Nanos) -> Status {
        self.status_with(now, false)
    }

    fn status_with(&self, now: Nanos, entries: bool) -> Status {
        let now = now.max(self.now);
        let leases = self.ledger.queue().leases();
        // What each job's processes hold together, per GPU: summed once,
        // not once per process.
        let mut job_used: HashMap<(u64, usize), u64> = HashMap::new();
        for c in self.conns.values() {
            if let Some(s) = c.shim()
                && let Some(t) = s.member_of
            {
                for d in &s.devices {
                    *job_used.entry((t, d.gpu)).or_insert(0) += d.used;
                }
            }
        }
        let mut gpus = Vec::new();
        let managed = self.managed();
        let mig_status = self.ledger.queue().mig().status();
        let live: Vec<&str> = mig_status
            .iter()
            .flat_map(|g| g.instances.iter().filter_map(|i| i.uuid.as_deref()))
            .collect();
        for (gi, g) in self.gpus.iter().enumerate() {
            // Entries of instances that are gone, and of GPUs learnt from
            // clients that none names any more (kept for reuse), are not
            // shown.
            if g.vacant() || (g.mig.is_some() && !live.contains(&g.uuid_str.as_str())) {
                continue;
            }
            let st = g.sched.status(now);
            let mut processes = Vec::new();
            let mut units: HashMap<u32, Unit> = HashMap::new();
            for (&id, c) in self.conns.iter() {
                let Some(sh) = c.shim() else {
                    continue;
                };
                let Some(d) = sh.devices.iter().find(|d| d.gpu == gi) else {
                    continue;
                };
                let s = st.iter().find(|s| s.client == id);
                let job = sh.member_of.and_then(|t| self.ledger.jobs().get(&t));
                let (uid, weight) = self.user_of(c);
                units.insert(
                    c.peer.pid,
                    Unit {
                        uid,
                        weight,
                        job: sh.member_of,
                        own: sh.share.unwrap_or(DEFAULT_WEIGHT),
                    },
                );
                processes.push(ProcStatus {
                    pid: c.peer.pid,
                    command: c.command.clone(),
                    ordinal: d.ordinal,
                    mem_used: d.used,
                    mem_peak: d.peak,
                    mem_cap: (d.cap > 0).then_some(d.cap),
                    sm_percent: self
                        .cfg
                        .mps_pipe
                        .as_ref()
                        .and_then(|_| job.and_then(|j| j.compute)),
                    driver_mem: self
                        .world
                        .telemetry()
                        .process_memory(&g.uuid_str, c.peer.pid),
                    ooms: d.ooms,
                    share_target: s.map_or(0.0, |s| s.target),
                    share_achieved: s.map_or(0.0, |s| s.achieved),
                    limit: s.map_or(sh.limit, |s| s.limit),
                    uid: c.peer.uid,
                    job: job.map(|j| j.pid),
                    pod: job.and_then(|j| j.pod.clone()),
                    job_mem_used: sh
                        .member_of
                        .map(|t| job_used.get(&(t, gi)).copied().unwrap_or(0)),
                    state: s.map_or("idle".into(), |s| match s.state {
                        ClientState::Idle => "idle".into(),
                        ClientState::Waiting => "waiting".into(),
                        ClientState::Holding => "holding".into(),
                        ClientState::Revoking if s.hung => "hung".into(),
                        ClientState::Revoking => "revoking".into(),
                    }),
                    priority: s.map_or(Priority::Normal, |s| s.priority).as_str().into(),
                    gpu_time_s: s.map_or(0.0, |s| s.times.gpu_time as f64 / 1e9),
                    entitled_s: s.map_or(0.0, |s| s.times.entitled as f64 / 1e9),
                    held_back_s: s.map_or(0.0, |s| s.times.held_back as f64 / 1e9),
                    draining: s.is_some_and(|s| s.draining),
                });
            }
            processes.sort_by_key(|p| p.pid);
            let users = self.levels(&processes, &units);
            let ls = g
                .index
                .filter(|_| g.mig.is_none())
                .and_then(|i| leases.iter().find(|l| l.index == i));
            // An instance in use is committed whole to its job.
            let in_use = g.mig.is_some()
                && mig_status.iter().any(|m| {
                    m.instances.iter().any(|i| {
                        i.uuid.as_deref() == Some(g.uuid_str.as_str())
                            && matches!(i.use_, Use::Lease(_))
                    })
                });
            let committed_mem = match g.mig {
                Some(_) if in_use => g.total_mem,
                Some(_) => 0,
                None => ls.map_or(0, |l| l.committed_mem),
            };
            let outside = self.outside(gi, &managed).unwrap_or_default();
            let driver = self.driver_mem(gi);
            // The shims' processes outside any lease hold memory no lease
            // committed: what is allocated counts where it is more.
            let allocated: u64 = processes.iter().map(|p| p.mem_used).sum();
            let free_mem = g
                .total_mem
                .saturating_sub(committed_mem.max(allocated))
                .saturating_sub(outside.mem)
                .min(driver.map_or(u64::MAX, |d| d.free));
            gpus.push(GpuStatus {
                index: g.index,
                mode: if g.mig.is_some() {
                    "mig-instance"
                } else if self.cfg.mps_pipe.is_some() {
                    "mps"
                } else {
                    "time-slicing"
                }
                .into(),
                uuid: g.uuid_str.clone(),
                name: g.name.clone(),
                total_mem: g.total_mem,
                slots_total: match g.mig {
                    Some(_) => 1,
                    None => ls.map_or(self.cfg.queue.overprovision.max(1), |l| l.slots_total),
                },
                slots_used: match g.mig {
                    Some(_) => u32::from(in_use),
                    None => ls.map_or(0, |l| l.slots_used),
                },
                committed_mem,
                utilization: match g.mig {
                    Some(_) => None,
                    None => self.world.telemetry().utilization(&g.uuid_str),
                },
                holder: g
                    .sched
                    .holder()
                    .and_then(|h| self.conns.get(&h))
                    .map(|c| c.peer.pid),
                processes,
                users,
                driver,
                unmanaged: outside.listed,
                unmanaged_processes: outside.count,
                unmanaged_mem: outside.mem,
                free_mem,
                health: self.health(gi),
                mig: None,
                mig_instance: g.mig.map(|(_, gi)| gi),
            });
        }
        for m in &mig_status {
            gpus.push(self.mig_gpu_status(now, m));
        }
        // GPUs by index (unknown ones last), each MIG GPU followed by its
        // instances; the sort is stable, so nothing else moves.
        gpus.sort_by_key(|g| {
            (
                g.index.is_none(),
                g.index,
                g.mig_instance.is_some(),
                g.mig_instance,
            )
        });
        let queue = if entries {
            self.queue_entries(now)
        } else {
            Vec::new()
        };
        let leases = self
            .ledger
            .jobs()
            .iter()
            .filter(|(_, j)| !matches!(j.phase, Phase::Queued { .. }))
            .map(|(t, j)| LeaseEntry {
                pid: j.pid,
                uid: j.uid,
                pod: j.pod.clone(),
                command: j.label.clone(),
                gpus: self
                    .ledger
                    .queue()
                    .lease(*t)
                    .map_or_else(Vec::new, |l| l.gpus.clone()),
                mem_cap: j.mem_cap,
                held_s: self
                    .ledger
                    .jobs()
                    .leased_at(t)
                    .map_or(0.0, |at| now.saturating_sub(at) as f64 / 1e9),
                compute: j.compute,
                limit: j.limit,
                connected: self
                    .ledger
                    .jobs()
                    .run(t)
                    .is_some_and(|c| self.conns.contains_key(&c)),
            })
            .collect();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            socket: self.cfg.socket.clone(),
            timeslice_ms: self.cfg.sched.timeslice as f64 / 1e6,
            inflight_us: self.cfg.sched.bound as f64 / 1e3,
            overprovision: self.cfg.queue.overprovision.max(1),
            gpus,
            queue,
            leases,
            next: None,
            truncated: false,
            mps: self.world.mps().cloned(),
            recovery: (!self.ledger.placing(now)).then(|| self.ledger.recovering_text(now)),
            history: None,
        }
    }

    /// Each waiting request in queue order, with why it waits.
    fn queue_entries(&self, now: Nanos) -> Vec<QueueEntry> {
        let mut why: HashMap<u64, Why> = self.ledger.queue().why(now).into_iter().collect();
        self.ledger
            .queue()
            .waiting(now)
            .into_iter()
            .map(|w| {
                let job = self.ledger.jobs().get(&w.id);
                let why = why.remove(&w.id).unwrap_or_default();
                QueueEntry {
                    position: w.position as u32,
                    pid: job.map_or(0, |j| j.pid),
                    pod: job.and_then(|j| j.pod.clone()),
                    uid: job.map_or(0, |j| j.uid),
                    command: w.label.clone(),
                    wants: w.want.words(),
                    want_gpus: match w.want {
                        Want::Gpus(n) => Some(n),
                        Want::Memory(_) => None,
                    },
                    want_mem: match w.want {
                        Want::Memory(b) => Some(b),
                        Want::Gpus(_) => None,
                    },
                    waiting_s: w.waited as f64 / 1e9,
                    escalated: w.escalated,
                    reason: if self.ledger.placing(now) {
                        why.reason
                    } else {
                        "recovering".into()
                    },
                    why: if self.ledger.placing(now) {
                        why.text
                    } else {
                        format!("{}; {}", self.ledger.recovering_text(now), why.text)
                    },
                    waits_for: why.gpus,
                }
            })
            .collect()
    }

    /// The levels of fairness over one GPU's processes: per user (the
    /// scheduler's: a job's processes are its user's), per job.
    fn levels(&self, processes: &[ProcStatus], units: &HashMap<u32, Unit>) -> Vec<UserShare> {
        let mut users: BTreeMap<u32, UserShare> = BTreeMap::new();
        for p in processes {
            let Some(unit) = units.get(&p.pid) else {
                continue;
            };
            let job = unit.job.and_then(|t| self.ledger.jobs().get(&t));
            let (uid, weight) = (unit.uid, unit.weight);
            let u = users.entry(uid).or_insert_with(|| UserShare {
                uid,
                weight,
                ..UserShare::default()
            });
            u.weight = u.weight.max(weight);
            u.share_target += p.share_target;
            u.share_achieved += p.share_achieved;
            u.gpu_time_s += p.gpu_time_s;
            u.entitled_s += p.entitled_s;
            u.held_back_s += p.held_back_s;
            let own = unit.own;
            let pid = job.map(|j| j.pid);
            let at = match u.jobs.iter().position(|j| j.job == pid) {
                Some(i) => i,
                None => {
                    u.jobs.push(JobShare {
                        job: pid,
                        pod: job.and_then(|j| j.pod.clone()),
                        weight: job.and_then(|j| j.compute).unwrap_or(0.0),
                        ..JobShare::default()
                    });
                    u.jobs.len() - 1
                }
            };
            let j = &mut u.jobs[at];
            if job.and_then(|j| j.compute).is_none() {
                j.weight = j.weight.max(own);
            }
            j.share_target += p.share_target;
            j.share_achieved += p.share_achieved;
            j.gpu_time_s += p.gpu_time_s;
            j.entitled_s += p.entitled_s;
            j.held_back_s += p.held_back_s;
            j.processes += 1;
        }
        let mut users: Vec<UserShare> = users.into_values().collect();
        for u in &mut users {
            // Meters overlap while work drains beside a holder's.
            u.share_achieved = u.share_achieved.min(1.0);
            u.jobs.sort_by_key(|j| j.job);
            for j in &mut u.jobs {
                j.share_achieved = j.share_achieved.min(1.0);
            }
        }
        users
    }

    /// A GPU in MIG mode: its instances, who holds them, since when idle.
    fn mig_gpu_status(&self, now: Nanos, m: &mig::GpuStatus) -> GpuStatus {
        let instances = m
            .instances
            .iter()
            .map(|i| {
                let (state, job, idle_s) = match i.use_ {
                    Use::Lease(_) if i.gi.is_none() => ("creating", None, None),
                    Use::Lease(id) => ("in-use", self.ledger.jobs().get(&id).map(|j| j.pid), None),
                    Use::Idle { since } => {
                        ("idle", None, Some(now.saturating_sub(since) as f64 / 1e9))
                    }
                    Use::Foreign => ("foreign", None, None),
                };
                MigInstance {
                    gi: i.gi,
                    profile: i.profile.clone(),
                    placement: i.placement.to_string(),
                    mem: i.mem,
                    uuid: i.uuid.clone(),
                    state: state.into(),
                    job,
                    idle_s,
                }
            })
            .collect();
        GpuStatus {
            index: Some(m.gpu.index),
            mode: "mig".into(),
            uuid: m.gpu.uuid.clone(),
            name: m.gpu.name.clone(),
            total_mem: m.gpu.total_mem,
            slots_total: 0,
            slots_used: 0,
            committed_mem: self.ledger.queue().mig().committed(m.gpu.index),
            free_mem: m
                .gpu
                .total_mem
                .saturating_sub(self.ledger.queue().mig().committed(m.gpu.index)),
            // NVML does not report utilisation in MIG mode.
            utilization: None,
            holder: None,
            processes: Vec::new(),
            users: Vec::new(),
            mig: Some(MigStatus {
                instances,
                created: m.created,
                destroyed: m.destroyed,
                failures: m.failures,
            }),
            mig_instance: None,
            ..Default::default()
        }
    }

    /// One page of status: every GPU, queue entry and lease, and processes
    /// from the `from`-th (in GPU, then pid order) on, at most
    /// `STATUS_PAGE`; `next` says where the following page starts. Each
    /// page fits a frame whatever the node holds.
    pub fn status_json(&self, now: Nanos, from: usize) -> String {
        let mut st = self.status(now);
        if from == 0 {
            st.history = Some(self.history_within(now, HISTORY_ROOM));
        }
        let mut seen = 0usize;
        let mut next = None;
        // Room for processes once the rest is written.
        let mut room = (wire::MAX_STATUS_JSON / 2).saturating_sub(
            serde_json::to_string(&st.history).map_or(0, |j| j.len())
                + serde_json::to_string(&st.queue).map_or(0, |j| j.len())
                + serde_json::to_string(&st.leases).map_or(0, |j| j.len())
                + st.gpus
                    .iter()
                    .map(|g| serde_json::to_string(&g.users).map_or(0, |j| j.len()))
                    .sum::<usize>(),
        );
        let mut taken = 0;
        for g in &mut st.gpus {
            let procs = std::mem::take(&mut g.processes);
            for p in procs {
                if seen >= from && next.is_none() {
                    let size = serde_json::to_string(&p).map_or(0, |j| j.len()) + 1;
                    // At least one per page, so paging always advances.
                    if taken < STATUS_PAGE && (size <= room || taken == 0) {
                        room = room.saturating_sub(size);
                        taken += 1;
                        g.processes.push(p);
                    } else {
                        next = Some(seen as u32);
                    }
                }
                seen += 1;
            }
        }
        st.next = next;
        // Lists other than processes are bounded by the per-user budgets;
        // cut them too if a page would still not fit.
        let mut json = serde_json::to_string(&st).unwrap_or_default();
        while json.len() > wire::MAX_STATUS_JSON - 64
            && (!st.queue.is_empty() || !st.leases.is_empty())
        {
            let q = st.queue.len() / 2;
            st.queue.truncate(q);
            let l = st.leases.len() / 2;
            st.leases.truncate(l);
            st.truncated = true;
            json = serde_json::to_string(&st).unwrap_or_default();
        }
        json
    }
}

impl Broker {
    /// The ring of recent samples, with as many of the newest samples as
    /// fit in `room` bytes of JSON.
    fn history_within(&self, now: Nanos, room: usize) -> crate::status::History {
        let mut samples = self.history.len();
        loop {
            let h = self.history.view(now, samples);
            if samples <= 1 || serde_json::to_string(&h).map_or(0, |j| j.len()) <= room {
                return h;
            }
            samples /= 2;
        }
    }
}
