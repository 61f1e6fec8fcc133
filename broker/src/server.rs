//! The broker daemon: a thin socket layer around the scheduler and queue
//! state machines. One thread, one mio event loop; every client socket is
//! non-blocking with its own bounded output buffer, so a slow or stuck
//! client can only lose its own connection, never stall the others.

use crate::inventory::{self, Nvml};
use crate::jobs::{self, Job, Phase, StateFile};
use crate::mig::{self, Step, Use};
use crate::mig_nvml::{MigDriver, NvmlMig};
use crate::queue::{self, Pinned, Placement, Queue, QueueConfig, Want};
use crate::sched::{Action, ClientState, GroupId, Priority, SchedConfig, Scheduler};
use crate::status::{GpuStatus, LeaseEntry, ProcStatus, QueueEntry, Status};
use gpufrac_common::size::format_size;
use gpufrac_common::wire::{
    self, ClientMsg, DecodeError, Role, ServerMsg, parse_uuid, uuid_string,
};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub socket: PathBuf,
    /// Contended timeslice between busy processes of one class, ns
    /// (default 20 ms).
    pub timeslice: u64,
    /// Most unfinished work a holder may keep queued while others share its
    /// GPU, ns (default 250 µs; 0: unbounded).
    pub inflight: u64,
    /// Group that may use the socket (mode 0660).
    pub group: Option<String>,
    /// Address for Prometheus metrics over HTTP, e.g. 127.0.0.1:9400.
    pub metrics: Option<String>,
    /// Queue escalation age, ns (default 1 h).
    pub escalate_after: u64,
    /// Logical GPUs per physical GPU (default 1).
    pub overprovision: u32,
    /// Allow committed memory beyond physical.
    pub overcommit: bool,
    /// Place fractions on the emptiest GPU instead of best fit.
    pub spread: bool,
    /// Most connections one user may hold open at once.
    pub max_conns_per_user: usize,
    /// Where leases and the queue are kept across restarts (default: next
    /// to the socket, `<socket>.state`).
    pub state: Option<PathBuf>,
    /// Run NVIDIA MPS for the GPUs: jobs share the SMs at once.
    pub mps: bool,
    /// What to do with GPUs in MIG mode.
    pub mig: MigMode,
}

/// How the broker uses GPUs in MIG mode (docs/mig.md). It never changes a
/// GPU's MIG mode: that resets the GPU and is the administrator's call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MigMode {
    /// Not at all: CUDA shows no device for such a GPU, and the broker
    /// says so at start.
    #[default]
    Off,
    /// `--mig dynamic`: `gpufrac run --gpu-memory` jobs get MIG instances
    /// made for them (the smallest profile that fits), kept idle after the
    /// job for the next one, and destroyed only when their room is needed.
    Dynamic,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions {
            socket: gpufrac_common::config::DEFAULT_SOCKET.into(),
            timeslice: SchedConfig::default().timeslice,
            inflight: SchedConfig::default().bound,
            group: None,
            metrics: None,
            escalate_after: 3600 * 1_000_000_000,
            overprovision: 1,
            overcommit: false,
            spread: false,
            max_conns_per_user: DEFAULT_MAX_CONNS_PER_USER,
            state: None,
            mps: false,
            mig: MigMode::Off,
        }
    }
}

pub const DEFAULT_MAX_CONNS_PER_USER: usize = 256;
/// A connection must say hello within this, and finish any frame it
/// starts within `FRAME_DEADLINE`: idle or trickling connections cannot
/// pile up.
const HELLO_DEADLINE: Duration = Duration::from_secs(2);
const FRAME_DEADLINE: Duration = Duration::from_secs(5);
/// Unread client input across all connections.
const INPUT_BUDGET: usize = 64 << 20;
/// Processes listed per status page; a page's JSON stays far below the
/// frame limit (a process entry is a few hundred bytes).
const STATUS_PAGE: usize = 1000;
/// GPUs the broker arbitrates for clients when it found none itself.
const MAX_UNKNOWN_GPUS: usize = 16;
/// Fairness units: a job's is its token, a user's its uid (tagged).
const UID_UNIT: GroupId = 1 << 63;

/// A client whose unsent output grows past this is not reading: drop it.
const MAX_OUTBUF: usize = 4 << 20;
/// Weight of a process that set no GPU_COMPUTE_SHARE: as if it asked 50%,
/// so two such processes split evenly and every share is a plain weight.
pub const DEFAULT_WEIGHT: f64 = 50.0;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const FIRST_CLIENT: usize = 2;

static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe.
        unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) };
    }
}

struct ClientDev {
    gpu: usize,
    ordinal: u32,
    cap: u64,
    used: u64,
    peak: u64,
    ooms: u64,
}

struct Conn {
    stream: UnixStream,
    id: u64,
    pid: u32,
    uid: u32,
    opened: Instant,
    /// An unfinished frame has been waiting since then.
    partial_since: Option<Instant>,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    role: Option<Role>,
    command: String,
    devices: Vec<ClientDev>,
    share: Option<f64>,
    limit: Option<f64>,
    priority: Priority,
    /// The job (token) this connection is the `gpufrac run` of.
    job: Option<u64>,
    /// The job this process belongs to (it descends from the job's run, or
    /// holds its token).
    member_of: Option<u64>,
    /// The job token a process sent in `Join` (a container's process, which
    /// does not descend from its job's run).
    claimed_job: Option<u64>,
    /// It has sent `Register` (and been answered).
    registered: bool,
    /// Queue position last told to a waiting `gpufrac run`.
    queued: Option<u32>,
    dead: bool,
    /// Registered for writability (output pending).
    want_write: bool,
}

struct Gpu {
    index: Option<u32>,
    uuid: [u8; 16],
    uuid_str: String,
    name: String,
    total_mem: u64,
    sched: Scheduler,
    /// A MIG instance (`--mig dynamic`), arbitrated like a GPU of its own:
    /// the index of its GPU and its GPU instance id.
    mig: Option<(u32, u32)>,
}

struct Server {
    opts: BrokerOptions,
    poll: Poll,
    listener: UnixListener,
    conns: HashMap<Token, Conn>,
    by_id: HashMap<u64, Token>,
    gpus: Vec<Gpu>,
    queue: Queue,
    nvml: Nvml,
    next_token: usize,
    metrics: Option<Arc<Mutex<String>>>,
    last_metrics: Instant,
    readbuf: Vec<u8>,
    /// Every `gpufrac run`, by token; saved to `state` after each change.
    jobs: std::collections::BTreeMap<u64, Job>,
    job_conn: HashMap<u64, Token>,
    leased_at: HashMap<u64, Instant>,
    state: Option<StateFile>,
    dirty: bool,
    /// The broker found GPUs itself: a client naming another is refused.
    discovered: bool,
    per_uid: HashMap<u32, usize>,
    inbuf_total: usize,
    /// Held open so that, out of file descriptors, the broker can still
    /// accept a connection to close it (else the listener stays readable
    /// and the backlog fills with clients who wait forever).
    reserve: Option<std::fs::File>,
    last_sweep: Instant,
    last_refusal_log: Option<Instant>,
    /// MPS mode: the control daemon the broker runs.
    mps: Option<crate::mps::Mps>,
    /// `--mig dynamic`: carries out the MIG planner's steps.
    mig_driver: Option<Box<dyn MigDriver>>,
}

/// A warning at most every 10 s: a flood must not also flood the log.
fn warn_limited(last: &mut Option<Instant>, msg: std::fmt::Arguments<'_>) {
    if last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
        *last = Some(Instant::now());
        warn!("{msg}");
    }
}

/// `CLOCK_MONOTONIC` in ns: unlike an `Instant` it means the same to the
/// next broker after a restart, so queue ages survive one.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime into a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn reserve_fd() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

impl Server {
    fn now(&self) -> u64 {
        monotonic_ns()
    }

    fn sched_cfg(&self) -> SchedConfig {
        SchedConfig {
            timeslice: self.opts.timeslice,
            bound: self.opts.inflight,
            ..SchedConfig::default()
        }
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
        let Some(bytes) = parse_uuid(uuid) else {
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
                    .any(|c| c.devices.iter().any(|d| d.gpu == i))
        });
        match stale {
            Some(i) => self.gpus[i] = unit,
            None => self.gpus.push(unit),
        }
    }

    /// Carries out a MIG lease's steps through NVML (destroying idle
    /// instances in the way, creating the job's), synchronously: a step
    /// takes milliseconds with the simulated driver, more on a real GPU,
    /// and the loop waits for it. Returns the lease with its MIG device,
    /// or why not; then the request is back in the queue where it was (if
    /// it came from the queue) and the GPU's instances have been re-read.
    fn finish_mig(&mut self, lease: queue::Lease) -> Result<queue::Lease, String> {
        let Some(a) = lease.mig.clone().filter(|a| !a.steps.is_empty()) else {
            return Ok(lease);
        };
        let now = self.now();
        let Some(driver) = self.mig_driver.as_mut() else {
            // Unreachable: without a driver the planner has no GPUs.
            self.queue.mig_failed(now, lease.id, None);
            return Err("the broker has no MIG driver".into());
        };
        let mut failure = None;
        let mut made = None;
        for step in &a.steps {
            match *step {
                Step::Destroy { gi } => match driver.destroy(a.gpu, gi) {
                    Ok(()) => {
                        self.queue.mig_destroyed(a.gpu, gi);
                        info!(
                            gpu = a.gpu,
                            gi, "destroyed an idle MIG instance to make room"
                        );
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                },
                Step::Create { profile, placement } => {
                    match driver.create(a.gpu, profile, placement) {
                        Ok(m) => made = Some(m),
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    }
                }
            }
        }
        let (gi, uuid) = match (failure, made) {
            (None, Some(m)) => m,
            (failure, _) => {
                let e = failure.unwrap_or_else(|| "no instance was created".into());
                let found = self
                    .mig_driver
                    .as_mut()
                    .and_then(|d| d.instances(a.gpu).ok());
                let requeued = self.queue.mig_failed(now, lease.id, found.as_deref());
                warn!(
                    gpu = a.gpu,
                    profile = %a.profile_name,
                    placement = %a.placement,
                    requeued,
                    "MIG: {e}; re-read the GPU's instances, and that placement is avoided for {} s",
                    mig::BLOCK_FOR / 1_000_000_000
                );
                return Err(e);
            }
        };
        info!(gpu = a.gpu, gi, profile = %a.profile_name, placement = %a.placement, %uuid, "created a MIG instance");
        self.add_mig_unit(a.gpu, gi, &uuid, &a.profile_name, a.mem);
        self.queue
            .mig_created(lease.id, gi, uuid)
            .ok_or_else(|| "the lease ended while its MIG instance was made".into())
    }

    fn send(&mut self, tok: Token, msg: &ServerMsg) {
        if let Some(c) = self.conns.get_mut(&tok) {
            wire::encode_server(msg, &mut c.outbuf);
            if c.outbuf.len() > MAX_OUTBUF {
                warn!(pid = c.pid, "client is not reading; disconnecting it");
                c.dead = true;
            }
        }
    }

    fn send_id(&mut self, id: u64, msg: &ServerMsg) {
        if let Some(&tok) = self.by_id.get(&id) {
            self.send(tok, msg);
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let (pid, uid) = peer_cred(stream.as_raw_fd());
                    let count = self.per_uid.get(&uid).copied().unwrap_or(0);
                    if count >= self.opts.max_conns_per_user {
                        // Said and closed at once, without buffering: the
                        // write of one small frame to a fresh socket does
                        // not block.
                        let mut out = Vec::new();
                        wire::encode_server(
                            &ServerMsg::Error {
                                code: wire::ERR_REFUSED,
                                message: format!(
                                    "user {uid} already has {count} connections open to this broker \
                                     (its limit, --max-connections-per-user); close some and retry"
                                ),
                            },
                            &mut out,
                        );
                        let _ = stream.write(&out);
                        warn_limited(
                            &mut self.last_refusal_log,
                            format_args!(
                                "refusing a connection from uid {uid} (pid {pid}): {count} open, the per-user limit"
                            ),
                        );
                        continue;
                    }
                    let tok = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, tok, Interest::READABLE)
                    {
                        warn!("register client: {e}");
                        continue;
                    }
                    *self.per_uid.entry(uid).or_insert(0) += 1;
                    let id = tok.0 as u64;
                    debug!(pid, uid, id, "client connected");
                    self.by_id.insert(id, tok);
                    self.conns.insert(
                        tok,
                        Conn {
                            stream,
                            id,
                            pid,
                            uid,
                            opened: Instant::now(),
                            partial_since: None,
                            inbuf: Vec::new(),
                            outbuf: Vec::new(),
                            role: None,
                            command: cmdline(pid),
                            devices: Vec::new(),
                            share: None,
                            limit: None,
                            priority: Priority::Normal,
                            job: None,
                            member_of: None,
                            claimed_job: None,
                            registered: false,
                            queued: None,
                            dead: false,
                            want_write: false,
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of descriptors: free the reserve, take the
                    // connection off the backlog and close it, so the
                    // client hears "closed" instead of hanging.
                    warn_limited(
                        &mut self.last_refusal_log,
                        format_args!(
                            "out of file descriptors ({e}); closing new connections until some close"
                        ),
                    );
                    if self.reserve.take().is_none() {
                        // Nothing to free; the loop retries after the next
                        // sweep has closed stale connections.
                        return;
                    }
                    let shed = self.listener.accept();
                    self.reserve = reserve_fd();
                    match shed {
                        Ok((stream, _)) => drop(stream),
                        Err(_) => return,
                    }
                    // The listener is edge-triggered: drain the backlog.
                }
                Err(e) => {
                    warn!("accept: {e}");
                    return;
                }
            }
        }
    }

    /// Closes connections that never said hello or sat on half a frame.
    fn sweep(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < Duration::from_millis(250) {
            return;
        }
        self.last_sweep = now;
        for c in self.conns.values_mut() {
            let silent = c.role.is_none() && now.duration_since(c.opened) > HELLO_DEADLINE;
            let stuck = c
                .partial_since
                .is_some_and(|t| now.duration_since(t) > FRAME_DEADLINE);
            if (silent || stuck) && !c.dead {
                debug!(
                    pid = c.pid,
                    uid = c.uid,
                    silent,
                    stuck,
                    "closing a stalled connection"
                );
                c.dead = true;
            }
        }
        // Jobs restored from a previous broker whose run never came back.
        let gone: Vec<(u64, u32)> = self
            .jobs
            .iter()
            .filter(|(t, j)| !self.job_conn.contains_key(t) && !j.alive())
            .map(|(t, j)| (*t, j.pid))
            .collect();
        // Named by the run's pid, as status names leases: the token is a
        // secret.
        for (t, pid) in gone {
            info!(
                pid,
                "a restored job's gpufrac run is gone; ending its lease"
            );
            self.end_job(t);
        }
    }

    fn read(&mut self, tok: Token) {
        // One buffer for the whole loop, not a zeroed 16 KiB per read.
        let mut buf = std::mem::take(&mut self.readbuf);
        buf.resize(16 * 1024, 0);
        while let Some(c) = self.conns.get_mut(&tok) {
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    c.dead = true;
                    break;
                }
                Ok(n) => {
                    if self.inbuf_total + n > INPUT_BUDGET {
                        warn!(
                            pid = c.pid,
                            uid = c.uid,
                            "input budget exhausted; closing the client"
                        );
                        c.dead = true;
                        break;
                    }
                    c.inbuf.extend_from_slice(&buf[..n]);
                    self.inbuf_total += n;
                    // Never buffer more than one maximal frame of input.
                    if c.inbuf.len() > wire::MAX_CLIENT_FRAME as usize + 8 {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.dead = true;
                    break;
                }
            }
        }
        self.readbuf = buf;
        self.process_input(tok);
    }

    fn process_input(&mut self, tok: Token) {
        loop {
            let Some(c) = self.conns.get_mut(&tok) else {
                return;
            };
            if c.dead || c.inbuf.is_empty() {
                if let Some(c) = self.conns.get_mut(&tok) {
                    c.partial_since = None;
                }
                return;
            }
            match wire::decode_client(&c.inbuf) {
                Ok((msg, used)) => {
                    c.inbuf.drain(..used);
                    self.inbuf_total = self.inbuf_total.saturating_sub(used);
                    c.partial_since = None;
                    if c.inbuf.capacity() > 64 << 10 && c.inbuf.len() < 4 << 10 {
                        c.inbuf.shrink_to(4 << 10);
                    }
                    self.handle(tok, msg);
                }
                Err(DecodeError::Incomplete) => {
                    c.partial_since.get_or_insert_with(Instant::now);
                    return;
                }
                Err(e) => {
                    let pid = c.pid;
                    warn_limited(
                        &mut self.last_refusal_log,
                        format_args!("bad frame from pid {pid} ({e}); closing that client"),
                    );
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_BAD_FRAME,
                            message: format!("bad frame: {e}"),
                        },
                    );
                    if let Some(c) = self.conns.get_mut(&tok) {
                        c.dead = true;
                    }
                    return;
                }
            }
        }
    }

    fn handle(&mut self, tok: Token, msg: ClientMsg) {
        let now = self.now();
        let Some(c) = self.conns.get_mut(&tok) else {
            return;
        };
        let id = c.id;
        if c.role.is_none() {
            match msg {
                ClientMsg::Hello {
                    magic,
                    version,
                    role,
                    ..
                } => {
                    let reply = wire::hello_reply(magic, version);
                    let ok = matches!(reply, ServerMsg::HelloOk { .. });
                    if ok {
                        c.role = Some(role);
                    } else {
                        warn!(
                            pid = c.pid,
                            version, "refusing client with another protocol version"
                        );
                        c.dead = true;
                    }
                    self.send(tok, &reply);
                }
                _ => {
                    c.dead = true;
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_BAD_FRAME,
                            message: "expected Hello first".into(),
                        },
                    );
                }
            }
            return;
        }
        match msg {
            ClientMsg::Hello { .. } => {}
            ClientMsg::Register {
                command,
                devices,
                share,
                limit,
                priority,
            } => {
                // A weight is a percentage: (0, 100]. Anything larger would
                // let one client declare itself the whole GPU (1e300 once
                // left a neighbour 52 kernels in 2924).
                let share = share
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(|s| s.min(100.0));
                let limit = limit
                    .filter(|l| l.is_finite() && *l > 0.0)
                    .map(|l| (l / 100.0).min(1.0));
                // Only GPUs this node has: a client inventing UUIDs once
                // grew the broker by 400 MB and broke status for everyone.
                let unknown: Vec<String> = devices
                    .iter()
                    .take(64)
                    .filter(|d| !self.gpus.iter().any(|g| g.uuid == d.uuid))
                    .map(|d| uuid_string(&d.uuid))
                    .collect();
                let room = if self.discovered {
                    0
                } else {
                    MAX_UNKNOWN_GPUS.saturating_sub(self.gpus.len())
                };
                if unknown.len() > room {
                    let pid = c.pid;
                    let known: Vec<&str> = self.gpus.iter().map(|g| g.uuid_str.as_str()).collect();
                    warn_limited(
                        &mut self.last_refusal_log,
                        format_args!(
                            "refusing a registration from pid {pid} for GPUs this node does not have: {}",
                            unknown.join(", ")
                        ),
                    );
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_REFUSED,
                            message: format!(
                                "this broker does not manage {} (it manages: {}); \
                                 run the process where the broker sees its GPUs, or with GPUFRAC_BROKER=off",
                                unknown.join(", "),
                                if known.is_empty() { "none".into() } else { known.join(", ") }
                            ),
                        },
                    );
                    if let Some(c) = self.conns.get_mut(&tok) {
                        c.dead = true;
                    }
                    return;
                }
                let Some(c) = self.conns.get_mut(&tok) else {
                    return;
                };
                // The broker's own view of the process wins: a process could
                // claim to be anyone's job in status. A process the broker
                // cannot see in /proc (another pid namespace) says for itself.
                if c.command.is_empty() && !command.is_empty() {
                    c.command = command;
                }
                c.share = share;
                c.limit = limit;
                c.priority = priority;
                // The job it belongs to: the nearest `gpufrac run` among its
                // ancestors (run is a subreaper, so a daemonised child stays
                // below it), whatever its environment says.
                let chain = jobs::ancestry(c.pid);
                let job = chain
                    .iter()
                    .find_map(|&p| self.jobs.iter().find(|(_, j)| j.pid == p).map(|(&t, _)| t))
                    // Else the token it holds: the token is random and only
                    // in the job's environment, so holding it is the proof.
                    .or(c.claimed_job.filter(|t| self.jobs.contains_key(t)));
                let uid = c.uid;
                let old_job = std::mem::replace(&mut c.member_of, job);
                let old: Vec<usize> = c.devices.drain(..).map(|d| d.gpu).collect();
                for g in old {
                    self.gpus[g].sched.remove_client(now, id);
                }
                let mut devs = Vec::new();
                for d in devices.iter().take(64) {
                    let g = self.gpu_by_uuid(&d.uuid, d.mem_total);
                    if devs.iter().any(|x: &ClientDev| x.gpu == g) {
                        continue;
                    }
                    // Added to the GPU's scheduler by `enforce` below, with
                    // its unit's settings.
                    devs.push(ClientDev {
                        gpu: g,
                        ordinal: d.ordinal,
                        cap: d.mem_cap,
                        used: 0,
                        peak: 0,
                        ooms: 0,
                    });
                }
                let mem_cap = job
                    .and_then(|t| self.jobs.get(&t))
                    .and_then(|j| j.mem_cap)
                    .unwrap_or(0);
                let job_pid = job.and_then(|t| self.jobs.get(&t)).map(|j| j.pid);
                if let Some(c) = self.conns.get_mut(&tok) {
                    lower_caps(&mut devs, mem_cap);
                    // A job is named by its run's pid: the token is a secret.
                    info!(pid = c.pid, uid, command = %c.command, devices = devs.len(), ?share, ?limit, %priority, job = ?job_pid, "registered");
                    c.devices = devs;
                }
                self.send(tok, &ServerMsg::Registered { mem_cap });
                if let Some(c) = self.conns.get_mut(&tok) {
                    c.registered = true;
                }
                self.enforce(now, tok);
                if let Some(t) = old_job.filter(|&t| Some(t) != job) {
                    self.enforce_job(now, t);
                }
                if let Some(t) = job {
                    self.enforce_job(now, t);
                }
            }
            ClientMsg::Usage {
                uuid,
                used,
                peak,
                ooms,
            } => {
                if let Some(d) = c.devices.iter_mut().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    // Reports are the client's word: never more than the
                    // GPU holds (a claim of 4 EiB used would skew status
                    // and every sum made from it).
                    let total = self.gpus[d.gpu].total_mem;
                    let cap = if total > 0 { total } else { u64::MAX };
                    d.used = used.min(cap);
                    d.peak = peak.min(cap).max(d.used);
                    d.ooms = ooms;
                }
            }
            ClientMsg::Acquire { uuid } if self.mps.is_some() => {
                // MPS runs every client's kernels side by side: nothing to
                // take turns at. The grant is open-ended and never revoked.
                if c.devices.iter().any(|d| self.gpus[d.gpu].uuid == uuid) {
                    self.send(
                        tok,
                        &ServerMsg::Grant {
                            uuid,
                            grant: 1,
                            slice_ns: 0,
                            bound_ns: 0,
                            waiters: false,
                        },
                    );
                }
            }
            ClientMsg::Acquire { uuid } => {
                debug!(pid = c.pid, "acquire");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.acquire(now, id);
                }
            }
            ClientMsg::Release { uuid, held_ns } => {
                debug!(pid = c.pid, held_us = held_ns / 1000, "release");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.release(now, id);
                }
            }
            ClientMsg::Drained { uuid } => {
                debug!(pid = c.pid, "drained");
                if let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == uuid) {
                    let g = d.gpu;
                    self.gpus[g].sched.drained(now, id);
                }
            }
            ClientMsg::Ping => self.send(tok, &ServerMsg::Pong),
            ClientMsg::Join { job } => {
                // Settled at Register; a token no job holds is ignored
                // there (the process is its user's), not refused: a
                // container can outlive its run.
                c.claimed_job = Some(job);
            }
            ClientMsg::Name { pod, label } => {
                let Some(t) = c.job else {
                    self.send(
                        tok,
                        &ServerMsg::Error {
                            code: wire::ERR_REFUSED,
                            message:
                                "Name names the job of this connection's lease: send Lease first"
                                    .into(),
                        },
                    );
                    return;
                };
                let label = clip(&label, MAX_COMMAND);
                let pod = Some(clip(&pod, MAX_POD)).filter(|p| !p.is_empty());
                c.command = label.clone();
                self.queue.relabel(t, &label, pod.as_deref());
                if let Some(j) = self.jobs.get_mut(&t) {
                    j.label = label;
                    j.pod = pod;
                    self.dirty = true;
                }
            }
            ClientMsg::Status { from } => {
                let json = self.status_json(from as usize);
                self.send(tok, &ServerMsg::StatusReply { json });
            }
            ClientMsg::Lease {
                want_gpus,
                want_mem,
                compute,
                limit,
                no_wait,
                command,
                priority,
                resume,
                token: chosen,
                pin,
            } => {
                if c.job.is_some() {
                    self.send(
                        tok,
                        &ServerMsg::Refused {
                            reason: "one lease per connection".into(),
                        },
                    );
                    return;
                }
                let (pid, uid) = (c.pid, c.uid);
                if resume != 0 {
                    self.resume_job(tok, resume);
                    return;
                }
                let refusal = if chosen != 0 && self.jobs.contains_key(&chosen) {
                    Some("the chosen token is another job's; choose another at random")
                } else if !pin.is_empty() && (want_gpus, want_mem) != (0, 0) {
                    Some(
                        "a lease either names its GPUs and the memory on each (pin) or asks for GPUs or memory, not both",
                    )
                } else {
                    None
                };
                if let Some(reason) = refusal {
                    self.send(
                        tok,
                        &ServerMsg::Refused {
                            reason: reason.into(),
                        },
                    );
                    return;
                }
                let pin: Vec<Pinned> = pin
                    .iter()
                    .map(|p| Pinned {
                        uuid: uuid_string(&p.uuid),
                        mem: p.mem,
                    })
                    .collect();
                let want = match (want_gpus, want_mem) {
                    _ if !pin.is_empty() => Some(Want::Memory(queue::pinned_total(&pin))),
                    (0, 0) => None,
                    (0, b) => Some(Want::Memory(b)),
                    (n, _) => Some(Want::Gpus(n)),
                };
                let label = if command.is_empty() {
                    c.command.clone()
                } else {
                    command
                };
                c.command = label.clone();
                // Percent on the wire; clamped like a process's own.
                let compute = compute
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(|s| s.min(100.0));
                let limit = limit
                    .filter(|l| l.is_finite() && *l > 0.0)
                    .map(|l| (l / 100.0).min(1.0));
                let Some(start_time) = jobs::proc_start_time(pid) else {
                    self.send(
                        tok,
                        &ServerMsg::Refused {
                            reason: "cannot identify the requesting process".into(),
                        },
                    );
                    return;
                };
                let token = match chosen {
                    0 => jobs::new_token(),
                    t => t,
                };
                let mut job = Job {
                    token,
                    pid,
                    start_time,
                    uid,
                    want,
                    compute,
                    limit,
                    priority,
                    label,
                    mem_cap: None,
                    phase: Phase::Unplaced,
                    pin,
                    pod: None,
                };
                match job.request() {
                    // A job without placement: a unit with its settings.
                    None => {
                        self.attach_job(tok, job);
                        self.send_unplaced(tok, token);
                    }
                    Some(req) if no_wait => {
                        match self.queue.try_now(now, token, req).map_err(|r| r.reason) {
                            Ok(lease) => match self.finish_mig(lease) {
                                Ok(lease) => {
                                    job.phase = Phase::Running {
                                        gpus: lease.gpus.clone(),
                                        mig: lease.mig.as_ref().and_then(|a| a.uuid.clone()),
                                    };
                                    self.attach_job(tok, job);
                                    self.deliver_lease(&lease);
                                }
                                Err(e) => self.send(
                                    tok,
                                    &ServerMsg::Refused {
                                        reason: format!(
                                            "no room now: the MIG instance could not be made ({e}); drop --no-wait to queue"
                                        ),
                                    },
                                ),
                            },
                            Err(reason) => self.send(tok, &ServerMsg::Refused { reason }),
                        }
                    }
                    Some(req) => match self.queue.submit(now, token, req) {
                        Ok(()) => {
                            job.phase = Phase::Queued { since: now };
                            self.attach_job(tok, job);
                            if let Some(c) = self.conns.get_mut(&tok) {
                                c.queued = Some(0);
                            }
                        }
                        Err(r) => self.send(tok, &ServerMsg::Refused { reason: r.reason }),
                    },
                }
            }
        }
    }

    fn mps_pipe(&self) -> String {
        self.mps
            .as_ref()
            .map_or_else(String::new, |m| m.pipe_dir.display().to_string())
    }

    /// The lease of a job without placement: no GPUs, only its token (and
    /// the MPS pipe, in MPS mode).
    fn send_unplaced(&mut self, tok: Token, token: u64) {
        // Held from now, as a placed lease is from its grant (status's HELD).
        self.leased_at.entry(token).or_insert_with(Instant::now);
        let msg = ServerMsg::Leased {
            gpus: Vec::new(),
            uuids: Vec::new(),
            mem_cap: 0,
            token,
            mps_pipe: self.mps_pipe(),
            mig: String::new(),
        };
        self.send(tok, &msg);
    }

    fn attach_job(&mut self, tok: Token, job: Job) {
        let t = job.token;
        self.jobs.insert(t, job);
        self.job_conn.insert(t, tok);
        if let Some(c) = self.conns.get_mut(&tok) {
            c.job = Some(t);
        }
        self.dirty = true;
        self.rejoin(t);
    }

    /// Brings a job's processes up to date with it: those that sent its
    /// token before it existed join it (a pod's processes can start before
    /// the device plugin's lease reaches the broker, and keep their token
    /// when the plugin books the pod again after a restart), and all of
    /// them get its memory cap once it has one (a pod's lease may be
    /// granted after its processes started).
    fn rejoin(&mut self, token: u64) {
        let now = self.now();
        let mem_cap = self.jobs.get(&token).and_then(|j| j.mem_cap).unwrap_or(0);
        let who: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.registered
                    && (c.member_of == Some(token)
                        || (c.member_of.is_none() && c.claimed_job == Some(token)))
            })
            .map(|(t, _)| *t)
            .collect();
        if who.is_empty() {
            return;
        }
        for t in who {
            if let Some(c) = self.conns.get_mut(&t) {
                c.member_of = Some(token);
                lower_caps(&mut c.devices, mem_cap);
            }
            if mem_cap > 0 {
                self.send(t, &ServerMsg::Registered { mem_cap });
            }
            self.enforce(now, t);
        }
        self.enforce_job(now, token);
    }

    /// A `gpufrac run` reconnecting after a broker restart: only the same
    /// process may claim its job back, and only while no live connection
    /// holds it.
    fn resume_job(&mut self, tok: Token, token: u64) {
        let Some(c) = self.conns.get(&tok) else {
            return;
        };
        let ok = self.jobs.get(&token).is_some_and(|j| {
            j.pid == c.pid
                && j.alive()
                && !self
                    .job_conn
                    .get(&token)
                    .is_some_and(|t| self.conns.contains_key(t))
        });
        if !ok {
            self.send(
                tok,
                &ServerMsg::Refused {
                    reason: "this broker has no such lease to resume (it was started without the state file, or the lease ended)".into(),
                },
            );
            return;
        }
        let pid = c.pid;
        self.job_conn.insert(token, tok);
        if let Some(c) = self.conns.get_mut(&tok) {
            c.job = Some(token);
        }
        let (phase, label) = {
            let j = &self.jobs[&token];
            (j.phase.clone(), j.label.clone())
        };
        info!(pid, "gpufrac run reclaimed its job");
        if let Some(c) = self.conns.get_mut(&tok) {
            c.command = label;
        }
        match phase {
            Phase::Queued { .. } => {
                if let Some(c) = self.conns.get_mut(&tok) {
                    c.queued = Some(0);
                }
            }
            Phase::Unplaced => self.send_unplaced(tok, token),
            Phase::Running { .. } => {
                if let Some(lease) = self.queue.lease(token).cloned() {
                    self.deliver_lease(&lease);
                }
            }
        }
    }

    /// The job is over (its run disconnected or died): its lease or place
    /// goes, its processes become their user's again.
    fn end_job(&mut self, token: u64) {
        let now = self.now();
        if let Some(a) = self.queue.lease(token).and_then(|l| l.mig.clone()) {
            info!(
                gpu = a.gpu,
                gi = ?a.gi,
                profile = %a.profile_name,
                "the job's MIG instance is idle; kept for the next job until its room is needed"
            );
        }
        self.queue.cancel(now, token);
        self.queue.release(now, token);
        self.leased_at.remove(&token);
        self.job_conn.remove(&token);
        if let Some(j) = self.jobs.remove(&token) {
            self.dirty = true;
            let members: Vec<Token> = self
                .conns
                .iter()
                .filter(|(_, c)| c.member_of == Some(token))
                .map(|(t, _)| *t)
                .collect();
            for t in members {
                if let Some(c) = self.conns.get_mut(&t) {
                    c.member_of = None;
                }
                self.enforce(now, t);
            }
            debug!(pid = j.pid, "job ended");
        }
    }

    /// Puts a process in its unit's scheduler group with the unit's
    /// settings: a job's `--gpu-compute` is the unit's weight, its
    /// `--gpu-limit` is split evenly among its processes on each GPU, and
    /// its `--priority` is every process's class. Outside a job, a user's
    /// processes form the unit.
    fn enforce(&mut self, now: u64, tok: Token) {
        let Some(c) = self.conns.get(&tok) else {
            return;
        };
        let job = c.member_of;
        let j = job.and_then(|t| self.jobs.get(&t));
        let group = match job {
            Some(t) => t & !UID_UNIT,
            None => UID_UNIT | u64::from(c.uid),
        };
        let (unit_weight, job_limit, job_prio) =
            j.map_or((None, None, None), |j| (j.compute, j.limit, j.priority));
        for d in &c.devices {
            let limit = match job_limit {
                Some(l) => {
                    // Processes of this job on this GPU.
                    let n = self
                        .conns
                        .values()
                        .filter(|o| {
                            o.member_of == job && o.devices.iter().any(|od| od.gpu == d.gpu)
                        })
                        .count()
                        .max(1) as f64;
                    Some(c.limit.map_or(l / n, |own| own.min(l / n)))
                }
                None => c.limit,
            };
            let sched = &mut self.gpus[d.gpu].sched;
            sched.add_client(
                now,
                c.id,
                c.share.unwrap_or(DEFAULT_WEIGHT),
                limit,
                job_prio.unwrap_or(c.priority),
            );
            sched.set_group(now, c.id, group, unit_weight);
        }
    }

    /// Re-applies a job's settings to all its processes: its limit is split
    /// among however many there are now.
    fn enforce_job(&mut self, now: u64, job: u64) {
        let has_limit = self.jobs.get(&job).is_some_and(|j| j.limit.is_some());
        if !has_limit {
            return;
        }
        let members: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.member_of == Some(job) && !c.devices.is_empty())
            .map(|(t, _)| *t)
            .collect();
        for t in members {
            self.enforce(now, t);
        }
    }

    fn deliver_lease(&mut self, lease: &queue::Lease) {
        let uuids: Vec<[u8; 16]> = lease
            .uuids
            .iter()
            .map(|u| {
                self.gpus
                    .iter()
                    .find(|g| &g.uuid_str == u)
                    .map(|g| g.uuid)
                    // A GPU in MIG mode is not among them.
                    .or_else(|| parse_uuid(u))
                    .unwrap_or([0; 16])
            })
            .collect();
        let mig = lease.mig.as_ref().and_then(|a| a.uuid.clone());
        if let Some(j) = self.jobs.get_mut(&lease.id) {
            j.phase = Phase::Running {
                gpus: lease.gpus.clone(),
                mig: mig.clone(),
            };
            j.mem_cap = lease.mem_cap;
            self.dirty = true;
        }
        self.rejoin(lease.id);
        self.leased_at.entry(lease.id).or_insert_with(Instant::now);
        if let Some(&tok) = self.job_conn.get(&lease.id) {
            if let Some(c) = self.conns.get_mut(&tok) {
                info!(pid = c.pid, gpus = ?lease.gpus, mem_cap = ?lease.mem_cap, mig = ?mig, "lease granted");
                c.queued = None;
            }
            self.send(
                tok,
                &ServerMsg::Leased {
                    gpus: lease.gpus.clone(),
                    uuids,
                    mem_cap: lease.mem_cap.unwrap_or(0),
                    token: lease.id,
                    mps_pipe: self.mps_pipe(),
                    mig: mig.unwrap_or_default(),
                },
            );
        }
    }

    /// Everything the state machines decided since the last turn.
    fn pump(&mut self) {
        let now = self.now();
        for g in 0..self.gpus.len() {
            if self.gpus[g].sched.next_timeout().is_some_and(|t| t <= now) {
                self.gpus[g].sched.handle_timeout(now);
            }
            while let Some(a) = self.gpus[g].sched.poll_action() {
                let uuid = self.gpus[g].uuid;
                debug!(?a, "scheduler");
                match a {
                    Action::Grant {
                        client,
                        grant,
                        slice,
                        bound,
                        waiters,
                    } => self.send_id(
                        client,
                        &ServerMsg::Grant {
                            uuid,
                            grant,
                            slice_ns: slice.unwrap_or(0),
                            bound_ns: bound,
                            waiters,
                        },
                    ),
                    Action::Revoke { client, grant } => {
                        self.send_id(client, &ServerMsg::Revoke { uuid, grant })
                    }
                }
            }
        }
        for lease in self.queue.poll(now) {
            // A MIG instance that cannot be made leaves the request queued
            // (said in the log); the next turn tries elsewhere.
            if let Ok(lease) = self.finish_mig(lease) {
                self.deliver_lease(&lease);
            }
        }
        for w in self.queue.waiting(now) {
            let pos = w.position as u32;
            let Some(&tok) = self.job_conn.get(&w.id) else {
                continue;
            };
            let changed = self.conns.get(&tok).is_some_and(|c| c.queued != Some(pos));
            if changed {
                let waiting_for = describe(&w.want);
                if let Some(c) = self.conns.get_mut(&tok) {
                    c.queued = Some(pos);
                }
                self.send(
                    tok,
                    &ServerMsg::Queued {
                        position: pos,
                        waiting_for,
                        token: w.id,
                    },
                );
            }
        }
    }

    fn flush(&mut self, tok: Token) {
        let Some(c) = self.conns.get_mut(&tok) else {
            return;
        };
        while !c.outbuf.is_empty() {
            match c.stream.write(&c.outbuf) {
                Ok(0) => {
                    c.dead = true;
                    break;
                }
                Ok(n) => {
                    c.outbuf.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.dead = true;
                    break;
                }
            }
        }
        // Ask for writability only while output is pending, and tell epoll
        // only when that changes: a syscall per flush is most of the cost of
        // a grant otherwise.
        let pending = !c.outbuf.is_empty();
        if pending != c.want_write {
            c.want_write = pending;
            let want = if pending {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let _ = self.poll.registry().reregister(&mut c.stream, tok, want);
        }
    }

    fn reap(&mut self) {
        let now = self.now();
        let dead: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| c.dead)
            .map(|(t, _)| *t)
            .collect();
        let reaped = !dead.is_empty();
        for tok in dead {
            // Say what we still can (an error frame) before closing.
            self.flush(tok);
            let Some(mut c) = self.conns.remove(&tok) else {
                continue;
            };
            let _ = self.poll.registry().deregister(&mut c.stream);
            self.by_id.remove(&c.id);
            self.inbuf_total = self.inbuf_total.saturating_sub(c.inbuf.len());
            if let Some(n) = self.per_uid.get_mut(&c.uid) {
                *n -= 1;
                if *n == 0 {
                    self.per_uid.remove(&c.uid);
                }
            }
            for d in &c.devices {
                self.gpus[d.gpu].sched.remove_client(now, c.id);
            }
            if let Some(t) = c.job
                && self.job_conn.get(&t) == Some(&tok)
            {
                self.end_job(t);
            }
            if let Some(t) = c.member_of
                && !c.devices.is_empty()
            {
                // Its job's limit is split among fewer processes now.
                self.enforce_job(now, t);
            }
            if !c.devices.is_empty() || c.job.is_some() {
                info!(pid = c.pid, command = %c.command, "client gone");
            }
        }
        if reaped {
            // The descriptors just closed make room for connections still
            // waiting in the backlog, which the edge-triggered listener
            // will not report again.
            self.accept();
        }
    }

    /// Runs the state machines and the sockets to a fixed point: removing
    /// a dead client can produce a grant for another, sending can reveal a
    /// dead client, and every such consequence must go out this turn (there
    /// may be no timer to bring the loop back).
    fn settle(&mut self, touched: Vec<Token>) {
        let mut touched = touched;
        loop {
            self.reap();
            self.pump();
            let toks: Vec<Token> = self
                .conns
                .iter()
                .filter(|(_, c)| !c.outbuf.is_empty())
                .map(|(t, _)| *t)
                .collect();
            for t in toks.into_iter().chain(touched.drain(..)) {
                self.flush(t);
            }
            if !self.conns.values().any(|c| c.dead) {
                break;
            }
        }
        self.save_state();
    }

    /// Writes the jobs out if they changed. A write that fails is retried
    /// at the next change, and said once.
    fn save_state(&mut self) {
        if !std::mem::take(&mut self.dirty) {
            return;
        }
        let Some(f) = &self.state else { return };
        if let Err(e) = f.save(self.jobs.values()) {
            warn_limited(
                &mut self.last_refusal_log,
                format_args!(
                    "cannot write the state file {}: {e}; leases will not survive a restart",
                    f.path().display()
                ),
            );
            self.dirty = true;
        }
    }

    fn next_wakeup(&self) -> Option<Duration> {
        let now = self.now();
        let mut t = self
            .gpus
            .iter()
            .filter_map(|g| g.sched.next_timeout())
            .min();
        // Queue escalation has no timer of its own: re-check while anyone
        // waits, and refresh metrics.
        if !self.queue.waiting(now).is_empty() || self.metrics.is_some() {
            let tick = now + 500_000_000;
            t = Some(t.map_or(tick, |x| x.min(tick)));
        }
        // Deadlines of connections that have not said hello or sit on half
        // a frame, and restored jobs whose run may have died.
        let pending = self.mps.is_some()
            || self
                .conns
                .values()
                .any(|c| c.role.is_none() || c.partial_since.is_some())
            || self.jobs.keys().any(|k| !self.job_conn.contains_key(k));
        if pending {
            let tick = now + 250_000_000;
            t = Some(t.map_or(tick, |x| x.min(tick)));
        }
        t.map(|t| Duration::from_nanos(t.saturating_sub(now)))
    }

    fn status(&self) -> Status {
        let now = self.now();
        let leases = self.queue.leases();
        // What each job's processes hold together, per GPU: summed once,
        // not once per process.
        let mut job_used: HashMap<(u64, usize), u64> = HashMap::new();
        for c in self.conns.values() {
            if let Some(t) = c.member_of {
                for d in &c.devices {
                    *job_used.entry((t, d.gpu)).or_insert(0) += d.used;
                }
            }
        }
        let mut gpus = Vec::new();
        let mig_status = self.queue.mig().status();
        let live: Vec<&str> = mig_status
            .iter()
            .flat_map(|g| g.instances.iter().filter_map(|i| i.uuid.as_deref()))
            .collect();
        for g in &self.gpus {
            // Entries of instances that are gone (kept for reuse) are not
            // shown.
            if g.mig.is_some() && !live.contains(&g.uuid_str.as_str()) {
                continue;
            }
            let st = g.sched.status(now);
            let driver_mem = self.nvml.process_memory(&g.uuid_str);
            let mut processes = Vec::new();
            for c in self.conns.values() {
                let Some(d) = c.devices.iter().find(|d| self.gpus[d.gpu].uuid == g.uuid) else {
                    continue;
                };
                let s = st.iter().find(|s| s.client == c.id);
                processes.push(ProcStatus {
                    pid: c.pid,
                    command: clip(&c.command, MAX_COMMAND),
                    ordinal: d.ordinal,
                    mem_used: d.used,
                    mem_peak: d.peak,
                    mem_cap: (d.cap > 0).then_some(d.cap),
                    sm_percent: self.mps.as_ref().and_then(|_| {
                        c.member_of
                            .and_then(|t| self.jobs.get(&t))
                            .and_then(|j| j.compute)
                    }),
                    driver_mem: driver_mem
                        .iter()
                        .find(|(p, _)| *p == c.pid)
                        .map(|&(_, b)| b),
                    ooms: d.ooms,
                    share_target: s.map_or(0.0, |s| s.target),
                    share_achieved: s.map_or(0.0, |s| s.achieved),
                    limit: s.map_or(c.limit, |s| s.limit),
                    uid: c.uid,
                    job: c.member_of.and_then(|t| self.jobs.get(&t)).map(|j| j.pid),
                    pod: c
                        .member_of
                        .and_then(|t| self.jobs.get(&t))
                        .and_then(|j| j.pod.clone()),
                    job_mem_used: c
                        .member_of
                        .map(|t| job_used.get(&(t, d.gpu)).copied().unwrap_or(0)),
                    state: s.map_or("idle".into(), |s| match s.state {
                        ClientState::Idle => "idle".into(),
                        ClientState::Waiting => "waiting".into(),
                        ClientState::Holding => "holding".into(),
                        ClientState::Revoking if s.hung => "hung".into(),
                        ClientState::Revoking => "revoking".into(),
                    }),
                    priority: s.map_or(Priority::Normal, |s| s.priority).as_str().into(),
                    gpu_time_s: s.map_or(0.0, |s| s.gpu_time as f64 / 1e9),
                    draining: s.is_some_and(|s| s.draining),
                });
            }
            processes.sort_by_key(|p| p.pid);
            let ls = g
                .index
                .filter(|_| g.mig.is_none())
                .and_then(|i| leases.iter().find(|l| l.index == i));
            // An instance in use is committed whole to its job.
            let in_use = g.mig.is_some()
                && mig_status.iter().any(|m| {
                    m.instances.iter().any(|i| {
                        i.uuid.as_deref() == Some(g.uuid_str.as_str())
                            && matches!(i.use_, Use::Lease(_))
                    })
                });
            gpus.push(GpuStatus {
                index: g.index,
                mode: if g.mig.is_some() {
                    "mig-instance"
                } else if self.mps.is_some() {
                    "mps"
                } else {
                    "time-slicing"
                }
                .into(),
                uuid: g.uuid_str.clone(),
                name: g.name.clone(),
                total_mem: g.total_mem,
                slots_total: match g.mig {
                    Some(_) => 1,
                    None => ls.map_or(self.opts.overprovision, |l| l.slots_total),
                },
                slots_used: match g.mig {
                    Some(_) => u32::from(in_use),
                    None => ls.map_or(0, |l| l.slots_used),
                },
                committed_mem: match g.mig {
                    Some(_) if in_use => g.total_mem,
                    Some(_) => 0,
                    None => ls.map_or(0, |l| l.committed_mem),
                },
                utilization: match g.mig {
                    Some(_) => None,
                    None => self.nvml.utilization(&g.uuid_str),
                },
                holder: g
                    .sched
                    .holder()
                    .and_then(|h| self.by_id.get(&h))
                    .and_then(|t| self.conns.get(t))
                    .map(|c| c.pid),
                processes,
                mig: None,
                mig_instance: g.mig.map(|(_, gi)| gi),
            });
        }
        for m in &mig_status {
            gpus.push(self.mig_gpu_status(now, m));
        }
        // GPUs by index (unknown ones last), each MIG GPU followed by its
        // instances; the sort is stable, so nothing else moves.
        gpus.sort_by_key(|g| {
            (
                g.index.is_none(),
                g.index,
                g.mig_instance.is_some(),
                g.mig_instance,
            )
        });
        let queue = self
            .queue
            .waiting(now)
            .into_iter()
            .map(|w| {
                let job = self.jobs.get(&w.id);
                QueueEntry {
                    position: w.position as u32,
                    pid: job.map_or(0, |j| j.pid),
                    pod: job.and_then(|j| j.pod.clone()),
                    command: w.label.clone(),
                    wants: describe(&w.want),
                    waiting_s: w.waited as f64 / 1e9,
                    escalated: w.escalated,
                }
            })
            .collect();
        let leases = self
            .jobs
            .iter()
            .filter(|(_, j)| !matches!(j.phase, Phase::Queued { .. }))
            .map(|(t, j)| LeaseEntry {
                pid: j.pid,
                pod: j.pod.clone(),
                command: j.label.clone(),
                gpus: self
                    .queue
                    .lease(*t)
                    .map_or_else(Vec::new, |l| l.gpus.clone()),
                mem_cap: j.mem_cap,
                held_s: self
                    .leased_at
                    .get(t)
                    .map_or(0.0, |at| at.elapsed().as_secs_f64()),
                compute: j.compute,
                limit: j.limit,
                connected: self
                    .job_conn
                    .get(t)
                    .is_some_and(|c| self.conns.contains_key(c)),
            })
            .collect();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            socket: self.opts.socket.display().to_string(),
            timeslice_ms: self.opts.timeslice as f64 / 1e6,
            inflight_us: self.opts.inflight as f64 / 1e3,
            overprovision: self.opts.overprovision,
            gpus,
            queue,
            leases,
            next: None,
            truncated: false,
            mps: self.mps.as_ref().map(|m| crate::status::MpsStatus {
                state: m.state.into(),
                pipe_dir: m.pipe_dir.display().to_string(),
                daemon_pid: m.daemon_pid(),
                restarts: m.restarts,
            }),
        }
    }

    /// A GPU in MIG mode: its instances, who holds them, since when idle.
    fn mig_gpu_status(&self, now: u64, m: &mig::GpuStatus) -> GpuStatus {
        let instances = m
            .instances
            .iter()
            .map(|i| {
                let (state, job, idle_s) = match i.use_ {
                    Use::Lease(_) if i.gi.is_none() => ("creating", None, None),
                    Use::Lease(id) => ("in-use", self.jobs.get(&id).map(|j| j.pid), None),
                    Use::Idle { since } => {
                        ("idle", None, Some(now.saturating_sub(since) as f64 / 1e9))
                    }
                    Use::Foreign => ("foreign", None, None),
                };
                crate::status::MigInstance {
                    gi: i.gi,
                    profile: i.profile.clone(),
                    placement: i.placement.to_string(),
                    mem: i.mem,
                    uuid: i.uuid.clone(),
                    state: state.into(),
                    job,
                    idle_s,
                }
            })
            .collect();
        GpuStatus {
            index: Some(m.gpu.index),
            mode: "mig".into(),
            uuid: m.gpu.uuid.clone(),
            name: m.gpu.name.clone(),
            total_mem: m.gpu.total_mem,
            slots_total: 0,
            slots_used: 0,
            committed_mem: self.queue.mig().committed(m.gpu.index),
            // NVML does not report utilisation in MIG mode.
            utilization: None,
            holder: None,
            processes: Vec::new(),
            mig: Some(crate::status::MigStatus {
                instances,
                created: m.created,
                destroyed: m.destroyed,
                failures: m.failures,
            }),
            mig_instance: None,
        }
    }

    /// One page of status: every GPU, queue entry and lease, and processes
    /// from the `from`-th (in GPU, then pid order) on, at most
    /// `STATUS_PAGE`; `next` says where the following page starts. Each
    /// page fits a frame whatever the node holds.
    fn status_json(&self, from: usize) -> String {
        let mut st = self.status();
        let mut seen = 0usize;
        let mut next = None;
        // Room for processes once the rest is written.
        let mut room = (wire::MAX_STATUS_JSON / 2).saturating_sub(
            serde_json::to_string(&st.queue).map_or(0, |j| j.len())
                + serde_json::to_string(&st.leases).map_or(0, |j| j.len()),
        );
        let mut taken = 0;
        for g in &mut st.gpus {
            let procs = std::mem::take(&mut g.processes);
            for p in procs {
                if seen >= from && next.is_none() {
                    let size = serde_json::to_string(&p).map_or(0, |j| j.len()) + 1;
                    // At least one per page, so paging always advances.
                    if taken < STATUS_PAGE && (size <= room || taken == 0) {
                        room = room.saturating_sub(size);
                        taken += 1;
                        g.processes.push(p);
                    } else {
                        next = Some(seen as u32);
                    }
                }
                seen += 1;
            }
        }
        st.next = next;
        // Lists other than processes are bounded by the connection limits;
        // cut them too if a page would still not fit.
        let mut json = serde_json::to_string(&st).unwrap_or_default();
        while json.len() > wire::MAX_STATUS_JSON - 64
            && (!st.queue.is_empty() || !st.leases.is_empty())
        {
            let q = st.queue.len() / 2;
            st.queue.truncate(q);
            let l = st.leases.len() / 2;
            st.leases.truncate(l);
            st.truncated = true;
            json = serde_json::to_string(&st).unwrap_or_default();
        }
        json
    }

    fn refresh_metrics(&mut self) {
        let Some(m) = self.metrics.clone() else {
            return;
        };
        if self.last_metrics.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_metrics = Instant::now();
        let text = render_metrics(&self.status());
        *m.lock().unwrap_or_else(|e| e.into_inner()) = text;
    }
}

/// Longest command line status shows: a process's arguments are its own
/// to make long, not everyone's status to carry.
const MAX_COMMAND: usize = 1024;
/// A pod's `namespace/name`: 63 and 253 characters at most in Kubernetes.
const MAX_POD: usize = 320;

/// A job's memory cap (0: none) over a process's own on each device: the
/// lower of the two holds, as the shim applies it on `Registered`.
fn lower_caps(devs: &mut [ClientDev], mem_cap: u64) {
    for d in devs.iter_mut() {
        if mem_cap > 0 && (d.cap == 0 || d.cap > mem_cap) {
            d.cap = mem_cap;
        }
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn describe(w: &Want) -> String {
    match w {
        Want::Gpus(1) => "1 GPU".into(),
        Want::Gpus(n) => format!("{n} GPUs"),
        Want::Memory(b) => format!("{} of GPU memory", format_size(*b)),
    }
}

fn peer_cred(fd: i32) -> (u32, u32) {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        (cred.pid as u32, cred.uid)
    } else {
        (0, 0)
    }
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn render_metrics(s: &Status) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP gpufrac_gpu_memory_total_bytes Physical memory of the GPU."
    );
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_total_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_total_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.total_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_committed_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_committed_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.committed_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_processes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_processes{{uuid=\"{}\"}} {}",
            g.uuid,
            g.processes.len()
        );
    }
    for (name, help) in [
        (
            "gpufrac_process_memory_used_bytes",
            "Memory charged to the process by the shim.",
        ),
        (
            "gpufrac_process_share_target",
            "Compute share promised when contended (0..1).",
        ),
        (
            "gpufrac_process_share_achieved",
            "Compute share held over the last window (0..1).",
        ),
        (
            "gpufrac_process_ooms_total",
            "Allocations refused by the memory cap.",
        ),
        (
            "gpufrac_process_gpu_seconds_total",
            "GPU time charged to the process (split evenly while shared).",
        ),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(
            o,
            "# TYPE {name} {}",
            if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            }
        );
        for g in &s.gpus {
            for p in &g.processes {
                let v = match name {
                    "gpufrac_process_memory_used_bytes" => p.mem_used as f64,
                    "gpufrac_process_share_target" => p.share_target,
                    "gpufrac_process_share_achieved" => p.share_achieved,
                    "gpufrac_process_gpu_seconds_total" => p.gpu_time_s,
                    _ => p.ooms as f64,
                };
                let _ = writeln!(
                    o,
                    "{name}{{uuid=\"{}\",pid=\"{}\",priority=\"{}\"}} {v}",
                    g.uuid, p.pid, p.priority
                );
            }
        }
    }
    if s.gpus.iter().any(|g| g.mig.is_some()) {
        let _ = writeln!(
            o,
            "# HELP gpufrac_mig_instance A MIG instance on a GPU under --mig dynamic (always 1): \
             profile, placement (start:size in memory slices), state (in-use, idle, foreign) \
             and the pid of the gpufrac run holding it."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mig_instance gauge");
        for g in &s.gpus {
            for i in g.mig.iter().flat_map(|m| m.instances.iter()) {
                let _ = writeln!(
                    o,
                    "gpufrac_mig_instance{{uuid=\"{}\",mig_uuid=\"{}\",gi=\"{}\",profile=\"{}\",placement=\"{}\",state=\"{}\",job=\"{}\"}} 1",
                    g.uuid,
                    i.uuid.as_deref().unwrap_or(""),
                    i.gi.map_or_else(String::new, |v| v.to_string()),
                    i.profile,
                    i.placement,
                    i.state,
                    i.job.map_or_else(String::new, |v| v.to_string())
                );
            }
        }
        let _ = writeln!(
            o,
            "# HELP gpufrac_mig_instance_idle_seconds How long an idle MIG instance has had no job."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mig_instance_idle_seconds gauge");
        for g in &s.gpus {
            for i in g.mig.iter().flat_map(|m| m.instances.iter()) {
                if let (Some(idle), Some(u)) = (i.idle_s, &i.uuid) {
                    let _ = writeln!(
                        o,
                        "gpufrac_mig_instance_idle_seconds{{uuid=\"{}\",mig_uuid=\"{u}\",profile=\"{}\"}} {idle}",
                        g.uuid, i.profile
                    );
                }
            }
        }
        for (name, help) in [
            (
                "gpufrac_mig_instances_created_total",
                "MIG instances this broker created.",
            ),
            (
                "gpufrac_mig_instances_destroyed_total",
                "Idle MIG instances this broker destroyed to make room.",
            ),
            (
                "gpufrac_mig_failures_total",
                "MIG instances that could not be made or destroyed.",
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} counter");
            for g in &s.gpus {
                if let Some(m) = &g.mig {
                    let v = match name {
                        "gpufrac_mig_instances_created_total" => m.created,
                        "gpufrac_mig_instances_destroyed_total" => m.destroyed,
                        _ => m.failures,
                    };
                    let _ = writeln!(o, "{name}{{uuid=\"{}\"}} {v}", g.uuid);
                }
            }
        }
    }
    if let Some(m) = &s.mps {
        let _ = writeln!(
            o,
            "# HELP gpufrac_mps_up The MPS control daemon the broker runs is up (1) or not (0)."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mps_up gauge");
        let _ = writeln!(o, "gpufrac_mps_up {}", u8::from(m.state == "running"));
    }
    let _ = writeln!(o, "# TYPE gpufrac_queue_waiting gauge");
    let _ = writeln!(o, "gpufrac_queue_waiting {}", s.queue.len());
    o
}

/// Scrapes served at once; more are answered 503 at once.
const METRICS_CONNS: usize = 32;

/// Serves each connection on its own short-lived thread with a short read
/// deadline, so idle or slow connections (ten once delayed a scrape by
/// 20 s) cannot hold up a scrape.
fn serve_metrics(addr: &str, text: Arc<Mutex<String>>) -> Result<(), String> {
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("metrics address {addr}: {e}"))?;
    info!(%addr, "serving Prometheus metrics at /metrics");
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else {
                    // Out of descriptors, most likely: let some close.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if busy.load(Ordering::Relaxed) >= METRICS_CONNS {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                    let _ = s.write_all(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    );
                    continue;
                }
                busy.fetch_add(1, Ordering::Relaxed);
                let (text, busy) = (text.clone(), busy.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .spawn(move || {
                        answer_scrape(&mut s, &text);
                        busy.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    warn!("cannot start a metrics thread");
                }
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn answer_scrape(s: &mut std::net::TcpStream, text: &Mutex<String>) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let mut req = Vec::new();
    let mut chunk = [0u8; 1024];
    // The request line is enough; stop at the end of the headers or 8 KiB.
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => req.extend_from_slice(&chunk[..n]),
        }
        if req.starts_with(b"GET ") && req.contains(&b'\n') {
            break;
        }
    }
    let path_ok = req.starts_with(b"GET /metrics");
    let body = if path_ok {
        text.lock().unwrap_or_else(|e| e.into_inner()).clone()
    } else {
        String::new()
    };
    let head = if path_ok { "200 OK" } else { "404 Not Found" };
    let _ = write!(
        s,
        "HTTP/1.1 {head}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// `what: e`, and for a permission error where to put the socket instead.
fn no_permission(what: String, e: &std::io::Error) -> String {
    if e.kind() != std::io::ErrorKind::PermissionDenied {
        return format!("{what}: {e}");
    }
    let p = crate::user_socket();
    format!(
        "{what}: {e}; run the broker as root, or give it a socket in a directory you can write: \
         gpufrac broker --socket {p}, and set GPUFRAC_SOCKET={p} for gpufrac run, gpufrac status \
         and the programs you start",
        p = p.display()
    )
}

/// A directory others can write lets them replace the socket (or plant
/// their own before the broker starts): refuse one that is writable by
/// group or others (unless sticky, like /tmp, where only owners may
/// remove) or owned by someone other than root or the broker's user.
fn check_socket_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta =
        std::fs::metadata(dir).map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mode = meta.mode();
    let sticky = mode & 0o1000 != 0;
    if meta.uid() != 0 && meta.uid() != me {
        return Err(format!(
            "the socket directory {} belongs to uid {}, who could replace the socket; \
             use a directory owned by root or by this user (e.g. /run/gpufrac)",
            dir.display(),
            meta.uid()
        ));
    }
    if mode & 0o022 != 0 && !sticky {
        return Err(format!(
            "the socket directory {} is writable by {} (mode {:o}), who could replace the socket; \
             run: chmod go-w {} (or choose another --socket)",
            dir.display(),
            if mode & 0o002 != 0 {
                "everyone"
            } else {
                "its group"
            },
            mode & 0o7777,
            dir.display()
        ));
    }
    Ok(())
}

/// Raises the soft file limit to the hard one: every client is a socket.
fn raise_nofile() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) != 0 {
            return 0;
        }
        if rl.rlim_cur < rl.rlim_max {
            let want = libc::rlimit {
                rlim_cur: rl.rlim_max,
                rlim_max: rl.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return want.rlim_cur;
            }
        }
    }
    rl.rlim_cur
}

fn bind(opts: &BrokerOptions) -> Result<UnixListener, String> {
    let path = &opts.socket;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| no_permission(format!("cannot create {}", dir.display()), &e))?;
        }
        check_socket_dir(dir)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only ever remove a stale socket: a typo in --socket must not
        // delete someone's file.
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; remove it yourself or choose another --socket path",
                path.display()
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "another broker is already listening on {}",
                path.display()
            ));
        }
        // A stale socket from a broker that died.
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path)
        .map_err(|e| no_permission(format!("cannot listen on {}", path.display()), &e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    if let Some(group) = &opts.group {
        let cname =
            std::ffi::CString::new(group.as_str()).map_err(|_| "bad group name".to_string())?;
        // SAFETY: getgrnam with a valid C string; we copy gr_gid at once.
        let gr = unsafe { libc::getgrnam(cname.as_ptr()) };
        if gr.is_null() {
            return Err(format!("--group {group}: no such group"));
        }
        let gid = unsafe { (*gr).gr_gid };
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| "bad socket path")?;
        // SAFETY: chown of our own socket file; -1 keeps the owner.
        if unsafe { libc::chown(cpath.as_ptr(), u32::MAX, gid) } != 0 {
            return Err(format!(
                "chown {} to group {group}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(l)
}

/// Runs the broker until SIGTERM/SIGINT. Returns an error message meant for
/// the user (e.g. the socket is already in use).
pub fn run(opts: BrokerOptions) -> Result<(), String> {
    // Every option is checked before anything is created, so a refused
    // start leaves nothing behind.
    if opts.overprovision == 0 {
        return Err("--overprovision must be at least 1".into());
    }
    if opts.max_conns_per_user == 0 {
        return Err("--max-connections-per-user must be at least 1".into());
    }
    if opts.mig == MigMode::Dynamic && opts.mps {
        return Err(
            "--mig dynamic and --mps cannot be combined: choose MIG instances (isolated, fixed sizes) \
             or MPS (shared SMs, one fault domain) for this node"
                .into(),
        );
    }
    if let Some(group) = &opts.group {
        let cname =
            std::ffi::CString::new(group.as_str()).map_err(|_| "bad group name".to_string())?;
        // SAFETY: getgrnam with a valid C string; only the null check.
        if unsafe { libc::getgrnam(cname.as_ptr()) }.is_null() {
            return Err(format!("--group {group}: no such group"));
        }
    }
    if let Some(addr) = &opts.metrics
        && addr.parse::<std::net::SocketAddr>().is_err()
        && std::net::ToSocketAddrs::to_socket_addrs(addr.as_str()).is_err()
    {
        // `--metrics 9400` (or `:9400`) is the likely slip: a port alone.
        return Err(match addr.trim_start_matches(':').parse::<u16>() {
            Ok(port) => format!(
                "--metrics {addr}: needs an address, not only a port; \
                 use --metrics 127.0.0.1:{port} (or 0.0.0.0:{port} to serve every interface)"
            ),
            Err(_) => {
                format!("--metrics {addr}: not an address; use HOST:PORT, e.g. 127.0.0.1:9400")
            }
        });
    }
    let nofile = raise_nofile();
    let found = match inventory::discover() {
        Ok(g) => g,
        // With --mig dynamic the GPUs may all be in MIG mode, which CUDA
        // does not show as devices; NVML is asked below.
        Err(e) if opts.mig == MigMode::Dynamic => {
            info!("{e}");
            Vec::new()
        }
        Err(e) => {
            warn!(
                "{e}; no GPUs to queue for (compute arbitration still works for clients that register)"
            );
            Vec::new()
        }
    };
    let (found, planner, mig_driver) = discover_mig(opts.mig, found, monotonic_ns())?;
    let discovered = !found.is_empty() || !planner.is_empty();
    for g in &found {
        info!(index = g.index, name = %g.name, uuid = %uuid_string(&g.uuid), total = %format_size(g.total_mem), "GPU");
    }
    // Bound before the socket: a metrics address in use must not leave a
    // socket behind.
    let metrics = match &opts.metrics {
        Some(addr) => {
            let m = Arc::new(Mutex::new(String::new()));
            serve_metrics(addr, m.clone())?;
            Some(m)
        }
        None => None,
    };
    let listener = bind(&opts)?;
    info!(nofile, "file limit");
    let mps = if opts.mps {
        let dir = opts
            .socket
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."))
            .to_path_buf();
        match crate::mps::Mps::start(&dir) {
            Ok(m) => Some(m),
            Err(e) => {
                // Nothing left behind by a refused start.
                let _ = std::fs::remove_file(&opts.socket);
                return Err(e);
            }
        }
    } else {
        None
    };
    let state_path = opts.state.clone().unwrap_or_else(|| {
        let mut p = opts.socket.clone().into_os_string();
        p.push(".state");
        PathBuf::from(p)
    });
    let poll = Poll::new().map_err(|e| e.to_string())?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 into a 2-int array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
        return Err("pipe2 failed".into());
    }
    SIGNAL_PIPE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: installing a handler that only writes to a pipe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    // SAFETY: a peer that disappears mid-write must not kill the broker.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let mut listener = listener;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    poll.registry()
        .register(&mut SourceFd(&fds[0]), SIGNALS, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    let qgpus = found
        .iter()
        .map(|g| queue::GpuInfo {
            index: g.index,
            uuid: uuid_string(&g.uuid),
            total_mem: g.total_mem,
        })
        .collect();
    let qcfg = QueueConfig {
        escalate_after: opts.escalate_after,
        overprovision: opts.overprovision,
        overcommit: opts.overcommit,
        placement: if opts.spread {
            Placement::Spread
        } else {
            Placement::BestFit
        },
    };
    let sched = SchedConfig {
        timeslice: opts.timeslice,
        bound: opts.inflight,
        ..SchedConfig::default()
    };
    let mut s = Server {
        poll,
        listener,
        conns: HashMap::new(),
        by_id: HashMap::new(),
        gpus: found
            .iter()
            .map(|g| Gpu {
                index: Some(g.index),
                uuid: g.uuid,
                uuid_str: uuid_string(&g.uuid),
                name: g.name.clone(),
                total_mem: g.total_mem,
                sched: Scheduler::new(sched),
                mig: None,
            })
            .collect(),
        queue: {
            let mut q = Queue::new(qgpus, qcfg);
            q.set_mig(planner);
            q
        },
        nvml: Nvml::open(),
        next_token: FIRST_CLIENT,
        metrics,
        last_metrics: Instant::now() - Duration::from_secs(1),
        readbuf: Vec::new(),
        jobs: std::collections::BTreeMap::new(),
        job_conn: HashMap::new(),
        leased_at: HashMap::new(),
        state: Some(StateFile::new(state_path)),
        dirty: false,
        discovered,
        per_uid: HashMap::new(),
        inbuf_total: 0,
        reserve: reserve_fd(),
        last_sweep: Instant::now(),
        last_refusal_log: None,
        mps,
        mig_driver,
        opts,
    };
    // Instances found at start are units of arbitration from the outset:
    // restored jobs' processes register on them.
    for m in s.queue.mig().status() {
        for i in &m.instances {
            if let (Some(gi), Some(u)) = (i.gi, &i.uuid) {
                s.add_mig_unit(m.gpu.index, gi, u, &i.profile, i.mem);
            }
        }
    }
    s.restore_jobs();
    info!(socket = %s.opts.socket.display(), timeslice_ms = s.opts.timeslice as f64 / 1e6, "broker ready");
    let mut events = Events::with_capacity(256);
    let result = loop {
        let timeout = s.next_wakeup();
        if let Err(e) = s.poll.poll(&mut events, timeout) {
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            break Err(format!("poll: {e}"));
        }
        let mut stop = false;
        let mut touched = Vec::new();
        for ev in events.iter() {
            match ev.token() {
                LISTENER => s.accept(),
                SIGNALS => stop = true,
                tok => {
                    if ev.is_readable() || ev.is_read_closed() {
                        s.read(tok);
                    }
                    touched.push(tok);
                }
            }
        }
        if stop {
            info!("shutting down");
            break Ok(());
        }
        s.sweep();
        if let Some(m) = s.mps.as_mut() {
            m.supervise();
        }
        s.settle(touched);
        s.refresh_metrics();
    };
    if let Some(m) = s.mps.as_mut() {
        m.quit();
    }
    let _ = std::fs::remove_file(&s.opts.socket);
    // A clean stop ends every lease (the runs see the socket close); only
    // a crash leaves state for the next broker.
    if let Some(f) = &s.state {
        f.remove();
    }
    result
}

/// GPUs in MIG mode, through NVML. With `--mig dynamic`: their profiles and
/// instances go to the planner (instances found are adopted, idle); they
/// leave the CUDA-found list, whose GPUs take NVML's (nvidia-smi's) index.
/// Without it, a GPU in MIG mode is only mentioned. Returns the GPUs for
/// the queue, the planner and the driver.
#[allow(clippy::type_complexity)]
fn discover_mig(
    mode: MigMode,
    mut found: Vec<inventory::GpuInfo>,
    now: u64,
) -> Result<
    (
        Vec<inventory::GpuInfo>,
        mig::Planner,
        Option<Box<dyn MigDriver>>,
    ),
    String,
> {
    if mode == MigMode::Off {
        if let Ok(all) = NvmlMig::open().and_then(|mut d| d.gpus()) {
            for g in all.iter().filter(|g| g.mig) {
                info!(
                    index = g.index,
                    name = %g.name,
                    "GPU in MIG mode: this broker does not use it; gpufrac broker --mig dynamic hands out its MIG instances"
                );
            }
        }
        return Ok((found, mig::Planner::default(), None));
    }
    let mut d = NvmlMig::open().map_err(|e| {
        format!("--mig dynamic needs NVML to read MIG modes and make instances: {e}")
    })?;
    let all = d.gpus().map_err(|e| format!("--mig dynamic: {e}"))?;
    let mut described = Vec::new();
    for g in all.iter().filter(|g| g.mig) {
        described.push(d.describe(g).map_err(|e| format!("--mig dynamic: {e}"))?);
    }
    let mut planner = mig::Planner::new(described.clone());
    for g in &described {
        let inst = d
            .instances(g.index)
            .map_err(|e| format!("--mig dynamic: {e}"))?;
        planner.sync(now, g.index, &inst);
        let profiles: Vec<&str> = g.profiles.iter().map(|p| p.name.as_str()).collect();
        info!(
            index = g.index,
            name = %g.name,
            uuid = %g.uuid,
            instances = inst.len(),
            profiles = %profiles.join(" "),
            "GPU in MIG mode: its instances are made and destroyed for --gpu-memory jobs"
        );
    }
    if described.is_empty() {
        warn!(
            "--mig dynamic: no GPU is in MIG mode, so there is nothing to manage; an administrator enables \
             MIG with nvidia-smi -i N -mig 1 (gpufrac never changes MIG mode)"
        );
    }
    found.retain(|c| {
        let u = uuid_string(&c.uuid);
        !all.iter().any(|g| g.mig && g.uuid == u)
    });
    for c in &mut found {
        let u = uuid_string(&c.uuid);
        if let Some(g) = all.iter().find(|g| g.uuid == u) {
            c.index = g.index;
        }
    }
    Ok((found, planner, Some(Box::new(d))))
}

impl Server {
    /// Books what a previous broker left (leases first, then the queue in
    /// its original order) before any client is accepted, so no GPU is
    /// handed out twice. Jobs whose `gpufrac run` has died are dropped.
    fn restore_jobs(&mut self) {
        let Some(f) = &self.state else { return };
        let (saved, problem) = f.load();
        if let Some(p) = problem {
            warn!("{p}");
        }
        let (mut kept, mut dropped) = (0, 0);
        let mut saved = saved;
        saved.sort_by_key(|j| match j.phase {
            Phase::Running { .. } | Phase::Unplaced => (0, 0),
            Phase::Queued { since } => (1, since),
        });
        let now = self.now();
        for j in saved {
            if !j.alive() || self.jobs.contains_key(&j.token) {
                dropped += 1;
                continue;
            }
            let ok = match (&j.phase, j.request()) {
                (Phase::Unplaced, _) => true,
                (
                    Phase::Running {
                        gpus,
                        mig: Some(uuid),
                    },
                    Some(req),
                ) => match gpus
                    .first()
                    .map(|&ix| self.queue.restore_mig(j.token, req, ix, uuid))
                {
                    Some(Ok(_)) => {
                        self.leased_at.insert(j.token, Instant::now());
                        true
                    }
                    Some(Err(r)) => {
                        warn!(pid = j.pid, "cannot restore a MIG lease: {}", r.reason);
                        false
                    }
                    None => false,
                },
                (Phase::Running { gpus, mig: None }, Some(req)) => {
                    match self.queue.restore(j.token, req, gpus) {
                        Ok(_) => {
                            self.leased_at.insert(j.token, Instant::now());
                            true
                        }
                        Err(r) => {
                            warn!(pid = j.pid, "cannot restore a lease: {}", r.reason);
                            false
                        }
                    }
                }
                (Phase::Queued { since }, Some(req)) => self
                    .queue
                    .submit_since((*since).min(now), j.token, req)
                    .is_ok(),
                _ => false,
            };
            if ok {
                kept += 1;
                self.jobs.insert(j.token, j);
            } else {
                dropped += 1;
            }
        }
        if kept + dropped > 0 {
            info!(kept, dropped, "restored jobs from the state file");
        }
        self.dirty = true;
        self.save_state();
    }
}
