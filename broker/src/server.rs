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
//! accepts at most `ACCEPTS_PER_TURN` connections, then the core runs its
//! turn (`Broker::turn`: each user with a ready connection its part,
//! charged in work), reading sockets through this loop when it asks. The
//! rule of who is served, and for how long, is the core's alone; the loop
//! only tells it which sockets the poll found readable and runs turns
//! while it is `busy` (the edge-triggered poll will not say again what it
//! already said).

use std::collections::HashMap;
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
use crate::proto::{
    Broker, ConnId, Kept, MigDone, Nanos, RateLimit, Read as Got, Sockets, WARN_EVERY, Work,
};
use crate::statefile::StateFile;

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
const WAKER: Token = Token(2);
const FIRST_CLIENT: usize = 3;
/// Connections accepted per turn, before ready connections are served.
pub const ACCEPTS_PER_TURN: usize = 64;
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
    pub state: StateFile,
    /// The private directory to remove at a clean stop when nothing is
    /// left in it: the one the broker made at start, or the socket's
    /// default one (a test suite's brokers once left them behind, by the
    /// dozen, under /run/gpufrac/state).
    pub made_dir: Option<PathBuf>,
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
    /// Readable when the process exits (None: a kernel without pidfds);
    /// held open while the client is, in the poll until closed with it.
    _pidfd: Option<OwnedFd>,
    /// The poll said the peer hung up. Until then a short read is all
    /// the socket held, and the edge-triggered poll reports the next
    /// bytes; after it, no edge comes again, so reads go on to the end.
    hung_up: bool,
}

struct Loop {
    core: Broker,
    poll: Poll,
    listener: UnixListener,
    clients: HashMap<Token, Client>,
    next_token: usize,
    /// The listener may have connections waiting in its backlog.
    backlog: bool,
    /// Accepting stopped short of the backlog's end (out of descriptors,
    /// or an error): the edge-triggered listener will not say so again,
    /// so the next close looks at the backlog.
    starved: bool,
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
        state,
        made_dir,
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
        backlog: false,
        starved: false,
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
    let kept = l.core.stop_state();
    if let Some(m) = l.mps.as_mut() {
        if kept.is_some() {
            // The kept leases' jobs run on as its clients: quitting it
            // would stop their servers under them. The next broker takes
            // it over (`Mps::start`).
            info!(
                pipe = %m.pipe_dir.display(),
                "leaving the MPS control daemon running for the jobs whose leases are kept"
            );
        } else {
            m.quit();
        }
    }
    // The socket stays where it is, stale: a path that is never free is
    // one nobody else can take between this stop and the next start (the
    // next broker renames its own over it; clients see a refused
    // connection, as with no broker).
    // The last write finishes first; then what the core holds now, which
    // a coalesced write may not have caught, is written over it.
    drop(l.saver.take());
    let _ = saver_thread.join();
    keep_or_remove(StateFile::new(state_path), kept, made_dir);
    result
}

/// A clean stop (a restart, an upgrade, a rollout's SIGTERM) keeps the
/// leases of running jobs for the next broker, as a crash does: it books
/// them before it accepts anyone, and each run claims its own back (those
/// whose run died meanwhile are dropped). With no run alive nothing needs
/// to outlive the stop, and the file and the private directory go.
fn keep_or_remove(state: StateFile, kept: Option<Kept>, made_dir: Option<PathBuf>) {
    let Some(k) = kept else {
        state.remove();
        if let Some(d) = made_dir {
            // rmdir: only an empty directory goes (MPS's log stays, and
            // the directory with it), and a link in its place is never
            // followed.
            let _ = std::fs::remove_dir(d);
        }
        info!("stopped: no job was running; nothing left for a next broker");
        return;
    };
    if let Err(e) = state.save(&k.bytes) {
        // The last write that did go stays: the next broker drops what
        // ended since, and a run it does not know is refused its claim.
        warn!(
            "cannot write the state file at the stop: {}: {e}; the next broker gets the one written last",
            state.path().display()
        );
    }
    info!(
        leases = k.leases,
        queued = k.queued,
        unplaced = k.unplaced,
        state = %state.path().display(),
        "stopped: kept {} lease{} for the next broker ({} queued requests, {} jobs without placement); \
         the next broker books them and each run claims its own back",
        k.leases,
        if k.leases == 1 { "" } else { "s" },
        k.queued,
        k.unplaced
    );
}

/// The clients' sockets and the clock, as the core's turn asks for them.
struct Live<'a>(&'a mut HashMap<Token, Client>);

impl Sockets for Live<'_> {
    fn now(&mut self) -> Nanos {
        now()
    }

    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Got {
        let Some(c) = self.0.get_mut(&Token(id as usize)) else {
            return Got::Closed;
        };
        loop {
            return match c.stream.read(buf) {
                Ok(0) => Got::Closed,
                // A stream socket's read stops short only when it has
                // nothing more: the read that would say so is saved.
                Ok(n) if n < buf.len() && !c.hung_up => Got::Drained(n),
                Ok(n) => Got::Bytes(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Got::WouldBlock,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => Got::Closed,
            };
        }
    }
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
    mut sampler: Box<dyn Sampler + Send>,
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
        // Status shows the daemon from the first request on: the loop's
        // own look at it comes after the turn's events, and a client
        // waiting on the socket is one of them.
        if let Some(st) = self.mps.as_mut().and_then(|m| m.poll()) {
            self.core.set_mps(Some(st));
        }
        loop {
            let timeout = self.timeout();
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(format!("poll: {e}"));
            }
            // A process's last frames (a usage report sent at exit) may
            // sit in its socket when its pidfd says it is gone: its
            // connection is read in this turn, and closed after it.
            let mut exited = Vec::new();
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.backlog = true,
                    SIGNALS => {
                        info!("shutting down");
                        return Ok(());
                    }
                    WAKER => {}
                    Token(t) if t & PIDFD != 0 => {
                        let id = (t & !PIDFD) as ConnId;
                        self.core.readable(id);
                        exited.push(id);
                    }
                    tok => {
                        if (ev.is_read_closed() || ev.is_error())
                            && let Some(c) = self.clients.get_mut(&tok)
                        {
                            c.hung_up = true;
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.core.readable(tok.0 as ConnId);
                        }
                        if ev.is_writable() {
                            self.flush(tok.0 as ConnId);
                        }
                    }
                }
            }
            self.turn();
            for id in exited {
                self.core.exited(id);
            }
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
        if self.backlog || self.core.busy() {
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
                // Closing a descriptor takes it out of the poll (nothing
                // else holds it open): no deregistering, two fewer
                // syscalls per connection.
                drop(self.clients.remove(&Token(id as usize)));
                self.core.remove(now(), id);
            }
            // The descriptors just closed make room for connections still
            // waiting in the backlog if accepting stopped for want of
            // them, which the edge-triggered listener will not report
            // again: the next turn accepts them. Otherwise the backlog was
            // drained to its end, and each close is no accept.
            self.backlog |= std::mem::take(&mut self.starved);
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

    /// One turn: a bounded number of accepts, then the core's turn, its
    /// reads done here when it asks.
    fn turn(&mut self) {
        if self.backlog {
            self.backlog = self.accept();
        }
        self.core.turn(&mut Live(&mut self.clients));
    }

    /// Accepts up to `ACCEPTS_PER_TURN` connections; true if the backlog
    /// may hold more.
    fn accept(&mut self) -> bool {
        for i in 0..ACCEPTS_PER_TURN {
            // The listener is edge-triggered: the backlog is drained to its
            // end, which after an accept a poll says, where an accept that
            // finds nobody would make a socket and a descriptor and free
            // them again. One that arrives after the poll is a new edge.
            if i > 0 && !self.backlog_waits() {
                return false;
            }
            match self.listener.accept() {
                Ok((mut stream, _)) => {
                    let Some(crate::listen::Accepted { peer, pidfd }) =
                        crate::listen::peer(stream.as_raw_fd(), self.core.reads_groups())
                    else {
                        // The kernel cannot say who it is, or it has
                        // exited already: nobody to trust.
                        continue;
                    };
                    let tok = Token(self.next_token);
                    self.next_token += 1;
                    let id = tok.0 as ConnId;
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
                    // Whatever it sent before the accept, which the poll
                    // may not say again, is read at its first turn.
                    self.clients.insert(
                        tok,
                        Client {
                            stream,
                            want_write: false,
                            _pidfd: pidfd,
                            hung_up: false,
                        },
                    );
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
                        self.starved = true;
                        return false;
                    }
                    let shed = self.listener.accept();
                    self.reserve = reserve_fd();
                    match shed {
                        Ok((stream, _)) => drop(stream),
                        Err(_) => {
                            self.starved = true;
                            return false;
                        }
                    }
                    // The listener is edge-triggered: drain the backlog,
                    // a turn at a time.
                }
                Err(e) => {
                    warn!("accept: {e}");
                    self.starved = true;
                    return false;
                }
            }
        }
        true
    }

    /// Whether a connection waits in the listener's backlog (or the poll
    /// cannot say).
    fn backlog_waits(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll of one pollfd, without waiting.
        unsafe { libc::poll(&mut p, 1, 0) != 0 }
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

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpufrac-stop-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn kept(bytes: &[u8]) -> Kept {
        Kept {
            bytes: bytes.to_vec(),
            leases: 1,
            queued: 0,
            unplaced: 0,
        }
    }

    /// With a job running, the stop writes what the core holds over the
    /// last coalesced write and leaves file and directory for the next
    /// broker; with none, both go.
    #[test]
    fn a_clean_stop_keeps_the_state_only_while_jobs_run() {
        let d = dir("keep");
        let state = d.join("state");
        StateFile::new(state.clone()).save(b"older").unwrap();
        keep_or_remove(
            StateFile::new(state.clone()),
            Some(kept(b"newest")),
            Some(d.clone()),
        );
        assert_eq!(std::fs::read(&state).unwrap(), b"newest");
        keep_or_remove(StateFile::new(state.clone()), None, Some(d.clone()));
        assert!(!d.exists(), "the private directory is left");
    }
}
