//! What each client was entitled to, and how long its ceilings held it
//! back: a stable measure of starvation. A client's target share (its
//! weight over the weights of the asking clients of the highest band, as
//! status reports it) is integrated over the time it asked and its
//! ceilings let it be granted: compared with its GPU time, what is left
//! is time it was owed and did not get. A target that flaps while a
//! `high` client comes and goes averages out instead of flapping an
//! alert, and what a higher band was entitled to is never counted as
//! owed (the target is already net of it). Time an asking client was
//! kept out by its own limit, its job's, the `high` class's share or its
//! want of evidence (`ceilings`: parked) is counted as held back instead.
//!
//! After each event the shares of the moment are noted (over the clients
//! that ask, not every one registered); `settle`, at the start of the
//! next event, adds the time since at those shares: nothing that changes
//! them happens between two events (a ceiling that frees up is a
//! timeout, an event of its own), so the sums are exact.

use super::clock::band;
use super::{ClientId, Nanos, Scheduler};

/// A client's part of the time between two events: its share of what is
/// owed, or held back by its ceilings.
#[derive(Clone, Copy, Debug)]
pub(super) enum Part {
    Owed(f64),
    HeldBack,
}

impl Scheduler {
    /// Notes each asking client's part, as things stand after an event:
    /// those of the highest asking band that their ceilings let run are
    /// owed their weight's share of the band's (a `high` one's among
    /// them: what it takes is not owed to the others); the others of that
    /// band are held back.
    pub(super) fn note_entitled(&mut self) {
        self.parts.clear();
        let band_of = |id: &ClientId| band(self.clients[id].class);
        let Some(top) = self.tally.asking.iter().map(band_of).max() else {
            return;
        };
        let mut total = 0.0;
        for &id in &self.tally.asking {
            let c = &self.clients[&id];
            if band(c.class) != top {
                continue;
            }
            let w = self.clock.weight(id);
            total += w;
            let part = if self.ceilings.parked(id) {
                Part::HeldBack
            } else {
                Part::Owed(w)
            };
            self.parts.push((id, part));
        }
        for (_, p) in &mut self.parts {
            if let Part::Owed(w) = p {
                *w = if total > 0.0 { *w / total } else { 0.0 };
            }
        }
    }

    /// Adds `dt`, the time since the last event, at the parts noted then.
    pub(super) fn accrue_entitled(&mut self, dt: Nanos) {
        if dt == 0 {
            return;
        }
        let dt = dt as f64;
        for &(id, part) in &self.parts {
            if let Some(c) = self.clients.get_mut(&id) {
                match part {
                    Part::Owed(share) => c.acct.entitled += dt * share,
                    Part::HeldBack => c.acct.held_back += dt,
                }
            }
        }
    }
}

/// What `settle` would add to client `id` after `dt` more, at `parts` (the
/// parts noted at the last event, by client): (owed, held back), ns.
pub(super) fn pending_part(
    parts: &std::collections::HashMap<ClientId, Part>,
    id: ClientId,
    dt: f64,
) -> (f64, f64) {
    match parts.get(&id) {
        Some(Part::Owed(share)) => (dt * share, 0.0),
        Some(Part::HeldBack) => (0.0, dt),
        None => (0.0, 0.0),
    }
}
