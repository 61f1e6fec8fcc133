//! The compute gate as an object: each test makes its own `Gate` and a
//! stand-in world (the current device, the clock, no driver), and drives
//! it as the launch hooks and the client thread do, with real threads
//! where a launch must wait or a release must wait for a launch.

use super::*;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

struct Stub {
    dev: Option<usize>,
    now: AtomicU64,
}

impl World for Stub {
    fn device(&self) -> Option<usize> {
        self.dev
    }
    fn wait_room(&self, _d: usize, _bound: u64) {}
    fn now(&self) -> u64 {
        self.now.load(SeqCst)
    }
}

const T0: u64 = 1_000_000_000;

fn on(dev: usize) -> Stub {
    Stub {
        dev: Some(dev),
        now: AtomicU64::new(T0),
    }
}

/// Gated (a session registered), every device closed.
fn arbitrated() -> Arc<Gate> {
    let g = Arc::new(Gate::new());
    g.set_devices(4);
    g.close_all(true);
    g
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
fn an_ungated_gate_lets_every_launch_through_holding_nothing() {
    let g = Gate::new();
    let p = g.pass(&on(0)).unwrap();
    assert_eq!(p, Pass::FREE);
    g.launched(p);
    assert_eq!(g.gauges().in_flight, 0);
    // Nothing is posted either: no session to ask.
    assert_eq!(g.gauges().wants, 0);
}

#[test]
fn an_open_device_counts_its_launch_until_it_returns() {
    let g = arbitrated();
    g.open(1, false, 0, None, false);
    let p = g.pass(&on(1)).unwrap();
    assert_eq!(p.tracked(), None);
    assert_eq!(g.gauges().in_flight, 0b10);
    g.launched(p);
    assert_eq!(g.gauges().in_flight, 0);
    // A bounded grant tracks its launches (inflight.rs times them).
    g.open(1, true, 250_000, Some(T0), false);
    let p = g.pass(&on(1)).unwrap();
    assert_eq!(p.tracked(), Some(1));
    g.launched(p);
}

#[test]
fn a_closed_device_posts_its_want_and_waits_for_the_grant() {
    let g = arbitrated();
    assert_eq!(
        g.pass_now(&on(2)),
        None,
        "a thread holding a pass never waits"
    );
    let launched = Arc::new(AtomicBool::new(false));
    let t = {
        let (g, launched) = (g.clone(), launched.clone());
        std::thread::spawn(move || {
            let p = g.pass(&on(2)).unwrap();
            launched.store(true, SeqCst);
            g.launched(p);
            p
        })
    };
    wait_until("the want posted", || g.gauges().wants == 0b100);
    assert!(!launched.load(SeqCst), "launched before its grant");
    g.open(2, false, 0, None, false);
    let p = t.join().unwrap();
    assert!(launched.load(SeqCst));
    assert_ne!(p, Pass::FREE, "counted in flight under the grant");
    // Granted: nothing wanted any more.
    assert_eq!(g.gauges().wants, 0);
}

#[test]
fn ending_arbitration_frees_a_waiting_launch() {
    let g = arbitrated();
    let t = {
        let g = g.clone();
        std::thread::spawn(move || g.pass(&on(0)).unwrap())
    };
    wait_until("the want posted", || g.gauges().wants == 1);
    g.close_all(false);
    assert_eq!(t.join().unwrap(), Pass::FREE);
    assert_eq!(g.gauges().wants, 0);
}

#[test]
fn an_armed_device_lets_its_first_launch_out_ahead_of_the_grant() {
    let g = arbitrated();
    let w = on(0);
    g.arm(0b1);
    let p = g.pass(&w).unwrap();
    // Not counted (no grant for a release to wait for), but its work is
    // tracked under the optimistic bound, and the session is asked.
    assert_eq!(p.tracked(), Some(0));
    g.launched(p);
    let gauges = g.gauges();
    assert_eq!(gauges.wants, 1);
    assert_eq!(gauges.optimistic_until[0], T0 + OPTIMISTIC_NS);
    // The window lets launches out until it ends; the arming was used.
    w.now.store(T0 + OPTIMISTIC_NS - 1, SeqCst);
    assert_eq!(g.pass(&w).unwrap().tracked(), Some(0));
    w.now.store(T0 + OPTIMISTIC_NS, SeqCst);
    assert_eq!(g.pass_now(&w), None);
    // The session ends the window it saw run out (and drains); a grant
    // ends it too.
    assert!(g.end_window(0, T0 + OPTIMISTIC_NS));
    assert!(!g.end_window(0, T0 + OPTIMISTIC_NS));
    g.arm(0b1);
    let _ = g.pass(&w).unwrap();
    g.open(0, false, 0, None, true);
    assert_eq!(g.gauges().optimistic_until[0], 0);
}

/// A release returns only once the launch let through before it has
/// returned, on each lane: the device's, the all-open counter's and the
/// per-thread slots' (membarrier, where the kernel has it). The launch
/// holds its pass while the release starts (a barrier), so the two
/// overlap.
#[test]
fn a_release_waits_for_the_launch_in_flight_on_every_lane() {
    for (all_open, slots) in [(false, false), (true, false), (true, true)] {
        let g = arbitrated();
        if slots {
            g.register_membarrier();
        }
        g.open(3, false, 0, None, all_open);
        let order = Arc::new(Mutex::new(Vec::new()));
        let p = g.pass(&on(3)).unwrap();
        let start = Arc::new(std::sync::Barrier::new(2));
        let closer = {
            let (g, order, start) = (g.clone(), order.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                g.close(3);
                order.lock().unwrap().push("released");
            })
        };
        start.wait();
        // The release is under way (or about to be): it cannot finish
        // while this launch is out.
        std::thread::yield_now();
        order.lock().unwrap().push("launch returned");
        g.launched(p);
        closer.join().unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["launch returned", "released"],
            "all_open {all_open}, slots {slots}"
        );
        // Closed: the next launch waits (or, holding a pass, backs out).
        assert_eq!(g.pass_now(&on(3)), None);
    }
}

#[test]
fn drains_are_handed_to_the_drain_thread_and_reported_once() {
    let g = arbitrated();
    g.request_drain(1);
    g.request_drain(3);
    assert_eq!(g.drain_requests(), 0b1010);
    g.drained(1);
    assert_eq!(g.gauges().drained, 0b10);
    assert_eq!(g.gauges().drained, 0, "reported once");
    assert!(!g.gauges().drain_lost);
    g.drain_lost();
    assert!(g.gauges().drain_lost);
}

#[test]
fn the_first_registration_is_waited_for_a_bounded_time() {
    let g = arbitrated();
    let t0 = Instant::now();
    g.wait_first_registration(Duration::from_millis(50));
    assert!(t0.elapsed() >= Duration::from_millis(50));
    let waiter = {
        let g = g.clone();
        std::thread::spawn(move || g.wait_first_registration(Duration::from_secs(60)))
    };
    g.first_registration_done();
    waiter.join().unwrap();
}

#[test]
fn a_fork_child_starts_from_nothing() {
    let g = arbitrated();
    g.open(0, true, 250_000, Some(T0), false);
    g.arm(0b10);
    let p = g.pass(&on(0)).unwrap();
    g.request_drain(0);
    g.drained(2);
    g.drain_lost();
    // The child: no thread of the parent's is inside a launch there.
    g.reset_after_fork();
    let gauges = g.gauges();
    assert_eq!(
        (
            gauges.in_flight,
            gauges.wants,
            gauges.drained,
            gauges.drain_lost
        ),
        (0, 0, 0, false)
    );
    assert_eq!(g.pass(&on(0)).unwrap(), Pass::FREE, "ungated");
    // The parent's pass is not the child's to give back; dropping it does
    // nothing.
    let _ = p;
}

#[test]
fn an_exit_waits_for_its_last_report_a_bounded_time() {
    let g = arbitrated();
    // Nobody answers: the exit goes on after the bound.
    let t0 = Instant::now();
    g.report_at_exit(Duration::from_millis(30));
    assert!(t0.elapsed() >= Duration::from_millis(30));
    assert!(g.gauges().exiting);
    // The client thread answers.
    let g = arbitrated();
    let exiting = {
        let g = g.clone();
        std::thread::spawn(move || g.report_at_exit(Duration::from_secs(60)))
    };
    wait_until("the exit posted", || g.gauges().exiting);
    g.exit_reported();
    exiting.join().unwrap();
}
