//! What each client was owed (`entitled`): its target integrated over the
//! time it was busy within its ceilings, which its GPU time meets where
//! shares hold; time its ceilings held it back is not owed but counted
//! apart; and a `high` burst that flaps a busy client's target leaves no
//! debt worth an alert.

use super::*;

fn owed(sim: &Sim, id: ClientId) -> (f64, f64, f64) {
    let s = status_of(&sim.s, sim.now, id);
    (
        s.times.entitled as f64 / SEC as f64,
        s.times.gpu_time as f64 / SEC as f64,
        s.times.held_back as f64 / SEC as f64,
    )
}

#[test]
fn entitlement_is_met_where_shares_hold() {
    let mut sim = Sim::new(SchedConfig::default());
    for (id, w) in [(0, 70.0), (1, 30.0)] {
        sim.add(id, w, None);
        sim.residual.insert(id, B);
        sim.start(id);
    }
    sim.run_until(20 * SEC);
    for (id, want) in [(0, 14.0), (1, 6.0)] {
        let (entitled, gpu, held) = owed(&sim, id);
        assert!((entitled - want).abs() < 0.2, "client {id}: {entitled}");
        assert!(
            (entitled - gpu).abs() < 0.2,
            "client {id}: {entitled} {gpu}"
        );
        assert_eq!(held, 0.0);
    }
}

#[test]
fn time_a_limit_holds_back_is_not_owed() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.add(1, 50.0, Some(0.2));
    sim.residual.insert(1, B);
    sim.start(1);
    sim.run_until(10 * SEC);
    let (entitled, gpu, held) = owed(&sim, 1);
    assert!((gpu - 2.0).abs() < 0.2, "{gpu}");
    assert!((entitled - gpu).abs() < 0.2, "owed {entitled}, got {gpu}");
    assert!(held > 7.5, "held back {held}");
}

/// A busy `normal` process beside another user's interactive `high`
/// bursts: its target flaps between all of the GPU and half of it with
/// every burst, but what it was owed over 10 s stays within a point of
/// what it got, so no alert on the difference fires.
#[test]
fn high_bursts_flap_the_target_but_leave_no_debt() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.proc_of(1, 1, Priority::Normal);
    sim.proc_of(2, 2, Priority::High);
    sim.residual.insert(1, B);
    sim.start(1);
    let mut t = sim.now;
    while t < 10 * SEC {
        sim.run_until(t);
        sim.burst(2);
        t += 20 * MS;
    }
    sim.run_until(10 * SEC);
    let (entitled, gpu, _) = owed(&sim, 1);
    // Owed less than all of the GPU: half of it while a burst was busy.
    assert!(
        entitled < 9.95,
        "owed {entitled} s: the bursts took nothing"
    );
    assert!(
        entitled - gpu < 0.1,
        "owed {entitled} s, got {gpu} s in 10 s"
    );
}

/// A target is a share among the shares: a busy `high` process (above
/// them) leaves a `normal` one's target whole instead of halving it for
/// as long as it is busy, and shows none of its own. Before, the normal
/// process's target dropped to a half with every `high` burst.
#[test]
fn high_is_above_the_shares_not_among_them() {
    let mut sim = Sim::new(SchedConfig::default());
    sim.proc_of(1, 1, Priority::Normal);
    sim.proc_of(2, 2, Priority::High);
    sim.residual.insert(1, B);
    sim.residual.insert(2, B);
    sim.start(1);
    sim.start(2);
    sim.run_until(SEC);
    let (normal, high) = (status_of(&sim.s, sim.now, 1), status_of(&sim.s, sim.now, 2));
    assert!(high.state != ClientState::Idle, "the high process is busy");
    assert_eq!((normal.target, high.target), (1.0, 0.0));
}
