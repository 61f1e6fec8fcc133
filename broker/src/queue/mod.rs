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
mod tests;
