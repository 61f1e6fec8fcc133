//! The core in virtual time: a stand-in for /proc, connections as ids,
//! frames in and out. Each attack a hostile local user made on the broker
//! has a test in one of these rooms, by topic (and one with real processes
//! in tests/attacks.rs). This file holds what they share: `T`, a broker
//! with its stand-ins, and builders and readers of messages.

mod budgets;
mod classes;
mod deadlines;
mod dirty_sets;
mod evidence;
mod fairness;
mod history;
mod identity;
mod logs;
mod messages;
mod mig_instances;
mod positions;
mod restarts;
mod roles;
mod service_props;
mod stats;
mod telemetry;
mod work;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use gpufrac_common::wire::{self, ClientMsg, DeviceReg, LeaseReq, Pin, Role, ServerMsg};

use super::*;
use crate::authority::{Allow, Peer, Policy};
use crate::jobs::{Job, Phase};
use crate::procs::Procs;
use crate::sched::Priority;
use crate::statefile::Loaded;

const SEC: Nanos = 1_000_000_000;
const GIB: u64 = 1 << 30;
const ALICE: u32 = 1000;
const BOB: u32 = 1001;
const PLUGIN: u32 = 990;

/// pid -> (parent, mark).
type Table = Rc<RefCell<HashMap<u32, (u32, u64)>>>;

/// The stand-in for /proc, and how many of its files the core read.
struct FakeProcs(Table, Rc<std::cell::Cell<u64>>);

impl Procs for FakeProcs {
    fn ident(&self, pid: u32) -> Option<u64> {
        self.1.set(self.1.get() + 1);
        self.0.borrow().get(&pid).map(|p| p.1)
    }

    fn parent(&self, pid: u32) -> Option<u32> {
        self.1.set(self.1.get() + 1);
        self.0.borrow().get(&pid).map(|p| p.0)
    }

    fn parent_and_ident(&self, pid: u32) -> (Option<u32>, Option<u64>) {
        self.1.set(self.1.get() + 1);
        let p = self.0.borrow().get(&pid).copied();
        (p.map(|p| p.0), p.map(|p| p.1))
    }
}

struct T {
    b: Broker,
    now: Nanos,
    procs: Table,
    /// Files of the stand-in /proc read so far.
    proc_reads: Rc<std::cell::Cell<u64>>,
    next: ConnId,
    pids: u32,
    /// Bytes a client sent that the shell has not read yet: what the
    /// core's reads get, when it serves the connection.
    unread: HashMap<ConnId, Vec<u8>>,
}

/// Job tokens as a fixed sequence (splitmix64): the same in every run, yet
/// spread over all of u64 as random ones are, so that a test guessing
/// small tokens guesses no job's.
fn tokens() -> Tokens {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    Box::new(move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
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
        T::build(cfg, gpus, planner, tokens())
    }

    fn build(cfg: Config, gpus: &[u64], planner: crate::mig::Planner, tokens: Tokens) -> T {
        T::build_on(cfg, gpus, planner, tokens, true)
    }

    /// A broker that found no GPU (no driver): it arbitrates the GPUs its
    /// clients name.
    fn driverless(cfg: Config) -> T {
        T::build_on(cfg, &[], crate::mig::Planner::default(), tokens(), false)
    }

    fn build_on(
        cfg: Config,
        gpus: &[u64],
        planner: crate::mig::Planner,
        tokens: Tokens,
        discovered: bool,
    ) -> T {
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
        let reads = Rc::new(std::cell::Cell::new(0));
        let b = Broker::new(
            cfg,
            gpus,
            planner,
            discovered,
            Box::new(FakeProcs(procs.clone(), reads.clone())),
            tokens,
            SEC,
        );
        T {
            b,
            now: SEC,
            procs,
            proc_reads: reads,
            next: 10,
            pids: 100,
            unread: HashMap::new(),
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

    /// A connection from `pid` as `uid`, silent (no hello); None if the
    /// broker refused it.
    fn try_connect(&mut self, pid: u32, uid: u32) -> Option<ConnId> {
        let id = self.next;
        self.next += 1;
        let peer = Peer {
            pid,
            uid,
            gid: uid,
            groups: Vec::new(),
            ident: self.procs.borrow().get(&pid).map(|p| p.1),
        };
        self.b.connect(self.now, id, peer).ok().map(|()| id)
    }

    /// A connection from `pid` as `uid`, accepted but silent: no hello.
    fn connect_raw(&mut self, pid: u32, uid: u32) -> ConnId {
        self.try_connect(pid, uid).expect("connection accepted")
    }

    /// A connection from `pid` as `uid` that said hello as `role`.
    fn connect_role(&mut self, pid: u32, uid: u32, role: Role) -> ConnId {
        let id = self.connect_raw(pid, uid);
        self.send(id, &ClientMsg::hello(pid, role));
        assert!(matches!(self.recv(id)[..], [ServerMsg::HelloOk { .. }]));
        id
    }

    /// A CLI client's connection (`gpufrac run`, `status`, the plugin).
    fn connect_as(&mut self, pid: u32, uid: u32) -> ConnId {
        self.connect_role(pid, uid, Role::Cli)
    }

    /// A process's shim's connection.
    fn connect_shim(&mut self, pid: u32, uid: u32) -> ConnId {
        self.connect_role(pid, uid, Role::Shim)
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

    /// What the shell does: runs the core's turns while it is busy (its
    /// reads get what `unread` holds), writes the state, closes dead
    /// connections.
    fn turn(&mut self) {
        loop {
            self.b.turn(&mut Virtual {
                now: self.now,
                unread: &mut self.unread,
            });
            if !self.b.busy() {
                break;
            }
        }
        while self.save().is_some() {}
        for id in self.b.dead() {
            self.b.remove(self.now, id);
        }
    }

    /// Writes the state if a write is due, as the shell's saver would:
    /// its bytes, written.
    fn save(&mut self) -> Option<Vec<u8>> {
        let (seq, bytes) = self.b.take_state(self.now)?;
        self.b.state_saved(self.now, seq, Ok(()));
        Some(bytes)
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
        self.send(id, &register(priority));
        assert!(
            self.recv(id)
                .iter()
                .any(|m| matches!(m, ServerMsg::Registered { .. }))
        );
    }

    fn lease(&mut self, id: ConnId, gpus: u32, mem: u64, no_wait: bool) {
        self.send(id, &lease(gpus, mem, no_wait).into());
    }

    fn status(&self) -> crate::status::Status {
        self.b.status(self.now)
    }

    /// Alice's lease holds the only GPU and Bob's run, asking for it with
    /// `command`, waits behind it: (Alice's connection, Bob's run, its
    /// pid).
    fn bob_waits_behind_alice(&mut self, command: &str) -> (ConnId, ConnId, u32) {
        let (p1, p2) = (self.spawn(1), self.spawn(1));
        let holder = self.connect_as(p1, ALICE);
        self.lease(holder, 1, 0, false);
        self.advance(SEC);
        assert!(leased(&self.recv(holder)).is_some());
        let run = self.connect_as(p2, BOB);
        self.send(
            run,
            &LeaseReq {
                command: command.into(),
                ..lease(1, 0, false)
            }
            .into(),
        );
        (holder, run, p2)
    }
}

/// Sockets in virtual time: each connection's unread bytes, and a clock
/// that stands still for the turn.
struct Virtual<'a> {
    now: Nanos,
    unread: &'a mut HashMap<ConnId, Vec<u8>>,
}

impl Sockets for Virtual<'_> {
    fn now(&mut self) -> Nanos {
        self.now
    }

    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read {
        match self.unread.get_mut(&id) {
            Some(bytes) if !bytes.is_empty() => {
                let n = bytes.len().min(buf.len());
                buf[..n].copy_from_slice(&bytes[..n]);
                bytes.drain(..n);
                Read::Bytes(n)
            }
            _ => Read::WouldBlock,
        }
    }
}

/// A shim's registration on GPU 0.
fn register(priority: Priority) -> ClientMsg {
    ClientMsg::Register {
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
    }
}

fn lease(gpus: u32, mem: u64, no_wait: bool) -> LeaseReq {
    LeaseReq {
        want_gpus: gpus,
        want_mem: mem,
        no_wait,
        ..LeaseReq::default()
    }
}

fn leased(ms: &[ServerMsg]) -> Option<u64> {
    ms.iter().find_map(|m| match m {
        ServerMsg::Leased(l) => Some(l.token),
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
