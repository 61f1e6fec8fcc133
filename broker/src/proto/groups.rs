//! Each process's place in its GPUs' schedulers: the unit it counts in
//! (its job, or its user's processes outside any job) with the unit's
//! settings, and the user its time counts for with that user's weight.

use super::conn::Conn;
use super::{Broker, ConnId, Nanos};
use crate::sched::{GroupId, UserId};

/// Fairness units: a job's is its token, a user's its uid (tagged).
const UID_UNIT: GroupId = 1 << 63;
/// Weight of a process that set no GPU_COMPUTE_SHARE: as if it asked 50%,
/// so two such processes split evenly and every share is a plain weight.
pub const DEFAULT_WEIGHT: f64 = 50.0;

impl Broker {
    /// Puts a process in its unit's scheduler group with the unit's
    /// settings: a job's `--gpu-compute` is the unit's weight, its
    /// `--gpu-limit` a ceiling for all its processes together on each
    /// GPU, its `--priority` every process's class. Outside a job, a
    /// user's processes form the unit. Above units, users share the GPU
    /// by their weights.
    pub(super) fn enforce(&mut self, now: Nanos, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let Some(s) = c.shim() else {
            return;
        };
        let job = s.member_of;
        let j = job.and_then(|t| self.ledger.jobs().get(&t));
        let group = match job {
            Some(t) => t & !UID_UNIT,
            None => UID_UNIT | u64::from(c.peer.uid),
        };
        let (unit_weight, unit_limit, job_prio) =
            j.map_or((None, None, None), |j| (j.compute, j.limit, j.priority));
        let (user, user_weight) = self.user_of(c);
        for d in &s.devices {
            self.gpus[d.gpu].registered(c.peer.pid, id);
            let sched = &mut self.gpus[d.gpu].sched;
            sched.add_client(
                now,
                id,
                s.share.unwrap_or(DEFAULT_WEIGHT),
                s.limit,
                job_prio.unwrap_or(s.priority),
            );
            sched.set_unit(
                now,
                id,
                group,
                unit_weight,
                unit_limit,
                Some((UserId::from(user), user_weight)),
            );
        }
    }

    /// The user a process's GPU time counts for, and that user's weight.
    /// A job's processes are its user's, whoever runs them (a pod's, a
    /// root helper joined by token): one user, one part of the GPU.
    pub(super) fn user_of(&self, c: &Conn) -> (u32, f64) {
        let user = c
            .member_of()
            .and_then(|t| self.ledger.jobs().get(&t))
            .map_or(c.peer.uid, |j| j.uid);
        let weight = if user == c.peer.uid && !self.cfg.weights.groups.is_empty() {
            let gids: Vec<u32> = std::iter::once(c.peer.gid)
                .chain(c.peer.groups.iter().copied())
                .collect();
            self.cfg.weights.of(user, &gids)
        } else {
            self.cfg.weights.of(user, &[])
        };
        (user, weight)
    }
}
