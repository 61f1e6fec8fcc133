//! Leases on MIG instances (`--mig dynamic`): the socket layer makes and
//! destroys instances and reports back here; the planner (`crate::mig`) keeps
//! the books.

use super::refusals::refuse;
use super::{Lease, Nanos, Queue, Refusal, Request, RequestId, Waiter};
use crate::mig;

impl Queue {
    /// Hands the GPUs in MIG mode to the queue (`--mig dynamic`).
    pub fn set_mig(&mut self, planner: mig::Planner) {
        self.mig = planner;
    }

    pub fn mig(&self) -> &mig::Planner {
        &self.mig
    }

    /// The driver's word on GPU `index`'s instances (at start, after a
    /// failure).
    #[cfg(test)]
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
                    told: None,
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
}
