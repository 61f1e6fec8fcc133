//! Ceilings on time on the GPU, and the waiters they keep out.
//!
//! - A client's `GPU_COMPUTE_LIMIT` and its unit's `--gpu-limit` (one
//!   budget for all the unit's members together, however many there are),
//!   sliding-window budgets enforced even on an otherwise idle GPU.
//! - The `high` class's share of each window while a lower class could use
//!   the GPU (`--high-share`, Linux's real-time throttling), kept by users:
//!   its meters run only while a `high` client holds the GPU *and* a
//!   lower class waits (a lone `high` process that held the GPU while
//!   nothing lower wanted it has used none of the share), and a user may
//!   hold within its *part* of the share (the share times its weight over
//!   those of the users with `high` work now or `high` time in the window)
//!   even when the class's share is spent, and beyond it may use what the
//!   class has left: one user's busy `high` process cannot keep another
//!   user's interactive `high` requests waiting. The class holds at most
//!   the share while the users with `high` work stay the same; a user
//!   whose `high` work starts after the others used the whole share still
//!   gets its part (so up to the share plus that part in that window).
//!
//! A waiter a ceiling keeps out is *parked*: out of the run queue (it does
//! not compete, so it neither gathers a claim while it cannot run nor
//! holds the clock back) until the instant it would fit again, kept in an
//! index of those instants.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::clock::UserKey;
use super::meter::{Meter, budget};
use super::{ClientId, GroupId, Nanos, SchedConfig};

/// Usage histories left by departed members, at most this many.
const MAX_LEFT: usize = 1024;

/// One ceiling on a client's time on the GPU, as it stands now.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ceiling {
    /// What it leaves.
    pub remaining: Nanos,
    /// The least worth granting against it: without a floor, a client
    /// hovering at its budget would get a stream of nanosecond grants.
    pub quantum: Nanos,
    /// When it leaves `quantum` again at the earliest, if what it meters
    /// stopped now (a meter still running only makes that later: the
    /// instant is looked at again then).
    pub back_at: Nanos,
}

impl Ceiling {
    /// A budget of `budget` ns in each `window` over `meter`.
    pub fn windowed(
        budget: Nanos,
        quantum: Nanos,
        meter: &Meter,
        window: Nanos,
        now: Nanos,
    ) -> Ceiling {
        let allowed = budget - quantum.min(budget);
        Ceiling {
            remaining: budget.saturating_sub(meter.usage(window, now)),
            quantum,
            back_at: meter.down_to_at(window, now, allowed).unwrap_or(now),
        }
    }

    pub fn fits(&self) -> bool {
        self.remaining >= self.quantum
    }
}

/// What the ceilings need to know of a client.
pub(super) struct Who<'a> {
    pub limit: Option<f64>,
    pub meter: &'a Meter,
    pub group: GroupId,
    /// A `high` client's user, and its weight as a user.
    pub high: Option<(UserKey, f64)>,
}

#[derive(Debug, Clone, Default)]
struct Unit {
    limit: Option<f64>,
    /// On the GPU while any member is.
    meter: Meter,
    on_gpu: usize,
    members: usize,
}

/// A user's `high` time, and its weight when it last held (for the
/// others' parts once it has no `high` work left).
#[derive(Debug, Clone, Default)]
struct Kept {
    meter: Meter,
    weight: f64,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Ceilings {
    cfg: SchedConfig,
    /// Units with a limit (kept while the window still sees their time).
    units: BTreeMap<GroupId, Unit>,
    /// The `high` class's time taken from a lower class, and each user's.
    high: Meter,
    high_users: BTreeMap<UserKey, Kept>,
    high_on: Option<UserKey>,
    /// Users with `high` work now: how many clients, and their weight.
    high_active: BTreeMap<UserKey, (usize, f64)>,
    /// Waiters kept out, by when they may fit again.
    parked: BTreeSet<(Nanos, ClientId)>,
    parked_until: BTreeMap<ClientId, Nanos>,
    /// Usage histories departed members left, for the next member of
    /// their unit (a process's own limit survives a reconnect).
    left: BTreeMap<(UserKey, GroupId), VecDeque<(Nanos, Nanos)>>,
    /// An empty meter, for a user with no `high` time.
    none: Meter,
}

impl Ceilings {
    pub fn new(cfg: SchedConfig) -> Ceilings {
        Ceilings {
            cfg,
            ..Ceilings::default()
        }
    }

    /// A member joins unit `group` (`delta` 1), leaves it (-1) or stays
    /// (0); a joining or staying member sets the unit's `limit`.
    pub fn member(&mut self, group: GroupId, limit: Option<f64>, delta: i32) {
        let u = self.units.entry(group).or_default();
        u.members = u.members.saturating_add_signed(delta as isize);
        if delta >= 0 {
            u.limit = limit;
        }
        self.tidy(group);
    }

    /// A member of `group` went on (`on`) or off the GPU at `now`.
    pub fn unit_on_gpu(&mut self, group: GroupId, on: bool, now: Nanos) {
        if let Some(u) = self.units.get_mut(&group) {
            if on {
                u.on_gpu += 1;
            } else {
                u.on_gpu = u.on_gpu.saturating_sub(1);
            }
            u.meter.prune(self.cfg.window, now);
            u.meter.set(u.on_gpu > 0, now);
        }
        self.tidy(group);
    }

    /// A unit nobody belongs to is kept while the window still sees its
    /// time.
    fn tidy(&mut self, group: GroupId) {
        if self
            .units
            .get(&group)
            .is_some_and(|u| u.members == 0 && u.on_gpu == 0 && u.meter.is_empty())
        {
            self.units.remove(&group);
        }
    }

    /// A user's `high` work starts (`on`) or ends, for the parts.
    pub fn high_active(&mut self, user: UserKey, weight: f64, on: bool) {
        let e = self.high_active.entry(user).or_insert((0, weight));
        if on {
            e.0 += 1;
            e.1 = weight;
        } else {
            e.0 = e.0.saturating_sub(1);
            if e.0 == 0 {
                self.high_active.remove(&user);
            }
        }
    }

    /// Runs the `high` meters while `on` (a `high` client of that user,
    /// of that weight, holds the GPU while a lower class waits).
    pub fn sync_high(&mut self, on: Option<(UserKey, f64)>, now: Nanos) {
        let w = self.cfg.window;
        self.high.prune(w, now);
        self.high.set(on.is_some(), now);
        let user = on.map(|(u, _)| u);
        if self.high_on != user {
            if let Some(k) = self.high_on.and_then(|u| self.high_users.get_mut(&u)) {
                k.meter.set(false, now);
                k.meter.prune(w, now);
            }
            self.high_users.retain(|_, k| {
                k.meter.prune(w, now);
                !k.meter.is_empty()
            });
        }
        self.high_on = user;
        if let Some((u, weight)) = on {
            let k = self.high_users.entry(u).or_default();
            k.weight = weight;
            k.meter.set(true, now);
        }
    }

    /// The ceilings on a client: its own limit, its unit's, and for a
    /// `high` client while the class is `bounded`, its user's part of
    /// the share or the class's leftover.
    pub fn of(&self, c: &Who<'_>, bounded: bool, now: Nanos) -> Vec<Ceiling> {
        let cfg = &self.cfg;
        let limited = |fraction: f64, meter: &Meter| {
            let budget = budget(fraction, cfg.window);
            let quantum = (budget.min(cfg.timeslice) / 5).max(1);
            Ceiling::windowed(budget, quantum, meter, cfg.window, now)
        };
        let own = c.limit.map(|l| limited(l, c.meter));
        let unit = self
            .units
            .get(&c.group)
            .and_then(|u| u.limit.map(|l| limited(l, &u.meter)));
        let high = c
            .high
            .filter(|_| bounded)
            .map(|(u, w)| self.high_ceiling(u, w, now));
        [own, unit, high].into_iter().flatten().collect()
    }

    /// A `high` client's ceiling while the class is bounded: its user's
    /// part of the share, or what the class has left, whichever leaves it
    /// more; when neither has room, the one that comes back first.
    fn high_ceiling(&self, user: UserKey, weight: f64, now: Nanos) -> Ceiling {
        let (cfg, w) = (&self.cfg, self.cfg.window);
        let share = budget(cfg.high_share, w);
        let class = Ceiling::windowed(share, share.min(cfg.timeslice), &self.high, w, now);
        let part = budget(cfg.high_share * self.high_part(user, weight), w);
        let meter = self.high_users.get(&user).map_or(&self.none, |k| &k.meter);
        let own = Ceiling::windowed(part, part.min(cfg.timeslice), meter, w, now);
        match (own.fits(), class.fits()) {
            (true, true) if own.remaining < class.remaining => class,
            (true, _) => own,
            (false, true) => class,
            (false, false) if own.back_at <= class.back_at => own,
            (false, false) => class,
        }
    }

    /// A user's part of the class's share: its weight over those of the
    /// users with `high` work now or `high` time in the window.
    fn high_part(&self, user: UserKey, own: f64) -> f64 {
        let active = self
            .high_active
            .iter()
            .filter(|(v, _)| **v != user)
            .map(|(_, e)| e.1);
        let past = self
            .high_users
            .iter()
            .filter(|(v, _)| **v != user && !self.high_active.contains_key(v))
            .map(|(_, k)| k.weight);
        own / (own + active.chain(past).sum::<f64>())
    }

    /// Keeps waiter `id` out until `until`.
    pub fn park(&mut self, id: ClientId, until: Nanos) {
        self.unpark(id);
        self.parked.insert((until, id));
        self.parked_until.insert(id, until);
    }

    pub fn unpark(&mut self, id: ClientId) {
        if let Some(t) = self.parked_until.remove(&id) {
            self.parked.remove(&(t, id));
        }
    }

    pub fn parked(&self, id: ClientId) -> bool {
        self.parked_until.contains_key(&id)
    }

    /// The parked waiters whose instant came (all of them: `all`).
    pub fn due(&mut self, now: Nanos, all: bool) -> Vec<ClientId> {
        let due: Vec<ClientId> = self
            .parked
            .iter()
            .take_while(|&&(t, _)| all || t <= now)
            .map(|&(_, id)| id)
            .collect();
        for &id in &due {
            self.unpark(id);
        }
        due
    }

    pub fn next_timeout(&self) -> Option<Nanos> {
        self.parked.first().map(|p| p.0)
    }

    /// A departed member's usage history, for the next member of its unit.
    pub fn leave_history(
        &mut self,
        key: (UserKey, GroupId),
        h: VecDeque<(Nanos, Nanos)>,
        now: Nanos,
    ) {
        let lo = now.saturating_sub(self.cfg.window);
        if h.back().is_some_and(|&(_, e)| e > lo) {
            self.left.insert(key, h);
        }
        while self.left.len() > MAX_LEFT {
            self.left.pop_first();
        }
    }

    pub fn take_history(&mut self, key: (UserKey, GroupId)) -> VecDeque<(Nanos, Nanos)> {
        self.left.remove(&key).unwrap_or_default()
    }

    /// A unit's limit, for status.
    pub fn unit_limit(&self, group: GroupId) -> Option<f64> {
        self.units.get(&group).and_then(|u| u.limit)
    }
}
