//! The broker core, sans I/O (as quinn-proto is for quinn): connections'
//! bytes, credentials and disconnections go in, with the time; replies,
//! closes, timers and work for slow drivers come out. It owns the
//! protocol (framing, handshake, dispatch), who may do what
//! (`authority`), each user's budgets, jobs and their membership, leases
//! and the queue, MIG as requests to the shell, the state to persist and
//! status. /proc is behind a trait (`procs`). The shell
//! (`server.rs`) only moves bytes, arms timers and runs the work it is
//! given, so everything here is tested in virtual time (`tests/`).
//!
//! Rooms: `conn` (a connection, its role's state, its budgets), `roles`
//! (which role sends which message), `clients` (processes:
//! registration, membership, arbitration), `jobtable` (each job and all
//! that is kept of it, ended in one place), `leases` (jobs: leases, the
//! queue, restarts, recovery, MIG), `view` (status). NVML's view comes in
//! as a snapshot the shell sampled (`telemetry`), job tokens from a source
//! given at construction.

mod clients;
mod conn;
mod jobtable;
mod leases;
mod roles;
mod view;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use gpufrac_common::wire::{self, DecodeError, ServerMsg};
use tracing::warn;

use crate::authority::{Peer, Policy};
use crate::history;
use crate::jobs::Job;
use crate::mig::{self, FoundInstance};
use crate::procs::{Procs, Telemetry};

/// Where job tokens come from: random in the broker (`jobs::new_token`),
/// a fixed sequence in tests. A token names a job on the wire, so a real
/// source must be unguessable.
pub type Tokens = Box<dyn FnMut() -> u64>;
use crate::queue::{self, Queue, QueueConfig};
use crate::sched::{Action, SchedConfig, Scheduler, Weights};
use crate::stats::{Refusal, Stats};
use crate::status::MpsStatus;
use gpufrac_common::wire::uuid_string;

use conn::{Bucket, Conn, Held};
pub use conn::{Budgets, DEFAULT_MAX_CONNS_PER_USER, MAX_OUTBUF, clip, escape};

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
/// State writes at most this often: churn costs bounded I/O.
pub const SAVE_EVERY: Nanos = 100 * MS;
/// Queue escalation has no timer of its own: re-checked this often while
/// anyone waits.
const QUEUE_TICK: Nanos = 500 * MS;
/// Restored jobs whose run may have died are looked at this often.
const SWEEP_TICK: Nanos = 250 * MS;
/// Warnings a client can provoke are said at most this often.
pub const WARN_EVERY: Nanos = 10_000 * MS;
/// GPUs the broker arbitrates for clients when it found none itself.
const MAX_UNKNOWN_GPUS: usize = 16;
/// Frames handled per connection per turn: a connection with more waits
/// for the next turn, after every other ready connection has had its own.
pub const FRAMES_PER_TURN: usize = 64;
/// Status pages built for one user: this many at once, then one per
/// `STATUS_EVERY`. A page costs a walk over every connection; a user
/// asking faster waits (its other requests too, so replies keep their
/// order), and nobody else does.
const STATUS_BURST: u32 = 16;
const STATUS_EVERY: Nanos = 20 * MS;
/// Log lines one user's connections can cause: this many at once, then
/// one per `LOG_EVERY`; what is held back is counted and said.
const LOG_BURST: u32 = 64;
const LOG_EVERY: Nanos = 100 * MS;

/// What one user may still make the broker say and build: its log lines
/// and warnings, its status pages. Kept apart from `Held` (which goes
/// with the user's last connection) so that connecting anew does not
/// refill it.
#[derive(Debug)]
struct Voice {
    lines: Bucket,
    held_back: u64,
    warning: RateLimit,
    status: Bucket,
}

impl Voice {
    fn new(now: Nanos) -> Voice {
        Voice {
            lines: Bucket::full(LOG_BURST, now),
            held_back: 0,
            warning: RateLimit::new(WARN_EVERY),
            status: Bucket::full(STATUS_BURST, now),
        }
    }

    /// Nothing to remember: a fresh one would be the same.
    fn idle(&self, now: Nanos) -> bool {
        self.held_back == 0
            && self
                .warning
                .last
                .is_none_or(|t| now.saturating_sub(t) > WARN_EVERY)
            && self.lines.is_full(now, LOG_BURST, LOG_EVERY)
            && self.status.is_full(now, STATUS_BURST, STATUS_EVERY)
    }
}

/// Something said at most once per period: warnings a client (or a flood
/// of them) can provoke must not flood the log too.
#[derive(Debug)]
pub struct RateLimit {
    every: Nanos,
    last: Option<Nanos>,
}

impl RateLimit {
    pub const fn new(every: Nanos) -> Self {
        RateLimit { every, last: None }
    }

    /// True, once per period: say it now.
    pub fn ready(&mut self, now: Nanos) -> bool {
        let ready = self.last.is_none_or(|t| now.saturating_sub(t) > self.every);
        if ready {
            self.last = Some(now);
        }
        ready
    }
}

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

/// A GPU, or a MIG instance, as a unit of arbitration.
struct Gpu {
    index: Option<u32>,
    uuid: [u8; 16],
    uuid_str: String,
    name: String,
    total_mem: u64,
    sched: Scheduler,
    /// A MIG instance (`--mig dynamic`): the index of its GPU and its GPU
    /// instance id.
    mig: Option<(u32, u32)>,
}

/// The broker's decisions, in virtual time.
pub struct Broker {
    cfg: Config,
    conns: BTreeMap<ConnId, Conn>,
    held: HashMap<u32, Held>,
    gpus: Vec<Gpu>,
    /// The broker found GPUs itself: a client naming another is refused.
    discovered: bool,
    queue: Queue,
    /// Every job, by token, with everything kept of it.
    jobs: jobtable::Jobs,
    procs: Box<dyn Procs>,
    tokens: Tokens,
    /// The driver's view, as the shell last sampled it (`telemetry`).
    telemetry: Telemetry,
    mps: Option<MpsStatus>,
    /// State: changes counted, the last count handed out to be written
    /// and the last known written, and when the last write was handed out.
    state_seq: u64,
    saving: Option<u64>,
    saved_seq: u64,
    last_save: Option<Nanos>,
    work: VecDeque<Work>,
    /// MIG leases being made: the connection of a `--no-wait` request,
    /// which is answered either way.
    making: BTreeMap<u64, leases::Making>,
    /// After an untrusted state file: placements held until then, and why.
    recovery: Option<(Nanos, String)>,
    last_sweep: Nanos,
    /// Connections past a deadline, for the shell to read once more before
    /// `expire` decides: a deadline is the client's, not the time the
    /// broker took to read what the client had already sent.
    overdue: Vec<ConnId>,
    warnings: RateLimit,
    /// Per user: log lines, warnings and status pages it may still cause.
    voices: HashMap<u32, Voice>,
    /// Connections whose held-back input may be handled again (a status
    /// reply they waited for went out): the shell serves them next turn.
    unblocked: Vec<ConnId>,
    /// What changed, kept as it changes so that each turn's work is
    /// proportional to it, not to every connection: connections closed
    /// (`dead`), with output waiting (`pending_output`), and holding a
    /// status request back (`answer_held_status`).
    closing: BTreeSet<ConnId>,
    unsent: BTreeSet<ConnId>,
    status_held: BTreeSet<ConnId>,
    /// Connections that have not said hello or sit on half a frame: those
    /// the sweep looks at for deadlines.
    unsettled: BTreeSet<ConnId>,
    /// The queue changed since it was last polled (a request, a release, a
    /// run attached to its job, the end of a recovery): `pump` polls it
    /// then, and every `QUEUE_TICK` after `queue_polled` (escalation and
    /// idle MIG instances change with time alone).
    queue_dirty: bool,
    /// Frames handled so far (`frames_handled`).
    frames_handled: u64,
    /// What metrics count as it happens (`stats`).
    stats: Stats,
    queue_polled: Nanos,
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
            gpus: gpus
                .iter()
                .map(|g| Gpu {
                    index: Some(g.index),
                    uuid: g.uuid,
                    uuid_str: uuid_string(&g.uuid),
                    name: g.name.clone(),
                    total_mem: g.total_mem,
                    sched: Scheduler::new(cfg.sched),
                    mig: None,
                })
                .collect(),
            cfg,
            conns: BTreeMap::new(),
            held: HashMap::new(),
            discovered,
            queue,
            jobs: jobtable::Jobs::default(),
            procs,
            tokens,
            telemetry: Telemetry::default(),
            mps: None,
            state_seq: 0,
            saving: None,
            saved_seq: 0,
            last_save: None,
            work: VecDeque::new(),
            making: BTreeMap::new(),
            recovery: None,
            last_sweep: now,
            overdue: Vec::new(),
            warnings: RateLimit::new(WARN_EVERY),
            voices: HashMap::new(),
            unblocked: Vec::new(),
            closing: BTreeSet::new(),
            unsent: BTreeSet::new(),
            status_held: BTreeSet::new(),
            unsettled: BTreeSet::new(),
            queue_dirty: true,
            frames_handled: 0,
            stats: Stats::default(),
            queue_polled: now,
            history: history::Ring::new(cfg_leases + 2),
            now,
        };
        // Instances found at start are units of arbitration from the
        // outset: restored jobs' processes register on them.
        for m in b.queue.mig().status() {
            for i in &m.instances {
                if let (Some(gi), Some(u)) = (i.gi, &i.uuid) {
                    b.add_mig_unit(m.gpu.index, gi, u, &i.profile, i.mem);
                }
            }
        }
        b
    }

    /// The MPS control daemon's state (MPS mode), as the shell sees it.
    pub fn set_mps(&mut self, mps: Option<MpsStatus>) {
        self.mps = mps;
    }

    /// What the driver said of each GPU, sampled by the shell (NVML is
    /// never asked from inside the core: a slow driver must not stall
    /// grants). Status shows it until the next sample.
    pub fn telemetry(&mut self, now: Nanos, snapshot: Telemetry) {
        self.clock(now);
        self.telemetry = snapshot;
    }

    /// The UUIDs the shell's sampler asks the driver about: every GPU and
    /// MIG instance status shows utilisation or driver memory for.
    pub fn telemetry_uuids(&self) -> Vec<String> {
        let live = self.live_mig_uuids();
        self.gpus
            .iter()
            .filter(|g| g.mig.is_none() || live.contains(&g.uuid_str))
            .map(|g| g.uuid_str.clone())
            .collect()
    }

    /// A token for a new job: never 0 (which means "none" on the wire) nor
    /// another job's.
    fn new_token(&mut self) -> u64 {
        loop {
            let t = (self.tokens)();
            if t != 0 && !self.jobs.contains_key(&t) {
                return t;
            }
        }
    }

    fn clock(&mut self, now: Nanos) -> Nanos {
        self.now = self.now.max(now);
        self.now
    }

    /// A warning a client can provoke, at most every `WARN_EVERY`: a flood
    /// must not also flood the log.
    fn warn_limited(&mut self, msg: std::fmt::Arguments<'_>) {
        if self.warnings.ready(self.now) {
            warn!("{msg}");
        }
    }

    fn voice(&mut self, uid: u32) -> &mut Voice {
        let now = self.now;
        self.voices.entry(uid).or_insert_with(|| Voice::new(now))
    }

    /// A warning user `uid`'s connections provoked, at most every
    /// `WARN_EVERY` per user: one user's flood neither floods the log nor
    /// silences the warnings about anyone else.
    pub(super) fn warn_uid(&mut self, uid: u32, msg: std::fmt::Arguments<'_>) {
        let now = self.now;
        if self.voice(uid).warning.ready(now) {
            warn!("{msg}");
        }
    }

    /// Whether a log line user `uid`'s connections caused may be written
    /// now (its per-user line budget); lines held back are counted and
    /// said with the next line let through.
    pub(super) fn may_log(&mut self, uid: u32) -> bool {
        let now = self.now;
        let v = self.voice(uid);
        if !v.lines.take(now, LOG_BURST, LOG_EVERY) {
            v.held_back += 1;
            return false;
        }
        let held = std::mem::take(&mut v.held_back);
        if held > 0 {
            tracing::info!(
                "{held} log lines about uid {uid}'s connections were left out (its log budget)"
            );
        }
        true
    }

    /// The command line of `id`'s process, looked up once, when first
    /// needed (a registration, a lease), never at accept. Kept only if the
    /// process still is the one accepted: else the pid is another's.
    pub(super) fn look_up_command(&mut self, id: ConnId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        if c.command_read || !c.command.is_empty() {
            return;
        }
        let (pid, start) = (c.peer.pid, c.peer.start_time);
        let command = self.procs.cmdline(pid);
        let same = start.is_some() && self.procs.start_time(pid) == start;
        let label = self.cfg.budgets.label;
        if let Some(c) = self.conns.get_mut(&id) {
            c.command_read = true;
            if same {
                c.command = clip(&command, label);
            }
        }
    }

    /// A new connection from `peer`, as the shell found it at accept (its
    /// start time read while a pidfd held the process). It counts against
    /// its user's connection budget from now on. Refused, with the frame to
    /// say why, past that budget.
    pub fn connect(&mut self, now: Nanos, id: ConnId, peer: Peer) -> Result<(), Vec<u8>> {
        let now = self.clock(now);
        let count = self.held.get(&peer.uid).map_or(0, |h| h.conns);
        if count >= self.cfg.budgets.connections {
            let mut out = Vec::new();
            wire::encode_server(
                &ServerMsg::Error {
                    code: wire::ERR_REFUSED,
                    message: format!(
                        "user {} already has {count} connections open to this broker \
                         (its limit, --max-connections-per-user); close some and retry",
                        peer.uid
                    ),
                },
                &mut out,
            );
            self.stats.refused(Refusal::ConnectionLimit);
            self.warn_uid(
                peer.uid,
                format_args!(
                    "refusing a connection from uid {} (pid {}): {count} open, the per-user limit",
                    peer.uid, peer.pid
                ),
            );
            return Err(out);
        }
        self.held.entry(peer.uid).or_default().conns += 1;
        tracing::debug!(pid = peer.pid, uid = peer.uid, id, "client connected");
        self.conns.insert(id, Conn::new(peer, now, String::new()));
        self.unsettled.insert(id);
        Ok(())
    }

    /// The process of `id` has exited (its pidfd said so): the connection
    /// is closed even if another process still holds its socket, so that
    /// nothing sent on it is taken for the process that gets the pid next.
    pub fn exited(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get(&id)
            && !c.dead
        {
            tracing::debug!(pid = c.peer.pid, "the process of a connection exited");
        }
        self.kill(id);
    }

    /// Bytes that arrived on `id`. Frames are handled as they complete,
    /// at most `FRAMES_PER_TURN` now (`serve` handles the rest, next
    /// turn); what is left unhandled counts against its user's input
    /// budget, and a user past it loses the connection that went over.
    pub fn input(&mut self, now: Nanos, id: ConnId, bytes: &[u8]) {
        let now = self.clock(now);
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.dead {
            return;
        }
        let uid = c.peer.uid;
        let h = self.held.entry(uid).or_default();
        if h.input + bytes.len() > self.cfg.budgets.input {
            let pid = c.peer.pid;
            c.dead = true;
            self.closing.insert(id);
            self.warn_uid(
                uid,
                format_args!(
                    "user {uid}'s input budget is exhausted; closing the connection of pid {pid} that went over"
                ),
            );
            return;
        }
        h.input += bytes.len();
        c.inbuf.extend_from_slice(bytes);
        self.frames(now, id);
        self.pump(now);
    }

    /// Handles up to `FRAMES_PER_TURN` more of the frames `id` has sent
    /// (after `input` or `serve` stopped at that budget, or a status reply
    /// it waited for went out).
    pub fn serve(&mut self, now: Nanos, id: ConnId) {
        let now = self.clock(now);
        self.frames(now, id);
        self.pump(now);
    }

    /// Whether the shell should read more from `id`: everything it sent is
    /// handled (or waits as half a frame). While it is not, the socket is
    /// left alone, so the kernel's buffer, not the broker, holds the rest.
    pub fn wants_input(&self, id: ConnId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| !c.dead && !c.more && c.status_wait().is_none())
    }

    /// Frames handled since the broker started: what the shell charges a
    /// user's turn with.
    pub fn frames_handled(&self) -> u64 {
        self.frames_handled
    }

    /// Grant latencies, queue waits and refusals so far, for metrics.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether `id` has frames to handle now (`serve`).
    pub fn has_frames(&self, id: ConnId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| !c.dead && c.more && c.status_wait().is_none())
    }

    /// Connections that waited for a status reply and got it: their input
    /// may be handled again.
    pub fn take_unblocked(&mut self) -> Vec<ConnId> {
        std::mem::take(&mut self.unblocked)
    }

    /// Handles `id`'s frames; a connection's hello and half frames change
    /// only here, so its place in `unsettled` is settled here too.
    fn frames(&mut self, now: Nanos, id: ConnId) {
        self.handle_frames(now, id);
        match self.conns.get(&id) {
            Some(c) if c.role().is_none() || c.partial_since.is_some() => {
                self.unsettled.insert(id);
            }
            _ => {
                self.unsettled.remove(&id);
            }
        }
    }

    fn handle_frames(&mut self, now: Nanos, id: ConnId) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let uid = c.peer.uid;
        c.more = false;
        let mut handled = 0;
        loop {
            let Some(c) = self.conns.get_mut(&id) else {
                return;
            };
            if c.dead || c.inbuf.is_empty() || c.status_wait().is_some() {
                if c.inbuf.is_empty() {
                    c.partial_since = None;
                }
                break;
            }
            if handled == FRAMES_PER_TURN {
                c.more = true;
                break;
            }
            match wire::decode_client(&c.inbuf) {
                Ok((msg, used)) => {
                    c.inbuf.drain(..used);
                    c.partial_since = None;
                    if c.inbuf.capacity() > 64 << 10 && c.inbuf.len() < 4 << 10 {
                        c.inbuf.shrink_to(4 << 10);
                    }
                    if let Some(h) = self.held.get_mut(&uid) {
                        h.input = h.input.saturating_sub(used);
                    }
                    handled += 1;
                    self.frames_handled += 1;
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
    }

    /// A `Status` request: answered now if its user's status budget
    /// allows, else held (with everything after it on the connection)
    /// until the budget refills (`handle_timeout`).
    pub(super) fn ask_status(&mut self, now: Nanos, id: ConnId, from: u32) {
        let Some(uid) = self.conns.get(&id).map(|c| c.peer.uid) else {
            return;
        };
        if self.voice(uid).status.take(now, STATUS_BURST, STATUS_EVERY) {
            let json = self.status_json(now, from as usize);
            self.send(id, &ServerMsg::StatusReply { json });
        } else if let Some(c) = self.conns.get_mut(&id).and_then(|c| c.cli_mut()) {
            c.status_wait = Some(from);
            self.status_held.insert(id);
        }
    }

    /// Answers held status requests whose users' budgets have refilled,
    /// one connection after another from where the last round stopped.
    fn answer_held_status(&mut self, now: Nanos) {
        let waiting: Vec<(ConnId, u32, u32)> = self
            .status_held
            .iter()
            .filter_map(|id| self.conns.get(id).map(|c| (*id, c)))
            .filter(|(_, c)| !c.dead)
            .filter_map(|(id, c)| c.status_wait().map(|f| (id, c.peer.uid, f)))
            .collect();
        for (id, uid, from) in waiting {
            if !self.voice(uid).status.take(now, STATUS_BURST, STATUS_EVERY) {
                continue;
            }
            let json = self.status_json(now, from as usize);
            if let Some(c) = self.conns.get_mut(&id) {
                if let Some(cli) = c.cli_mut() {
                    cli.status_wait = None;
                }
                self.status_held.remove(&id);
                // What it sent after the request is handled next turn,
                // within the turn's budget.
                c.more = true;
            }
            self.send(id, &ServerMsg::StatusReply { json });
            self.unblocked.push(id);
        }
    }

    /// The peer hung up, or its socket failed.
    pub fn hangup(&mut self, id: ConnId) {
        self.kill(id);
    }

    fn kill(&mut self, id: ConnId) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.dead = true;
            self.closing.insert(id);
        }
    }

    /// What is waiting to be written to `id`.
    pub fn output(&self, id: ConnId) -> &[u8] {
        self.conns.get(&id).map_or(&[], |c| &c.outbuf)
    }

    /// `n` bytes of `output(id)` were written.
    pub fn consumed(&mut self, id: ConnId, n: usize) {
        if let Some(c) = self.conns.get_mut(&id) {
            let n = n.min(c.outbuf.len());
            c.outbuf.drain(..n);
            if c.outbuf.is_empty() {
                self.unsent.remove(&id);
                if c.outbuf.capacity() > 64 << 10 {
                    c.outbuf = Vec::new();
                }
            }
            if let Some(h) = self.held.get_mut(&c.peer.uid) {
                h.output = h.output.saturating_sub(n);
            }
        }
    }

    /// Connections with output waiting.
    pub fn pending_output(&self) -> Vec<ConnId> {
        self.unsent.iter().copied().collect()
    }

    /// Connections the core is done with: the shell writes what it still
    /// can of their output, closes them and calls `remove`.
    pub fn dead(&self) -> Vec<ConnId> {
        self.closing.iter().copied().collect()
    }

    pub fn is_dead(&self, id: ConnId) -> bool {
        self.conns.get(&id).is_none_or(|c| c.dead)
    }

    /// The connection is closed: its process's grant and registration go
    /// at once, a run's job ends.
    pub fn remove(&mut self, now: Nanos, id: ConnId) {
        let now = self.clock(now);
        let Some(c) = self.conns.remove(&id) else {
            return;
        };
        self.closing.remove(&id);
        self.unsent.remove(&id);
        self.status_held.remove(&id);
        self.unsettled.remove(&id);
        self.stats.forget(id);
        if let Some(t) = c.member_of() {
            self.jobs.leave(t, id);
        }
        if let Some(h) = self.held.get_mut(&c.peer.uid) {
            h.conns = h.conns.saturating_sub(1);
            h.input = h.input.saturating_sub(c.inbuf.len());
            h.output = h.output.saturating_sub(c.outbuf.len());
            if h.conns == 0 {
                self.held.remove(&c.peer.uid);
            }
        }
        self.forget_client(now, id, c);
        self.pump(now);
    }

    /// Timers: deadlines of connections, restored jobs whose run died,
    /// the end of a recovery, the schedulers' and the queue's clocks.
    pub fn handle_timeout(&mut self, now: Nanos) {
        let now = self.clock(now);
        self.answer_held_status(now);
        if now.saturating_sub(self.last_sweep) >= SWEEP_TICK {
            self.last_sweep = now;
            self.sweep(now);
        }
        self.end_recovery(now);
        self.pump(now);
        if now >= self.history.due() {
            let st = self.status(now);
            self.history.record(now, &st);
        }
    }

    /// Connections past a deadline: the shell reads each once more, then
    /// calls `expire` for it.
    pub fn take_overdue(&mut self) -> Vec<ConnId> {
        std::mem::take(&mut self.overdue)
    }

    /// Closes `id` if, with everything its socket held now read, it is
    /// still past its deadline.
    pub fn expire(&mut self, now: Nanos, id: ConnId) {
        let now = self.clock(now);
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.dead {
            return;
        }
        if let Some(why) = stalled(c, now) {
            tracing::debug!(
                pid = c.peer.pid,
                uid = c.peer.uid,
                why,
                "closing a stalled connection"
            );
            c.dead = true;
            self.closing.insert(id);
        }
    }

    /// Finds connections that never said hello or sat on half a frame,
    /// and ends restored jobs whose run never came back. A stalled
    /// connection is not closed here: the shell first reads what its
    /// socket holds (a busy broker may not have read a hello sent in
    /// time), then calls `expire`.
    fn sweep(&mut self, now: Nanos) {
        for &id in &self.unsettled {
            let Some(c) = self.conns.get(&id) else {
                continue;
            };
            if !c.dead && stalled(c, now).is_some() && !self.overdue.contains(&id) {
                self.overdue.push(id);
            }
        }
        self.voices.retain(|_, v| !v.idle(now));
        let gone: Vec<(u64, u32)> = self
            .jobs
            .without_run()
            .filter(|(_, j)| !self.alive(j))
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
        let now = self.now;
        let mut t = self
            .gpus
            .iter()
            .filter_map(|g| g.sched.next_timeout())
            .min();
        let mut at = |x: Nanos| t = Some(t.map_or(x, |y| y.min(x)));
        if self.queue.has_waiting() {
            at(if self.queue_dirty {
                now
            } else {
                self.queue_polled + QUEUE_TICK
            });
        }
        let sweep = self
            .unsettled
            .iter()
            .any(|id| self.conns.get(id).is_some_and(|c| !c.dead))
            || self.jobs.without_run().next().is_some()
            || !self.voices.is_empty();
        // From the last sweep, not from now: a busy broker, whose loop
        // never sleeps a whole tick, must still sweep.
        if sweep {
            at(self.last_sweep + SWEEP_TICK);
        }
        if let Some((until, _)) = &self.recovery {
            at(*until);
        }
        // A held status request: when its user's budget next refills.
        for c in self.status_held.iter().filter_map(|id| self.conns.get(id)) {
            if !c.dead && c.status_wait().is_some() {
                let v = self.voices.get(&c.peer.uid);
                at(v.map_or(now, |v| v.status.next(STATUS_EVERY)));
            }
        }
        if let Some(s) = self.save_due() {
            at(s);
        }
        at(self.history.due());
        // Overdue stays overdue: the shell then calls `handle_timeout` at
        // once (each overdue timer is one it clears).
        t
    }

    /// Work for the shell, in order.
    pub fn poll_work(&mut self) -> Option<Work> {
        self.work.pop_front()
    }

    fn send(&mut self, id: ConnId, msg: &ServerMsg) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.dead {
            return;
        }
        let before = c.outbuf.len();
        wire::encode_server(msg, &mut c.outbuf);
        let added = c.outbuf.len() - before;
        if added > 0 {
            self.unsent.insert(id);
        }
        let h = self.held.entry(c.peer.uid).or_default();
        h.output += added;
        let (pid, uid) = (c.peer.pid, c.peer.uid);
        if c.outbuf.len() > MAX_OUTBUF {
            c.dead = true;
            self.closing.insert(id);
            self.warn_uid(
                uid,
                format_args!(
                    "pid {pid} (uid {uid}) is not reading what it asked for; disconnecting it"
                ),
            );
        } else if h.output > self.cfg.budgets.output {
            c.dead = true;
            self.closing.insert(id);
            self.warn_uid(
                uid,
                format_args!(
                    "user {uid}'s output budget is exhausted (its connections are not reading); \
                     closing the connection of pid {pid} that went over"
                ),
            );
        }
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
                        )
                    }
                    Action::Revoke { client, grant } => {
                        self.send(client, &ServerMsg::Revoke { uuid, grant })
                    }
                }
            }
        }
        // The queue is sorted and walked only when something changed, or
        // once a tick while time alone may change its order.
        let due = self.queue_dirty || now >= self.queue_polled + QUEUE_TICK;
        if due {
            self.queue_dirty = false;
            self.queue_polled = now;
            if self.placing(now) {
                for lease in self.queue.poll(now) {
                    self.placed(now, lease, None);
                }
            }
            self.tell_positions(now);
        }
    }

    /// The queue, to change it: it is polled again at the next `pump`.
    fn queue_mut(&mut self) -> &mut Queue {
        self.queue_dirty = true;
        &mut self.queue
    }

    /// The state to write, if it changed and a write is due: (its number,
    /// its bytes). Report with `state_saved`.
    pub fn take_state(&mut self, now: Nanos) -> Option<(u64, Vec<u8>)> {
        let now = self.clock(now);
        if self.save_due().is_none_or(|t| t > now) {
            return None;
        }
        self.saving = Some(self.state_seq);
        self.last_save = Some(now);
        Some((self.state_seq, crate::jobs::encode(self.jobs.values())))
    }

    /// When the next write may go: None while nothing changed or one is
    /// being written.
    fn save_due(&self) -> Option<Nanos> {
        if self.saving.is_some() || self.state_seq == self.saved_seq {
            return None;
        }
        Some(self.last_save.map_or(0, |t| t + SAVE_EVERY))
    }

    /// State number `seq` was written, or could not be (then leases are
    /// told all the same: a broker that cannot write its state must still
    /// hand out what it granted; it says so).
    pub fn state_saved(&mut self, now: Nanos, seq: u64, result: Result<(), String>) {
        let now = self.clock(now);
        self.saving = None;
        match result {
            Ok(()) => self.saved_seq = self.saved_seq.max(seq),
            Err(e) => self.warn_limited(format_args!(
                "cannot write the state file: {e}; leases will not survive a restart"
            )),
        }
        // Leases granted but not yet durable are told to their run once
        // the state that books them is on disk, so that a crash never
        // forgets a lease a job already holds.
        for t in self.jobs.saved(seq) {
            self.tell_lease(t);
        }
        self.pump(now);
    }

    fn changed(&mut self) {
        self.state_seq += 1;
    }

    /// Whether a job's `gpufrac run` is still the process that asked.
    fn alive(&self, j: &Job) -> bool {
        self.procs.start_time(j.pid) == Some(j.start_time)
    }

    fn sched_cfg(&self) -> SchedConfig {
        self.cfg.sched
    }

    fn gpu_by_uuid(&mut self, uuid: &[u8; 16], total: u64) -> usize {
        if let Some(i) = self.gpus.iter().position(|g| &g.uuid == uuid) {
            return i;
        }
        // A device the broker itself cannot see (hidden from it, or it runs
        // without a driver): arbitrate it all the same, by UUID.
        let cfg = self.sched_cfg();
        self.gpus.push(Gpu {
            index: None,
            uuid: *uuid,
            uuid_str: uuid_string(uuid),
            name: "unknown".into(),
            total_mem: total,
            sched: Scheduler::new(cfg),
            mig: None,
        });
        self.gpus.len() - 1
    }

    /// MIG devices of the instances that exist now.
    fn live_mig_uuids(&self) -> Vec<String> {
        self.queue
            .mig()
            .status()
            .into_iter()
            .flat_map(|g| g.instances.into_iter().filter_map(|i| i.uuid))
            .collect()
    }

    /// A MIG instance becomes a unit of arbitration, so that its processes
    /// (registering with its MIG device UUID) are known. The entry of an
    /// instance that is gone, and that no process names any more, is
    /// reused: entries stay bounded by the instances a node can hold.
    fn add_mig_unit(&mut self, parent: u32, gi: u32, uuid: &str, profile: &str, mem: u64) {
        let Some(bytes) = wire::parse_uuid(uuid) else {
            warn!(
                gpu = parent,
                gi,
                "MIG device {uuid} has a UUID of the old form (driver before R470); its processes cannot register with the broker"
            );
            return;
        };
        if self.gpus.iter().any(|g| g.uuid == bytes) {
            return;
        }
        let unit = Gpu {
            index: Some(parent),
            uuid: bytes,
            uuid_str: uuid.to_owned(),
            name: format!("MIG {profile} (GPU {parent}, GPU instance {gi})"),
            total_mem: mem,
            sched: Scheduler::new(self.sched_cfg()),
            mig: Some((parent, gi)),
        };
        let live = self.live_mig_uuids();
        let stale = (0..self.gpus.len()).find(|&i| {
            self.gpus[i].mig.is_some()
                && !live.contains(&self.gpus[i].uuid_str)
                && !self
                    .conns
                    .values()
                    .any(|c| c.devices().iter().any(|d| d.gpu == i))
        });
        match stale {
            Some(i) => self.gpus[i] = unit,
            None => self.gpus.push(unit),
        }
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
