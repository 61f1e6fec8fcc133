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
