//! The fair tree: per band, users, then each user's units (its jobs, and
//! its processes outside any job), then each unit's clients. Every user
//! and unit is a node with a virtual time of its own, a clock over its
//! children and its children's waiters in the order a grant picks them,
//! so that a user's debt and wake-up credit are the user's, whatever its
//! connections do: they outlive its clients coming and going while any is
//! registered, and for a while after the last one leaves (see `leave`
//! and `prune`).
//!
//! `high` and `normal` share one band and so one virtual time per user and
//! unit: `high` changes *when* a user runs (it is dispatched with a warp,
//! as in Borrowed Virtual Time), not how much. `low` has a band of its own
//! below, run only when the band above has no one to grant.
//!
//! This room keeps the structure (nodes, waiters, members) consistent as
//! `Index::apply` moves clients in and out; the keys of the nodes, which
//! need the hierarchy's weights, are recomputed by `Scheduler::refresh`.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{ClientId, GroupId, Nanos, Priority, UserKey};

/// A virtual time, ordered as `f64::total_cmp` orders it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Vt(pub f64);

impl PartialEq for Vt {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Vt {}
impl PartialOrd for Vt {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Vt {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// `low`, then `high` and `normal` together.
pub(super) const BANDS: usize = 2;

pub(super) fn band(p: Priority) -> usize {
    match p {
        Priority::Low => 0,
        Priority::Normal | Priority::High => 1,
    }
}

/// Memberless users, and memberless units, kept for their debt or their
/// usage history: at most this many of each.
pub(super) const MAX_KEPT: usize = 1024;

pub(super) type UserRef = (usize, UserKey);
pub(super) type UnitRef = (usize, UserKey, GroupId);
/// A waiter's place among its siblings: its virtual time less any warp,
/// then FIFO (the stamp of when it started waiting).
pub(super) type Place<K> = (Vt, u64, K);

/// The levels of the tree, top first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Level {
    User,
    Unit,
    Client,
}

/// What users and units have in common.
#[derive(Debug, Clone, Default)]
pub(super) struct Node {
    /// Charged time over the node's weight at its level.
    pub vtime: f64,
    /// Over its children's places (its waiters, and the holder's branch
    /// when the holder is below it); never decreasing. A child that starts
    /// competing starts at most one slice of its own behind it.
    pub clock: f64,
    /// Registered clients below.
    pub members: usize,
    /// Waiting clients below, and how many of them are `high`.
    pub waiting: usize,
    pub high: usize,
    /// FIFO stamp of its first waiter, while it has any.
    pub since: u64,
    /// Its place in its parent, while it has waiters.
    pub entry: Option<(Vt, u64)>,
    /// Its virtual time as charged (no warp) in its parent's `real`,
    /// while it has waiters.
    pub real: Option<Vt>,
    /// When it last competed (a waiter or the holder below it), and its
    /// parent's clock then: a node that starts competing again has kept
    /// its lag behind that clock since (as EEVDF keeps a sleeper's lag),
    /// plus the credit its time away earned (`Scheduler::compete`).
    pub off: (Nanos, f64),
}

#[derive(Debug, Clone, Default)]
pub(super) struct UserNode {
    pub n: Node,
    /// Its units with waiters, in order.
    pub units: BTreeSet<Place<GroupId>>,
    /// The same units by virtual time as charged, for the clock.
    pub real: BTreeSet<(Vt, GroupId)>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct UnitNode {
    pub n: Node,
    /// Its waiting clients, in order.
    pub clients: BTreeSet<Place<ClientId>>,
    /// The same clients by virtual time as charged, for the clock.
    pub real: BTreeSet<(Vt, ClientId)>,
    /// The window's usage history of a member that left, for the next one
    /// that joins (its own `GPU_COMPUTE_LIMIT` survives a reconnect).
    pub left: VecDeque<(Nanos, Nanos)>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Tree {
    /// Per band: users with waiters, in order.
    pub top: [BTreeSet<Place<UserKey>>; BANDS],
    /// Per band: the same users by virtual time as charged, for the clock.
    pub top_real: [BTreeSet<(Vt, UserKey)>; BANDS],
    /// Per band: the clock over users.
    pub clock: [f64; BANDS],
    pub users: BTreeMap<UserRef, UserNode>,
    pub units: BTreeMap<UnitRef, UnitNode>,
    /// Units (and so their users) whose place or clock is out of date.
    pub stale: Vec<UnitRef>,
    /// Nodes without members, kept while they owe time or hold history.
    pub kept_users: BTreeSet<UserRef>,
    pub kept_units: BTreeSet<UnitRef>,
    /// The scheduler's latest time, for when a new node last competed.
    pub now: Nanos,
}

fn user_of(p: UnitRef) -> UserRef {
    (p.0, p.1)
}

impl Tree {
    /// Makes the nodes of `p` exist: a new user starts at its band's clock,
    /// a new unit at its user's (neither with any credit).
    pub fn ensure(&mut self, p: UnitRef) {
        let u = user_of(p);
        if !self.users.contains_key(&u) {
            let n = Node {
                vtime: self.clock[p.0],
                off: (self.now, self.clock[p.0]),
                ..Node::default()
            };
            self.users.insert(
                u,
                UserNode {
                    n,
                    ..UserNode::default()
                },
            );
            self.kept_users.insert(u);
        }
        if !self.units.contains_key(&p) {
            let clock = self.users[&u].n.clock;
            let n = Node {
                vtime: clock,
                off: (self.now, clock),
                ..Node::default()
            };
            self.units.insert(
                p,
                UnitNode {
                    n,
                    ..UnitNode::default()
                },
            );
            self.kept_units.insert(p);
        }
    }

    pub fn join(&mut self, p: UnitRef) {
        self.ensure(p);
        let u = user_of(p);
        for n in [
            &mut self.users.get_mut(&u).expect("ensured").n,
            &mut self.units.get_mut(&p).expect("ensured").n,
        ] {
            n.members += 1;
        }
        self.kept_users.remove(&u);
        self.kept_units.remove(&p);
    }

    /// A member leaves: a node left without members is kept only while it
    /// owes time (ahead of its parent's clock) or holds a member's usage
    /// history, and dropped at once otherwise (every client passes through
    /// a unit of its own before the caller places it).
    pub fn leave(&mut self, p: UnitRef) {
        let u = user_of(p);
        let parent = self.users.get(&u).map_or(f64::INFINITY, |x| x.n.clock);
        if let Some(x) = self.units.get_mut(&p) {
            x.n.members -= 1;
            if x.n.members == 0 {
                if x.n.vtime > parent || !x.left.is_empty() {
                    self.kept_units.insert(p);
                } else {
                    self.place_unit(p, None);
                    self.units.remove(&p);
                }
            }
        }
        let clock = self.clock[p.0];
        if let Some(x) = self.users.get_mut(&u) {
            x.n.members -= 1;
            if x.n.members == 0 {
                let has_units = self
                    .units
                    .range((u.0, u.1, GroupId::MIN)..=(u.0, u.1, GroupId::MAX))
                    .next()
                    .is_some();
                if x.n.vtime > clock || has_units {
                    self.kept_users.insert(u);
                } else {
                    self.place_user(u, None);
                    self.users.remove(&u);
                }
            }
        }
    }

    /// `real`: the waiter's virtual time as charged, without its warp.
    pub fn add_waiter(&mut self, p: UnitRef, place: Place<ClientId>, real: Vt, high: bool) {
        let u = self.users.get_mut(&user_of(p)).expect("a member's user");
        let x = self.units.get_mut(&p).expect("a member's unit");
        for n in [&mut u.n, &mut x.n] {
            if n.waiting == 0 {
                n.since = place.1;
            }
            n.waiting += 1;
            n.high += usize::from(high);
        }
        x.clients.insert(place);
        x.real.insert((real, place.2));
        self.stale.push(p);
    }

    pub fn remove_waiter(&mut self, p: UnitRef, place: &Place<ClientId>, real: Vt, high: bool) {
        let u = self.users.get_mut(&user_of(p)).expect("a member's user");
        let x = self.units.get_mut(&p).expect("a member's unit");
        for n in [&mut u.n, &mut x.n] {
            n.waiting -= 1;
            n.high -= usize::from(high);
        }
        x.clients.remove(place);
        x.real.remove(&(real, place.2));
        self.stale.push(p);
    }

    /// The waiting clients of a band in the order a grant picks them:
    /// users by place, each user's units by place, each unit's clients by
    /// place.
    pub fn waiters(&self, band: usize) -> impl Iterator<Item = ClientId> + '_ {
        self.top[band].iter().flat_map(move |&(_, _, u)| {
            self.users[&(band, u)]
                .units
                .iter()
                .flat_map(move |&(_, _, g)| {
                    self.units[&(band, u, g)]
                        .clients
                        .iter()
                        .map(|&(_, _, id)| id)
                })
        })
    }

    /// Sets a node's place in its parent's set: `key` while it has
    /// waiters (None removes it); and its virtual time as charged in the
    /// parent's `real`, over which the parent's clock is taken.
    pub fn place_unit(&mut self, p: UnitRef, key: Option<Vt>) {
        let x = self.units.get_mut(&p).expect("placed units exist");
        let (new, real) = (key.map(|k| (k, x.n.since)), key.map(|_| Vt(x.n.vtime)));
        if new == x.n.entry && real == x.n.real {
            return;
        }
        let old = std::mem::replace(&mut x.n.entry, new);
        let old_real = std::mem::replace(&mut x.n.real, real);
        let u = self.users.get_mut(&user_of(p)).expect("a unit's user");
        if let Some((k, s)) = old {
            u.units.remove(&(k, s, p.2));
            u.real.remove(&(old_real.expect("placed together"), p.2));
        }
        if let Some((k, s)) = new {
            u.units.insert((k, s, p.2));
            u.real.insert((real.expect("placed together"), p.2));
        }
    }

    pub fn place_user(&mut self, r: UserRef, key: Option<Vt>) {
        let x = self.users.get_mut(&r).expect("placed users exist");
        let (new, real) = (key.map(|k| (k, x.n.since)), key.map(|_| Vt(x.n.vtime)));
        if new == x.n.entry && real == x.n.real {
            return;
        }
        let old = std::mem::replace(&mut x.n.entry, new);
        let old_real = std::mem::replace(&mut x.n.real, real);
        if let Some((k, s)) = old {
            self.top[r.0].remove(&(k, s, r.1));
            self.top_real[r.0].remove(&(old_real.expect("placed together"), r.1));
        }
        if let Some((k, s)) = new {
            self.top[r.0].insert((k, s, r.1));
            self.top_real[r.0].insert((real.expect("placed together"), r.1));
        }
    }

    /// Forgets memberless nodes that neither owe time (ahead of their
    /// parent's clock) nor hold usage history the window still sees; past
    /// `MAX_KEPT` of a kind, the one least ahead goes first. A node dropped is as good as new when its user
    /// comes back: it starts at the clock, which gives it no credit.
    pub fn prune(&mut self, window: Nanos, now: Nanos) {
        let lo = now.saturating_sub(window);
        let units = &mut self.units;
        let users = &self.users;
        self.kept_units.retain(|p| {
            let x = units.get_mut(p).expect("kept units exist");
            x.left.retain(|&(_, e)| e > lo);
            let parent = users.get(&user_of(*p)).map_or(f64::INFINITY, |u| u.n.clock);
            let keep = x.n.members > 0 || x.n.vtime > parent || !x.left.is_empty();
            if !keep {
                units.remove(p);
            }
            keep
        });
        let (users, units, clock) = (&mut self.users, &self.units, self.clock);
        self.kept_users.retain(|r| {
            let x = &users[r];
            let has_units = units
                .range((r.0, r.1, GroupId::MIN)..=(r.0, r.1, GroupId::MAX))
                .next()
                .is_some();
            let keep = x.n.members > 0 || x.n.vtime > clock[r.0] || has_units;
            if !keep {
                users.remove(r);
            }
            keep
        });
        self.evict();
    }

    /// Holds the memberless nodes to `MAX_KEPT` of each kind.
    pub fn evict(&mut self) {
        while self.kept_units.len() > MAX_KEPT {
            let lead = |p: &UnitRef| {
                let parent = self.users.get(&user_of(*p)).map_or(0.0, |u| u.n.clock);
                self.units[p].n.vtime - parent
            };
            let Some(p) = self
                .kept_units
                .iter()
                .copied()
                .min_by(|a, b| lead(a).total_cmp(&lead(b)))
            else {
                break;
            };
            self.kept_units.remove(&p);
            self.units.remove(&p);
        }
        while self.kept_users.len() > MAX_KEPT {
            let lead = |r: &UserRef| self.users[r].n.vtime - self.clock[r.0];
            let Some(r) = self
                .kept_users
                .iter()
                .copied()
                .min_by(|a, b| lead(a).total_cmp(&lead(b)))
            else {
                break;
            };
            self.kept_users.remove(&r);
            self.users.remove(&r);
            let gone: Vec<UnitRef> = self
                .units
                .range((r.0, r.1, GroupId::MIN)..=(r.0, r.1, GroupId::MAX))
                .map(|(p, _)| *p)
                .collect();
            for p in gone {
                self.units.remove(&p);
                self.kept_units.remove(&p);
            }
        }
    }
}
