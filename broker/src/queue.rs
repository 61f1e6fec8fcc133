//! GPU admission queue for `gpufrac run` (the README's `gpufrac run` section).
//!
//! A pure state machine: no I/O, no clock. The socket layer submits requests,
//! reports ends of leases, and calls [`Queue::poll`] after every change
//! (submit, cancel, release) to learn which waiting requests were placed.
//! Escalation needs no timer of its own: it only reorders the queue, and
//! reordering never makes a request fit that did not fit before, so the next
//! event's `poll` is always soon enough.
//!
//! Placement rules, per physical GPU with `F = overprovision` slots:
//! - A whole-GPU (`--gpus N`) lease takes one slot on each of N distinct GPUs,
//!   lowest indices first, and commits `total / F` of memory on each (its
//!   default memory cap when F > 1). With F = 1 it needs the GPU to have no
//!   lease at all, fractions included: a whole GPU means exclusive.
//! - A memory fraction (`--gpu-memory B`) needs one GPU that still has a free
//!   slot (so with F = 1, one not held whole) and `B` uncommitted memory,
//!   chosen best-fit or spread. With F > 1 fractions and slot leases share a
//!   GPU, both bounded by memory: a slot lease is just a tenant capped at
//!   `total / F`.
//! - Committed memory never exceeds a GPU's total unless `overcommit`; then
//!   memory is not checked at all (slots still are), and fractions go to GPUs
//!   where they still fit if any, otherwise to the least overcommitted one.
//!
//! - A pinned request (the Kubernetes device plugin's pod: the kubelet
//!   already chose the GPUs and the pod is starting there) names its GPUs
//!   and the memory on each; it goes there and nowhere else, as a fraction
//!   on each. Pinned requests wait ahead of all but escalated ones, and a
//!   GPU a pinned request waits for takes no other new lease meanwhile, so
//!   that jobs arriving later cannot keep a pod's memory from it.
//!
//! GPUs in MIG mode under `--mig dynamic` are not among these: the MIG
//! planner (`mig.rs`) owns them. A memory request goes to a MIG instance
//! whenever one can be had now (reused, created, or created after
//! destroying idle ones), else to a fraction of a GPU outside MIG mode,
//! else it waits for whichever frees first. Whole-GPU requests never go to
//! MIG GPUs: CUDA shows a process one MIG device at most, so `--gpus N`
//! could not use what it was given. A MIG lease comes out of `poll` with
//! the steps (destroy, create) the socket layer carries out before
//! delivering it, and reports back with `mig_created` or `mig_failed`.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;

use gpufrac_common::size::format_size_arg;
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
    /// Non-empty: the GPUs are already chosen, with the memory on each;
    /// `want` is then `Memory` of their sum.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pin: Vec<Pinned>,
    /// The pod (`namespace/name`) a pinned request is, once its plugin
    /// says: messages name it by that, not by the plugin's pid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// What a pinned request wants: the memory of all its pins.
pub fn pinned_total(pin: &[Pinned]) -> u64 {
    pin.iter().fold(0u64, |a, p| a.saturating_add(p.mem))
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

#[derive(Debug, Clone)]
struct Waiter {
    id: RequestId,
    req: Request,
    since: Nanos,
    seq: u64,
}

/// What a lease holds on one GPU, so releasing undoes exactly that.
#[derive(Debug, Clone, Copy)]
struct Share {
    gpu: usize,
    mem: u64,
    slot: bool,
}

#[derive(Debug, Clone)]
struct Held {
    lease: Lease,
    req: Request,
    shares: Vec<Share>,
    /// A MIG lease placed from the queue: (since, seq) of its wait, to
    /// queue it again where it was if its instance cannot be made.
    requeue: Option<(Nanos, u64)>,
}

/// Where a request would go.
#[derive(Debug, Clone)]
enum Placed {
    Shares(Vec<Share>),
    Mig(mig::Choice),
}

#[derive(Debug, Clone)]
struct GpuState {
    info: GpuInfo,
    slots_used: u32,
    committed: u64,
    leases: Vec<RequestId>,
}

impl GpuState {
    fn uncommitted(&self) -> i128 {
        self.info.total_mem as i128 - self.committed as i128
    }
}

#[derive(Debug, Clone)]
pub struct Queue {
    cfg: QueueConfig,
    /// Sorted by index. GPUs in MIG mode are in `mig` instead.
    gpus: Vec<GpuState>,
    waiting: Vec<Waiter>,
    held: BTreeMap<RequestId, Held>,
    next_seq: u64,
    mig: mig::Planner,
}

fn fmt_bytes(b: u64) -> String {
    const K: f64 = 1024.0;
    let f = b as f64;
    if f >= K * K * K {
        format!("{:.1} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.1} MiB", f / (K * K))
    } else if f >= K {
        format!("{:.1} KiB", f / K)
    } else {
        format!("{b} B")
    }
}

fn fmt_indices(idx: &[u32]) -> String {
    match idx {
        [] => "none".into(),
        [one] => format!("index {one}"),
        [first, .., last] if idx.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("indices {first}-{last}")
        }
        _ => {
            let list: Vec<String> = idx.iter().map(u32::to_string).collect();
            format!("indices {}", list.join(", "))
        }
    }
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn refuse(reason: impl Into<String>) -> Refusal {
    Refusal {
        reason: reason.into(),
    }
}

fn want_text(want: Want) -> String {
    match want {
        Want::Gpus(n) => format!("--gpus {n}"),
        Want::Memory(b) => format!("--gpu-memory {}", format_size_arg(b)),
    }
}

impl Queue {
    pub fn new(mut gpus: Vec<GpuInfo>, cfg: QueueConfig) -> Self {
        gpus.sort_by_key(|g| g.index);
        gpus.dedup_by_key(|g| g.index);
        let cfg = QueueConfig {
            overprovision: cfg.overprovision.max(1),
            ..cfg
        };
        Queue {
            cfg,
            gpus: gpus
                .into_iter()
                .map(|info| GpuState {
                    info,
                    slots_used: 0,
                    committed: 0,
                    leases: Vec::new(),
                })
                .collect(),
            waiting: Vec::new(),
            held: BTreeMap::new(),
            next_seq: 0,
            mig: mig::Planner::default(),
        }
    }

    /// Hands the GPUs in MIG mode to the queue (`--mig dynamic`).
    pub fn set_mig(&mut self, planner: mig::Planner) {
        self.mig = planner;
    }

    pub fn mig(&self) -> &mig::Planner {
        &self.mig
    }

    /// The driver's word on GPU `index`'s instances (at start, after a
    /// failure).
    pub fn mig_sync(&mut self, now: Nanos, index: u32, found: &[mig::FoundInstance]) {
        self.mig.sync(now, index, found);
    }

    /// A lease's idle MIG instance was destroyed to make room.
    pub fn mig_destroyed(&mut self, index: u32, gi: u32) {
        self.mig.destroyed(index, gi);
    }

    /// A lease's MIG instance exists: the lease, ready to deliver.
    pub fn mig_created(&mut self, id: RequestId, gi: u32, uuid: String) -> Option<Lease> {
        let h = self.held.get_mut(&id)?;
        let a = h.lease.mig.as_mut()?;
        self.mig.created(id, a.gpu, gi, uuid.clone());
        a.gi = Some(gi);
        a.uuid = Some(uuid);
        a.steps.clear();
        h.requeue = None;
        Some(h.lease.clone())
    }

    /// A lease's MIG instance could not be made: the lease is undone, the
    /// planner learns what the driver now reports (`found`, when it could
    /// be read) and avoids that placement for a while. A lease placed from
    /// the queue waits again where it was (true); one from `try_now` is
    /// simply gone (false).
    pub fn mig_failed(
        &mut self,
        now: Nanos,
        id: RequestId,
        found: Option<&[mig::FoundInstance]>,
    ) -> bool {
        let Some(h) = self.held.remove(&id) else {
            return false;
        };
        if let Some(a) = &h.lease.mig {
            self.mig.failed(now, id, a.gpu, a.placement);
            if let Some(found) = found {
                self.mig.sync(now, a.gpu, found);
            }
        }
        match h.requeue {
            Some((since, seq)) => {
                self.waiting.push(Waiter {
                    id,
                    req: h.req,
                    since,
                    seq,
                });
                true
            }
            None => false,
        }
    }

    /// A MIG lease that was running before a restart, on the instance with
    /// MIG device `uuid` of GPU `index`.
    pub fn restore_mig(
        &mut self,
        id: RequestId,
        req: Request,
        index: u32,
        uuid: &str,
    ) -> Result<Lease, Refusal> {
        if self.held.contains_key(&id) || self.waiting.iter().any(|w| w.id == id) {
            return Err(refuse(format!("request {id} is already queued or running")));
        }
        let a = self.mig.restore(id, index, uuid).ok_or_else(|| {
            refuse(format!(
                "MIG instance {uuid} on GPU {index} no longer exists (or GPU {index} is no longer in MIG mode)"
            ))
        })?;
        Ok(self.hold_mig(id, req, a, None))
    }

    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    pub fn gpus(&self) -> impl Iterator<Item = &GpuInfo> {
        self.gpus.iter().map(|g| &g.info)
    }

    /// Queues a request. Refuses at once what no GPU of this node could ever
    /// satisfy, and ids already in use. Call `poll` afterwards.
    pub fn submit(&mut self, now: Nanos, id: RequestId, req: Request) -> Result<(), Refusal> {
        self.check(id, &req)?;
        self.waiting.push(Waiter {
            id,
            req,
            since: now,
            seq: self.next_seq,
        });
        self.next_seq += 1;
        Ok(())
    }

    /// Queues a request that was waiting since `since` (a restarted broker
    /// restoring its queue): it keeps its age, and so its place.
    pub fn submit_since(
        &mut self,
        since: Nanos,
        id: RequestId,
        req: Request,
    ) -> Result<(), Refusal> {
        self.submit(since, id, req)
    }

    /// Books a lease that was running before a restart on the GPUs it held
    /// (by index), whatever else is booked: the job is running there. GPUs
    /// this node no longer has are left out.
    pub fn restore(&mut self, id: RequestId, req: Request, gpus: &[u32]) -> Result<Lease, Refusal> {
        if self.held.contains_key(&id) || self.waiting.iter().any(|w| w.id == id) {
            return Err(refuse(format!("request {id} is already queued or running")));
        }
        if !req.pin.is_empty() {
            let shares: Vec<Share> = req.pin.iter().filter_map(|p| self.pin_share(p)).collect();
            if shares.is_empty() {
                return Err(refuse("none of the lease's GPUs is on this node any more"));
            }
            return Ok(self.commit(id, req, shares));
        }
        let shares: Vec<Share> = gpus
            .iter()
            .filter_map(|&ix| self.gpus.iter().position(|g| g.info.index == ix))
            .map(|i| match req.want {
                Want::Gpus(_) => Share {
                    gpu: i,
                    mem: self.slot_mem(&self.gpus[i]),
                    slot: true,
                },
                Want::Memory(b) => Share {
                    gpu: i,
                    mem: b,
                    slot: false,
                },
            })
            .collect();
        if shares.is_empty() {
            return Err(refuse("none of the lease's GPUs is on this node any more"));
        }
        Ok(self.commit(id, req, shares))
    }

    /// `--no-wait`: a lease now, or a refusal saying what is busy. Never
    /// jumps an escalated request, which by then has priority over everyone
    /// younger, this one included.
    pub fn try_now(&mut self, now: Nanos, id: RequestId, req: Request) -> Result<Lease, Refusal> {
        self.check(id, &req)?;
        let escalated = self
            .waiting
            .iter()
            .filter(|w| self.is_escalated(now, w))
            .count();
        if escalated > 0 {
            return Err(refuse(format!(
                "{} waited longer than the escalation limit and must be placed first; \
                 retry later or drop --no-wait to queue",
                plural(
                    escalated as u64,
                    "queued request has",
                    "queued requests have"
                )
            )));
        }
        // Every GPU a pinned request waits for is taken: they are first.
        let reserved: Vec<usize> = self
            .waiting
            .iter()
            .flat_map(|w| &w.req.pin)
            .filter_map(|p| self.gpu_of(&p.uuid))
            .collect();
        match self.plan(now, &req, &reserved) {
            Some(plan) => Ok(self.commit_placed(id, req, plan, None)),
            None => Err(refuse(format!(
                "no room now for {}: {}; drop --no-wait to queue",
                want_text(req.want),
                self.busy_summary()
            ))),
        }
    }

    /// The waiting `run` died or gave up. A lease under that id (granted
    /// before the caller noticed) is released, so nothing leaks.
    pub fn cancel(&mut self, now: Nanos, id: RequestId) {
        if let Some(pos) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(pos);
        } else {
            self.release(now, id);
        }
    }

    /// The lease ended. A waiting request under that id is dropped instead.
    pub fn release(&mut self, now: Nanos, id: RequestId) {
        let Some(held) = self.held.remove(&id) else {
            if let Some(pos) = self.waiting.iter().position(|w| w.id == id) {
                self.waiting.remove(pos);
            }
            return;
        };
        if held.lease.mig.is_some() {
            // Lazily: the instance stays, idle, until its room is needed.
            self.mig.release(now, id);
        }
        for s in held.shares {
            let g = &mut self.gpus[s.gpu];
            g.committed = g.committed.saturating_sub(s.mem);
            if s.slot {
                g.slots_used -= 1;
            }
            g.leases.retain(|&l| l != id);
        }
    }

    /// Places whatever can be placed now, in queue order, backfilling
    /// smaller requests into holes; but once an escalated request does not
    /// fit, nothing behind it is placed, so the resources it waits for drain
    /// towards it instead of being taken by a stream of small jobs.
    pub fn poll(&mut self, now: Nanos) -> Vec<Lease> {
        let mut placed = Vec::new();
        let mut taken = Vec::new();
        // GPUs of pinned requests that did not fit: nobody after them may
        // take room there (they come before every unescalated request).
        let mut reserved = Vec::new();
        for i in self.order(now) {
            let w = &self.waiting[i];
            let escalated = self.is_escalated(now, w);
            match self.plan(now, &w.req, &reserved) {
                Some(plan) => {
                    let (id, req, origin) = (w.id, w.req.clone(), (w.since, w.seq));
                    placed.push(self.commit_placed(id, req, plan, Some(origin)));
                    taken.push(i);
                }
                None if escalated => break,
                None => reserved.extend(w.req.pin.iter().filter_map(|p| self.gpu_of(&p.uuid))),
            }
        }
        taken.sort_unstable();
        for i in taken.into_iter().rev() {
            self.waiting.remove(i);
        }
        placed
    }

    pub fn waiting(&self, now: Nanos) -> Vec<WaitingStatus> {
        self.order(now)
            .into_iter()
            .enumerate()
            .map(|(pos, i)| {
                let w = &self.waiting[i];
                WaitingStatus {
                    id: w.id,
                    position: pos + 1,
                    want: w.req.want,
                    label: w.req.label.clone(),
                    since: w.since,
                    waited: now.saturating_sub(w.since),
                    escalated: self.is_escalated(now, w),
                }
            })
            .collect()
    }

    /// 1-based queue position of a waiting request.
    pub fn position(&self, now: Nanos, id: RequestId) -> Option<usize> {
        self.order(now)
            .into_iter()
            .position(|i| self.waiting[i].id == id)
            .map(|p| p + 1)
    }

    pub fn leases(&self) -> Vec<LeaseStatus> {
        self.gpus
            .iter()
            .map(|g| {
                let mut leases = g.leases.clone();
                leases.sort_unstable();
                LeaseStatus {
                    index: g.info.index,
                    uuid: g.info.uuid.clone(),
                    total_mem: g.info.total_mem,
                    slots_used: g.slots_used,
                    slots_total: self.cfg.overprovision,
                    committed_mem: g.committed,
                    leases,
                }
            })
            .collect()
    }

    /// A new label and pod for a waiting or held request (status and
    /// messages show them).
    pub fn relabel(&mut self, id: RequestId, label: &str, pod: Option<&str>) {
        let req = match self.held.get_mut(&id) {
            Some(h) => Some(&mut h.req),
            None => self
                .waiting
                .iter_mut()
                .find(|w| w.id == id)
                .map(|w| &mut w.req),
        };
        if let Some(r) = req {
            r.label = label.to_owned();
            r.pod = pod.map(str::to_owned);
        }
    }

    pub fn lease(&self, id: RequestId) -> Option<&Lease> {
        self.held.get(&id).map(|h| &h.lease)
    }

    /// The request a lease was granted for (label, compute, limit).
    pub fn lease_request(&self, id: RequestId) -> Option<&Request> {
        self.held.get(&id).map(|h| &h.req)
    }

    fn is_escalated(&self, now: Nanos, w: &Waiter) -> bool {
        now.saturating_sub(w.since) >= self.cfg.escalate_after
    }

    /// Indices into `waiting`, in queue order: escalated first (FIFO), then
    /// pinned (FIFO), then by GPUs needed (a fraction counts as zero), FIFO
    /// among equals.
    fn order(&self, now: Nanos) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.waiting.len()).collect();
        idx.sort_by_key(|&i| {
            let w = &self.waiting[i];
            if self.is_escalated(now, w) {
                (0, 0, w.seq)
            } else if !w.req.pin.is_empty() {
                (1, 0, w.seq)
            } else {
                let size = match w.req.want {
                    Want::Memory(_) => 0,
                    Want::Gpus(n) => n,
                };
                (2, size, w.seq)
            }
        });
        idx
    }

    fn check(&self, id: RequestId, req: &Request) -> Result<(), Refusal> {
        if self.held.contains_key(&id) || self.waiting.iter().any(|w| w.id == id) {
            return Err(refuse(format!("request {id} is already queued or running")));
        }
        if let Some(c) = req.compute
            && !(c.is_finite() && c > 0.0)
        {
            return Err(refuse(format!(
                "invalid compute share {c}: it must be a positive weight, e.g. 30%"
            )));
        }
        if let Some(l) = req.limit
            && !(l.is_finite() && l > 0.0 && l <= 1.0)
        {
            return Err(refuse(format!(
                "invalid compute limit {l}: it must be a fraction in (0, 1], e.g. 30%"
            )));
        }
        if self.gpus.is_empty() && self.mig.is_empty() {
            return Err(refuse("this node has no GPUs"));
        }
        if !req.pin.is_empty() {
            return self.check_pinned(req);
        }
        let indices: Vec<u32> = self.gpus.iter().map(|g| g.info.index).collect();
        match req.want {
            Want::Gpus(0) => Err(refuse("requested 0 GPUs; ask for at least 1")),
            Want::Gpus(_) if self.gpus.is_empty() => Err(refuse(format!(
                "--gpus needs whole GPUs, and every GPU of this node is in MIG mode ({}), \
                 handed out only as MIG instances; ask for --gpu-memory instead{}",
                self.mig_gpus_text(),
                self.largest_profile_text()
                    .map_or_else(String::new, |t| format!(", at most {t}"))
            ))),
            Want::Gpus(n) if n as usize > self.gpus.len() => {
                let mut reason = format!(
                    "requested {} but this node has {} ({})",
                    plural(n.into(), "GPU", "GPUs"),
                    self.gpus.len(),
                    fmt_indices(&indices)
                );
                if self.cfg.overprovision > 1 {
                    reason.push_str(&format!(
                        "; with --overprovision {} a lease still takes at most one slot \
                         per GPU, so ask for --gpu-memory, or at most --gpus {}",
                        self.cfg.overprovision,
                        self.gpus.len()
                    ));
                } else {
                    reason.push_str(&format!("; ask for at most --gpus {}", self.gpus.len()));
                }
                if !self.mig.is_empty() {
                    reason.push_str(&format!(
                        "; GPUs in MIG mode ({}) are handed out only as MIG instances, for --gpu-memory",
                        self.mig_gpus_text()
                    ));
                }
                Err(refuse(reason))
            }
            Want::Gpus(_) => Ok(()),
            Want::Memory(0) => Err(refuse(
                "requested 0 bytes of GPU memory; ask for a positive size, e.g. 4G",
            )),
            Want::Memory(b) if !self.mig.is_empty() => {
                let whole = self
                    .gpus
                    .iter()
                    .max_by_key(|g| (g.info.total_mem, Reverse(g.info.index)));
                if self.mig.could_fit(b, req.compute)
                    || whole.is_some_and(|g| b <= g.info.total_mem)
                {
                    return Ok(());
                }
                let (gpu, p) = self.mig.largest().expect("a MIG GPU has profiles");
                let mut most = p.mem;
                let mut reason = format!(
                    "requested {} but no MIG profile holds it: the largest is {} ({}, GPU {gpu})",
                    fmt_bytes(b),
                    p.name,
                    fmt_bytes(p.mem)
                );
                match whole {
                    Some(g) => {
                        most = most.max(g.info.total_mem);
                        reason.push_str(&format!(
                            ", and the largest GPU outside MIG mode has {} (GPU {})",
                            fmt_bytes(g.info.total_mem),
                            g.info.index
                        ));
                    }
                    None => reason.push_str(", and no GPU of this node is outside MIG mode"),
                }
                reason.push_str(&format!(
                    "; ask for at most --gpu-memory {}",
                    format_size_arg(most)
                ));
                Err(refuse(reason))
            }
            Want::Memory(b) => {
                let largest = self
                    .gpus
                    .iter()
                    .max_by_key(|g| (g.info.total_mem, Reverse(g.info.index)))
                    .expect("non-empty");
                if b > largest.info.total_mem {
                    Err(refuse(format!(
                        "requested {} but the largest GPU has {} (GPU {}); \
                         ask for at most --gpu-memory {}",
                        fmt_bytes(b),
                        fmt_bytes(largest.info.total_mem),
                        largest.info.index,
                        format_size_arg(largest.info.total_mem)
                    )))
                } else {
                    Ok(())
                }
            }
        }
    }

    fn check_pinned(&self, req: &Request) -> Result<(), Refusal> {
        let sum = pinned_total(&req.pin);
        if req.want != Want::Memory(sum) {
            return Err(refuse(format!(
                "a pinned request wants the sum of its pins ({}), not {}",
                fmt_bytes(sum),
                want_text(req.want)
            )));
        }
        for (n, p) in req.pin.iter().enumerate() {
            let Some(i) = self.gpu_of(&p.uuid) else {
                let why = if self
                    .mig
                    .gpus()
                    .any(|g| g.uuid.eq_ignore_ascii_case(&p.uuid))
                {
                    "is in MIG mode, handed out only as MIG instances"
                } else {
                    "is not a GPU of this broker"
                };
                return Err(refuse(format!("GPU {} {why}", p.uuid)));
            };
            if req.pin[..n]
                .iter()
                .any(|q| q.uuid.eq_ignore_ascii_case(&p.uuid))
            {
                return Err(refuse(format!(
                    "GPU {} is named twice; name each GPU once with all its memory",
                    p.uuid
                )));
            }
            let g = &self.gpus[i].info;
            if p.mem == 0 || p.mem > g.total_mem {
                return Err(refuse(format!(
                    "requested {} on GPU {}, which has {}; ask for 1 byte to {} there",
                    fmt_bytes(p.mem),
                    g.index,
                    fmt_bytes(g.total_mem),
                    fmt_bytes(g.total_mem)
                )));
            }
        }
        Ok(())
    }

    /// The position in `gpus` of the GPU with this UUID.
    fn gpu_of(&self, uuid: &str) -> Option<usize> {
        self.gpus
            .iter()
            .position(|g| g.info.uuid.eq_ignore_ascii_case(uuid))
    }

    fn slot_mem(&self, g: &GpuState) -> u64 {
        g.info.total_mem / u64::from(self.cfg.overprovision)
    }

    fn fits_whole(&self, g: &GpuState) -> bool {
        if g.slots_used >= self.cfg.overprovision {
            return false;
        }
        if self.cfg.overprovision == 1 {
            return g.leases.is_empty();
        }
        self.cfg.overcommit || g.uncommitted() >= i128::from(self.slot_mem(g))
    }

    fn mig_gpus_text(&self) -> String {
        let v: Vec<u32> = self.mig.gpus().map(|g| g.index).collect();
        let list = fmt_indices(&v);
        match list.strip_prefix("index ") {
            Some(one) => format!("GPU {one}"),
            None => format!("GPUs {}", list.trim_start_matches("indices ")),
        }
    }

    fn largest_profile_text(&self) -> Option<String> {
        self.mig.largest().map(|(gpu, p)| {
            format!(
                "(the {} profile of GPU {gpu}): --gpu-memory {}",
                p.name,
                format_size_arg(p.mem)
            )
        })
    }

    /// Where `req` would go now, or None if it must wait: its pinned GPUs
    /// if it has them; else a MIG instance if one can be had, else a GPU
    /// outside MIG mode other than the `reserved` ones (positions in
    /// `gpus`).
    fn plan(&self, now: Nanos, req: &Request, reserved: &[usize]) -> Option<Placed> {
        if !req.pin.is_empty() {
            return self.plan_pinned(&req.pin).map(Placed::Shares);
        }
        if let Want::Memory(b) = req.want
            && let Some(c) = self.mig.plan(now, b, req.compute)
        {
            return Some(Placed::Mig(c));
        }
        self.plan_shares(req.want, reserved).map(Placed::Shares)
    }

    /// A fraction on each pinned GPU, if every one has a free slot and the
    /// memory (or `overcommit`).
    fn plan_pinned(&self, pin: &[Pinned]) -> Option<Vec<Share>> {
        pin.iter()
            .map(|p| {
                self.pin_share(p).filter(|s| {
                    let g = &self.gpus[s.gpu];
                    g.slots_used < self.cfg.overprovision
                        && (self.cfg.overcommit || g.uncommitted() >= i128::from(s.mem))
                })
            })
            .collect()
    }

    /// What a pin holds on its GPU (a fraction), if the GPU is this
    /// queue's.
    fn pin_share(&self, p: &Pinned) -> Option<Share> {
        Some(Share {
            gpu: self.gpu_of(&p.uuid)?,
            mem: p.mem,
            slot: false,
        })
    }

    fn commit_placed(
        &mut self,
        id: RequestId,
        req: Request,
        placed: Placed,
        origin: Option<(Nanos, u64)>,
    ) -> Lease {
        match placed {
            Placed::Shares(shares) => self.commit(id, req, shares),
            Placed::Mig(c) => {
                let a = self.mig.assign(id, &c);
                self.hold_mig(id, req, a, origin)
            }
        }
    }

    /// The lease of a job on MIG instance `a`: the instance's GPU, all of
    /// its memory as the cap.
    fn hold_mig(
        &mut self,
        id: RequestId,
        req: Request,
        a: mig::Assignment,
        requeue: Option<(Nanos, u64)>,
    ) -> Lease {
        let lease = Lease {
            id,
            gpus: vec![a.gpu],
            uuids: vec![a.gpu_uuid.clone()],
            mem_cap: Some(a.mem),
            mig: Some(a),
        };
        self.held.insert(
            id,
            Held {
                lease: lease.clone(),
                req,
                shares: Vec::new(),
                requeue,
            },
        );
        lease
    }

    /// Where `want` would go now among GPUs outside MIG mode, or None.
    fn plan_shares(&self, want: Want, reserved: &[usize]) -> Option<Vec<Share>> {
        match want {
            Want::Gpus(n) => {
                let free: Vec<Share> = self
                    .gpus
                    .iter()
                    .enumerate()
                    .filter(|(i, g)| !reserved.contains(i) && self.fits_whole(g))
                    .take(n as usize)
                    .map(|(i, g)| Share {
                        gpu: i,
                        mem: self.slot_mem(g),
                        slot: true,
                    })
                    .collect();
                (free.len() == n as usize && n > 0).then_some(free)
            }
            Want::Memory(b) => {
                let open = || {
                    self.gpus.iter().enumerate().filter(|(i, g)| {
                        !reserved.contains(i) && g.slots_used < self.cfg.overprovision
                    })
                };
                let need = i128::from(b);
                let fitting = open().filter(|(_, g)| g.uncommitted() >= need);
                let chosen = match self.cfg.placement {
                    Placement::BestFit => fitting.min_by_key(|(i, g)| (g.uncommitted(), *i)),
                    Placement::Spread => {
                        fitting.min_by_key(|(i, g)| (Reverse(g.uncommitted()), *i))
                    }
                };
                let chosen = match chosen {
                    Some(c) => Some(c),
                    None if self.cfg.overcommit => {
                        open().min_by_key(|(i, g)| (Reverse(g.uncommitted()), *i))
                    }
                    None => None,
                };
                chosen.map(|(i, _)| {
                    vec![Share {
                        gpu: i,
                        mem: b,
                        slot: false,
                    }]
                })
            }
        }
    }

    fn commit(&mut self, id: RequestId, req: Request, mut shares: Vec<Share>) -> Lease {
        // Pins come in the client's order; a lease lists GPUs ascending.
        shares.sort_by_key(|s| self.gpus[s.gpu].info.index);
        for s in &shares {
            let g = &mut self.gpus[s.gpu];
            g.committed = g.committed.saturating_add(s.mem);
            if s.slot {
                g.slots_used += 1;
            }
            g.leases.push(id);
        }
        let mem_cap = match req.want {
            // On several GPUs, each has its own cap, in the processes'
            // environment: one cap for all would be wrong for some.
            Want::Memory(_) if req.pin.len() > 1 => None,
            Want::Memory(b) => Some(b),
            Want::Gpus(_) if self.cfg.overprovision > 1 => shares.iter().map(|s| s.mem).min(),
            Want::Gpus(_) => None,
        };
        let lease = Lease {
            id,
            gpus: shares.iter().map(|s| self.gpus[s.gpu].info.index).collect(),
            uuids: shares
                .iter()
                .map(|s| self.gpus[s.gpu].info.uuid.clone())
                .collect(),
            mem_cap,
            mig: None,
        };
        self.held.insert(
            id,
            Held {
                lease: lease.clone(),
                req,
                shares,
                requeue: None,
            },
        );
        lease
    }

    fn busy_summary(&self) -> String {
        let f = self.cfg.overprovision;
        let parts: Vec<String> = self
            .gpus
            .iter()
            .map(|g| {
                if g.leases.is_empty() {
                    return format!("GPU {}: free", g.info.index);
                }
                // A pod's lease is named by its pod: the plugin that asked
                // for it has one pid for all of them.
                let mut jobs: Vec<(u32, Option<&str>)> = g
                    .leases
                    .iter()
                    .filter_map(|l| self.held.get(l))
                    .map(|h| (h.req.job, h.req.pod.as_deref()))
                    .collect();
                jobs.sort_unstable();
                let ids: Vec<String> = jobs
                    .iter()
                    .map(|(j, pod)| match pod {
                        Some(p) => format!("pod {p}"),
                        None => j.to_string(),
                    })
                    .collect();
                let owners = format!(
                    "{} {}",
                    if ids.len() == 1 { "job" } else { "jobs" },
                    ids.join(", ")
                );
                if f == 1 && g.slots_used == 1 {
                    format!("GPU {}: held whole by {owners}", g.info.index)
                } else {
                    format!(
                        "GPU {}: {}/{f} slots, {} of {} committed ({owners})",
                        g.info.index,
                        g.slots_used,
                        fmt_bytes(g.committed),
                        fmt_bytes(g.info.total_mem)
                    )
                }
            })
            .collect();
        let mut text = parts.join("; ");
        if !self.mig.is_empty() {
            if !text.is_empty() {
                text.push_str("; ");
            }
            text.push_str(&self.mig.busy_summary());
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const SEC: Nanos = 1_000_000_000;

    fn gpus(totals: &[u64]) -> Vec<GpuInfo> {
        totals
            .iter()
            .enumerate()
            .map(|(i, &t)| GpuInfo {
                index: i as u32,
                uuid: format!("GPU-{i:04}"),
                total_mem: t,
            })
            .collect()
    }

    fn req(want: Want) -> Request {
        Request {
            want,
            compute: None,
            limit: None,
            label: format!("job {want:?}"),
            job: 0,
            pin: Vec::new(),
            pod: None,
        }
    }

    /// A pod's request: `gib` on each GPU of `on` (positions, as `gpus`
    /// names them).
    fn pinned(on: &[(u32, u64)]) -> Request {
        let pin: Vec<Pinned> = on
            .iter()
            .map(|&(i, gib)| Pinned {
                uuid: format!("GPU-{i:04}"),
                mem: gib * GIB,
            })
            .collect();
        Request {
            want: Want::Memory(pin.iter().map(|p| p.mem).sum()),
            label: "pod ns/p".into(),
            pin,
            ..req(Want::Gpus(1))
        }
    }

    fn whole(n: u32) -> Request {
        req(Want::Gpus(n))
    }

    fn mem(gib: u64) -> Request {
        req(Want::Memory(gib * GIB))
    }

    fn placed(leases: &[Lease]) -> Vec<(RequestId, Vec<u32>)> {
        leases.iter().map(|l| (l.id, l.gpus.clone())).collect()
    }

    fn two_80g() -> Queue {
        Queue::new(gpus(&[80 * GIB, 80 * GIB]), QueueConfig::default())
    }

    #[test]
    fn whole_gpus_go_lowest_first_and_third_waits_for_first_freed() {
        let mut q = two_80g();
        for id in 1..=3 {
            q.submit(0, id, whole(1)).unwrap();
        }
        let l = q.poll(0);
        assert_eq!(placed(&l), vec![(1, vec![0]), (2, vec![1])]);
        assert_eq!(l[0].uuids, vec!["GPU-0000".to_string()]);
        assert_eq!(l[0].mem_cap, None);
        assert_eq!(q.waiting(0).len(), 1);
        q.release(SEC, 2);
        assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![1])]);
        assert!(q.waiting(SEC).is_empty());
    }

    #[test]
    fn small_overtakes_big() {
        let mut q = two_80g();
        q.submit(0, 1, whole(1)).unwrap();
        q.poll(0);
        q.submit(1, 2, whole(2)).unwrap();
        q.submit(2, 3, whole(1)).unwrap();
        q.submit(3, 4, mem(10)).unwrap();
        let w: Vec<_> = q.waiting(3).iter().map(|w| (w.id, w.position)).collect();
        // Fractions first, then by GPUs needed; the big one is last.
        assert_eq!(w, vec![(4, 1), (3, 2), (2, 3)]);
        // Only GPU 1 is free: the fraction takes it first, so the 1-GPU job
        // (which needs it whole) waits, and so does the big one.
        assert_eq!(placed(&q.poll(3)), vec![(4, vec![1])]);
        q.release(4, 1);
        assert_eq!(placed(&q.poll(4)), vec![(3, vec![0])]);
        assert_eq!(q.position(4, 2), Some(1));
    }

    #[test]
    fn escalation_lets_big_through_and_blocks_younger_small_ones() {
        let cfg = QueueConfig {
            escalate_after: 10 * SEC,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
        q.submit(0, 1, whole(1)).unwrap();
        q.submit(0, 2, whole(1)).unwrap();
        assert_eq!(q.poll(0).len(), 2);
        q.submit(SEC, 10, whole(2)).unwrap();
        q.submit(2 * SEC, 3, whole(1)).unwrap();
        // Before escalation a small one overtakes the big one.
        q.release(3 * SEC, 1);
        assert_eq!(placed(&q.poll(3 * SEC)), vec![(3, vec![0])]);
        q.submit(15 * SEC, 4, whole(1)).unwrap();
        q.submit(15 * SEC, 5, mem(1)).unwrap();
        let w = q.waiting(15 * SEC);
        assert_eq!(w[0].id, 10);
        assert!(w[0].escalated);
        assert!(!w[1].escalated);
        // GPU 0 frees up, but the escalated big job still cannot fit; the
        // younger small ones must not take what it is waiting for.
        q.release(20 * SEC, 3);
        assert!(q.poll(20 * SEC).is_empty());
        let err = q.try_now(20 * SEC, 6, mem(1)).unwrap_err();
        assert!(err.reason.contains("escalation"), "{err}");
        q.release(21 * SEC, 2);
        assert_eq!(placed(&q.poll(21 * SEC)), vec![(10, vec![0, 1])]);
        let w: Vec<_> = q.waiting(21 * SEC).iter().map(|w| w.id).collect();
        assert_eq!(w, vec![5, 4]);
        q.release(30 * SEC, 10);
        assert_eq!(
            placed(&q.poll(30 * SEC)),
            vec![(4, vec![0]), (5, vec![1])],
            "escalated by now too, FIFO among themselves"
        );
    }

    #[test]
    fn escalated_requests_are_fifo_among_themselves() {
        let cfg = QueueConfig {
            escalate_after: 10 * SEC,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
        q.submit(0, 1, whole(2)).unwrap();
        assert_eq!(q.poll(0).len(), 1);
        q.submit(SEC, 2, whole(2)).unwrap();
        q.submit(2 * SEC, 3, whole(1)).unwrap();
        q.submit(20 * SEC, 4, mem(1)).unwrap();
        let w: Vec<_> = q
            .waiting(20 * SEC)
            .iter()
            .map(|w| (w.id, w.position, w.escalated, w.waited))
            .collect();
        assert_eq!(
            w,
            vec![
                (2, 1, true, 19 * SEC),
                (3, 2, true, 18 * SEC),
                (4, 3, false, 0)
            ]
        );
    }

    #[test]
    fn memory_best_fit_packs() {
        let mut q = Queue::new(gpus(&[80 * GIB, 40 * GIB]), QueueConfig::default());
        q.submit(0, 1, mem(10)).unwrap();
        q.submit(0, 2, mem(35)).unwrap();
        q.submit(0, 3, mem(30)).unwrap();
        q.submit(0, 4, mem(50)).unwrap();
        let l = q.poll(0);
        // 10 → the smaller GPU; 35 no longer fits there; 30 fills it
        // exactly; 50 fits neither (45 left on GPU 0) and waits.
        assert_eq!(placed(&l), vec![(1, vec![1]), (2, vec![0]), (3, vec![1])]);
        assert_eq!(l[0].mem_cap, Some(10 * GIB));
        assert_eq!(q.waiting(0)[0].id, 4);
        let st = q.leases();
        assert_eq!(st[0].committed_mem, 35 * GIB);
        assert_eq!(st[1].committed_mem, 40 * GIB);
        assert_eq!(st[1].leases, vec![1, 3]);
        assert_eq!(st[1].slots_used, 0);
        q.release(SEC, 2);
        assert_eq!(placed(&q.poll(SEC)), vec![(4, vec![0])]);
    }

    #[test]
    fn memory_spread_spreads() {
        let cfg = QueueConfig {
            placement: Placement::Spread,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB, 40 * GIB]), cfg);
        for id in 1..=4 {
            q.submit(0, id, mem(10)).unwrap();
        }
        assert_eq!(
            placed(&q.poll(0)),
            vec![(1, vec![0]), (2, vec![1]), (3, vec![0]), (4, vec![1])]
        );
    }

    #[test]
    fn memory_waits_when_nothing_fits_and_is_placed_after_release() {
        let mut q = two_80g();
        q.submit(0, 1, mem(70)).unwrap();
        q.submit(0, 2, mem(70)).unwrap();
        q.submit(0, 3, mem(20)).unwrap();
        assert_eq!(q.poll(0).len(), 2);
        assert_eq!(q.position(0, 3), Some(1));
        assert!(q.poll(SEC).is_empty());
        q.release(2 * SEC, 2);
        assert_eq!(placed(&q.poll(2 * SEC)), vec![(3, vec![1])]);
    }

    #[test]
    fn whole_and_fractions_exclude_each_other_without_overprovision() {
        let mut q = Queue::new(gpus(&[80 * GIB]), QueueConfig::default());
        q.submit(0, 1, mem(1)).unwrap();
        q.submit(0, 2, whole(1)).unwrap();
        assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
        q.release(SEC, 1);
        assert_eq!(placed(&q.poll(SEC)), vec![(2, vec![0])]);
        assert_eq!(q.leases()[0].committed_mem, 80 * GIB);
        q.submit(SEC, 3, mem(1)).unwrap();
        assert!(q.poll(SEC).is_empty());
    }

    #[test]
    fn impossible_requests_are_refused_at_once() {
        let mut q = two_80g();
        let e = q.submit(0, 1, whole(3)).unwrap_err();
        assert!(
            e.reason
                .starts_with("requested 3 GPUs but this node has 2 (indices 0-1)"),
            "{e}"
        );
        let e = q.submit(0, 2, mem(100)).unwrap_err();
        assert!(
            e.reason
                .starts_with("requested 100.0 GiB but the largest GPU has 80.0 GiB"),
            "{e}"
        );
        assert!(q.submit(0, 3, whole(0)).is_err());
        assert!(q.submit(0, 4, req(Want::Memory(0))).is_err());
        let bad_limit = Request {
            limit: Some(1.5),
            ..whole(1)
        };
        assert!(q.submit(0, 5, bad_limit).is_err());
        let bad_share = Request {
            compute: Some(f64::NAN),
            ..whole(1)
        };
        assert!(q.submit(0, 6, bad_share).is_err());
        assert!(q.waiting(0).is_empty());
        assert!(q.try_now(0, 7, whole(3)).is_err());

        let mut empty = Queue::new(vec![], QueueConfig::default());
        assert!(
            empty
                .submit(0, 1, whole(1))
                .unwrap_err()
                .reason
                .contains("no GPUs")
        );

        let mut one = Queue::new(gpus(&[16 * GIB]), QueueConfig::default());
        let e = one.submit(0, 1, whole(2)).unwrap_err();
        assert!(
            e.reason
                .starts_with("requested 2 GPUs but this node has 1 (index 0)")
        );
        let e = one.submit(0, 2, req(Want::Memory(17 * GIB))).unwrap_err();
        assert!(e.reason.contains("16.0 GiB"), "{e}");
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let mut q = two_80g();
        q.submit(0, 1, whole(1)).unwrap();
        assert!(q.submit(0, 1, whole(1)).is_err());
        q.poll(0);
        assert!(q.submit(0, 1, whole(1)).is_err());
        assert!(q.try_now(0, 1, whole(1)).is_err());
    }

    #[test]
    fn try_now_places_or_says_what_is_busy() {
        let mut q = two_80g();
        let of = |job, r| Request { job, ..r };
        let l = q.try_now(0, 1, of(101, whole(1))).unwrap();
        assert_eq!(l.gpus, vec![0]);
        q.try_now(0, 2, of(102, mem(30))).unwrap();
        let e = q.try_now(0, 3, whole(1)).unwrap_err();
        // Leases are named by their run's pid, as status shows them.
        assert!(e.reason.contains("GPU 0: held whole by job 101"), "{e}");
        assert!(e.reason.contains("GPU 1:"), "{e}");
        assert!(e.reason.contains("(job 102)"), "{e}");
        assert!(e.reason.contains("--no-wait"), "{e}");
        let e = q.try_now(0, 4, mem(60)).unwrap_err();
        assert!(e.reason.contains("--gpu-memory 60G"), "{e}");
        // Refused requests leave no trace.
        assert!(q.waiting(0).is_empty());
        assert_eq!(q.leases()[1].leases, vec![2]);
        q.try_now(0, 5, mem(50)).unwrap();
    }

    #[test]
    fn cancel_removes_waiting_and_releases_a_granted_lease() {
        let mut q = Queue::new(gpus(&[80 * GIB]), QueueConfig::default());
        q.submit(0, 1, whole(1)).unwrap();
        q.submit(0, 2, whole(1)).unwrap();
        q.submit(0, 3, whole(1)).unwrap();
        q.poll(0);
        q.cancel(SEC, 2);
        assert_eq!(
            q.waiting(SEC).iter().map(|w| w.id).collect::<Vec<_>>(),
            vec![3]
        );
        assert_eq!(q.position(SEC, 3), Some(1));
        // The run died right after being placed.
        q.cancel(SEC, 1);
        assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
        // Unknown ids are ignored.
        q.cancel(SEC, 42);
        q.release(SEC, 42);
    }

    #[test]
    fn overprovision_two_slots_per_gpu() {
        let cfg = QueueConfig {
            overprovision: 2,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB]), cfg);
        for id in 1..=3 {
            q.submit(0, id, whole(1)).unwrap();
        }
        let l = q.poll(0);
        assert_eq!(placed(&l), vec![(1, vec![0]), (2, vec![0])]);
        assert!(l.iter().all(|l| l.mem_cap == Some(40 * GIB)));
        let st = &q.leases()[0];
        assert_eq!((st.slots_used, st.slots_total), (2, 2));
        assert_eq!(st.committed_mem, 80 * GIB);
        assert_eq!(q.waiting(0)[0].id, 3);
        // A lease still takes at most one slot per physical GPU.
        assert!(q.submit(0, 4, whole(2)).is_err());
        q.release(SEC, 1);
        assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
    }

    #[test]
    fn overprovision_mixes_slots_and_fractions_by_memory() {
        let cfg = QueueConfig {
            overprovision: 2,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB]), cfg);
        q.submit(0, 1, whole(1)).unwrap();
        q.submit(0, 2, mem(30)).unwrap();
        q.submit(0, 3, whole(1)).unwrap();
        // The fraction goes first and leaves 50 GiB; the slot lease takes
        // 40 of it; the second slot would need 40 more and waits.
        let l = q.poll(0);
        assert_eq!(placed(&l), vec![(2, vec![0]), (1, vec![0])]);
        assert_eq!(q.leases()[0].committed_mem, 70 * GIB);
        assert_eq!(q.position(0, 3), Some(1));
        q.release(SEC, 2);
        assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![0])]);
    }

    #[test]
    fn overcommit_lets_commitments_exceed_total() {
        let cfg = QueueConfig {
            overcommit: true,
            ..QueueConfig::default()
        };
        let mut q = Queue::new(gpus(&[80 * GIB, 80 * GIB]), cfg);
        for id in 1..=3 {
            q.submit(0, id, mem(60)).unwrap();
        }
        // Where it still fits first, then the least overcommitted GPU.
        assert_eq!(
            placed(&q.poll(0)),
            vec![(1, vec![0]), (2, vec![1]), (3, vec![0])]
        );
        assert_eq!(q.leases()[0].committed_mem, 120 * GIB);
        // Whole GPUs are still exclusive.
        q.submit(0, 4, whole(1)).unwrap();
        assert!(q.poll(0).is_empty());
    }

    #[test]
    fn pinned_requests_go_to_their_gpu_and_hold_it_against_newcomers() {
        let mut q = two_80g();
        q.submit(0, 1, mem(70)).unwrap();
        assert_eq!(placed(&q.poll(0)), vec![(1, vec![0])]);
        // The pod's 20 GiB on GPU 0 wait for job 1's room...
        q.submit(SEC, 2, pinned(&[(0, 20)])).unwrap();
        // ...and a 5 GiB job, which best fit would put into GPU 0's last
        // 10 GiB, goes to GPU 1 instead, as does --no-wait.
        q.submit(SEC, 3, mem(5)).unwrap();
        assert_eq!(placed(&q.poll(SEC)), vec![(3, vec![1])]);
        assert_eq!(q.position(SEC, 2), Some(1));
        let l = q.try_now(SEC, 4, mem(5)).unwrap();
        assert_eq!(l.gpus, [1]);
        q.release(2 * SEC, 1);
        let l = q.poll(2 * SEC);
        assert_eq!(placed(&l), vec![(2, vec![0])]);
        assert_eq!(l[0].mem_cap, Some(20 * GIB));
        assert_eq!(q.leases()[0].committed_mem, 20 * GIB);
        // Pinned requests go before unescalated ones, FIFO among them.
        q.submit(3 * SEC, 5, whole(1)).unwrap();
        q.submit(4 * SEC, 6, pinned(&[(1, 80)])).unwrap();
        q.submit(5 * SEC, 7, pinned(&[(0, 60)])).unwrap();
        let order: Vec<RequestId> = q.waiting(5 * SEC).iter().map(|w| w.id).collect();
        assert_eq!(order, [6, 7, 5]);
        assert_eq!(placed(&q.poll(5 * SEC)), vec![(7, vec![0])]);
        // What is busy names a pod's lease by its pod once it has one.
        q.relabel(7, "container server", Some("ml/infer-0"));
        let e = q.try_now(6 * SEC, 8, mem(1)).unwrap_err();
        assert!(e.reason.contains("pod ml/infer-0"), "{e}");
    }

    #[test]
    fn a_pinned_request_on_several_gpus_takes_each_its_own() {
        let mut q = two_80g();
        let l = q.try_now(0, 1, pinned(&[(1, 30), (0, 10)])).unwrap();
        assert_eq!((l.gpus.clone(), l.mem_cap), (vec![0, 1], None));
        let c: Vec<u64> = q.leases().iter().map(|g| g.committed_mem).collect();
        assert_eq!(c, [10 * GIB, 30 * GIB]);
        q.release(SEC, 1);
        assert!(q.leases().iter().all(|g| g.committed_mem == 0));
        // After a broker restart it is booked where its pins say, whatever
        // GPUs the saved lease listed.
        let l = q.restore(2, pinned(&[(1, 30), (0, 10)]), &[]).unwrap();
        assert_eq!(l.gpus, [0, 1]);
        let c: Vec<u64> = q.leases().iter().map(|g| g.committed_mem).collect();
        assert_eq!(c, [10 * GIB, 30 * GIB]);
    }

    #[test]
    fn bad_pins_are_refused_with_what_would_do() {
        let mut q = two_80g();
        let mut r = pinned(&[(0, 10)]);
        r.pin[0].uuid = "GPU-ffff".into();
        let e = q.submit(0, 1, r).unwrap_err();
        assert!(
            e.reason.contains("GPU-ffff is not a GPU of this broker"),
            "{e}"
        );
        let e = q.submit(0, 2, pinned(&[(0, 10), (0, 5)])).unwrap_err();
        assert!(e.reason.contains("named twice"), "{e}");
        let e = q.submit(0, 3, pinned(&[(1, 81)])).unwrap_err();
        assert!(
            e.reason.contains("81.0 GiB on GPU 1, which has 80.0 GiB"),
            "{e}"
        );
        let mut r = pinned(&[(0, 10)]);
        r.want = Want::Gpus(1);
        let e = q.submit(0, 4, r).unwrap_err();
        assert!(e.reason.contains("sum of its pins"), "{e}");
        // A pinned GPU in MIG mode is named as such.
        let mut q = with_mig();
        let mut r = pinned(&[(0, 5)]);
        r.pin[0].uuid = q.mig().gpus().next().unwrap().uuid.clone();
        let e = q.submit(0, 5, r).unwrap_err();
        assert!(e.reason.contains("in MIG mode"), "{e}");
    }

    #[test]
    fn lease_details_are_queryable() {
        let mut q = two_80g();
        let r = Request {
            compute: Some(30.0),
            limit: Some(0.5),
            label: "python train.py".into(),
            ..whole(2)
        };
        q.submit(0, 9, r.clone()).unwrap();
        q.poll(0);
        assert_eq!(q.lease(9).unwrap().gpus, vec![0, 1]);
        assert_eq!(q.lease_request(9), Some(&r));
        q.release(SEC, 9);
        assert!(q.lease(9).is_none());
        assert!(
            q.leases()
                .iter()
                .all(|g| g.committed_mem == 0 && g.slots_used == 0)
        );
    }

    /// GPU 1 (80 GiB) outside MIG mode, GPU 0 an A100-40GB in MIG mode.
    fn with_mig() -> Queue {
        let mut q = Queue::new(
            vec![GpuInfo {
                index: 1,
                uuid: "GPU-0001".into(),
                total_mem: 80 * GIB,
            }],
            QueueConfig::default(),
        );
        q.set_mig(mig::Planner::new(vec![mig::models::a100_40gb(0)]));
        q
    }

    fn steps(l: &Lease) -> Vec<mig::Step> {
        l.mig.as_ref().unwrap().steps.clone()
    }

    #[test]
    fn memory_goes_to_a_mig_instance_first_then_to_fractions() {
        let mut q = with_mig();
        q.submit(0, 1, mem(4)).unwrap();
        let l = q.poll(0);
        assert_eq!(placed(&l), vec![(1, vec![0])]);
        assert_eq!(l[0].mem_cap, Some(4864 << 20), "the instance's memory");
        assert_eq!(
            steps(&l[0]),
            vec![mig::Step::Create {
                profile: 19,
                placement: mig::Range { start: 6, size: 1 }
            }]
        );
        let done = q.mig_created(1, 7, "MIG-one".into()).unwrap();
        assert_eq!(done.mig.as_ref().unwrap().uuid.as_deref(), Some("MIG-one"));
        assert!(done.mig.as_ref().unwrap().steps.is_empty());
        assert_eq!(q.lease(1), Some(&done));
        // No profile holds 45 GiB: a fraction of GPU 1.
        q.submit(0, 2, mem(45)).unwrap();
        let l = q.poll(0);
        assert_eq!(placed(&l), vec![(2, vec![1])]);
        assert!(l[0].mig.is_none());
        assert_eq!(q.leases()[0].committed_mem, 45 * GIB);
        // The job ends: its instance stays, idle, and the next is given it
        // as it is.
        q.release(SEC, 1);
        q.submit(SEC, 3, mem(2)).unwrap();
        let l = q.poll(SEC);
        let a = l[0].mig.as_ref().unwrap();
        assert_eq!(
            (a.gi, a.uuid.as_deref(), a.steps.len()),
            (Some(7), Some("MIG-one"), 0)
        );
        // A whole GPU only ever means one outside MIG mode.
        q.release(SEC, 2);
        q.submit(SEC, 4, whole(1)).unwrap();
        assert_eq!(placed(&q.poll(SEC)), vec![(4, vec![1])]);
    }

    #[test]
    fn a_failed_instance_waits_again_where_it_was() {
        let mut q = with_mig();
        // GPU 1 is taken whole, so memory can only go to MIG.
        q.submit(0, 1, whole(1)).unwrap();
        assert_eq!(placed(&q.poll(0)), vec![(1, vec![1])]);
        q.submit(SEC, 2, mem(30)).unwrap();
        q.submit(2 * SEC, 3, mem(30)).unwrap();
        let l = q.poll(2 * SEC);
        assert_eq!(placed(&l), vec![(2, vec![0])]);
        assert_eq!(steps(&l[0]).len(), 1, "a 7g.40gb to create");
        assert_eq!(q.position(2 * SEC, 3), Some(1));
        let found = vec![(1, 5, mig::Range { start: 0, size: 4 }, vec!["MIG-x".into()])];
        assert!(q.mig_failed(3 * SEC, 2, Some(&found)));
        let w = q.waiting(3 * SEC);
        assert_eq!(
            w.iter().map(|w| (w.id, w.since)).collect::<Vec<_>>(),
            vec![(2, SEC), (3, 2 * SEC)],
            "back in its place, with its age"
        );
        assert!(q.lease(2).is_none());
        // The driver says a 4g.20gb (made by hand) is there: nothing holds
        // 30 GiB now; and the failed slices are avoided for a while anyway.
        assert!(q.poll(3 * SEC).is_empty());
        assert!(q.mig().avoiding(3 * SEC));
        // try_now leases are not queued again.
        let mut q = with_mig();
        let l = q.try_now(0, 9, mem(4)).unwrap();
        assert!(!steps(&l).is_empty());
        assert!(!q.mig_failed(0, 9, None));
        assert!(q.waiting(0).is_empty());
    }

    #[test]
    fn mig_refusals_name_the_largest_profile() {
        let mut q = Queue::new(vec![], QueueConfig::default());
        q.set_mig(mig::Planner::new(vec![mig::models::a100_40gb(0)]));
        let e = q.submit(0, 1, mem(45)).unwrap_err();
        assert!(
            e.reason.starts_with(
                "requested 45.0 GiB but no MIG profile holds it: the largest is 7g.40gb (39.2 GiB, GPU 0), \
                 and no GPU of this node is outside MIG mode; ask for at most --gpu-memory 39.25G"
            ),
            "{e}"
        );
        let e = q.submit(0, 2, whole(1)).unwrap_err();
        assert!(
            e.reason
                .contains("every GPU of this node is in MIG mode (GPU 0)"),
            "{e}"
        );
        assert!(
            e.reason
                .ends_with("ask for --gpu-memory instead, at most (the 7g.40gb profile of GPU 0): --gpu-memory 39.25G"),
            "{e}"
        );
        let mut q = with_mig();
        let e = q.submit(0, 3, mem(90)).unwrap_err();
        assert!(
            e.reason
                .contains("the largest GPU outside MIG mode has 80.0 GiB (GPU 1)"),
            "{e}"
        );
        assert!(
            e.reason.ends_with("ask for at most --gpu-memory 80G"),
            "{e}"
        );
        let e = q.submit(0, 4, whole(2)).unwrap_err();
        assert!(
            e.reason
                .contains("GPUs in MIG mode (GPU 0) are handed out only as MIG instances"),
            "{e}"
        );
        // Restored leases find their instance, or are refused.
        q.mig_sync(
            0,
            0,
            &[(
                3,
                19,
                mig::Range { start: 6, size: 1 },
                vec!["MIG-a".into()],
            )],
        );
        let l = q.restore_mig(5, mem(4), 0, "MIG-a").unwrap();
        assert_eq!((l.gpus.clone(), l.mem_cap), (vec![0], Some(4864 << 20)));
        assert!(q.restore_mig(6, mem(4), 0, "MIG-b").is_err());
        // What is busy, for --no-wait, names the MIG GPU too.
        q.submit(0, 7, whole(1)).unwrap();
        q.poll(0);
        let e = q.try_now(0, 8, mem(70)).unwrap_err();
        assert!(e.reason.contains("GPU 0 (MIG): 1 instances in use"), "{e}");
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Submit(Want),
            /// GiB on the GPU at this position (mod the count), and on the
            /// next one too if the second is non-zero.
            Pin(usize, u64, u64),
            TryNow(Want),
            Release(usize),
            Cancel(usize),
            Advance(Nanos),
            Poll,
        }

        fn want() -> impl Strategy<Value = Want> {
            prop_oneof![
                (0..4u32).prop_map(Want::Gpus),
                (0..90u64).prop_map(|g| Want::Memory(g * GIB + 7)),
            ]
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                3 => want().prop_map(Op::Submit),
                1 => (any::<usize>(), 1..90u64, prop_oneof![Just(0u64), 1..30u64])
                    .prop_map(|(g, a, b)| Op::Pin(g, a, b)),
                1 => want().prop_map(Op::TryNow),
                2 => any::<usize>().prop_map(Op::Release),
                1 => any::<usize>().prop_map(Op::Cancel),
                1 => (0..20 * SEC).prop_map(Op::Advance),
                2 => Just(Op::Poll),
            ]
        }

        fn config() -> impl Strategy<Value = (Vec<u64>, QueueConfig)> {
            (
                prop::collection::vec(
                    prop_oneof![Just(16 * GIB), Just(24 * GIB + 3), Just(80 * GIB)],
                    0..4,
                ),
                1..4u32,
                prop_oneof![Just(Placement::BestFit), Just(Placement::Spread)],
                0..30 * SEC,
            )
                .prop_map(|(totals, f, placement, escalate_after)| {
                    (
                        totals,
                        QueueConfig {
                            escalate_after,
                            overprovision: f,
                            overcommit: false,
                            placement,
                        },
                    )
                })
        }

        fn check(q: &Queue, now: Nanos, just_polled: bool) {
            let f = q.cfg.overprovision;
            for (i, g) in q.gpus.iter().enumerate() {
                assert!(g.committed <= g.info.total_mem, "GPU {i} overcommitted");
                assert!(g.slots_used <= f);
                if f == 1 && g.slots_used == 1 {
                    assert_eq!(g.leases.len(), 1, "whole GPU shared");
                }
                let (mut mem, mut slots, mut n) = (0, 0, 0);
                for h in q.held.values() {
                    for s in h.shares.iter().filter(|s| s.gpu == i) {
                        mem += s.mem;
                        slots += u32::from(s.slot);
                        n += 1;
                    }
                }
                assert_eq!((g.committed, g.slots_used, g.leases.len()), (mem, slots, n));
            }
            for (id, h) in &q.held {
                assert!(h.lease.gpus.windows(2).all(|w| w[0] < w[1]));
                assert!(!q.waiting.iter().any(|w| w.id == *id));
                match h.req.want {
                    Want::Memory(_) if !h.req.pin.is_empty() => {
                        assert_eq!(h.lease.gpus.len(), h.req.pin.len());
                        let cap = h.req.pin[0].mem;
                        assert_eq!(h.lease.mem_cap, (h.req.pin.len() == 1).then_some(cap));
                        for p in &h.req.pin {
                            assert!(h.lease.uuids.contains(&p.uuid));
                        }
                    }
                    Want::Memory(b) => {
                        assert_eq!(h.lease.mem_cap, Some(b));
                        assert_eq!(h.lease.gpus.len(), 1);
                    }
                    Want::Gpus(n) => assert_eq!(h.lease.gpus.len(), n as usize),
                }
            }
            if just_polled {
                // Backfill is complete: up to the first blocked escalated
                // request, nothing still waiting fits (but where pinned
                // requests before it wait).
                let mut reserved = Vec::new();
                for i in q.order(now) {
                    let w = &q.waiting[i];
                    assert!(
                        q.plan(now, &w.req, &reserved).is_none(),
                        "request {} fits",
                        w.id
                    );
                    reserved.extend(w.req.pin.iter().filter_map(|p| q.gpu_of(&p.uuid)));
                    if q.is_escalated(now, w) {
                        break;
                    }
                }
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]
            #[test]
            fn commitments_stay_within_totals((totals, cfg) in config(), ops in prop::collection::vec(op(), 1..120)) {
                let mut q = Queue::new(gpus(&totals), cfg);
                let mut now = 0;
                let mut next_id = 0;
                let mut ids: Vec<RequestId> = Vec::new();
                for op in ops {
                    let mut polled = false;
                    match op {
                        Op::Submit(w) => {
                            next_id += 1;
                            if q.submit(now, next_id, req(w)).is_ok() {
                                ids.push(next_id);
                            }
                        }
                        Op::Pin(g, a, b) if !totals.is_empty() => {
                            let n = totals.len();
                            let mut on = vec![((g % n) as u32, a)];
                            if b > 0 && n > 1 {
                                on.push((((g + 1) % n) as u32, b));
                            }
                            next_id += 1;
                            if q.submit(now, next_id, pinned(&on)).is_ok() {
                                ids.push(next_id);
                            }
                        }
                        Op::TryNow(w) => {
                            next_id += 1;
                            if q.try_now(now, next_id, req(w)).is_ok() {
                                ids.push(next_id);
                            }
                        }
                        Op::Release(k) if !ids.is_empty() => {
                            let id = ids.remove(k % ids.len());
                            q.release(now, id);
                        }
                        Op::Cancel(k) if !ids.is_empty() => {
                            let id = ids.remove(k % ids.len());
                            q.cancel(now, id);
                        }
                        Op::Advance(dt) => now += dt,
                        Op::Poll => {
                            q.poll(now);
                            polled = true;
                        }
                        _ => {}
                    }
                    check(&q, now, polled);
                    let w = q.waiting(now);
                    prop_assert!(w.iter().enumerate().all(|(i, s)| s.position == i + 1));
                }
            }
        }
    }
}
