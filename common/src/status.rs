//! The status document the broker serves in `StatusReply` (`gpufrac status
//! --json` prints it as is; the table view and `gpufrac top` render it).
//! Field names are part of the contract. Built with the `status` feature:
//! the broker and the CLI use it, the shim does not.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Status {
    pub version: String,
    pub socket: String,
    pub timeslice_ms: f64,
    /// Most unfinished work a holder may keep queued while others share its
    /// GPU, µs (0: unbounded).
    #[serde(default)]
    pub inflight_us: f64,
    pub overprovision: u32,
    pub gpus: Vec<GpuStatus>,
    pub queue: Vec<QueueEntry>,
    pub leases: Vec<LeaseEntry>,
    /// Processes are paged: the next page starts at this process index
    /// (`None`: this was the last page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u32>,
    /// The queue or lease lists were cut to fit a page.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// `--mps`: the MPS control daemon the broker runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsStatus>,
    /// The broker started from a state file it could not trust and holds
    /// new placements while running jobs claim their leases back: why, and
    /// for how long more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<String>,
    /// Recent samples of the GPUs and of each user's and job's share, so
    /// that a view opened now (`gpufrac top`) has history from the start.
    /// On the first page only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<History>,
}

/// Samples of each series the broker keeps (`History::samples` at most):
/// three minutes, one a second. A view that keeps its own series beside
/// the broker's (`gpufrac top`'s per process) keeps as many.
pub const HISTORY_DEPTH: usize = 180;

/// The broker's ring of recent samples (`broker/src/history.rs`), one every
/// `every_s`, oldest first: every series has `samples` values, `null`
/// where its GPU, user or job was not there at that moment.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct History {
    pub every_s: f64,
    /// Values per series.
    pub samples: u32,
    /// Seconds from the newest sample to this status.
    pub age_s: f64,
    /// Requests waiting in the queue.
    pub queue: Vec<u32>,
    pub gpus: Vec<GpuHistory>,
    /// Each user's part of a GPU, and each of its jobs' (and its
    /// processes' outside any job).
    pub shares: Vec<ShareHistory>,
    /// Series left out to keep the ring within its bounds (per user per
    /// GPU, and in all): they have no history here.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuHistory {
    /// As in [`GpuStatus::uuid`].
    pub uuid: String,
    /// NVML utilisation, percent.
    pub utilization: Vec<Option<u32>>,
    /// What its processes had allocated through the shim, together, bytes.
    pub allocated: Vec<Option<u64>>,
    /// Memory promised to leases, bytes.
    pub committed: Vec<Option<u64>>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ShareHistory {
    /// The GPU's UUID.
    pub gpu: String,
    pub uid: u32,
    /// `user`: the user's part as a whole; `job`: one of its jobs (`job`
    /// None: its processes outside any job).
    pub level: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// As in [`UserShare`] and [`JobShare`], 0..1.
    pub target: Vec<Option<f32>>,
    pub achieved: Vec<Option<f32>>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MpsStatus {
    /// starting | running | failed | stopped
    pub state: String,
    pub pipe_dir: String,
    pub daemon_pid: Option<u32>,
    pub restarts: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuStatus {
    /// nvidia-smi index; None for a device only known from a client. A MIG
    /// instance has its GPU's.
    pub index: Option<u32>,
    /// How processes share it: "time-slicing" (the broker's timeslices) or
    /// "mps" (side by side under NVIDIA MPS); under `--mig dynamic`, "mig"
    /// for a GPU in MIG mode (its instances in `mig`) and "mig-instance"
    /// for one of its instances, a device of its own (its processes,
    /// timeslices among them, its MIG device UUID in `uuid`).
    #[serde(default = "time_slicing")]
    pub mode: String,
    pub uuid: String,
    pub name: String,
    pub total_mem: u64,
    pub slots_total: u32,
    pub slots_used: u32,
    /// Memory promised to leases of `gpufrac run`.
    pub committed_mem: u64,
    /// NVML utilisation in percent, when NVML is present.
    pub utilization: Option<u32>,
    /// pid of the process holding the compute timeslice.
    pub holder: Option<u32>,
    pub processes: Vec<ProcStatus>,
    /// The levels of fairness on this GPU: each user with processes here,
    /// and under it its jobs (and its processes outside any job), with
    /// the share each gets and used. Every page carries all of them.
    #[serde(default)]
    pub users: Vec<UserShare>,
    /// What the driver (NVML) says of the GPU's memory: every process's,
    /// the shim's or not, and the driver's own. None: not asked (no NVML,
    /// a MIG instance).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverMem>,
    /// Processes the driver lists on this GPU that are not under the shim
    /// (none of this broker's registered processes on it), most memory
    /// first, at most 32; `unmanaged_processes` counts them all and
    /// `unmanaged_mem` sums what they hold. Placement counts that memory
    /// as taken.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unmanaged: Vec<UnmanagedProc>,
    #[serde(default)]
    pub unmanaged_processes: u32,
    #[serde(default)]
    pub unmanaged_mem: u64,
    /// What a new lease could still have: total less what is committed
    /// (or allocated, where the shims' processes hold more) less what
    /// processes outside gpufrac hold, and never more than the driver
    /// says is free.
    #[serde(default)]
    pub free_mem: u64,
    /// Its health as NVML reports it (None: not asked; each figure None
    /// where the driver or the GPU has no such counter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<GpuHealth>,
    /// A GPU in MIG mode: its instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigStatus>,
    /// A MIG instance: its GPU instance id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_instance: Option<u32>,
}

/// NVML's `nvmlDeviceGetMemoryInfo`, bytes.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DriverMem {
    pub total: u64,
    pub used: u64,
    pub free: u64,
}

/// A GPU's health from NVML. What DCGM's exporter measures besides
/// (NVLink and PCIe traffic, throttle reasons, retired pages, per-engine
/// activity) is left to it.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GpuHealth {
    #[serde(default)]
    pub temperature_c: Option<u32>,
    /// What it draws now and the most it may draw, watts.
    #[serde(default)]
    pub power_w: Option<f64>,
    #[serde(default)]
    pub power_limit_w: Option<f64>,
    /// The SM clock now, MHz.
    #[serde(default)]
    pub sm_clock_mhz: Option<u32>,
    /// ECC errors since the driver loaded, corrected and not.
    #[serde(default)]
    pub ecc_corrected: Option<u64>,
    #[serde(default)]
    pub ecc_uncorrected: Option<u64>,
    /// XID events (the driver's critical errors) since the broker started,
    /// and the last one's XID.
    #[serde(default)]
    pub xid_errors: u64,
    #[serde(default)]
    pub last_xid: Option<u64>,
}

/// A process on a GPU that is not under the shim: no cap, no share, no
/// lease; only the driver knows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct UnmanagedProc {
    pub pid: u32,
    /// What the driver says it holds, bytes.
    pub mem: u64,
}

/// The instances of a GPU in MIG mode under `--mig dynamic`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MigStatus {
    pub instances: Vec<MigInstance>,
    /// Instances this broker created, idle ones it destroyed to make room,
    /// and steps that failed.
    pub created: u64,
    pub destroyed: u64,
    pub failures: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MigInstance {
    /// GPU instance id (None while being created).
    pub gi: Option<u32>,
    /// `1g.5gb`
    pub profile: String,
    /// Memory slices, `start:size` as nvidia-smi prints them.
    pub placement: String,
    pub mem: u64,
    /// The MIG device (`MIG-<uuid>`).
    pub uuid: Option<String>,
    /// in-use | idle | creating | foreign (not the broker's: a GPU instance
    /// with several compute instances, made by hand).
    pub state: String,
    /// pid of the `gpufrac run` holding it.
    pub job: Option<u32>,
    /// Seconds since it became idle.
    pub idle_s: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProcStatus {
    pub pid: u32,
    pub command: String,
    /// CUDA ordinal of this GPU inside that process.
    pub ordinal: u32,
    pub mem_used: u64,
    pub mem_peak: u64,
    pub mem_cap: Option<u64>,
    /// `--mps`: the share of the GPU's SMs this process may use
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, from its job's
    /// `--gpu-compute`), percent; None: all of them.
    #[serde(default)]
    pub sm_percent: Option<f64>,
    /// What the driver reports for this process (NVML), when available: the
    /// shim's figure plus the driver's own context and module memory.
    #[serde(default)]
    pub driver_mem: Option<u64>,
    pub ooms: u64,
    /// Share promised when contended, 0..1.
    pub share_target: f64,
    /// Share of GPU time held over the last window, 0..1.
    pub share_achieved: f64,
    /// GPU_COMPUTE_LIMIT, 0..1.
    pub limit: Option<f64>,
    /// holding | waiting | idle | revoking | hung
    pub state: String,
    /// GPU_COMPUTE_PRIORITY: high | normal | low.
    #[serde(default = "normal")]
    pub priority: String,
    /// GPU time charged to it so far, seconds: time on the GPU (holding, or
    /// its queued work still running after a release), split evenly while
    /// several processes' work shared the GPU.
    #[serde(default)]
    pub gpu_time_s: f64,
    /// GPU time it was owed so far, seconds: its target share over the
    /// time it was busy and its ceilings let it be granted. Where it is
    /// more than `gpu_time_s`, the process got less than its share.
    #[serde(default)]
    pub entitled_s: f64,
    /// Time it was busy but held back by its ceilings (its limit, its
    /// job's, the `high` class's share), seconds.
    #[serde(default)]
    pub held_back_s: f64,
    /// Released, with queued work still running on the GPU.
    #[serde(default)]
    pub draining: bool,
    /// The process's user (the unit of fairness outside a job).
    #[serde(default)]
    pub uid: u32,
    /// pid of the `gpufrac run` whose job this process belongs to (its
    /// unit of fairness), if any.
    #[serde(default)]
    pub job: Option<u32>,
    /// What all of that job's processes hold on this GPU (a job started
    /// with `--gpu-memory` is capped as a whole).
    #[serde(default)]
    pub job_mem_used: Option<u64>,
    /// The pod (`namespace/name`) whose lease that job is, for a pod's
    /// process under the Kubernetes device plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// A user's part of a GPU: users with work share it by their weights
/// first, then each user's part goes to its jobs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct UserShare {
    /// The user every process here is counted for: a job's processes are
    /// its user's, whoever runs them.
    pub uid: u32,
    /// Its weight among users (`--user-weight`, `--group-weight`; 1 by
    /// default).
    pub weight: f64,
    /// What its processes here together get while they are busy and the
    /// GPU contended, 0..1 (the sum of their `share_target`).
    pub share_target: f64,
    /// What they together held over the last window, 0..1.
    pub share_achieved: f64,
    /// GPU time charged to them so far, seconds.
    pub gpu_time_s: f64,
    /// GPU time they were owed and time they were held back, seconds
    /// (the sums of their processes').
    #[serde(default)]
    pub entitled_s: f64,
    #[serde(default)]
    pub held_back_s: f64,
    /// Its jobs here, and its processes outside any job (`job` None).
    pub jobs: Vec<JobShare>,
}

/// A job's part of its user's part, or that of the user's processes
/// outside any job; its processes share it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct JobShare {
    /// pid of the job's `gpufrac run`; None: the user's processes outside
    /// any job.
    pub job: Option<u32>,
    /// A pod's job: `namespace/name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Its weight among the user's jobs: its `--gpu-compute`, else the
    /// largest `GPU_COMPUTE_SHARE` among its processes (50 unset).
    pub weight: f64,
    pub share_target: f64,
    pub share_achieved: f64,
    pub gpu_time_s: f64,
    /// As in [`UserShare`].
    #[serde(default)]
    pub entitled_s: f64,
    #[serde(default)]
    pub held_back_s: f64,
    /// How many of its processes are on this GPU (each process's entry
    /// names its job and user).
    pub processes: u32,
}

fn time_slicing() -> String {
    "time-slicing".into()
}

fn normal() -> String {
    "normal".into()
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct QueueEntry {
    pub position: u32,
    pub pid: u32,
    /// A pod's lease (`namespace/name`): `pid` is then the device plugin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The job's user.
    #[serde(default)]
    pub uid: u32,
    pub command: String,
    /// Human description: "2 GPUs", "4.00 GiB".
    pub wants: String,
    /// What `wants` says: whole GPUs (`--gpus N`), or bytes of memory on
    /// one GPU (`--gpu-memory`; a pod's, the sum of its pins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub want_gpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub want_mem: Option<u64>,
    pub waiting_s: f64,
    pub escalated: bool,
    /// Why it waits: what it needs, what is free, who holds the rest.
    #[serde(default)]
    pub why: String,
    /// Why, in one of a few words: `fits_now`, `held_for_earlier`,
    /// `no_room`, `recovering` (metrics' `reason` label).
    #[serde(default)]
    pub reason: String,
    /// The GPUs (indices) it waits for.
    #[serde(default)]
    pub waits_for: Vec<u32>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LeaseEntry {
    pub pid: u32,
    /// A pod's lease (`namespace/name`): `pid` is then the device plugin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The job's user.
    #[serde(default)]
    pub uid: u32,
    pub command: String,
    pub gpus: Vec<u32>,
    pub mem_cap: Option<u64>,
    pub held_s: f64,
    /// `--gpu-compute` (percent) and `--gpu-limit` (0..1), enforced on
    /// every process of the job.
    #[serde(default)]
    pub compute: Option<f64>,
    #[serde(default)]
    pub limit: Option<f64>,
    /// Its `gpufrac run` is connected (false for a lease restored after a
    /// broker restart until run reconnects).
    #[serde(default = "yes")]
    pub connected: bool,
}

fn yes() -> bool {
    true
}

/// What a job has had, for its run's end-of-job line (`gpufrac run
/// --report` writes it with the run's own figures).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct JobSummary {
    /// The pid of its `gpufrac run`.
    pub job: u32,
    /// The GPUs its lease holds (indices).
    pub gpus: Vec<u32>,
    /// How long it waited in the queue, and has held its lease, seconds.
    pub queued_s: f64,
    pub held_s: f64,
    /// GPU time its processes were charged, and what they were owed (their
    /// target share while busy within their ceilings), seconds.
    pub gpu_s: f64,
    pub owed_s: f64,
    /// The most memory its processes held at once, and its cap, bytes.
    pub peak_mem: u64,
    #[serde(default)]
    pub mem_cap: Option<u64>,
    /// Allocations its memory caps refused.
    pub refusals: u64,
    /// Its `--gpu-compute` (percent) and `--gpu-limit` (0..1).
    #[serde(default)]
    pub compute: Option<f64>,
    #[serde(default)]
    pub limit: Option<f64>,
}
