//! The broker core, sans I/O (as quinn-proto is for quinn): connections'
//! bytes, credentials and disconnections go in, with the time; replies,
//! closes, timers and work for slow drivers come out. It owns the
//! protocol (framing, handshake, dispatch), who is served when and for
//! how much work (`turns`), who may do what (`authority`), each user's
//! budgets, jobs and their membership, leases and the queue, MIG as
//! requests to the shell, the state to persist and status. /proc is
//! behind a trait (`procs`). The shell (`server.rs`) only says which
//! sockets are readable, reads them when a turn asks, writes, arms timers
//! and runs the work it is given, so everything here is tested in virtual
//! time (`tests/`).
//!
//! Rooms (no two of which call each other both ways): `conn` (a connection, its role's state; `Conns`, every open
//! connection with what changed of them and its user's budgets), `turns`
//! (who is served next, and the work each user is charged; `Serving`,
//! the turns with the work done and the read buffer), `roles`
//! (which role sends which message), `clients` (processes:
//! registration, membership, arbitration), `groups` (each process's
//! unit and user in its GPUs' schedulers), `say` (frames, status pages
//! and log lines, each within its user's budget), `jobtable` (each job and all
//! that is kept of it, ended in one place), `ledger` (jobs as one part:
//! the job table, the queue, token claims, MIG instances being made, a
//! recovery's hold), `leases` (what clients ask of jobs: leases, resumes,
//! claims back, MIG leases made), `view` (status), `gpus` (the units of
//! arbitration, found, made or learnt, and what a client may name),
//! `outside` (the world the core does not decide: /proc, job tokens, the
//! driver's view and the MPS daemon, and the processes the driver lists
//! that are not under the shim), `voices` (each user's log lines and
//! status pages), `saves` (when the state is written). NVML's view comes
//! in as a snapshot the shell sampled (`telemetry`), job tokens from a
//! source given at construction.

mod clients;
mod conn;
mod gpus;
mod groups;
mod jobtable;
mod leases;
mod ledger;
mod outside;
mod roles;
mod saves;
mod say;
mod summary;
mod timers;
mod turns;
mod view;
mod voices;

#[cfg(test)]
mod tests;

use gpufrac_common::wire::{self, DecodeError, ServerMsg};

use crate::authority::{Peer, Policy};
use crate::history;
use crate::jobs::{Job, Phase};
use crate::mig::{self, FoundInstance};
use crate::procs::{Procs, Telemetry};
use outside::World;

/// Where job tokens come from: random in the broker (`jobs::token_source`),
/// a fixed sequence in tests. A token names a job on the wire, so a real
/// source must be unguessable.
pub type Tokens = Box<dyn FnMut() -> u64>;
use crate::queue::{self, Queue, QueueConfig};
use crate::sched::{Action, SchedConfig};
use crate::stats::{Refusal, Stats};
use crate::status::MpsStatus;
use crate::weights::Weights;
use gpufrac_common::wire::uuid_string;
use gpus::Gpus;
use ledger::Ledger;
use timers::{Timer, Timers};

pub use conn::Budgets;
use conn::{Conn, Conns};
pub use saves::SAVE_EVERY;
use saves::Saves;
pub use turns::{MIN_READ, Read, Sockets};
use turns::{Served, Serving};
use voices::Voices;
#[cfg(test)]
use voices::{LOG_BURST, LOG_EVERY, STATUS_BURST, STATUS_EVERY};
pub use voices::{RateLimit, WARN_EVERY};

/// Monotonic nanoseconds (`CLOCK_MONOTONIC`, which a broker restart does
/// not reset, so queue ages survive one).
pub type Nanos = u64;
/// Chosen by the shell, unique among open connections.
pub type ConnId = u64;

const MS: Nanos = 1_000_000;
/// A connection must say hello within this, and finish any frame it
/// starts within `FRAME_DEADLINE`: idle or trickling connections cannot
/// pile up.
const HELLO_DEADLINE: Nanos = 2000 * MS;
const FRAME_DEADLINE: Nanos = 5000 * MS;
/// Restored jobs whose run may have died are looked at this often.
const SWEEP_TICK: Nanos = 250 * MS;
/// Bytes read from one connection per serve: a connection with more
/// waits for the next turn, after every other ready connection of its user
/// has had its own.
pub const READ_PER_TURN: usize = 64 << 10;
/// Everything the core decides by.
#[derive(Clone, Debug)]
pub struct Config {
    pub sched: SchedConfig,
    pub queue: QueueConfig,
    pub policy: Policy,
    /// Users' weights (`--user-weight`, `--group-weight`).
    pub weights: Weights,
    pub budgets: Budgets,
    /// For status.
    pub socket: String,
    /// MPS mode: the pipe directory clients are given.
    pub mps_pipe: Option<String>,
    /// After a state file that could not be trusted: how long running jobs
    /// have to claim their leases back before new placements resume.
    pub recovery_grace: Nanos,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sched: SchedConfig::default(),
            queue: QueueConfig::default(),
            policy: Policy::default(),
            weights: Weights::default(),
            budgets: Budgets::default(),
            socket: String::new(),
            mps_pipe: None,
            recovery_grace: 30_000 * MS,
        }
    }
}

/// Work the shell carries out for the core, off its event loop, and
/// reports back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// Make a MIG lease's instance on GPU `gpu`: the planner's steps, in
    /// order (`mig_done` with what came of them). Creating or destroying
    /// an instance takes up to seconds on a real GPU.
    Mig {
        lease: u64,
        gpu: u32,
        steps: Vec<mig::Step>,
    },
}

/// Why a MIG instance was not made, and the GPU's instances as the driver
/// then reports them (when they could be read).
pub type MigFailure = (String, Option<Vec<FoundInstance>>);

/// What came of a `Work::Mig`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDone {
    pub lease: u64,
    pub gpu: u32,
    /// GPU instances destroyed (before a failure, if any).
    pub destroyed: Vec<u32>,
    /// The instance made (GPU instance id, MIG device UUID), or why not
    /// and the GPU's instances as the driver then reports them.
    pub result: Result<(u32, String), MigFailure>,
}

/// The state a clean stop keeps for the next broker (`Broker::stop_state`).
#[derive(Debug)]
pub struct Kept {
    /// The state file's bytes.
    pub bytes: Vec<u8>,
    /// Jobs holding GPUs, waiting in the queue, and without placement.
    pub leases: usize,
    pub queued: usize,
    pub unplaced: usize,
}

/// The broker's decisions, in virtual time.
pub struct Broker {
    cfg: Config,
    /// Every open connection, what changed of them and their users'
    /// budgets.
    conns: Conns,
    /// The units of arbitration, each with its scheduler.
    gpus: Gpus,
    /// Every job, the queue, MIG instances being made, a recovery.
    ledger: Ledger,
    /// Processes, tokens, the driver's view and the MPS daemon.
    world: World,
    /// The state's changes and when it is written.
    saves: Saves,
    last_sweep: Nanos,
    /// Per user: log lines and status pages it may still cause.
    voices: Voices,
    /// Connections with something to do, in their users' lines, and the
    /// work each turn is charged.
    serving: Serving,
    /// What metrics count as it happens (`stats`).
    stats: Stats,
    /// Recent samples of status, served with it (`history.rs`).
    history: history::Ring,
    now: Nanos,
}

impl Broker {
    /// A broker for `gpus` (found through CUDA, PCI bus order) and the MIG
    /// GPUs in `planner`; `discovered`: the GPUs are the node's (a client
    /// naming another is refused).
    pub fn new(
        cfg: Config,
        gpus: Vec<crate::inventory::GpuInfo>,
        planner: mig::Planner,
        discovered: bool,
        procs: Box<dyn Procs>,
        tokens: Tokens,
        now: Nanos,
    ) -> Broker {
        let qgpus = gpus
            .iter()
            .map(|g| queue::GpuInfo {
                index: g.index,
                uuid: uuid_string(&g.uuid),
                total_mem: g.total_mem,
            })
            .collect();
        let mut queue = Queue::new(qgpus, cfg.queue);
        queue.set_mig(planner);
        // A user's series on a GPU: its part, its processes outside any
        // job, and a job per lease it may hold.
        let cfg_leases = cfg.budgets.leases;
        let mut b = Broker {
            gpus: Gpus::new(&gpus, cfg.sched, discovered),
            conns: Conns::new(cfg.budgets),
            cfg,
            ledger: Ledger::new(queue, now),
            world: World::new(procs, tokens),
            saves: Saves::default(),
            last_sweep: now,
            voices: Voices::default(),
            serving: Serving::default(),
            stats: Stats::default(),
            history: history::Ring::new(cfg_leases + 2),
            now,
        };
        // Instances found at start are units of arbitration from the
        // outset: restored jobs' processes register on them.
        for m in b.ledger.queue().mig().status() {
            for i in &m.instances {
                if let (Some(gi), Some(u)) = (i.gi, &i.uuid) {
                    b.add_mig_unit((m.gpu.index, gi), u, (&i.profile, i.mem));
                }
            }
        }
        b
    }

    /// The MPS control daemon's state (MPS mode), as the shell sees it.
    pub fn set_mps(&mut self, mps: Option<MpsStatus>) {
        self.world.set_mps(mps);
    }

    /// What the driver said of each GPU, sampled by the shell (NVML is
    /// never asked from inside the core: a slow driver must not stall
    /// grants). Status shows it until the next sample.
    pub fn telemetry(&mut self, now: Nanos, snapshot: Telemetry) {
        let now = self.clock(now);
        self.work_seen(now, &snapshot);
        self.world.set_telemetry(snapshot);
        self.outside_seen();
        self.pump(now);
    }

    /// Tells each GPU's scheduler how busy the driver saw its clients'
    /// processes (evidence of work in proportion to the time they held,
    /// `sched::evidence`). The driver counts work by process, so it is a
    /// connection's only where the connection was its process's one on
    /// that GPU since the previous sample (a shim keeps one): a process
    /// with two could lend one's work to the other, a pretender holding
    /// beside a connection that works a moment each second, or comes and
    /// goes between samples. Two passes over the connections (a lookup
    /// each, then the next span's record), a sort of those seen: the work
    /// grows with the connections the broker already bounds, not with
    /// what the driver lists.
    fn work_seen(&mut self, now: Nanos, t: &Telemetry) {
        // Each GPU's (pid, percent), as the sampler sorted them; None: not
        // reported.
        let working: Vec<Option<&[(u32, u32)]>> = self
            .gpus
            .iter()
            .map(|g| t.gpus.get(&g.uuid_str)?.working.as_deref())
            .collect();
        // Where nothing is judged, no record of who was registered is kept.
        for (g, w) in working.iter().enumerate() {
            if w.is_none() {
                self.gpus[g].since_sample = None;
            }
        }
        if working.iter().all(Option::is_none) {
            return;
        }
        // (pid, connection, percent) on each GPU whose process the driver
        // saw.
        let mut seen: Vec<Vec<(u32, ConnId, u32)>> = vec![Vec::new(); self.gpus.len()];
        for (&id, c) in self.conns.iter() {
            for d in c.devices() {
                let pid = c.peer.pid;
                let busy = working[d.gpu].and_then(|w| {
                    w.binary_search_by_key(&pid, |&(p, _)| p)
                        .ok()
                        .map(|i| w[i].1)
                });
                if let Some(pct) = busy {
                    seen[d.gpu].push((pid, id, pct));
                }
            }
        }
        for (g, mut seen) in seen.into_iter().enumerate() {
            if working[g].is_none() {
                continue;
            }
            seen.sort_unstable();
            // A process's work is evidence for its connection only where
            // that connection was its one here all the span: one that
            // came and went beside it (and worked) lends it nothing.
            let gpu = &mut self.gpus[g];
            let busy: Vec<(ConnId, u32)> = seen
                .chunk_by(|a, b| a.0 == b.0)
                .filter_map(|one| match one {
                    [(pid, id, pct)] => gpu.lone(*pid, *id).then_some((*id, *pct)),
                    _ => None,
                })
                .collect();
            gpu.sched.work_seen(now, busy);
            // The next span starts with those registered now.
            gpu.since_sample = Some(Default::default());
        }
        for (&id, c) in self.conns.iter() {
            for d in c.devices() {
                self.gpus[d.gpu].registered(c.peer.pid, id);
            }
        }
    }

    /// The UUIDs the shell's sampler asks the driver about: every GPU and
    /// MIG instance status shows utilisation or driver memory for.
    pub fn telemetry_uuids(&self) -> Vec<String> {
        self.gpus.telemetry_uuids(&self.ledger.live_mig_uuids())
    }

    fn clock(&mut self, now: Nanos) -> Nanos {
        self.now = self.now.max(now);
        self.now
    }

    /// A new connection from `peer`, as the shell found it at accept (its
    /// mark taken while a pidfd held the process). It counts against
    /// its user's connection budget from now on, and is read at its first
    /// turn (whatever it sent before the accept). Refused, with the frame
    /// to say why, past that budget.
    pub fn connect(&mut self, now: Nanos, id: ConnId, peer: Peer) -> Result<(), Vec<u8>> {
        let now = self.clock(now);
        let (pid, uid) = (peer.pid, peer.uid);
        if let Err(count) = self.conns.open(id, peer, now) {
            let mut out = Vec::new();
            wire::encode_server(
                &ServerMsg::Error {
                    code: wire::ERR_REFUSED,
                    message: format!(
                        "user {} already has {count} connections open to this broker \
                         (its limit, --max-connections-per-user); close some and retry",
                        uid
                    ),
                },
                &mut out,
            );
            self.stats.refused(uid, Refusal::ConnectionLimit);
            self.warn_uid(
                uid,
                format_args!(
                    "refusing a connection from uid {uid} (pid {pid}): {count} open, the per-user limit"
                ),
            );
            return Err(out);
        }
        tracing::debug!(pid, uid, id, "client connected");
        self.serving.push(id, uid);
        Ok(())
    }

    /// The process of `id` has exited (its pidfd said so): the connection
    /// is closed even if another process still holds its socket, so that
    /// nothing sent on it is taken for the process that gets the pid next.
    pub fn exited(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get(&id)
            && !c.dead()
        {
            tracing::debug!(pid = c.peer.pid, "the process of a connection exited");
        }
        self.kill(id);
    }

    /// The shell's poll says `id`'s socket has something for it (bytes, a
    /// hangup, an error): it gets a turn.
    pub fn readable(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id)
            && !c.dead()
        {
            c.readable = true;
            if c.awaited {
                self.serving.push_answer(id, c.peer.uid);
            } else {
                self.serving.push(id, c.peer.uid);
            }
        }
    }

    /// Whether anything asks which supplementary groups a process has
    /// (`--plugin-group`, `--high-allow` with a group, `--group-weight`):
    /// else the shell does not ask the kernel at each accept.
    pub fn reads_groups(&self) -> bool {
        self.cfg.policy.names_groups() || !self.cfg.weights.groups.is_empty()
    }

    /// Whether a connection waits for a turn: the shell then runs the next
    /// one at once, without waiting in its poll (it is edge-triggered, and
    /// would not say again what it already said).
    pub fn busy(&self) -> bool {
        self.serving.busy()
    }

    /// One turn (`turns`): each user with a ready connection has its
    /// connections served, within the user's part of the turn in work. A
    /// connection served handles the frames it has left, or else has its
    /// socket read through `io` (into the buffer given; `READ_CHUNK` at a
    /// time, at most `READ_PER_TURN` a serve and no more than its user's
    /// part has left) and what arrived handled, at the time `io` says
    /// then. A connection past a deadline is read the same way before it
    /// is closed: a deadline is the client's, not the time the broker took
    /// to read what the client had already sent.
    pub fn turn(&mut self, io: &mut impl Sockets) {
        let mut turns = self.serving.start_turn();
        turns.run(|id, left| self.serve_within(io, id, left));
        self.serving.end_turn(turns);
    }

    /// Serves `id` once, within `left` units of work.
    fn serve_within(&mut self, io: &mut impl Sockets, id: ConnId, left: u64) -> Served {
        let now = self.clock(io.now());
        if let Some(c) = self.conns.get_mut(&id) {
            c.awaited = false;
        }
        let start = self.serving.begin(left);
        if self.has_frames(id)
            || self
                .conns
                .get(&id)
                .is_some_and(|c| c.status_wait().is_some())
        {
            self.frames(now, id);
            self.pump(now);
        } else {
            self.read_from(io, id, left);
        }
        let now = self.clock(io.now());
        self.settle_overdue(now, id);
        Served {
            work: self.serving.cost().units() - start,
            more: self.has_frames(id) || self.socket_has_more(id),
        }
    }

    /// The socket may hold more for `id`, and it would take it.
    fn socket_has_more(&self, id: ConnId) -> bool {
        self.conns.get(&id).is_some_and(|c| c.readable) && self.wants_input(id)
    }

    /// Reads `id`'s socket through the shell's `read`, handling what
    /// arrives, until the socket is drained, the connection stops taking
    /// input (frames left for its next turn) or its part is read.
    fn read_from(&mut self, io: &mut impl Sockets, id: ConnId, left: u64) {
        let mut buf = self.serving.take_buf();
        let mut room = usize::try_from(left)
            .unwrap_or(usize::MAX)
            .clamp(MIN_READ, READ_PER_TURN);
        while room > 0 && self.socket_has_more(id) {
            let want = room.min(buf.len());
            let got = io.read(id, &mut buf[..want]);
            match got {
                Read::Bytes(n) | Read::Drained(n) if n > 0 => {
                    let n = n.min(want);
                    room -= n;
                    let now = self.clock(io.now());
                    self.take_in(now, id, &buf[..n]);
                    if matches!(got, Read::Drained(_))
                        && let Some(c) = self.conns.get_mut(&id)
                    {
                        c.readable = false;
                    }
                }
                Read::WouldBlock => {
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.readable = false;
                    }
                }
                Read::Bytes(_) | Read::Drained(_) | Read::Closed => {
                    if let Some(c) = self.conns.get_mut(&id) {
                        c.readable = false;
                    }
                    self.kill(id);
                }
            }
        }
        self.serving.put_buf(buf);
    }

    /// A connection the sweep found past a deadline, once what its socket
    /// held has been read: closed if it still is past it. While its socket
    /// or its held frames have more, it waits for its next serve.
    fn settle_overdue(&mut self, now: Nanos, id: ConnId) {
        let more = self.has_frames(id) || self.socket_has_more(id);
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if !c.overdue || c.dead() || more {
            return;
        }
        c.overdue = false;
        if let Some(why) = stalled(c, now) {
            tracing::debug!(
                pid = c.peer.pid,
                uid = c.peer.uid,
                why,
                "closing a stalled connection"
            );
            self.conns.kill(id);
        }
    }

    /// Bytes that arrived on `id`. Frames are handled as they complete,
    /// within one user's part of a turn in work (`serve` handles the
    /// rest); what is left unhandled counts against its user's input
    /// budget, and a user past it loses the connection that went over.
    /// (The shell's reads go through `turn`; this is for a caller that
    /// reads itself.)
    #[cfg(test)]
    pub fn input(&mut self, now: Nanos, id: ConnId, bytes: &[u8]) {
        let now = self.clock(now);
        self.serving.begin(turns::WORK_PER_TURN);
        self.take_in(now, id, bytes);
    }

    fn take_in(&mut self, now: Nanos, id: ConnId, bytes: &[u8]) {
        let Some(c) = self.conns.get(&id).filter(|c| !c.dead()) else {
            return;
        };
        let (pid, uid) = (c.peer.pid, c.peer.uid);
        if self.conns.take_in(id, bytes).is_err() {
            self.warn_uid(
                uid,
                format_args!(
                    "user {uid}'s input budget is exhausted; closing the connection of pid {pid} that went over"
                ),
            );
            return;
        }
        self.serving.charge().read += bytes.len() as u64;
        self.frames(now, id);
        self.pump(now);
    }

    /// Handles more of the frames `id` has sent, within one user's part of
    /// a turn (after `input` or a serve stopped there, or a status reply it
    /// waited for may go out).
    #[cfg(test)]
    pub fn serve(&mut self, now: Nanos, id: ConnId) {
        let now = self.clock(now);
        self.serving.begin(turns::WORK_PER_TURN);
        self.frames(now, id);
        self.pump(now);
    }

    /// Whether `id` would read more: everything it sent is handled (or
    /// waits as half a frame). While it is not, the socket is left alone,
    /// so the kernel's buffer, not the broker, holds the rest.
    pub fn wants_input(&self, id: ConnId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| !c.dead() && !c.more && c.status_wait().is_none())
    }

    /// Frames handled since the broker started.
    #[cfg(test)]
    pub fn frames_handled(&self) -> u64 {
        self.serving.cost().frames
    }

    /// The work done since the broker started, by kind (`turns::Cost`).
    #[cfg(test)]
    pub fn cost(&self) -> turns::Cost {
        self.serving.cost()
    }

    /// Grant latencies, queue waits and refusals so far, for metrics.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether `id` has frames to handle now (`serve`).
    pub fn has_frames(&self, id: ConnId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| !c.dead() && c.more && c.status_wait().is_none())
    }

    /// Handles `id`'s frames; a connection's hello and half frames change
    /// only here, so its place in `unsettled` is settled here too.
    fn frames(&mut self, now: Nanos, id: ConnId) {
        self.handle_frames(now, id);
        self.conns.settle(id);
    }

    /// Handles whole frames from the front of `id`'s input while the work
    /// done stays below `serve_until` (the first always), a held status
    /// request first. Frames are read in place and their bytes dropped
    /// once, at the end: dropping each frame's bytes from the front of
    /// the buffer moved everything behind it, per frame.
    fn handle_frames(&mut self, now: Nanos, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let uid = c.peer.uid;
        c.more = false;
        if let Some(from) = c.status_wait()
            && !self.answer_status(now, id, from)
        {
            return;
        }
        let mut start = 0;
        let mut first = true;
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.dead() || start >= c.inbuf.len() || c.status_wait().is_some() {
                break;
            }
            if !first && self.serving.spent_up() {
                c.more = true;
                break;
            }
            first = false;
            match wire::decode_client(&c.inbuf[start..]) {
                Ok((msg, used)) => {
                    start += used;
                    c.partial_since = None;
                    self.conns.handled(uid, used);
                    self.serving.charge().frames += 1;
                    self.serving.charge().decoded += used as u64;
                    self.handle(now, id, msg);
                }
                Err(DecodeError::Incomplete) => {
                    c.partial_since.get_or_insert(now);
                    break;
                }
                Err(e) => {
                    let pid = c.peer.pid;
                    self.warn_uid(
                        uid,
                        format_args!("bad frame from pid {pid} ({e}); closing that client"),
                    );
                    self.send(
                        id,
                        &ServerMsg::Error {
                            code: wire::ERR_BAD_FRAME,
                            message: format!("bad frame: {e}"),
                        },
                    );
                    self.kill(id);
                    break;
                }
            }
        }
        if let Some(c) = self.conns.get_mut(&id) {
            c.inbuf.drain(..start.min(c.inbuf.len()));
            if c.inbuf.is_empty() {
                c.partial_since = None;
            }
            if c.inbuf.capacity() > 64 << 10 && c.inbuf.len() < 4 << 10 {
                c.inbuf.shrink_to(4 << 10);
            }
        }
    }

    /// Held status requests whose users' budgets have refilled: their
    /// connections get a turn, in which the page is built (and charged to
    /// their user) and what they sent after it is handled.
    fn answer_held_status(&mut self, now: Nanos) {
        let waiting: Vec<(ConnId, u32)> = self
            .conns
            .status_waiting()
            .map(|(id, uid, _)| (id, uid))
            .collect();
        for (id, uid) in waiting {
            if self.voices.has_page(uid, now) {
                self.serving.push(id, uid);
            }
        }
    }

    /// The peer hung up, or its socket failed.
    pub fn hangup(&mut self, id: ConnId) {
        self.kill(id);
    }

    /// What is waiting to be written to `id`.
    pub fn output(&self, id: ConnId) -> &[u8] {
        self.conns.output(id)
    }

    /// `n` bytes of `output(id)` were written.
    pub fn consumed(&mut self, id: ConnId, n: usize) {
        self.conns.consumed(id, n);
    }

    /// Connections with output waiting.
    pub fn pending_output(&self) -> Vec<ConnId> {
        self.conns.pending_output().collect()
    }

    /// Connections the core is done with: the shell writes what it still
    /// can of their output, closes them and calls `remove`.
    pub fn dead(&self) -> Vec<ConnId> {
        self.conns.dead().collect()
    }

    #[cfg(test)]
    pub fn is_dead(&self, id: ConnId) -> bool {
        self.conns.get(&id).is_none_or(Conn::dead)
    }

    /// The connection is closed: its process's grant and registration go
    /// at once, a run's job ends.
    pub fn remove(&mut self, now: Nanos, id: ConnId) {
        let now = self.clock(now);
        let Some(c) = self.conns.remove(id) else {
            return;
        };
        self.stats.forget(id);
        if let Some(t) = c.member_of() {
            // Its refusals are its devices': it is no longer in `conns`.
            let mut spent = self.spent(now, &[id], c.devices().iter().map(|d| d.gpu));
            spent.ooms = c.devices().iter().map(|d| d.ooms).sum();
            let used = c.devices().iter().map(|d| d.used).sum();
            self.ledger.jobs_mut().leave(t, id, spent, used);
        }
        self.forget_client(now, id, c);
        self.pump(now);
    }

    /// The timers due at `now`, each to its part: deadlines of
    /// connections and restored jobs whose run died (`Sweep`), held status
    /// requests (`Status`), the end of a recovery (`Jobs`); the
    /// schedulers' and the queue's clocks are the pump's, which runs
    /// whatever was due, and the history's sample comes after it. The
    /// state's write is the shell's (`take_state`).
    pub fn handle_timeout(&mut self, now: Nanos) {
        let now = self.clock(now);
        let due = self.timers().due(now);
        for &t in &due {
            match t {
                Timer::Status => self.answer_held_status(now),
                Timer::Sweep => {
                    self.last_sweep = now;
                    self.sweep(now);
                }
                Timer::Jobs => self.ledger.end_recovery(now),
                Timer::Scheduler | Timer::Save | Timer::History => {}
            }
        }
        self.pump(now);
        // Sampled once what was due has been done.
        if due.contains(&Timer::History) {
            let st = self.status_brief(now);
            let queued = self.ledger.queue().waiting_count();
            self.history.record(now, &st, queued);
        }
    }

    /// Finds connections that never said hello or sat on half a frame,
    /// and ends restored jobs whose run never came back. A stalled
    /// connection is not closed here: it gets a turn, in which what its
    /// socket holds is read first (a busy broker may not have read a hello
    /// sent in time), and is closed there if it still is stalled
    /// (`settle_overdue`).
    fn sweep(&mut self, now: Nanos) {
        let unsettled: Vec<ConnId> = self.conns.unsettled().collect();
        for id in unsettled {
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            if !c.dead() && !c.overdue && stalled(c, now).is_some() {
                c.overdue = true;
                c.readable = true;
                self.serving.push(id, c.peer.uid);
            }
        }
        self.voices.forget_idle(now);
        let gone: Vec<(u64, u32)> = self
            .ledger
            .jobs()
            .without_run()
            .filter(|(_, j)| !self.world.alive(j))
            .map(|(t, j)| (*t, j.pid))
            .collect();
        // Named by the run's pid, as status names leases: the token is a
        // secret.
        for (t, pid) in gone {
            tracing::info!(
                pid,
                "a restored job's gpufrac run is gone; ending its lease"
            );
            self.end_job(now, t);
        }
    }

    /// When `handle_timeout` next has something to do.
    pub fn next_timeout(&self) -> Option<Nanos> {
        self.timers().next()
    }

    /// Each part's next deadline (`timers`).
    fn timers(&self) -> Timers {
        let now = self.now;
        let mut t = Timers::default();
        t.set(Timer::Scheduler, self.gpus.next_timeout());
        t.set(Timer::Jobs, self.ledger.next_timeout(now));
        let sweep = self.conns.any_unsettled()
            || self.ledger.jobs().without_run().next().is_some()
            || !self.voices.is_empty();
        // From the last sweep, not from now: a busy broker, whose loop
        // never sleeps a whole tick, must still sweep.
        t.set(Timer::Sweep, sweep.then_some(self.last_sweep + SWEEP_TICK));
        // A held status request: when its user's budget next refills.
        for (_, uid, _) in self.conns.status_waiting() {
            t.set(
                Timer::Status,
                Some(self.voices.next_page(uid).unwrap_or(now)),
            );
        }
        t.set(Timer::Save, self.save_due());
        t.set(Timer::History, Some(self.history.due()));
        // Overdue stays overdue: the shell then calls `handle_timeout` at
        // once (each overdue timer is one it clears).
        t
    }

    /// Work for the shell, in order.
    pub fn poll_work(&mut self) -> Option<Work> {
        self.ledger.poll_work()
    }

    /// Everything the state machines decided since the last turn.
    fn pump(&mut self, now: Nanos) {
        for g in 0..self.gpus.len() {
            if self.gpus[g].sched.next_timeout().is_some_and(|t| t <= now) {
                self.gpus[g].sched.handle_timeout(now);
            }
            while let Some(a) = self.gpus[g].sched.poll_action() {
                let uuid = self.gpus[g].uuid;
                tracing::debug!(?a, "scheduler");
                match a {
                    Action::Grant {
                        client,
                        grant,
                        slice,
                        bound,
                        waiters,
                    } => {
                        self.stats.granted(now, client, g);
                        self.send(
                            client,
                            &ServerMsg::Grant {
                                uuid,
                                grant,
                                slice_ns: slice.unwrap_or(0),
                                bound_ns: bound,
                                waiters,
                            },
                        );
                        // Its next message (most often the Release that
                        // frees the GPU) does not wait behind its own
                        // user's new connections.
                        if let Some(c) = self.conns.get_mut(&client) {
                            c.awaited = true;
                        }
                    }
                    Action::Revoke { client, grant } => {
                        self.send(client, &ServerMsg::Revoke { uuid, grant });
                        if let Some(c) = self.conns.get_mut(&client) {
                            c.awaited = true;
                        }
                    }
                }
            }
        }
        // The queue is sorted and walked only when something changed, or
        // once a tick while time alone may change its order; its places
        // are told at most once a `POSITION_TICK` (`Ledger::positions`).
        if let Some(placed) = self.ledger.poll(now) {
            for lease in placed {
                self.placed(now, lease, None);
            }
        }
        self.tell_positions(now);
    }

    /// What the shell made of a MIG lease's steps.
    pub fn mig_done(&mut self, now: Nanos, done: MigDone) {
        let now = self.clock(now);
        self.mig_made(now, done);
        self.pump(now);
    }

    /// Books what a previous broker left (leases first, then the queue in
    /// its original order) before any client is heard, so no GPU is handed
    /// out twice. Jobs whose `gpufrac run` has died are dropped. When the
    /// newest state could not be trusted, new placements are held for
    /// the recovery grace, while running jobs claim back what it lost.
    pub fn restore(&mut self, now: Nanos, loaded: crate::statefile::Loaded) {
        let now = self.clock(now);
        let world = &self.world;
        let alive = |j: &Job| world.alive(j);
        self.ledger
            .restore(now, loaded, alive, self.cfg.recovery_grace);
        self.saves.changed();
    }

    /// The state to write, if it changed and a write is due: (its number,
    /// its bytes). Report with `state_saved`.
    pub fn take_state(&mut self, now: Nanos) -> Option<(u64, Vec<u8>)> {
        let now = self.clock(now);
        if self.save_due().is_none_or(|t| t > now) {
            return None;
        }
        let seq = self.saves.start(now, self.ledger.jobs().unsaved_users());
        Some((seq, self.ledger.jobs_mut().encode()))
    }

    /// What a clean stop leaves for the next broker: the jobs whose
    /// `gpufrac run` is still alive (their leases, places in the queue and
    /// settings), to be taken back as after a crash; None when no run is
    /// alive, and nothing needs to outlive the stop. Those whose run died
    /// are left out: the next broker would drop them at once.
    pub fn stop_state(&mut self) -> Option<Kept> {
        let live: Vec<&Job> = self
            .ledger
            .jobs()
            .values()
            .filter(|j| self.world.alive(j))
            .collect();
        if live.is_empty() {
            return None;
        }
        let count = |f: fn(&Phase) -> bool| live.iter().filter(|j| f(&j.phase)).count();
        Some(Kept {
            leases: count(|p| matches!(p, Phase::Running { .. })),
            queued: count(|p| matches!(p, Phase::Queued { .. })),
            unplaced: count(|p| matches!(p, Phase::Unplaced)),
            bytes: crate::jobs::encode(live.into_iter()),
        })
    }

    /// When the next write may go (`Saves::due`), a lease its run waits
    /// for counted for its user.
    fn save_due(&self) -> Option<Nanos> {
        self.saves.due(self.ledger.jobs().unsaved_users())
    }

    /// State number `seq` was written, or could not be (then leases are
    /// told all the same: a broker that cannot write its state must still
    /// hand out what it granted; it says so).
    pub fn state_saved(&mut self, now: Nanos, seq: u64, result: Result<(), String>) {
        let now = self.clock(now);
        self.saves.done(now, seq, result);
        // Leases granted but not yet durable are told to their run once
        // the state that books them is on disk, so that a crash never
        // forgets a lease a job already holds.
        for t in self.ledger.jobs_mut().saved(seq) {
            self.tell_lease(t);
        }
        self.pump(now);
    }
}

/// Why `c` is past a deadline, if it is: it never said hello, or has sat
/// on half a frame.
fn stalled(c: &Conn, now: Nanos) -> Option<&'static str> {
    if c.role().is_none() && now.saturating_sub(c.opened) > HELLO_DEADLINE {
        Some("no hello")
    } else if c
        .partial_since
        .is_some_and(|t| now.saturating_sub(t) > FRAME_DEADLINE)
    {
        Some("half a frame")
    } else {
        None
    }
}
