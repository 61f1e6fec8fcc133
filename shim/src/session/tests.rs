//! The session in virtual time: each test feeds events at chosen instants
//! and checks the actions, with no thread, socket or clock.

use super::*;
use gpufrac_common::wire::{ClientMsg, DeviceReg, ServerMsg};
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const T0: u64 = 1_000 * MS;

fn uuid(i: usize) -> [u8; 16] {
    [i as u8 + 1; 16]
}

fn regs(n: usize) -> Vec<DeviceReg> {
    (0..n)
        .map(|i| DeviceReg {
            uuid: uuid(i),
            ordinal: i as u32,
            mem_cap: 0,
            mem_total: 1 << 30,
        })
        .collect()
}

fn run(s: &mut Session, now: u64, e: Event<'_>) -> Vec<Action> {
    let mut out = Vec::new();
    s.on(now, e, &mut out);
    out
}

fn connect(s: &mut Session, now: u64, n: usize) -> Vec<Action> {
    run(
        s,
        now,
        Event::Connected {
            devices: regs(n),
            command: "python train.py".into(),
        },
    )
}

fn session(n: usize) -> Session {
    let mut s = Session::new(&ShimConfig::default());
    connect(&mut s, T0, n);
    s
}

fn grant(dev: usize, id: u64, slice_ns: u64, bound_ns: u64, waiters: bool) -> Event<'static> {
    Event::Message(ServerMsg::Grant {
        uuid: uuid(dev),
        grant: id,
        slice_ns,
        bound_ns,
        waiters,
    })
}

fn revoke(dev: usize, id: u64) -> Event<'static> {
    Event::Message(ServerMsg::Revoke {
        uuid: uuid(dev),
        grant: id,
    })
}

/// Gauges of a process that last launched at `last` on every device and
/// has nothing in flight.
fn idle_since(last: u64) -> Gauges {
    Gauges {
        last_launch: [last; MAX_DEVICES],
        ..Gauges::default()
    }
}

fn opens(a: &[Action]) -> Vec<usize> {
    a.iter()
        .filter_map(|a| match a {
            Action::Open { dev, .. } => Some(*dev),
            _ => None,
        })
        .collect()
}

/// The releases among `a`: (device, asks again first).
fn releases(a: &[Action]) -> Vec<(usize, bool)> {
    a.iter()
        .enumerate()
        .filter_map(|(k, act)| match act {
            Action::Close { dev } => {
                let again = ClientMsg::Acquire { uuid: uuid(*dev) };
                Some((*dev, k > 0 && a[k - 1] == Action::Send(again)))
            }
            _ => None,
        })
        .collect()
}

/// The devices asked for (`Acquire`) among `a`.
fn asked(a: &[Action]) -> Vec<usize> {
    a.iter()
        .filter_map(|a| match a {
            Action::Send(ClientMsg::Acquire { uuid: u }) => Some(usize::from(u[0]) - 1),
            _ => None,
        })
        .collect()
}

/// The `held_ns` of the `Release` among `a`.
fn held_ns(a: &[Action]) -> Option<u64> {
    a.iter().find_map(|a| match a {
        Action::Send(ClientMsg::Release { held_ns, .. }) => Some(*held_ns),
        _ => None,
    })
}

/// Gauges of a process whose threads want `wants` (and are otherwise idle
/// since `last`).
fn wanting(wants: u64, last: u64) -> Gauges {
    Gauges {
        wants,
        ..idle_since(last)
    }
}

fn sends(a: &[Action]) -> Vec<&ClientMsg> {
    a.iter()
        .filter_map(|a| match a {
            Action::Send(m) => Some(m),
            _ => None,
        })
        .collect()
}

#[test]
fn connecting_registers_then_arbitrates() {
    let mut cfg = ShimConfig {
        job: 42,
        compute_share: Some(25.0),
        ..ShimConfig::default()
    };
    cfg.compute_priority = Priority::Low;
    let mut s = Session::new(&cfg);
    let a = connect(&mut s, T0, 2);
    // Join settles the job, so it goes before Register; only then may
    // application threads send on the connection.
    assert_eq!(a[0], Action::Send(ClientMsg::Join { job: 42 }));
    assert_eq!(
        a[1],
        Action::Send(ClientMsg::Register {
            command: "python train.py".into(),
            devices: regs(2),
            share: Some(25.0),
            limit: None,
            priority: Priority::Low,
        })
    );
    assert_eq!(a[2], Action::Arbitrate);
    // Without a job there is no Join.
    let mut s = Session::new(&ShimConfig::default());
    let a = connect(&mut s, T0, 1);
    assert!(matches!(a[0], Action::Send(ClientMsg::Register { .. })));
}

#[test]
fn a_grant_opens_its_device_and_all_open_needs_every_device_unshared() {
    let mut s = session(2);
    let a = run(&mut s, T0, grant(0, 1, 0, 0, false));
    assert_eq!(
        a[0],
        Action::Open {
            dev: 0,
            contended: false,
            bound_ns: 0,
            stamp: None,
            all_open: false
        }
    );
    let a = run(&mut s, T0 + 1, grant(1, 2, 0, 0, false));
    assert!(matches!(
        a[0],
        Action::Open {
            dev: 1,
            all_open: true,
            ..
        }
    ));
    // Someone waits on device 1: contended, stamped from now, and the
    // lane that skips the per-device check closes.
    let a = run(&mut s, T0 + 2, grant(1, 2, 0, 0, true));
    assert_eq!(
        a[0],
        Action::Open {
            dev: 1,
            contended: true,
            bound_ns: 0,
            stamp: Some(T0 + 2),
            all_open: false
        }
    );
    // A bound alone shares the GPU too.
    let a = run(&mut s, T0 + 3, grant(0, 1, 0, 250_000, false));
    assert!(matches!(
        a[0],
        Action::Open {
            dev: 0,
            contended: false,
            bound_ns: 250_000,
            stamp: Some(_),
            all_open: false
        }
    ));
    assert_eq!(s.open(), 0b11);
}

#[test]
fn a_grant_for_a_device_this_process_does_not_have_is_ignored() {
    let mut s = session(1);
    assert!(run(&mut s, T0, grant(5, 1, 0, 0, false)).is_empty());
    assert!(run(&mut s, T0, revoke(5, 1)).is_empty());
    assert_eq!(s.open(), 0);
}

#[test]
fn a_revoke_of_the_current_grant_releases_asking_again_then_drains() {
    let mut s = session(1);
    run(&mut s, T0, grant(0, 7, 20 * MS, 0, false));
    let a = run(&mut s, T0 + 20 * MS, revoke(0, 7));
    // Asked again before the Release (heard after it, the broker would
    // take the Acquire for the holder's and idle it), which goes out once
    // no launch is past the gate; the drain after.
    assert_eq!(
        a[..4],
        [
            Action::Send(ClientMsg::Acquire { uuid: uuid(0) }),
            Action::Close { dev: 0 },
            Action::Send(ClientMsg::Release {
                uuid: uuid(0),
                held_ns: 20 * MS
            }),
            Action::Drain { dev: 0 },
        ]
    );
    assert_eq!(s.open(), 0);
    // Asked already: the threads that want it now add no Acquire.
    let a = run(&mut s, T0 + 21 * MS, Event::Tick(&wanting(1, T0)));
    assert!(
        !sends(&a)
            .iter()
            .any(|m| matches!(m, ClientMsg::Acquire { .. })),
        "{a:?}"
    );
}

#[test]
fn a_grant_is_held_from_its_first_message_not_its_updates() {
    let mut s = session(1);
    run(&mut s, T0, grant(0, 7, 0, 0, false));
    // Someone asks: the same grant, now contended.
    let a = run(&mut s, T0 + 5 * MS, grant(0, 7, 20 * MS, 0, true));
    assert!(matches!(
        a[0],
        Action::Open {
            dev: 0,
            contended: true,
            ..
        }
    ));
    let a = run(&mut s, T0 + 25 * MS, revoke(0, 7));
    assert_eq!(held_ns(&a), Some(25 * MS));
}

#[test]
fn a_revoke_of_another_grant_or_of_a_released_one_is_ignored() {
    let mut s = session(1);
    run(&mut s, T0, grant(0, 7, 20 * MS, 0, false));
    assert!(run(&mut s, T0 + MS, revoke(0, 6)).is_empty());
    assert_eq!(s.open(), 1);
    // Handed back idle, then the broker's revoke of that grant crosses the
    // release: nothing is released twice.
    let a = run(&mut s, T0 + MS, Event::Tick(&idle_since(T0)));
    assert_eq!(releases(&a), [(0, false)]);
    assert!(run(&mut s, T0 + 2 * MS, revoke(0, 7)).is_empty());
}

#[test]
fn a_grant_update_that_crossed_the_release_is_ignored() {
    let mut s = session(1);
    run(&mut s, T0, grant(0, 7, 0, 0, true));
    let a = run(&mut s, T0 + MS, Event::Tick(&idle_since(T0)));
    assert_eq!(releases(&a), [(0, false)]);
    // The broker's update of grant 7 (sent before it saw the release).
    assert!(opens(&run(&mut s, T0 + MS + 1, grant(0, 7, 20 * MS, 0, true))).is_empty());
    assert_eq!(s.open(), 0);
    // A new grant opens.
    assert_eq!(
        opens(&run(&mut s, T0 + 2 * MS, grant(0, 8, 0, 0, false))),
        [0]
    );
}

#[test]
fn idle_hand_back_only_while_shared_and_truly_idle() {
    let mut s = session(2);
    // Device 0 alone: never handed back however idle.
    run(&mut s, T0, grant(0, 1, 0, 0, false));
    // Device 1 sliced: handed back after IDLE_HANDBACK_NS without launches.
    run(&mut s, T0, grant(1, 2, 20 * MS, 0, false));
    let last = T0 + 3 * MS;
    let g = idle_since(last);
    assert!(releases(&run(&mut s, last + IDLE_HANDBACK_NS - 1, Event::Tick(&g))).is_empty());
    // Waiting for its own kernels is not idleness.
    let syncing = Gauges {
        syncing: true,
        ..g.clone()
    };
    assert!(releases(&run(&mut s, last + 10 * MS, Event::Tick(&syncing))).is_empty());
    // Nor is a launch still inside the driver call.
    let busy = Gauges {
        in_flight: 0b10,
        ..g.clone()
    };
    assert!(releases(&run(&mut s, last + 10 * MS, Event::Tick(&busy))).is_empty());
    let a = run(&mut s, last + IDLE_HANDBACK_NS, Event::Tick(&g));
    assert_eq!(releases(&a), [(1, false)]);
    assert!(a.contains(&Action::Drain { dev: 1 }));
    assert_eq!(s.open(), 0b01);
    // Released once.
    assert!(releases(&run(&mut s, last + 20 * MS, Event::Tick(&g))).is_empty());
}

#[test]
fn the_tick_is_fine_while_a_shared_grant_or_an_optimistic_window_needs_it() {
    let mut s = session(1);
    assert_eq!(s.tick_ns(false), COARSE_TICK_NS);
    assert_eq!(s.tick_ns(true), IDLE_HANDBACK_NS / 2);
    run(&mut s, T0, grant(0, 1, 0, 0, false));
    assert_eq!(s.tick_ns(false), COARSE_TICK_NS);
    run(&mut s, T0, grant(0, 1, 0, 250_000, false));
    assert_eq!(s.tick_ns(false), IDLE_HANDBACK_NS / 2);
}

#[test]
fn an_optimistic_window_that_runs_out_without_a_grant_ends_and_drains() {
    let mut s = session(2);
    let mut g = idle_since(T0);
    g.optimistic_until[1] = T0 + MS;
    g.wants = 0b10;
    let ended = |a: &[Action]| a.iter().any(|a| matches!(a, Action::EndOptimism { .. }));
    assert!(!ended(&run(&mut s, T0 + MS - 1, Event::Tick(&g))));
    let a = run(&mut s, T0 + MS, Event::Tick(&g));
    assert!(a.contains(&Action::EndOptimism {
        dev: 1,
        until: T0 + MS
    }));
    // A window on a device that got its grant meanwhile is the grant's.
    run(&mut s, T0 + MS, grant(1, 3, 0, 0, false));
    assert!(!ended(&run(&mut s, T0 + 2 * MS, Event::Tick(&g))));
}

#[test]
fn usage_goes_out_when_it_changed_at_most_every_report_interval() {
    let mut s = session(2);
    let mut g = idle_since(T0);
    g.usage[0] = (100, 200, 0);
    let a = run(&mut s, T0, Event::Tick(&g));
    // The first report of a session says every device.
    assert_eq!(sends(&a).len(), 2);
    assert!(sends(&a).contains(&&ClientMsg::Usage {
        uuid: uuid(0),
        used: 100,
        peak: 200,
        ooms: 0
    }));
    g.usage[1] = (5, 5, 1);
    // Changed, but too soon.
    assert!(sends(&run(&mut s, T0 + REPORT_EVERY_NS - 1, Event::Tick(&g))).is_empty());
    let a = run(&mut s, T0 + REPORT_EVERY_NS, Event::Tick(&g));
    assert_eq!(
        sends(&a),
        [&ClientMsg::Usage {
            uuid: uuid(1),
            used: 5,
            peak: 5,
            ooms: 1
        }]
    );
    // Unchanged: nothing.
    assert!(sends(&run(&mut s, T0 + 3 * REPORT_EVERY_NS, Event::Tick(&g))).is_empty());
}

#[test]
fn a_silent_broker_is_probed_then_deemed_stalled_while_waited_on() {
    let mut s = session(1);
    let waiting = wanting(1, 0);
    // Nothing asked: silence is fine however long.
    run(&mut s, T0, Event::Tick(&Gauges::default()));
    assert!(run(&mut s, T0 + 10 * STALL_NS, Event::Tick(&Gauges::default())).is_empty());
    let t = T0 + 10 * STALL_NS;
    let acquire = ClientMsg::Acquire { uuid: uuid(0) };
    assert_eq!(sends(&run(&mut s, t, Event::Tick(&waiting))), [&acquire]);
    let a = run(&mut s, t + watch::PROBE_NS, Event::Tick(&waiting));
    // Asked again (half a second on), and probed.
    assert_eq!(sends(&a), [&acquire, &ClientMsg::Ping]);
    // An answer restarts the count.
    run(&mut s, t + watch::PROBE_NS + 1, Event::Heard);
    let a = run(&mut s, t + STALL_NS, Event::Tick(&waiting));
    assert!(!a.contains(&Action::End));
    let t = t + watch::PROBE_NS + 1;
    let a = run(&mut s, t + STALL_NS, Event::Tick(&waiting));
    assert!(
        a.ends_with(&[
            Action::Say(Note::StalledUnarbitrated { loud: false }),
            Action::End,
            Action::Unarbitrated { gated: false }
        ]),
        "{a:?}"
    );
    assert!(!s.is_connected());
    // The session is over: its ticks and messages do nothing.
    assert!(run(&mut s, t + 2 * STALL_NS, Event::Tick(&waiting)).is_empty());
    assert!(run(&mut s, t + 2 * STALL_NS, grant(0, 1, 0, 0, false)).is_empty());
    // Said already: the failures to reconnect that follow say nothing.
    let a = run(
        &mut s,
        t + 3 * STALL_NS,
        Event::ConnectFailed("no broker".into()),
    );
    assert!(!a.iter().any(|a| matches!(a, Action::Say(_))));
}

#[test]
fn a_holder_of_a_slice_gives_a_silent_broker_the_slice_too() {
    let mut s = session(1);
    let slice = 50 * MS;
    run(&mut s, T0, grant(0, 1, slice, 0, false));
    // Busy on the GPU all along, so no hand-back.
    let busy = |now| Gauges {
        in_flight: 1,
        last_launch: [now; MAX_DEVICES],
        ..Gauges::default()
    };
    run(&mut s, T0, Event::Tick(&busy(T0)));
    let a = run(&mut s, T0 + STALL_NS, Event::Tick(&busy(T0 + STALL_NS)));
    assert!(!a.contains(&Action::End));
    let a = run(&mut s, T0 + STALL_NS + slice, Event::Tick(&busy(T0)));
    assert!(a.contains(&Action::End));
}

#[test]
fn with_the_broker_required_a_stall_waits_and_is_said_once() {
    let cfg = ShimConfig {
        broker: BrokerMode::Required,
        ..ShimConfig::default()
    };
    let mut s = Session::new(&cfg);
    connect(&mut s, T0, 1);
    let waiting = wanting(1, 0);
    let said = |a: &[Action]| a.iter().filter(|a| matches!(a, Action::Say(_))).count();
    run(&mut s, T0, Event::Tick(&waiting));
    let a = run(&mut s, T0 + STALL_NS, Event::Tick(&waiting));
    assert!(
        a.contains(&Action::Say(Note::StalledWaiting)) && said(&a) == 1,
        "{a:?}"
    );
    assert_eq!(
        said(&run(&mut s, T0 + 2 * STALL_NS, Event::Tick(&waiting))),
        0
    );
    assert!(s.is_connected());
    // Lost, launches wait for a broker rather than run unarbitrated.
    let a = run(&mut s, T0 + 3 * STALL_NS, Event::Lost("closed".into()));
    assert!(a.contains(&Action::Unarbitrated { gated: true }));
}

#[test]
fn a_broker_that_answers_registration_sets_the_cap_or_refuses() {
    let mut s = session(1);
    let a = run(
        &mut s,
        T0,
        Event::Message(ServerMsg::Registered { mem_cap: 1 << 20 }),
    );
    assert_eq!(
        a,
        [Action::ApplyCap(1 << 20), Action::FirstRegistrationDone]
    );
    let a = run(
        &mut s,
        T0,
        Event::Message(ServerMsg::Registered { mem_cap: 0 }),
    );
    assert_eq!(a, [Action::FirstRegistrationDone]);
    let a = run(
        &mut s,
        T0,
        Event::Message(ServerMsg::Error {
            code: 1,
            message: "no".into(),
        }),
    );
    assert_eq!(
        a,
        [
            Action::Say(Note::Refused("no".into())),
            Action::FirstRegistrationDone
        ]
    );
}

#[test]
fn a_restarted_broker_gets_a_fresh_registration_and_nothing_old_holds() {
    let mut s = session(2);
    run(&mut s, T0, grant(0, 7, 0, 0, true));
    run(&mut s, T0, grant(1, 8, 0, 0, false));
    run(&mut s, T0 + MS, Event::Tick(&idle_since(T0)));
    let mut g = idle_since(T0);
    g.usage[0] = (1, 1, 0);
    run(&mut s, T0 + MS, Event::Tick(&g));
    let a = run(
        &mut s,
        T0 + 2 * MS,
        Event::Lost("broker closed the connection".into()),
    );
    assert_eq!(
        a,
        [
            Action::Say(Note::Lost("broker closed the connection".into())),
            Action::End,
            Action::Unarbitrated { gated: false }
        ]
    );
    assert_eq!(s.open(), 0);
    // Lost after a served session: the first failure to reconnect is said.
    let a = run(
        &mut s,
        T0 + 3 * MS,
        Event::ConnectFailed("no broker".into()),
    );
    assert!(
        a.iter()
            .any(|a| matches!(a, Action::Say(Note::NoBroker { .. })))
    );
    let a = run(
        &mut s,
        T0 + 4 * MS,
        Event::ConnectFailed("no broker".into()),
    );
    assert!(!a.iter().any(|a| matches!(a, Action::Say(_))));
    let a = connect(&mut s, T0 + 500 * MS, 2);
    assert!(matches!(a[0], Action::Send(ClientMsg::Register { .. })));
    // The new broker numbers grants afresh: its 7 is not the old one.
    assert_eq!(
        opens(&run(&mut s, T0 + 501 * MS, grant(0, 7, 0, 0, false))),
        [0]
    );
    // And it hears every device's usage, changed or not.
    let a = run(&mut s, T0 + 501 * MS, Event::Tick(&g));
    assert_eq!(
        sends(&a)
            .iter()
            .filter(|m| matches!(m, ClientMsg::Usage { .. }))
            .count(),
        2
    );
}

#[test]
fn a_forked_child_starts_with_a_session_of_its_own() {
    // The child has no client thread: the parent's session stays behind on
    // its stack, and the child's first context starts a new one, which
    // holds nothing until its own broker connection registers.
    let mut parent = session(1);
    run(&mut parent, T0, grant(0, 1, 0, 0, false));
    let mut child = Session::new(&ShimConfig::default());
    assert_eq!(child.open(), 0);
    assert!(!child.is_connected());
    assert!(run(&mut child, T0, grant(0, 1, 0, 0, false)).is_empty());
    assert!(run(&mut child, T0, Event::Tick(&idle_since(0))).is_empty());
    assert_eq!(
        opens(&{
            connect(&mut child, T0, 1);
            run(&mut child, T0, grant(0, 1, 0, 0, false))
        }),
        [0]
    );
}

#[test]
fn what_threads_want_is_asked_once_then_again_after_half_a_second() {
    let mut s = session(2);
    let a = run(&mut s, T0, Event::Tick(&wanting(0b10, T0)));
    assert_eq!(asked(&a), [1]);
    // Still wanted, still unanswered: not again until ASK_AGAIN_NS.
    let a = run(
        &mut s,
        T0 + ASK_AGAIN_NS - 1,
        Event::Tick(&wanting(0b10, T0)),
    );
    assert!(asked(&a).is_empty(), "{a:?}");
    let a = run(&mut s, T0 + ASK_AGAIN_NS, Event::Tick(&wanting(0b10, T0)));
    assert_eq!(asked(&a), [1]);
    // Granted: wanting it is no reason to ask.
    run(&mut s, T0 + ASK_AGAIN_NS, grant(1, 4, 0, 0, false));
    let a = run(
        &mut s,
        T0 + 3 * ASK_AGAIN_NS,
        Event::Tick(&wanting(0b10, T0)),
    );
    assert!(asked(&a).is_empty(), "{a:?}");
}

#[test]
fn a_first_launch_is_armed_until_its_device_is_asked_for_or_held() {
    let mut s = Session::new(&ShimConfig::default());
    let a = connect(&mut s, T0, 2);
    // Connected: nothing asked, nothing held, both armed, after the gates
    // closed.
    let at = |x: &Action| a.iter().position(|y| y == x).unwrap();
    assert!(at(&Action::Arbitrate) < at(&Action::Arm(0b11)));
    // Asked for device 0: disarmed.
    let a = run(&mut s, T0, Event::Tick(&wanting(0b01, T0)));
    assert!(a.contains(&Action::Arm(0b10)), "{a:?}");
    // Granted, then handed back idle: armed again for the next return.
    run(&mut s, T0, grant(0, 1, 20 * MS, 0, false));
    let a = run(&mut s, T0 + MS, Event::Tick(&idle_since(T0)));
    assert_eq!(releases(&a), [(0, false)]);
    assert!(a.contains(&Action::Arm(0b11)), "{a:?}");
    // Revoked while busy: asked again at once, so not armed.
    run(&mut s, T0 + 2 * MS, grant(0, 2, 20 * MS, 0, false));
    let a = run(&mut s, T0 + 3 * MS, revoke(0, 2));
    assert_eq!(releases(&a), [(0, true)]);
    assert!(
        !a.iter().any(|a| matches!(a, Action::Arm(b) if b & 1 != 0)),
        "{a:?}"
    );
}

#[test]
fn what_the_drain_thread_saw_finish_is_reported() {
    let mut s = session(3);
    let g = Gauges {
        drained: 0b101,
        ..idle_since(T0)
    };
    let a = run(&mut s, T0, Event::Tick(&g));
    let drained: Vec<_> = sends(&a)
        .into_iter()
        .filter(|m| matches!(m, ClientMsg::Drained { .. }))
        .collect();
    assert_eq!(
        drained,
        [
            &ClientMsg::Drained { uuid: uuid(0) },
            &ClientMsg::Drained { uuid: uuid(2) }
        ]
    );
}

/// The drain thread died (a contained panic) while this process held a
/// device: the session hands it back with its Release — a Release lost
/// there would leave the broker a hung holder — ends the connection and
/// stops arbitrating, for good, even in required mode.
#[test]
fn a_lost_drain_thread_hands_back_what_is_held_with_its_release() {
    for required in [false, true] {
        let cfg = ShimConfig {
            broker: if required {
                BrokerMode::Required
            } else {
                BrokerMode::Optional
            },
            ..ShimConfig::default()
        };
        let mut s = Session::new(&cfg);
        connect(&mut s, T0, 2);
        run(&mut s, T0, grant(1, 9, 20 * MS, 0, false));
        let lost = Gauges {
            drain_lost: true,
            ..idle_since(T0)
        };
        let a = run(&mut s, T0 + 5 * MS, Event::Tick(&lost));
        let close = a.iter().position(|a| *a == Action::Close { dev: 1 });
        let release = a.iter().position(|a| {
            *a == Action::Send(ClientMsg::Release {
                uuid: uuid(1),
                held_ns: 5 * MS,
            })
        });
        let end = a.iter().position(|a| *a == Action::End);
        assert!(close < release && release < end && close.is_some(), "{a:?}");
        assert_eq!(releases(&a), [(1, false)]);
        assert!(
            !a.iter().any(|a| matches!(a, Action::Drain { .. })),
            "{a:?}"
        );
        assert!(
            a.ends_with(&[Action::Unarbitrated { gated: false }]),
            "{a:?}"
        );
        assert!(s.retired() && !s.is_connected());
        // Nothing after: no grant opens, no broker is asked for.
        assert!(run(&mut s, T0 + 6 * MS, grant(0, 1, 0, 0, false)).is_empty());
        assert!(run(&mut s, T0 + 6 * MS, Event::Tick(&wanting(1, T0))).is_empty());
        let a = run(&mut s, T0 + 7 * MS, Event::ConnectFailed("gone".into()));
        assert!(a.is_empty());
    }
    // Lost between connections: nothing to hand back, retired all the same.
    let mut s = Session::new(&ShimConfig::default());
    let lost = Gauges {
        drain_lost: true,
        ..Gauges::default()
    };
    let a = run(&mut s, T0, Event::Tick(&lost));
    assert!(a.contains(&Action::Unarbitrated { gated: false }), "{a:?}");
    assert!(s.retired());
}

/// A process that exits between two usage reports says its figures once
/// more (a short job's end line would say the peak of before its last
/// allocations), then lets the exit go on; without a connection it lets it
/// go on at once.
#[test]
fn at_exit_the_figures_go_out_once_more() {
    let mut s = session(2);
    let mut g = idle_since(T0);
    g.usage[1] = (3 << 30, 3 << 30, 0);
    // The usual report went out at the first tick.
    run(&mut s, T0, Event::Tick(&g));
    g.usage[1] = (0, 3 << 30, 0);
    g.exiting = true;
    let a = run(&mut s, T0 + MS, Event::Tick(&g));
    let usage: Vec<_> = sends(&a)
        .into_iter()
        .filter(|m| matches!(m, ClientMsg::Usage { .. }))
        .collect();
    assert_eq!(usage.len(), 2, "every device, within the report interval: {a:?}");
    assert_eq!(a.last(), Some(&Action::ExitReported));
    assert!(!run(&mut s, T0 + 2 * MS, Event::Tick(&g)).contains(&Action::ExitReported));
    let mut s = Session::new(&ShimConfig::default());
    assert_eq!(run(&mut s, T0, Event::Tick(&g)), [Action::ExitReported]);
}

// ---- properties over random event sequences ----

#[derive(Debug, Clone)]
enum Op {
    Grant {
        dev: usize,
        id: u64,
        slice: bool,
        bound: bool,
        waiters: bool,
    },
    Revoke {
        dev: usize,
        id: u64,
    },
    Tick {
        syncing: bool,
        in_flight: u64,
        wants: u64,
        idle_for: u64,
        optimistic: u64,
        used: u64,
    },
    Registered(u64),
    Heard,
    Lost,
    Connect,
    ConnectFailed,
    Advance(u64),
}

const NDEV: usize = 3;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..NDEV + 1, 1..5u64, any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(dev, id, slice, bound, waiters)| Op::Grant { dev, id, slice, bound, waiters }
        ),
        2 => (0..NDEV, 1..5u64).prop_map(|(dev, id)| Op::Revoke { dev, id }),
        4 => (any::<bool>(), 0..8u64, 0..8u64, 0..2 * IDLE_HANDBACK_NS, 0..8u64, 0..3u64)
            .prop_map(|(syncing, in_flight, wants, idle_for, optimistic, used)| Op::Tick {
                syncing,
                in_flight,
                wants,
                idle_for,
                optimistic,
                used
            }),
        1 => (0..2u64).prop_map(Op::Registered),
        1 => Just(Op::Heard),
        1 => Just(Op::Lost),
        1 => Just(Op::Connect),
        1 => Just(Op::ConnectFailed),
        3 => prop_oneof![0..MS, Just(REPORT_EVERY_NS), Just(watch::PROBE_NS)].prop_map(Op::Advance),
    ]
}

/// What the actions so far say of one device.
#[derive(Clone, Copy, Default)]
struct Seen {
    open: bool,
    shared: bool,
    /// The id of the grant it was last opened under, and the one released.
    grant: u64,
    released: u64,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_session_keeps_its_invariants(ops in proptest::collection::vec(op(), 1..120)) {
        let mut s = Session::new(&ShimConfig::default());
        let mut now = T0;
        let mut seen = [Seen::default(); NDEV];
        let mut connected = false;
        let mut last_usage: Option<u64> = None;
        for op in ops {
            let mut stale_grant = None;
            // A tick's (syncing, in flight, idle for).
            let mut tick = None;
            let mut gauges = Gauges::default();
            let event = match op {
                Op::Grant { dev, id, slice, bound, waiters } => {
                    if dev < NDEV && id == seen[dev].released && connected {
                        stale_grant = Some(dev);
                    }
                    grant(dev, id, if slice { 20 * MS } else { 0 }, if bound { 250_000 } else { 0 }, waiters)
                }
                Op::Revoke { dev, id } => revoke(dev, id),
                Op::Tick { syncing, in_flight, wants, idle_for, optimistic, used } => {
                    tick = Some((syncing, in_flight, idle_for));
                    let g = &mut gauges;
                    *g = idle_since(now.saturating_sub(idle_for));
                    g.syncing = syncing;
                    g.in_flight = in_flight;
                    g.wants = wants;
                    for d in 0..NDEV {
                        if optimistic & (1 << d) != 0 {
                            g.optimistic_until[d] = now;
                        }
                        g.usage[d] = (used, used, 0);
                    }
                    Event::Tick(&gauges)
                }
                Op::Registered(cap) => Event::Message(ServerMsg::Registered { mem_cap: cap }),
                Op::Heard => Event::Heard,
                Op::Lost => Event::Lost("closed".into()),
                Op::Connect => Event::Connected { devices: regs(NDEV), command: String::new() },
                Op::ConnectFailed => Event::ConnectFailed("no broker".into()),
                Op::Advance(dt) => { now += dt; continue; }
            };
            let was_connected = connected;
            let is_connect = matches!(event, Event::Connected { .. });
            let is_revoke = matches!(event, Event::Message(ServerMsg::Revoke { .. }));
            let a = run(&mut s, now, event);
            if !was_connected && !is_connect {
                // Between sessions nothing reaches the gates but the
                // failure to connect's own.
                prop_assert!(a.iter().all(|a| matches!(a,
                    Action::FirstRegistrationDone | Action::Say(Note::NoBroker { .. }) | Action::Unarbitrated { .. })), "{a:?}");
            }
            if let Some(dev) = stale_grant {
                prop_assert!(!opens(&a).contains(&dev), "a grant with the released id {} opened device {dev}", seen[dev].released);
            }
            let mut usage_sent = false;
            for (k, act) in a.iter().enumerate() {
                match act {
                    Action::Arbitrate => {
                        connected = true;
                        seen = [Seen::default(); NDEV];
                        last_usage = None;
                    }
                    Action::End => connected = false,
                    Action::Unarbitrated { .. } => {
                        for d in &mut seen {
                            d.open = false;
                            d.shared = false;
                        }
                    }
                    Action::Open { dev, contended, bound_ns, all_open, .. } => {
                        prop_assert!(connected);
                        let Op::Grant { .. } = op else { unreachable!() };
                        let Event::Message(ServerMsg::Grant { grant, .. }) = grant_of(&op) else { unreachable!() };
                        seen[*dev].open = true;
                        seen[*dev].shared = *contended || *bound_ns != 0;
                        seen[*dev].grant = grant;
                        let all = seen.iter().all(|d| d.open && !d.shared);
                        prop_assert_eq!(*all_open, all);
                    }
                    Action::Close { dev } => {
                        prop_assert!(seen[*dev].open, "release of device {dev}, which is not open");
                        // A revoke asks again, first; an idle hand-back
                        // does not.
                        let again = Action::Send(ClientMsg::Acquire { uuid: uuid(*dev) });
                        prop_assert_eq!(k > 0 && a[k - 1] == again, is_revoke);
                        let released = matches!(&a[k + 1], Action::Send(ClientMsg::Release { uuid: u, .. }) if *u == uuid(*dev));
                        prop_assert!(released, "{a:?}");
                        if !is_revoke {
                            prop_assert!(seen[*dev].shared, "idle hand-back of an unshared grant");
                            let Some((syncing, in_flight, idle_for)) = tick else {
                                panic!("a release neither revoked nor idle: {a:?}");
                            };
                            prop_assert!(!syncing && in_flight & (1 << dev) == 0 && idle_for >= IDLE_HANDBACK_NS,
                                "handed back while busy: {tick:?}");
                        }
                        prop_assert_eq!(&a[k + 2], &Action::Drain { dev: *dev });
                        seen[*dev].open = false;
                        seen[*dev].shared = false;
                        seen[*dev].released = seen[*dev].grant;
                    }
                    Action::EndOptimism { dev, .. } => {
                        prop_assert!(!seen[*dev].open);
                    }
                    Action::Send(ClientMsg::Acquire { uuid: u }) => {
                        // Only for a device a thread wants, or asking again
                        // on a revoke; never for one held.
                        let dev = (0..NDEV).find(|&d| uuid(d) == *u).unwrap();
                        let wanted = matches!(op, Op::Tick { wants, .. } if wants & (1 << dev) != 0);
                        prop_assert!(wanted || is_revoke, "{op:?}: {a:?}");
                        prop_assert!(!seen[dev].open || is_revoke);
                    }
                    Action::Arm(devices) => {
                        let open = seen.iter().enumerate().filter(|(_, d)| d.open).fold(0, |m, (i, _)| m | 1 << i);
                        prop_assert_eq!(devices & open, 0, "armed a held device");
                    }
                    Action::Send(ClientMsg::Usage { .. }) => usage_sent = true,
                    _ => {}
                }
            }
            if usage_sent {
                if let Some(t) = last_usage {
                    prop_assert!(now - t >= REPORT_EVERY_NS);
                }
                last_usage = Some(now);
            }
            let open = seen.iter().enumerate().filter(|(_, d)| d.open).fold(0, |m, (i, _)| m | 1 << i);
            prop_assert_eq!(s.open(), open);
            prop_assert_eq!(s.is_connected(), connected);
        }
    }
}

fn grant_of(op: &Op) -> Event<'static> {
    match *op {
        Op::Grant {
            dev,
            id,
            slice,
            bound,
            waiters,
        } => grant(
            dev,
            id,
            if slice { 20 * MS } else { 0 },
            if bound { 250_000 } else { 0 },
            waiters,
        ),
        _ => unreachable!(),
    }
}
