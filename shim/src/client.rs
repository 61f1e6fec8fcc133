//! The client thread: the I/O loop between the broker's socket and the
//! broker session.
//!
//! The thread starts at the first context creation (never earlier). It
//! connects, hands what happens (messages, its ticks, a lost connection)
//! to the session (`session.rs`, where every decision is made and tested
//! in virtual time) and applies the actions it gets back to the compute
//! gate (`client/gate.rs`, what application threads pass through) and
//! the socket. If the broker goes away it keeps retrying and re-registers
//! when it returns; meanwhile launches run unarbitrated (or block, with
//! GPUFRAC_BROKER=required).
//!
//! No wait on the broker is unbounded (see `watch.rs`): connecting and the
//! handshake have a deadline (`client/connect.rs`), and a broker that
//! stops answering (SIGSTOP, wedged) while this process waits on it is
//! treated as gone.
//!
//! The gate (`client/gate.rs`, `GATE`) is the one object the application
//! threads share with this thread: they post what they want there and
//! wake it; this thread alone changes what the gate lets through and
//! alone writes to the socket. Beside it, under `client/`: `lanes` (the
//! gate's release handshake, model-checked), `compute` (the gate as the
//! launch hooks use it), `connect`, `drain` (the drain thread),
//! `registration` (what is registered, the job's cap) and `notes` (what
//! the session says).

mod compute;
mod connect;
mod drain;
mod gate;
mod lanes;
mod notes;
mod registration;

use self::compute::now_ns;
pub use self::compute::{launched, may_launch, may_launch_now, syncing};
pub use self::connect::check_required;
use self::connect::{CONNECT_TIMEOUT, ConnectFail, connect};
use self::gate::GATE;
pub use self::gate::Pass;
use self::registration::registration;
use crate::ledger::LEDGERS;
use crate::session::{Action, Event, Gauges, Session};
use crate::{boundary, config, devices};
use gpufrac_common::config::{BrokerMode, ShimConfig};
use gpufrac_common::wire;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

pub fn on_context_created() {
    let Ok(cfg) = config::get() else { return };
    if cfg.broker == BrokerMode::Off {
        return;
    }
    if config::arbitrate() {
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: registering a plain extern "C" callback, once (a forked
        // child inherits it).
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(report_at_exit);
        });
        let spawned = std::thread::Builder::new()
            .name("gpufrac-client".into())
            // Its connection closed as it unwound: the broker holds nothing
            // of this process's any more, and the gates open.
            .spawn(move || {
                contained(
                    "broker session",
                    || client_thread(cfg),
                    || GATE.close_all(false),
                )
            });
        if spawned.is_err() {
            warn!("could not start the broker client thread; compute is not arbitrated");
            return;
        }
        // The broker may impose the job's memory cap (its lease's), and the
        // first allocation must already be under it.
        GATE.wait_first_registration(Duration::from_millis(1500));
    }
}

/// Runs one of the shim's own threads. A panic ends it, and with it
/// arbitration: the gates open (launches hand out no memory, so they pass
/// through, as every entry point that hands out none does), and stderr
/// says so once. Memory caps do not depend on these threads.
fn contained(what: &str, body: impl FnOnce(), lost: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_err() {
        let at = boundary::Where::take();
        lost();
        crate::log::write_line(format_args!(
            "internal error in the {what} thread ({at}); compute is not arbitrated from now on, memory caps still hold"
        ));
    }
}

fn client_thread(cfg: &'static ShimConfig) {
    GATE.register_membarrier();
    // What the other threads wake this one with.
    // SAFETY: a plain eventfd.
    let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    GATE.set_wake_fd(wake);
    if std::thread::Builder::new()
        .name("gpufrac-drain".into())
        // The session hands back what it holds, each with its Release,
        // and ends arbitration.
        .spawn(|| contained("drain", drain::run, || GATE.drain_lost()))
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
    let mut said_not_the_broker = false;
    while !session.retired() {
        match connect(cfg, CONNECT_TIMEOUT) {
            Ok(s) => serve(s, wake, cfg, &mut session, &mut out),
            Err(e) => {
                // Someone else on the broker's path is news at any log
                // level (a quiet session only logs a missing broker).
                if matches!(e, ConnectFail::NotTheBroker(_))
                    && !session.loud()
                    && !said_not_the_broker
                {
                    said_not_the_broker = true;
                    crate::log::write_line(format_args!(
                        "{}; running as with no broker: memory caps are enforced, compute is not arbitrated",
                        e.what(&cfg.socket)
                    ));
                }
                let event = Event::ConnectFailed(e.what(&cfg.socket));
                feed(&mut session, event, &mut None, cfg, &mut out);
                // The drain thread may be gone meanwhile.
                let g = gauges();
                feed(&mut session, Event::Tick(&g), &mut None, cfg, &mut out);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The gate's gauges, with the memory figures of the books.
fn gauges() -> Gauges {
    let mut g = GATE.gauges();
    for (u, l) in g.usage.iter_mut().zip(&LEDGERS).take(GATE.device_count()) {
        *u = (
            l.used.load(Relaxed),
            l.peak.load(Relaxed),
            l.ooms.load(Relaxed),
        );
    }
    g
}

/// The connection of a session, as the actions see it.
struct Conn {
    s: UnixStream,
    /// Closed: the session is over.
    ended: bool,
    /// A write that did not go out.
    failed: Option<String>,
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
fn serve(s: UnixStream, wake: i32, cfg: &ShimConfig, session: &mut Session, out: &mut Vec<Action>) {
    let fd = s.as_raw_fd();
    GATE.set_conn_fd(fd);
    let mut conn = Some(Conn {
        s,
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
        let tick = session.tick_ns(GATE.any_window());
        // ppoll, not a socket timeout: SO_RCVTIMEO counts in scheduler
        // ticks (4 ms at HZ=250), far coarser than the hand-back.
        let ts = libc::timespec {
            tv_sec: (tick / 1_000_000_000) as libc::time_t,
            tv_nsec: (tick % 1_000_000_000) as libc::c_long,
        };
        let mut pfd = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds of ours, a timespec on the stack.
        let ready = unsafe { libc::ppoll(pfd.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if ready > 0 && pfd[1].revents != 0 {
            let mut n = 0u64;
            // SAFETY: reading the eventfd's counter into a local.
            unsafe { libc::read(wake, (&mut n as *mut u64).cast(), 8) };
        }
        if ready > 0 && pfd[0].revents != 0 {
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
            let g = gauges();
            feed(session, Event::Tick(&g), &mut conn, cfg, out);
        }
    }
    GATE.set_conn_fd(-1);
}

/// Does what the session decided.
fn apply(a: Action, conn: &mut Option<Conn>, cfg: &ShimConfig) {
    match a {
        Action::Send(m) => {
            let Some(c) = conn.as_mut().filter(|c| c.failed.is_none() && !c.ended) else {
                return;
            };
            let mut buf = Vec::with_capacity(64);
            wire::encode_client(&m, &mut buf);
            if let Err(e) = c.s.write_all(&buf) {
                c.failed = Some(e.to_string());
            }
        }
        Action::Arbitrate => GATE.close_all(true),
        Action::Open {
            dev,
            contended,
            bound_ns,
            stamp,
            all_open,
        } => GATE.open(dev, contended, bound_ns, stamp, all_open),
        Action::Close { dev } => GATE.close(dev),
        Action::Arm(devices) => GATE.arm(devices),
        Action::Drain { dev } => GATE.request_drain(dev),
        Action::EndOptimism { dev, until } => {
            // What went out in the window is charged until it has run.
            if GATE.end_window(dev, until) {
                GATE.request_drain(dev);
            }
        }
        Action::ApplyCap(cap) => registration::apply_job_cap(cap),
        Action::FirstRegistrationDone => GATE.first_registration_done(),
        Action::Say(note) => notes::say(note, cfg),
        Action::End => {
            let Some(c) = conn else { return };
            let _ = c.s.shutdown(std::net::Shutdown::Both);
            c.ended = true;
        }
        Action::Unarbitrated { gated } => GATE.close_all(gated),
        Action::ExitReported => GATE.exit_reported(),
    }
}

/// A process that ends between two usage reports (at most one every
/// 100 ms) would leave the broker figures from before its last
/// allocations, or none: a job of one short process ended with a peak of
/// 0 B. At exit the session says its figures once more, if it can within
/// `EXIT_WAIT`.
extern "C" fn report_at_exit() {
    GATE.report_at_exit(EXIT_WAIT);
}

/// The longest an exit waits for the session's last usage report (a
/// client thread blocked on a broker that stopped reading never sends it).
const EXIT_WAIT: Duration = Duration::from_millis(50);

/// The child of a fork has no client thread and must not share the
/// parent's connection: the gate closes it, and the child's own first
/// context starts a client afresh (`config::arbitrate`), with a session of
/// its own. Called in the child by `hooks::process`'s fork handler.
pub fn reset_after_fork() {
    GATE.reset_after_fork();
}
