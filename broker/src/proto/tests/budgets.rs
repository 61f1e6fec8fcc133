//! Each user's budgets: input frames, unread output, labels and leases,
//! queued requests; and state writes coalesced, so churn costs bounded
//! I/O.

use super::*;

/// The attack: 256 partial frames from one user filled the broker's input
/// budget and got other users' connections closed.
#[test]
fn one_users_partial_frames_close_only_that_users_connections() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pv = t.spawn(1);
    let victim = t.connect_as(pv, ALICE);
    // Half a frame of the victim's own, pending.
    t.b.input(t.now, victim, &[10, 0, 0]);
    let mut attackers = Vec::new();
    let frame_start = (wire::MAX_CLIENT_FRAME - 1).to_le_bytes();
    for _ in 0..256 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.b.input(t.now, c, &frame_start);
        t.b.input(t.now, c, &vec![0x06; 128 << 10]);
        attackers.push(c);
    }
    let dead = t.b.dead();
    assert!(!dead.is_empty(), "bob went over his budget");
    assert!(dead.iter().all(|d| attackers.contains(d)));
    assert!(!dead.contains(&victim));
    t.turn();
    // The victim's connection lives on, and the victim is still served.
    assert!(!t.b.is_dead(victim));
    let p2 = t.spawn(1);
    let v2 = t.connect_as(p2, ALICE);
    t.send(v2, &ClientMsg::Ping);
    assert!(matches!(t.recv(v2)[..], [ServerMsg::Pong]));
    let held = t.b.held.get(&BOB).map_or(0, |h| h.input);
    assert!(held <= Budgets::default().input, "{held}");
}

/// The attack: 250 connections asking for status and never reading took
/// the broker's memory from 82 MB to 1.05 GB.
#[test]
fn unread_output_is_bounded_per_user() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    // Enough processes for a status page of real size.
    for _ in 0..200 {
        let p = t.spawn(1);
        let c = t.connect_shim(p, ALICE);
        t.register(c, Priority::Normal);
    }
    let mut greedy = Vec::new();
    for _ in 0..250 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        for _ in 0..4 {
            t.send(c, &ClientMsg::Status { from: 0 });
        }
        greedy.push(c);
    }
    // Bob's pages are built at his status rate; what he does not read
    // piles up until his output budget closes his connections.
    for _ in 0..80 {
        let held = t.b.held.get(&BOB).map_or(0, |h| h.output);
        assert!(held <= Budgets::default().output + MAX_OUTBUF, "{held}");
        t.advance(SEC / 10);
    }
    assert!(greedy.iter().any(|c| !t.b.conns.contains_key(c)));
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.send(c, &ClientMsg::Status { from: 0 });
    assert!(matches!(t.recv(c)[..], [ServerMsg::StatusReply { .. }]));
}

/// The attack: 250 leases with 65 KB labels made a 16 MB state file
/// rewritten and fsynced on every change.
#[test]
fn labels_are_cut_leases_bounded_and_state_writes_coalesced() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let label = "x".repeat(65_000);
    let mut refusals = 0;
    let mut writes = 0;
    for _ in 0..250 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.send(
            c,
            &LeaseReq {
                command: label.clone(),
                compute: Some(10.0),
                ..lease(0, 0, false)
            }
            .into(),
        );
        t.send(
            c,
            &ClientMsg::Name {
                pod: String::new(),
                label: label.clone(),
            },
        );
        refusals += usize::from(refused(&t.recv(c)).is_some());
        if let Some((seq, _)) = t.b.take_state(t.now) {
            writes += 1;
            t.b.state_saved(t.now, seq, Ok(()));
        }
        t.now += 1_000_000;
    }
    let b = Budgets::default();
    assert_eq!(refusals, 250 - b.leases, "bob's leases past his budget");
    // 250 ms of churn: at most one write per SAVE_EVERY (and the first).
    assert!(writes <= 4, "{writes} writes");
    let bytes = crate::jobs::encode(t.b.jobs.values());
    assert!(
        bytes.len() < b.leases * (b.label * 2 + 400),
        "{} bytes",
        bytes.len()
    );
    assert!(t.status().leases.iter().all(|l| l.command.len() <= b.label));
}

/// The attack: one user queued 247 requests ahead of everyone.
#[test]
fn queued_requests_are_bounded_per_user_but_not_for_the_plugin() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let holder = t.connect_as(p, ALICE);
    t.lease(holder, 1, 0, false);
    t.turn();
    assert!(leased(&t.recv(holder)).is_some());
    let b = Budgets::default();
    let mut refused_at = None;
    for i in 0..b.queued + 5 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.lease(c, 0, GIB, false);
        if let Some(why) = refused(&t.recv(c)) {
            assert!(why.contains("waiting in the queue"), "{why}");
            refused_at.get_or_insert(i);
        }
    }
    assert_eq!(refused_at, Some(b.queued));
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 0, GIB, false);
    assert!(refused(&t.recv(c)).is_none(), "another user still queues");
    assert_eq!(t.status().queue.len(), b.queued + 1);
}
