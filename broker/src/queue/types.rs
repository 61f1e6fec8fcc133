//! The queue's public types: GPUs and configuration in, requests and
//! their leases, refusals, and what status shows of both.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::mig;

/// Monotonic nanoseconds, chosen by the caller.
pub type Nanos = u64;
/// Chosen by the caller; unique among requests waiting or leased.
pub type RequestId = u64;

const HOUR: Nanos = 3600 * 1_000_000_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// nvidia-smi (PCI bus) order.
    pub index: u32,
    /// CUDA's default enumeration order differs from nvidia-smi's, so
    /// children should be pointed at GPUs by UUID.
    pub uuid: String,
    pub total_mem: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Least uncommitted memory that still fits: keeps big holes for big
    /// requests.
    #[default]
    BestFit,
    /// Most uncommitted memory: spreads load over GPUs.
    Spread,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueConfig {
    /// A request that has waited this long goes ahead of all younger ones.
    pub escalate_after: Nanos,
    /// Slots per physical GPU (F >= 1; 0 is read as 1).
    pub overprovision: u32,
    /// Let committed memory exceed a GPU's total.
    pub overcommit: bool,
    /// How memory fractions pick a GPU.
    pub placement: Placement,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            escalate_after: HOUR,
            overprovision: 1,
            overcommit: false,
            placement: Placement::BestFit,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Want {
    /// `--gpus N`
    Gpus(u32),
    /// `--gpu-memory SIZE`, bytes.
    Memory(u64),
}

impl Want {
    /// What the request waits for, in words: "1 GPU", "2 GPUs", "16.00
    /// GiB of GPU memory".
    pub fn words(&self) -> String {
        match self {
            Want::Gpus(1) => "1 GPU".into(),
            Want::Gpus(n) => format!("{n} GPUs"),
            Want::Memory(b) => format!("{} of GPU memory", gpufrac_common::size::format_size(*b)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub want: Want,
    /// `--gpu-compute`, a weight; carried for status, not used for placement.
    pub compute: Option<f64>,
    /// `--gpu-limit`, a fraction in (0, 1].
    pub limit: Option<f64>,
    /// The command, for status.
    pub label: String,
    /// pid of the job's `gpufrac run`: names its lease in messages, as
    /// status shows it. (The request id is the job's secret token.)
    #[serde(default)]
    pub job: u32,
    /// The job's user: an escalated request never waits for its own
    /// user's leases with GPUs held for it (that user could hold them
    /// forever and so freeze the queue for everyone).
    #[serde(default)]
    pub uid: u32,
    /// Non-empty: the GPUs are already chosen, with the memory on each;
    /// `want` is then `Memory` of their sum.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pin: Vec<Pinned>,
    /// The pod (`namespace/name`) a pinned request is, once its plugin
    /// says: messages name it by that, not by the plugin's pid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// Memory on a GPU chosen before the request reached the queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pinned {
    /// The GPU's UUID (`GPU-…`), as in [`GpuInfo::uuid`].
    pub uuid: String,
    pub mem: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub id: RequestId,
    /// nvidia-smi indices, ascending.
    pub gpus: Vec<u32>,
    /// UUIDs of `gpus`, same order: what `CUDA_VISIBLE_DEVICES` should list.
    pub uuids: Vec<String>,
    /// Bytes per GPU; None = uncapped. For a slot lease on GPUs of different
    /// sizes, the smallest GPU's `total / F`. A MIG lease: the instance's
    /// memory (the job has all of it).
    pub mem_cap: Option<u64>,
    /// A MIG instance (`gpus` is then its GPU): which, and, until it
    /// exists, the steps that make it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<mig::Assignment>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// Says why, and what would work.
    pub reason: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for Refusal {}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WaitingStatus {
    pub id: RequestId,
    /// 1-based place in queue order.
    pub position: usize,
    pub want: Want,
    pub label: String,
    pub since: Nanos,
    pub waited: Nanos,
    pub escalated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseStatus {
    pub index: u32,
    pub uuid: String,
    pub total_mem: u64,
    pub slots_used: u32,
    pub slots_total: u32,
    pub committed_mem: u64,
    /// Leases with a share of this GPU (slots and fractions), ascending.
    pub leases: Vec<RequestId>,
}
