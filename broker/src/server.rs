//! The broker's I/O shell around its core (`proto`): one thread, one mio
//! event loop. It accepts connections and asks the kernel who they are,
//! moves bytes between sockets and the core, arms the core's timers, and
//! hands slow work to threads of its own: state writes (an fsync) and MIG
//! instances (seconds on a real GPU), so that no grant ever waits on them.
//! It never interprets a frame. Every socket is non-blocking; output waits
//! in the core, charged to its user, so a slow or stuck client can only
//! lose its own connection.
//!
//! Service is in bounded turns (SECURITY.md, invariant 1): each turn
//! accepts at most `ACCEPTS_PER_TURN` connections and gives each user with
//! a ready connection its part: its connections in turn, each at most
//! `READ_PER_TURN` bytes and the core's `FRAMES_PER_TURN` frames, until
//! the user's `FRAMES_PER_USER_TURN` are spent; a connection with more
//! waits for the next turn on the ready lists (`Turns`), since the
//! edge-triggered poll will not say again what it already said. So no
//! connection, and no user however many connections it holds, keeps
//! another user from an answer for more than one user's part of a turn.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use tracing::{debug, info, warn};

use crate::mig::Step;
use crate::mig_nvml::MigDriver;
use crate::procs::{Sampler, Telemetry};
use crate::proto::{Broker, ConnId, MigDone, Nanos, RateLimit, WARN_EVERY, Work};
use crate::statefile::StateFile;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const WAKER: Token = Token(2);
const FIRST_CLIENT: usize = 3;
/// Connections accepted per turn, before ready connections are served.
pub const ACCEPTS_PER_TURN: usize = 64;
/// Bytes read from one connection per turn.
pub const READ_PER_TURN: usize = 64 << 10;
/// A client's pidfd is registered under its token with this bit set.
const PIDFD: usize = 1 << (usize::BITS - 2);
const MS: Nanos = 1_000_000;

static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: write(2) is async-signal-safe.
        unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) };
    }
}

fn now() -> Nanos {
    gpufrac_common::clock::mono_ns()
}

/// What `startup` hands the loop.
pub struct Shell {
    pub core: Broker,
    pub listener: UnixListener,
    pub socket: PathBuf,
    pub state: StateFile,
    pub metrics: Option<crate::metrics::Feed>,
    pub mps: Option<crate::mps::Mps>,
    pub mig_driver: Option<Box<dyn MigDriver + Send>>,
    /// The driver, for status's utilisation and per-process memory (None:
    /// no NVML).
    pub sampler: Option<Box<dyn Sampler + Send>>,
}

/// The driver is sampled this often, for status and metrics.
const SAMPLE_EVERY: Nanos = 500 * MS;

/// What the helper threads report.
enum Done {
    Saved(u64, Result<(), String>),
    Mig(MigDone),
    Sampled(Telemetry),
}

struct Client {
    stream: UnixStream,
    /// Registered for writability (output pending).
    want_write: bool,
    /// The poll said readable and a read has not yet found it empty.
    readable: bool,
    /// Readable when the process exits (None: a kernel without pidfds).
    pidfd: Option<OwnedFd>,
    /// The peer's uid, from the kernel at accept: whose turn it shares.
    uid: u32,
}

/// How many frames of one user a turn handles, over all its connections:
/// as many as one connection may send in a turn. A user's share of a
/// turn, not a connection's, is what bounds everyone else's wait: with a
/// budget per connection only, a user holding 128 connections that
/// churned Acquire and Release made every turn 128 connections' work
/// long, each grant after a revoke waited that long, and another user's
/// busy process lost two thirds of its GPU time. Counting frames, not
/// connections, keeps a user with many quiet processes (one frame each)
/// served as quickly as before.
pub const FRAMES_PER_USER_TURN: usize = crate::proto::FRAMES_PER_TURN;

/// What serving a connection once did: the frames handled (a read that
/// handled none still counts as one), and whether it has more to do.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    pub frames: usize,
    pub more: bool,
}

/// Which connections get a turn next: round-robin over the users with
/// something to do, and within each user over its ready connections until
/// the user's `FRAMES_PER_USER_TURN` are spent. The shell's scheduling,
/// kept apart from sockets so that its rule is tested on its own.
#[derive(Debug, Default)]
pub struct Turns {
    /// Each user's ready connections, in the order they are served.
    users: HashMap<u32, VecDeque<ConnId>>,
    /// Users with a ready connection, in the order they are served.
    order: VecDeque<u32>,
    /// The ready connections (each in its user's line once).
    queued: HashSet<ConnId>,
    /// The listener may have connections waiting in its backlog.
    pub listener: bool,
}

impl Turns {
    /// `id`, a connection of `uid`, has something to do: it gets a turn
    /// (once, however often this is said before its turn comes).
    pub fn push(&mut self, id: ConnId, uid: u32) {
        if !self.queued.insert(id) {
            return;
        }
        let q = self.users.entry(uid).or_default();
        if q.is_empty() {
            self.order.push_back(uid);
        }
        q.push_back(id);
    }

    /// One turn: each user with a ready connection, in order, has its
    /// connections served (`serve`), each once, from the front of its
    /// line until its frames for the turn are spent or none is left. A
    /// connection with more to do goes to the back of its user's line; a
    /// user with connections left waits for the next turn, behind every
    /// other.
    pub fn run(&mut self, mut serve: impl FnMut(ConnId) -> Served) {
        for _ in 0..self.order.len() {
            let Some(uid) = self.order.pop_front() else {
                break;
            };
            let mut left = FRAMES_PER_USER_TURN;
            // Served once a turn at most: those with more wait behind the
            // rest of their user's line.
            let mut again = Vec::new();
            while left > 0 {
                let Some(id) = self.users.get_mut(&uid).and_then(|q| q.pop_front()) else {
                    break;
                };
                self.queued.remove(&id);
                let s = serve(id);
                left = left.saturating_sub(s.frames.max(1));
                if s.more {
                    again.push(id);
                }
            }
            for id in again {
                if self.queued.insert(id) {
                    self.users.entry(uid).or_default().push_back(id);
                }
            }
            if self.users.get(&uid).is_some_and(|q| !q.is_empty()) {
                self.order.push_back(uid);
            } else {
                self.users.remove(&uid);
            }
        }
    }

    /// Whether another turn is due at once (no waiting in poll).
    pub fn busy(&self) -> bool {
        self.listener || !self.order.is_empty()
    }
}

struct Loop {
    core: Broker,
    poll: Poll,
    listener: UnixListener,
    clients: HashMap<Token, Client>,
    next_token: usize,
    turns: Turns,
    readbuf: Vec<u8>,
    /// Held open so that, out of file descriptors, the broker can still
    /// accept a connection to close it (else the listener stays readable
    /// and the backlog fills with clients who wait forever).
    reserve: Option<std::fs::File>,
    saver: Option<Sender<Snapshot>>,
    mig: Option<Sender<Work>>,
    done: Receiver<Done>,
    metrics: Option<crate::metrics::Feed>,
    last_metrics: Nanos,
    /// The sampler thread, asked with the UUIDs to sample; whether a
    /// sample is being taken, and when the last was asked for.
    sampler: Option<Sender<Vec<String>>>,
    sampling: bool,
    last_sample: Nanos,
    mps: Option<crate::mps::Mps>,
    /// The warning that the broker is out of file descriptors.
    out_of_fds: RateLimit,
}

fn reserve_fd() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

/// Runs the loop until SIGTERM/SIGINT.
pub fn serve(shell: Shell) -> Result<(), String> {
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
    let Shell {
        core,
        mut listener,
        socket,
        state,
        metrics,
        mps,
        mig_driver,
        sampler,
    } = shell;
    poll.registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    poll.registry()
        .register(&mut SourceFd(&fds[0]), SIGNALS, Interest::READABLE)
        .map_err(|e| e.to_string())?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(|e| e.to_string())?);
    let (done_tx, done) = channel();
    let state_path = state.path().to_path_buf();
    let (saver, saver_thread) = spawn_saver(state, done_tx.clone(), waker.clone())?;
    let sampler = match sampler {
        Some(s) => Some(spawn_sampler(s, done_tx.clone(), waker.clone())?),
        None => None,
    };
    let mig = match mig_driver {
        Some(d) => Some(spawn_mig(d, done_tx, waker)?),
        None => None,
    };
    let mut l = Loop {
        core,
        poll,
        listener,
        clients: HashMap::new(),
        next_token: FIRST_CLIENT,
        turns: Turns::default(),
        readbuf: Vec::new(),
        reserve: reserve_fd(),
        saver: Some(saver),
        mig,
        done,
        metrics,
        last_metrics: 0,
        sampler,
        sampling: false,
        last_sample: 0,
        mps,
        out_of_fds: RateLimit::new(WARN_EVERY),
    };
    let result = l.run();
    if let Some(m) = l.mps.as_mut() {
        m.quit();
    }
    let _ = std::fs::remove_file(&socket);
    // The last write finishes before the file goes: a clean stop ends
    // every lease (the runs see the socket close); only a crash leaves
    // state for the next broker.
    drop(l.saver.take());
    let _ = saver_thread.join();
    StateFile::new(state_path).remove();
    result
}

/// A state snapshot to write: its number and its bytes.
type Snapshot = (u64, Vec<u8>);

/// Writes state snapshots on a thread of its own: an fsync may take long
/// on a busy disk, and grants must not wait for it.
fn spawn_saver(
    state: StateFile,
    done: Sender<Done>,
    waker: Arc<Waker>,
) -> Result<(Sender<Snapshot>, std::thread::JoinHandle<()>), String> {
    let (tx, rx) = channel::<Snapshot>();
    let t = std::thread::Builder::new()
        .name("state".into())
        .spawn(move || {
            for (seq, bytes) in rx {
                let r = state
                    .save(&bytes)
                    .map_err(|e| format!("{}: {e}", state.path().display()));
                if done.send(Done::Saved(seq, r)).is_err() {
                    return;
                }
                let _ = waker.wake();
            }
        })
        .map_err(|e| format!("cannot start the state writer: {e}"))?;
    Ok((tx, t))
}

/// Asks the driver on a thread of its own: an NVML call may take long on a
/// busy driver, and the loop must not wait for it.
fn spawn_sampler(
    sampler: Box<dyn Sampler + Send>,
    done: Sender<Done>,
    waker: Arc<Waker>,
) -> Result<Sender<Vec<String>>, String> {
    let (tx, rx) = channel::<Vec<String>>();
    std::thread::Builder::new()
        .name("telemetry".into())
        .spawn(move || {
            for uuids in rx {
                if done.send(Done::Sampled(sampler.sample(&uuids))).is_err() {
                    return;
                }
                let _ = waker.wake();
            }
        })
        .map_err(|e| format!("cannot start the telemetry sampler: {e}"))?;
    Ok(tx)
}

/// Carries out MIG steps on a thread of its own, one lease at a time.
fn spawn_mig(
    mut driver: Box<dyn MigDriver + Send>,
    done: Sender<Done>,
    waker: Arc<Waker>,
) -> Result<Sender<Work>, String> {
    let (tx, rx) = channel::<Work>();
    std::thread::Builder::new()
        .name("mig".into())
        .spawn(move || {
            for w in rx {
                let Work::Mig { lease, gpu, steps } = w;
                let d = make_instance(driver.as_mut(), lease, gpu, &steps);
                if done.send(Done::Mig(d)).is_err() {
                    return;
                }
                let _ = waker.wake();
            }
        })
        .map_err(|e| format!("cannot start the MIG worker: {e}"))?;
    Ok(tx)
}

/// A MIG lease's steps through NVML: idle instances in the way destroyed,
/// the job's created; after a failure, the GPU's instances as they are.
fn make_instance(driver: &mut dyn MigDriver, lease: u64, gpu: u32, steps: &[Step]) -> MigDone {
    let mut destroyed = Vec::new();
    let mut made = None;
    let mut failure = None;
    for step in steps {
        match *step {
            Step::Destroy { gi } => match driver.destroy(gpu, gi) {
                Ok(()) => destroyed.push(gi),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            },
            Step::Create { profile, placement } => match driver.create(gpu, profile, placement) {
                Ok(m) => made = Some(m),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            },
        }
    }
    let result = match (failure, made) {
        (None, Some(m)) => Ok(m),
        (failure, _) => {
            let e = failure.unwrap_or_else(|| "no instance was created".into());
            Err((e, driver.instances(gpu).ok()))
        }
    };
    MigDone {
        lease,
        gpu,
        destroyed,
        result,
    }
}

impl Loop {
    fn run(&mut self) -> Result<(), String> {
        let mut events = Events::with_capacity(256);
        loop {
            let timeout = self.timeout();
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(format!("poll: {e}"));
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.turns.listener = true,
                    SIGNALS => {
                        info!("shutting down");
                        return Ok(());
                    }
                    WAKER => {}
                    Token(t) if t & PIDFD != 0 => self.core.exited((t & !PIDFD) as ConnId),
                    tok => {
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            if let Some(c) = self.clients.get_mut(&tok) {
                                c.readable = true;
                            }
                            self.ready(tok.0 as ConnId);
                        }
                        if ev.is_writable() {
                            self.flush(tok.0 as ConnId);
                        }
                    }
                }
            }
            self.turn();
            while let Ok(d) = self.done.try_recv() {
                match d {
                    Done::Saved(seq, r) => self.core.state_saved(now(), seq, r),
                    Done::Mig(m) => self.core.mig_done(now(), m),
                    Done::Sampled(t) => {
                        self.sampling = false;
                        self.core.telemetry(now(), t);
                    }
                }
            }
            self.sample();
            if self.core.next_timeout().is_some_and(|t| t <= now()) {
                self.core.handle_timeout(now());
            }
            for id in self.core.take_unblocked() {
                self.ready(id);
            }
            if let Some(st) = self.mps.as_mut().and_then(|m| m.poll()) {
                self.core.set_mps(Some(st));
            }
            self.settle();
            self.refresh_metrics();
        }
    }

    /// Until the core's next timer, the MPS daemon's next look, or the
    /// next metrics refresh.
    fn timeout(&self) -> Option<Duration> {
        if self.turns.busy() {
            return Some(Duration::ZERO);
        }
        let t = now();
        let mut next = self.core.next_timeout();
        let mut at = |x: Nanos| next = Some(next.map_or(x, |n: Nanos| n.min(x)));
        if self.mps.is_some() {
            at(t + 250 * MS);
        }
        if self.metrics.is_some() {
            at(self.last_metrics + 500 * MS);
        }
        if self.sampler.is_some() && !self.sampling {
            at(self.last_sample + SAMPLE_EVERY);
        }
        next.map(|n| Duration::from_nanos(n.saturating_sub(t)))
    }

    /// Writes what the core has for each client, closes those it is done
    /// with, and hands out work, until nothing changes: closing one client
    /// can produce a grant for another, and sending can reveal a dead one.
    fn settle(&mut self) {
        // A deadline passed while the client's bytes may still sit unread
        // in its socket (this loop was busy elsewhere): read them, then let
        // the core decide.
        for id in self.core.take_overdue() {
            // Frames the core held back to keep turns bounded come first;
            // then what the socket holds.
            while self.core.has_frames(id) {
                self.core.serve(now(), id);
            }
            self.read(Token(id as usize));
            self.core.expire(now(), id);
        }
        loop {
            for id in self.core.pending_output() {
                self.flush(id);
            }
            let dead = self.core.dead();
            if dead.is_empty() {
                break;
            }
            for id in dead {
                // Say what can still be said (an error frame) first.
                self.flush(id);
                if let Some(mut c) = self.clients.remove(&Token(id as usize)) {
                    let _ = self.poll.registry().deregister(&mut c.stream);
                    if let Some(p) = &c.pidfd {
                        let _ = self
                            .poll
                            .registry()
                            .deregister(&mut SourceFd(&p.as_raw_fd()));
                    }
                }
                self.core.remove(now(), id);
            }
            // The descriptors just closed make room for connections still
            // waiting in the backlog, which the edge-triggered listener
            // will not report again: the next turn accepts them.
            self.turns.listener = true;
        }
        while let Some(w) = self.core.poll_work() {
            match &self.mig {
                Some(tx) if tx.send(w.clone()).is_ok() => {}
                _ => {
                    let Work::Mig { lease, gpu, .. } = w;
                    self.core.mig_done(
                        now(),
                        MigDone {
                            lease,
                            gpu,
                            destroyed: Vec::new(),
                            result: Err(("the broker has no MIG driver".into(), None)),
                        },
                    );
                }
            }
        }
        if let Some((seq, bytes)) = self.core.take_state(now()) {
            let sent = self
                .saver
                .as_ref()
                .is_some_and(|s| s.send((seq, bytes)).is_ok());
            if !sent {
                self.core
                    .state_saved(now(), seq, Err("the state writer has stopped".into()));
            }
        }
    }

    /// One turn: a bounded number of accepts, then each user's ready
    /// connections served within the user's budget.
    fn turn(&mut self) {
        if self.turns.listener {
            self.turns.listener = self.accept();
        }
        let mut turns = std::mem::take(&mut self.turns);
        turns.run(|id| {
            let before = self.core.frames_handled();
            let more = self.serve(id);
            Served {
                frames: (self.core.frames_handled() - before) as usize,
                more,
            }
        });
        // Serving queues nothing itself: the loop's events do, outside
        // the turn.
        debug_assert!(!self.turns.busy());
        self.turns = turns;
    }

    /// `id` has something to do: it is queued for a turn in its user's
    /// line (a connection already closed has nothing more to do).
    fn ready(&mut self, id: ConnId) {
        if let Some(c) = self.clients.get(&Token(id as usize)) {
            self.turns.push(id, c.uid);
        }
    }

    /// Accepts up to `ACCEPTS_PER_TURN` connections; true if the backlog
    /// may hold more.
    fn accept(&mut self) -> bool {
        for _ in 0..ACCEPTS_PER_TURN {
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let Some(crate::listen::Accepted { peer, pidfd }) =
                        crate::listen::peer(stream.as_raw_fd())
                    else {
                        // The kernel cannot say who it is, or it has
                        // exited already: nobody to trust.
                        continue;
                    };
                    let tok = Token(self.next_token);
                    self.next_token += 1;
                    let id = tok.0 as ConnId;
                    let uid = peer.uid;
                    if let Err(frame) = self.core.connect(now(), id, peer) {
                        // Said and closed at once, without buffering: the
                        // write of one small frame to a fresh socket does
                        // not block.
                        let _ = stream.write(&frame);
                        continue;
                    }
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, tok, Interest::READABLE)
                    {
                        warn!("register client: {e}");
                        self.core.hangup(id);
                        continue;
                    }
                    if let Some(p) = &pidfd
                        && let Err(e) = self.poll.registry().register(
                            &mut SourceFd(&p.as_raw_fd()),
                            Token(tok.0 | PIDFD),
                            Interest::READABLE,
                        )
                    {
                        warn!("register a client's pidfd: {e}");
                        self.core.hangup(id);
                    }
                    self.clients.insert(
                        tok,
                        Client {
                            stream,
                            want_write: false,
                            // Whatever it sent before the accept: the
                            // poll may not say so again.
                            readable: true,
                            pidfd,
                            uid,
                        },
                    );
                    self.turns.push(id, uid);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of descriptors: free the reserve, take the
                    // connection off the backlog and close it, so the
                    // client hears "closed" instead of hanging.
                    if self.out_of_fds.ready(now()) {
                        warn!(
                            "out of file descriptors ({e}); closing new connections until some close"
                        );
                    }
                    if self.reserve.take().is_none() {
                        // Nothing to free; the loop retries after the next
                        // sweep has closed stale connections.
                        return false;
                    }
                    let shed = self.listener.accept();
                    self.reserve = reserve_fd();
                    match shed {
                        Ok((stream, _)) => drop(stream),
                        Err(_) => return false,
                    }
                    // The listener is edge-triggered: drain the backlog,
                    // a turn at a time.
                }
                Err(e) => {
                    warn!("accept: {e}");
                    return false;
                }
            }
        }
        true
    }

    /// `id`'s turn: frames the core held back, or else at most
    /// `READ_PER_TURN` bytes from its socket. True if it has more to do
    /// (it then waits for the next turn, behind every other).
    fn serve(&mut self, id: ConnId) -> bool {
        let tok = Token(id as usize);
        if self.core.has_frames(id) {
            self.core.serve(now(), id);
        } else {
            self.read(tok);
        }
        let readable = self.clients.get(&tok).is_some_and(|c| c.readable);
        self.core.has_frames(id) || (readable && self.core.wants_input(id))
    }

    fn read(&mut self, tok: Token) {
        let id = tok.0 as ConnId;
        // One buffer for the whole loop, not a zeroed 16 KiB per read.
        let mut buf = std::mem::take(&mut self.readbuf);
        buf.resize(16 * 1024, 0);
        let mut left = READ_PER_TURN;
        while left > 0 && self.core.wants_input(id) {
            let Some(c) = self.clients.get_mut(&tok) else {
                break;
            };
            let want = left.min(buf.len());
            match c.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    c.readable = false;
                    self.core.hangup(id);
                    break;
                }
                Ok(n) => {
                    left -= n;
                    self.core.input(now(), id, &buf[..n]);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.readable = false;
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.readable = false;
                    self.core.hangup(id);
                    break;
                }
            }
        }
        self.readbuf = buf;
    }

    fn flush(&mut self, id: ConnId) {
        let tok = Token(id as usize);
        let Some(c) = self.clients.get_mut(&tok) else {
            return;
        };
        loop {
            let out = self.core.output(id);
            if out.is_empty() {
                break;
            }
            match c.stream.write(out) {
                Ok(0) => {
                    self.core.hangup(id);
                    break;
                }
                Ok(n) => self.core.consumed(id, n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.core.hangup(id);
                    break;
                }
            }
        }
        // Ask for writability only while output is pending, and tell epoll
        // only when that changes: a syscall per flush is most of the cost
        // of a grant otherwise.
        let pending = !self.core.output(id).is_empty();
        if pending != c.want_write {
            c.want_write = pending;
            let want = if pending {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            if let Err(e) = self.poll.registry().reregister(&mut c.stream, tok, want) {
                debug!("reregister client: {e}");
            }
        }
    }

    /// Asks the sampler for the driver's view, every `SAMPLE_EVERY`, one
    /// sample at a time.
    fn sample(&mut self) {
        let Some(tx) = &self.sampler else {
            return;
        };
        let t = now();
        if self.sampling || t.saturating_sub(self.last_sample) < SAMPLE_EVERY {
            return;
        }
        self.last_sample = t;
        self.sampling = tx.send(self.core.telemetry_uuids()).is_ok();
        if !self.sampling {
            self.sampler = None;
        }
    }

    /// Hands the metrics thread a snapshot; it renders and serves it
    /// without the loop.
    fn refresh_metrics(&mut self) {
        let Some(m) = &self.metrics else {
            return;
        };
        let t = now();
        if t.saturating_sub(self.last_metrics) < 500 * MS {
            return;
        }
        self.last_metrics = t;
        m.publish(t, self.core.status(t), self.core.stats().counters());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One turn in which every connection served handles `frames` and
    /// has more to do as `more` says; the order they were served in.
    fn turn(
        t: &mut Turns,
        frames: impl Fn(ConnId) -> usize,
        more: impl Fn(ConnId) -> bool,
    ) -> Vec<ConnId> {
        let mut served = Vec::new();
        t.run(|id| {
            served.push(id);
            Served {
                frames: frames(id),
                more: more(id),
            }
        });
        served
    }

    #[test]
    fn each_ready_connection_gets_one_turn_in_order() {
        let mut t = Turns::default();
        assert!(!t.busy());
        t.push(1, 10);
        t.push(2, 20);
        t.push(1, 10);
        assert!(t.busy());
        assert_eq!(turn(&mut t, |_| 1, |_| false), [1, 2]);
        assert!(!t.busy());
        // With more to do after its turn, it comes after those that
        // became ready meanwhile.
        assert!(turn(&mut t, |_| 1, |_| false).is_empty());
        t.push(1, 10);
        assert_eq!(turn(&mut t, |_| FRAMES_PER_USER_TURN, |id| id == 1), [1]);
        t.push(3, 30);
        assert_eq!(turn(&mut t, |_| 1, |_| false), [1, 3]);
        t.listener = true;
        assert!(t.busy());
    }

    #[test]
    fn a_user_with_many_busy_connections_gets_one_users_part_of_a_turn() {
        let mut t = Turns::default();
        for id in 100..228 {
            t.push(id, 65534);
        }
        t.push(1, 5001);
        // Each of the flood's connections has a full turn's frames: one
        // of them is served a turn, the victim every turn it is ready.
        let full = |id| if id >= 100 { FRAMES_PER_TURN_OF_ONE } else { 1 };
        assert_eq!(turn(&mut t, full, |id| id >= 100), [100, 1]);
        t.push(1, 5001);
        assert_eq!(turn(&mut t, full, |id| id >= 100), [101, 1]);
        assert_eq!(turn(&mut t, full, |id| id >= 100), [102]);
    }

    const FRAMES_PER_TURN_OF_ONE: usize = crate::proto::FRAMES_PER_TURN;

    #[test]
    fn a_user_with_many_quiet_connections_is_served_as_many_a_turn_as_its_frames_allow() {
        let mut t = Turns::default();
        for id in 0..200 {
            t.push(id, 0);
        }
        let first = turn(&mut t, |_| 1, |_| false);
        assert_eq!(
            first,
            (0..FRAMES_PER_USER_TURN as ConnId).collect::<Vec<_>>()
        );
        // A read that handled no frame (half a frame) still costs one.
        let second = turn(&mut t, |_| 0, |_| false);
        assert_eq!(second.len(), FRAMES_PER_USER_TURN);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// However many users hold however many connections, each
        /// handling whatever it may per serve and having more to do or
        /// not: a connection is served once a turn at most, a user's turn
        /// is charged at most its budget plus one connection's frames; a
        /// user with one connection is served in
        /// every turn it is ready; and every ready connection is served
        /// within as many turns as its user has connections.
        #[test]
        fn a_connection_waits_for_its_own_users_others_only(
            users in prop::collection::vec(1..40u64, 1..6),
            load in prop::collection::vec((0..=64usize, any::<bool>()), 1..300),
            steps in prop::collection::vec((any::<bool>(), any::<u64>()), 1..60),
        ) {
            let mut t = Turns::default();
            // Connection ids: user u's are u * 1000 ..; the victim's 1.
            let uid_of = |id: ConnId| (id / 1000) as u32;
            let victim = 1;
            let mut waited: HashMap<ConnId, usize> = HashMap::new();
            for (u, &n) in users.iter().enumerate() {
                for k in 0..n {
                    let id = (u as u64 + 1) * 1000 + k;
                    t.push(id, uid_of(id));
                    waited.insert(id, 0);
                }
            }
            let frames = |id: ConnId, salt: u64| load[((id ^ salt) as usize) % load.len()];
            for (ready, salt) in steps {
                if ready && !waited.contains_key(&victim) {
                    t.push(victim, uid_of(victim));
                    waited.insert(victim, 0);
                }
                let mut charged: HashMap<u32, usize> = HashMap::new();
                let mut served = Vec::new();
                t.run(|id| {
                    let (f, more) = frames(id, salt);
                    *charged.entry(uid_of(id)).or_default() += f.max(1);
                    served.push((id, more));
                    Served { frames: f, more: more && id != victim }
                });
                for (&uid, &c) in &charged {
                    prop_assert!(
                        c < FRAMES_PER_USER_TURN + FRAMES_PER_TURN_OF_ONE,
                        "user {} charged {} frames in a turn", uid, c
                    );
                }
                let mut once = std::collections::HashSet::new();
                prop_assert!(served.iter().all(|&(id, _)| once.insert(id)), "served twice in a turn");
                if waited.contains_key(&victim) {
                    prop_assert!(served.iter().any(|&(id, _)| id == victim));
                }
                for (id, more) in served {
                    waited.remove(&id);
                    if more && id != victim {
                        waited.insert(id, 0);
                    }
                }
                for (&id, w) in waited.iter_mut() {
                    *w += 1;
                    let line = users.get((id / 1000) as usize - 1).copied().unwrap_or(1);
                    prop_assert!(*w <= line as usize, "connection {} waited {} turns", id, w);
                }
            }
        }
    }
}
