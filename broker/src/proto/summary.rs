//! What a job has had, for its run's end-of-job line: asked by the run
//! (with its job's token, which only the job's environment holds) on a
//! connection of its own just before it ends, while the lease still
//! holds. One request takes one of the user's status pages (`voice`), so
//! that asking cannot cost the broker more than status can.

use gpufrac_common::wire::ServerMsg;

use super::{Broker, ConnId, Nanos};
use crate::status::JobSummary;

impl Broker {
    pub(super) fn summary(&mut self, now: Nanos, id: ConnId, token: u64) {
        let Some(peer) = self.conns.get(&id).map(|c| c.peer.clone()) else {
            return;
        };
        let reply = match self.ledger.jobs().entry(&token) {
            // The token proves the job; the user's own (or root) only, so
            // that a leaked token tells nobody else anything.
            Some(e) if e.job.uid == peer.uid || peer.uid == 0 => {
                if self.voices.page(peer.uid, now) {
                    Ok(())
                } else {
                    Err("too many status and summary requests of this user; retry in a moment")
                }
            }
            _ => Err("this broker has no such job (it ended, or was never this user's)"),
        };
        if let Err(reason) = reply {
            return self.send(
                id,
                &ServerMsg::Refused {
                    reason: reason.into(),
                },
            );
        }
        let members: Vec<ConnId> = self.ledger.jobs().members(&token).collect();
        let gpus: Vec<usize> = members
            .iter()
            .filter_map(|m| self.conns.get(m))
            .flat_map(|c| c.devices().iter().map(|d| d.gpu))
            .collect();
        let live = self.spent(now, &members, gpus);
        let Some(e) = self.ledger.jobs().entry(&token) else {
            return;
        };
        let secs = |ns: u64| ns as f64 / 1e9;
        let summary = JobSummary {
            job: e.job.pid,
            gpus: self
                .ledger
                .queue()
                .lease(token)
                .map_or_else(Vec::new, |l| l.gpus.clone()),
            queued_s: secs(e.queued_ns),
            held_s: e.leased_at.map_or(0.0, |t| secs(now.saturating_sub(t))),
            gpu_s: secs(e.gpu_ns.saturating_add(live.gpu_ns)),
            owed_s: secs(e.owed_ns.saturating_add(live.owed_ns)),
            peak_mem: e.peak,
            mem_cap: e.job.mem_cap,
            refusals: e.ooms.saturating_add(live.ooms),
            compute: e.job.compute,
            limit: e.job.limit,
        };
        let json = serde_json::to_string(&summary).unwrap_or_default();
        self.send(id, &ServerMsg::SummaryReply { json });
    }
}
