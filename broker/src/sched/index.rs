//! What each event needs to find without walking every client: who is on
//! the GPU, who waits (in the fair tree, in the order a grant picks them,
//! and per class), who has a grant out, how many clients each class and
//! unit has, and the weights of the hierarchy per user. A node may have a
//! thousand processes registered on one GPU, nearly all idle, and an event
//! must cost what changed, not what is connected.
//!
//! Every client carries the snapshot of what it put in here (`Indexed`);
//! after any change to a client, `Scheduler::reindex` swaps the old
//! snapshot's entries for the new one's. The weights of the hierarchy are
//! recomputed, at `reweigh`, only for the (band, user) pairs whose active
//! members changed, by the same sums in the same order as over everyone,
//! so they come out bit for bit the same.

use std::collections::{BTreeMap, BTreeSet};

use super::tree::{Place, Tree, UnitRef, Vt, band};
use super::{
    Client, ClientId, ClientState, GroupId, Priority, Scheduler, USER_SCALE, UnitSum, UserKey,
    sanitize_weight,
};

/// An active client's place in the hierarchy: band, user, unit.
type ActiveKey = (usize, UserKey, GroupId, ClientId);

/// What one client has put in the index.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Indexed {
    /// None: not in the index at all.
    class: Option<Priority>,
    /// Its unit in the fair tree.
    pub(super) path: Option<UnitRef>,
    on_gpu: bool,
    holding: bool,
    /// Its place among its unit's waiters, and its virtual time as
    /// charged (without its warp).
    waiting: Option<(Place<ClientId>, Vt)>,
    granted: bool,
    active: bool,
    /// Own weight, imposed unit weight, user weight: what its unit's and
    /// user's sums take from it while it is active.
    weighs: (f64, Option<f64>, Option<f64>),
}

impl Indexed {
    fn of(id: ClientId, c: &Client, warp: f64) -> Indexed {
        Indexed {
            class: Some(c.class),
            path: Some(c.path()),
            on_gpu: c.on_gpu(),
            holding: c.state == ClientState::Holding,
            waiting: (c.state == ClientState::Waiting)
                .then_some(((Vt(c.vtime - c.warp(warp, c.own)), c.seq, id), Vt(c.vtime))),
            granted: c.grant.is_some(),
            active: c.is_active() || c.on_gpu(),
            weighs: (c.own, c.unit_weight, c.user.map(|(_, w)| w)),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Index {
    pub on_gpu: BTreeSet<ClientId>,
    /// Per class, the waiting clients.
    pub waiting: [BTreeSet<ClientId>; 3],
    /// Clients with a grant out: the holder and those revoked.
    pub granted: BTreeSet<ClientId>,
    /// Clients whose meter the window may still see.
    pub metered: BTreeSet<ClientId>,
    pub per_class: [usize; 3],
    /// Per user, its active `high` clients (those with `high` work).
    pub high_users: BTreeMap<UserKey, usize>,
    pub per_group: BTreeMap<GroupId, usize>,
    pub active: BTreeSet<ActiveKey>,
    /// (band, user) pairs whose sums are out of date.
    pub dirty: BTreeSet<(usize, UserKey)>,
    units: BTreeMap<(usize, UserKey, GroupId), UnitSum>,
    /// Per (band, user): the sum of its units' weights, and the user's
    /// weight (the largest its active processes were given).
    users: BTreeMap<(usize, UserKey), (f64, f64)>,
    pub tree: Tree,
}

impl Index {
    fn apply(&mut self, id: ClientId, old: &Indexed, new: &Indexed) {
        if old == new {
            return;
        }
        if old.class != new.class {
            if let Some(k) = old.class {
                self.per_class[k.index()] -= 1;
            }
            if let Some(k) = new.class {
                self.per_class[k.index()] += 1;
            }
        }
        // Out of the old unit's waiters before leaving it (a unit left with
        // nothing to keep goes at once), into the new one's after joining.
        let waits = |x: &Indexed| x.waiting.map(|w| (w, x.path, x.class));
        let rewait = waits(old) != waits(new);
        if rewait && let (Some((w, r)), Some(p), Some(k)) = (old.waiting, old.path, old.class) {
            self.tree.remove_waiter(p, &w, r, k == Priority::High);
            self.waiting[k.index()].remove(&id);
        }
        if old.path != new.path {
            if let Some(p) = old.path {
                if let Some(n) = self.per_group.get_mut(&p.2) {
                    *n -= 1;
                    if *n == 0 {
                        self.per_group.remove(&p.2);
                    }
                }
                self.tree.leave(p);
            }
            if let Some(p) = new.path {
                *self.per_group.entry(p.2).or_default() += 1;
                self.tree.join(p);
            }
        }
        if old.on_gpu != new.on_gpu {
            if new.on_gpu {
                self.on_gpu.insert(id);
            } else {
                self.on_gpu.remove(&id);
            }
        }
        if rewait && let (Some((w, r)), Some(p), Some(k)) = (new.waiting, new.path, new.class) {
            self.tree.add_waiter(p, w, r, k == Priority::High);
            self.waiting[k.index()].insert(id);
        }
        if old.holding != new.holding
            || (new.holding && (old.path, old.class) != (new.path, new.class))
            || old.granted != new.granted
            || (new.granted && old.path != new.path)
        {
            // The holder's branch (with its class's warp) counts in its
            // nodes' clocks, and a revoked holder's in its band's until it
            // answers.
            self.tree.stale.extend(old.path.into_iter().chain(new.path));
        }
        if old.granted != new.granted {
            if new.granted {
                self.granted.insert(id);
            } else {
                self.granted.remove(&id);
            }
        }
        let high = |x: &Indexed| {
            x.path
                .filter(|_| x.active && x.class == Some(Priority::High))
                .map(|p| p.1)
        };
        if high(old) != high(new) {
            if let Some(u) = high(old)
                && let Some(n) = self.high_users.get_mut(&u)
            {
                *n -= 1;
                if *n == 0 {
                    self.high_users.remove(&u);
                }
            }
            if let Some(u) = high(new) {
                *self.high_users.entry(u).or_default() += 1;
            }
        }
        let key = |x: &Indexed| x.path.filter(|_| x.active).map(|(b, u, g)| (b, u, g, id));
        let (ko, kn) = (key(old), key(new));
        if ko != kn || (old.weighs != new.weighs && kn.is_some()) {
            if let Some(k) = ko {
                self.active.remove(&k);
                self.dirty.insert((k.0, k.1));
            }
            if let Some(k) = kn {
                self.active.insert(k);
                self.dirty.insert((k.0, k.1));
            }
        }
    }

    /// Clients registered that could take the GPU from a holder of `class`
    /// or follow it: of its band or above.
    pub fn at_or_above(&self, class: Priority) -> usize {
        Priority::ALL
            .iter()
            .filter(|k| band(**k) >= band(class))
            .map(|k| self.per_class[k.index()])
            .sum()
    }

    pub fn has_members(&self, group: GroupId) -> bool {
        self.per_group.contains_key(&group)
    }

    /// Brings the sums of the (band, user) pairs that changed up to date:
    /// each unit's over its active members in id order, each user's over
    /// its units in unit order, as a pass over everyone would. Returns the
    /// pairs it recomputed.
    fn flush(&mut self, clients: &BTreeMap<ClientId, Client>) -> Vec<(usize, UserKey)> {
        let dirty = std::mem::take(&mut self.dirty);
        for &(k, u) in &dirty {
            let stale: Vec<_> = self
                .units
                .range((k, u, GroupId::MIN)..=(k, u, GroupId::MAX))
                .map(|(key, _)| *key)
                .collect();
            for key in stale {
                self.units.remove(&key);
            }
            let mut user: Option<(f64, f64)> = None;
            let mut unit: Option<(GroupId, UnitSum)> = None;
            let span = (k, u, GroupId::MIN, ClientId::MIN)..=(k, u, GroupId::MAX, ClientId::MAX);
            for &(_, _, g, id) in self.active.range(span) {
                let c = &clients[&id];
                match &mut unit {
                    Some((ug, s)) if *ug == g => s.add(c),
                    _ => {
                        if let Some((ug, s)) = unit.take() {
                            self.units.insert((k, u, ug), s);
                        }
                        let mut s = UnitSum::default();
                        s.add(c);
                        unit = Some((g, s));
                    }
                }
                let e = user.get_or_insert((0.0, 0.0));
                if let Some((_, w)) = c.user {
                    e.1 = e.1.max(w);
                }
            }
            if let Some((ug, s)) = unit {
                self.units.insert((k, u, ug), s);
            }
            match user {
                Some(mut e) => {
                    e.0 = self
                        .units
                        .range((k, u, GroupId::MIN)..=(k, u, GroupId::MAX))
                        .fold(0.0, |acc, (_, s)| acc + s.weight());
                    self.users.insert((k, u), e);
                }
                None => {
                    self.users.remove(&(k, u));
                }
            }
        }
        dirty.into_iter().collect()
    }

    /// A unit's weight among its user's units (its active members' sum).
    pub fn unit_weight(&self, p: UnitRef) -> f64 {
        sanitize_weight(self.units.get(&p).map_or(0.0, UnitSum::weight))
    }

    /// A user's weight among the band's users: a user of weight 1 weighs
    /// as a unit of `USER_SCALE`; a unit that stands for itself, its own.
    pub fn user_weight(&self, b: usize, u: UserKey) -> f64 {
        match u {
            UserKey::User(_) => {
                sanitize_weight(USER_SCALE * self.users.get(&(b, u)).map_or(0.0, |e| e.1))
            }
            UserKey::Unit(g) => self.unit_weight((b, u, g)),
        }
    }
}

/// A client's weights at each level of the tree: its user's among the
/// band's users, its unit's among the user's units, its own among the
/// unit's members. An inactive client is weighed as if it joined.
#[derive(Debug, Clone, Copy)]
pub(super) struct Levels {
    pub user: f64,
    pub unit: f64,
    pub own: f64,
}

impl Scheduler {
    /// Puts `id`'s current state in the index, in place of what it put
    /// there before; call after any change to a client.
    pub(super) fn reindex(&mut self, id: ClientId) {
        let warp = self.warp();
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        let new = Indexed::of(id, c, warp);
        let old = std::mem::replace(&mut c.idx, new.clone());
        if !c.meter.is_empty() {
            self.ix.metered.insert(id);
        }
        self.ix.apply(id, &old, &new);
        self.refresh();
    }

    /// Takes a client that left out of the index.
    pub(super) fn unindex(&mut self, id: ClientId, c: &Client) {
        self.ix.apply(id, &c.idx, &Indexed::default());
        self.ix.metered.remove(&id);
        self.refresh();
    }

    /// Sets the hierarchy's sums from the clients active now (see
    /// `weight`): once per event, after everything that can change who is
    /// active, so the weights hold until the next event, whose `settle`
    /// charges by them. The places of the nodes whose weights moved are
    /// recomputed (a `high` waiter's warp is in its node's weight).
    pub(super) fn reweigh(&mut self) {
        for (b, u) in self.ix.flush(&self.clients) {
            let t = &mut self.ix.tree;
            let units = t
                .units
                .range((b, u, GroupId::MIN)..=(b, u, GroupId::MAX))
                .filter(|(_, x)| x.n.waiting > 0)
                .map(|(p, _)| *p);
            t.stale.extend(units.collect::<Vec<_>>());
            if let Some(h) = self.holder.and_then(|h| self.clients.get(&h))
                && h.user_ref() == (b, u)
            {
                t.stale.push(h.path());
            }
        }
        self.refresh();
    }

    /// A client's weights at each level (see `Levels`).
    pub(super) fn levels(&self, c: &Client) -> Levels {
        let (b, u) = c.user_ref();
        let unit = self
            .ix
            .units
            .get(&(b, u, c.group))
            .copied()
            .unwrap_or_default();
        let (_, user_w) = self.ix.users.get(&(b, u)).copied().unwrap_or((0.0, 0.0));
        let joined = if c.is_active() || c.on_gpu() {
            unit
        } else {
            let mut j = unit;
            j.add(c);
            j
        };
        let unit_w = sanitize_weight(joined.weight());
        let user = match c.user {
            Some((_, own_w)) => sanitize_weight(USER_SCALE * user_w.max(own_w)),
            None => unit_w,
        };
        Levels {
            user,
            unit: unit_w,
            own: c.own,
        }
    }

    /// A client's effective weight, within its band: its user's part of
    /// the band's users, times its unit's part of that user's units, times
    /// its own part of its unit's members (all among those active), scaled
    /// as a user's weight is. What status shows; the tree charges level by
    /// level. An inactive client is weighed as if it were about to join.
    pub(super) fn weight(&self, c: &Client) -> f64 {
        let (k, u) = c.user_ref();
        let unit = self
            .ix
            .units
            .get(&(k, u, c.group))
            .copied()
            .unwrap_or_default();
        let (users_sum, user_w) = self.ix.users.get(&(k, u)).copied().unwrap_or((0.0, 0.0));
        let (unit_j, users_sum) = if c.is_active() || c.on_gpu() {
            (unit, users_sum)
        } else {
            let mut joined = unit;
            joined.add(c);
            (joined, users_sum - unit.weight() + joined.weight())
        };
        let unit_w = unit_j.weight();
        let in_unit = c.own / unit_j.own_sum;
        let w = match c.user {
            Some((_, own_w)) => USER_SCALE * user_w.max(own_w) * unit_w / users_sum * in_unit,
            None => unit_w * in_unit,
        };
        sanitize_weight(w)
    }
}
