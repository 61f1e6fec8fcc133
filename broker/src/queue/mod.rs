//! GPU admission queue for `gpufrac run` (the README's `gpufrac run` section).
//!
//! A pure state machine: no I/O, no clock. The socket layer submits requests,
//! reports ends of leases, and calls [`Queue::poll`] after every change
//! (submit, cancel, release) to learn which waiting requests were placed.
//! Escalation needs no timer of its own: it only reorders the queue and
//! holds GPUs back (`reserve`), and neither ever makes a request fit that
//! did not fit before, so the next event's `poll` is always soon enough.
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
//! planner (`mig/`) owns them. A memory request goes to a MIG instance
//! whenever one can be had now (reused, created, or created after
//! destroying idle ones), else to a fraction of a GPU outside MIG mode,
//! else it waits for whichever frees first. Whole-GPU requests never go to
//! MIG GPUs: CUDA shows a process one MIG device at most, so `--gpus N`
//! could not use what it was given. A MIG lease comes out of `poll` with
//! the steps (destroy, create) the socket layer carries out before
//! delivering it, and reports back with `mig_created` or `mig_failed`.
//!
//! Rooms: `types` (requests, leases, what status shows), `placement`
//! (where a request goes, and booking it), `pinned` (the device plugin's
//! pods), `mig_leases` (leases on MIG instances), `refusals` (what is
//! refused, in words), `status`, `why` (why a waiting request waits,
//! in words); this file holds the books, the queue
//! order and the entry points.

mod line;
mod mig_leases;
mod pinned;
mod placement;
mod refusals;
mod reserve;
mod status;
#[cfg(test)]
pub(crate) use status::{FAR_PER_WALK, RETELL_EVERY, due, retell_after};
mod types;
mod why;

use std::collections::BTreeMap;

use line::Line;
use refusals::{plural, refuse, want_text};
use reserve::{Hold, closed_to};

use crate::mig;

pub use pinned::pinned_total;
pub use types::{
    GpuInfo, Lease, LeaseStatus, Nanos, Pinned, Placement, QueueConfig, Refusal, Request,
    RequestId, WaitingStatus, Want,
};
pub use why::Why;

#[derive(Debug, Clone)]
struct Waiter {
    id: RequestId,
    req: Request,
    since: Nanos,
    seq: u64,
    /// The place it was last told and when (`positions_to_tell`); None:
    /// not yet.
    told: Option<(u32, Nanos)>,
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
    /// Memory the driver says processes outside gpufrac hold here (no
    /// lease's, no shim's): as taken as committed memory is.
    outside: u64,
}

impl GpuState {
    fn uncommitted(&self) -> i128 {
        self.info.total_mem as i128 - self.committed as i128 - self.outside as i128
    }
}

#[derive(Debug, Clone)]
pub struct Queue {
    cfg: QueueConfig,
    /// Sorted by index. GPUs in MIG mode are in `mig` instead.
    gpus: Vec<GpuState>,
    waiting: Line,
    held: BTreeMap<RequestId, Held>,
    next_seq: u64,
    mig: mig::Planner,
    /// New requests told their place without a walk, to be sent
    /// (`take_fresh`); and whether one waits for a walk to be told.
    fresh: Vec<(RequestId, u32, Want)>,
    walk: bool,
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
                    outside: 0,
                })
                .collect(),
            waiting: Line::default(),
            held: BTreeMap::new(),
            next_seq: 0,
            mig: mig::Planner::default(),
            fresh: Vec::new(),
            walk: false,
        }
    }

    pub fn gpus(&self) -> impl Iterator<Item = &GpuInfo> {
        self.gpus.iter().map(|g| &g.info)
    }

    /// The memory processes outside gpufrac hold on the GPU with this
    /// UUID, as the driver last listed them: placement counts it as taken
    /// (a fraction never goes where it is not free; a whole GPU is one
    /// with none of it). Whether it changed: then `poll`, as after a
    /// release.
    pub fn set_outside(&mut self, uuid: &str, bytes: u64) -> bool {
        let Some(i) = self.gpu_of(uuid) else {
            return false;
        };
        let g = &mut self.gpus[i];
        let changed = g.outside != bytes;
        g.outside = bytes;
        changed
    }

    /// Queues a request. Refuses at once what no GPU of this node could ever
    /// satisfy, and ids already in use. Call `poll` afterwards.
    ///
    /// A new request is told its place at once (`take_fresh`): the newest
    /// fraction's is the last (it goes after every earlier whole-GPU
    /// request and fraction, and escalated ones go first), so it needs no
    /// walk; any other is told by a walk due now (`must_walk`).
    pub fn submit(&mut self, now: Nanos, id: RequestId, req: Request) -> Result<(), Refusal> {
        let want = (req.pin.is_empty()).then_some(req.want);
        self.file(now, id, req)?;
        match want {
            Some(want @ Want::Memory(_)) => {
                let place = u32::try_from(self.waiting.len()).unwrap_or(u32::MAX);
                if let Some(w) = self.waiting.get_mut(id) {
                    w.told = Some((place, now));
                }
                self.fresh.push((id, place, want));
            }
            _ => self.walk = true,
        }
        Ok(())
    }

    fn file(&mut self, since: Nanos, id: RequestId, req: Request) -> Result<(), Refusal> {
        self.check(id, &req)?;
        self.waiting.push(Waiter {
            id,
            req,
            since,
            seq: self.next_seq,
            told: None,
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
        self.file(since, id, req)?;
        self.walk = true;
        Ok(())
    }

    /// Books a lease that was running before a restart on the GPUs it held
    /// (by index), whatever else is booked: the job is running there. GPUs
    /// this node no longer has are left out.
    pub fn restore(&mut self, id: RequestId, req: Request, gpus: &[u32]) -> Result<Lease, Refusal> {
        if self.held.contains_key(&id) || self.waiting.contains(id) {
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
    /// takes a GPU that a request ahead of it waits for: an escalated or
    /// pinned one, or a whole-GPU one it does not go before (a request
    /// made now goes after every other fraction and every whole-GPU
    /// request for as many GPUs or fewer). Any other GPU it may have.
    pub fn try_now(&mut self, now: Nanos, id: RequestId, req: Request) -> Result<Lease, Refusal> {
        self.check(id, &req)?;
        // What the requests ahead hold back: (the hold, its request's
        // place, whether that request is escalated, pinned).
        let mut holds: Vec<(Hold, usize, bool, bool)> = Vec::new();
        for (place, i) in self.order(now).into_iter().enumerate() {
            let w = &self.waiting[i];
            let (escalated, pinned) = (self.is_escalated(now, w), !w.req.pin.is_empty());
            let ahead = match (w.req.want, req.want) {
                (Want::Gpus(m), Want::Gpus(n)) if !escalated && !pinned => m <= n,
                _ => true,
            };
            if ahead {
                let plain: Vec<Hold> = holds.iter().map(|h| h.0).collect();
                let held = self.held_back(now, w, &plain);
                holds.extend(held.into_iter().map(|h| (h, place, escalated, pinned)));
            }
        }
        let fits_without = |drop: &dyn Fn(bool, bool) -> bool| {
            let kept: Vec<Hold> = holds
                .iter()
                .filter(|h| !drop(h.2, h.3))
                .map(|h| h.0)
                .collect();
            self.plan(now, &req, &closed_to(&kept, req.uid)).is_some()
        };
        let (by_escalated, by_whole) = (
            fits_without(&|escalated, _| escalated),
            fits_without(&|escalated, pinned| escalated || !pinned),
        );
        let mut escalated: Vec<usize> = holds
            .iter()
            .filter(|h| h.2 && h.0.only.is_none_or(|u| u == req.uid))
            .map(|h| h.1)
            .collect();
        escalated.dedup();
        match self.plan(
            now,
            &req,
            &closed_to(&holds.iter().map(|h| h.0).collect::<Vec<_>>(), req.uid),
        ) {
            Some(plan) => Ok(self.commit_placed(id, req, plan, None)),
            None if by_escalated => Err(refuse(format!(
                "the GPUs free now are held for {} that waited longer than the escalation \
                 limit and must be placed first; retry later or drop --no-wait to queue",
                plural(escalated.len() as u64, "queued request", "queued requests")
            ))),
            None if by_whole => Err(refuse(
                "the GPUs free now are held for earlier queued requests for whole GPUs, \
                 which go first (a request takes no GPU that one ahead of it waits for); \
                 retry later or drop --no-wait to queue",
            )),
            None => Err(refuse(format!(
                "no room now for {}: {}; drop --no-wait to queue",
                want_text(req.want),
                self.busy_summary()
            ))),
        }
    }

    /// The GPUs a waiting request that does not fit holds back from those
    /// behind it: a pinned one's GPUs; an escalated one's reservation, and
    /// a whole-GPU one's (fractions backfill only where they delay no
    /// earlier whole-GPU request). A fraction that is not escalated holds
    /// nothing. `holds`: what the requests ahead of it hold back.
    fn held_back(&self, now: Nanos, w: &Waiter, holds: &[Hold]) -> Vec<Hold> {
        if !w.req.pin.is_empty() {
            return w
                .req
                .pin
                .iter()
                .filter_map(|p| self.gpu_of(&p.uuid))
                .map(|gpu| Hold { gpu, only: None })
                .collect();
        }
        let holds_any = self.is_escalated(now, w) || matches!(w.req.want, Want::Gpus(_));
        // Once every GPU is held from everyone, another hold adds nothing:
        // a long queue is walked without working out each one's.
        let all_held =
            (0..self.gpus.len()).all(|gpu| holds.iter().any(|h| h.gpu == gpu && h.only.is_none()));
        if holds_any && !all_held {
            self.reservation(&w.req, holds)
        } else {
            Vec::new()
        }
    }

    /// The waiting `run` died or gave up. A lease under that id (granted
    /// before the caller noticed) is released, so nothing leaks.
    pub fn cancel(&mut self, now: Nanos, id: RequestId) {
        if self.waiting.remove(id).is_none() {
            self.release(now, id);
        }
    }

    /// The lease ended. A waiting request under that id is dropped instead.
    pub fn release(&mut self, now: Nanos, id: RequestId) {
        let Some(held) = self.held.remove(&id) else {
            self.waiting.remove(id);
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
    /// smaller requests into holes; but an escalated request that does not
    /// fit holds back the GPUs it waits for (`reserve`), so that they drain
    /// towards it instead of being taken by a stream of small jobs, while
    /// every other GPU stays open to the rest of the queue.
    pub fn poll(&mut self, now: Nanos) -> Vec<Lease> {
        let mut placed = Vec::new();
        // What a waiting request holds back depends on the leases of the
        // moment (free GPUs first, the fewest leases to wait for), and a
        // pass places requests after the holds before them were worked
        // out. So while a pass both placed something and held something
        // back, the next pass works the holds out again from the new
        // leases; otherwise a request could be left waiting behind a hold
        // that, by the end of the poll, no longer covers the GPU it fits
        // on. Without holds one pass is enough: placing only takes room.
        loop {
            let (n, held_any) = self.pass(now, &mut placed);
            if n == 0 || !held_any {
                return placed;
            }
        }
    }

    /// One walk of the queue in order, placing what fits: (how many were
    /// placed, whether anything was held back).
    fn pass(&mut self, now: Nanos, placed: &mut Vec<Lease>) -> (usize, bool) {
        let room = self.room();
        // Nothing can be placed when not even the smallest request waiting
        // would fit anywhere: a queue that only grows or loses waiting
        // requests is not walked.
        if !self.waiting.any_pinned()
            && !self
                .waiting
                .fewest_gpus()
                .is_some_and(|n| room.may_fit_gpus(n))
            && !self
                .waiting
                .least_memory()
                .is_some_and(|b| room.may_fit_memory(b))
        {
            return (0, false);
        }
        let mut n = 0;
        // GPUs that requests ahead wait for (pinned, escalated and
        // whole-GPU ones): nobody after them may take room there.
        let mut holds = Vec::new();
        // What could fit at best, reservations aside: placing only takes
        // room, so it stays an upper bound through the walk, and a request
        // past it is passed over without working out where it would go.
        for slot in self.order(now) {
            let w = &self.waiting[slot];
            let plan = if room.may_fit(&w.req) {
                self.plan(now, &w.req, &closed_to(&holds, w.req.uid))
            } else {
                None
            };
            match plan {
                Some(plan) => {
                    let id = w.id;
                    let w = self.waiting.remove(id).expect("walked from the line");
                    placed.push(self.commit_placed(id, w.req, plan, Some((w.since, w.seq))));
                    n += 1;
                }
                None => {
                    let held = self.held_back(now, w, &holds);
                    holds.extend(held);
                }
            }
        }
        (n, !holds.is_empty())
    }

    fn is_escalated(&self, now: Nanos, w: &Waiter) -> bool {
        now.saturating_sub(w.since) >= self.cfg.escalate_after
    }

    /// Each waiting request's slot in `waiting`, in queue order (`line`).
    fn order(&self, now: Nanos) -> Vec<line::Slot> {
        self.waiting.order(now, self.cfg.escalate_after)
    }
}

#[cfg(test)]
mod tests;
