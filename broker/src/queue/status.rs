//! What the queue shows: waiting requests in queue order, the leases on
//! each GPU, and a lease's details; and relabelling for those views.

use super::{Lease, LeaseStatus, Nanos, Queue, Request, RequestId, WaitingStatus};

impl Queue {
    /// Whether any request waits (without ordering them, as `waiting` does).
    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
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
}
