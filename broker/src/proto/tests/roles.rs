//! A connection's role, fixed by its Hello: each message outside it is
//! refused with an error naming the message, the role and what would be
//! right, and the connection closed, holding nothing; and, as a property,
//! no sequence of messages on any roles leaves a CLI connection with a
//! process's state or a shim's with a lease.

use proptest::prelude::*;

use super::*;

fn shim_messages() -> Vec<ClientMsg> {
    vec![
        register(Priority::Normal),
        ClientMsg::Usage {
            uuid: uuid(1),
            used: GIB,
            peak: GIB,
            ooms: 0,
        },
        ClientMsg::Acquire { uuid: uuid(1) },
        ClientMsg::Release {
            uuid: uuid(1),
            held_ns: 1,
        },
        ClientMsg::Drained { uuid: uuid(1) },
        ClientMsg::Join { job: 7 },
    ]
}

fn cli_messages() -> Vec<ClientMsg> {
    vec![
        ClientMsg::Status { from: 0 },
        lease(0, GIB, false).into(),
        ClientMsg::Name {
            pod: "ns/p".into(),
            label: "x".into(),
        },
    ]
}

/// The one error `ms` holds and that `id` was closed after it.
fn closed_with(t: &T, id: ConnId, ms: &[ServerMsg]) -> String {
    assert!(t.b.is_dead(id), "closed after {ms:?}");
    match ms {
        [ServerMsg::Error { code, message }] => {
            assert_eq!(*code, wire::ERR_BAD_FRAME, "{message}");
            message.clone()
        }
        other => panic!("expected one error, got {other:?}"),
    }
}

/// Sends `m` on a new connection of `role` (a shim registered first):
/// the error it was closed with.
fn refused_on(t: &mut T, role: Role, m: &ClientMsg) -> String {
    let pid = t.spawn(1);
    let c = t.connect_role(pid, ALICE, role);
    if role == Role::Shim {
        t.register(c, Priority::Normal);
    }
    t.send(c, m);
    let ms = t.recv(c);
    let why = closed_with(t, c, &ms);
    t.turn();
    why
}

#[test]
fn a_shims_messages_on_a_cli_connection_are_refused_and_closed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    for (m, name) in shim_messages()
        .iter()
        .zip(["Register", "Usage", "Acquire", "Release", "Drained", "Join"])
    {
        assert_eq!(
            refused_on(&mut t, Role::Cli, m),
            format!(
                "{name} is a shim's message (libgpufrac.so in a process); this connection said \
                 it is a CLI client (Hello role 2); open another connection with role Shim"
            )
        );
    }
    // Nothing of them is held: no process in any scheduler or status.
    assert!(t.status().gpus[0].processes.is_empty());
    assert!(t.b.gpus[0].sched.status(t.now).is_empty());
}

#[test]
fn a_cli_clients_messages_on_a_shim_connection_are_refused_and_closed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    for (m, name) in cli_messages().iter().zip(["Status", "Lease", "Name"]) {
        assert_eq!(
            refused_on(&mut t, Role::Shim, m),
            format!(
                "{name} is a CLI client's message (gpufrac run, gpufrac status, the device \
                 plugin); this connection said it is a shim (Hello role 1); open another \
                 connection with role Cli"
            )
        );
    }
    // No lease, no place in the queue, and the closed shims' processes
    // are gone from their GPU.
    t.advance(SEC);
    let st = t.status();
    assert!(st.leases.is_empty() && st.queue.is_empty(), "{st:?}");
    assert!(t.b.ledger.jobs().len() == 0);
    assert!(st.gpus[0].processes.is_empty());
}

#[test]
fn ping_is_either_roles() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    for role in [Role::Shim, Role::Cli] {
        let pid = t.spawn(1);
        let c = t.connect_role(pid, ALICE, role);
        t.send(c, &ClientMsg::Ping);
        assert_eq!(t.recv(c), [ServerMsg::Pong], "{role:?}");
        assert!(!t.b.is_dead(c));
    }
}

#[test]
fn each_role_is_served_its_own_messages() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let shim = t.connect_shim(pid, ALICE);
    for m in shim_messages() {
        t.send(shim, &m);
    }
    let cli = t.connect_as(pid, ALICE);
    for m in cli_messages() {
        t.send(cli, &m);
    }
    t.advance(SEC);
    for id in [shim, cli] {
        let ms = t.recv(id);
        assert!(
            !ms.iter().any(|m| matches!(
                m,
                ServerMsg::Error {
                    code: wire::ERR_BAD_FRAME,
                    ..
                }
            )),
            "{ms:?}"
        );
        assert!(!t.b.is_dead(id));
    }
    let st = t.status();
    assert_eq!(st.gpus[0].processes.len(), 1);
    assert_eq!(st.leases.len(), 1);
}

#[test]
fn a_second_hello_of_the_other_role_is_refused_and_closed() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_shim(pid, ALICE);
    t.register(c, Priority::Normal);
    t.send(c, &ClientMsg::hello(pid, Role::Cli));
    let ms = t.recv(c);
    let why = closed_with(&t, c, &ms);
    assert_eq!(
        why,
        "Hello with role Cli on a connection that said it is a shim (Hello role 1): a \
         connection keeps the role of its first Hello; open another connection with role Cli"
    );
}

#[test]
fn frames_after_a_refused_message_are_not_handled() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_as(pid, ALICE);
    // In one read: the refused message, then one the role may send.
    let mut bytes = Vec::new();
    wire::encode_client(&register(Priority::Normal), &mut bytes);
    wire::encode_client(&lease(0, GIB, false).into(), &mut bytes);
    t.b.input(t.now, c, &bytes);
    let ms = t.recv(c);
    closed_with(&t, c, &ms);
    t.advance(SEC);
    assert!(t.b.ledger.jobs().len() == 0 && t.status().queue.is_empty());
}

/// `gpufrac run` sends its request in the same write as its Hello: both
/// are answered in order; behind a Hello the broker refuses, the request
/// is never read.
#[test]
fn a_request_in_the_hellos_write_is_answered_after_it_unless_refused() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pid = t.spawn(1);
    let c = t.connect_raw(pid, ALICE);
    let mut bytes = Vec::new();
    wire::encode_client(&ClientMsg::hello(pid, Role::Cli), &mut bytes);
    wire::encode_client(&lease(0, GIB, false).into(), &mut bytes);
    t.b.input(t.now, c, &bytes);
    t.turn();
    let ms = t.recv(c);
    assert!(
        matches!(ms[..], [ServerMsg::HelloOk { .. }, ServerMsg::Leased(_)]),
        "{ms:?}"
    );

    let other = t.spawn(1);
    let d = t.connect_raw(other, BOB);
    let mut bytes = Vec::new();
    let mut hello = ClientMsg::hello(other, Role::Cli);
    if let ClientMsg::Hello {
        version,
        max_version,
        ..
    } = &mut hello
    {
        (*version, *max_version) = (u16::MAX - 1, u16::MAX);
    }
    wire::encode_client(&hello, &mut bytes);
    wire::encode_client(&lease(0, GIB, false).into(), &mut bytes);
    t.b.input(t.now, d, &bytes);
    let ms = t.recv(d);
    t.turn();
    assert!(
        matches!(&ms[..], [ServerMsg::Error { code, .. }] if *code == wire::ERR_VERSION),
        "{ms:?}"
    );
    t.advance(SEC);
    assert_eq!(t.b.ledger.jobs().len(), 1, "only the first run's job");
}

/// What a generated client sends.
#[derive(Debug, Clone)]
enum Msg {
    Register,
    Usage,
    Acquire,
    Release,
    Drained,
    /// The token of the `n`-th job (by token order), or one no job holds.
    Join(usize),
    Ping,
    Status,
    /// GPUs, memory, no-wait.
    Lease(u32, u64, bool),
    Name,
    Hello(Role),
}

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Shim), Just(Role::Cli)]
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        2 => Just(Msg::Register),
        1 => Just(Msg::Usage),
        2 => Just(Msg::Acquire),
        1 => Just(Msg::Release),
        1 => Just(Msg::Drained),
        1 => (0..4usize).prop_map(Msg::Join),
        1 => Just(Msg::Ping),
        1 => Just(Msg::Status),
        2 => (0..3u32, prop_oneof![Just(0), Just(GIB), Just(8 * GIB)], any::<bool>())
            .prop_map(|(g, m, w)| Msg::Lease(g, m, w)),
        1 => Just(Msg::Name),
        1 => role().prop_map(Msg::Hello),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// A new connection of a new process of `uid` (ALICE or BOB), child
    /// of the `parent`-th process so far (a run's child joins its job).
    Connect(Role, bool, usize),
    /// A message on the `i`-th connection.
    Send(usize, Msg),
    Close(usize),
    Advance(Nanos),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (role(), any::<bool>(), 0..8usize).prop_map(|(r, a, p)| Step::Connect(r, a, p)),
        8 => (0..8usize, msg()).prop_map(|(i, m)| Step::Send(i, m)),
        1 => (0..8usize).prop_map(Step::Close),
        1 => (0..2 * SEC).prop_map(Step::Advance),
    ]
}

fn to_wire(t: &T, pid: u32, m: &Msg) -> ClientMsg {
    let g = uuid(1);
    match m {
        Msg::Register => register(Priority::Normal),
        Msg::Usage => ClientMsg::Usage {
            uuid: g,
            used: GIB,
            peak: GIB,
            ooms: 0,
        },
        Msg::Acquire => ClientMsg::Acquire { uuid: g },
        Msg::Release => ClientMsg::Release {
            uuid: g,
            held_ns: 1,
        },
        Msg::Drained => ClientMsg::Drained { uuid: g },
        Msg::Join(n) => ClientMsg::Join {
            job: t.b.ledger.jobs().iter().nth(*n).map_or(3, |(t, _)| *t),
        },
        Msg::Ping => ClientMsg::Ping,
        Msg::Status => ClientMsg::Status { from: 0 },
        Msg::Lease(g, m, w) => lease(*g, *m, *w).into(),
        Msg::Name => ClientMsg::Name {
            pod: "ns/p".into(),
            label: "x".into(),
        },
        Msg::Hello(r) => ClientMsg::hello(pid, *r),
    }
}

/// Whether `m` is outside `role` (a second Hello of the other role too).
fn outside(role: Role, m: &Msg) -> bool {
    match m {
        Msg::Ping => false,
        Msg::Hello(r) => *r != role,
        Msg::Status | Msg::Lease(..) | Msg::Name => role != Role::Cli,
        _ => role != Role::Shim,
    }
}

/// Every connection holds only its role's state, wherever the core keeps
/// it: a GPU's scheduler and a job's members are shims, a job's run and
/// a queue position are a CLI client's.
fn check_roles(t: &T) -> Result<(), TestCaseError> {
    let role = |id: ConnId| t.b.conns.get(&id).and_then(|c| c.role());
    for g in t.b.gpus.iter() {
        for s in g.sched.status(t.now) {
            prop_assert_eq!(role(s.client), Some(Role::Shim), "in a GPU's scheduler");
        }
    }
    for (token, _) in t.b.ledger.jobs().iter() {
        let e = t.b.ledger.jobs().entry(token).expect("listed");
        if let Some(run) = e.run.filter(|r| t.b.conns.contains_key(r)) {
            prop_assert_eq!(role(run), Some(Role::Cli), "a job's run");
        }
        for &m in &e.members {
            prop_assert_eq!(role(m), Some(Role::Shim), "a job's member");
        }
    }
    for (&id, c) in t.b.conns.iter() {
        match c.role() {
            Some(Role::Cli) => prop_assert!(c.devices().is_empty() && c.member_of().is_none()),
            Some(Role::Shim) => prop_assert!(c.job().is_none() && c.status_wait().is_none()),
            None => prop_assert!(c.shim().is_none() && c.cli().is_none()),
        }
        prop_assert!(
            t.b.conns.status_waiting().all(|(held, _, _)| held != id)
                || c.role() == Some(Role::Cli)
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Generated clients of generated roles send generated messages: a
    /// message outside a connection's role closes it with the error that
    /// names the message, any other leaves it open, and no connection
    /// ever holds the other role's state.
    #[test]
    fn no_connection_acts_outside_its_role(steps in prop::collection::vec(step(), 1..60)) {
        let mut t = T::new(cfg(), &[16 * GIB, 16 * GIB]);
        // (connection, pid, role) of the open ones.
        let mut open: Vec<(ConnId, u32, Role)> = Vec::new();
        let mut pids: Vec<u32> = Vec::new();
        for s in steps {
            match s {
                Step::Connect(role, alice, parent) => {
                    let parent = pids.get(parent).copied().unwrap_or(1);
                    let pid = t.spawn(parent);
                    pids.push(pid);
                    let uid = if alice { ALICE } else { BOB };
                    let id = t.connect_role(pid, uid, role);
                    open.push((id, pid, role));
                }
                Step::Send(i, m) if !open.is_empty() => {
                    let (id, pid, role) = open[i % open.len()];
                    let wire_msg = to_wire(&t, pid, &m);
                    t.send(id, &wire_msg);
                    let ms = t.recv(id);
                    let refusal = ms.iter().find_map(|m| match m {
                        ServerMsg::Error { code: wire::ERR_BAD_FRAME, message } => Some(message.clone()),
                        _ => None,
                    });
                    if outside(role, &m) {
                        prop_assert!(t.b.is_dead(id), "{m:?} on a {role:?} connection left it open");
                        let why = refusal.unwrap_or_default();
                        let name = wire_msg.name();
                        prop_assert!(why.starts_with(name) || why.starts_with("Hello with role"), "{why}");
                    } else {
                        prop_assert!(refusal.is_none(), "{m:?} on a {role:?} connection: {refusal:?}");
                        prop_assert!(!t.b.is_dead(id), "{m:?} on a {role:?} connection closed it");
                    }
                }
                Step::Close(i) if !open.is_empty() => {
                    let (id, _, _) = open[i % open.len()];
                    t.b.hangup(id);
                }
                Step::Advance(dt) => t.advance(dt),
                _ => {}
            }
            t.turn();
            open.retain(|(id, _, _)| t.b.conns.contains_key(id));
            check_roles(&t)?;
        }
        t.advance(SEC);
        check_roles(&t)?;
    }
}
