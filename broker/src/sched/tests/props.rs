//! Property tests: random sequences of events never make two holders or
//! panic, and charges, shares and timers stay sane.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add(ClientId, f64, Option<f64>, Priority),
    Remove(ClientId),
    Acquire(ClientId),
    Release(ClientId),
    Drained(ClientId),
    Group(ClientId, GroupId, Option<f64>, Option<f64>),
    User(ClientId, UserId, f64),
    Advance(Nanos),
    Timeout,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0..6u64;
    prop_oneof![
        (
            id.clone(),
            prop_oneof![Just(1.0), Just(30.0), Just(0.0), Just(f64::NAN)],
            prop_oneof![
                Just(None),
                Just(Some(0.3)),
                Just(Some(0.01)),
                Just(Some(2.0))
            ],
            proptest::sample::select(Priority::ALL.to_vec()),
        )
            .prop_map(|(i, w, l, p)| Op::Add(i, w, l, p)),
        id.clone().prop_map(Op::Remove),
        id.clone().prop_map(Op::Acquire),
        id.clone().prop_map(Op::Release),
        id.clone().prop_map(Op::Drained),
        (
            id.clone(),
            100..103u64,
            prop_oneof![Just(None), Just(Some(25.0)), Just(Some(f64::INFINITY))],
            prop_oneof![
                Just(None),
                Just(Some(0.3)),
                Just(Some(0.02)),
                Just(Some(7.0))
            ],
        )
            .prop_map(|(i, g, w, l)| Op::Group(i, g, w, l)),
        (
            id.clone(),
            0..3u64,
            prop_oneof![Just(1.0), Just(3.0), Just(0.0), Just(f64::NAN)],
        )
            .prop_map(|(i, u, w)| Op::User(i, u, w)),
        (0..120 * MS).prop_map(Op::Advance),
        Just(Op::Timeout),
    ]
}

fn config() -> impl Strategy<Value = SchedConfig> {
    (
        0..60 * MS,
        0..2 * SEC,
        0..300 * MS,
        0..MS,
        0..SEC,
        0..5 * MS,
        prop_oneof![Just(0.5), Just(1.0), Just(0.05)],
    )
        .prop_map(
            |(timeslice, window, grace, bound, drain_timeout, wake, high_share)| SchedConfig {
                timeslice,
                window,
                grace,
                bound,
                drain_timeout,
                wake,
                high_share,
                ..SchedConfig::default()
            },
        )
}

fn check(s: &Scheduler, now: Nanos) {
    let st = s.status(now);
    let holding: Vec<_> = st
        .iter()
        .filter(|c| c.state == ClientState::Holding)
        .map(|c| c.client)
        .collect();
    assert!(holding.len() <= 1, "two holders: {holding:?}");
    assert_eq!(s.holder(), holding.first().copied());
    // Nobody waits on an idle GPU for nothing.
    if s.holder().is_none() {
        assert!(s.clone().pick(s.now).is_none());
    }
    for c in &st {
        assert!((0.0..=1.0 + 1e-9).contains(&c.achieved), "{c:?}");
        assert!(c.weight.is_finite() && c.weight > 0.0, "{c:?}");
    }
    // The charges never exceed the time that has passed.
    let total: Nanos = st.iter().map(|c| c.times.gpu_time).sum();
    assert!(total <= now + st.len() as Nanos, "{total} > {now}");
    if let Some(t) = s.next_timeout() {
        assert!(t > s.now, "timer at {t} not after {}", s.now);
    }
}

fn apply(s: &mut Scheduler, now: &mut Nanos, op: Op) {
    let now = match op {
        Op::Advance(dt) => {
            *now += dt;
            return;
        }
        _ => *now,
    };
    match op {
        Op::Add(i, w, l, p) => s.add_client(now, i, w, l, p),
        Op::Remove(i) => s.remove_client(now, i),
        Op::Acquire(i) => s.acquire(now, i),
        Op::Release(i) => s.release(now, i),
        Op::Drained(i) => s.drained(now, i),
        Op::Group(i, g, w, l) => s.set_group(now, i, g, w, l),
        Op::User(i, u, w) => s.set_user(now, i, u, w),
        Op::Advance(_) => {}
        Op::Timeout => s.handle_timeout(now),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn never_two_holders_never_panics(cfg in config(), ops in prop::collection::vec(op(), 1..200)) {
        let mut s = Scheduler::new(cfg);
        let mut now = 0;
        for op in ops {
            apply(&mut s, &mut now, op);
            while let Some(a) = s.poll_action() {
                if let Action::Grant { client, .. } = a {
                    prop_assert!(s.state(client).is_some());
                }
            }
            check(&s, now);
        }
    }
}
