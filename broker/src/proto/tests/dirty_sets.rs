//! What the core keeps as things change, so that a turn's work follows
//! what changed rather than the number of connections: the sets it hands
//! the shell (`dead`, `pending_output`), the held status requests, the
//! connections the sweep looks at for deadlines, and the
//! queue walked only when it changed, each job's members, the job table's
//! indexes (by run, by user), the token claims, and which learnt GPUs
//! each user names. After any
//! sequence of operations each must be exactly what a full scan would
//! find.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

#[derive(Debug, Clone)]
enum Op {
    /// A new connection, from a new process of one of three users, in a
    /// role (a message of the other role closes it).
    Connect(u8, Role),
    /// A connection that says nothing yet.
    ConnectSilent(u8),
    /// Raw bytes on a connection (by index among the open ones).
    Bytes(usize, Vec<u8>),
    Register(usize),
    /// A process sends a job's token (of the jobs by position, or made up).
    Join(usize, usize),
    Acquire(usize),
    /// A lease of GPUs (0: memory only), waiting or not.
    Lease(usize, u8, bool),
    /// A burst of status requests (over the user's budget, some wait).
    Status(usize, u8),
    /// The shell writes this many bytes of the connection's output.
    Write(usize, u16),
    Hangup(usize),
    Exit(usize),
    /// The shell's turn: overdue connections expired, dead ones removed.
    Turn,
    Advance(Nanos),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3u8, prop_oneof![Just(Role::Shim), Just(Role::Cli)])
            .prop_map(|(u, r)| Op::Connect(u, r)),
        1 => (0..3u8).prop_map(Op::ConnectSilent),
        1 => (0..8usize, prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(i, b)| Op::Bytes(i, b)),
        2 => (0..8usize).prop_map(Op::Register),
        1 => (0..8usize, 0..4usize).prop_map(|(i, j)| Op::Join(i, j)),
        2 => (0..8usize).prop_map(Op::Acquire),
        3 => (0..8usize, 0..3u8, any::<bool>()).prop_map(|(i, g, w)| Op::Lease(i, g, w)),
        2 => (0..8usize, 1..40u8).prop_map(|(i, n)| Op::Status(i, n)),
        3 => (0..8usize, any::<u16>()).prop_map(|(i, n)| Op::Write(i, n)),
        1 => (0..8usize).prop_map(Op::Hangup),
        1 => (0..8usize).prop_map(Op::Exit),
        2 => Just(Op::Turn),
        2 => (0..3_000_000_000u64).prop_map(Op::Advance),
    ]
}

/// Every set equals its scan; a queue not marked changed has nothing to
/// place and has told each waiting run its position.
fn check(t: &mut T) {
    let b = &t.b;
    let scan = |f: &dyn Fn(&Conn) -> bool| -> BTreeSet<ConnId> {
        b.conns
            .iter()
            .filter(|(_, c)| f(c))
            .map(|(&id, _)| id)
            .collect()
    };
    let set = |v: Vec<ConnId>| v.into_iter().collect::<BTreeSet<_>>();
    assert_eq!(set(b.dead()), scan(&|c| c.dead()), "dead");
    assert_eq!(
        set(b.pending_output()),
        scan(&|c| !c.outbuf().is_empty()),
        "pending output"
    );
    assert_eq!(
        b.conns
            .status_waiting()
            .map(|(id, _, _)| id)
            .collect::<BTreeSet<_>>(),
        scan(&|c| !c.dead() && c.status_wait().is_some()),
        "held status requests"
    );
    assert_eq!(
        b.conns.unsettled().collect::<BTreeSet<_>>(),
        scan(&|c| c.role().is_none() || c.partial_since.is_some()),
        "connections without hello or with half a frame"
    );
    // Each job's members are the connections that say they are its.
    for (token, _) in b.ledger.jobs().iter() {
        let e = b.ledger.jobs().entry(token).expect("listed");
        assert_eq!(
            e.members,
            scan(&|c| c.member_of() == Some(*token)),
            "members of a job"
        );
    }
    // The job table's indexes: each job under its run and its user.
    for (&token, j) in b.ledger.jobs().iter() {
        assert!(
            b.ledger.jobs().run_by(j.pid, j.ident).is_some(),
            "job by run"
        );
        assert!(
            b.ledger.jobs().of_user(j.uid).any(|k| k.token == token),
            "job by user"
        );
    }
    let runless: BTreeSet<u64> = b.ledger.jobs().without_run().map(|(&t, _)| t).collect();
    let scanned: BTreeSet<u64> = b
        .ledger
        .jobs()
        .iter()
        .map(|(&t, _)| t)
        .filter(|t| b.ledger.jobs().run(t).is_none())
        .collect();
    assert_eq!(runless, scanned, "jobs without a run");
    let mut users: BTreeSet<u32> = b.ledger.jobs().values().map(|j| j.uid).collect();
    users.extend([ALICE, BOB, PLUGIN]);
    for uid in users {
        assert_eq!(
            b.ledger.jobs().of_user(uid).count(),
            b.ledger.jobs().values().filter(|j| j.uid == uid).count(),
            "jobs of {uid}"
        );
    }
    // Token claims: the connections that sent each token.
    let mut claims: std::collections::BTreeMap<u64, BTreeSet<ConnId>> = Default::default();
    for (&id, c) in b.conns.iter() {
        if let Some(t) = c.shim().and_then(|s| s.claimed_job) {
            claims.entry(t).or_default().insert(id);
        }
    }
    assert_eq!(*b.ledger.claims(), claims, "token claims");
    // Which learnt GPUs each user's registered processes name.
    for (g, gpu) in b.gpus.iter().enumerate() {
        let Some(named) = &gpu.learned else {
            continue;
        };
        let mut scan: std::collections::HashMap<u32, u32> = Default::default();
        for c in b.conns.values() {
            if c.devices().iter().any(|d| d.gpu == g) {
                *scan.entry(c.peer.uid).or_default() += 1;
            }
        }
        assert_eq!(named, &scan, "who names learnt GPU {g}");
    }
    let orphans: BTreeSet<ConnId> = b
        .conns
        .iter()
        .filter(|(_, c)| {
            c.member_of()
                .is_some_and(|t| !b.ledger.jobs().contains_key(&t))
        })
        .map(|(&id, _)| id)
        .collect();
    assert!(orphans.is_empty(), "members of ended jobs: {orphans:?}");
    // Places are told at most once a `POSITION_TICK`: checked once told.
    if !t.b.ledger.is_dirty() && !t.b.ledger.untold() {
        let at = t.b.ledger.polled();
        for w in t.b.ledger.queue().waiting(at) {
            let told = t.b.ledger.queue().told(w.id);
            // Beyond the tenth place, told at most once a `retell_after`.
            let walked = t.b.ledger.walked().unwrap_or(0);
            assert!(
                !crate::queue::due(told, w.position as u32, walked),
                "position {} told as {told:?}",
                w.position
            );
        }
        assert!(
            t.b.ledger.queue_in_test().poll(at).is_empty(),
            "the queue was not polled after it changed"
        );
    }
}

fn run(ops: Vec<Op>, driverless: bool) {
    let mut t = if driverless {
        T::driverless(cfg())
    } else {
        T::new(cfg(), &[16 * GIB, 16 * GIB])
    };
    let mut open: Vec<ConnId> = Vec::new();
    let users = [ALICE, BOB, PLUGIN];
    for op in ops {
        open.retain(|id| t.b.conns.contains_key(id));
        let pick = |i: usize| (!open.is_empty()).then(|| open[i % open.len()]);
        match op {
            Op::Connect(u, role) => {
                let pid = t.spawn(1);
                open.push(t.connect_role(pid, users[u as usize], role));
            }
            Op::ConnectSilent(u) => {
                let pid = t.spawn(1);
                open.extend(t.try_connect(pid, users[u as usize]));
            }
            Op::Bytes(i, bytes) => {
                if let Some(id) = pick(i) {
                    t.b.input(t.now, id, &bytes);
                }
            }
            Op::Register(i) => {
                if let Some(id) = pick(i) {
                    // On GPU 0, or (learnt by a broker without a driver)
                    // on GPUs named by the connection.
                    let mut m = register(Priority::Normal);
                    if let ClientMsg::Register { devices, .. } = &mut m
                        && driverless
                    {
                        devices.push(DeviceReg {
                            uuid: uuid(0x40 + (id % 3) as u8),
                            ..devices[0]
                        });
                    }
                    t.send(id, &m);
                }
            }
            Op::Join(i, j) => {
                if let Some(id) = pick(i) {
                    let tokens: Vec<u64> = t.b.ledger.jobs().iter().map(|(&k, _)| k).collect();
                    let job = tokens.get(j).copied().unwrap_or(0x5eed + j as u64);
                    t.send(id, &ClientMsg::Join { job });
                }
            }
            Op::Acquire(i) => {
                if let Some(id) = pick(i) {
                    t.send(id, &ClientMsg::Acquire { uuid: uuid(1) });
                }
            }
            Op::Lease(i, gpus, no_wait) => {
                if let Some(id) = pick(i) {
                    let mem = if gpus == 0 { 4 * GIB } else { 0 };
                    t.lease(id, u32::from(gpus), mem, no_wait);
                }
            }
            Op::Status(i, n) => {
                if let Some(id) = pick(i) {
                    for _ in 0..n {
                        t.send(id, &ClientMsg::Status { from: 0 });
                    }
                }
            }
            Op::Write(i, n) => {
                if let Some(id) = pick(i) {
                    let n = usize::from(n).min(t.b.output(id).len());
                    t.b.consumed(id, n);
                }
            }
            Op::Hangup(i) => {
                if let Some(id) = pick(i) {
                    t.b.hangup(id);
                }
            }
            Op::Exit(i) => {
                if let Some(id) = pick(i) {
                    t.b.exited(id);
                }
            }
            Op::Turn => t.turn(),
            Op::Advance(dt) => t.advance(dt),
        }
        check(&mut t);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn what_the_core_keeps_equals_a_full_scan(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, false);
    }

    /// The same, for a broker without a driver, which learns GPUs from
    /// its clients.
    #[test]
    fn what_a_driverless_core_keeps_equals_a_full_scan(ops in prop::collection::vec(op(), 1..60)) {
        run(ops, true);
    }
}

/// A request that waits is told its position once, and the queue is not
/// walked again until something changes or a tick passes.
#[test]
fn an_unchanged_queue_is_not_walked_again() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (holder, waiter, _) = t.bob_waits_behind_alice("");
    t.turn();
    assert!(
        t.recv(waiter)
            .iter()
            .any(|m| matches!(m, ServerMsg::Queued { position: 1, .. }))
    );
    let polled = t.b.ledger.polled();
    assert!(!t.b.ledger.is_dirty());
    // Unrelated traffic: the queue stays as it was, and is not walked.
    t.send(holder, &ClientMsg::Ping);
    assert_eq!(t.b.ledger.polled(), polled);
    // Its holder gone, the GPU goes to the waiter in the same turn.
    t.b.hangup(holder);
    t.advance(SEC);
    assert!(leased(&t.recv(waiter)).is_some());
}
