//! The shim's side of the broker: the client thread, which owns the
//! connection and runs the broker session.
//!
//! The thread starts at the first context creation (never earlier). It
//! connects, hands what happens (messages, its ticks, a lost connection)
//! to the session (`session.rs`, where every decision is made and tested
//! in virtual time) and applies the actions it gets back to the compute
//! gate (`compute.rs`, what application threads pass through) and the
//! socket. If the broker goes away it keeps retrying and re-registers when
//! it returns; meanwhile launches run unarbitrated (or block, with
//! GPUFRAC_BROKER=required). A second thread drains released devices.
//!
//! No wait on the broker is unbounded (see `watch.rs`): connecting and the
//! handshake have a deadline, and a broker that stops answering (SIGSTOP,
//! wedged) while this process waits on it is treated as gone.

mod compute;

pub use self::compute::{Pass, launched, may_launch, may_launch_now, syncing};
use self::compute::{device_count, now_ns};
use crate::driver::call;
use crate::ledger::{LEDGERS, NO_LIMIT};
use crate::session::{Action, Event, Note, STALL_S, Session};
use crate::{boundary, config, contexts, devices};
use gpufrac_common::config::{BrokerMode, MAX_DEVICES, ShimConfig};
use gpufrac_common::cuda::*;
use gpufrac_common::net;
use gpufrac_common::wire::{self, ClientMsg, DeviceReg, Role, ServerMsg};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

static STARTED: AtomicU8 = AtomicU8::new(0);

/// Connecting and the handshake, per attempt of the client thread (which
/// retries every ~0.5 s anyway). A live broker answers in microseconds; a
/// full accept queue (a flood of idle connections) or a stopped broker
/// never does, and `connect` on a Unix socket would block with it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The same for the one attempt `GPUFRAC_BROKER=required` makes in cuInit,
/// whose failure fails the process: more patience with a busy broker.
const REQUIRED_TIMEOUT: Duration = Duration::from_secs(5);
pub fn on_context_created() {
    let Ok(cfg) = config::config() else { return };
    if cfg.broker == BrokerMode::Off {
        return;
    }
    if STARTED.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        static FORK_HANDLER: std::sync::Once = std::sync::Once::new();
        // SAFETY: registering a plain extern "C" callback, once (a forked
        // child inherits it).
        FORK_HANDLER.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(after_fork_child));
        });
        let spawned = std::thread::Builder::new()
            .name("gpufrac-client".into())
            .spawn(move || contained("broker session", || client_thread(cfg)));
        if spawned.is_err() {
            warn!("could not start the broker client thread; compute is not arbitrated");
            return;
        }
        // The broker may impose the job's memory cap (its lease's), and
        // the first allocation must already be under it: wait for the
        // first registration to be answered, or to fail, a bounded time.
        let mut done = FIRST_REGISTRATION
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let deadline = std::time::Instant::now() + Duration::from_millis(1500);
        while !*done {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            done = FIRST_REGISTRATION
                .1
                .wait_timeout(done, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Set once the first registration was answered or could not be made.
static FIRST_REGISTRATION: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

fn first_registration_done() {
    let mut done = FIRST_REGISTRATION
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !*done {
        *done = true;
        FIRST_REGISTRATION.1.notify_all();
    }
}

/// `GPUFRAC_BROKER=required`: called from cuInit; fails initialisation when
/// no broker answers within `REQUIRED_TIMEOUT`.
pub fn check_required(cfg: &ShimConfig) -> Result<(), u32> {
    // Frameworks call cuInit more than once; one successful check is enough.
    static CHECKED: AtomicBool = AtomicBool::new(false);
    if cfg.broker != BrokerMode::Required || CHECKED.load(Acquire) {
        return Ok(());
    }
    match connect(cfg, REQUIRED_TIMEOUT) {
        Ok(_) => {
            CHECKED.store(true, Release);
            Ok(())
        }
        Err(e) => {
            let hint = match e {
                ConnectFail::Silent(_) => "set GPUFRAC_BROKER=optional to run without it",
                ConnectFail::Other(_) => {
                    "start one with `gpufrac broker` or set GPUFRAC_BROKER=optional"
                }
            };
            crate::log::write_line(format_args!(
                "GPUFRAC_BROKER=required but {}; {hint}",
                e.what(&cfg.socket)
            ));
            Err(CUDA_ERROR_SYSTEM_NOT_READY)
        }
    }
}

/// Why no session with the broker could be opened.
enum ConnectFail {
    /// It did not complete the handshake within this time: accept queue
    /// full, stopped, or wedged.
    Silent(Duration),
    Other(String),
}

impl ConnectFail {
    /// "no broker at PATH (why)" or "the broker at PATH did not answer ...".
    fn what(&self, socket: &str) -> String {
        match self {
            ConnectFail::Silent(t) => format!(
                "the broker at {socket} did not answer within {} s (it may be overloaded or stopped)",
                t.as_secs()
            ),
            ConnectFail::Other(e) => format!("no broker at {socket} ({e})"),
        }
    }
}

/// Connects and completes the handshake within `timeout`.
fn connect(cfg: &ShimConfig, timeout: Duration) -> Result<UnixStream, ConnectFail> {
    let deadline = Instant::now() + timeout;
    let fail = |e: std::io::Error| {
        if e.kind() == ErrorKind::TimedOut {
            ConnectFail::Silent(timeout)
        } else {
            ConnectFail::Other(e.to_string())
        }
    };
    let mut s = net::connect_unix(std::path::Path::new(&cfg.socket), deadline).map_err(fail)?;
    let mut buf = Vec::new();
    wire::encode_client(&ClientMsg::hello(std::process::id(), Role::Shim), &mut buf);
    // A fresh connection's send buffer is empty: this cannot block.
    s.write_all(&buf).map_err(fail)?;
    let mut inbuf = Vec::new();
    loop {
        match wire::decode_server(&inbuf) {
            Ok((ServerMsg::HelloOk { version }, _)) => match wire::accept_version(version) {
                Ok(_) => break,
                Err(why) => return Err(ConnectFail::Other(why)),
            },
            Ok((ServerMsg::Error { message, .. }, _)) => return Err(ConnectFail::Other(message)),
            Ok((other, _)) => {
                return Err(ConnectFail::Other(format!("unexpected answer {other:?}")));
            }
            Err(wire::DecodeError::Incomplete) => {}
            Err(e) => return Err(ConnectFail::Other(format!("bad frame from broker: {e}"))),
        }
        net::wait_for(&s, libc::POLLIN, deadline).map_err(fail)?;
        let mut tmp = [0u8; 4096];
        match s.read(&mut tmp) {
            Ok(0) => return Err(ConnectFail::Other("broker closed the connection".into())),
            Ok(n) => inbuf.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(fail(e)),
        }
    }
    // The session reads only after ppoll says so; this is a backstop.
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(fail)?;
    Ok(s)
}

/// Runs one of the shim's own threads. A panic ends it, and with it
/// arbitration: the gates open (launches hand out no memory, so they pass
/// through, as every entry point that hands out none does), and stderr
/// says so once. Memory caps do not depend on these threads.
fn contained(what: &str, body: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_err() {
        let at = boundary::Where::take();
        compute::unarbitrated(false);
        crate::log::write_line(format_args!(
            "internal error in the {what} thread ({at}); compute is not arbitrated from now on, memory caps still hold"
        ));
    }
}

fn client_thread(cfg: &'static ShimConfig) {
    compute::register_membarrier();
    if std::thread::Builder::new()
        .name("gpufrac-drain".into())
        .spawn(|| contained("drain", drain_thread))
        .is_err()
    {
        warn!(
            "could not start the drain thread; queued work after a handover is charged until the broker's timeout"
        );
    }
    // Caps and UUIDs are needed to register; they exist once a context does.
    while devices::ensure().is_err() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut session = Session::new(cfg);
    let mut out = Vec::new();
    loop {
        match connect(cfg, CONNECT_TIMEOUT) {
            Ok(s) => serve(s, cfg, &mut session, &mut out),
            Err(e) => {
                let event = Event::ConnectFailed(e.what(&cfg.socket));
                feed(&mut session, event, &mut None, cfg, &mut out);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The connection of a session, as the actions see it.
struct Conn {
    s: UnixStream,
    /// Application threads may send on it (registration is on the wire).
    published: bool,
    /// Closed: the session is over.
    ended: bool,
    /// A write of the client thread's own that did not go out.
    failed: Option<String>,
}

/// What this process registers: its devices, with their caps as they are
/// now.
fn registration() -> Vec<DeviceReg> {
    let devs: Vec<DeviceReg> = devices::all()
        .iter()
        .enumerate()
        .take(MAX_DEVICES)
        .map(|(i, d)| {
            let cap = LEDGERS[i].limit.load(Relaxed);
            DeviceReg {
                uuid: d.uuid.bytes,
                ordinal: i as u32,
                mem_cap: if cap == NO_LIMIT { 0 } else { cap },
                mem_total: d.total,
            }
        })
        .collect();
    compute::set_devices(devs.len());
    devs
}

/// Hands `event` to the session and applies what it decides.
fn feed(
    session: &mut Session,
    event: Event<'_>,
    conn: &mut Option<Conn>,
    cfg: &ShimConfig,
    out: &mut Vec<Action>,
) {
    session.on(now_ns(), event, out);
    for a in out.drain(..) {
        apply(a, conn, cfg);
    }
    if let Some(why) = conn.as_mut().and_then(|c| c.failed.take()) {
        feed(session, Event::Lost(why), conn, cfg, out);
    }
}

/// One connected session; returns when the session ends (the connection
/// lost, or the broker stalled).
fn serve(s: UnixStream, cfg: &ShimConfig, session: &mut Session, out: &mut Vec<Action>) {
    let fd = {
        use std::os::fd::AsRawFd;
        s.as_raw_fd()
    };
    let mut conn = Some(Conn {
        s,
        published: false,
        ended: false,
        failed: None,
    });
    let devices = registration();
    let command = gpufrac_common::procfs::cmdline(None);
    feed(
        session,
        Event::Connected { devices, command },
        &mut conn,
        cfg,
        out,
    );
    let mut inbuf = Vec::new();
    let ended = |c: &Option<Conn>| c.as_ref().is_none_or(|c| c.ended);
    while !ended(&conn) {
        let optimistic = compute::any_optimistic();
        let tick = session.tick_ns(optimistic);
        // ppoll, not a socket timeout: SO_RCVTIMEO counts in scheduler
        // ticks (4 ms at HZ=250), far coarser than the hand-back.
        let ts = libc::timespec {
            tv_sec: (tick / 1_000_000_000) as libc::time_t,
            tv_nsec: (tick % 1_000_000_000) as libc::c_long,
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd of ours, a timespec on the stack.
        let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if ready > 0 {
            let mut tmp = [0u8; 4096];
            let read = match conn.as_mut() {
                Some(c) => c.s.read(&mut tmp),
                None => break,
            };
            let event = match read {
                Ok(0) => Some(Event::Lost("broker closed the connection".into())),
                Ok(n) => {
                    inbuf.extend_from_slice(&tmp[..n]);
                    Some(Event::Heard)
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) =>
                {
                    None
                }
                Err(e) => Some(Event::Lost(e.to_string())),
            };
            if let Some(event) = event {
                feed(session, event, &mut conn, cfg, out);
            }
        }
        while !ended(&conn) {
            match wire::decode_server(&inbuf) {
                Ok((m, n)) => {
                    inbuf.drain(..n);
                    feed(session, Event::Message(m), &mut conn, cfg, out);
                }
                Err(wire::DecodeError::Incomplete) => break,
                Err(e) => {
                    let why = format!("bad frame from broker: {e}");
                    feed(session, Event::Lost(why), &mut conn, cfg, out);
                }
            }
        }
        if !ended(&conn) {
            let g = compute::gauges();
            feed(session, Event::Tick(&g), &mut conn, cfg, out);
        }
    }
}

/// Does what the session decided.
fn apply(a: Action, conn: &mut Option<Conn>, cfg: &ShimConfig) {
    match a {
        Action::Send(m) => match conn {
            Some(c) if !c.published => {
                // Registration, before application threads may send: the
                // client thread writes alone.
                let mut buf = Vec::new();
                wire::encode_client(&m, &mut buf);
                if let Err(e) = c.s.write_all(&buf) {
                    c.failed = Some(e.to_string());
                }
            }
            // A send that fails on a published connection is a connection
            // lost, which its read says.
            _ => {
                compute::send(&m);
            }
        },
        Action::Arbitrate => {
            let Some(c) = conn else { return };
            if c.failed.is_some() {
                return;
            }
            use std::os::fd::AsRawFd;
            compute::arbitrate(c.s.as_raw_fd());
            c.published = true;
        }
        Action::Open {
            dev,
            contended,
            bound_ns,
            stamp,
            all_open,
        } => compute::open(dev, contended, bound_ns, stamp, all_open),
        Action::Release {
            dev,
            ask_again,
            release: msg,
        } => compute::release(dev, ask_again, &msg),
        Action::Drain { dev } => compute::request_drain(dev),
        Action::EndOptimism { dev, until } => compute::end_optimism(dev, until),
        Action::ApplyCap(cap) => apply_job_cap(cap),
        Action::FirstRegistrationDone => first_registration_done(),
        Action::Say(note) => say(note, cfg),
        Action::End => {
            let Some(c) = conn else { return };
            compute::unpublish();
            // Wake any thread blocked sending to a broker that stopped
            // reading, and let a send in progress finish before the
            // descriptor is closed (and its number reused) with `c`.
            let _ = c.s.shutdown(std::net::Shutdown::Both);
            compute::wait_for_senders();
            c.ended = true;
        }
        Action::Unarbitrated { gated } => compute::unarbitrated(gated),
    }
}

fn say(note: Note, cfg: &ShimConfig) {
    let socket = &cfg.socket;
    match note {
        Note::Registered => info!("registered with the broker at {socket}"),
        Note::Refused(message) => {
            crate::log::write_line(format_args!("the broker refused this process: {message}"))
        }
        Note::StalledWaiting => crate::log::write_line(format_args!(
            "broker at {socket} has not answered for {STALL_S} s; launches wait for it (GPUFRAC_BROKER=required)"
        )),
        Note::StalledUnarbitrated { loud: true } => crate::log::write_line(format_args!(
            "broker at {socket} has not answered for {STALL_S} s; launching unarbitrated until it answers again"
        )),
        Note::StalledUnarbitrated { loud: false } => warn!(
            "broker at {socket} has not answered for {STALL_S} s; launching unarbitrated until it answers again"
        ),
        Note::Lost(e) => warn!("lost the broker ({e}); retrying"),
        Note::NoBroker { what, loud: true } => crate::log::write_line(format_args!(
            "{what}; memory caps are enforced, compute shares and limits are not until it returns"
        )),
        Note::NoBroker { what, loud: false } => {
            warn!("{what}; memory caps are enforced, compute is not arbitrated")
        }
        Note::Granted { dev, open_ended } => debug!(
            "device {dev}: granted ({})",
            if open_ended {
                "open-ended"
            } else {
                "timeslice"
            }
        ),
        Note::Released { dev, held_ns } => {
            debug!("device {dev}: released after {} us", held_ns / 1000)
        }
    }
}

/// The job's cap, from its lease: it holds even if the process's
/// environment lost or raised GPU_MEM_LIMIT.
fn apply_job_cap(mem_cap: u64) {
    let n = device_count();
    let mut lowered = false;
    for l in &LEDGERS[..n] {
        lowered |= l.limit.fetch_min(mem_cap, AcqRel) > mem_cap;
    }
    if lowered {
        info!("memory cap lowered to the job's {mem_cap} bytes by the broker");
    }
}

/// Waits for the work this process queued on a released device to finish,
/// then tells the broker, which charges that work as GPU time used.
fn drain_thread() {
    loop {
        let req = compute::drains();
        for d in 0..MAX_DEVICES {
            if req & (1 << d) == 0 {
                continue;
            }
            for ctx in contexts::of_device(d) {
                unsafe {
                    if call::cuCtxPushCurrent_v2(ctx as CUcontext) == CUDA_SUCCESS {
                        call::cuCtxSynchronize();
                        let mut old: CUcontext = std::ptr::null_mut();
                        call::cuCtxPopCurrent_v2(&mut old);
                    }
                }
            }
            if let Some(dev) = devices::all().get(d) {
                compute::send(&ClientMsg::Drained {
                    uuid: dev.uuid.bytes,
                });
            }
        }
    }
}

/// The child of a fork has no client thread and must not share the
/// parent's connection: close it, and start afresh at the child's own
/// first context, with a session of its own.
extern "C" fn after_fork_child() {
    let fd = compute::take_fd();
    if fd >= 0 {
        // SAFETY: closing the child's copy of the inherited descriptor.
        unsafe { libc::close(fd) };
    }
    STARTED.store(0, SeqCst);
    compute::reset_after_fork();
}
