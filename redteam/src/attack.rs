//! The attacker user (`nobody`): a strategy is a few cohorts, each a
//! number of connections (members) from a number of processes, all doing
//! one thing (a play) on a cycle: each member is on for `duty` percent
//! of a period, members' cycles staggered by `stagger` percent, and may
//! open a new connection (from a new process) each time it comes on.
//! So connections and processes open, idle, rotate and come back;
//! classes mix across cohorts; inputs go up to what the protocol and
//! /proc allow; leases churn; readers stop reading; recalls are answered
//! honestly, by asking again after releasing, or not at all. The search
//! (`search.rs`) breeds strategies; `seeds` are the ones a review found
//! by hand.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpufrac_common::config::Priority;
use gpufrac_common::wire::{self, ClientMsg, DeviceReg, LeaseReq, Pin, Role, ServerMsg};

use crate::core::{ConnId, GIB, MS, Nanos, US, uuid};
use crate::host::{Argv, Text};
use crate::node::{ATTACKER, Actor, Io, Timers};

/// How a holder answers a recall.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Recall {
    /// As the shim does: asks again (while it has work), then releases.
    Honest,
    /// Releases, then asks again at once: it comes back from idle.
    Reask,
    /// Never answers (a stopped process): it stops launching, and keeps
    /// the grant as far as the broker knows.
    Ignore,
}

/// What a lease asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Want {
    /// No placement: a job for its processes and a name (`Name`).
    Unplaced,
    /// `--gpu-memory 1G`.
    Memory,
    /// `--gpu-memory` of a whole GPU's memory less `less` bytes (one of
    /// [`NEAR_WHOLE`]): every size near the GPU's total, none of which
    /// may go before an earlier `--gpus 1`.
    WholeMemory { less: u32 },
    /// `--gpus 1`.
    Gpu,
    /// Pinned to GPU 0, the device plugin's request: refused.
    Pinned,
    /// `--priority high`: refused where `--high-allow` leaves it out.
    High,
}

impl Want {
    pub const ALL: [Want; 6] = [
        Want::Unplaced,
        Want::Memory,
        Want::WholeMemory { less: 0 },
        Want::Gpu,
        Want::Pinned,
        Want::High,
    ];
}

/// How much less than a GPU's memory a [`Want::WholeMemory`] asks for:
/// nothing, a byte, a page, a MiB, 16 and 64 MiB.
pub const NEAR_WHOLE: &[u32] = &[0, 1, 4096, 1 << 20, 16 << 20, 64 << 20];

/// What a cohort's members do while on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Play {
    /// A process's shim on GPU 0 (and `uuids` GPUs it makes up): asks
    /// for the GPU when it comes on, launches while it holds it when it
    /// has `work`, releases when it goes off.
    Shim {
        class: Priority,
        work: bool,
        recall: Recall,
        uuids: u8,
    },
    /// `frames` pings each time it comes on (as many as its socket takes).
    Ping { frames: u16 },
    /// `frames` status requests each time it comes on.
    Status { frames: u16 },
    /// A lease without placement, then `frames` `Name` frames with a
    /// label of `kib` KiB of control bytes each time it comes on.
    Name { kib: u16, frames: u8 },
    /// A `gpufrac run` asking for `want` each time it comes on (queued,
    /// or `--no-wait`), ended when it goes off.
    Lease { want: Want, queued: bool },
    /// A slow writer: a lease without placement, then `Name` frames with
    /// a label of `kib` KiB of control bytes, sent `bytes` bytes each time
    /// it comes on (the broker holds each partial frame until it is
    /// whole), the next once one is.
    Trickle { kib: u16, bytes: u16 },
}

/// Members doing one play on one cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cohort {
    pub play: Play,
    /// Connections, 1 to 64.
    pub members: u8,
    /// The processes they come from (members dealt round-robin); 0: the
    /// processes of the cohort before it, so that one process has
    /// connections that play differently (a pretender beside a
    /// connection that works: the driver counts work by process).
    pub procs: u8,
    pub start_ms: u16,
    pub period_ms: u16,
    /// Percent of the period each member is on.
    pub duty: u8,
    /// Percent of the period between one member's start and the next's.
    pub stagger: u8,
    /// A member opens a new connection each time it comes on and closes
    /// it when it goes off.
    pub reconnect: bool,
    /// ... from a new process (the old one exits).
    pub respawn: bool,
    /// Its processes' command line.
    pub argv: Argv,
    /// Its members never read what the broker says.
    pub slow: bool,
}

/// An attacker's strategy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Strategy {
    pub cohorts: Vec<Cohort>,
}

/// The bounds the search keeps within.
pub const MAX_COHORTS: usize = 4;
pub const MAX_MEMBERS: u8 = 64;
pub const MIN_PERIOD_MS: u16 = 2;
pub const MAX_PERIOD_MS: u16 = 2000;
/// The largest command line: Linux takes 2 MiB of arguments with the
/// default stack limit, more with a larger one; the review used 4.5 MiB.
pub const MAX_ARGV_KIB: u32 = 4608;
/// A `Name` label within the protocol's 256 KiB frame.
pub const MAX_NAME_KIB: u16 = 250;
/// How large the attacker's inputs may be, and how much of the broker's
/// work it may cause in one play: past that, it leaves (its connections
/// closed, what they had not sent yet dropped). The broker's work is real
/// work in the harness too, 20 to 40 times slower than virtual time in a
/// debug build: a search with the largest inputs runs for minutes there,
/// so the test suite searches with smaller ones (`Bounds::QUICK`: work
/// that grows with an input's size still shows, at a fraction of the
/// size, and 50 ms of the broker's work is past every threshold), and
/// `cargo xtask redteam` with the largest (`Bounds::FULL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub argv_kib: u32,
    pub name_kib: u16,
    /// The broker's work (ns of its time) the attacker may cause.
    pub work: Nanos,
}

impl Bounds {
    pub const FULL: Bounds = Bounds {
        argv_kib: MAX_ARGV_KIB,
        name_kib: MAX_NAME_KIB,
        work: 500 * MS,
    };
    pub const QUICK: Bounds = Bounds {
        argv_kib: 256,
        name_kib: 32,
        work: 50 * MS,
    };

    /// `s` with its inputs cut to these bounds.
    pub fn clamp(&self, s: &Strategy) -> Strategy {
        let mut s = s.clone();
        for c in &mut s.cohorts {
            c.argv.kib = c.argv.kib.min(self.argv_kib);
            if let Play::Name { kib, .. } | Play::Trickle { kib, .. } = &mut c.play {
                *kib = (*kib).min(self.name_kib);
            }
        }
        s
    }
}

/// Which strategies a search may try: all of them, or only shims of some
/// classes with short command lines and no made-up GPUs, to see whether
/// it finds an attack within a narrower space by itself; or with a kind
/// of attack already known left out, to see what else it finds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Space {
    pub shims_only: bool,
    /// The shims' classes allowed (all when empty).
    pub classes: Vec<Priority>,
    /// Every shim launches while it holds, and reads what it is sent: the
    /// holder without work (or that never hears its grant), which the
    /// broker tells from a busy one only by the driver's per-process
    /// utilisation, left out.
    pub working: bool,
}

impl Space {
    pub fn all() -> Space {
        Space {
            shims_only: false,
            classes: Vec::new(),
            working: false,
        }
    }

    /// `s` brought into the space: cohorts of other plays dropped, other
    /// classes made the first allowed, large inputs made small, every shim
    /// launching (`working`); None if nothing is left.
    pub fn fit(&self, s: &Strategy) -> Option<Strategy> {
        let mut out = Strategy::default();
        for c in &s.cohorts {
            let mut c = *c;
            match &mut c.play {
                Play::Shim {
                    class, uuids, work, ..
                } => {
                    if !self.classes.is_empty() && !self.classes.contains(class) {
                        *class = self.classes[0];
                    }
                    if self.working {
                        // One that never reads never hears its grant,
                        // and holds without launching too.
                        *work = true;
                        c.slow = false;
                    }
                    if self.shims_only {
                        *uuids = 0;
                        c.argv = Argv::SHORT;
                    }
                }
                _ if self.shims_only => continue,
                _ => {}
            }
            out.cohorts.push(c);
        }
        (!out.cohorts.is_empty()).then_some(out)
    }
}

/// Frames an attacker sends in one play at most: past it, it leaves
/// (plays stay bounded in the harness's time).
const MAX_FRAMES: u64 = 100_000;

impl Cohort {
    /// A member's cycle: when it first comes on, from the start.
    fn first_on(&self, member: usize) -> Nanos {
        let p = self.period();
        let phase = (member as u64 * u64::from(self.stagger) * p / 100) % p;
        Nanos::from(self.start_ms) * MS + phase
    }

    fn period(&self) -> Nanos {
        Nanos::from(self.period_ms.max(MIN_PERIOD_MS)) * MS
    }

    fn on_for(&self) -> Option<Nanos> {
        (self.duty < 100).then(|| (self.period() * u64::from(self.duty.max(1)) / 100).max(US))
    }

    fn role(&self) -> Role {
        match self.play {
            Play::Shim { .. } => Role::Shim,
            _ => Role::Cli,
        }
    }
}

#[derive(Debug, Default)]
struct Member {
    cohort: usize,
    index: usize,
    conn: Option<ConnId>,
    on: bool,
    grant: Option<u64>,
    released: u64,
    waiting: bool,
    /// Its current lease request (in `record.leases`).
    lease: Option<usize>,
    /// How much of its trickled frame its connection has sent.
    trickled: usize,
    /// The process whose `high` job its open lease is: the one counted
    /// in `high_jobs` until the lease's connection closes, whichever
    /// process its slot holds by then.
    high_pid: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Timer {
    On(usize),
    Off(usize),
    Drained(ConnId),
    Leave,
}

/// A lease the attacker asked for, and when it was placed.
#[derive(Debug, Clone, Copy)]
pub struct LeaseAsked {
    pub want: Want,
    pub asked: Nanos,
    pub leased: Option<Nanos>,
}

/// What the attacker did and saw.
#[derive(Debug, Default, Clone)]
pub struct Record {
    /// It was cut short: past its bounds on work or frames.
    pub cut: bool,
    pub leases: Vec<LeaseAsked>,
    pub connections: u64,
    pub frames: u64,
    pub pids: Vec<u32>,
}

/// A strategy, played.
pub struct Attacker {
    cohorts: Vec<Cohort>,
    /// The broker's work past which it leaves.
    work: Nanos,
    members: Vec<Member>,
    /// Each cohort's processes.
    procs: Vec<Vec<Option<u32>>>,
    /// The cohort whose processes each cohort's members come from.
    owner: Vec<usize>,
    /// What each cohort's processes say their command is.
    commands: Vec<String>,
    /// Each trickling cohort's frame, encoded once.
    trickles: Vec<Vec<u8>>,
    left: bool,
    timers: Timers<Timer>,
    by_conn: BTreeMap<ConnId, usize>,
    /// Per process, its open leases for `high`: while it has one, its
    /// shims are of that job, `high` whatever they registered with (the
    /// fairness oracle's class).
    high_jobs: BTreeMap<u32, usize>,
    pub record: Record,
}

impl Attacker {
    /// `s` played from `base` within `bounds`; everything of it closed
    /// and gone at `leave` when given.
    pub fn new(s: &Strategy, bounds: &Bounds, base: Nanos, leave: Option<Nanos>) -> Attacker {
        let s = bounds.clamp(s);
        let mut a = Attacker {
            cohorts: s.cohorts.clone(),
            work: bounds.work,
            members: Vec::new(),
            procs: s
                .cohorts
                .iter()
                .map(|c| vec![None; usize::from(c.procs.clamp(1, c.members.max(1)))])
                .collect(),
            commands: s.cohorts.iter().map(|c| c.argv.command()).collect(),
            trickles: s
                .cohorts
                .iter()
                .map(|c| match c.play {
                    Play::Trickle { kib, .. } => {
                        let mut b = Vec::new();
                        wire::encode_client(&name_frame(kib), &mut b);
                        b
                    }
                    _ => Vec::new(),
                })
                .collect(),
            owner: s
                .cohorts
                .iter()
                .enumerate()
                .scan(0, |last, (ci, c)| {
                    if c.procs > 0 || ci == 0 {
                        *last = ci;
                    }
                    Some(*last)
                })
                .collect(),
            left: false,
            timers: Timers::default(),
            by_conn: BTreeMap::new(),
            high_jobs: BTreeMap::new(),
            record: Record::default(),
        };
        for (ci, c) in s.cohorts.iter().enumerate() {
            for i in 0..usize::from(c.members.clamp(1, MAX_MEMBERS)) {
                let m = a.members.len();
                a.members.push(Member {
                    cohort: ci,
                    index: i,
                    ..Member::default()
                });
                a.at(base + c.first_on(i), Timer::On(m));
            }
        }
        if let Some(t) = leave {
            a.at(t, Timer::Leave);
        }
        a
    }

    fn at(&mut self, t: Nanos, timer: Timer) {
        self.timers.at(t, timer);
    }

    fn send(&mut self, io: &mut Io<'_>, c: ConnId, msg: &ClientMsg) {
        self.record.frames += 1;
        io.send(c, msg);
    }

    /// Member `m`'s process slot: its owner cohort, and the slot there.
    fn slot(&self, m: usize) -> (usize, usize) {
        let (ci, i) = (self.owner[self.members[m].cohort], self.members[m].index);
        (ci, i % self.procs[ci].len())
    }

    /// Member `m`'s process, if it has one.
    fn pid_of(&self, m: usize) -> Option<u32> {
        let (ci, slot) = self.slot(m);
        self.procs[ci][slot]
    }

    /// The class the broker gives a shim of process `pid` that
    /// registered with `class`: its open `high` lease's, if it has one.
    fn shim_class(&self, pid: u32, class: Priority) -> Priority {
        if self.high_jobs.contains_key(&pid) {
            Priority::High
        } else {
            class
        }
    }

    fn process(&mut self, io: &mut Io<'_>, m: usize, fresh: bool) -> u32 {
        let (ci, slot) = self.slot(m);
        let slots = &mut self.procs[ci];
        if fresh && let Some(old) = slots[slot].take() {
            io.exit(old);
        }
        if let Some(pid) = slots[slot] {
            return pid;
        }
        let pid = io.spawn(ATTACKER, self.cohorts[ci].argv);
        self.procs[ci][slot] = Some(pid);
        self.record.pids.push(pid);
        pid
    }

    fn open(&mut self, io: &mut Io<'_>, m: usize) -> ConnId {
        let c = self.cohorts[self.members[m].cohort];
        let pid = self.process(io, m, c.respawn);
        let conn = io.connect(pid);
        self.record.connections += 1;
        if c.slow {
            io.stop_reading(conn);
        }
        self.send(io, conn, &ClientMsg::hello(pid, c.role()));
        self.by_conn.insert(conn, m);
        let mb = &mut self.members[m];
        mb.conn = Some(conn);
        mb.grant = None;
        mb.waiting = false;
        match c.play {
            Play::Shim { class, uuids, .. } => {
                let mut devices = vec![DeviceReg {
                    uuid: uuid(0),
                    ordinal: 0,
                    mem_cap: 0,
                    mem_total: 16 * GIB,
                }];
                devices.extend((0..uuids).map(|k| DeviceReg {
                    uuid: uuid(100 + usize::from(k)),
                    ordinal: u32::from(k) + 1,
                    mem_cap: 0,
                    mem_total: 16 * GIB,
                }));
                let reg = ClientMsg::Register {
                    command: self.commands[self.members[m].cohort].clone(),
                    devices,
                    share: None,
                    limit: None,
                    priority: class,
                };
                self.send(io, conn, &reg);
                io.on_gpu(conn, ATTACKER, self.shim_class(pid, class));
            }
            Play::Name { .. } | Play::Trickle { .. } => {
                let lease = LeaseReq::default();
                self.send(io, conn, &lease.into());
            }
            _ => {}
        }
        self.members[m].trickled = 0;
        conn
    }

    /// Member `m`'s lease, if for `high`, opens: its process's shims are of
    /// that job's class while it has one open.
    fn high_opened(&mut self, io: &mut Io<'_>, m: usize) {
        let play = self.cohorts[self.members[m].cohort].play;
        if !matches!(
            play,
            Play::Lease {
                want: Want::High,
                ..
            }
        ) {
            return;
        }
        let Some(pid) = self.pid_of(m) else {
            return;
        };
        self.members[m].high_pid = Some(pid);
        *self.high_jobs.entry(pid).or_default() += 1;
        self.reclass(io, pid);
    }

    /// Member `m`'s `high` lease, if it had one open, closes.
    fn high_closed(&mut self, io: &mut Io<'_>, m: usize) {
        let Some(pid) = self.members[m].high_pid.take() else {
            return;
        };
        if let Some(n) = self.high_jobs.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                self.high_jobs.remove(&pid);
            }
        }
        self.reclass(io, pid);
    }

    /// Process `pid`'s shims take the class the broker gives them now.
    fn reclass(&mut self, io: &mut Io<'_>, pid: u32) {
        for k in 0..self.members.len() {
            let mb = &self.members[k];
            if let (Play::Shim { class, .. }, Some(conn)) = (self.cohorts[mb.cohort].play, mb.conn)
                && self.pid_of(k) == Some(pid)
            {
                io.set_class(conn, self.shim_class(pid, class));
            }
        }
    }

    fn close(&mut self, io: &mut Io<'_>, m: usize) {
        if let Some(c) = self.members[m].conn.take() {
            io.close(c);
            self.by_conn.remove(&c);
            self.high_closed(io, m);
        }
        let mb = &mut self.members[m];
        mb.grant = None;
        mb.waiting = false;
        mb.lease = None;
    }

    fn on(&mut self, io: &mut Io<'_>, m: usize) {
        let c = self.cohorts[self.members[m].cohort];
        let reopen = c.reconnect || matches!(c.play, Play::Lease { .. });
        let open = self.members[m].conn.is_some_and(|x| !io.is_closed(x));
        if reopen || !open {
            self.close(io, m);
            self.open(io, m);
        }
        self.members[m].on = true;
        let Some(conn) = self.members[m].conn else {
            return;
        };
        match c.play {
            Play::Shim { work, .. } => {
                io.wants(conn, true, work);
                let mb = &mut self.members[m];
                if mb.grant.is_none() && !mb.waiting {
                    mb.waiting = true;
                    self.send(io, conn, &ClientMsg::Acquire { uuid: uuid(0) });
                }
            }
            Play::Ping { frames } => self.flood(io, conn, &ClientMsg::Ping, frames),
            Play::Status { frames } => self.flood(io, conn, &ClientMsg::Status { from: 0 }, frames),
            Play::Name { kib, frames } => {
                self.flood(io, conn, &name_frame(kib), u16::from(frames));
            }
            Play::Trickle { bytes, .. } => {
                let frame = &self.trickles[self.members[m].cohort];
                let from = self.members[m].trickled;
                let n = usize::from(bytes.max(1))
                    .min(frame.len() - from)
                    .min(io.room(conn));
                io.send_raw(conn, &frame[from..from + n]);
                let to = from + n;
                if to == frame.len() {
                    self.record.frames += 1;
                }
                self.members[m].trickled = to % frame.len();
            }
            Play::Lease { want, queued } => {
                let mut req = LeaseReq {
                    no_wait: !queued,
                    command: self.commands[self.members[m].cohort].clone(),
                    ..LeaseReq::default()
                };
                match want {
                    Want::Unplaced => {}
                    Want::Memory => req.want_mem = GIB,
                    Want::WholeMemory { less } => req.want_mem = 16 * GIB - u64::from(less),
                    Want::Gpu => req.want_gpus = 1,
                    Want::Pinned => {
                        req.pin = vec![Pin {
                            uuid: uuid(0),
                            mem: GIB,
                        }]
                    }
                    Want::High => {
                        req.want_mem = GIB;
                        req.priority = Some(Priority::High);
                    }
                }
                self.record.leases.push(LeaseAsked {
                    want,
                    asked: io.now,
                    leased: None,
                });
                self.members[m].lease = Some(self.record.leases.len() - 1);
                self.send(io, conn, &req.into());
                self.high_opened(io, m);
            }
        }
    }

    /// `n` copies of `msg`, as many as the socket takes without blocking.
    fn flood(&mut self, io: &mut Io<'_>, conn: ConnId, msg: &ClientMsg, n: u16) {
        let mut one = Vec::new();
        wire::encode_client(msg, &mut one);
        let fit = io.room(conn) / one.len().max(1);
        let n = usize::from(n).min(fit);
        if n == 0 {
            return;
        }
        self.record.frames += n as u64;
        io.send_raw(conn, &one.repeat(n));
    }

    fn off(&mut self, io: &mut Io<'_>, m: usize) {
        let c = self.cohorts[self.members[m].cohort];
        self.members[m].on = false;
        if let (Play::Shim { .. }, Some(conn)) = (c.play, self.members[m].conn) {
            io.wants(conn, false, false);
            if self.members[m].grant.is_some() {
                self.release(io, m);
            } else if std::mem::take(&mut self.members[m].waiting) {
                self.send(
                    io,
                    conn,
                    &ClientMsg::Release {
                        uuid: uuid(0),
                        held_ns: 0,
                    },
                );
            }
        }
        if c.reconnect || matches!(c.play, Play::Lease { .. }) {
            self.close(io, m);
        }
    }

    fn release(&mut self, io: &mut Io<'_>, m: usize) {
        let c = self.cohorts[self.members[m].cohort];
        let Some(conn) = self.members[m].conn else {
            return;
        };
        let Some(g) = self.members[m].grant.take() else {
            return;
        };
        self.members[m].released = g;
        self.send(
            io,
            conn,
            &ClientMsg::Release {
                uuid: uuid(0),
                held_ns: 0,
            },
        );
        let work = matches!(c.play, Play::Shim { work: true, .. });
        let drain = if work { 250 * US } else { 0 };
        io.holds(conn, false, drain);
        self.at(io.now + drain, Timer::Drained(conn));
    }

    fn leave(&mut self, io: &mut Io<'_>, drop_unsent: bool) {
        self.left = true;
        for m in 0..self.members.len() {
            if drop_unsent && let Some(c) = self.members[m].conn {
                io.drop_unread(c);
            }
            self.close(io, m);
        }
        for slots in std::mem::take(&mut self.procs) {
            for pid in slots.into_iter().flatten() {
                io.exit(pid);
            }
        }
        self.timers.clear();
    }

    /// Past its bounds, the attacker leaves: true then.
    fn cut(&mut self, io: &mut Io<'_>) -> bool {
        if self.left {
            return true;
        }
        if io.work > self.work || self.record.frames > MAX_FRAMES {
            self.record.cut = true;
            self.leave(io, true);
            return true;
        }
        false
    }

    fn timer(&mut self, io: &mut Io<'_>, t: Timer) {
        if self.cut(io) {
            return;
        }
        match t {
            Timer::On(m) => {
                self.on(io, m);
                let c = self.cohorts[self.members[m].cohort];
                if let Some(d) = c.on_for() {
                    self.at(io.now + d, Timer::Off(m));
                    self.at(io.now + c.period(), Timer::On(m));
                } else if matches!(
                    c.play,
                    Play::Ping { .. }
                        | Play::Status { .. }
                        | Play::Name { .. }
                        | Play::Trickle { .. }
                ) {
                    // Always on: a flood goes on each period.
                    self.at(io.now + c.period(), Timer::On(m));
                }
            }
            Timer::Off(m) => self.off(io, m),
            Timer::Drained(conn) => {
                if self.by_conn.contains_key(&conn) {
                    self.send(io, conn, &ClientMsg::Drained { uuid: uuid(0) });
                }
            }
            Timer::Leave => self.leave(io, false),
        }
    }
}

impl Actor for Attacker {
    fn wake_at(&self) -> Option<Nanos> {
        self.timers.next_at()
    }

    fn wake(&mut self, io: &mut Io<'_>) {
        while let Some(timer) = self.timers.pop_due(io.now) {
            self.timer(io, timer);
        }
    }

    fn heard(&mut self, io: &mut Io<'_>, conn: ConnId, msg: ServerMsg) {
        if self.cut(io) {
            return;
        }
        let Some(&m) = self.by_conn.get(&conn) else {
            return;
        };
        let c = self.cohorts[self.members[m].cohort];
        match msg {
            ServerMsg::Grant { grant, .. } => {
                let mb = &mut self.members[m];
                if grant == mb.released || mb.grant == Some(grant) {
                    return;
                }
                mb.grant = Some(grant);
                mb.waiting = false;
                let on = mb.on;
                io.holds(conn, true, 0);
                if !on
                    && !matches!(
                        c.play,
                        Play::Shim {
                            recall: Recall::Ignore,
                            ..
                        }
                    )
                {
                    self.release(io, m);
                }
            }
            ServerMsg::Revoke { grant, .. } => {
                if self.members[m].grant != Some(grant) {
                    return;
                }
                let Play::Shim { recall, .. } = c.play else {
                    return;
                };
                let on = self.members[m].on;
                match recall {
                    Recall::Honest => {
                        if on {
                            self.members[m].waiting = true;
                            self.send(io, conn, &ClientMsg::Acquire { uuid: uuid(0) });
                        }
                        self.release(io, m);
                    }
                    Recall::Reask => {
                        self.release(io, m);
                        if on {
                            self.members[m].waiting = true;
                            self.send(io, conn, &ClientMsg::Acquire { uuid: uuid(0) });
                        }
                    }
                    // Stopped: no more launches, no answer.
                    Recall::Ignore => io.holds(conn, false, 0),
                }
            }
            ServerMsg::Leased(_) => {
                if let Some(l) = self.members[m].lease {
                    self.record.leases[l].leased.get_or_insert(io.now);
                }
            }
            _ => {}
        }
    }

    fn closed(&mut self, _io: &mut Io<'_>, conn: ConnId) {
        if let Some(m) = self.by_conn.remove(&conn) {
            let mb = &mut self.members[m];
            if mb.conn == Some(conn) {
                mb.conn = None;
                mb.grant = None;
                mb.waiting = false;
            }
        }
    }
}

/// A cohort of one member, on all the time, from the start, with a short
/// command line, reading what it is sent.
pub fn cohort(play: Play) -> Cohort {
    Cohort {
        play,
        members: 1,
        procs: 1,
        start_ms: 0,
        period_ms: 1000,
        duty: 100,
        stagger: 0,
        reconnect: false,
        respawn: false,
        argv: Argv::SHORT,
        slow: false,
    }
}

/// A shim of `class` that launches while it holds (`work`) and answers
/// recalls as `recall` says, naming no made-up GPUs.
pub fn shim(class: Priority, work: bool, recall: Recall) -> Play {
    Play::Shim {
        class,
        work,
        recall,
        uuids: 0,
    }
}

/// The strategies of the review that found the round-4 attacks (issue 32),
/// by name.
pub fn seeds() -> Vec<(&'static str, Strategy)> {
    let one = |c: Cohort| Strategy { cohorts: vec![c] };
    vec![
        (
            // Sixteen connections of one process taking turns: each comes
            // back from idle with a sixteenth of the user's debt.
            "rotation",
            one(Cohort {
                members: 16,
                period_ms: 320,
                duty: 6,
                stagger: 6,
                ..cohort(shim(Priority::Normal, true, Recall::Honest))
            }),
        ),
        (
            "high-and-normal",
            Strategy {
                cohorts: vec![
                    cohort(shim(Priority::High, true, Recall::Honest)),
                    cohort(shim(Priority::Normal, true, Recall::Honest)),
                ],
            },
        ),
        (
            // A holder with hardly any work answering every recall by
            // asking again after its release.
            "recall-pretending",
            one(cohort(shim(Priority::Normal, false, Recall::Reask))),
        ),
        (
            "big-argv-registers",
            one(Cohort {
                members: 32,
                period_ms: 200,
                duty: 50,
                reconnect: true,
                argv: Argv {
                    kib: 2048,
                    text: Text::Plain,
                },
                ..cohort(shim(Priority::Normal, false, Recall::Honest))
            }),
        ),
        (
            "name-flood",
            one(Cohort {
                members: 2,
                period_ms: 5,
                ..cohort(Play::Name { kib: 64, frames: 2 })
            }),
        ),
        (
            "uuid-flood",
            one(cohort(Play::Shim {
                class: Priority::Normal,
                work: false,
                recall: Recall::Honest,
                uuids: 15,
            })),
        ),
        (
            "lease-churn",
            one(Cohort {
                members: 16,
                period_ms: 10,
                duty: 50,
                stagger: 6,
                ..cohort(Play::Lease {
                    want: Want::Unplaced,
                    queued: false,
                })
            }),
        ),
        (
            "refusal-a-second",
            one(Cohort {
                period_ms: 1000,
                duty: 10,
                ..cohort(Play::Lease {
                    want: Want::Pinned,
                    queued: false,
                })
            }),
        ),
        (
            "forged-fields",
            one(Cohort {
                argv: Argv {
                    kib: 0,
                    text: Text::Fields,
                },
                ..cohort(shim(Priority::Normal, false, Recall::Honest))
            }),
        ),
        (
            "slow-status-readers",
            one(Cohort {
                members: 8,
                period_ms: 10,
                slow: true,
                ..cohort(Play::Status { frames: 64 })
            }),
        ),
        (
            "whole-memory-jumps-the-queue",
            Strategy {
                cohorts: vec![
                    Cohort {
                        period_ms: 400,
                        duty: 90,
                        ..cohort(Play::Lease {
                            want: Want::Memory,
                            queued: false,
                        })
                    },
                    Cohort {
                        start_ms: 300,
                        period_ms: 2000,
                        duty: 90,
                        ..cohort(Play::Lease {
                            want: Want::WholeMemory { less: 1 << 20 },
                            queued: true,
                        })
                    },
                ],
            },
        ),
    ]
}

/// A `Name` frame whose pod is empty and whose label is `kib` KiB of
/// control bytes (each escaped to several on the way to a log).
fn name_frame(kib: u16) -> ClientMsg {
    let label: String = "\u{1}\n\u{1b}"
        .chars()
        .cycle()
        .take(usize::from(kib.min(MAX_NAME_KIB)) * 1024)
        .collect();
    ClientMsg::Name {
        pod: String::new(),
        label,
    }
}

impl Strategy {
    /// The strategy as Rust, to paste into a regression test.
    pub fn to_rust(&self) -> String {
        let mut s = String::from("Strategy {\n    cohorts: vec![\n");
        for c in &self.cohorts {
            let play = match c.play {
                Play::Shim {
                    class,
                    work,
                    recall,
                    uuids,
                } => format!(
                    "Play::Shim {{ class: Priority::{class:?}, work: {work}, recall: Recall::{recall:?}, uuids: {uuids} }}"
                ),
                Play::Ping { frames } => format!("Play::Ping {{ frames: {frames} }}"),
                Play::Status { frames } => format!("Play::Status {{ frames: {frames} }}"),
                Play::Name { kib, frames } => {
                    format!("Play::Name {{ kib: {kib}, frames: {frames} }}")
                }
                Play::Lease { want, queued } => {
                    format!("Play::Lease {{ want: Want::{want:?}, queued: {queued} }}")
                }
                Play::Trickle { kib, bytes } => {
                    format!("Play::Trickle {{ kib: {kib}, bytes: {bytes} }}")
                }
            };
            let _ = writeln!(
                s,
                "        Cohort {{\n            play: {play},\n            members: {}, procs: {}, start_ms: {}, period_ms: {}, duty: {}, stagger: {},\n            reconnect: {}, respawn: {}, argv: Argv {{ kib: {}, text: Text::{:?} }}, slow: {},\n        }},",
                c.members,
                c.procs,
                c.start_ms,
                c.period_ms,
                c.duty,
                c.stagger,
                c.reconnect,
                c.respawn,
                c.argv.kib,
                c.argv.text,
                c.slow
            );
        }
        s.push_str("    ],\n}");
        s
    }

    /// The strategy in words.
    pub fn describe(&self) -> String {
        let mut out = Vec::new();
        for c in &self.cohorts {
            let play = match c.play {
                Play::Shim {
                    class,
                    work,
                    recall,
                    uuids,
                } => format!(
                    "shim, {} class, {}, recalls {}{}",
                    class.as_str(),
                    if work {
                        "launching while it holds"
                    } else {
                        "no work"
                    },
                    match recall {
                        Recall::Honest => "answered as the shim does",
                        Recall::Reask => "answered by Release then Acquire",
                        Recall::Ignore => "ignored",
                    },
                    if uuids > 0 {
                        format!(", {uuids} made-up GPUs")
                    } else {
                        String::new()
                    }
                ),
                Play::Ping { frames } => format!("{frames} pings"),
                Play::Status { frames } => format!("{frames} status requests"),
                Play::Name { kib, frames } => {
                    format!("{frames} Name frames of {kib} KiB of control bytes")
                }
                Play::Lease { want, queued } => format!(
                    "a lease for {want:?}{}",
                    if queued { " (queued)" } else { " (--no-wait)" }
                ),
                Play::Trickle { kib, bytes } => {
                    format!("Name frames of {kib} KiB of control bytes, {bytes} bytes at a time")
                }
            };
            let cycle = if c.duty >= 100 {
                "all the time".to_owned()
            } else {
                format!(
                    "{}% of each {} ms{}",
                    c.duty,
                    c.period_ms,
                    if c.members > 1 && c.stagger > 0 {
                        format!(", staggered by {}% (taking turns)", c.stagger)
                    } else {
                        String::new()
                    }
                )
            };
            let mut extra = Vec::new();
            if c.reconnect {
                extra.push(if c.respawn {
                    "a new process and connection each time"
                } else {
                    "a new connection each time"
                });
            }
            if c.slow {
                extra.push("never reading");
            }
            let argv = if c.argv.kib > 0 || c.argv.text != Text::Plain {
                format!(", command line {} KiB {:?}", c.argv.kib, c.argv.text)
            } else {
                String::new()
            };
            let procs = match c.procs {
                0 => "the cohort before's".to_owned(),
                n => n.to_string(),
            };
            out.push(format!(
                "{} connection(s) of {} process(es) from {} ms, {} on {}{}{}{}",
                c.members,
                procs,
                c.start_ms,
                play,
                cycle,
                argv,
                if extra.is_empty() { "" } else { ", " },
                extra.join(", ")
            ));
        }
        out.join("; ")
    }

    /// Whether some cohort has several connections of one user with work
    /// coming back from idle at different times, taking turns at the GPU
    /// (the rotation attack, however it was reached).
    pub fn rotates(&self) -> bool {
        self.cohorts.iter().any(|c| {
            matches!(c.play, Play::Shim { work: true, .. })
                && c.members > 1
                && c.duty < 100
                && c.stagger > 0
        })
    }
}
