//! The victim user's processes, scripted: a busy training process, an
//! interactive one that works in bursts, a CLI that pings and asks for
//! status, `gpufrac run`s, processes that register, and requests that
//! the policy refuses or that wait in the queue. Each behaves as the
//! shim and the CLI do (a revoked busy process asks again before it
//! releases; an idle holder hands a shared grant back after 500 µs; a
//! release is followed by `Drained` once its queued work has run), and
//! records when each of its questions was answered, in virtual time and
//! in the broker's work.

use std::collections::{BTreeMap, VecDeque};

use gpufrac_common::config::Priority;
use gpufrac_common::wire::{ClientMsg, DeviceReg, LeaseReq, Pin, Role, ServerMsg};

use crate::core::{ConnId, GIB, Nanos, US, uuid};
use crate::host::Argv;
use crate::node::{Actor, Io, Timers, VICTIM};

/// A shim hands a shared grant back after this long without a launch.
pub const IDLE_HANDBACK: Nanos = 500 * US;
/// Work a process keeps queued when it releases an unbounded grant.
const DEFAULT_DRAIN: Nanos = 250 * US;

/// One of the victim's processes, or a series of them.
#[derive(Debug, Clone)]
pub enum Part {
    /// A process that always has work for GPU 0.
    Busy { class: Priority },
    /// A process with `burst` of work every `every` (an inference
    /// server): how long each burst waits for its grant is its latency.
    Interactive {
        class: Priority,
        every: Nanos,
        burst: Nanos,
    },
    /// A CLI connection that pings every `ping` and asks for status every
    /// `status`.
    Cli { ping: Nanos, status: Nanos },
    /// `gpufrac run --gpu-memory MEM --no-wait` every `every`, each run
    /// lasting `hold` (`mem` 0: a run asking for no GPU, whose job only
    /// groups its processes).
    Runs { every: Nanos, hold: Nanos, mem: u64 },
    /// A process registering at each of these times (from the start),
    /// staying for `stay`.
    Registers { at: Vec<Nanos>, stay: Nanos },
    /// A `gpufrac run` the policy refuses (a lease pinned to a GPU, the
    /// device plugin's request) at each of these times.
    Refused { at: Vec<Nanos> },
    /// `gpufrac run --gpus 1` queued at this time, held once placed.
    Queued { at: Nanos },
}

/// A question and when it was answered.
#[derive(Debug, Clone)]
pub struct Answer {
    pub what: &'static str,
    pub asked: Nanos,
    /// The broker's work (ns of its time) when it was asked.
    pub work: Nanos,
    /// When, and at what work, it was answered.
    pub answered: Option<(Nanos, Nanos)>,
}

impl Answer {
    /// Its wait in virtual time and in the broker's work, counted up to
    /// `end` (at `end_work`) when it had no answer.
    pub fn wait(&self, end: Nanos, end_work: Nanos) -> (Nanos, Nanos) {
        let (t, w) = self.answered.unwrap_or((end, end_work));
        (t.saturating_sub(self.asked), w.saturating_sub(self.work))
    }
}

/// What the victim saw.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// Answers to pings, status requests, registrations and leases.
    pub answers: Vec<Answer>,
    /// Interactive bursts: from the burst's start to its grant.
    pub grants: Vec<Answer>,
    /// Registrations refused.
    pub refused: usize,
    /// Connections the broker closed on the victim.
    pub dropped: usize,
    /// The queued run: when it asked, and when it was placed.
    pub queued: Option<(Nanos, Option<Nanos>)>,
    pub pids: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Timer {
    Start(usize),
    Ping(ConnId, Nanos),
    Status(ConnId, Nanos),
    Burst(ConnId, Nanos),
    BurstEnd(ConnId),
    HandBack(ConnId),
    Drained(ConnId),
    Run(Nanos, Nanos, u64),
    Register(usize, usize),
    Refuse(usize, usize),
    Queue,
    Close(ConnId),
}

#[derive(Debug, Default)]
struct Shim {
    /// Work to do now.
    working: bool,
    /// Always working.
    busy: bool,
    grant: Option<u64>,
    released: u64,
    bound: Nanos,
    contended: bool,
    last_launch: Nanos,
    /// A burst waiting for its grant since then (time, work).
    burst_asked: Option<(Nanos, Nanos)>,
    /// What is left of a burst recalled before its end.
    burst_left: Nanos,
    burst: Nanos,
}

#[derive(Debug)]
struct Conn {
    pid: u32,
    shim: Option<Shim>,
    /// A run: how long it holds its lease once answered.
    hold: Option<Nanos>,
    /// Questions asked on it, answered in order.
    asked: VecDeque<Answer>,
}

/// The victim user.
pub struct Victim {
    parts: Vec<Part>,
    base: Nanos,
    timers: Timers<Timer>,
    conns: BTreeMap<ConnId, Conn>,
    /// The queued run's connection.
    queued: Option<ConnId>,
    pub record: Record,
}

impl Victim {
    /// `parts`, their times counted from `base`.
    pub fn new(parts: Vec<Part>, base: Nanos) -> Victim {
        let mut v = Victim {
            parts,
            base,
            timers: Timers::default(),
            conns: BTreeMap::new(),
            queued: None,
            record: Record::default(),
        };
        for i in 0..v.parts.len() {
            v.at(base, Timer::Start(i));
        }
        v
    }

    fn at(&mut self, t: Nanos, timer: Timer) {
        self.timers.at(t, timer);
    }

    /// Every question asked, answered or not.
    pub fn answers(&self) -> impl Iterator<Item = &Answer> {
        self.record
            .answers
            .iter()
            .chain(self.conns.values().flat_map(|c| c.asked.iter()))
    }

    /// Every interactive burst's wait for its grant, granted or still
    /// waiting (a burst that waits past the end counts up to it).
    pub fn bursts(&self) -> impl Iterator<Item = Answer> + '_ {
        let waiting = self
            .conns
            .values()
            .filter_map(|c| c.shim.as_ref()?.burst_asked)
            .map(|(asked, work)| Answer {
                what: "grant",
                asked,
                work,
                answered: None,
            });
        self.record.grants.iter().cloned().chain(waiting)
    }

    fn open(&mut self, io: &mut Io<'_>, role: Role) -> ConnId {
        let pid = io.spawn(VICTIM, Argv::SHORT);
        self.record.pids.push(pid);
        let c = io.connect(pid);
        io.send(c, &ClientMsg::hello(pid, role));
        self.conns.insert(
            c,
            Conn {
                pid,
                shim: None,
                hold: None,
                asked: VecDeque::new(),
            },
        );
        c
    }

    fn ask(&mut self, io: &mut Io<'_>, c: ConnId, what: &'static str, msg: &ClientMsg) {
        io.send(c, msg);
        if let Some(conn) = self.conns.get_mut(&c) {
            conn.asked.push_back(Answer {
                what,
                asked: io.now,
                work: io.work,
                answered: None,
            });
        }
    }

    fn register(&mut self, io: &mut Io<'_>, c: ConnId, class: Priority) {
        let reg = ClientMsg::Register {
            command: String::new(),
            devices: vec![DeviceReg {
                uuid: uuid(0),
                ordinal: 0,
                mem_cap: 0,
                mem_total: 16 * GIB,
            }],
            share: None,
            limit: None,
            priority: class,
        };
        self.ask(io, c, "register", &reg);
    }

    fn shim(&mut self, io: &mut Io<'_>, class: Priority, busy: bool, burst: Nanos) -> ConnId {
        let c = self.open(io, Role::Shim);
        self.register(io, c, class);
        io.on_gpu(c, VICTIM, class);
        if let Some(conn) = self.conns.get_mut(&c) {
            conn.shim = Some(Shim {
                busy,
                burst,
                ..Shim::default()
            });
        }
        if busy {
            self.work_on(io, c);
        }
        c
    }

    /// The process of `c` has work: it launches if it holds the GPU,
    /// else asks for it.
    fn work_on(&mut self, io: &mut Io<'_>, c: ConnId) {
        let Some(s) = self.conns.get_mut(&c).and_then(|c| c.shim.as_mut()) else {
            return;
        };
        s.working = true;
        s.last_launch = io.now;
        io.wants(c, true, true);
        if s.grant.is_some() {
            if !s.busy {
                let end = io.now + s.burst;
                self.record.grants.push(Answer {
                    what: "grant",
                    asked: io.now,
                    work: io.work,
                    answered: Some((io.now, io.work)),
                });
                self.at(end, Timer::BurstEnd(c));
            }
        } else {
            if !s.busy && s.burst_asked.is_none() {
                s.burst_asked = Some((io.now, io.work));
                s.burst_left = s.burst;
            }
            io.send(c, &ClientMsg::Acquire { uuid: uuid(0) });
        }
    }

    /// Stops holding `c`'s grant; a process with work left asks again
    /// first, as the shim does.
    fn release(&mut self, io: &mut Io<'_>, c: ConnId) {
        let Some(s) = self.conns.get_mut(&c).and_then(|c| c.shim.as_mut()) else {
            return;
        };
        let Some(g) = s.grant.take() else {
            return;
        };
        s.released = g;
        if s.working {
            io.send(c, &ClientMsg::Acquire { uuid: uuid(0) });
        }
        io.send(
            c,
            &ClientMsg::Release {
                uuid: uuid(0),
                held_ns: 0,
            },
        );
        let drain = if s.working || io.now < s.last_launch + DEFAULT_DRAIN {
            if s.bound > 0 { s.bound } else { DEFAULT_DRAIN }
        } else {
            0
        };
        io.holds(c, false, drain);
        self.at(io.now + drain, Timer::Drained(c));
    }

    fn grant(&mut self, io: &mut Io<'_>, c: ConnId, grant: u64, contended: bool, bound: Nanos) {
        let Some(s) = self.conns.get_mut(&c).and_then(|c| c.shim.as_mut()) else {
            return;
        };
        if grant == s.released {
            return;
        }
        s.contended = contended;
        s.bound = bound;
        if s.grant == Some(grant) {
            // An update: shared now while idle, it is handed back soon.
            if !s.working && contended {
                let t = s.last_launch.max(io.now) + IDLE_HANDBACK;
                self.at(t, Timer::HandBack(c));
            }
            return;
        }
        s.grant = Some(grant);
        io.holds(c, true, 0);
        if let Some((asked, work)) = s.burst_asked.take() {
            let end = io.now + s.burst_left;
            self.record.grants.push(Answer {
                what: "grant",
                asked,
                work,
                answered: Some((io.now, io.work)),
            });
            self.at(end, Timer::BurstEnd(c));
        } else if !s.working {
            // Granted with nothing to do (a request that crossed the end
            // of a burst): handed back as the shim would.
            self.at(io.now + IDLE_HANDBACK, Timer::HandBack(c));
        }
    }

    fn revoke(&mut self, io: &mut Io<'_>, c: ConnId, grant: u64) {
        let Some(s) = self.conns.get_mut(&c).and_then(|c| c.shim.as_mut()) else {
            return;
        };
        if s.grant != Some(grant) {
            return;
        }
        if s.working && !s.busy {
            // Recalled mid-burst: the rest waits for the next grant.
            s.burst_asked = Some((io.now, io.work));
        }
        self.release(io, c);
    }

    fn start(&mut self, io: &mut Io<'_>, i: usize) {
        match self.parts[i].clone() {
            Part::Busy { class } => {
                self.shim(io, class, true, 0);
            }
            Part::Interactive {
                class,
                every,
                burst,
            } => {
                let c = self.shim(io, class, false, burst);
                self.at(io.now + every, Timer::Burst(c, every));
            }
            Part::Cli { ping, status } => {
                let c = self.open(io, Role::Cli);
                self.at(io.now + ping, Timer::Ping(c, ping));
                self.at(io.now + status, Timer::Status(c, status));
            }
            Part::Runs { every, hold, mem } => self.at(io.now, Timer::Run(every, hold, mem)),
            Part::Registers { at, .. } => {
                if let Some(&first) = at.first() {
                    self.at(self.base + first, Timer::Register(i, 0));
                }
            }
            Part::Refused { at } => {
                if let Some(&first) = at.first() {
                    self.at(self.base + first, Timer::Refuse(i, 0));
                }
            }
            Part::Queued { at } => self.at(self.base + at, Timer::Queue),
        }
    }

    fn timer(&mut self, io: &mut Io<'_>, t: Timer) {
        match t {
            Timer::Start(i) => self.start(io, i),
            Timer::Ping(c, every) => {
                self.ask(io, c, "ping", &ClientMsg::Ping);
                self.at(io.now + every, Timer::Ping(c, every));
            }
            Timer::Status(c, every) => {
                self.ask(io, c, "status", &ClientMsg::Status { from: 0 });
                self.at(io.now + every, Timer::Status(c, every));
            }
            Timer::Burst(c, every) => {
                self.work_on(io, c);
                self.at(io.now + every, Timer::Burst(c, every));
            }
            Timer::BurstEnd(c) => {
                if let Some(s) = self.conns.get_mut(&c).and_then(|c| c.shim.as_mut())
                    && s.working
                    && s.grant.is_some()
                {
                    s.working = false;
                    s.last_launch = io.now;
                    io.wants(c, false, false);
                    if s.contended {
                        self.at(io.now + IDLE_HANDBACK, Timer::HandBack(c));
                    }
                }
            }
            Timer::HandBack(c) => {
                if let Some(s) = self.conns.get(&c).and_then(|c| c.shim.as_ref())
                    && !s.working
                    && s.contended
                    && s.grant.is_some()
                    && io.now >= s.last_launch + IDLE_HANDBACK
                {
                    self.release(io, c);
                }
            }
            Timer::Drained(c) => {
                if self.conns.contains_key(&c) {
                    io.send(c, &ClientMsg::Drained { uuid: uuid(0) });
                }
            }
            Timer::Run(every, hold, mem) => {
                let c = self.open(io, Role::Cli);
                let ask = LeaseReq {
                    want_mem: mem,
                    no_wait: true,
                    command: "python3 eval.py".into(),
                    ..LeaseReq::default()
                };
                self.ask(io, c, "run --no-wait", &ask.into());
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.hold = Some(hold);
                }
                self.at(io.now + every, Timer::Run(every, hold, mem));
            }
            Timer::Register(i, k) => {
                let c = self.open(io, Role::Shim);
                self.register(io, c, Priority::Normal);
                if let Part::Registers { at, stay } = &self.parts[i] {
                    let (next, stay) = (at.get(k + 1).copied(), *stay);
                    if let Some(next) = next {
                        self.at(self.base + next, Timer::Register(i, k + 1));
                    }
                    self.at(io.now + stay, Timer::Close(c));
                }
            }
            Timer::Refuse(i, k) => {
                let c = self.open(io, Role::Cli);
                let ask = LeaseReq {
                    pin: vec![Pin {
                        uuid: uuid(0),
                        mem: GIB,
                    }],
                    command: "python3 serve.py".into(),
                    ..LeaseReq::default()
                };
                self.ask(io, c, "refused lease", &ask.into());
                if let Part::Refused { at } = &self.parts[i]
                    && let Some(&next) = at.get(k + 1)
                {
                    self.at(self.base + next, Timer::Refuse(i, k + 1));
                }
            }
            Timer::Queue => {
                let c = self.open(io, Role::Cli);
                let ask = LeaseReq {
                    want_gpus: 1,
                    command: "python3 train.py".into(),
                    ..LeaseReq::default()
                };
                io.send(c, &ask.into());
                self.queued = Some(c);
                self.record.queued = Some((io.now, None));
            }
            Timer::Close(c) => {
                if let Some(conn) = self.conns.remove(&c) {
                    self.record.answers.extend(conn.asked);
                    io.close(c);
                    io.exit(conn.pid);
                }
            }
        }
    }
}

impl Actor for Victim {
    fn wake_at(&self) -> Option<Nanos> {
        self.timers.next_at()
    }

    fn wake(&mut self, io: &mut Io<'_>) {
        while let Some(timer) = self.timers.pop_due(io.now) {
            self.timer(io, timer);
        }
    }

    fn heard(&mut self, io: &mut Io<'_>, c: ConnId, msg: ServerMsg) {
        match msg {
            ServerMsg::HelloOk { .. } | ServerMsg::Queued { .. } => {}
            ServerMsg::Grant {
                grant,
                slice_ns,
                bound_ns,
                waiters,
                ..
            } => self.grant(io, c, grant, slice_ns != 0 || waiters, bound_ns),
            ServerMsg::Revoke { grant, .. } => self.revoke(io, c, grant),
            ServerMsg::Leased(_) if self.queued == Some(c) => {
                if let Some((_, placed)) = self.record.queued.as_mut() {
                    placed.get_or_insert(io.now);
                }
            }
            m => {
                // A run holds its lease for its time once answered (at
                // once when refused), then ends.
                if let Some(hold) = self.conns.get_mut(&c).and_then(|c| c.hold.take()) {
                    let hold = if matches!(m, ServerMsg::Leased(_)) {
                        hold
                    } else {
                        0
                    };
                    self.at(io.now + hold, Timer::Close(c));
                }
                if let Some(a) = self.conns.get_mut(&c).and_then(|c| c.asked.pop_front()) {
                    if a.what == "register" && matches!(m, ServerMsg::Error { .. }) {
                        self.record.refused += 1;
                    }
                    let mut a = a;
                    a.answered = Some((io.now, io.work));
                    self.record.answers.push(a);
                }
            }
        }
    }

    fn closed(&mut self, io: &mut Io<'_>, c: ConnId) {
        if let Some(conn) = self.conns.remove(&c) {
            self.record.dropped += 1;
            self.record.answers.extend(conn.asked);
            io.exit(conn.pid);
        }
    }
}
