//! Bad input and long runs: unknown ids, weights and limits out of range,
//! a clock that goes back, and history that must stay bounded.

use super::*;

#[test]
fn unknown_ids_are_ignored() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    s.acquire(0, 1);
    drain(&mut s);
    s.acquire(MS, 99);
    s.release(MS, 99);
    s.drained(MS, 99);
    s.remove_client(MS, 99);
    s.handle_timeout(MS);
    assert!(drain(&mut s).is_empty());
    assert_eq!(s.holder(), Some(1));
    assert_eq!(s.state(99), None);
    assert_eq!(s.status(MS).len(), 1);
    s.acquire(2 * MS, 1);
    assert!(drain(&mut s).is_empty());
}

#[test]
fn bad_weights_and_limits_are_sanitized() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, f64::NAN, Some(f64::NAN), N);
    s.add_client(0, 2, -3.0, Some(1.5), N);
    s.add_client(0, 3, 0.0, Some(0.0), N);
    for st in s.status(0) {
        assert_eq!(st.weight, 1.0);
        assert_eq!(st.limit, None);
    }
    s.add_client(0, 1, 30.0, Some(0.5), Priority::Low);
    let st = status_of(&s, 0, 1);
    assert_eq!(
        (st.weight, st.limit, st.priority),
        (30.0, Some(0.5), Priority::Low)
    );
}

#[test]
fn history_stays_bounded() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(0, 1, 1.0, None, N);
    let mut t = 0;
    for _ in 0..10_000 {
        s.acquire(t, 1);
        s.release(t + 10, 1);
        s.drained(t + 10, 1);
        t += 20;
    }
    let c = &s.clients[&1];
    assert_eq!(c.meter.total(t), 100_000);
    assert_eq!(c.meter.usage(s.cfg.window, t), 100_000);
    // What the window no longer sees goes at the client's next event.
    s.acquire(t + 2 * SEC, 1);
    assert_eq!(s.clients[&1].meter.usage(s.cfg.window, t + 2 * SEC), 0);
    assert_eq!(s.clients[&1].meter.total(t + 2 * SEC), 100_000);
}

#[test]
fn earlier_now_is_clamped() {
    let mut s = Scheduler::new(SchedConfig::default());
    s.add_client(SEC, 1, 1.0, None, N);
    s.acquire(SEC, 1);
    s.release(0, 1);
    s.drained(0, 1);
    assert_eq!(status_of(&s, 0, 1).times.total_held, 0);
}
