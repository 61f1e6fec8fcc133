//! The simulated node in virtual time: the broker (`core::Shell`) on one
//! side of its sockets, the users' processes (actors) on the other, and
//! the GPU they take turns at. The loop is the broker's: it polls (here:
//! takes what the clients did since its last pass), runs a pass, which
//! moves the clock by the work it did, and its output reaches the
//! clients when the pass ends; while it has nothing to do, the clock
//! jumps to the next timer, the broker's or a client's.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;

use gpufrac_common::config::Priority;
use gpufrac_common::wire::{self, ClientMsg, ServerMsg};

use crate::core::{Clock, ConnId, Driver, Nanos, Read, Setup, Shell, Sockets};
use crate::host::{Argv, Host};

/// The victim user, and the attacker (`nobody`).
pub const VICTIM: u32 = 1000;
pub const ATTACKER: u32 = 65534;

/// What a Unix stream socket holds each way before a writer must wait
/// (Linux's default).
pub const SOCKBUF: usize = 208 << 10;

/// A client's end of a connection.
#[derive(Debug)]
struct Socket {
    actor: usize,
    pid: u32,
    to_broker: VecDeque<u8>,
    to_client: Vec<u8>,
    accepted: bool,
    client_closed: bool,
    broker_closed: bool,
    /// The client never reads what the broker sends.
    slow: bool,
}

/// The sockets, and what the clients did since the broker's last poll.
#[derive(Debug, Default)]
struct Net {
    sockets: BTreeMap<ConnId, Socket>,
    backlog: VecDeque<ConnId>,
    next_id: ConnId,
    /// Became readable (bytes, or closed) since the last poll.
    readable: BTreeSet<ConnId>,
    /// Processes that exited since the last poll.
    exited: Vec<u32>,
}

impl Sockets for Net {
    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read {
        let Some(s) = self.sockets.get_mut(&id) else {
            return Read::Closed;
        };
        if s.to_broker.is_empty() {
            return if s.client_closed {
                Read::Closed
            } else {
                Read::WouldBlock
            };
        }
        let n = buf.len().min(s.to_broker.len());
        let (a, b) = s.to_broker.as_slices();
        let first = n.min(a.len());
        buf[..first].copy_from_slice(&a[..first]);
        buf[first..n].copy_from_slice(&b[..n - first]);
        s.to_broker.drain(..n);
        // As the broker's shell reads a stream socket: a short read is all
        // there was, unless the client hung up (then no edge comes again).
        if n < buf.len() && !s.client_closed {
            Read::Drained(n)
        } else {
            Read::Bytes(n)
        }
    }

    fn write(&mut self, id: ConnId, bytes: &[u8]) -> Option<usize> {
        let s = self.sockets.get_mut(&id)?;
        if s.client_closed {
            // EPIPE.
            return None;
        }
        let n = bytes.len().min(SOCKBUF.saturating_sub(s.to_client.len()));
        s.to_client.extend_from_slice(&bytes[..n]);
        Some(n)
    }

    fn accept(&mut self) -> Option<(ConnId, u32)> {
        let id = self.backlog.pop_front()?;
        let s = self.sockets.get_mut(&id)?;
        s.accepted = true;
        Some((id, s.pid))
    }

    fn close(&mut self, id: ConnId) {
        if let Some(s) = self.sockets.get_mut(&id) {
            s.broker_closed = true;
        }
    }
}

/// Someone with work for the GPU: a process's session on it.
#[derive(Debug, Clone)]
struct Occupant {
    uid: u32,
    pid: u32,
    class: Priority,
    /// It asks for the GPU: as far as the broker can tell, it has work.
    claims: bool,
    /// It has work to run (a real process launching), whether or not it
    /// may launch now.
    wants: bool,
    /// It holds the grant and launches.
    holding: bool,
    /// Work it queued before it released runs until then.
    drain_until: Nanos,
}

impl Occupant {
    fn running(&self, t: Nanos) -> bool {
        (self.holding && self.wants) || self.drain_until > t
    }
}

/// What the GPU did, in ns, from the start.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuTime {
    /// The victim user's GPU time (the GPU's time-slicer splits the GPU
    /// evenly among the processes with work on it).
    pub victim: f64,
    pub attacker: f64,
    /// The victim had work waiting for a grant.
    pub victim_waiting: f64,
    /// ... and the GPU ran nobody's work.
    pub idle_victim_waiting: f64,
    /// The victim's fair part: while it had work, the share of the GPU
    /// the policy gives one of two users asking for it, by their classes
    /// (an attacker that asks for the GPU is owed its part whether or not
    /// it uses it: the broker cannot see its kernels).
    pub fair: f64,
}

/// One GPU's time, by whose work ran on it.
#[derive(Debug, Default)]
struct Gpu {
    t: Nanos,
    occ: BTreeMap<ConnId, Occupant>,
    time: GpuTime,
    /// Time anyone's work ran, and its value at the last sample.
    busy: Nanos,
    sampled: (Nanos, Nanos),
    /// The kernel time each pid ran since the last sample of per-process
    /// work (the time-slicer's even split), and when that sample was.
    ran: BTreeMap<u32, f64>,
    ran_from: Nanos,
}

impl Driver for Gpu {
    fn utilization(&mut self, now: Nanos) -> u32 {
        self.advance(now);
        let (t0, b0) = std::mem::replace(&mut self.sampled, (now, self.busy));
        let span = now.saturating_sub(t0).max(1);
        (100 * (self.busy - b0) / span).min(100) as u32
    }

    fn working(&mut self, now: Nanos) -> Vec<(u32, u32)> {
        self.advance(now);
        let span = now
            .saturating_sub(std::mem::replace(&mut self.ran_from, now))
            .max(1) as f64;
        std::mem::take(&mut self.ran)
            .into_iter()
            .map(|(pid, ns)| (pid, ((100.0 * ns / span).ceil() as u32).clamp(1, 100)))
            .collect()
    }
}

/// The victim's part of the GPU when both users have work: `low` runs
/// only on time nobody else wants; otherwise two users split it evenly,
/// whatever their classes (priority buys latency, never throughput).
fn fair_part(victim: Priority, attacker: Option<Priority>) -> f64 {
    match (victim, attacker) {
        (_, None) => 1.0,
        (Priority::Low, Some(Priority::Low)) => 0.5,
        (Priority::Low, Some(_)) => 0.0,
        (_, Some(Priority::Low)) => 1.0,
        _ => 0.5,
    }
}

impl Gpu {
    fn advance(&mut self, to: Nanos) {
        while self.t < to {
            let t = self.t;
            let next = self
                .occ
                .values()
                .map(|o| o.drain_until)
                .filter(|&d| d > t && d < to)
                .min()
                .unwrap_or(to);
            let dt = (next - t) as f64;
            let running: Vec<&Occupant> = self.occ.values().filter(|o| o.running(t)).collect();
            let n = running.len() as f64;
            if !running.is_empty() {
                self.busy += next - t;
                for o in &running {
                    *self.ran.entry(o.pid).or_default() += dt / n;
                }
            }
            for o in &running {
                if o.uid == VICTIM {
                    self.time.victim += dt / n;
                } else {
                    self.time.attacker += dt / n;
                }
            }
            let claims = |uid: u32| {
                self.occ
                    .values()
                    .filter(|o| o.uid == uid && o.claims)
                    .map(|o| o.class)
                    .max()
            };
            if let Some(v) = claims(VICTIM) {
                self.time.fair += dt * fair_part(v, claims(ATTACKER));
                let held = self
                    .occ
                    .values()
                    .any(|o| o.uid == VICTIM && o.claims && o.holding);
                if !held {
                    self.time.victim_waiting += dt;
                    // While an attacker's process of the victim's own class
                    // asks for the GPU, it is owed its part of the class's
                    // time, and may waste it (granted, it need not work or
                    // even read its grant): the victim's part is the
                    // fairness invariant's business. Idle counts time the
                    // victim lost to a class above it, or to nobody.
                    let own_part = self
                        .occ
                        .values()
                        .any(|o| o.uid == ATTACKER && o.class == v && o.claims);
                    if running.is_empty() && !own_part {
                        self.time.idle_victim_waiting += dt;
                    }
                }
            }
            self.t = next;
        }
    }
}

/// An actor's timers, due in order of time, then of setting (two set
/// for the same instant fire as set).
#[derive(Debug)]
pub struct Timers<T> {
    due: BTreeMap<(Nanos, u64), T>,
    seq: u64,
}

impl<T> Default for Timers<T> {
    fn default() -> Self {
        Timers {
            due: BTreeMap::new(),
            seq: 0,
        }
    }
}

impl<T> Timers<T> {
    pub fn at(&mut self, t: Nanos, timer: T) {
        self.seq += 1;
        self.due.insert((t, self.seq), timer);
    }

    /// When the first is due.
    pub fn next_at(&self) -> Option<Nanos> {
        self.due.keys().next().map(|&(t, _)| t)
    }

    /// The first timer due by `now`, taken off the table.
    pub fn pop_due(&mut self, now: Nanos) -> Option<T> {
        let first = self.due.first_entry()?;
        if first.key().0 > now {
            return None;
        }
        Some(first.remove())
    }

    pub fn clear(&mut self) {
        self.due.clear();
    }
}

/// A user's processes as the broker sees them from the other end of its
/// sockets: they act at their own times and when the broker says
/// something.
pub trait Actor {
    /// When it next acts of itself.
    fn wake_at(&self) -> Option<Nanos>;
    fn wake(&mut self, io: &mut Io<'_>);
    /// A frame from the broker on `conn`.
    fn heard(&mut self, io: &mut Io<'_>, conn: ConnId, msg: ServerMsg);
    /// The broker closed `conn` (after everything it said was heard).
    fn closed(&mut self, io: &mut Io<'_>, conn: ConnId);
}

/// What an actor can do, now.
pub struct Io<'a> {
    pub now: Nanos,
    /// The broker's work so far (for answers' cost in work).
    pub work: Nanos,
    actor: usize,
    net: &'a mut Net,
    host: &'a RefCell<Host>,
    gpu: &'a mut Gpu,
}

impl Io<'_> {
    pub fn spawn(&mut self, uid: u32, argv: Argv) -> u32 {
        self.host.borrow_mut().spawn(uid, 1, argv)
    }

    /// The process exits: the broker's pidfd says so.
    pub fn exit(&mut self, pid: u32) {
        self.host.borrow_mut().exit(pid);
        self.net.exited.push(pid);
    }

    /// A new connection from `pid`, in the listener's backlog.
    pub fn connect(&mut self, pid: u32) -> ConnId {
        self.net.next_id += 1;
        let id = self.net.next_id;
        self.net.sockets.insert(
            id,
            Socket {
                actor: self.actor,
                pid,
                to_broker: VecDeque::new(),
                to_client: Vec::new(),
                accepted: false,
                client_closed: false,
                broker_closed: false,
                slow: false,
            },
        );
        self.net.backlog.push_back(id);
        id
    }

    /// What the client wrote on `conn` that the broker has not read is
    /// dropped (the harness's shortcut when an attacker is cut short).
    pub fn drop_unread(&mut self, conn: ConnId) {
        if let Some(s) = self.net.sockets.get_mut(&conn) {
            s.to_broker.clear();
        }
    }

    /// The client stops reading `conn`.
    pub fn stop_reading(&mut self, conn: ConnId) {
        if let Some(s) = self.net.sockets.get_mut(&conn) {
            s.slow = true;
        }
    }

    pub fn send(&mut self, conn: ConnId, msg: &ClientMsg) {
        let mut b = Vec::new();
        wire::encode_client(msg, &mut b);
        self.send_raw(conn, &b);
    }

    pub fn send_raw(&mut self, conn: ConnId, bytes: &[u8]) {
        if let Some(s) = self.net.sockets.get_mut(&conn)
            && !s.client_closed
            && !s.broker_closed
        {
            s.to_broker.extend(bytes);
            self.net.readable.insert(conn);
        }
    }

    /// What `conn`'s socket takes before a write would block.
    pub fn room(&self, conn: ConnId) -> usize {
        self.net
            .sockets
            .get(&conn)
            .map_or(0, |s| SOCKBUF.saturating_sub(s.to_broker.len()))
    }

    /// Whether the broker has closed `conn` (or it was never opened).
    pub fn is_closed(&self, conn: ConnId) -> bool {
        self.net
            .sockets
            .get(&conn)
            .is_none_or(|s| s.broker_closed || s.client_closed)
    }

    /// The client closes its end: its process's session on the GPU ends.
    pub fn close(&mut self, conn: ConnId) {
        if let Some(s) = self.net.sockets.get_mut(&conn)
            && !s.client_closed
        {
            s.client_closed = true;
            self.net.readable.insert(conn);
        }
        self.gpu.advance(self.now);
        self.gpu.occ.remove(&conn);
    }

    /// `conn` is a process's session on the GPU, of this class.
    pub fn on_gpu(&mut self, conn: ConnId, uid: u32, class: Priority) {
        self.gpu.advance(self.now);
        self.gpu.occ.insert(
            conn,
            Occupant {
                uid,
                pid: self.net.sockets.get(&conn).map_or(0, |s| s.pid),
                class,
                claims: false,
                wants: false,
                holding: false,
                drain_until: 0,
            },
        );
    }

    /// The class the broker gives `conn`'s process now (a job's priority
    /// is its processes', whatever they registered with).
    pub fn set_class(&mut self, conn: ConnId, class: Priority) {
        self.gpu.advance(self.now);
        if let Some(o) = self.gpu.occ.get_mut(&conn) {
            o.class = class;
        }
    }

    /// Whether the process of `conn` asks for the GPU, and whether it has
    /// work for it (a real process asks when it has).
    pub fn wants(&mut self, conn: ConnId, claims: bool, works: bool) {
        self.gpu.advance(self.now);
        if let Some(o) = self.gpu.occ.get_mut(&conn) {
            o.claims = claims;
            o.wants = works;
        }
    }

    /// It may launch (a grant) or not (released; what it queued runs for
    /// `drain` more).
    pub fn holds(&mut self, conn: ConnId, holding: bool, drain: Nanos) {
        self.gpu.advance(self.now);
        if let Some(o) = self.gpu.occ.get_mut(&conn) {
            if o.holding && !holding && o.wants {
                o.drain_until = o.drain_until.max(self.now + drain);
            }
            o.holding = holding;
        }
    }
}

/// The node: the broker, the users' processes, the GPU.
pub struct Node {
    pub clock: Clock,
    shell: Shell,
    host: Rc<RefCell<Host>>,
    net: Net,
    gpu: Gpu,
}

impl Node {
    pub fn new(setup: &Setup) -> Node {
        let host = Rc::new(RefCell::new(Host::default()));
        let now = crate::core::SEC;
        Node {
            clock: Clock { now, work: 0 },
            shell: Shell::new(setup, host.clone(), now),
            host,
            net: Net::default(),
            gpu: Gpu {
                t: now,
                sampled: (now, 0),
                ..Gpu::default()
            },
        }
    }

    /// When the run began (virtual time starts a second after boot).
    pub fn start(&self) -> Nanos {
        crate::core::SEC
    }

    pub fn shell(&self) -> &Shell {
        &self.shell
    }

    pub fn gpu_time(&self) -> GpuTime {
        self.gpu.time
    }

    /// Connections the broker still has open for `uid`'s processes.
    pub fn open_connections(&self, actor: usize) -> usize {
        self.net
            .sockets
            .values()
            .filter(|s| s.actor == actor && s.accepted && !s.broker_closed && !s.client_closed)
            .count()
    }

    /// Bytes of command lines the broker has read.
    pub fn cmdline_bytes(&self) -> u64 {
        self.host.borrow().cmdline_bytes
    }

    fn io(&mut self, actor: usize) -> Io<'_> {
        Io {
            now: self.clock.now,
            work: self.clock.work,
            actor,
            net: &mut self.net,
            host: &self.host,
            gpu: &mut self.gpu,
        }
    }

    /// Runs until `end`, the users' processes played by `actors`.
    pub fn run(&mut self, actors: &mut [&mut dyn Actor], end: Nanos) {
        while self.clock.now < end {
            self.wake_actors(actors);
            self.poll();
            // As the shell's poll: no wait (and no look at the timers)
            // while the core has a turn to run.
            let busy = self.shell.busy();
            let timeout = if busy {
                None
            } else {
                self.shell.next_timeout()
            };
            let due = timeout.is_some_and(|t| t <= self.clock.now);
            if busy || due {
                self.shell
                    .iteration(&mut self.clock, &mut self.net, &mut self.gpu);
                self.gpu.advance(self.clock.now);
                // A process's own timers that fell due while the broker
                // worked run before it reads what the broker wrote at the
                // end of that work, as a process on its own CPU would
                // have run them: a victim whose burst ended during a long
                // turn once heard that turn's revoke first, took itself
                // for mid-burst, and asked again as no waker.
                self.wake_actors(actors);
                self.deliver(actors);
                continue;
            }
            let next = actors
                .iter()
                .filter_map(|a| a.wake_at())
                .chain(timeout)
                .chain(Some(end))
                .min()
                .unwrap_or(end)
                .max(self.clock.now);
            if next == self.clock.now && !self.pending() {
                // An actor due now that did nothing: time must move.
                self.clock.now += 1;
            } else {
                self.clock.now = next;
            }
            self.gpu.advance(self.clock.now);
        }
    }

    /// Whether clients did something the broker has not polled yet.
    fn pending(&self) -> bool {
        !self.net.readable.is_empty() || !self.net.backlog.is_empty() || !self.net.exited.is_empty()
    }

    fn wake_actors(&mut self, actors: &mut [&mut dyn Actor]) {
        for _ in 0..1000 {
            let now = self.clock.now;
            let Some(i) =
                (0..actors.len()).find(|&i| actors[i].wake_at().is_some_and(|t| t <= now))
            else {
                return;
            };
            actors[i].wake(&mut self.io(i));
        }
    }

    /// What the poll would say: new connections, readable sockets,
    /// processes gone.
    fn poll(&mut self) {
        if !self.net.backlog.is_empty() {
            self.shell.listener_ready();
        }
        for id in std::mem::take(&mut self.net.readable) {
            if self.net.sockets.get(&id).is_some_and(|s| s.accepted) {
                self.shell.ready(id);
            }
        }
        for pid in std::mem::take(&mut self.net.exited) {
            let ids: Vec<ConnId> = self
                .net
                .sockets
                .iter()
                .filter(|(_, s)| s.pid == pid && s.accepted && !s.broker_closed)
                .map(|(&id, _)| id)
                .collect();
            for id in ids {
                self.shell.exited(&mut self.clock, id);
            }
        }
    }

    /// The clients read what the broker wrote, and hear of closes.
    fn deliver(&mut self, actors: &mut [&mut dyn Actor]) {
        let ids: Vec<ConnId> = self.net.sockets.keys().copied().collect();
        for id in ids {
            let Some(s) = self.net.sockets.get_mut(&id) else {
                continue;
            };
            if s.client_closed {
                if s.broker_closed {
                    self.net.sockets.remove(&id);
                }
                continue;
            }
            let actor = s.actor;
            let mut msgs = Vec::new();
            if !s.slow {
                let mut used = 0;
                while let Ok((m, n)) = wire::decode_server(&s.to_client[used..]) {
                    msgs.push(m);
                    used += n;
                }
                s.to_client.drain(..used);
            }
            let closed = s.broker_closed && (s.slow || s.to_client.is_empty());
            for m in msgs {
                actors[actor].heard(&mut self.io(actor), id, m);
            }
            if closed {
                let mut io = self.io(actor);
                io.gpu.advance(io.now);
                io.gpu.occ.remove(&id);
                actors[actor].closed(&mut io, id);
                self.net.sockets.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn occupant(uid: u32, class: Priority) -> Occupant {
        Occupant {
            uid,
            pid: uid,
            class,
            claims: true,
            wants: true,
            holding: false,
            drain_until: 0,
        }
    }

    #[test]
    fn two_users_split_the_gpu_and_low_gets_what_nobody_asks_for() {
        use Priority::*;
        assert_eq!(fair_part(Normal, None), 1.0);
        assert_eq!(fair_part(Normal, Some(High)), 0.5);
        assert_eq!(fair_part(High, Some(Normal)), 0.5);
        assert_eq!(fair_part(Normal, Some(Low)), 1.0);
        assert_eq!(fair_part(Low, Some(Normal)), 0.0);
        assert_eq!(fair_part(Low, Some(Low)), 0.5);
    }

    /// The victim holds for 10 ms beside the attacker's queued work (2 ms
    /// of it), then waits 10 ms while the attacker holds without
    /// launching: the GPU is split while both run, idle while nobody's
    /// work runs (but not counted against the broker: the attacker is of
    /// the victim's class), and the victim's fair part is half while the
    /// attacker asks.
    #[test]
    fn gpu_time_is_split_among_the_work_on_it() {
        let ms = crate::core::MS;
        let mut g = Gpu::default();
        let mut v = occupant(VICTIM, Priority::Normal);
        v.holding = true;
        let mut a = occupant(ATTACKER, Priority::Normal);
        a.drain_until = 2 * ms;
        a.wants = false;
        g.occ.insert(1, v);
        g.occ.insert(2, a);
        g.advance(10 * ms);
        assert_eq!(g.time.victim, (ms + 8 * ms) as f64);
        assert_eq!(g.time.attacker, ms as f64);
        g.occ.get_mut(&1).unwrap().holding = false;
        g.occ.get_mut(&2).unwrap().holding = true;
        g.advance(20 * ms);
        assert_eq!(g.time.victim_waiting, (10 * ms) as f64);
        // Of the victim's own class: the attacker's own part, not idle.
        assert_eq!(g.time.idle_victim_waiting, 0.0);
        assert_eq!(g.time.fair, (10 * ms) as f64);
        assert_eq!(g.busy, 10 * ms);
        assert_eq!(g.utilization(20 * ms), 50);
    }
}
