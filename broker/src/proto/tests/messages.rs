//! Each message a client may send, on its own, in virtual time: what the
//! core answers and what status shows of it afterwards. Attacks built from
//! them are in the rooms by topic; this room is the plain contract.

use super::*;

fn proc_of(st: &crate::status::Status, pid: u32) -> crate::status::ProcStatus {
    st.gpus
        .iter()
        .flat_map(|g| g.processes.iter())
        .find(|p| p.pid == pid)
        .cloned()
        .expect("the process is in status")
}

// Hello

#[test]
fn hello_is_answered_and_a_second_of_the_same_role_changes_nothing() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_as(pid, ALICE);
    t.send(c, &ClientMsg::hello(pid, Role::Cli));
    assert!(t.recv(c).is_empty());
    assert!(!t.b.is_dead(c));
}

#[test]
fn hello_of_another_version_is_refused_and_closed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_raw(pid, ALICE);
    t.send(
        c,
        &ClientMsg::Hello {
            magic: wire::MAGIC,
            version: 99,
            pid,
            role: Role::Cli,
            max_version: 99,
        },
    );
    let ms = t.recv(c);
    assert!(
        matches!(ms[..], [ServerMsg::Error { .. }]),
        "told why: {ms:?}"
    );
    assert!(t.b.is_dead(c));
}

#[test]
fn anything_before_hello_is_refused_and_closed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_raw(pid, ALICE);
    t.send(c, &ClientMsg::Ping);
    match &t.recv(c)[..] {
        [ServerMsg::Error { message, .. }] => assert!(message.contains("Hello first")),
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(t.b.is_dead(c));
}

// Ping

#[test]
fn ping_is_answered_with_pong() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_as(pid, ALICE);
    t.send(c, &ClientMsg::Ping);
    assert_eq!(t.recv(c), [ServerMsg::Pong]);
}

// Status

#[test]
fn status_replies_with_a_page_of_json() {
    let mut t = T::new(cfg(), &[16 * GIB, 8 * GIB]);
    let pid = t.spawn(1);
    let shim = t.connect_shim(pid, ALICE);
    t.register(shim, Priority::Normal);
    let c = t.connect_as(pid, ALICE);
    t.send(c, &ClientMsg::Status { from: 0 });
    let json = match &t.recv(c)[..] {
        [ServerMsg::StatusReply { json }] => json.clone(),
        other => panic!("expected a status reply, got {other:?}"),
    };
    let st: crate::status::Status = serde_json::from_str(&json).expect("status JSON");
    assert_eq!(st.gpus.len(), 2);
    assert_eq!(st.gpus[0].processes[0].pid, pid);
    assert_eq!(st.next, None);
    // From past the last process: the page lists none.
    t.send(c, &ClientMsg::Status { from: 5 });
    let [ServerMsg::StatusReply { json }] = &t.recv(c)[..] else {
        panic!("expected a status reply");
    };
    let st: crate::status::Status = serde_json::from_str(json).expect("status JSON");
    assert!(st.gpus.iter().all(|g| g.processes.is_empty()));
}

// Register, Usage

#[test]
fn register_books_the_process_and_usage_is_shown_within_the_gpu() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    let p = proc_of(&t.status(), pid);
    assert_eq!((p.mem_used, p.state.as_str()), (0, "idle"));
    t.send(
        c,
        &ClientMsg::Usage {
            uuid: uuid(1),
            used: 3 * GIB,
            peak: 5 * GIB,
            ooms: 2,
        },
    );
    let p = proc_of(&t.status(), pid);
    assert_eq!((p.mem_used, p.mem_peak, p.ooms), (3 * GIB, 5 * GIB, 2));
    // A claim past the GPU's memory is held to it.
    t.send(
        c,
        &ClientMsg::Usage {
            uuid: uuid(1),
            used: u64::MAX,
            peak: u64::MAX,
            ooms: 0,
        },
    );
    let p = proc_of(&t.status(), pid);
    assert!(p.mem_used <= 16 * GIB && p.mem_peak <= 16 * GIB);
}

// Acquire, Release, Drained

#[test]
fn acquire_release_and_drained_hand_the_gpu_over() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let (a, b) = (t.connect_shim(p1, ALICE), t.connect_shim(p2, BOB));
    t.register(a, Priority::Normal);
    t.register(b, Priority::Normal);
    t.send(a, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(granted(&t.recv(a)));
    t.send(b, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(!granted(&t.recv(b)), "one holder at a time");
    assert_eq!(proc_of(&t.status(), p2).state, "waiting");
    t.send(
        a,
        &ClientMsg::Release {
            uuid: uuid(1),
            held_ns: 1_000_000,
        },
    );
    // Handed over at once, without waiting for the old holder's work.
    assert!(granted(&t.recv(b)));
    assert_eq!(t.status().gpus[0].holder, Some(p2));
    assert!(proc_of(&t.status(), p1).draining);
    t.send(a, &ClientMsg::Drained { uuid: uuid(1) });
    assert!(!proc_of(&t.status(), p1).draining);
}

#[test]
fn acquire_of_a_gpu_not_registered_grants_nothing() {
    let mut t = T::new(cfg(), &[16 * GIB, 16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    t.send(c, &ClientMsg::Acquire { uuid: uuid(2) });
    assert!(!granted(&t.recv(c)));
    assert_eq!(t.status().gpus[1].holder, None);
}

// Lease, Name, Join

#[test]
fn lease_is_answered_with_its_token_and_name_labels_it() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let run = t.connect_as(pid, ALICE);
    t.send(
        run,
        &ClientMsg::Name {
            pod: "ns/p".into(),
            label: "train".into(),
        },
    );
    match &t.recv(run)[..] {
        [ServerMsg::Error { message, .. }] => assert!(message.contains("send Lease first")),
        other => panic!("expected an error, got {other:?}"),
    }
    t.lease(run, 1, 0, false);
    t.advance(SEC);
    assert!(leased(&t.recv(run)).is_some());
    t.send(
        run,
        &ClientMsg::Name {
            pod: "ns/p".into(),
            label: "train\nforged".into(),
        },
    );
    let st = t.status();
    assert_eq!(st.leases.len(), 1);
    assert_eq!(st.leases[0].pod.as_deref(), Some("ns/p"));
    assert_eq!(st.leases[0].pid, pid);
    assert!(!st.leases[0].command.contains('\n'), "escaped");
    assert!(st.leases[0].connected);
}

#[test]
fn join_makes_a_process_its_jobs_member_only_with_the_right_token() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let rp = t.spawn(1);
    let run = t.connect_as(rp, ALICE);
    t.lease(run, 0, 0, false);
    let token = leased(&t.recv(run)).expect("a job without placement");
    // Not a descendant of the run (a container's process).
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let (member, other) = (t.connect_shim(p1, ALICE), t.connect_shim(p2, ALICE));
    t.send(member, &ClientMsg::Join { job: token });
    t.send(other, &ClientMsg::Join { job: token ^ 1 });
    t.register(member, Priority::Normal);
    t.register(other, Priority::Normal);
    let st = t.status();
    assert_eq!(proc_of(&st, p1).job, Some(rp));
    assert_eq!(proc_of(&st, p2).job, None);
    // Another user's process holding the token does not join it.
    let p3 = t.spawn(1);
    let bob = t.connect_shim(p3, BOB);
    t.send(bob, &ClientMsg::Join { job: token });
    t.register(bob, Priority::Normal);
    assert_eq!(proc_of(&t.status(), p3).job, None);
    // The job ends with its run: its members are their users' again.
    t.b.hangup(run);
    t.turn();
    assert_eq!(proc_of(&t.status(), p1).job, None);
}

#[test]
fn under_mps_acquire_of_a_registered_gpu_is_an_open_ended_grant() {
    let mut t = T::new(
        Config {
            mps_pipe: Some("/run/mps".into()),
            ..cfg()
        },
        &[16 * GIB, 16 * GIB],
    );
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    t.send(c, &ClientMsg::Acquire { uuid: uuid(2) });
    assert!(t.recv(c).is_empty(), "not registered there");
    t.send(c, &ClientMsg::Acquire { uuid: uuid(1) });
    assert_eq!(
        t.recv(c),
        [ServerMsg::Grant {
            uuid: uuid(1),
            grant: 1,
            slice_ns: 0,
            bound_ns: 0,
            waiters: false,
        }]
    );
    // Nobody takes turns: the scheduler holds no grant.
    assert_eq!(t.status().gpus[0].holder, None);
}
