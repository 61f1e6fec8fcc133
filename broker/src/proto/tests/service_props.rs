//! The service and identity invariants (SECURITY.md, 1, 2 and 6) as
//! properties of the core in virtual time: an attacker (uid `BOB`) does
//! whatever proptest makes up beside a scripted victim (`ALICE`), with the
//! largest inputs the protocol and /proc allow among its moves, and the
//! core runs its own turns (`Broker::turn`), reading the sockets' unread
//! bytes as the shell would. The victim's answer latency is bounded in
//! work: what the core does in the turn that answers it.

use proptest::prelude::*;

use super::*;
use crate::proto::turns::{FRAME_WORK, PROC_READ_WORK, WALK_WORK, WORK_PER_TURN};

/// What the attacker does in one step.
#[derive(Debug, Clone)]
enum Op {
    /// A new connection, from a process of its own, saying it is this;
    /// `deep`: the process at the bottom of a chain of 100 (the most /proc
    /// a registration can make the broker read).
    Connect(Role, bool),
    /// Raw bytes written on a connection (by index among its open ones).
    Bytes(usize, Vec<u8>),
    /// A burst of whole frames of one kind.
    Frames(usize, Kind, usize),
    /// This many new connections, each of the role that sends the kind,
    /// each with a burst of it: many costly connections at once.
    Swarm(Kind, usize),
    Close(usize),
    /// Its process exits and a victim's process gets the pid; `told`: the
    /// pidfd's news reaches the core before anything else happens.
    Die(usize, bool),
    Advance(Nanos),
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Ping,
    Status,
    /// A registration with the longest command a frame holds, of control
    /// characters (each escaped to four bytes).
    Register,
    /// A lease likewise.
    Lease,
    /// A `Name` of two such strings.
    Name,
}

fn op() -> impl Strategy<Value = Op> {
    let kind = prop_oneof![
        Just(Kind::Ping),
        Just(Kind::Status),
        Just(Kind::Register),
        Just(Kind::Lease),
        Just(Kind::Name),
    ];
    prop_oneof![
        2 => (prop_oneof![Just(Role::Shim), Just(Role::Cli)], any::<bool>())
            .prop_map(|(r, deep)| Op::Connect(r, deep)),
        2 => (0..8usize, prop::collection::vec(any::<u8>(), 0..300)).prop_map(|(i, b)| Op::Bytes(i, b)),
        4 => (0..8usize, kind.clone(), 1..600usize).prop_map(|(i, k, n)| Op::Frames(i, k, n)),
        1 => (kind, 1..24usize).prop_map(|(k, n)| Op::Swarm(k, n)),
        1 => (0..8usize).prop_map(Op::Close),
        1 => (0..8usize, any::<bool>()).prop_map(|(i, t)| Op::Die(i, t)),
        1 => (0..50_000_000u64).prop_map(Op::Advance),
    ]
}

/// The longest string a frame's field holds, of control characters.
fn hostile() -> String {
    "\u{1}".repeat(usize::from(u16::MAX))
}

fn frame(k: Kind) -> Vec<u8> {
    let m = match k {
        Kind::Ping => ClientMsg::Ping,
        Kind::Status => ClientMsg::Status { from: 0 },
        Kind::Register => ClientMsg::Register {
            command: hostile(),
            devices: vec![DeviceReg {
                uuid: uuid(1),
                ordinal: 0,
                mem_cap: 0,
                mem_total: 16 * GIB,
            }],
            share: Some(100.0),
            limit: None,
            priority: Priority::High,
        },
        Kind::Lease => LeaseReq {
            command: hostile(),
            ..lease(0, GIB, true)
        }
        .into(),
        Kind::Name => ClientMsg::Name {
            pod: hostile(),
            label: hostile(),
        },
    };
    let mut b = Vec::new();
    wire::encode_client(&m, &mut b);
    b
}

/// The most work one step of a serve can take beyond what its user had
/// left: a frame (the largest the protocol allows, decoded), its text
/// escaped as far as the limits keep, the /proc reads of the deepest
/// ancestry, a read's least chunk, and its reply, a status page at most
/// (a walk of every connection, a few hundred bytes each).
fn largest_step(conns: usize, gpus: usize) -> u64 {
    let label = Budgets::default().label;
    let escaped = 4 * (label + super::super::leases::MAX_POD + 2);
    FRAME_WORK
        + u64::from(wire::MAX_CLIENT_FRAME)
        + MIN_READ as u64
        + escaped as u64
        + 64 * PROC_READ_WORK
        + 4096
        + conns as u64 * (2048 + WALK_WORK * gpus as u64)
}

/// The broker with the sockets' unread bytes, served as the shell does.
struct World {
    t: T,
    /// What each connection's client wrote that the broker has not read.
    sockets: HashMap<ConnId, Vec<u8>>,
}

impl World {
    fn connect(&mut self, pid: u32, uid: u32, role: Role) -> Option<ConnId> {
        let id = self.t.try_connect(pid, uid)?;
        self.sockets.insert(id, Vec::new());
        self.write(id, &ClientMsg::hello(pid, role));
        Some(id)
    }

    fn write(&mut self, id: ConnId, m: &ClientMsg) {
        if let Some(s) = self.sockets.get_mut(&id) {
            wire::encode_client(m, s);
        }
    }

    /// One pass of server.rs's loop: the poll marks connections with
    /// bytes waiting readable, the core runs a turn (its reads take what
    /// the sockets hold), then timers, then the dead are closed. Returns
    /// the work the core's turn did.
    fn turn(&mut self) -> u64 {
        let now = self.t.now;
        for (&id, s) in &self.sockets {
            if !s.is_empty() {
                self.t.b.readable(id);
            }
        }
        let before = self.t.b.cost().units();
        self.t.b.turn(&mut Virtual {
            now,
            unread: &mut self.sockets,
        });
        let work = self.t.b.cost().units() - before;
        if self.t.b.next_timeout().is_some_and(|x| x <= now) {
            self.t.b.handle_timeout(now);
        }
        while let Some((seq, _)) = self.t.b.take_state(now) {
            self.t.b.state_saved(now, seq, Ok(()));
        }
        for id in self.t.b.dead() {
            self.t.b.remove(now, id);
            self.sockets.remove(&id);
        }
        work
    }

    /// What the broker holds for `uid` stays within its budgets.
    fn check_budgets(&self, uid: u32) {
        let b = Budgets::default();
        let h = self.t.b.conns.held(uid);
        assert!(h.conns <= b.connections, "{} connections", h.conns);
        assert!(h.input <= b.input, "{} bytes of input", h.input);
        assert!(
            h.output <= b.output + conn::MAX_OUTBUF,
            "{} bytes out",
            h.output
        );
        for c in self.t.b.conns.values().filter(|c| c.peer.uid == uid) {
            // Never more than a serve's read and a frame held back.
            assert!(
                c.inbuf.len() <= READ_PER_TURN + wire::MAX_CLIENT_FRAME as usize,
                "{} bytes held for one connection",
                c.inbuf.len()
            );
            assert!(
                c.command.len() <= b.label,
                "{} bytes of command",
                c.command.len()
            );
            assert!(!c.command.contains(['\n', '\r']), "{:?}", c.command);
        }
        assert!(self.t.b.voices.len() <= 2);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever the attacker does, with the largest frames and the deepest
    /// ancestry it can make, the victim's ping is answered in the turn it
    /// is sent, and that turn's work is bounded by a constant of the
    /// budgets (two users' parts, each with its largest step), not by what
    /// the attacker sends; its status page comes within a few turns; the
    /// attacker holds no more than its budgets.
    #[test]
    fn an_attacker_never_keeps_the_victim_from_an_answer(ops in prop::collection::vec(op(), 1..40)) {
        let mut w = World { t: T::new(cfg(), &[16 * GIB]), sockets: HashMap::new() };
        let vp = w.t.spawn(1);
        let v = w.connect(vp, ALICE, Role::Cli).expect("the victim connects");
        // A chain of 100 processes: the deepest ancestry /proc can show.
        let mut deep = 1;
        for _ in 0..100 {
            deep = w.t.spawn(deep);
        }
        let mut attackers: Vec<(ConnId, u32)> = Vec::new();
        let mut status_asked: Option<usize> = None;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Connect(role, low) => {
                    let p = w.t.spawn(if low { deep } else { 1 });
                    if let Some(id) = w.connect(p, BOB, role) {
                        attackers.push((id, p));
                    }
                }
                Op::Bytes(i, bytes) => {
                    if let Some(&(id, _)) = attackers.get(i % attackers.len().max(1))
                        && let Some(s) = w.sockets.get_mut(&id)
                    {
                        s.extend_from_slice(&bytes);
                    }
                }
                Op::Frames(i, k, n) => {
                    if let Some(&(id, _)) = attackers.get(i % attackers.len().max(1)) {
                        let f = frame(k);
                        if let Some(s) = w.sockets.get_mut(&id) {
                            // What a socket holds before its writer blocks.
                            let n = n.min((4 << 20) / f.len()).max(1);
                            for _ in 0..n {
                                s.extend_from_slice(&f);
                            }
                        }
                    }
                }
                Op::Swarm(k, n) => {
                    let role = match k {
                        Kind::Register => Role::Shim,
                        _ => Role::Cli,
                    };
                    let f = frame(k);
                    for _ in 0..n {
                        let p = w.t.spawn(deep);
                        if let Some(id) = w.connect(p, BOB, role) {
                            if matches!(k, Kind::Name) {
                                w.write(id, &lease(0, 0, false).into());
                            }
                            if let Some(s) = w.sockets.get_mut(&id) {
                                for _ in 0..((1 << 20) / f.len()).max(1) {
                                    s.extend_from_slice(&f);
                                }
                            }
                            attackers.push((id, p));
                        }
                    }
                }
                Op::Close(i) => {
                    if !attackers.is_empty() {
                        let (id, _) = attackers.remove(i % attackers.len());
                        w.t.b.hangup(id);
                    }
                }
                Op::Die(i, told) => {
                    if let Some(&(id, pid)) = attackers.get(i % attackers.len().max(1)) {
                        w.t.procs.borrow_mut().insert(pid, (vp, 7_000_000 + step as u64));
                        if told {
                            w.t.b.exited(id);
                        }
                    }
                }
                Op::Advance(dt) => w.t.now += dt,
            }
            // The victim asks, then the shell takes a turn.
            w.write(v, &ClientMsg::Ping);
            if step % 8 == 0 && status_asked.is_none() {
                w.write(v, &ClientMsg::Status { from: 0 });
                status_asked = Some(step);
            }
            w.t.now += MS;
            let conns = w.t.b.conns.len();
            let work = w.turn();
            prop_assert!(w.sockets.contains_key(&v), "the victim was disconnected");
            let got = w.t.recv(v);
            prop_assert!(got.iter().any(|m| matches!(m, ServerMsg::Pong)), "step {step}: {got:?}");
            let bound = 2 * (WORK_PER_TURN + largest_step(conns, 1));
            prop_assert!(work <= bound, "step {step}: a turn of {work} units of work (bound {bound})");
            if got.iter().any(|m| matches!(m, ServerMsg::StatusReply { .. })) {
                status_asked = None;
            }
            prop_assert!(status_asked.is_none_or(|s| step - s < 3), "the victim's status waits");
            for &(id, _) in &attackers {
                if w.t.b.conns.contains_key(&id) {
                    w.t.recv(id);
                }
            }
            w.check_budgets(BOB);
            attackers.retain(|(id, _)| w.sockets.contains_key(id));
        }
    }

    /// A connection whose process died, its pid now a victim's, is never
    /// taken for the victim's process: its lease is booked to the dead
    /// process (which no victim process descends from), and it never
    /// joins the victim's job; whatever the order of lease, registration,
    /// death, reuse and the pidfd's news.
    #[test]
    fn a_reused_pid_never_makes_an_attacker_the_victims_process(
        lease_before in any::<bool>(),
        register_after in any::<bool>(),
        told in any::<bool>(),
        victim_runs in any::<bool>(),
    ) {
        let mut t = T::new(cfg(), &[16 * GIB]);
        let ap = t.spawn(1);
        // Its `gpufrac run` and its shim: two connections of one process.
        let a = t.connect_as(ap, BOB);
        let ash = t.connect_shim(ap, BOB);
        let attacker_start = t.procs.borrow()[&ap].1;
        if lease_before {
            t.lease(a, 0, GIB, true);
        }
        // The attacker's process dies (its socket lives on in another of
        // its processes); the pid goes to the victim's shell.
        t.procs.borrow_mut().insert(ap, (1, 9_999_999));
        if told {
            t.b.exited(a);
            t.b.exited(ash);
        }
        let mut victim_job = None;
        if victim_runs {
            // The victim's `gpufrac run` is the process at the pid now.
            let vr = t.connect_as(ap, ALICE);
            t.lease(vr, 0, 2 * GIB, true);
            t.turn();
            victim_job = leased(&t.recv(vr));
        }
        if !lease_before {
            t.lease(a, 0, GIB, true);
        }
        if register_after {
            t.send(ash, &ClientMsg::Register {
                command: String::new(),
                devices: vec![DeviceReg { uuid: uuid(1), ordinal: 0, mem_cap: 0, mem_total: 16 * GIB }],
                share: None,
                limit: None,
                priority: Priority::Normal,
            });
        }
        t.turn();
        // The victim's child, below the pid.
        let vc = t.spawn(ap);
        let c = t.connect_shim(vc, ALICE);
        t.register(c, Priority::Normal);
        for (token, j) in t.b.ledger.jobs().iter() {
            if j.uid == BOB {
                prop_assert_eq!(j.ident, attacker_start);
                let member = t.b.conns.get(&c).and_then(|c| c.member_of());
                prop_assert_ne!(member, Some(*token), "the victim's process is in the attacker's job");
            }
        }
        if let Some(conn) = t.b.conns.get(&ash) {
            prop_assert!(conn.member_of().is_none() || conn.member_of() != victim_job);
        }
        if let Some(vj) = victim_job {
            prop_assert_eq!(t.b.conns.get(&c).unwrap().member_of(), Some(vj));
        }
    }

    /// Arbitrary bytes, split anywhere, after a handshake or without one:
    /// the core never panics, keeps within the budgets, and keeps no
    /// control character in what it would log or show.
    #[test]
    fn arbitrary_input_never_panics_nor_exceeds_budgets(
        hello in any::<bool>(),
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..2000), 1..30),
        register in prop::collection::vec(any::<char>(), 0..40),
    ) {
        let mut t = T::new(cfg(), &[16 * GIB]);
        // A pid the stand-in for /proc does not know (another pid
        // namespace): the broker then keeps the command the client sends.
        let p = 50_000;
        let id = if hello {
            t.connect_shim(p, BOB)
        } else {
            let id = t.next;
            t.next += 1;
            let peer = Peer { pid: p, uid: BOB, gid: BOB, groups: Vec::new(), ident: Some(1) };
            t.b.connect(t.now, id, peer).unwrap();
            id
        };
        // Sometimes a valid registration with a hostile command line first.
        let command: String = register.into_iter().collect();
        t.send(id, &ClientMsg::Register {
            command,
            devices: vec![DeviceReg { uuid: uuid(1), ordinal: 0, mem_cap: 0, mem_total: 16 * GIB }],
            share: None,
            limit: None,
            priority: Priority::Normal,
        });
        for c in chunks {
            t.b.input(t.now, id, &c);
            while t.b.has_frames(id) {
                t.b.serve(t.now, id);
            }
            t.now += MS;
            t.b.handle_timeout(t.now);
            let held = t.b.conns.held(BOB).input;
            prop_assert!(held <= Budgets::default().input);
            if let Some(c) = t.b.conns.get(&id) {
                prop_assert!(!c.command.chars().any(char::is_control), "{:?}", c.command);
            }
            t.turn();
        }
        for g in t.status().gpus {
            for p in g.processes {
                prop_assert!(!p.command.chars().any(char::is_control), "{:?}", p.command);
            }
        }
    }
}

/// A flood of frames in one read is handled a user's part of a turn at a
/// time (about 64 small frames), and the rest as soon as the core serves
/// the connection again.
#[test]
fn a_flood_of_frames_is_handled_a_turn_at_a_time() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let a = t.connect_as(p, BOB);
    let f = frame(Kind::Ping);
    let flood: Vec<u8> = f.iter().copied().cycle().take(f.len() * 1000).collect();
    t.b.input(t.now, a, &flood);
    let most = (WORK_PER_TURN / FRAME_WORK) as usize;
    let first = t.recv(a).len();
    assert!(
        first > most / 2 && first <= most,
        "{first} frames in one serve"
    );
    assert!(t.b.has_frames(a) && !t.b.wants_input(a));
    let mut turns = 1;
    while t.b.has_frames(a) {
        t.b.serve(t.now, a);
        assert!(t.recv(a).len() <= most);
        turns += 1;
    }
    assert!(turns >= 1000usize.div_ceil(most), "{turns} turns");
    assert!(t.b.wants_input(a));
}

/// Status requests past a user's rate wait, with what follows them, and
/// are answered in order as the budget refills; another user's are not
/// held up.
#[test]
fn status_past_a_users_rate_waits_and_keeps_its_order() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let a = t.connect_as(p, BOB);
    for _ in 0..STATUS_BURST + 1 {
        t.send(a, &ClientMsg::Status { from: 0 });
    }
    t.send(a, &ClientMsg::Ping);
    let got = t.recv(a);
    assert_eq!(got.len(), STATUS_BURST as usize, "{got:?}");
    assert!(!t.b.wants_input(a) && !t.b.has_frames(a));
    let q = t.spawn(1);
    let v = t.connect_as(q, ALICE);
    t.send(v, &ClientMsg::Status { from: 0 });
    assert!(matches!(t.recv(v)[..], [ServerMsg::StatusReply { .. }]));
    let due = t.b.next_timeout().expect("a timer for the held request");
    assert!(due <= t.now + STATUS_EVERY);
    t.advance(STATUS_EVERY);
    let got = t.recv(a);
    assert!(
        matches!(got[..], [ServerMsg::StatusReply { .. }, ServerMsg::Pong]),
        "{got:?}"
    );
}

/// One user's log flood neither grows the log without bound nor silences
/// another user's lines.
#[test]
fn log_lines_are_budgeted_per_user() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let mut allowed = 0;
    for _ in 0..10 * LOG_BURST {
        if t.b.may_log(BOB) {
            allowed += 1;
        }
    }
    assert_eq!(allowed, LOG_BURST);
    assert!(t.b.may_log(ALICE));
    t.now += 10 * LOG_EVERY;
    t.b.clock(t.now);
    assert!(t.b.may_log(BOB));
}
