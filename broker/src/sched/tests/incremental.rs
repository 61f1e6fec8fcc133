//! The index against a pass over every client: after any sequence of
//! events, what the scheduler finds through its index is what a scan of
//! all clients would find, and the weights are the same to the bit.

use super::*;

/// The effective weights as a pass over every client computes them: per
/// (class, user, unit) the active members' sums, per (class, user) its
/// units' weights and the largest user weight; an inactive client weighed
/// as if it joined.
fn weights_by_scan(s: &Scheduler) -> Map<ClientId, f64> {
    let active = |c: &&Client| c.is_active() || c.on_gpu();
    let mut units: Map<(usize, UserKey, GroupId), UnitSum> = Map::new();
    for c in s.clients.values().filter(active) {
        units
            .entry((c.class.index(), c.user_key(), c.group))
            .or_default()
            .add(c);
    }
    let mut users: Map<(usize, UserKey), (f64, f64)> = Map::new();
    for (&(k, u, _), unit) in &units {
        users.entry((k, u)).or_default().0 += unit.weight();
    }
    for c in s.clients.values().filter(active) {
        if let Some((_, w)) = c.user {
            let e = users.entry((c.class.index(), c.user_key())).or_default();
            e.1 = e.1.max(w);
        }
    }
    s.clients
        .iter()
        .map(|(&id, c)| {
            let (k, u) = (c.class.index(), c.user_key());
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
        .collect()
}

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
    let mut waiting: Vec<(&ClientId, &Client)> = s
        .clients
        .iter()
        .filter(|(_, c)| c.state == ClientState::Waiting)
        .collect();
    waiting.sort_by(|a, b| {
        b.1.class
            .cmp(&a.1.class)
            .then(a.1.vtime.total_cmp(&b.1.vtime))
            .then(a.1.seq.cmp(&b.1.seq))
    });
    let by_index: Vec<ClientId> = s.ix.waiting.iter().map(|k| k.3).collect();
    let by_scan: Vec<ClientId> = waiting.iter().map(|&(&id, _)| id).collect();
    assert_eq!(by_index, by_scan, "waiters in grant order");
    for k in Priority::ALL {
        let n = s.clients.values().filter(|c| c.class == k).count();
        assert_eq!(s.ix.per_class[k.index()], n, "clients of {k:?}");
    }
    let groups: BTreeSet<GroupId> = s.clients.values().map(|c| c.group).collect();
    let indexed: BTreeSet<GroupId> = s.ix.per_group.keys().copied().collect();
    assert_eq!(indexed, groups, "units with members");
    assert!(
        s.ix.dirty.is_empty(),
        "sums left out of date after an event"
    );
    let scan = weights_by_scan(s);
    for (id, c) in &s.clients {
        assert_eq!(
            s.weight(c).to_bits(),
            scan[id].to_bits(),
            "weight of {id}: {c:?}"
        );
    }
    let holder_class = s.holder.map(|h| s.clients[&h].class);
    let high_bounded = s.cfg.high_share < 1.0
        && s.clients.values().any(|c| {
            c.class < Priority::High
                && (c.state == ClientState::Holding
                    || (c.state == ClientState::Waiting && s.fits(c, s.now, false)))
        });
    assert_eq!(s.high_bounded(s.now), high_bounded, "high bounded");
    let best = waiting
        .iter()
        .find(|(id, c)| Some(**id) != s.holder && s.fits(c, s.now, high_bounded))
        .map(|&(&id, _)| id);
    assert_eq!(
        s.best_waiter(s.now, s.holder, high_bounded).map(|c| c.id),
        best,
        "best waiter (holder {:?} of {holder_class:?})",
        s.holder
    );
}
