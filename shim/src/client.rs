//! The client thread: the I/O loop between the broker's socket and the
//! broker session.
//!
//! The thread starts at the first context creation (never earlier). It
//! connects, hands what happens (messages, its ticks, a lost connection)
//! to the session (`session.rs`, where every decision is made and tested
//! in virtual time) and applies the actions it gets back to the compute
//! gate (`client/compute.rs`, what application threads pass through) and
//! the socket. If the broker goes away it keeps retrying and re-registers
//! when it returns; meanwhile launches run unarbitrated (or block, with
//! GPUFRAC_BROKER=required).
//!
//! No wait on the broker is unbounded (see `watch.rs`): connecting and the
//! handshake have a deadline (`client/connect.rs`), and a broker that
//! stops answering (SIGSTOP, wedged) while this process waits on it is
//! treated as gone.
//!
//! Beside the gate, each part the gate and this loop share has a room of
//! its own under `client/`: `send` (the connection's sending side, any
//! thread), `asking` (an Acquire and the wait for its grant), `optimism`
//! (launching while the broker answers), `idle` (what idle hand-back
//! reads), `slots` (the open lane's per-thread flags), `drain` (the drain
//! thread), `registration` (what is registered, the job's cap),
//! `notes` (what the session says).

mod asking;
mod compute;
mod connect;
mod drain;
mod idle;
mod notes;
mod optimism;
mod registration;
mod send;
mod slots;

use self::compute::now_ns;
pub use self::compute::{Pass, launched, may_launch, may_launch_now, syncing};
pub use self::connect::check_required;
use self::connect::{CONNECT_TIMEOUT, connect};
use self::registration::{first_registration_done, registration};
use crate::ledger::LEDGERS;
use crate::session::{Action, Event, Session};
use crate::{boundary, config, devices};
use gpufrac_common::config::{BrokerMode, ShimConfig};
use gpufrac_common::wire;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU8, Ordering::*};
use std::time::Duration;

static STARTED: AtomicU8 = AtomicU8::new(0);

pub fn on_context_created() {
    let Ok(cfg) = config::config() else { return };
    if cfg.broker == BrokerMode::Off {
        return;
    }
    if STARTED.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        static FORK_HANDLER: std::sync::Once = std::sync::Once::new();
        // SAFETY: registering plain extern "C" callbacks, once (a forked
        // child inherits them).
        FORK_HANDLER.call_once(|| unsafe {
            libc::pthread_atfork(None, None, Some(after_fork_child));
            libc::atexit(report_at_exit);
        });
        let spawned = std::thread::Builder::new()
            .name("gpufrac-client".into())
            .spawn(move || contained("broker session", || client_thread(cfg)));
        if spawned.is_err() {
            warn!("could not start the broker client thread; compute is not arbitrated");
            return;
        }
        registration::wait_first_registration();
    }
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
    slots::register_membarrier();
    if std::thread::Builder::new()
        .name("gpufrac-drain".into())
        .spawn(|| contained("drain", drain::run))
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
        let optimistic = optimism::any();
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
                send::send(&m);
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
        Action::Drain { dev } => drain::request(dev),
        Action::EndOptimism { dev, until } => optimism::end(dev, until),
        Action::ApplyCap(cap) => registration::apply_job_cap(cap),
        Action::FirstRegistrationDone => first_registration_done(),
        Action::Say(note) => notes::say(note, cfg),
        Action::End => {
            let Some(c) = conn else { return };
            send::unpublish();
            // Wake any thread blocked sending to a broker that stopped
            // reading, and let a send in progress finish before the
            // descriptor is closed (and its number reused) with `c`.
            let _ = c.s.shutdown(std::net::Shutdown::Both);
            send::wait_for_senders();
            c.ended = true;
        }
        Action::Unarbitrated { gated } => compute::unarbitrated(gated),
    }
}

/// A process that ends between two usage reports (at most one every
/// 100 ms) would leave the broker figures from before its last
/// allocations, or none: a job of one short process ended with a peak of
/// 0 B. At exit its figures go out once more, if they can at once.
extern "C" fn report_at_exit() {
    let n = idle::device_count();
    for (d, l) in devices::all().iter().zip(&LEDGERS).take(n) {
        send::send_at_exit(&wire::ClientMsg::Usage {
            uuid: d.uuid.bytes,
            used: l.used.load(Relaxed),
            peak: l.peak.load(Relaxed),
            ooms: l.ooms.load(Relaxed),
        });
    }
}

/// The child of a fork has no client thread and must not share the
/// parent's connection: close it, and start afresh at the child's own
/// first context, with a session of its own.
extern "C" fn after_fork_child() {
    let fd = send::take_fd();
    if fd >= 0 {
        // SAFETY: closing the child's copy of the inherited descriptor.
        unsafe { libc::close(fd) };
    }
    STARTED.store(0, SeqCst);
    compute::reset_after_fork();
}
