//! The core in virtual time: a stand-in for /proc, connections as ids,
//! frames in and out. Each attack a hostile local user made on the broker
//! has a test here (and one with real processes in tests/attacks.rs).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use gpufrac_common::wire::{self, ClientMsg, DeviceReg, Pin, Role, ServerMsg};

use super::*;
use crate::authority::{Allow, Peer, Policy};
use crate::jobs::{Job, Phase};
use crate::procs::{NoTelemetry, Procs};
use crate::sched::Priority;
use crate::statefile::Loaded;

const SEC: Nanos = 1_000_000_000;
const GIB: u64 = 1 << 30;
const ALICE: u32 = 1000;
const BOB: u32 = 1001;
const PLUGIN: u32 = 990;

/// pid -> (parent, start time).
type Table = Rc<RefCell<HashMap<u32, (u32, u64)>>>;

struct FakeProcs(Table);

impl Procs for FakeProcs {
    fn start_time(&self, pid: u32) -> Option<u64> {
        self.0.borrow().get(&pid).map(|p| p.1)
    }

    fn parent(&self, pid: u32) -> Option<u32> {
        self.0.borrow().get(&pid).map(|p| p.0)
    }

    fn cmdline(&self, pid: u32) -> String {
        format!("proc-{pid}")
    }
}

struct T {
    b: Broker,
    now: Nanos,
    procs: Table,
    next: ConnId,
    pids: u32,
}

fn uuid(i: u8) -> [u8; 16] {
    [i; 16]
}

fn cfg() -> Config {
    Config {
        policy: Policy {
            plugin: Allow {
                uids: vec![PLUGIN],
                gids: vec![],
            },
            high: None,
        },
        ..Config::default()
    }
}

impl T {
    /// A broker with GPUs of these sizes.
    fn new(cfg: Config, gpus: &[u64]) -> T {
        T::with_mig(cfg, gpus, crate::mig::Planner::default())
    }

    fn with_mig(cfg: Config, gpus: &[u64], planner: crate::mig::Planner) -> T {
        let procs: Table = Rc::default();
        let gpus = gpus
            .iter()
            .enumerate()
            .map(|(i, &total_mem)| crate::inventory::GpuInfo {
                index: i as u32,
                uuid: uuid(i as u8 + 1),
                name: format!("gpu{i}"),
                total_mem,
            })
            .collect();
        let b = Broker::new(
            cfg,
            gpus,
            planner,
            true,
            Box::new(FakeProcs(procs.clone())),
            Box::new(NoTelemetry),
            SEC,
        );
        T {
            b,
            now: SEC,
            procs,
            next: 10,
            pids: 100,
        }
    }

    /// A new process, child of `parent` (1: none of ours).
    fn spawn(&mut self, parent: u32) -> u32 {
        self.pids += 1;
        let pid = self.pids;
        self.procs
            .borrow_mut()
            .insert(pid, (parent, 1000 + pid as u64));
        pid
    }

    fn connect_as(&mut self, pid: u32, uid: u32) -> ConnId {
        let id = self.next;
        self.next += 1;
        let peer = Peer {
            pid,
            uid,
            gid: uid,
            groups: Vec::new(),
        };
        self.b
            .connect(self.now, id, peer)
            .expect("connection accepted");
        self.send(id, &ClientMsg::hello(pid, Role::Cli));
        assert!(matches!(self.recv(id)[..], [ServerMsg::HelloOk { .. }]));
        id
    }

    fn send(&mut self, id: ConnId, m: &ClientMsg) {
        let mut bytes = Vec::new();
        wire::encode_client(m, &mut bytes);
        self.b.input(self.now, id, &bytes);
    }

    /// Everything sent to `id` since the last look.
    fn recv(&mut self, id: ConnId) -> Vec<ServerMsg> {
        let mut out = Vec::new();
        let mut buf = self.b.output(id).to_vec();
        self.b.consumed(id, buf.len());
        while !buf.is_empty() {
            let (m, n) = wire::decode_server(&buf).expect("a whole frame");
            out.push(m);
            buf.drain(..n);
        }
        out
    }

    /// What the shell does: writes the state, closes dead connections.
    fn turn(&mut self) {
        while let Some((seq, _)) = self.b.take_state(self.now) {
            self.b.state_saved(self.now, seq, Ok(()));
        }
        for id in self.b.dead() {
            self.b.remove(self.now, id);
        }
    }

    fn advance(&mut self, dt: Nanos) {
        let end = self.now + dt;
        loop {
            self.turn();
            match self.b.next_timeout() {
                Some(t) if t <= end => {
                    self.now = t.max(self.now);
                    self.b.handle_timeout(self.now);
                }
                _ => break,
            }
        }
        self.now = end;
        self.b.handle_timeout(end);
        self.turn();
    }

    /// A shim process registered on GPU 0.
    fn register(&mut self, id: ConnId, priority: Priority) {
        self.send(
            id,
            &ClientMsg::Register {
                command: String::new(),
                devices: vec![DeviceReg {
                    uuid: uuid(1),
                    ordinal: 0,
                    mem_cap: 0,
                    mem_total: 16 * GIB,
                }],
                share: None,
                limit: None,
                priority,
            },
        );
        assert!(
            self.recv(id)
                .iter()
                .any(|m| matches!(m, ServerMsg::Registered { .. }))
        );
    }

    fn lease(&mut self, id: ConnId, gpus: u32, mem: u64, no_wait: bool) {
        self.send(id, &lease(gpus, mem, no_wait).m());
    }

    fn status(&self) -> crate::status::Status {
        self.b.status(self.now)
    }
}

/// A `Lease` message, built field by field.
#[derive(Clone, Default)]
struct L {
    want_gpus: u32,
    want_mem: u64,
    compute: Option<f64>,
    limit: Option<f64>,
    no_wait: bool,
    command: String,
    priority: Option<Priority>,
    resume: u64,
    token: u64,
    pin: Vec<Pin>,
}

impl L {
    fn m(self) -> ClientMsg {
        ClientMsg::Lease {
            want_gpus: self.want_gpus,
            want_mem: self.want_mem,
            compute: self.compute,
            limit: self.limit,
            no_wait: self.no_wait,
            command: self.command,
            priority: self.priority,
            resume: self.resume,
            token: self.token,
            pin: self.pin,
        }
    }
}

fn lease(gpus: u32, mem: u64, no_wait: bool) -> L {
    L {
        want_gpus: gpus,
        want_mem: mem,
        no_wait,
        ..L::default()
    }
}

fn leased(ms: &[ServerMsg]) -> Option<u64> {
    ms.iter().find_map(|m| match m {
        ServerMsg::Leased { token, .. } => Some(*token),
        _ => None,
    })
}

fn refused(ms: &[ServerMsg]) -> Option<String> {
    ms.iter().find_map(|m| match m {
        ServerMsg::Refused { reason } => Some(reason.clone()),
        _ => None,
    })
}

fn granted(ms: &[ServerMsg]) -> bool {
    ms.iter().any(|m| matches!(m, ServerMsg::Grant { .. }))
}

/// The attack: a raw client asks for `high`, takes a grant and never
/// releases it. A victim of normal priority gets the GPU within the
/// class's share of the window, and keeps it.
#[test]
fn an_idle_high_grant_is_revoked_and_passed_over() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let (p1, p2) = (t.spawn(1), t.spawn(1));
    let attacker = t.connect_as(p1, BOB);
    t.register(attacker, Priority::High);
    t.send(attacker, &ClientMsg::Acquire { uuid: uuid(1) });
    assert!(granted(&t.recv(attacker)));
    t.advance(5 * SEC);
    let victim = t.connect_as(p2, ALICE);
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
    let a = t.connect_as(p1, ALICE);
    t.register(a, Priority::High);
    let b = t.connect_as(p2, BOB);
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
        &L {
            priority: Some(Priority::High),
            ..lease(1, 0, false)
        }
        .m(),
    );
    let why = refused(&t.recv(r)).expect("refused");
    assert!(why.contains("--high-allow"), "{why}");
}

/// The attack: the device plugin's pinned leases and chosen tokens, sent
/// by an ordinary user, jumped the queue and held memory against others.
#[test]
fn pins_and_chosen_tokens_only_from_root_or_the_plugin() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let pin = L {
        want_gpus: 0,
        want_mem: 0,
        pin: vec![Pin {
            uuid: uuid(1),
            mem: 8 * GIB,
        }],
        token: 0x1234,
        ..lease(0, 0, false)
    };
    let chosen = L {
        token: 0x5678,
        ..lease(0, GIB, false)
    };
    for m in [&pin, &chosen] {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.send(c, &m.clone().m());
        let why = refused(&t.recv(c)).expect("refused");
        assert!(why.contains("--plugin-user"), "{why}");
    }
    assert!(t.status().leases.is_empty() && t.status().queue.is_empty());
    for uid in [0, PLUGIN] {
        let p = t.spawn(1);
        let c = t.connect_as(p, uid);
        t.send(
            c,
            &L {
                token: 0x1000 + u64::from(uid),
                ..pin.clone()
            }
            .m(),
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
        &L {
            limit: Some(80.0),
            ..lease(0, 4 * GIB, false)
        }
        .m(),
    );
    t.turn();
    let token = leased(&t.recv(r)).expect("leased");
    // Bob holds the token, in a process of his own.
    let mut bobs = Vec::new();
    for _ in 0..20 {
        let p = t.spawn(1);
        let c = t.connect_as(p, BOB);
        t.send(c, &ClientMsg::Join { job: token });
        t.register(c, Priority::Normal);
        bobs.push(p);
    }
    // Root (a container's process) and Alice's own do join.
    let (pr, pa) = (t.spawn(1), t.spawn(1));
    for (p, uid) in [(pr, 0), (pa, ALICE)] {
        let c = t.connect_as(p, uid);
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
    let v = t.connect_as(child, ALICE);
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
    let c = t.connect_as(c2, BOB);
    t.register(c, Priority::Normal);
    let st = t.status();
    let p = st.gpus[0].processes.iter().find(|p| p.pid == c2).unwrap();
    assert_eq!(p.job, Some(run));
}

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
        let c = t.connect_as(p, ALICE);
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
    let held = t.b.held.get(&BOB).map_or(0, |h| h.output);
    assert!(held <= Budgets::default().output + MAX_OUTBUF, "{held}");
    assert!(greedy.iter().any(|&c| t.b.is_dead(c)));
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
            &L {
                command: label.clone(),
                compute: Some(10.0),
                ..lease(0, 0, false)
            }
            .m(),
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

/// A lease is told to its run only once the state that books it is on
/// disk: a crash never forgets a lease a job already holds.
#[test]
fn a_lease_is_told_only_once_durable() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 1, 0, false);
    assert!(leased(&t.recv(c)).is_none());
    let (seq, bytes) = t.b.take_state(t.now).expect("a write");
    let jobs = crate::jobs::decode(&bytes).unwrap();
    assert!(matches!(jobs[0].phase, Phase::Running { .. }));
    assert!(leased(&t.recv(c)).is_none(), "not before it is written");
    t.b.state_saved(t.now, seq, Ok(()));
    assert!(leased(&t.recv(c)).is_some());
}

/// The attack: a truncated state file was set aside and the broker went on
/// as if nothing ran, booking 10 GiB onto a GPU holding 16. Now placements
/// are held while running jobs claim their leases back.
#[test]
fn after_a_suspect_state_file_nothing_is_booked_twice() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    // The job the state file lost: it holds GPU 0 whole.
    t.b.restore(
        t.now,
        Loaded {
            jobs: Vec::new(),
            problem: Some("truncated".into()),
            suspect: true,
        },
    );
    assert!(t.status().recovery.is_some());
    // A newcomer cannot be placed now...
    let p = t.spawn(1);
    let n = t.connect_as(p, BOB);
    t.lease(n, 0, 10 * GIB, true);
    let why = refused(&t.recv(n)).expect("refused");
    assert!(why.contains("recovering"), "{why}");
    let p = t.spawn(1);
    let q = t.connect_as(p, BOB);
    t.lease(q, 0, 10 * GIB, false);
    t.advance(SEC);
    assert!(leased(&t.recv(q)).is_none(), "held while recovering");
    // ...while the running job claims its GPU back.
    let r = t.connect_as(run, ALICE);
    t.send(
        r,
        &L {
            resume: 0xabc,
            pin: vec![Pin {
                uuid: uuid(1),
                mem: 16 * GIB,
            }],
            ..lease(1, 0, false)
        }
        .m(),
    );
    t.turn();
    assert_eq!(leased(&t.recv(r)), Some(0xabc));
    // After the grace the queue moves again, around what was claimed.
    t.advance(Config::default().recovery_grace);
    assert!(t.status().recovery.is_none());
    assert!(leased(&t.recv(q)).is_none(), "GPU 0 is the claimed job's");
    assert_eq!(t.status().gpus[0].committed_mem, 16 * GIB);
    // Outside a recovery, a claim for a lease the broker never had is
    // refused.
    let p = t.spawn(1);
    let x = t.connect_as(p, BOB);
    t.send(
        x,
        &L {
            resume: 0xdef,
            pin: vec![Pin {
                uuid: uuid(1),
                mem: 16 * GIB,
            }],
            ..lease(1, 0, false)
        }
        .m(),
    );
    assert!(refused(&t.recv(x)).is_some());
}

#[test]
fn restored_jobs_are_resumed_only_by_their_own_run() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let run = t.spawn(1);
    let start = t.procs.borrow()[&run].1;
    let job = Job {
        pid: run,
        start_time: start,
        uid: ALICE,
        ..crate::jobs::sample(77)
    };

    t.b.restore(
        t.now,
        Loaded {
            jobs: vec![job],
            problem: None,
            suspect: false,
        },
    );
    let resume = L {
        resume: 77,
        ..lease(1, 0, false)
    }
    .m();
    let other = t.spawn(1);
    let o = t.connect_as(other, ALICE);
    t.send(o, &resume);
    assert!(refused(&t.recv(o)).is_some());
    let r = t.connect_as(run, ALICE);
    t.send(r, &resume);
    assert_eq!(leased(&t.recv(r)), Some(77));
}

/// Making a MIG instance takes seconds on a real GPU: the core asks the
/// shell for it and goes on; the lease is told when it is made.
#[test]
fn mig_instances_are_made_off_the_loop() {
    let planner = crate::mig::Planner::new(vec![crate::mig::models::a100_40gb(0)]);
    let mut t = T::with_mig(cfg(), &[], planner);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 0, 4 * GIB, false);
    t.turn();
    let Some(Work::Mig { lease, gpu, steps }) = t.b.poll_work() else {
        panic!("no MIG work");
    };
    assert_eq!((gpu, steps.len()), (0, 1));
    // Meanwhile the broker serves others.
    let p2 = t.spawn(1);
    let o = t.connect_as(p2, BOB);
    t.send(o, &ClientMsg::Ping);
    assert!(matches!(t.recv(o)[..], [ServerMsg::Pong]));
    assert!(leased(&t.recv(c)).is_none());
    assert_eq!(
        t.status().gpus[0].mig.as_ref().unwrap().instances[0].state,
        "creating"
    );
    let uuid = "MIG-11111111-2222-3333-4444-555555555555".to_string();
    t.b.mig_done(
        t.now,
        MigDone {
            lease,
            gpu,
            destroyed: Vec::new(),
            result: Ok((3, uuid.clone())),
        },
    );
    // Told once the state that books it is written (at most every
    // SAVE_EVERY).
    t.advance(SAVE_EVERY);
    let got = t.recv(c);
    assert!(
        got.iter()
            .any(|m| matches!(m, ServerMsg::Leased { mig, .. } if *mig == uuid)),
        "{got:?}"
    );
}

/// A `--no-wait` MIG request whose instance cannot be made is refused, and
/// its job was never booked.
#[test]
fn a_failed_instance_refuses_a_no_wait_request() {
    let planner = crate::mig::Planner::new(vec![crate::mig::models::a100_40gb(0)]);
    let mut t = T::with_mig(cfg(), &[], planner);
    let p = t.spawn(1);
    let c = t.connect_as(p, ALICE);
    t.lease(c, 0, 4 * GIB, true);
    let Some(Work::Mig { lease, gpu, .. }) = t.b.poll_work() else {
        panic!("no MIG work");
    };
    t.b.mig_done(
        t.now,
        MigDone {
            lease,
            gpu,
            destroyed: Vec::new(),
            result: Err(("insufficient resources".into(), Some(Vec::new()))),
        },
    );
    let why = refused(&t.recv(c)).expect("refused");
    assert!(why.contains("could not be made"), "{why}");
    assert!(t.status().leases.is_empty());
}

#[test]
fn stalled_connections_are_closed_at_their_deadlines() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let silent = t.next;
    t.next += 1;
    t.b.connect(
        t.now,
        silent,
        Peer {
            pid: p,
            uid: BOB,
            gid: BOB,
            groups: Vec::new(),
        },
    )
    .unwrap();
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
    let silent = t.next;
    t.next += 1;
    let peer = Peer {
        pid: p,
        uid: BOB,
        gid: BOB,
        groups: Vec::new(),
    };
    t.b.connect(t.now, silent, peer).unwrap();
    for _ in 0..40 {
        t.now += SEC / 10;
        t.send(busy, &ClientMsg::Ping);
        if t.b.next_timeout().is_some_and(|x| x <= t.now) {
            t.b.handle_timeout(t.now);
        }
        assert!(matches!(t.recv(busy)[..], [ServerMsg::Pong]));
    }
    assert!(
        t.b.is_dead(silent),
        "a silent connection outlived its deadline"
    );
}
