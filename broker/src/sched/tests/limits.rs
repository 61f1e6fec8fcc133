//! Ceilings: a client's `GPU_COMPUTE_LIMIT` and a unit's `--gpu-limit`,
//! held in each window alone or under contention, and across reconnects.

use super::*;

/// A limit's usage history also survives a reconnect within the unit.
#[test]
fn a_limit_survives_reconnects() {
    let mut sim = Sim::new(SchedConfig::default());
    let mut id = 1;
    sim.add(id, 50.0, Some(0.2));
    sim.s.set_group(0, id, 42, None, None);
    sim.residual.insert(id, B);
    sim.start(id);
    let end = 10 * SEC;
    let mut used = 0;
    while sim.now + 100 * MS < end {
        let t = sim.now + 100 * MS;
        sim.run_until(t);
        used += sim.gpu(id);
        sim.s.remove_client(t, id);
        id += 1;
        sim.add(id, 50.0, Some(0.2));
        sim.s.set_group(t, id, 42, None, None);
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    used += sim.gpu(id);
    let share = used as f64 / end as f64;
    assert!(
        share < 0.23,
        "a 20% limit reconnecting every 100 ms used {share:.3}"
    );
}

/// A job's `--gpu-limit` bounds its members together, however many there
/// are: idle members neither dilute it nor add to it.
#[test]
fn a_units_limit_holds_for_its_members_together() {
    for (busy, idle) in [(1, 0), (1, 9), (3, 0), (2, 200)] {
        let mut sim = Sim::new(SchedConfig::default());
        let n = busy + idle;
        for id in 0..n {
            sim.add(id, 50.0, None);
            sim.s.set_group(0, id, 77, None, Some(0.3));
            sim.residual.insert(id, B);
        }
        for id in 0..busy {
            sim.start(id);
        }
        let end = 10 * SEC;
        sim.run_until(end);
        let total: Nanos = (0..n).map(|i| sim.gpu(i)).sum();
        let share = total as f64 / end as f64;
        assert!(
            (share - 0.3).abs() < 0.02,
            "{busy} busy and {idle} idle members got {share} of a 30% limit"
        );
    }
}

#[test]
fn limit_alone_holds_its_share_of_each_window() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, Some(0.3));
    sim.start(1);
    let mut saw_idle = false;
    for tenth in 10..=100 {
        sim.run_until(tenth * SEC / 10);
        let a = status_of(&sim.s, sim.now, 1).achieved;
        assert!(
            (0.285..=0.305).contains(&a),
            "window ending {tenth}/10 s: {a}"
        );
        if sim.s.holder().is_none() {
            saw_idle = true;
            assert!(sim.s.next_timeout().is_some());
        }
    }
    assert!(saw_idle, "an over-budget lone client leaves the GPU idle");
    assert!(sim.grants_to(1).iter().all(|g| g.1.is_some()));
    let share = sim.gpu(1) as f64 / sim.now as f64;
    assert!((share - 0.3).abs() < 0.005, "{share}");
}

#[test]
fn limit_caps_a_client_under_contention_too() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, Some(0.2));
    sim.add(2, 1.0, None);
    sim.start(1);
    sim.start(2);
    sim.run_until(10 * SEC);
    let s1 = sim.gpu(1) as f64 / (10 * SEC) as f64;
    let s2 = sim.gpu(2) as f64 / (10 * SEC) as f64;
    assert!((s1 - 0.2).abs() < 0.01, "{s1}");
    assert!((s2 - 0.8).abs() < 0.01, "{s2}");
}

#[test]
fn limit_set_on_open_ended_holder_slices_it() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    assert_eq!(drain(&mut s), vec![grant(1, 1, None, 0)]);
    // A slice from now (its first request, a burst, is done), within
    // what the limit leaves.
    s.add_client(10 * MS, 1, 1.0, Some(0.5), N);
    assert_eq!(
        drain(&mut s),
        vec![Action::Grant {
            client: 1,
            grant: 1,
            slice: Some(20 * MS),
            bound: 0,
            waiters: false
        }]
    );
}

/// A request its limit kept out comes back as no burst: what it waited
/// for was its budget, not the GPU's quantum, so when it fits again it
/// gets an ordinary grant (the in-flight bound, not a burst's eight
/// times it) and an ordinary request. Before, it kept the burst it came
/// with however long it was parked (red team, seed 2027).
#[test]
fn a_request_its_limit_kept_out_comes_back_as_no_burst() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 1.0, Some(0.1));
    sim.add(2, 1.0, None);
    sim.residual.insert(2, B);
    sim.start(2);
    sim.start(1);
    // Client 1 uses its tenth of the window, then withdraws its request.
    sim.run_until(300 * MS);
    assert!(status_of(&sim.s, sim.now, 1).achieved > 0.09);
    assert_ne!(sim.s.holder(), Some(1), "kept out by its limit");
    sim.busy.remove(&1);
    sim.s.release(sim.now, 1);
    sim.pump();
    // Idle a while, it asks again, still over its budget: parked.
    sim.run_until(310 * MS);
    let asked = sim.now;
    sim.s.acquire(asked, 1);
    sim.s.drained(asked, 1);
    sim.pump();
    assert_ne!(sim.s.holder(), Some(1), "parked while over its budget");
    while sim.s.holder() != Some(1) {
        assert!(sim.now < asked + 2 * SEC, "never granted");
        sim.run_until(sim.now + MS);
    }
    assert!(sim.now > asked + 500 * MS, "granted at {}", sim.now);
    let bound = sim
        .log
        .iter()
        .rev()
        .find_map(|&(_, a)| match a {
            Action::Grant {
                client: 1, bound, ..
            } => Some(bound),
            _ => None,
        })
        .expect("a grant to 1");
    assert_eq!(bound, B, "granted as a burst after being parked");
}
