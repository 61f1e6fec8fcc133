//! Priority classes over the wire: a `high` grant that is never given
//! back is passed over, and `high` outside the allow-list is `normal`.

use super::*;

/// The attack: a raw client asks for `high`, takes a grant and never
/// releases it. A victim of normal priority gets the GPU within the
/// class's share of the window, and keeps it.
#[test]
fn an_idle_high_grant_is_revoked_and_passed_over() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let attacker = t.connect_shim(p1, BOB);
    t.register(attacker, Priority::High);
    t.send(attacker, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(granted(&t.recv(attacker)));
    t.advance(5 * SEC);
    let victim = t.connect_shim(p2, ALICE);
    t.register(victim, Priority::Normal);
    t.send(victim, &ClientMsg::Acquire { uuid: uuid(1) });
    t.advance(SEC);
    assert!(granted(&t.recv(victim)), "the victim waited a second");
    assert!(
        t.recv(attacker)
            .iter()
            .any(|m| matches!(m, ServerMsg::Revoke { .. }))
    );
    t.advance(10 * SEC);
    let st = t.status();
    let procs = &st.gpus[0].processes;
    let state = |pid| procs.iter().find(|p| p.pid == pid).unwrap().state.clone();
    assert_eq!(state(p1), "hung");
    assert_eq!(state(p2), "holding");
    assert_eq!(st.gpus[0].holder, Some(p2));
}

#[test]
fn high_outside_the_allow_list_is_normal() {
    let mut c = cfg();
    c.policy.high = Some(Allow {
        uids: vec![ALICE],
        gids: vec![],
    });
    let mut t = T::new(c, &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let a = t.connect_shim(p1, ALICE);
    t.register(a, Priority::High);
    let b = t.connect_shim(p2, BOB);
    t.register(b, Priority::High);
    let st = t.status();
    let prio = |pid| {
        st.gpus[0]
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .priority
            .clone()
    };
    assert_eq!((prio(p1), prio(p2)), ("high".into(), "normal".into()));
    let run = t.spawn(1);
    let r = t.connect_as(run, BOB);
    t.send(
        r,
        &LeaseReq {
            priority: Some(Priority::High),
            ..lease(1, 0, false)
        }
        .into(),
    );
    let why = refused(&t.recv(r)).expect("refused");
    assert!(why.contains("--high-allow"), "{why}");
}

/// A holder the broker revoked (its GPU kept for it only for a moment)
/// has its answer served ahead of every user's part of the next turn,
/// however many connections another user keeps busy.
#[test]
fn a_revoked_holders_answer_is_served_ahead_of_the_round() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (pv, pa) = (t.spawn(1), t.spawn(1));
    let v = t.connect_shim(pv, ALICE);
    t.register(v, Priority::Normal);
    t.send(v, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(granted(&t.recv(v)));
    // Another user's low waiter, so that the holder's slice ends in a
    // recall; and forty of its connections with a turn's work each.
    let a = t.connect_shim(pa, BOB);
    t.register(a, Priority::Low);
    t.send(a, &ClientMsg::Acquire { uuid: uuid(1) });
    let mut busy = Vec::new();
    for _ in 0..40 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        let mut pings = Vec::new();
        for _ in 0..200 {
            wire::encode_client(&ClientMsg::Ping, &mut pings);
        }
        t.unread.insert(c, pings);
        busy.push(c);
    }
    let revoked = (0..100).any(|_| {
        t.advance(10 * crate::sched::SchedConfig::default().timeslice / 100);
        t.recv(v)
            .iter()
            .any(|m| matches!(m, ServerMsg::Revoke { .. }))
    });
    assert!(revoked, "the holder was recalled");
    for &c in &busy {
        t.b.readable(c);
    }
    let mut answer = Vec::new();
    wire::encode_client(
        &ClientMsg::Release {
            uuid: uuid(1),
            held_ns: 0,
        },
        &mut answer,
    );
    wire::encode_client(&ClientMsg::Acquire { uuid: uuid(1) }, &mut answer);
    t.unread.insert(v, answer);
    t.b.readable(v);
    /// The sockets, and the order they were read in.
    struct Watched<'a>(Virtual<'a>, Vec<ConnId>);
    impl Sockets for Watched<'_> {
        fn now(&mut self) -> Nanos {
            self.0.now()
        }
        fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read {
            self.1.push(id);
            self.0.read(id, buf)
        }
    }
    let mut io = Watched(
        Virtual {
            now: t.now,
            unread: &mut t.unread,
        },
        Vec::new(),
    );
    t.b.turn(&mut io);
    assert_eq!(io.1.first(), Some(&v), "the answer is read first");
    assert!(granted(&t.recv(v)), "granted back in the same turn");
    assert!(t.unread[&v].is_empty());
}
