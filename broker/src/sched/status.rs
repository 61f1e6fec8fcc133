//! What the scheduler reports: each client's state, share and charges
//! for status, and who holds the GPU.

use super::entitled::{Part, pending_part};
use super::tree::band;
use super::{Client, ClientId, ClientStatus, Nanos, Priority, Scheduler};

impl Scheduler {
    pub fn status(&self, now: Nanos) -> Vec<ClientStatus> {
        let now = now.max(self.now);
        // `high` and `normal` share a band, and so the GPU by weight.
        let top = self
            .clients
            .values()
            .filter(|c| c.is_active())
            .map(|c| band(c.class))
            .max();
        // A target is a share among the shares: `high` is above them (it
        // takes the GPU at once, for at most `high_share` of each window
        // while others wait, charged to its user), so it is left out of
        // the sum and shows no target of its own. A busy `high` process
        // then no longer makes everyone else's target drop for as long as
        // it is busy; what it takes is netted out of what they are owed
        // (`entitled`) instead.
        let among =
            |c: &Client| c.is_active() && Some(band(c.class)) == top && c.class != Priority::High;
        let active_weight: f64 = self
            .clients
            .values()
            .filter(|c| among(c))
            .map(|c| self.weight(c))
            .sum();
        // What settle would add to each client's owed and held-back time.
        let parts: std::collections::HashMap<ClientId, Part> = self.parts.iter().copied().collect();
        let dt = now.saturating_sub(self.settled_at) as f64;
        // Charges since the last settle, as settle would make them.
        let n = self.clients.values().filter(|c| c.on_gpu()).count().max(1);
        let pending = now.saturating_sub(self.settled_at) as f64 / n as f64;
        self.clients
            .iter()
            .map(|(&id, c)| {
                let weight = self.weight(c);
                let span = self.cfg.window.min(now - c.added_at);
                let achieved = if span == 0 {
                    0.0
                } else {
                    (c.meter.usage(self.cfg.window, now) as f64 / span as f64).min(1.0)
                };
                let charged = c.charged + if c.on_gpu() { pending } else { 0.0 };
                ClientStatus {
                    client: id,
                    weight,
                    limit: c
                        .limit
                        .or_else(|| self.units.get(&c.group).and_then(|u| u.limit)),
                    priority: c.class,
                    state: c.state,
                    achieved,
                    target: if among(c) && active_weight > 0.0 {
                        weight / active_weight
                    } else {
                        0.0
                    },
                    total_held: c.meter.total(now),
                    gpu_time: charged as Nanos,
                    entitled: (c.entitled + pending_part(&parts, id, dt).0) as Nanos,
                    held_back: (c.held_back + pending_part(&parts, id, dt).1) as Nanos,
                    draining: c.draining_since.is_some(),
                    hung: c.grant.as_ref().is_some_and(|g| g.hung),
                }
            })
            .collect()
    }

    /// The client that may launch now.
    pub fn holder(&self) -> Option<ClientId> {
        self.holder
    }

    #[cfg(test)]
    pub fn state(&self, id: ClientId) -> Option<super::ClientState> {
        self.clients.get(&id).map(|c| c.state)
    }
}
