//! The index against a pass over every client: after any sequence of
//! events, what the scheduler finds through its index is what a scan of
//! all clients would find, and the weights are the same to the bit.

use super::*;
use crate::sched::tree::{UnitRef, UserRef, band};
use std::cmp::Reverse;

/// The effective weights as a pass over every client computes them: per
/// (band, user, unit) the active members' sums, per (band, user) its
/// units' weights and the largest user weight; an inactive client weighed
/// as if it joined. Also the weights at each level of the tree, per user
/// and per unit, of those active.
struct Scan {
    weights: Map<ClientId, f64>,
    users: Map<UserRef, f64>,
    units: Map<UnitRef, f64>,
}

fn scan_weights(s: &Scheduler) -> Scan {
    let active = |c: &&Client| c.is_active() || c.on_gpu();
    let mut units: Map<UnitRef, UnitSum> = Map::new();
    for c in s.clients.values().filter(active) {
        units.entry(c.path()).or_default().add(c);
    }
    let mut users: Map<UserRef, (f64, f64)> = Map::new();
    for (&(k, u, _), unit) in &units {
        users.entry((k, u)).or_default().0 += unit.weight();
    }
    for c in s.clients.values().filter(active) {
        if let Some((_, w)) = c.user {
            let e = users.entry(c.user_ref()).or_default();
            e.1 = e.1.max(w);
        }
    }
    let weights = s
        .clients
        .iter()
        .map(|(&id, c)| {
            let (k, u) = c.user_ref();
            let unit = units.get(&(k, u, c.group)).copied().unwrap_or_default();
            let (users_sum, user_w) = users.get(&(k, u)).copied().unwrap_or((0.0, 0.0));
            let (unit_j, users_sum) = if active(&c) {
                (unit, users_sum)
            } else {
                let mut joined = unit;
                joined.add(c);
                (joined, users_sum - unit.weight() + joined.weight())
            };
            let in_unit = c.own / unit_j.own_sum;
            let w = match c.user {
                Some((_, own_w)) => {
                    USER_SCALE * user_w.max(own_w) * unit_j.weight() / users_sum * in_unit
                }
                None => unit_j.weight() * in_unit,
            };
            (id, sanitize_weight(w))
        })
        .collect();
    let unit_w: Map<UnitRef, f64> = units
        .iter()
        .map(|(p, x)| (*p, sanitize_weight(x.weight())))
        .collect();
    let user_w = users
        .iter()
        .map(|(&(k, u), &(_, w))| {
            let w = match u {
                UserKey::User(_) => sanitize_weight(USER_SCALE * w),
                UserKey::Unit(g) => unit_w.get(&(k, u, g)).copied().unwrap_or(1.0),
            };
            ((k, u), w)
        })
        .collect();
    Scan {
        weights,
        users: user_w,
        units: unit_w,
    }
}

/// A waiter's place in grant order by a scan: band, then its user's place
/// (the node's virtual time less the warp of any `high` waiter of the
/// user), its unit's, its own, each level's ties by FIFO stamp then id.
type Order = (
    Reverse<usize>,
    Vt,
    u64,
    UserKey,
    Vt,
    u64,
    GroupId,
    Vt,
    u64,
    ClientId,
);

/// Panics where the index and a scan of every client disagree.
pub(super) fn check_index(s: &Scheduler) {
    let ids = |f: &dyn Fn(&Client) -> bool| -> BTreeSet<ClientId> {
        s.clients
            .iter()
            .filter(|(_, c)| f(c))
            .map(|(&id, _)| id)
            .collect()
    };
    assert_eq!(s.ix.on_gpu, ids(&|c| c.on_gpu()), "on the GPU");
    assert_eq!(s.ix.granted, ids(&|c| c.grant.is_some()), "granted");
    assert!(
        ids(&|c| !c.meter.is_empty()).is_subset(&s.ix.metered),
        "a meter with history is not pruned"
    );
    for k in Priority::ALL {
        let n = s.clients.values().filter(|c| c.class == k).count();
        assert_eq!(s.ix.per_class[k.index()], n, "clients of {k:?}");
        let w = ids(&|c| c.class == k && c.state == ClientState::Waiting);
        assert_eq!(s.ix.waiting[k.index()], w, "waiting in {k:?}");
    }
    let groups: BTreeSet<GroupId> = s.clients.values().map(|c| c.group).collect();
    let indexed: BTreeSet<GroupId> = s.ix.per_group.keys().copied().collect();
    assert_eq!(indexed, groups, "units with members");
    assert!(
        s.ix.dirty.is_empty(),
        "sums left out of date after an event"
    );
    assert!(s.ix.tree.stale.is_empty(), "tree left stale after an event");
    let scan = scan_weights(s);
    for (id, c) in &s.clients {
        assert_eq!(
            s.weight(c).to_bits(),
            scan.weights[id].to_bits(),
            "weight of {id}: {c:?}"
        );
    }
    // The tree's nodes: members, waiters and `high` waiters by a scan;
    // a node without members is kept aside, and nothing else is.
    let t = &s.ix.tree;
    let count = |f: &dyn Fn(&Client) -> bool| s.clients.values().filter(|c| f(c)).count();
    for (r, x) in &t.users {
        let mine = |c: &Client| c.user_ref() == *r;
        assert_eq!(x.n.members, count(&|c| mine(c)), "members of {r:?}");
        let w = |c: &Client| mine(c) && c.state == ClientState::Waiting;
        assert_eq!(x.n.waiting, count(&|c| w(c)), "waiters of {r:?}");
        assert_eq!(x.n.high, count(&|c| w(c) && c.class == Priority::High));
        assert_eq!(x.n.members == 0, t.kept_users.contains(r), "{r:?} kept");
    }
    for (p, x) in &t.units {
        let mine = |c: &Client| c.path() == *p;
        assert_eq!(x.n.members, count(&|c| mine(c)), "members of {p:?}");
        let w = |c: &Client| mine(c) && c.state == ClientState::Waiting;
        assert_eq!(x.n.waiting, count(&|c| w(c)), "waiters of {p:?}");
        assert_eq!(x.n.high, count(&|c| w(c) && c.class == Priority::High));
        assert_eq!(x.n.members == 0, t.kept_units.contains(p), "{p:?} kept");
        assert!(t.users.contains_key(&(p.0, p.1)), "{p:?} without its user");
    }
    for c in s.clients.values() {
        assert!(t.units.contains_key(&c.path()), "{c:?} without its unit");
    }
    // Grant order, by a scan.
    let warp = s.warp();
    let waiting: Vec<(&ClientId, &Client)> = s
        .clients
        .iter()
        .filter(|(_, c)| c.state == ClientState::Waiting)
        .collect();
    let has_high = |f: &dyn Fn(&Client) -> bool| {
        waiting
            .iter()
            .any(|(_, c)| c.class == Priority::High && f(c))
    };
    let mut order: Vec<Order> = waiting
        .iter()
        .map(|&(&id, c)| {
            let (b, u, g) = c.path();
            let (un, xn) = (&t.users[&(b, u)].n, &t.units[&(b, u, g)].n);
            let uh = has_high(&|o| (band(o.class), o.user_key()) == (b, u));
            let xh = has_high(&|o| o.path() == (b, u, g));
            let uw = scan.users[&(b, u)];
            let xw = scan.units[&(b, u, g)];
            (
                Reverse(b),
                Vt(un.vtime - if uh { warp / uw } else { 0.0 }),
                un.since,
                u,
                Vt(xn.vtime - if xh { warp / xw } else { 0.0 }),
                xn.since,
                g,
                Vt(c.vtime - c.warp(warp, c.own)),
                c.seq,
                id,
            )
        })
        .collect();
    order.sort();
    let by_scan: Vec<ClientId> = order.iter().map(|o| o.9).collect();
    let by_index: Vec<ClientId> = (0..tree::BANDS)
        .rev()
        .flat_map(|b| t.waiters(b).collect::<Vec<_>>())
        .collect();
    assert_eq!(by_index, by_scan, "waiters in grant order");
    // Every clock is at or past the least place it is over: its
    // waiters', and the holder's branch.
    let mut least: Map<(usize, Option<UserKey>, Option<GroupId>), f64> = Map::new();
    let mut put = |k, v: f64| {
        let e = least.entry(k).or_insert(v);
        *e = e.min(v);
    };
    for o in &order {
        let (b, u, g) = (o.0.0, o.3, o.6);
        put((b, None, None), o.1.0);
        put((b, Some(u), None), o.4.0);
        put((b, Some(u), Some(g)), o.7.0);
    }
    // A band's clock is over revoked holders that have not answered too.
    for h in s.granted() {
        let (b, u, _) = h.path();
        put(
            (b, None, None),
            t.users[&(b, u)].n.vtime - h.warp(warp, scan.users[&(b, u)]),
        );
    }
    if let Some(h) = s.holder.map(|h| &s.clients[&h]) {
        let (b, u, g) = h.path();
        put(
            (b, Some(u), None),
            t.units[&(b, u, g)].n.vtime - h.warp(warp, scan.units[&(b, u, g)]),
        );
        put((b, Some(u), Some(g)), h.vtime - h.warp(warp, h.own));
    }
    for (&(b, u, g), &m) in &least {
        let clock = match (u, g) {
            (None, _) => t.clock[b],
            (Some(u), None) => t.users[&(b, u)].n.clock,
            (Some(u), Some(g)) => t.units[&(b, u, g)].n.clock,
        };
        assert!(clock >= m, "clock of {b} {u:?} {g:?}: {clock} < {m}");
    }
    let high_bounded = s.cfg.high_share < 1.0
        && s.clients.values().any(|c| {
            c.class < Priority::High
                && (c.state == ClientState::Holding
                    || (c.state == ClientState::Waiting && s.fits(c, s.now, false)))
        });
    assert_eq!(s.high_bounded(s.now), high_bounded, "high bounded");
    let first = by_scan
        .iter()
        .find(|&&id| Some(id) != s.holder && s.fits(&s.clients[&id], s.now, high_bounded))
        .copied();
    assert_eq!(
        s.best_waiter(s.now, s.holder, high_bounded).map(|c| c.id),
        first,
        "best waiter (holder {:?})",
        s.holder
    );
}
