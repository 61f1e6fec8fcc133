//! Where a request goes: whole GPUs, memory fractions (best-fit or
//! spread), a MIG instance or its pinned GPUs; and booking the lease.

use std::cmp::Reverse;

use super::{
    GpuState, Held, Lease, Nanos, Placed, Placement, Queue, Request, RequestId, Share, Want,
};
use crate::mig;

impl Queue {
    /// The position in `gpus` of the GPU with this UUID.
    pub(super) fn gpu_of(&self, uuid: &str) -> Option<usize> {
        self.gpus
            .iter()
            .position(|g| g.info.uuid.eq_ignore_ascii_case(uuid))
    }

    pub(super) fn slot_mem(&self, g: &GpuState) -> u64 {
        g.info.total_mem / u64::from(self.cfg.overprovision)
    }

    pub(super) fn fits_whole(&self, g: &GpuState) -> bool {
        if g.slots_used >= self.cfg.overprovision {
            return false;
        }
        if self.cfg.overprovision == 1 {
            return g.leases.is_empty() && g.outside == 0;
        }
        self.cfg.overcommit || g.uncommitted() >= i128::from(self.slot_mem(g))
    }

    /// What could fit now at best, reservations aside.
    pub(super) fn room(&self) -> Room {
        let open = self
            .gpus
            .iter()
            .filter(|g| g.slots_used < self.cfg.overprovision);
        Room {
            whole: self.gpus.iter().filter(|g| self.fits_whole(g)).count(),
            mem: open.clone().map(GpuState::uncommitted).max(),
            overcommit: self.cfg.overcommit,
            mig: !self.mig.is_empty(),
        }
    }

    /// Where `req` would go now, or None if it must wait: its pinned GPUs
    /// if it has them; else a MIG instance if one can be had, else a GPU
    /// outside MIG mode other than the `reserved` ones (positions in
    /// `gpus`).
    pub(super) fn plan(&self, now: Nanos, req: &Request, reserved: &[usize]) -> Option<Placed> {
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

    pub(super) fn commit_placed(
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
    pub(super) fn hold_mig(
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

    pub(super) fn commit(&mut self, id: RequestId, req: Request, mut shares: Vec<Share>) -> Lease {
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
}

/// What could fit at best: an upper bound on what `plan` finds, cheap to
/// test against a request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Room {
    /// GPUs that could take a whole-GPU lease.
    whole: usize,
    /// The most uncommitted memory of a GPU with a free slot; None: none
    /// has one.
    mem: Option<i128>,
    overcommit: bool,
    /// GPUs in MIG mode, whose instances the planner may find.
    mig: bool,
}

impl Room {
    /// False only when `plan` would find nowhere for `req`.
    pub(super) fn may_fit(&self, req: &Request) -> bool {
        match req.want {
            _ if !req.pin.is_empty() => true,
            Want::Gpus(n) => self.may_fit_gpus(n),
            Want::Memory(b) => self.may_fit_memory(b),
        }
    }

    pub(super) fn may_fit_gpus(&self, n: u32) -> bool {
        n as usize <= self.whole
    }

    pub(super) fn may_fit_memory(&self, b: u64) -> bool {
        self.mig
            || self
                .mem
                .is_some_and(|m| self.overcommit || m >= i128::from(b))
    }
}
