//! What an escalated request holds back while it waits: only GPUs it could
//! use, only as many as it needs, and none while its own user's leases
//! stand in its way (SPEC §2, invariant 4: no idle GPU while a request it
//! could serve waits).
//!
//! An escalated request that does not fit reserves, for `--gpus N`, N GPUs
//! outside MIG mode that it could have once other users' leases end,
//! preferring those free now; for `--gpu-memory B`, the one such GPU
//! closest to fitting it. Nobody younger is placed on a reserved GPU, so
//! those drain towards it; every other GPU stays open to the rest of the
//! queue. A request its own user blocks holds GPUs back from that user's
//! younger requests only: that user decides when its leases end, and a
//! 1-byte lease held forever beside an escalated `--gpus 2` once kept every
//! other user's request off an idle GPU. Its own user blocks it through
//! that user's leases and through the GPUs held back, from that user only,
//! for that user's earlier requests: otherwise a younger request stuck
//! behind its own user's older one would hold an idle GPU against everyone
//! while it could not take the GPU itself, and nobody could.

use std::cmp::Reverse;

use super::{GpuState, Queue, Request, Want};

impl Queue {
    /// What `req`'s own user holds on `g`: (slots, memory).
    fn own_on(&self, gpu: usize, uid: u32) -> (u32, u64) {
        self.held
            .values()
            .filter(|h| h.req.uid == uid)
            .flat_map(|h| h.shares.iter().filter(|s| s.gpu == gpu))
            .fold((0, 0), |(n, m), s| (n + u32::from(s.slot), m + s.mem))
    }

    /// Whether `g` could take `req`'s share of it once every lease of
    /// other users on it had ended and nothing held it back for other
    /// users' requests.
    fn could_hold(&self, gpu: usize, g: &GpuState, req: &Request, holds: &[Hold]) -> bool {
        if holds
            .iter()
            .any(|h| h.gpu == gpu && h.only == Some(req.uid))
        {
            return false;
        }
        let (own_slots, own_mem) = self.own_on(gpu, req.uid);
        let own_leases = g
            .leases
            .iter()
            .filter(|l| self.held.get(l).is_some_and(|h| h.req.uid == req.uid))
            .count();
        let f = self.cfg.overprovision;
        let room = |need: u64| {
            self.cfg.overcommit
                || i128::from(g.info.total_mem) - i128::from(own_mem) >= i128::from(need)
        };
        match req.want {
            // With F = 1 a whole GPU is exclusive: any lease of its own
            // user on it blocks it.
            Want::Gpus(_) if f == 1 => own_leases == 0,
            Want::Gpus(_) => own_slots < f && room(self.slot_mem(g)),
            Want::Memory(b) => own_slots < f && room(b),
        }
    }

    /// The GPUs (positions in `gpus`) an escalated request that does not
    /// fit holds back, and from whom: from everyone, or, while its own
    /// user blocks it, from that user's younger requests only. `holds`:
    /// what the requests ahead of it hold back. Empty when it could never
    /// fit here (MIG instances are the planner's, and a request of GPUs
    /// never goes there).
    pub(super) fn reservation(&self, req: &Request, holds: &[Hold]) -> Vec<Hold> {
        if !req.pin.is_empty() {
            return Vec::new();
        }
        let reserved = closed_to(holds, req.uid);
        let mut c: Vec<(usize, &GpuState, bool)> = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| (i, g, self.could_hold(i, g, req, holds)))
            .filter(|&(_, g, _)| match req.want {
                Want::Gpus(_) => true,
                Want::Memory(b) => self.cfg.overcommit || g.info.total_mem >= b,
            })
            .collect();
        let (n, blocked) = match req.want {
            Want::Gpus(n) => {
                // Those it could have first; among them free ones, then
                // those not held back for an earlier escalated request,
                // then the fewest leases to wait for.
                c.sort_by_key(|&(i, g, could)| {
                    (
                        !could,
                        !g.leases.is_empty(),
                        reserved.contains(&i),
                        g.leases.len(),
                        i,
                    )
                });
                let could = c.iter().filter(|x| x.2).count();
                (n as usize, could < n as usize)
            }
            Want::Memory(_) => {
                c.sort_by_key(|&(i, g, could)| {
                    (!could, reserved.contains(&i), Reverse(g.uncommitted()), i)
                });
                (1, !c.first().is_some_and(|x| x.2))
            }
        };
        if c.len() < n {
            return Vec::new();
        }
        let only = blocked.then_some(req.uid);
        c.into_iter()
            .take(n)
            .map(|(gpu, _, _)| Hold { gpu, only })
            .collect()
    }
}

/// A GPU held back for a request ahead in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hold {
    pub gpu: usize,
    /// Held back only from this user's requests (an escalated request its
    /// own user's leases block: that user's younger requests still wait
    /// behind it, nobody else's); None: from everyone's.
    pub only: Option<u32>,
}

/// The GPUs `holds` close to a request of `uid`.
pub(super) fn closed_to(holds: &[Hold], uid: u32) -> Vec<usize> {
    holds
        .iter()
        .filter(|h| h.only.is_none_or(|u| u == uid))
        .map(|h| h.gpu)
        .collect()
}
