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
    let held = t.b.conns.held(BOB).input;
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
        let held = t.b.conns.held(BOB).output;
        assert!(
            held <= Budgets::default().output + conn::MAX_OUTBUF,
            "{held}"
        );
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
        writes += usize::from(t.save().is_some());
        t.now += 1_000_000;
    }
    let b = Budgets::default();
    assert_eq!(refusals, 250 - b.leases, "bob's leases past his budget");
    // 250 ms of churn: at most one write per SAVE_EVERY (and the first).
    assert!(writes <= 4, "{writes} writes");
    let bytes = crate::jobs::encode(t.b.ledger.jobs().values());
    assert!(
        bytes.len() < b.leases * (b.label * 2 + 400),
        "{} bytes",
        bytes.len()
    );
    assert!(t.status().leases.iter().all(|l| l.command.len() <= b.label));
}

/// The attack (found by the red-team search): one user's `Name` frames
/// kept the state changing, and each write waited `SAVE_EVERY` after the
/// last whoever's change it carried: another user's `run --no-wait` was
/// told its lease up to 101 ms late. Writes for leases are coalesced per
/// user, so the next write carries hers.
#[test]
fn another_users_churn_does_not_hold_a_lease_back() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    // `gpufrac run --gpu-memory 1G --no-wait`, as the red team's victim.
    let run = |t: &mut T, c| {
        let ask = LeaseReq {
            compute: Some(10.0),
            ..lease(0, GIB, true)
        };
        t.send(c, &ask.into());
        t.turn();
        leased(&t.recv(c)).is_some()
    };
    let p = t.spawn(1);
    let bob = t.connect_as(p, BOB);
    assert!(run(&mut t, bob));
    for k in 0..50 {
        t.send(
            bob,
            &ClientMsg::Name {
                pod: String::new(),
                label: format!("churn {k}"),
            },
        );
        t.turn();
        t.now += MS;
    }
    let q = t.spawn(1);
    let alice = t.connect_as(q, ALICE);
    assert!(
        run(&mut t, alice),
        "alice's lease waited for the write bob's churn had put off"
    );
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

/// A registration of `pid`'s process as `uid` on GPUs with these UUIDs;
/// whether the broker took it.
fn register_on(t: &mut T, uid: u32, uuids: &[[u8; 16]]) -> (ConnId, bool) {
    let p = t.spawn(1);
    let c = t.connect_shim(p, uid);
    t.send(
        c,
        &ClientMsg::Register {
            command: String::new(),
            devices: uuids
                .iter()
                .enumerate()
                .map(|(i, &uuid)| DeviceReg {
                    uuid,
                    ordinal: i as u32,
                    mem_cap: 0,
                    mem_total: 16 * GIB,
                })
                .collect(),
            share: None,
            limit: None,
            priority: Priority::Normal,
        },
    );
    let ok = t
        .recv(c)
        .iter()
        .any(|m| matches!(m, ServerMsg::Registered { .. }));
    (c, ok)
}

/// The attack: a broker that found no GPU arbitrated at most 16 GPUs its
/// clients named, all users together, and never forgot one: one
/// registration of made-up UUIDs, and every other user's process on
/// another GPU was refused (and ran unarbitrated). The room is each
/// user's own now.
#[test]
fn one_users_made_up_gpus_never_push_out_anothers() {
    let mut t = T::driverless(cfg());
    let made_up: Vec<[u8; 16]> = (0..16).map(|i| [0x80 + i; 16]).collect();
    let (_, ok) = register_on(&mut t, BOB, &made_up);
    assert!(ok, "a user's own room");
    // One more of bob's, on a 17th GPU: past his room, refused, saying so.
    let p = t.spawn(1);
    let c = t.connect_shim(p, BOB);
    t.send(
        c,
        &ClientMsg::Register {
            command: String::new(),
            devices: vec![DeviceReg {
                uuid: [0x7f; 16],
                ordinal: 0,
                mem_cap: 0,
                mem_total: 16 * GIB,
            }],
            share: None,
            limit: None,
            priority: Priority::Normal,
        },
    );
    match &t.recv(c)[..] {
        [ServerMsg::Error { message, .. }] => {
            assert!(message.contains("at most 16"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Alice's process on her GPUs (two of them) is arbitrated.
    let (a, ok) = register_on(&mut t, ALICE, &[[0x11; 16], [0x12; 16]]);
    assert!(ok, "another user's real GPUs");
    t.send(a, &ClientMsg::Acquire { uuid: [0x11; 16] });
    assert!(granted(&t.recv(a)));
    // And a GPU bob names too counts in bob's room, not alice's.
    let (_, ok) = register_on(&mut t, ALICE, &[[0x80; 16]]);
    assert!(ok);
}

/// What a client names is kept only while a process names it: a learnt
/// GPU no registered process names is gone from status, and its entry is
/// reused, so churn of made-up UUIDs holds nothing.
#[test]
fn learned_gpus_are_forgotten_with_the_last_process_naming_them() {
    let mut t = T::driverless(cfg());
    let (keep, _) = register_on(&mut t, ALICE, &[[0x11; 16]]);
    for i in 0..200u32 {
        let b = i.to_le_bytes();
        let uuids: Vec<[u8; 16]> = (0..4u8)
            .map(|k| {
                let mut u = [k; 16];
                u[..4].copy_from_slice(&b);
                u
            })
            .collect();
        let (c, ok) = register_on(&mut t, BOB, &uuids);
        assert!(ok);
        t.b.hangup(c);
        t.turn();
    }
    assert!(t.b.gpus.len() <= 5, "{} entries kept", t.b.gpus.len());
    let shown: Vec<String> = t.status().gpus.into_iter().map(|g| g.uuid).collect();
    assert_eq!(shown, [wire::uuid_string(&[0x11; 16])]);
    // A GPU two processes name stays while either does.
    let (other, _) = register_on(&mut t, BOB, &[[0x11; 16]]);
    t.b.hangup(keep);
    t.turn();
    assert_eq!(t.status().gpus.len(), 1);
    t.b.hangup(other);
    t.turn();
    assert!(t.status().gpus.is_empty());
    // Registering again elsewhere frees what the process named before.
    let (c, _) = register_on(&mut t, BOB, &[[0x21; 16]]);
    t.register(c, Priority::Normal);
    let shown: Vec<String> = t.status().gpus.into_iter().map(|g| g.uuid).collect();
    assert_eq!(shown, [wire::uuid_string(&uuid(1))]);
}
