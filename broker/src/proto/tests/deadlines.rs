//! Connection deadlines: stalled connections are closed on time, even
//! while a busy broker's loop never sleeps a whole sweep tick.

use super::*;

#[test]
fn stalled_connections_are_closed_at_their_deadlines() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let silent = t.connect_raw(p, BOB);
    let trickle = t.connect_as(p, BOB);
    t.b.input(t.now, trickle, &[10, 0]);
    t.advance(HELLO_DEADLINE + SWEEP_TICK);
    assert!(t.b.is_dead(silent) || !t.b.conns.contains_key(&silent));
    assert!(!t.b.is_dead(trickle) && t.b.conns.contains_key(&trickle));
    t.advance(FRAME_DEADLINE);
    assert!(!t.b.conns.contains_key(&trickle));
}

/// The shell asks for the core's timers after each batch of events; a
/// broker busy with one client's pings every 100 ms (its loop never
/// sleeps a whole sweep tick) still closes a connection that never said
/// hello.
#[test]
fn a_busy_broker_still_closes_silent_connections() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let busy = t.connect_as(p, ALICE);
    let silent = t.connect_raw(p, BOB);
    for _ in 0..40 {
        t.now += SEC / 10;
        t.send(busy, &ClientMsg::Ping);
        if t.b.next_timeout().is_some_and(|x| x <= t.now) {
            t.b.handle_timeout(t.now);
        }
        t.turn();
        assert!(matches!(t.recv(busy)[..], [ServerMsg::Pong]));
    }
    assert!(
        !t.b.conns.contains_key(&silent),
        "a silent connection outlived its deadline"
    );
}

/// A broker busy elsewhere may read a connection only after its deadline:
/// a hello the client sent in time, still unread in its socket, keeps the
/// connection open (it was closed, and the client saw a reset, before).
#[test]
fn a_hello_sent_in_time_but_read_late_keeps_the_connection() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let late = t.connect_raw(p, BOB);
    // Its first turn found nothing; the hello arrives while the broker is
    // busy elsewhere (the poll's news of it not yet handled).
    t.turn();
    let mut hello = Vec::new();
    wire::encode_client(&ClientMsg::hello(p, Role::Cli), &mut hello);
    t.unread.insert(late, hello);
    t.advance(HELLO_DEADLINE + SWEEP_TICK);
    assert!(
        t.b.conns.contains_key(&late),
        "closed with its hello unread"
    );
    assert!(matches!(t.recv(late)[..], [ServerMsg::HelloOk { .. }]));
    // Silent for real: closed at the next deadline check.
    let silent = t.connect_raw(p, BOB);
    t.advance(HELLO_DEADLINE + SWEEP_TICK);
    assert!(!t.b.conns.contains_key(&silent));
    assert!(t.b.conns.contains_key(&late));
}
