//! The entitlement clocks (`entitled`) against a walk of every asking
//! client, over generated events.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use crate::sched::clock::{BANDS, Member, UserKey, UserRef, Weights};
use crate::sched::entitled::{Asks, Entitled};
use crate::sched::{ClientId, GroupId, Nanos};

fn member(band: usize, user: u32, unit: GroupId, own: f64) -> Member {
    Member {
        band,
        user: UserKey::User(user.into()),
        unit,
        own,
        unit_weight: None,
        user_weight: 1.0 + f64::from(user % 3),
        high: false,
    }
}

/// Each asking client's share by walking them all, as the broker did
/// at every event: the owed ones' parts of the top band's weight.
fn shares(asking: &HashMap<ClientId, Asks>) -> HashMap<ClientId, f64> {
    let Some(top) = asking.values().map(|a| a.m.band).max() else {
        return HashMap::new();
    };
    let mut flows: BTreeMap<UserRef, Weights> = BTreeMap::new();
    for a in asking.values().filter(|a| a.m.band == top) {
        flows.entry(a.m.flow()).or_default().add(&a.m);
    }
    let total: f64 = flows.iter().map(|(r, w)| w.flow(r.1)).sum();
    asking
        .iter()
        .filter(|(_, a)| a.m.band == top && !a.parked)
        .map(|(&id, a)| {
            let w = &flows[&a.m.flow()];
            let s = a.m.own * w.per_own_weight(a.m.unit) * w.per_unit_weight(a.m.user) / total;
            (id, s)
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Step {
    Ask(ClientId, Asks),
    Stop(ClientId),
    Gone(ClientId),
    Wait(Nanos),
}

fn step() -> impl Strategy<Value = Step> {
    let asks = (0..BANDS, 0u32..3, 0u64..3, 1u32..4, any::<bool>()).prop_map(
        |(band, user, unit, own, parked)| {
            let mut m = member(
                band,
                user,
                unit + u64::from(user) * 10,
                f64::from(own) * 25.0,
            );
            // A unit's weight is imposed for all its members or none
            // (a job's `--gpu-compute`).
            if unit == 1 {
                m.unit_weight = Some(40.0);
            }
            Asks { m, parked }
        },
    );
    prop_oneof![
        (0u64..8, asks).prop_map(|(id, a)| Step::Ask(id, a)),
        (0u64..8).prop_map(Step::Stop),
        (0u64..8).prop_map(Step::Gone),
        (1u64..5_000_000).prop_map(Step::Wait),
    ]
}

proptest! {
    /// The clocks give each client what walking every asking client
    /// at every event gives: its share integrated, and the time it
    /// was parked in the top band.
    #[test]
    fn the_clocks_integrate_what_a_walk_of_every_client_would(
        steps in proptest::collection::vec(step(), 1..120)
    ) {
        let mut e = Entitled::default();
        let mut asking: HashMap<ClientId, Asks> = HashMap::new();
        let mut want: HashMap<ClientId, (f64, f64)> = HashMap::new();
        let mut now: Nanos = 0;
        for s in steps {
            match s {
                Step::Wait(dt) => {
                    let top = asking.values().map(|a| a.m.band).max();
                    for (id, share) in shares(&asking) {
                        want.entry(id).or_default().0 += share * dt as f64;
                    }
                    for (id, a) in &asking {
                        if a.parked && Some(a.m.band) == top {
                            want.entry(*id).or_default().1 += dt as f64;
                        }
                    }
                    now += dt;
                }
                Step::Ask(id, a) => {
                    e.set(id, Some(a), now);
                    asking.insert(id, a);
                }
                Step::Stop(id) => {
                    e.set(id, None, now);
                    asking.remove(&id);
                }
                Step::Gone(id) => {
                    e.forget(id, now);
                    asking.remove(&id);
                    want.remove(&id);
                }
            }
            for (id, &(o, h)) in &want {
                let (go, gh) = e.of(*id, now);
                prop_assert!((go - o).abs() <= 1e-6 * o.max(1.0) + 1.0, "client {id}: owed {go}, walked {o}");
                prop_assert!((gh - h).abs() <= 1.0, "client {id}: held back {gh}, walked {h}");
            }
        }
    }
}

#[test]
fn a_clients_share_follows_its_siblings_coming_and_going() {
    let mut e = Entitled::default();
    let a = |unit, own| Asks {
        m: member(1, 1, unit, own),
        parked: false,
    };
    e.set(1, Some(a(7, 50.0)), 0);
    e.set(2, Some(a(7, 50.0)), 1000);
    e.set(3, Some(a(8, 50.0)), 3000);
    // 1 alone for 1000, half for 2000, a quarter for 1000 (two units).
    let (owed, _) = e.of(1, 4000);
    assert!((owed - (1000.0 + 1000.0 + 250.0)).abs() < 1e-6, "{owed}");
    let (owed, _) = e.of(3, 4000);
    assert!((owed - 500.0).abs() < 1e-6, "{owed}");
}
