//! What each event needs to find without walking every client: who is on
//! the GPU, who waits (in the order a grant picks them), who has a grant
//! out, how many clients each class and unit has, and the weights of the
//! hierarchy per user. A node may have a thousand processes registered on
//! one GPU, nearly all idle, and an event must cost what changed, not what
//! is connected.
//!
//! Every client carries the snapshot of what it put in here (`Indexed`);
//! after any change to a client, `Scheduler::reindex` swaps the old
//! snapshot's entries for the new one's. The weights of the hierarchy are
//! recomputed, at `reweigh`, only for the (class, user) pairs whose active
//! members changed, by the same sums in the same order as over everyone,
//! so they come out bit for bit the same.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet};

use super::{
    Client, ClientId, ClientState, GroupId, Priority, Scheduler, USER_SCALE, UnitSum, UserKey,
    sanitize_weight,
};

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

/// A waiter's place: highest class, then least virtual time, then FIFO.
pub(super) type WaitKey = (Reverse<Priority>, Vt, u64, ClientId);
/// An active client's place in the hierarchy: class index, user, unit.
type ActiveKey = (usize, UserKey, GroupId, ClientId);

/// What one client has put in the index.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Indexed {
    /// None: not in the index at all.
    class: Option<Priority>,
    group: GroupId,
    on_gpu: bool,
    waiting: Option<WaitKey>,
    granted: bool,
    active: Option<ActiveKey>,
    /// Own weight, imposed unit weight, user weight: what its unit's and
    /// user's sums take from it while it is active.
    weighs: (f64, Option<f64>, Option<f64>),
}

impl Indexed {
    fn of(id: ClientId, c: &Client) -> Indexed {
        let (k, u) = (c.class.index(), c.user_key());
        Indexed {
            class: Some(c.class),
            group: c.group,
            on_gpu: c.on_gpu(),
            waiting: (c.state == ClientState::Waiting).then_some((
                Reverse(c.class),
                Vt(c.vtime),
                c.seq,
                id,
            )),
            granted: c.grant.is_some(),
            active: (c.is_active() || c.on_gpu()).then_some((k, u, c.group, id)),
            weighs: (c.own, c.unit_weight, c.user.map(|(_, w)| w)),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Index {
    pub on_gpu: BTreeSet<ClientId>,
    pub waiting: BTreeSet<WaitKey>,
    /// Clients with a grant out: the holder and those revoked.
    pub granted: BTreeSet<ClientId>,
    /// Clients whose meter the window may still see.
    pub metered: BTreeSet<ClientId>,
    pub per_class: [usize; 3],
    pub per_group: BTreeMap<GroupId, usize>,
    pub active: BTreeSet<ActiveKey>,
    /// (class, user) pairs whose sums are out of date.
    pub dirty: BTreeSet<(usize, UserKey)>,
    units: BTreeMap<(usize, UserKey, GroupId), UnitSum>,
    /// Per (class, user): the sum of its units' weights, and the user's
    /// weight (the largest its active processes were given).
    users: BTreeMap<(usize, UserKey), (f64, f64)>,
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
        let member = |x: &Indexed| x.class.map(|_| x.group);
        if member(old) != member(new) {
            if let Some(g) = member(old)
                && let Some(n) = self.per_group.get_mut(&g)
            {
                *n -= 1;
                if *n == 0 {
                    self.per_group.remove(&g);
                }
            }
            if let Some(g) = member(new) {
                *self.per_group.entry(g).or_default() += 1;
            }
        }
        if old.on_gpu != new.on_gpu {
            if new.on_gpu {
                self.on_gpu.insert(id);
            } else {
                self.on_gpu.remove(&id);
            }
        }
        if old.waiting != new.waiting {
            if let Some(k) = &old.waiting {
                self.waiting.remove(k);
            }
            if let Some(k) = new.waiting {
                self.waiting.insert(k);
            }
        }
        if old.granted != new.granted {
            if new.granted {
                self.granted.insert(id);
            } else {
                self.granted.remove(&id);
            }
        }
        if old.active != new.active || (old.weighs != new.weighs && new.active.is_some()) {
            if let Some(k) = &old.active {
                self.active.remove(k);
                self.dirty.insert((k.0, k.1));
            }
            if let Some(k) = new.active {
                self.active.insert(k);
                self.dirty.insert((k.0, k.1));
            }
        }
    }

    /// Clients registered in `class` or above.
    pub fn at_or_above(&self, class: Priority) -> usize {
        self.per_class[class.index()..].iter().sum()
    }

    pub fn has_members(&self, group: GroupId) -> bool {
        self.per_group.contains_key(&group)
    }

    /// The waiters of one class, least virtual time first.
    pub fn waiting_in(&self, class: Priority) -> impl Iterator<Item = &WaitKey> {
        let lo = (Reverse(class), Vt(f64::NEG_INFINITY), 0, 0);
        self.waiting
            .range(lo..)
            .take_while(move |k| k.0 == Reverse(class))
    }

    /// Brings the sums of the (class, user) pairs that changed up to date:
    /// each unit's over its active members in id order, each user's over
    /// its units in unit order, as a pass over everyone would.
    fn flush(&mut self, clients: &BTreeMap<ClientId, Client>) {
        for (k, u) in std::mem::take(&mut self.dirty) {
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
    }
}

impl Scheduler {
    /// Puts `id`'s current state in the index, in place of what it put
    /// there before; call after any change to a client.
    pub(super) fn reindex(&mut self, id: ClientId) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        let new = Indexed::of(id, c);
        let old = std::mem::replace(&mut c.idx, new.clone());
        if !c.meter.is_empty() {
            self.ix.metered.insert(id);
        }
        self.ix.apply(id, &old, &new);
    }

    /// Takes a client that left out of the index.
    pub(super) fn unindex(&mut self, id: ClientId, c: &Client) {
        self.ix.apply(id, &c.idx, &Indexed::default());
        self.ix.metered.remove(&id);
    }

    /// Sets the hierarchy's sums from the clients active now (see
    /// `weight`): once per event, after everything that can change who is
    /// active, so the weights hold until the next event, whose `settle`
    /// charges by them.
    pub(super) fn reweigh(&mut self) {
        self.ix.flush(&self.clients);
    }

    /// A client's effective weight, within its class: its user's weight,
    /// times its unit's part of that user's units, times its own part of
    /// its unit's members (all among those active). An inactive client is
    /// weighed as if it were about to join, so its wake-up credit is what
    /// it would get.
    pub(super) fn weight(&self, c: &Client) -> f64 {
        let (k, u) = (c.class.index(), c.user_key());
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
