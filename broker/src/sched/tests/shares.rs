//! Weighted fair shares: weights converge whatever the kernel length, a
//! unit's members split one share and keep its history across reconnects,
//! and status reports what each achieved against its target.

use super::*;

#[test]
fn equal_clients_converge_to_half() {
    assert_shares(&[50.0, 50.0], B);
}

/// Ten processes of one unit (a job, or a user) split one share: a lone
/// unit beside them still gets half the GPU.
#[test]
fn a_unit_of_ten_gets_one_share() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(0, 100.0, None);
    sim.s.set_group(0, 0, 500, None, None);
    for id in 1..=10 {
        sim.add(id, 100.0, None);
        sim.s.set_group(0, id, 600, None, None);
        sim.residual.insert(id, B);
    }
    sim.residual.insert(0, B);
    for id in 0..=10 {
        sim.start(id);
    }
    let end = 20 * SEC;
    sim.run_until(end);
    let lone = sim.gpu(0) as f64 / end as f64;
    assert!((lone - 0.5).abs() < 0.02, "lone unit got {lone:.3}");
    // An imposed unit weight (a lease's --gpu-compute) sets the split.
    let mut sim = Sim::new(SchedConfig::default());
    for id in 0..4 {
        sim.add(id, 50.0, None);
        sim.s.set_group(
            0,
            id,
            if id == 0 { 700 } else { 800 },
            Some(if id == 0 { 75.0 } else { 25.0 }),
            None,
        );
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    let first = sim.gpu(0) as f64 / end as f64;
    assert!((first - 0.75).abs() < 0.02, "the 75% unit got {first:.3}");
}

/// A process that disconnects and reconnects every 250 ms comes back
/// into its unit at the unit's virtual time and usage history, not with
/// a fresh start.
#[test]
fn reconnecting_does_not_reset_a_units_history() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 50.0, None);
    sim.s.set_group(0, 1, 900, None, None);
    sim.residual.insert(1, B);
    sim.start(1);
    let mut id = 100;
    sim.add(id, 50.0, None);
    sim.s.set_group(0, id, 901, None, None);
    sim.start(id);
    let end = 20 * SEC;
    while sim.now + 250 * MS < end {
        let t = sim.now + 250 * MS;
        sim.run_until(t);
        sim.s.remove_client(t, id);
        id += 1;
        sim.add(id, 50.0, None);
        sim.s.set_group(t, id, 901, None, None);
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(end);
    let victim = sim.gpu(1) as f64 / end as f64;
    assert!(
        victim > 0.47,
        "the steady process got {victim:.3} beside a reconnecting one"
    );
}

#[test]
fn weights_70_30_converge() {
    assert_shares(&[70.0, 30.0], B);
}

#[test]
fn three_clients_1_1_2_converge() {
    assert_shares(&[1.0, 1.0, 2.0], B);
}

/// 120 ms kernels: every handover leaves a whole kernel running beside
/// the next holder's. Charging the GPU time really used keeps 70/30.
#[test]
fn weights_hold_when_kernels_outlive_the_handover() {
    assert_shares(&[70.0, 30.0], 120 * MS);
    assert_shares(&[70.0, 30.0], 6 * MS);
    assert_shares(&[1.0, 1.0, 2.0], 120 * MS);
}

#[test]
fn achieved_and_target_reported() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 70.0, None);
    sim.add(2, 30.0, None);
    sim.add(3, 1.0, None);
    sim.start(1);
    sim.start(2);
    sim.run_until(5 * SEC);
    let st = sim.s.status(sim.now);
    assert!((st[0].achieved - 0.7).abs() < 0.03, "{st:?}");
    assert!((st[1].achieved - 0.3).abs() < 0.03, "{st:?}");
    assert!((st[0].target - 0.7).abs() < 1e-9);
    assert!((st[1].target - 0.3).abs() < 1e-9);
    assert_eq!(st[2].state, ClientState::Idle);
    assert_eq!(st[2].target, 0.0);
    assert_eq!(st[2].achieved, 0.0);
}
