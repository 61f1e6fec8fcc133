//! What each client was entitled to, and how long its ceilings held it
//! back: a stable measure of starvation. A client's target share (its
//! weight over the weights of the busy clients of the highest band, as
//! status reports it) is integrated over the time it was busy and its
//! ceilings let it be granted: compared with its GPU time, what is left
//! is time it was owed and did not get. A target that flaps while a
//! `high` client comes and goes averages out instead of flapping an
//! alert, and what a higher band was entitled to is never counted as
//! owed (the target is already net of it). Time a busy client could not
//! be granted because of its own limit, its job's, the `high` class's
//! share or a deferral is counted as held back instead.
//!
//! After each event (`reschedule`) the shares of the moment are noted;
//! `settle`, at the start of the next event, adds the time since at those
//! shares: nothing that changes them happens between two events (a
//! ceiling that frees up is a timeout, an event of its own), so the sums
//! are exact.

use super::tree::band;
use super::{ClientId, Nanos, Scheduler};

/// A client's part of the time between two events: its share of what is
/// owed, or held back by its ceilings.
#[derive(Clone, Copy, Debug)]
pub(super) enum Part {
    Owed(f64),
    HeldBack,
}

impl Scheduler {
    /// Notes each busy client's part, as things stand after an event:
    /// those of the highest busy band that their ceilings let be granted
    /// are owed their target share (their weight over the band's busy
    /// weight, as status reports it); the others of that band are held
    /// back.
    pub(super) fn note_entitled(&mut self, now: Nanos) {
        self.parts.clear();
        let top = self
            .clients
            .values()
            .filter(|c| c.is_active())
            .map(|c| band(c.class))
            .max();
        let Some(top) = top else {
            return;
        };
        let bounded = self.high_bounded(now);
        let mut total = 0.0;
        for (&id, c) in &self.clients {
            if c.is_active() && band(c.class) == top {
                let w = self.weight(c);
                total += w;
                let part = if self.fits(c, now, bounded) {
                    Part::Owed(w)
                } else {
                    Part::HeldBack
                };
                self.parts.push((id, part));
            }
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
                    Part::Owed(share) => c.entitled += dt * share,
                    Part::HeldBack => c.held_back += dt,
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
