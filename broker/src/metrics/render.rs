//! Every metric family the broker exports, made from a snapshot (the
//! status and the core's counters) and what the tally kept of earlier
//! ones. docs/metrics.md lists them; a test checks the list against what
//! a broker serves.

use std::collections::{BTreeMap, HashMap};

use gpufrac_common::config::Priority;

use super::tally::{JobKey, Tally, Totals, owner};
use super::text::{Family, Kind, Labels};
use crate::stats::{Histogram, OTHER_UID, Refusal, Stats};
use crate::status::{GpuStatus, ProcStatus, Status};

/// What the event loop hands the metrics room, at most twice a second.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Monotonic nanoseconds, when it was taken.
    pub at: u64,
    /// The same moment in Unix seconds (`wall_at`): start times are this
    /// less a status's "for how long".
    pub wall: f64,
    pub status: Status,
    pub stats: Stats,
}

/// A process's states, as status names them.
const STATES: [&str; 5] = ["holding", "waiting", "idle", "revoking", "hung"];
/// A MIG instance's states.
const MIG_STATES: [&str; 4] = ["in-use", "idle", "creating", "foreign"];

fn gpu(g: &GpuStatus) -> Labels {
    vec![
        ("gpu", g.index.map_or_else(String::new, |i| i.to_string())),
        ("uuid", g.uuid.clone()),
    ]
}

fn with(mut l: Labels, more: &[(&'static str, String)]) -> Labels {
    l.extend_from_slice(more);
    l
}

/// A family of one sample per GPU (MIG GPUs, whose instances are GPUs of
/// their own, left out where `devices_only`).
fn per_gpu(
    s: &Status,
    name: &'static str,
    help: &'static str,
    devices_only: bool,
    v: impl Fn(&GpuStatus) -> Option<f64>,
) -> Family {
    let mut f = Family::new(name, Kind::Gauge, help);
    for g in s.gpus.iter().filter(|g| !devices_only || g.mig.is_none()) {
        if let Some(x) = v(g) {
            f.add(gpu(g), x);
        }
    }
    f
}

pub fn families(snap: &Snapshot, t: &Tally) -> Vec<Family> {
    let s = &snap.status;
    let mut out = vec![build_info()];
    out.extend(gpus(s));
    out.extend(users(s, t));
    out.extend(jobs(s, t, snap.wall));
    out.extend(processes(s, t));
    out.extend(queue(s, &snap.stats, t, snap.wall));
    out.extend(mps_mig(s, snap.wall));
    out
}

/// When something began that status says has lasted `for_s` at `wall`,
/// in Unix seconds to the millisecond: the same figure at every scrape,
/// where the float arithmetic would otherwise make it wobble.
fn since(wall: f64, for_s: f64) -> f64 {
    ((wall - for_s) * 1000.0).round() / 1000.0
}

/// A command as a label: its program's name without its directory, only
/// letters, digits and `._+-@:` (anything else, control and format
/// characters among them, becomes `_`), at most 32 characters. A whole
/// command line is unbounded and may carry arguments nobody should
/// scrape (tokens in URLs).
pub fn program_name(command: &str) -> String {
    let first = command.split_whitespace().next().unwrap_or("");
    let base = first.rsplit('/').next().unwrap_or(first);
    let name: String = base
        .chars()
        .take(32)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._+-@:".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() { "-".into() } else { name }
}

fn build_info() -> Family {
    let mut f = Family::new(
        "gpufrac_build_info",
        Kind::Gauge,
        "The broker's version (always 1).",
    );
    f.add(vec![("version", env!("CARGO_PKG_VERSION").into())], 1.0);
    f
}

fn gpus(s: &Status) -> Vec<Family> {
    let mut info = Family::new(
        "gpufrac_gpu_info",
        Kind::Gauge,
        "A GPU or MIG instance the broker arbitrates (always 1): its name and how it is \
         shared (time-slicing, mps, mig for a GPU in MIG mode, mig-instance).",
    );
    for g in &s.gpus {
        info.add(
            with(
                gpu(g),
                &[("name", g.name.clone()), ("mode", g.mode.clone())],
            ),
            1.0,
        );
    }
    let mut states = Family::new(
        "gpufrac_gpu_processes",
        Kind::Gauge,
        "Processes registered on the GPU, by state (holding the compute timeslice, waiting \
         for it, idle, revoking, hung).",
    );
    let mut waiting = Family::new(
        "gpufrac_gpu_waiting_processes",
        Kind::Gauge,
        "Processes waiting for the GPU's compute timeslice, by priority class: the compute \
         queue's length.",
    );
    for g in s.gpus.iter().filter(|g| g.mig.is_none()) {
        for st in STATES {
            let n = g.processes.iter().filter(|p| p.state == st).count();
            states.add(with(gpu(g), &[("state", st.into())]), n as f64);
        }
        for class in Priority::ALL {
            let n = g
                .processes
                .iter()
                .filter(|p| p.state == "waiting" && p.priority == class.as_str())
                .count();
            waiting.add(with(gpu(g), &[("class", class.as_str().into())]), n as f64);
        }
    }
    vec![
        info,
        per_gpu(
            s,
            "gpufrac_gpu_memory_total_bytes",
            "Memory of the GPU or MIG instance.",
            false,
            |g| Some(g.total_mem as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_committed_bytes",
            "Memory promised to leases of gpufrac run on the GPU.",
            false,
            |g| Some(g.committed_mem as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_used_bytes",
            "Memory the shims of the GPU's processes hold, as they charge it to their caps.",
            true,
            |g| Some(g.processes.iter().map(|p| p.mem_used as f64).sum()),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_free_bytes",
            "Memory a new lease could still have on the GPU: its total less what is \
             committed to leases and what processes outside gpufrac hold, and never more \
             than the driver says is free.",
            false,
            |g| Some(g.free_mem as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_driver_used_bytes",
            "Memory the driver (NVML) says is used on the GPU: every process's, the shim's \
             or not, and the driver's own.",
            true,
            |g| g.driver.map(|d| d.used as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_driver_free_bytes",
            "Memory the driver (NVML) says is free on the GPU.",
            true,
            |g| g.driver.map(|d| d.free as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_memory_unmanaged_bytes",
            "Memory the driver says processes outside gpufrac (not under the shim) hold on \
             the GPU: no cap, no lease; placement counts it as taken.",
            true,
            |g| Some(g.unmanaged_mem as f64),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_processes_unmanaged",
            "Processes the driver lists on the GPU that are not under the shim.",
            true,
            |g| Some(f64::from(g.unmanaged_processes)),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_utilization_ratio",
            "Time the GPU was busy over NVML's last sample period (0 to 1), where NVML \
             reports it.",
            true,
            |g| g.utilization.map(|u| f64::from(u) / 100.0),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_temperature_celsius",
            "The GPU's temperature (NVML), where the driver reports it.",
            true,
            |g| g.health?.temperature_c.map(f64::from),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_power_usage_watts",
            "What the GPU draws now (NVML), where the driver reports it.",
            true,
            |g| g.health?.power_w,
        ),
        per_gpu(
            s,
            "gpufrac_gpu_power_limit_watts",
            "The most the GPU may draw (NVML's enforced power limit).",
            true,
            |g| g.health?.power_limit_w,
        ),
        per_gpu(
            s,
            "gpufrac_gpu_sm_clock_hertz",
            "The GPU's SM clock now (NVML).",
            true,
            |g| g.health?.sm_clock_mhz.map(|m| f64::from(m) * 1e6),
        ),
        xid_errors(s),
        per_gpu(
            s,
            "gpufrac_gpu_last_xid",
            "The XID of the GPU's last XID event since the broker started (0: none).",
            true,
            |g| g.health.map(|h| h.last_xid.unwrap_or(0) as f64),
        ),
        ecc(s),
        per_gpu(
            s,
            "gpufrac_gpu_requests_waiting",
            "Requests of gpufrac run waiting in the queue that the GPU could serve once its \
             leases end, or that it is held back for (their waits_for).",
            true,
            |g| {
                let n = g.index.map_or(0, |i| {
                    s.queue.iter().filter(|q| q.waits_for.contains(&i)).count()
                });
                Some(n as f64)
            },
        ),
        per_gpu(
            s,
            "gpufrac_gpu_slots",
            "Leases of --gpus 1 the GPU holds at once (--overprovision).",
            true,
            |g| Some(f64::from(g.slots_total)),
        ),
        per_gpu(
            s,
            "gpufrac_gpu_slots_used",
            "Slots of the GPU held by leases.",
            true,
            |g| Some(f64::from(g.slots_used)),
        ),
        states,
        waiting,
    ]
}

/// ECC errors since the driver loaded, corrected and not, where the GPU
/// counts them.
/// A counter, where `per_gpu` makes gauges.
fn xid_errors(s: &Status) -> Family {
    let mut f = Family::new(
        "gpufrac_gpu_xid_errors_total",
        Kind::Counter,
        "XID events (the driver's critical errors: a GPU fallen off the bus, a page \
         fault, an uncorrectable ECC error) on the GPU since the broker started.",
    );
    for g in s.gpus.iter().filter(|g| g.mig.is_none()) {
        if let Some(h) = g.health {
            f.add(gpu(g), h.xid_errors as f64);
        }
    }
    f
}

fn ecc(s: &Status) -> Family {
    let mut f = Family::new(
        "gpufrac_gpu_ecc_errors_total",
        Kind::Counter,
        "ECC errors of the GPU's memory since the driver loaded (NVML's volatile counts), \
         corrected and uncorrected, where ECC is on.",
    );
    for g in s.gpus.iter().filter(|g| g.mig.is_none()) {
        let Some(h) = g.health else {
            continue;
        };
        for (kind, n) in [
            ("corrected", h.ecc_corrected),
            ("uncorrected", h.ecc_uncorrected),
        ] {
            if let Some(n) = n {
                f.add(with(gpu(g), &[("type", kind.into())]), n as f64);
            }
        }
    }
    f
}

/// The families of a level of fairness, users or jobs: its share of the
/// GPU (target and achieved), its GPU time, the memory its processes hold
/// and the allocations refused them.
struct Level {
    target: Family,
    achieved: Family,
    seconds: Family,
    entitled: Family,
    held_back: Family,
    used: Family,
    refusals: Family,
}

impl Level {
    /// `level`: `user` or `job`; `whose`: "a user's"; `note`: said of its
    /// target.
    fn new(level: &str, whose: &str, note: &str) -> Level {
        let f = |what: &str, kind, help: String| {
            Family::new(format!("gpufrac_{level}_{what}"), kind, help)
        };
        Level {
            target: f(
                "share_target_ratio",
                Kind::Gauge,
                format!(
                    "The part of the GPU {whose} processes get together while they are busy \
                     and the GPU contended (0 to 1){note}."
                ),
            ),
            achieved: f(
                "share_achieved_ratio",
                Kind::Gauge,
                format!(
                    "The part of the GPU {whose} processes held over the last window (0 to 1)."
                ),
            ),
            seconds: f(
                "gpu_seconds_total",
                Kind::Counter,
                format!("GPU time charged to {whose} processes, those gone included, seconds."),
            ),
            entitled: f(
                "entitled_seconds_total",
                Kind::Counter,
                format!(
                    "GPU time {whose} processes were owed, those gone included, seconds: \
                     their target share over the time they were busy and their ceilings let \
                     them be granted (net of what a higher class was owed). Its rate less \
                     the rate of gpu_seconds_total is what they were short of their share."
                ),
            ),
            held_back: f(
                "held_back_seconds_total",
                Kind::Counter,
                format!(
                    "Time {whose} processes were busy but held back by their ceilings (a \
                     process's GPU_COMPUTE_LIMIT, a job's --gpu-limit, the high class's \
                     share), summed over processes, those gone included, seconds."
                ),
            ),
            used: f(
                "memory_used_bytes",
                Kind::Gauge,
                format!("Memory {whose} processes hold on the GPU, as their shims charge it."),
            ),
            refusals: f(
                "memory_refusals_total",
                Kind::Counter,
                format!(
                    "Allocations the memory caps refused to {whose} processes, those gone included."
                ),
            ),
        }
    }

    fn share(&mut self, l: Labels, target: f64, achieved: f64, t: Totals) {
        self.target.add(l.clone(), target);
        self.achieved.add(l.clone(), achieved);
        self.seconds.add(l.clone(), t.gpu_s);
        self.entitled.add(l.clone(), t.entitled_s);
        self.held_back.add(l, t.held_back_s);
    }

    fn process(&mut self, l: Labels, p: &ProcStatus) {
        self.used.add(l.clone(), p.mem_used as f64);
        self.refusals.add(l, p.ooms as f64);
    }

    fn gone(&mut self, l: Labels, t: Totals) {
        self.seconds.add(l.clone(), t.gpu_s);
        self.entitled.add(l.clone(), t.entitled_s);
        self.held_back.add(l.clone(), t.held_back_s);
        self.refusals.add(l, t.refusals as f64);
    }

    fn families(self) -> [Family; 7] {
        [
            self.target,
            self.achieved,
            self.seconds,
            self.entitled,
            self.held_back,
            self.used,
            self.refusals,
        ]
    }
}

fn users(s: &Status, t: &Tally) -> Vec<Family> {
    let mut level = Level::new("user", "a user's", "");
    for g in &s.gpus {
        for u in &g.users {
            let l = with(gpu(g), &[("user", t.user(u.uid))]);
            let t = Totals {
                gpu_s: u.gpu_time_s,
                entitled_s: u.entitled_s,
                held_back_s: u.held_back_s,
                refusals: 0,
            };
            level.share(l, u.share_target, u.share_achieved, t);
        }
        for p in &g.processes {
            level.process(with(gpu(g), &[("user", t.user(owner(g, p)))]), p);
        }
    }
    let by_uuid: HashMap<&str, &GpuStatus> = s.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    for (uuid, user, gone) in t.gone_users() {
        if let Some(g) = by_uuid.get(uuid) {
            level.gone(with(gpu(g), &[("user", user)]), gone);
        }
    }
    level.families().into()
}

fn jobs(s: &Status, t: &Tally, wall: f64) -> Vec<Family> {
    let mut info = Family::new(
        "gpufrac_job_info",
        Kind::Gauge,
        "A job (a lease of gpufrac run or a pod's) and the name of its program (always 1): \
         the command's first word without its directory, letters, digits and ._+-@: only, \
         at most 32 characters.",
    );
    let mut cap = Family::new(
        "gpufrac_job_memory_cap_bytes",
        Kind::Gauge,
        "The memory cap of a job started with --gpu-memory, shared by all its processes.",
    );
    let mut held = Family::new(
        "gpufrac_job_start_time_seconds",
        Kind::Gauge,
        "When a job's lease was granted, seconds since the epoch (time() less it: how \
         long it has held it).",
    );
    for l in &s.leases {
        let job = JobKey::of(Some(l.pid), l.pod.as_deref());
        let labels: Labels = vec![("user", t.user(l.uid)), ("job_id", t.job(l.uid, &job))];
        info.add(
            with(labels.clone(), &[("name", program_name(&l.command))]),
            1.0,
        );
        if let Some(c) = l.mem_cap {
            cap.add(labels.clone(), c as f64);
        }
        held.add(labels, since(wall, l.held_s));
    }
    let mut level = Level::new(
        "job",
        "a job's",
        "; job_id \"none\" is a user's processes outside any job",
    );
    for g in &s.gpus {
        for u in &g.users {
            for j in &u.jobs {
                let job = t.job(u.uid, &JobKey::of(j.job, j.pod.as_deref()));
                let l = with(gpu(g), &[("user", t.user(u.uid)), ("job_id", job)]);
                let t = Totals {
                    gpu_s: j.gpu_time_s,
                    entitled_s: j.entitled_s,
                    held_back_s: j.held_back_s,
                    refusals: 0,
                };
                level.share(l, j.share_target, j.share_achieved, t);
            }
        }
        for p in &g.processes {
            let uid = owner(g, p);
            let job = t.job(uid, &JobKey::of(p.job, p.pod.as_deref()));
            level.process(with(gpu(g), &[("user", t.user(uid)), ("job_id", job)]), p);
        }
    }
    let by_uuid: HashMap<&str, &GpuStatus> = s.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    for (uuid, user, job, gone) in t.gone_jobs() {
        if let Some(g) = by_uuid.get(uuid) {
            level.gone(with(gpu(g), &[("user", user), ("job_id", job)]), gone);
        }
    }
    let mut out = vec![info, cap, held];
    out.extend(level.families());
    out
}

fn processes(s: &Status, t: &Tally) -> Vec<Family> {
    let mut fams = [
        (
            "gpufrac_process_memory_used_bytes",
            Kind::Gauge,
            "Memory the process holds on the GPU, as its shim charges it to its cap.",
        ),
        (
            "gpufrac_process_memory_peak_bytes",
            Kind::Gauge,
            "The most memory the process has held on the GPU.",
        ),
        (
            "gpufrac_process_memory_cap_bytes",
            Kind::Gauge,
            "The process's memory cap on the GPU (GPU_MEM_LIMIT, or its job's), where it has one.",
        ),
        (
            "gpufrac_process_driver_memory_bytes",
            Kind::Gauge,
            "Memory the driver reports for the process (NVML: its allocations and the \
             driver's own context and modules), where NVML reports it.",
        ),
        (
            "gpufrac_process_memory_refusals_total",
            Kind::Counter,
            "Allocations the process's memory cap refused.",
        ),
        (
            "gpufrac_process_share_target_ratio",
            Kind::Gauge,
            "The part of the GPU the process gets while it is busy and the GPU contended (0 to 1).",
        ),
        (
            "gpufrac_process_share_achieved_ratio",
            Kind::Gauge,
            "The part of the GPU the process held over the last window (0 to 1).",
        ),
        (
            "gpufrac_process_gpu_seconds_total",
            Kind::Counter,
            "GPU time charged to the process (split evenly while work of several shared the \
             GPU), seconds.",
        ),
        (
            "gpufrac_process_mps_thread_ratio",
            Kind::Gauge,
            "Under --mps, the part of the GPU's SMs the process may use \
             (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE from its job's --gpu-compute, 0 to 1).",
        ),
    ]
    .map(|(n, k, h)| Family::new(n, k, h));
    let mut unlisted = Family::new(
        "gpufrac_processes_unlisted",
        Kind::Gauge,
        "Processes on the GPU past the bound of per-process series: counted in their \
         user's and job's series only.",
    );
    for g in s.gpus.iter().filter(|g| g.mig.is_none()) {
        let mut left_out = 0;
        for p in &g.processes {
            if !t.listed(&g.uuid, p.pid) {
                left_out += 1;
                continue;
            }
            let uid = owner(g, p);
            let l = with(
                gpu(g),
                &[
                    ("pid", p.pid.to_string()),
                    ("user", t.user(uid)),
                    ("job_id", t.job(uid, &JobKey::of(p.job, p.pod.as_deref()))),
                    ("class", p.priority.clone()),
                ],
            );
            let values = [
                Some(p.mem_used as f64),
                Some(p.mem_peak as f64),
                p.mem_cap.map(|c| c as f64),
                p.driver_mem.map(|m| m as f64),
                Some(p.ooms as f64),
                Some(p.share_target),
                Some(p.share_achieved),
                Some(p.gpu_time_s),
                p.sm_percent.map(|pct| pct / 100.0),
            ];
            for (f, v) in fams.iter_mut().zip(values) {
                if let Some(v) = v {
                    f.add(l.clone(), v);
                }
            }
        }
        unlisted.add(gpu(g), f64::from(left_out));
    }
    let mut out: Vec<Family> = fams.into();
    out.push(unlisted);
    out
}

fn queue(s: &Status, stats: &Stats, t: &Tally, wall: f64) -> Vec<Family> {
    let mut requests = Family::new(
        "gpufrac_queue_requests",
        Kind::Gauge,
        "Requests of gpufrac run waiting in the queue for GPUs or memory, by the job's \
         user, whether escalated (waiting longer than --escalate-after, placed ahead of \
         younger ones) and why they wait (fits_now, held_for_earlier, no_room, \
         recovering).",
    );
    let mut oldest = Family::new(
        "gpufrac_queue_oldest_request_start_time_seconds",
        Kind::Gauge,
        "When the request of the user that has waited longest was queued, seconds since \
         the epoch (time() less it: how long it has waited so far).",
    );
    let mut first: BTreeMap<String, f64> = BTreeMap::new();
    for q in &s.queue {
        let user = t.user(q.uid);
        let reason = if q.reason.is_empty() {
            "no_room".to_owned()
        } else {
            q.reason.clone()
        };
        requests.add(
            vec![
                ("escalated", q.escalated.to_string()),
                ("user", user.clone()),
                ("reason", reason),
            ],
            1.0,
        );
        let at = since(wall, q.waiting_s);
        first
            .entry(user)
            .and_modify(|f| *f = f.min(at))
            .or_insert(at);
    }
    for (user, at) in first {
        oldest.add(vec![("user", user)], at);
    }
    let mut wait = Family::new(
        "gpufrac_queue_wait_seconds",
        Kind::Histogram,
        "How long queued requests waited for their lease (those placed since the broker \
         started), by the job's user.",
    );
    let mut by_user: BTreeMap<String, Histogram> = BTreeMap::new();
    for (&uid, h) in &stats.queue_wait {
        let user = if uid == OTHER_UID {
            "other".into()
        } else {
            t.user(uid)
        };
        match by_user.get_mut(&user) {
            Some(sum) => sum.merge(h),
            None => {
                by_user.insert(user, h.clone());
            }
        }
    }
    for (user, h) in by_user {
        wait.histogram(vec![("user", user)], &h);
    }
    let mut leases = Family::new(
        "gpufrac_leases",
        Kind::Gauge,
        "Leases held: jobs of gpufrac run placed or without placement, and pods' leases.",
    );
    leases.add(vec![], s.leases.len() as f64);
    let mut grant = Family::new(
        "gpufrac_grant_latency_seconds",
        Kind::Histogram,
        "How long a process that asked for the GPU's compute timeslice (Acquire) waited \
         for it (Grant), by priority class.",
    );
    for class in Priority::ALL {
        grant.histogram(
            vec![("class", class.as_str().into())],
            &stats.grant_latency[class.index()],
        );
    }
    let mut refusals = Family::new(
        "gpufrac_refusals_total",
        Kind::Counter,
        "Requests the broker refused, by user and reason (connection_limit, lease_limit, \
         not_allowed, unknown_gpu, no_room, unsatisfiable, other).",
    );
    for (&uid, counts) in &stats.refusals {
        let user = if uid == OTHER_UID {
            "other".into()
        } else {
            t.user(uid)
        };
        for (r, &n) in Refusal::ALL.iter().zip(counts) {
            if n > 0 {
                refusals.add(
                    vec![("reason", r.as_str().into()), ("user", user.clone())],
                    n as f64,
                );
            }
        }
    }
    let mut recovering = Family::new(
        "gpufrac_recovering",
        Kind::Gauge,
        "1 while new placements are held after a state file that could not be trusted, \
         so that running jobs claim their leases back first.",
    );
    recovering.add(vec![], if s.recovery.is_some() { 1.0 } else { 0.0 });
    vec![requests, oldest, wait, leases, grant, refusals, recovering]
}

fn mps_mig(s: &Status, wall: f64) -> Vec<Family> {
    let mut out = Vec::new();
    if let Some(m) = &s.mps {
        let mut up = Family::new(
            "gpufrac_mps_up",
            Kind::Gauge,
            "The MPS control daemon the broker runs (--mps) is up (1) or not (0).",
        );
        up.add(vec![], if m.state == "running" { 1.0 } else { 0.0 });
        let mut restarts = Family::new(
            "gpufrac_mps_restarts_total",
            Kind::Counter,
            "Times the broker started the MPS control daemon again after it stopped.",
        );
        restarts.add(vec![], f64::from(m.restarts));
        out.extend([up, restarts]);
    }
    if !s.gpus.iter().any(|g| g.mig.is_some()) {
        return out;
    }
    let mut info = Family::new(
        "gpufrac_mig_instance_info",
        Kind::Gauge,
        "A MIG instance on a GPU under --mig dynamic (always 1): its profile, placement \
         (start:size in memory slices), state and the job holding it.",
    );
    let mut idle = Family::new(
        "gpufrac_mig_instance_idle_start_time_seconds",
        Kind::Gauge,
        "When an idle MIG instance's last job ended, seconds since the epoch (time() less \
         it: how long it has had no job).",
    );
    let mut states = Family::new(
        "gpufrac_mig_instances",
        Kind::Gauge,
        "MIG instances on the GPU, by state (in-use, idle, creating, foreign: made by hand).",
    );
    let counters = [
        (
            "gpufrac_mig_instances_created_total",
            "MIG instances this broker created.",
        ),
        (
            "gpufrac_mig_instances_destroyed_total",
            "Idle MIG instances this broker destroyed to make room.",
        ),
        (
            "gpufrac_mig_failures_total",
            "MIG instances that could not be made or destroyed.",
        ),
    ];
    let mut counts: Vec<Family> = counters
        .iter()
        .map(|&(n, h)| Family::new(n, Kind::Counter, h))
        .collect();
    for g in s.gpus.iter() {
        let Some(m) = &g.mig else {
            continue;
        };
        for i in &m.instances {
            let mig = i.uuid.clone().unwrap_or_default();
            info.add(
                with(
                    gpu(g),
                    &[
                        ("mig_uuid", mig.clone()),
                        ("gi", i.gi.map_or_else(String::new, |v| v.to_string())),
                        ("profile", i.profile.clone()),
                        ("placement", i.placement.clone()),
                        ("state", i.state.clone()),
                        (
                            "job_id",
                            i.job.map_or_else(|| "none".into(), |v| v.to_string()),
                        ),
                    ],
                ),
                1.0,
            );
            if let Some(secs) = i.idle_s {
                let l = with(gpu(g), &[("mig_uuid", mig), ("profile", i.profile.clone())]);
                idle.add(l, since(wall, secs));
            }
        }
        for st in MIG_STATES {
            let n = m.instances.iter().filter(|i| i.state == st).count();
            states.add(with(gpu(g), &[("state", st.into())]), n as f64);
        }
        for (f, v) in counts.iter_mut().zip([m.created, m.destroyed, m.failures]) {
            f.add(gpu(g), v as f64);
        }
    }
    out.extend([info, idle, states]);
    out.extend(counts);
    out
}
