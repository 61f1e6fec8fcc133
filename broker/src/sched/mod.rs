//! Per-GPU compute scheduler (docs/broker.md, "Compute arbitration").
//!
//! A pure state machine: no I/O, no clock, no threads. Every entry point takes
//! the current monotonic time so the whole policy can be driven in virtual
//! time by tests and by the socket layer alike. Outputs are queued as
//! [`Action`]s (drained with [`Scheduler::poll_action`]) and the caller arms a
//! timer for [`Scheduler::next_timeout`].
//!
//! One algorithm, EEVDF over users: in each band (`low`; `normal` and
//! `high` together) each user with a client that waits or has work on the
//! GPU competes as one flow of its user's weight, charged the GPU time its
//! clients use (from a grant until the queued work drained, split evenly
//! with the others on the GPU). The GPU goes to the highest band with a
//! waiter its ceilings let run; there, to the eligible flow (lag not
//! negative) with the earliest virtual deadline, and within it to the
//! client that used least of its part (its unit's part of the user's
//! units times its own part of the unit). A request is a slice, a fifth
//! of one for a waiter that was idle, a tenth and warped at `high`; a
//! waiter preempts the holder at once when its deadline is earlier (a
//! holder in a burst of the waiter's class or above once it had the
//! GPU's own quantum, `wake`), and after the quantum when it was idle.
//! A user's lag outlives its connections and processes. The parts:
//!
//! - `clock`: virtual time, weights, lag and the users' banks, the pick's
//!   orders;
//! - `lease`: the holder and the grants out, slices, bounds, bursts,
//!   recalls, hung holders, drains, and the actions;
//! - `ceilings`: limits and the `high` share, and the waiters they keep
//!   out until the instant they fit again;
//! - `evidence`: the driver's per-process work against time held, and each
//!   user's benefit of the doubt;
//! - `decide` (this module's coordinator): one event's opening and closing
//!   and the fixed point after it.

mod ceilings;
mod clock;
mod decide;
mod entitled;
mod evidence;
mod lease;
mod meter;
mod status;
mod types;

use std::collections::BTreeMap;

use ceilings::Ceilings;
use clock::{BANDS, FairClock, Member, UserKey, band, sanitize_weight};
use evidence::Evidence;
use lease::Leases;
use meter::Meter;

pub use gpufrac_common::config::Priority;
pub use types::{
    Action, ClientId, ClientState, ClientStatus, ClientTimes, GrantId, GroupId, Nanos, SchedConfig,
    UserId,
};

const MS: Nanos = 1_000_000;
const US: Nanos = 1_000;
/// How far (GPU time, in slices) a `high` burst's request is warped: its
/// user may owe that much and it is still eligible, its deadline that
/// much earlier. One slice is a busy holder's greatest lead, so an
/// interactive `high` process takes the GPU at once even when its own
/// user's batch just ran; repaid, since every moment it holds is charged
/// to its user, and throttled by the `high` share's meter.
const WARP_SLICES: f64 = 1.0;

/// By client id, what every event looks up and no walk needs in order
/// (status sorts): as B-trees, a quarter of the scheduler's time per grant
/// at 125 clients on a GPU (docs/broker.md). Fixed seed: runs alike.
pub(super) type ById<V> = std::collections::HashMap<ClientId, V, foldhash::fast::FixedState>;

/// What a client last put in the parts, to change only what moved.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Synced {
    member: Option<Member>,
    class: Option<Priority>,
    queued: bool,
    on_gpu: bool,
    /// Its user, and the user's weight, while it has `high` work.
    high: Option<(UserKey, f64)>,
}

#[derive(Debug, Clone)]
struct Client {
    class: Priority,
    /// What the clock weighs it by (its band and `high` follow `class`).
    m: Member,
    limit: Option<f64>,
    state: ClientState,
    added_at: Nanos,
    /// Set by `acquire` while revoking: the release re-queues instead of
    /// idling.
    wants_again: bool,
    /// It left idle and has not been granted since: its request is short
    /// and its grant a burst.
    waking: bool,
    /// When it last let go of a revoked grant: asking again within
    /// `wake` of that is no waking (a holder that answers each recall by
    /// letting go and asking at once would otherwise come back with a
    /// burst's short request each time).
    let_go: Option<Nanos>,
    /// On the GPU: holding, revoking or draining.
    meter: Meter,
    /// GPU time charged so far, ns (what it was owed is `entitled`'s).
    charged: f64,
    synced: Synced,
}

impl Client {
    fn new(class: Priority, own: f64, limit: Option<f64>, id: ClientId, now: Nanos) -> Client {
        let m = Member {
            band: band(class),
            user: UserKey::Unit(id),
            unit: id,
            own,
            unit_weight: None,
            user_weight: 1.0,
            high: class == Priority::High,
        };
        Client {
            class,
            m,
            limit,
            state: ClientState::Idle,
            added_at: now,
            wants_again: false,
            waking: false,
            let_go: None,
            meter: Meter::default(),
            charged: 0.0,
            synced: Synced::default(),
        }
    }

    fn set_class(&mut self, class: Priority) {
        self.class = class;
        (self.m.band, self.m.high) = (band(class), class == Priority::High);
    }

    /// Its user's weight among users, for the `high` share's parts.
    fn user_part(&self) -> f64 {
        match self.m.user {
            UserKey::User(_) => 100.0 * self.m.user_weight,
            UserKey::Unit(_) => self.m.unit_weight.unwrap_or(self.m.own),
        }
    }
}

/// What each event keeps instead of scanning: registered clients and
/// waiters in the run queue, per class.
#[derive(Debug, Clone, Default)]
struct Tally {
    registered: [usize; 3],
    queued: [usize; 3],
    /// Clients on the GPU (holding, revoked and not let go, or draining)
    /// per band, as `sync` last saw them.
    on_gpu: [usize; BANDS],
}

#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedConfig,
    /// Latest time seen; earlier `now` arguments are clamped to it so a
    /// caller's clock hiccup cannot make durations underflow.
    now: Nanos,
    /// Charges are settled up to here.
    settled_at: Nanos,
    clients: ById<Client>,
    clock: FairClock,
    lease: Leases,
    ceilings: Ceilings,
    evidence: Evidence,
    tally: Tally,
    /// When a waiter comes to preempt the holder (it becomes eligible, or
    /// the holder has had its quantum).
    timer: Option<Nanos>,
    /// Whether a lower class wanted the GPU, `high` was bounded and the
    /// driver's samples were judged after the last event: when any
    /// changes, parked waiters are looked at again.
    seen: (bool, bool, bool),
    /// What each asking client is owed, or held back (`entitled`).
    entitled: entitled::Entitled,
}

fn sanitize_limit(limit: Option<f64>) -> Option<f64> {
    // The shim validates GPU_COMPUTE_LIMIT; anything that still arrives out of
    // range is not a ceiling the scheduler can honour: >= 100% is no ceiling,
    // and <= 0 would park the client forever.
    limit.filter(|l| l.is_finite() && *l > 0.0 && *l < 1.0)
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Self {
        // Zero-length slices or windows would make deadlines fire at the
        // instant they are set and the timer loop spin.
        let cfg = SchedConfig {
            timeslice: cfg.timeslice.max(5),
            window: cfg.window.max(1),
            drain_timeout: cfg.drain_timeout.max(1),
            wake: cfg.wake.max(1),
            evidence: cfg.evidence.max(1),
            ..cfg
        };
        Scheduler {
            cfg,
            now: 0,
            settled_at: 0,
            clients: ById::default(),
            clock: FairClock::new(cfg.timeslice),
            lease: Leases::new(cfg),
            ceilings: Ceilings::new(cfg),
            evidence: Evidence::new(cfg),
            tally: Tally::default(),
            timer: None,
            seen: (false, false, false),
            entitled: entitled::Entitled::default(),
        }
    }

    /// Registers a client, idle. Re-adding a known id updates its weight,
    /// limit and class in place (time already used stays charged as it was).
    pub fn add_client(
        &mut self,
        now: Nanos,
        id: ClientId,
        weight: f64,
        limit: Option<f64>,
        class: Priority,
    ) {
        let (weight, limit) = (sanitize_weight(weight), sanitize_limit(limit));
        self.event(now, None, |s, now| {
            if let Some(c) = s.clients.get_mut(&id) {
                c.m.own = weight;
                c.limit = limit;
                c.set_class(class);
            } else {
                s.clients
                    .insert(id, Client::new(class, weight, limit, id, now));
                s.ceilings.member(id, None, 1);
            }
            s.sync(id, now);
        });
    }

    /// `set_group` and `set_user` in one event: the unit, and the user it
    /// belongs to (None: the unit stands for itself).
    pub fn set_unit(
        &mut self,
        now: Nanos,
        id: ClientId,
        group: GroupId,
        unit_weight: Option<f64>,
        unit_limit: Option<f64>,
        user: Option<(UserId, f64)>,
    ) {
        self.event(now, Some(id), |s, now| {
            let c = s.clients.get_mut(&id).expect("checked by event");
            let old = c.m.unit;
            let (user, user_weight) = match user {
                Some((u, w)) => (UserKey::User(u), sanitize_weight(w)),
                None => (UserKey::Unit(group), 1.0),
            };
            c.m = Member {
                unit: group,
                unit_weight: unit_weight.map(sanitize_weight),
                user,
                user_weight,
                ..c.m
            };
            let limit = sanitize_limit(unit_limit);
            if old == group {
                s.ceilings.member(group, limit, 0);
            } else {
                // A departed member's usage history goes to the next
                // of its unit (its own limit survives a reconnect).
                s.ceilings.member(old, None, -1);
                s.ceilings.member(group, limit, 1);
                c.meter
                    .adopt_history(s.ceilings.take_history((user, group)));
            }
            s.sync(id, now);
        });
    }

    /// Disconnect. A holder's GPU goes to the next waiter at once, and the
    /// process's queued work is gone with it.
    pub fn remove_client(&mut self, now: Nanos, id: ClientId) {
        self.event(now, Some(id), |s, now| {
            let c = s.clients.get_mut(&id).expect("checked by event");
            c.state = ClientState::Idle;
            s.lease.forget(id);
            s.ceilings.unpark(id);
            s.sync(id, now);
            let mut c = s.clients.remove(&id).expect("checked by event");
            c.meter.set(false, now);
            // Its own limit's window survives a reconnect: the next member
            // of its unit takes the history up.
            let key = (c.m.user, c.m.unit);
            s.ceilings.leave_history(key, c.meter.take_history(), now);
            s.ceilings.member(c.m.unit, None, -1);
            s.tally.registered[c.class.index()] -= 1;
            s.clock.remove(id, now);
            s.evidence.forget(id);
            s.entitled.forget(id, now);
        });
    }

    /// The client wants to launch work.
    pub fn acquire(&mut self, now: Nanos, id: ClientId) {
        self.event(now, Some(id), |s, now| {
            let c = s.clients.get_mut(&id).expect("checked by event");
            match c.state {
                ClientState::Idle => {
                    c.state = ClientState::Waiting;
                    c.waking = c.let_go.is_none_or(|t| now >= t.saturating_add(s.cfg.wake));
                    // A shim launches a little with its request, before
                    // any grant: that work is on the GPU (and charged)
                    // until it reports it drained or is granted — at most
                    // two wake periods (it is bounded to about that much
                    // work), so that a lost report cannot keep a waiting
                    // client charged.
                    if !s.lease.draining(id) {
                        let until = now.saturating_add(s.cfg.wake.saturating_mul(2));
                        s.lease.drain(id, until);
                    }
                }
                ClientState::Revoking => c.wants_again = true,
                ClientState::Waiting | ClientState::Holding => {}
            }
            s.sync(id, now);
        });
    }

    /// The client stopped launching: after a revoke, or early because it ran
    /// out of work. Its queued work may still run (see `drained`). From a
    /// waiting client it withdraws the request.
    pub fn release(&mut self, now: Nanos, id: ClientId) {
        self.event(now, Some(id), |s, now| {
            let drain = now.saturating_add(s.cfg.drain_timeout);
            let c = s.clients.get_mut(&id).expect("checked by event");
            match c.state {
                ClientState::Idle => {}
                ClientState::Waiting => {
                    c.state = ClientState::Idle;
                    c.waking = false;
                }
                ClientState::Holding | ClientState::Revoking => {
                    if c.state == ClientState::Revoking {
                        c.let_go = Some(now);
                    }
                    c.state = if std::mem::take(&mut c.wants_again) {
                        ClientState::Waiting
                    } else {
                        ClientState::Idle
                    };
                    s.lease.release(id, Some(drain));
                }
            }
            s.sync(id, now);
        });
    }

    /// Everything the client queued before its last release has finished.
    pub fn drained(&mut self, now: Nanos, id: ClientId) {
        self.event(now, Some(id), |s, now| {
            s.lease.end_drain(id);
            s.sync(id, now);
        });
    }

    /// A sample of the driver's per-process work: the processes of
    /// `busy` ran kernels on this GPU since the previous sample, each
    /// keeping it busy that many percent of the time. That a sample comes
    /// at all says that the GPU reports per-process work (for `evidence`
    /// from now): while a lower band waits, a client of a higher band is
    /// then granted only on work in proportion to the time it held, or
    /// its user's benefit of the doubt (`evidence`).
    pub fn work_seen(&mut self, now: Nanos, busy: impl IntoIterator<Item = (ClientId, u32)>) {
        let busy: BTreeMap<ClientId, u32> = busy.into_iter().collect();
        self.event(now, None, |s, now| {
            // In any order: each client's record stands apart.
            let clients = s.clients.iter().map(|(&id, c)| {
                let pct = busy.get(&id).copied().unwrap_or(0);
                (id, c.meter.total(now), pct)
            });
            s.evidence.sample(now, clients);
            // What the samples proved may let parked waiters run.
            s.unpark_all(now);
        });
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.lease.poll()
    }

    /// Earliest instant at which `handle_timeout` has something to do:
    /// the least of the parts' own, always later than the last time
    /// passed in, so a timer loop cannot spin.
    pub fn next_timeout(&self) -> Option<Nanos> {
        [
            self.lease.next_timeout(),
            self.ceilings.next_timeout(),
            Some(self.evidence.next_timeout()),
            self.timer,
        ]
        .into_iter()
        .flatten()
        .filter(|&t| t > self.now)
        .min()
    }

    pub fn handle_timeout(&mut self, now: Nanos) {
        self.event(now, None, |_, _| {});
    }
}

#[cfg(test)]
mod tests;
