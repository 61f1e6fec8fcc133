//! The `high` class's share of each window (`--high-share`, Linux's
//! real-time throttling), kept by users.
//!
//! - **Charged only for time taken from a lower class**: the meters run
//!   while a `high` client holds the GPU *and* a client of a lower class
//!   waits within its own ceilings. A lone `high` process that held the
//!   GPU for most of a second while nothing lower could use it once
//!   left the share spent, and when a `low` process then asked every
//!   `high` burst was passed over until the window slid (~500 ms).
//! - **By users**: each user's `high` time is metered too, and a user
//!   may hold within its *part* of the share (the share times its weight
//!   over the weights of the users with `high` work now or `high` time in
//!   the window) even when the class's share is spent; beyond its part it
//!   may use what the class has left. One user's busy `high` process used
//!   the whole share, and another user's interactive bursts then waited
//!   for the window to slide.
//!
//! The bound this keeps, in any window in which a lower class waits
//! throughout: each user's `high` time is at most the larger of its part
//! and what the class had left when it was granted (plus a slice, the
//! most a grant runs past a ceiling). The class as a whole holds at most
//! the share whenever the users with `high` work stay the same; when a
//! user's `high` work appears after the others used the whole share, the
//! newcomer still gets its part, so the class may hold up to the share
//! plus that part in that window (with two users of equal weight, 1.5
//! times the share; with k arriving one after another, the share times
//! 1 + 1/2 + ... + 1/k). A user cannot raise this by itself: its own time
//! is bounded by its part or the class's leftover, however many
//! processes or connections it has.

use std::collections::BTreeMap;

use super::limits::Ceiling;
use super::meter::{Meter, budget};
use super::tree::band;
use super::{Client, ClientState, Nanos, Priority, Scheduler, UserKey};

/// The class's and its users' time on the GPU taken from a lower class.
#[derive(Debug, Clone, Default)]
pub(super) struct High {
    class: Meter,
    /// Users with `high` time in the window.
    users: BTreeMap<UserKey, Kept>,
    /// The user whose meter runs.
    on: Option<UserKey>,
    /// The meter of a user with no `high` time in the window.
    none: Meter,
}

/// A user's `high` time, and its weight when it last held (for the parts
/// of the others once it has no `high` work left).
#[derive(Debug, Clone, Default)]
struct Kept {
    meter: Meter,
    weight: f64,
}

impl High {
    /// Forgets time the window no longer sees, and users left without any.
    pub fn prune(&mut self, window: Nanos, now: Nanos) {
        self.class.prune(window, now);
        self.users.retain(|_, k| {
            k.meter.prune(window, now);
            !k.meter.is_empty()
        });
    }
}

impl Scheduler {
    /// Whether the `high` class is held to its share of the window now:
    /// some client of a lower class could use the GPU (holds it, or waits
    /// within its own ceilings). Work-conserving: alone, `high` is not
    /// bounded.
    pub(super) fn high_bounded(&self, now: Nanos) -> bool {
        let holds = |c: &Client| c.class < Priority::High && c.state == ClientState::Holding;
        self.cfg.high_share < 1.0
            && (self
                .holder
                .and_then(|h| self.clients.get(&h))
                .is_some_and(holds)
                || self.lower_waits(now))
    }

    /// A client of a lower class than `high` waits within its own
    /// ceilings: time `high` holds now is taken from it.
    fn lower_waits(&self, now: Nanos) -> bool {
        [Priority::Normal, Priority::Low].into_iter().any(|k| {
            self.ix.waiting[k.index()]
                .iter()
                .any(|id| self.fits(&self.clients[id], now, false))
        })
    }

    /// Opens and closes the class's and its users' meters: they run while
    /// a `high` client holds the GPU (a revoked or hung one, or work still
    /// draining, is its own charge and nobody else's: a hung `high` client
    /// once used up the share for every other) and a lower class waits.
    pub(super) fn sync_high(&mut self, now: Nanos) {
        let on = self
            .holder
            .and_then(|h| self.clients.get(&h))
            .filter(|c| c.class == Priority::High && c.state == ClientState::Holding)
            .map(|c| (c.user_key(), self.levels(c).user))
            .filter(|_| self.cfg.high_share < 1.0 && self.lower_waits(now));
        let h = &mut self.high;
        h.class.set(on.is_some(), now);
        let user = on.map(|(u, _)| u);
        if h.on != user
            && let Some(k) = h.on.and_then(|u| h.users.get_mut(&u))
        {
            k.meter.set(false, now);
        }
        h.on = user;
        if let Some((u, weight)) = on {
            let k = h.users.entry(u).or_default();
            k.weight = weight;
            k.meter.set(true, now);
        }
    }

    /// The ceiling of a `high` client while the class is bounded: its
    /// user's part of the share, or what the class has left, whichever
    /// leaves it more; when neither has room, the one that comes back
    /// first.
    pub(super) fn high_ceiling(&self, c: &Client) -> Ceiling<'_> {
        let (cfg, now) = (&self.cfg, self.now);
        let share = budget(cfg.high_share, cfg.window);
        let class = Ceiling {
            budget: share,
            quantum: share.min(cfg.timeslice),
            meter: &self.high.class,
        };
        let part = budget(cfg.high_share * self.high_part(c), cfg.window);
        let own = Ceiling {
            budget: part,
            quantum: part.min(cfg.timeslice),
            meter: self
                .high
                .users
                .get(&c.user_key())
                .map_or(&self.high.none, |k| &k.meter),
        };
        let w = cfg.window;
        match (own.fits(w, now), class.fits(w, now)) {
            (true, true) if own.remaining(w, now) < class.remaining(w, now) => class,
            (true, _) => own,
            (false, true) => class,
            (false, false) => {
                let back = |x: &Ceiling<'_>| {
                    x.meter
                        .down_to_at(w, now, x.budget - x.quantum)
                        .unwrap_or(Nanos::MAX)
                };
                if back(&own) <= back(&class) {
                    own
                } else {
                    class
                }
            }
        }
    }

    /// `c`'s user's part of the class's share: its weight over those of
    /// the users with `high` work now or `high` time in the window (its
    /// own among them).
    fn high_part(&self, c: &Client) -> f64 {
        let u = c.user_key();
        let b = band(Priority::High);
        let own = self.levels(c).user;
        let active = &self.ix.high_users;
        let others: f64 = active
            .keys()
            .filter(|&&v| v != u)
            .map(|&v| self.ix.user_weight(b, v))
            .chain(
                self.high
                    .users
                    .iter()
                    .filter(|(v, _)| **v != u && !active.contains_key(v))
                    .map(|(_, k)| k.weight),
            )
            .sum();
        own / (own + others)
    }
}
