//! What the scheduler reports: each client's state, share and charges
//! for status, and who holds the GPU.

use super::clock::band;
use super::{ClientId, ClientState, ClientStatus, ClientTimes, Nanos, Priority, Scheduler};

impl Scheduler {
    pub fn status(&self, now: Nanos) -> Vec<ClientStatus> {
        let now = now.max(self.now);
        let active = |c: &super::Client| c.state != ClientState::Idle;
        // By id, as a B-tree held them: the sums below add in that order.
        let mut clients: Vec<(ClientId, &super::Client)> =
            self.clients.iter().map(|(&id, c)| (id, c)).collect();
        clients.sort_unstable_by_key(|&(id, _)| id);
        // `high` and `normal` share a band, and so the GPU by weight.
        let top = clients
            .iter()
            .map(|&(_, c)| c)
            .filter(|c| active(c))
            .map(|c| band(c.class))
            .max();
        // A target is a share among the shares: `high` is above them (it
        // takes the GPU at once, for at most `high_share` of each window
        // while others wait, charged to its user), so it is left out of
        // the sum and shows no target of its own; what it takes is netted
        // out of what the others are owed (`entitled`).
        let among = |c: &super::Client| {
            active(c) && Some(band(c.class)) == top && c.class != Priority::High
        };
        let active_weight: f64 = clients
            .iter()
            .filter(|(_, c)| among(c))
            .map(|&(id, _)| self.clock.weight(id))
            .sum();
        // Charges since the last settle, as settle would make them.
        let n = self.lease.on_gpu().count().max(1);
        let pending = now.saturating_sub(self.settled_at) as f64 / n as f64;
        clients
            .into_iter()
            .map(|(id, c)| {
                let weight = self.clock.weight(id);
                let span = self.cfg.window.min(now - c.added_at);
                let achieved = if span == 0 {
                    0.0
                } else {
                    (c.meter.usage(self.cfg.window, now) as f64 / span as f64).min(1.0)
                };
                let charged = c.charged + if c.synced.on_gpu { pending } else { 0.0 };
                let (entitled, held_back) = self.entitled.of(id, now);
                ClientStatus {
                    client: id,
                    weight,
                    limit: c.limit.or_else(|| self.ceilings.unit_limit(c.m.unit)),
                    priority: c.class,
                    state: c.state,
                    achieved,
                    target: if among(c) && active_weight > 0.0 {
                        weight / active_weight
                    } else {
                        0.0
                    },
                    times: ClientTimes {
                        total_held: c.meter.total(now),
                        gpu_time: charged as Nanos,
                        entitled: entitled as Nanos,
                        held_back: held_back as Nanos,
                    },
                    draining: self.lease.draining(id),
                    hung: self.lease.hung(id),
                }
            })
            .collect()
    }

    /// The client that may launch now.
    pub fn holder(&self) -> Option<ClientId> {
        self.lease.holder()
    }
}
