//! Who may do what: pins and chosen tokens only from root or the device
//! plugin, a job's token or a reused pid does not let others into a job.

use super::*;

/// The attack: the device plugin's pinned leases and chosen tokens, sent
/// by an ordinary user, jumped the queue and held memory against others.
#[test]
fn pins_and_chosen_tokens_only_from_root_or_the_plugin() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pin = LeaseReq {
        want_gpus: 0,
        want_mem: 0,
        pin: vec![Pin {
            uuid: uuid(1),
            mem: 8 * GIB,
        }],
        token: 0x1234,
        ..lease(0, 0, false)
    };
    let chosen = LeaseReq {
        token: 0x5678,
        ..lease(0, GIB, false)
    };
    for m in [&pin, &chosen] {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.send(c, &m.clone().into());
        let why = refused(&t.recv(c)).expect("refused");
        assert!(why.contains("--plugin-user"), "{why}");
    }
    assert!(t.status().leases.is_empty() && t.status().queue.is_empty());
    for uid in [0, PLUGIN] {
        let p = t.spawn(1);
        let c = t.connect_as(p, uid);
        t.send(
            c,
            &LeaseReq {
                token: 0x1000 + u64::from(uid),
                ..pin.clone()
            }
            .into(),
        );
        t.advance(SAVE_EVERY);
        let got = t.recv(c);
        assert!(leased(&got).is_some(), "uid {uid}: {got:?}");
    }
}

/// The attack: a job's token, leaked, let another user's processes into
/// the job (taking its cap, dividing its limit).
#[test]
fn a_leaked_token_does_not_join_another_users_job() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    let r = t.connect_as(run, ALICE);
    t.send(
        r,
        &LeaseReq {
            limit: Some(80.0),
            ..lease(0, 4 * GIB, false)
        }
        .into(),
    );
    t.turn();
    let token = leased(&t.recv(r)).expect("leased");
    // Bob holds the token, in a process of his own.
    let mut bobs = Vec::new();
    for _ in 0..20 {
        let p = t.spawn(1);
        let c = t.connect_shim(p, BOB);
        t.send(c, &ClientMsg::Join { job: token });
        t.register(c, Priority::Normal);
        bobs.push(p);
    }
    // Root (a container's process) and Alice's own do join.
    let (pr, pa) = (t.spawn(1), t.spawn(1));
    for (p, uid) in [(pr, 0), (pa, ALICE)] {
        let c = t.connect_shim(p, uid);
        t.send(c, &ClientMsg::Join { job: token });
        t.register(c, Priority::Normal);
    }
    let st = t.status();
    let job_of = |pid| {
        st.gpus[0]
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .clone()
    };
    for p in bobs {
        let s = job_of(p);
        assert_eq!((s.job, s.mem_cap), (None, None), "bob's {p}");
    }
    for p in [pr, pa] {
        let s = job_of(p);
        assert_eq!(s.job, Some(run));
        assert_eq!(s.mem_cap, Some(4 * GIB));
        // The job's limit is the job's, not divided among members.
        assert_eq!(s.limit, Some(0.8));
    }
}

/// The attack: a victim's process whose parent reused the pid of a dead
/// job's run was put in that job.
#[test]
fn a_reused_pid_is_not_the_jobs_run() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    let r = t.connect_as(run, BOB);
    t.lease(r, 0, GIB, false);
    t.turn();
    assert!(leased(&t.recv(r)).is_some());
    // The run is gone but its connection lives on (passed to another
    // process); its pid now names the victim's shell.
    t.procs.borrow_mut().insert(run, (1, 999_999));
    let child = t.spawn(run);
    let v = t.connect_shim(child, ALICE);
    t.register(v, Priority::Normal);
    let st = t.status();
    let p = st.gpus[0]
        .processes
        .iter()
        .find(|p| p.pid == child)
        .unwrap();
    assert_eq!((p.job, p.mem_cap), (None, None));
    // The true run's child is in the job.
    t.procs.borrow_mut().insert(run, (1, 1000 + run as u64));
    let c2 = t.spawn(run);
    let c = t.connect_shim(c2, BOB);
    t.register(c, Priority::Normal);
    let st = t.status();
    let p = st.gpus[0].processes.iter().find(|p| p.pid == c2).unwrap();
    assert_eq!(p.job, Some(run));
}
