//! The shim's side of the broker: registration, coalesced usage reports and
//! the compute gate.
//!
//! The gate on every launch: with no arbitration (no broker, or
//! `GPUFRAC_BROKER=off`) it is one atomic load. With a broker, a launch on a
//! device this process holds is a handful of atomics and no syscall; only a
//! launch on a device it does not hold asks the broker and waits.
//!
//! A background thread, started at the first context creation (never
//! earlier), owns the connection: it registers, applies grants, and on a
//! revoke (or ~2 ms without launches while others wait) stops new launches,
//! waits for launches already past the gate, drains this process's work on
//! that device and reports the release. If the broker goes away it keeps
//! retrying and re-registers when it returns; meanwhile launches run
//! unarbitrated (or block, with GPUFRAC_BROKER=required).
//!
//! No wait on the broker is unbounded (see `Watch`): connecting and the
//! handshake have a deadline, and a broker that stops answering (SIGSTOP,
//! wedged) while this process waits on it is treated as gone.

use crate::driver::call;
use crate::ledger::{LEDGERS, NO_LIMIT};
use crate::session::{Action, Event, Gauges, Note, STALL_S, Session};
use crate::{boundary, config, contexts, devices};
use gpufrac_common::config::{BrokerMode, MAX_DEVICES, ShimConfig};
use gpufrac_common::cuda::*;
use gpufrac_common::net;
use gpufrac_common::wire::{self, ClientMsg, DeviceReg, Role, ServerMsg};
use std::cell::Cell;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Launches must consult the per-device bits.
static GATED: AtomicBool = AtomicBool::new(false);
/// Threads blocked in a synchronize call: waiting for its own kernels is
/// not idleness.
static SYNCING: AtomicU32 = AtomicU32::new(0);
/// Devices this process may launch on now.
static OPEN: AtomicU64 = AtomicU64::new(0);
/// Every registered device is held under an open-ended grant: launches
/// need not even look up their device (the common case of a job alone on
/// its GPU). Cleared first by anything that closes a device.
static ALL_OPEN: AtomicBool = AtomicBool::new(false);
/// Launches that went through the ALL_OPEN lane on the counter and have not
/// returned (threads without a slot, or no membarrier).
static GLOBAL_IN_FLIGHT: AtomicU32 = AtomicU32::new(0);

/// Per-thread "inside a launch" flags for the ALL_OPEN lane, a cache line
/// each. With membarrier registered, a launch marks its slot with a plain
/// store and a compiler fence: the full fence that a Dekker handshake needs
/// is paid by the (rare) releaser, through membarrier, instead of by every
/// launch. Slots are never reused; threads beyond them take the counter.
#[repr(align(64))]
struct Slot(AtomicU32);
const NSLOT: usize = 256;
static SLOTS: [Slot; NSLOT] = [const { Slot(AtomicU32::new(0)) }; NSLOT];
static SLOTS_USED: AtomicU32 = AtomicU32::new(0);
static MEMBARRIER: AtomicBool = AtomicBool::new(false);
/// Devices held under a contended (sliced) grant: idle hand-back applies.
static CONTENDED: AtomicU64 = AtomicU64::new(0);
/// Devices for which an Acquire is outstanding.
static REQUESTED: AtomicU64 = AtomicU64::new(0);
/// Devices held under a grant with an in-flight bound (others share the
/// GPU): launches there are tracked (see inflight.rs), and idle hand-back
/// applies.
static BOUNDED: AtomicU64 = AtomicU64::new(0);
static BOUND_NS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Devices released whose queued work the drain thread still has to see
/// finish before telling the broker.
static DRAIN_REQ: AtomicU64 = AtomicU64::new(0);
static DRAIN_WAIT: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());
/// A process that starts launching after being idle does not wait for the
/// broker's answer: until this time (per device) its launches go straight
/// to the GPU, as they would without gpufrac, while the broker makes room.
/// Waiting here first is what would make sharing through gpufrac slower
/// than the GPU's own time-slicing.
static OPTIMISTIC_UNTIL: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
const OPTIMISTIC_NS: u64 = 1_000_000;
/// What a process may queue before the broker answers: a request of short
/// kernels goes out whole, a batch job that wakes up queues no more than
/// one long kernel (the broker's own burst bound).
const OPTIMISTIC_BOUND_NS: u64 = 2_000_000;
static IN_FLIGHT: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];
static LAST_LAUNCH: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

static STARTED: AtomicU8 = AtomicU8::new(0);
/// Raw fd of the live connection (-1 none), for app threads sending
/// Acquire and for a fork child to close.
static CONN_FD: AtomicI32 = AtomicI32::new(-1);
static SEND: Mutex<()> = Mutex::new(());
static WAIT: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Connecting and the handshake, per attempt of the client thread (which
/// retries every ~0.5 s anyway). A live broker answers in microseconds; a
/// full accept queue (a flood of idle connections) or a stopped broker
/// never does, and `connect` on a Unix socket would block with it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The same for the one attempt `GPUFRAC_BROKER=required` makes in cuInit,
/// whose failure fails the process: more patience with a busy broker.
const REQUIRED_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest device count registered (bounded by MAX_DEVICES).
static NDEV: AtomicU32 = AtomicU32::new(0);

thread_local! {
    // What this thread's current launch holds: a device's IN_FLIGHT (>= 0),
    // nothing (-1), the ALL_OPEN counter (ALL_LANE), or a slot
    // (SLOT_BASE - slot).
    static PENDING: Cell<i32> = const { Cell::new(-1) };
    // This thread's slot: -1 not yet assigned, -3 none left.
    static MY_SLOT: Cell<i32> = const { Cell::new(-1) };
    // The device whose in-flight bound the current launch counts against
    // (-1: none).
    static TRACK_DEV: Cell<i32> = const { Cell::new(-1) };
}

const SLOT_BASE: i32 = -100;

fn my_slot() -> i32 {
    MY_SLOT.with(|c| {
        let v = c.get();
        if v != -1 {
            return v;
        }
        let n = SLOTS_USED.fetch_add(1, Relaxed) as usize;
        let v = if n < NSLOT { n as i32 } else { -3 };
        c.set(v);
        v
    })
}

const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

fn register_membarrier() {
    // SAFETY: membarrier takes no pointers; failure (old kernel, seccomp)
    // leaves the counter lane in use.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED,
            0,
            0,
        )
    };
    MEMBARRIER.store(rc == 0, SeqCst);
}

// The precise clock: idle hand-back works in fractions of a millisecond, and
// the coarse clock ticks every few milliseconds.
use gpufrac_common::clock::mono_ns as now_ns;

/// The compute gate. `Ok` means launch now; `launched` must follow.
#[inline(always)]
pub fn may_launch(_stream: CUstream) -> Result<(), u32> {
    if !GATED.load(Acquire) {
        return Ok(());
    }
    // Waiting, it never gives up.
    gate_slow(true).unwrap_or(Ok(()))
}

/// The gate without asking the broker or waiting for a grant: `None` when
/// this launch would have to. For a thread that already holds a pass (see
/// `take_pass`): asking takes the send lock, which a release of the device
/// that pass counts against holds while it waits for that pass to end.
pub fn may_launch_now(_stream: CUstream) -> Option<Result<(), u32>> {
    if !GATED.load(Acquire) {
        return Some(Ok(()));
    }
    gate_slow(false)
}

#[cold]
#[inline(never)]
fn gate_slow(wait: bool) -> Option<Result<(), u32>> {
    if MEMBARRIER.load(Relaxed) {
        let slot = my_slot();
        if slot >= 0 {
            let flag = &SLOTS[slot as usize].0;
            flag.store(1, Relaxed);
            std::sync::atomic::compiler_fence(SeqCst);
            if ALL_OPEN.load(Relaxed) {
                PENDING.with(|p| p.set(SLOT_BASE - slot));
                return Some(Ok(()));
            }
            flag.store(0, Release);
        }
    }
    // Same Dekker handshake as the per-device lane below, on one counter.
    GLOBAL_IN_FLIGHT.fetch_add(1, SeqCst);
    if ALL_OPEN.load(SeqCst) {
        PENDING.with(|p| p.set(ALL_LANE));
        return Some(Ok(()));
    }
    GLOBAL_IN_FLIGHT.fetch_sub(1, SeqCst);
    let mut dev: CUdevice = -1;
    if unsafe { call::cuCtxGetDevice(&mut dev) } != CUDA_SUCCESS
        || !(0..MAX_DEVICES as i32).contains(&dev)
    {
        // No context: the driver will refuse the launch itself.
        return Some(Ok(()));
    }
    let d = dev as usize;
    let bit = 1u64 << d;
    loop {
        // Wait for room outside the gate: a revoke must not wait for it.
        let bounded = BOUNDED.load(Acquire) & bit != 0;
        let optimistic =
            OPEN.load(Acquire) & bit == 0 && now_ns() < OPTIMISTIC_UNTIL[d].load(Relaxed);
        if bounded {
            wait_room(d, BOUND_NS[d].load(Relaxed));
        } else if optimistic {
            wait_room(d, OPTIMISTIC_BOUND_NS);
        }
        IN_FLIGHT[d].fetch_add(1, SeqCst);
        if OPEN.load(SeqCst) & bit != 0 {
            if shared() & bit != 0 {
                LAST_LAUNCH[d].store(now_ns(), Relaxed);
            }
            PENDING.with(|p| p.set(dev));
            TRACK_DEV.with(|t| t.set(if bounded { dev } else { -1 }));
            return Some(Ok(()));
        }
        // Never send while counted in flight: a release in progress holds
        // the send lock while it waits for that count to drop.
        IN_FLIGHT[d].fetch_sub(1, SeqCst);
        if !GATED.load(Acquire) {
            return Some(Ok(()));
        }
        if !wait {
            return None;
        }
        // Coming back from idle: ask, and launch meanwhile (once there is
        // room under the optimistic bound: next time round).
        if ask(d, true) {
            continue;
        }
        let now = now_ns();
        if optimistic && now < OPTIMISTIC_UNTIL[d].load(Relaxed) {
            // Not counted in flight: this process holds no grant that a
            // release would have to wait for.
            TRACK_DEV.with(|t| t.set(dev));
            return Some(Ok(()));
        }
        expire_optimism(d, now);
        wait_for_grant(d);
    }
}

/// Waiting for room under the bound is waiting for this process's own
/// kernels: not idleness, so no idle hand-back meanwhile.
fn wait_room(d: usize, bound: u64) {
    SYNCING.fetch_add(1, SeqCst);
    crate::inflight::wait_room(d, bound);
    SYNCING.fetch_sub(1, SeqCst);
    LAST_LAUNCH[d].store(now_ns(), Relaxed);
}

/// PENDING value of a launch that went through the ALL_OPEN lane.
const ALL_LANE: i32 = -2;

/// After the driver call of a launch that `may_launch` let through, on
/// `stream` (`ptsz`: with per-thread default stream semantics).
#[inline(always)]
pub fn launched(rc: u32, stream: CUstream, ptsz: bool) {
    let t = TRACK_DEV.with(|t| t.replace(-1));
    if t >= 0 && rc == CUDA_SUCCESS {
        crate::inflight::record(t as usize, stream, ptsz);
    }
    let d = PENDING.with(|p| p.replace(-1));
    if d >= 0 {
        IN_FLIGHT[d as usize].fetch_sub(1, SeqCst);
    } else if d == ALL_LANE {
        GLOBAL_IN_FLIGHT.fetch_sub(1, SeqCst);
    } else if d <= SLOT_BASE {
        SLOTS[(SLOT_BASE - d) as usize].0.store(0, Release);
    }
}

/// What one pass of the gate holds until its launch returns (see
/// `take_pass`).
#[must_use]
pub struct Pass {
    pending: i32,
    track: i32,
}

/// Takes what the gate that just let this thread through holds off the
/// thread, so that the thread can pass the gate again before launching: a
/// launch that spans several streams passes once per stream and must give
/// back every pass, not the last one only (a pass never given back is an
/// in-flight count that a release waits for forever).
pub fn take_pass() -> Pass {
    Pass {
        pending: PENDING.with(|p| p.replace(-1)),
        track: TRACK_DEV.with(|t| t.replace(-1)),
    }
}

/// `launched` for a pass taken with `take_pass`.
pub fn launched_pass(pass: Pass, rc: u32, stream: CUstream, ptsz: bool) {
    PENDING.with(|p| p.set(pass.pending));
    TRACK_DEV.with(|t| t.set(pass.track));
    launched(rc, stream, ptsz);
}

/// Sends `Acquire` for `d` unless one is outstanding; true if it did. With
/// `optimistic`, the launches that follow may go out before the answer
/// (the window opens before the request leaves, so a quick grant closes it).
fn ask(d: usize, optimistic: bool) -> bool {
    let bit = 1u64 << d;
    if REQUESTED.fetch_or(bit, AcqRel) & bit != 0 {
        return false;
    }
    if optimistic {
        OPTIMISTIC_UNTIL[d].store(now_ns() + OPTIMISTIC_NS, Relaxed);
    }
    if let Some(dev) = devices::all().get(d)
        && !send(&ClientMsg::Acquire {
            uuid: dev.uuid.bytes,
        })
    {
        // Not on the wire (no connection at this instant): asking again
        // must not be skipped as already done.
        REQUESTED.fetch_and(!bit, AcqRel);
    }
    true
}

/// Devices where others share the GPU: a slice, a bound, or someone waiting.
/// Launches there stamp their time, and idle hand-back applies.
fn shared() -> u64 {
    CONTENDED.load(Relaxed) | BOUNDED.load(Relaxed)
}

/// Closes every gate (the broker connection is new, or gone).
fn close_gates() {
    ALL_OPEN.store(false, SeqCst);
    OPEN.store(0, SeqCst);
    CONTENDED.store(0, SeqCst);
    BOUNDED.store(0, SeqCst);
    REQUESTED.store(0, SeqCst);
}

/// Blocks until `d` is granted or the gates open (no broker, or a stalled
/// one in optional mode: the client thread's `Watch` bounds this wait).
fn wait_for_grant(d: usize) {
    let bit = 1u64 << d;
    let mut g = WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    let mut rounds = 0u32;
    while GATED.load(Acquire) && OPEN.load(SeqCst) & bit == 0 {
        rounds += 1;
        if rounds.is_multiple_of(ASK_AGAIN_ROUNDS) {
            // Asked long ago and still nothing: ask again. The broker
            // takes a repeated Acquire as the same request, and a request
            // lost in some race (a CI run once left a process waiting on a
            // broker that had it as idle) costs half a second, not forever.
            REQUESTED.fetch_and(!bit, AcqRel);
        }
        ask(d, false);
        g = WAIT
            .1
            .wait_timeout(g, Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Waits of 100 ms after which a waiting process repeats its Acquire.
const ASK_AGAIN_ROUNDS: u32 = 5;

fn wake_all() {
    let _g = WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    WAIT.1.notify_all();
}

/// Sends one frame on the live connection (any thread).
fn send(msg: &ClientMsg) -> bool {
    let g = SEND.lock().unwrap_or_else(|e| e.into_inner());
    send_locked(&g, msg)
}

/// Sends with the send lock already held (the lock orders an application
/// thread's Acquire after a release in progress).
fn send_locked(_held: &std::sync::MutexGuard<'_, ()>, msg: &ClientMsg) -> bool {
    let mut buf = Vec::with_capacity(64);
    wire::encode_client(msg, &mut buf);
    let fd = CONN_FD.load(Acquire);
    if fd < 0 {
        return false;
    }
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: writing our buffer to our socket; MSG_NOSIGNAL so a dead
        // broker does not kill the application with SIGPIPE.
        let n = unsafe {
            libc::send(
                fd,
                buf[off..].as_ptr().cast(),
                buf.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if n <= 0 {
            if n < 0 && std::io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        off += n as usize;
    }
    true
}

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
        GATED.store(false, SeqCst);
        close_gates();
        wake_all();
        crate::log::write_line(format_args!(
            "internal error in the {what} thread ({at}); compute is not arbitrated from now on, memory caps still hold"
        ));
    }
}

fn client_thread(cfg: &'static ShimConfig) {
    register_membarrier();
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
                session.on(
                    now_ns(),
                    Event::ConnectFailed(e.what(&cfg.socket)),
                    &mut out,
                );
                let mut none = None;
                for a in out.drain(..) {
                    apply(a, &mut none, cfg);
                }
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
    NDEV.store(devs.len() as u32, Relaxed);
    devs
}

/// The gate's state, read for a tick of the session. Syncing is read
/// first: a thread that stops waiting for its own work stamps its last
/// launch after, so the stamp is seen with it or the wait is.
fn gauges() -> Gauges {
    let mut g = Gauges {
        requested: REQUESTED.load(SeqCst),
        syncing: SYNCING.load(SeqCst) > 0,
        ..Gauges::default()
    };
    let n = (NDEV.load(Relaxed) as usize).min(MAX_DEVICES);
    for d in 0..n {
        if IN_FLIGHT[d].load(Relaxed) != 0 {
            g.in_flight |= 1 << d;
        }
        g.last_launch[d] = LAST_LAUNCH[d].load(Relaxed);
        let l = &LEDGERS[d];
        g.usage[d] = (
            l.used.load(Relaxed),
            l.peak.load(Relaxed),
            l.ooms.load(Relaxed),
        );
    }
    for (g, o) in g.optimistic_until.iter_mut().zip(&OPTIMISTIC_UNTIL) {
        *g = o.load(Relaxed);
    }
    g
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
        let optimistic = OPTIMISTIC_UNTIL.iter().any(|o| o.load(Relaxed) != 0);
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
            let g = gauges();
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
                send(&m);
            }
        },
        Action::Arbitrate => {
            let Some(c) = conn else { return };
            if c.failed.is_some() {
                return;
            }
            use std::os::fd::AsRawFd;
            close_gates();
            CONN_FD.store(c.s.as_raw_fd(), Release);
            c.published = true;
            GATED.store(true, Release);
            wake_all();
        }
        Action::Open {
            dev,
            contended,
            bound_ns,
            stamp,
            all_open,
        } => open(dev, contended, bound_ns, stamp, all_open),
        Action::Release {
            dev,
            ask_again,
            release: msg,
        } => release(dev, ask_again, &msg),
        Action::Drain { dev } => request_drain(dev),
        Action::EndOptimism { dev, until } => {
            // An application thread may have closed it first (and drained),
            // or opened a new one.
            if OPTIMISTIC_UNTIL[dev]
                .compare_exchange(until, 0, Relaxed, Relaxed)
                .is_ok()
            {
                request_drain(dev);
            }
        }
        Action::ApplyCap(cap) => apply_job_cap(cap),
        Action::FirstRegistrationDone => first_registration_done(),
        Action::Say(note) => say(note, cfg),
        Action::End => {
            let Some(c) = conn else { return };
            CONN_FD.store(-1, Release);
            // Wake any thread blocked sending to a broker that stopped
            // reading, and let a send in progress finish before the
            // descriptor is closed (and its number reused) with `c`.
            let _ = c.s.shutdown(std::net::Shutdown::Both);
            drop(SEND.lock().unwrap_or_else(|e| e.into_inner()));
            c.ended = true;
        }
        Action::Unarbitrated { gated } => {
            close_gates();
            GATED.store(gated, Release);
            wake_all();
        }
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

/// Opens `dev` under a grant (see `Action::Open`).
fn open(d: usize, contended: bool, bound_ns: u64, stamp: Option<u64>, all_open: bool) {
    let bit = 1u64 << d;
    BOUND_NS[d].store(bound_ns, Relaxed);
    if contended || bound_ns != 0 {
        // Launches go back through the lane that stamps their time before
        // the stamp that starts the idle window.
        ALL_OPEN.store(false, SeqCst);
    }
    if let Some(t) = stamp {
        LAST_LAUNCH[d].store(t, Relaxed);
    }
    if bound_ns == 0 {
        BOUNDED.fetch_and(!bit, SeqCst);
    } else {
        BOUNDED.fetch_or(bit, SeqCst);
    }
    OPTIMISTIC_UNTIL[d].store(0, Relaxed);
    if contended {
        CONTENDED.fetch_or(bit, SeqCst);
    } else {
        CONTENDED.fetch_and(!bit, SeqCst);
    }
    OPEN.fetch_or(bit, SeqCst);
    REQUESTED.fetch_and(!bit, SeqCst);
    ALL_OPEN.store(all_open, SeqCst);
    wake_all();
}

/// The job's cap, from its lease: it holds even if the process's
/// environment lost or raised GPU_MEM_LIMIT.
fn apply_job_cap(mem_cap: u64) {
    let n = (NDEV.load(Relaxed) as usize).min(MAX_DEVICES);
    let mut lowered = false;
    for l in &LEDGERS[..n] {
        lowered |= l.limit.fetch_min(mem_cap, AcqRel) > mem_cap;
    }
    if lowered {
        info!("memory cap lowered to the job's {mem_cap} bytes by the broker");
    }
}

/// Stops launching on `d`, waits for launches already past the gate and
/// tells the broker (`ask_again` first).
fn release(d: usize, ask_again: Option<ClientMsg>, msg: &ClientMsg) {
    let bit = 1u64 << d;
    // Held until the Release is on the wire: an application thread that
    // finds the gate closed and asks again must be heard *after* this
    // release, or the broker would take its Acquire for the holder's and
    // then idle it.
    let sending = SEND.lock().unwrap_or_else(|e| e.into_inner());
    ALL_OPEN.store(false, SeqCst);
    if MEMBARRIER.load(Relaxed) {
        // The other half of the slot handshake: every thread of this
        // process runs a full fence, so a launch either saw ALL_OPEN false
        // or its slot is visible below.
        unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) };
    }
    if OPEN.fetch_and(!bit, SeqCst) & bit == 0 {
        // Closed under the session by a contained panic: nothing to hand
        // back.
        return;
    }
    OPTIMISTIC_UNTIL[d].store(0, Relaxed);
    if let Some(acquire) = ask_again {
        // Still busy: ask again *before* releasing, to keep this process's
        // place in the fair queue instead of going idle.
        REQUESTED.fetch_or(bit, SeqCst);
        send_locked(&sending, &acquire);
    }
    let slots = (SLOTS_USED.load(Acquire) as usize).min(NSLOT);
    while IN_FLIGHT[d].load(SeqCst) > 0
        || GLOBAL_IN_FLIGHT.load(SeqCst) > 0
        || SLOTS[..slots].iter().any(|s| s.0.load(Acquire) != 0)
    {
        std::thread::yield_now();
    }
    CONTENDED.fetch_and(!bit, SeqCst);
    BOUNDED.fetch_and(!bit, SeqCst);
    send_locked(&sending, msg);
}

fn request_drain(d: usize) {
    DRAIN_REQ.fetch_or(1 << d, SeqCst);
    let _g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    DRAIN_WAIT.1.notify_one();
}

/// Waits for the work this process queued on a released device to finish,
/// then tells the broker, which charges that work as GPU time used.
fn drain_thread() {
    loop {
        let req = {
            let mut g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let r = DRAIN_REQ.swap(0, SeqCst);
                if r != 0 {
                    break r;
                }
                g = DRAIN_WAIT.1.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
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
                send(&ClientMsg::Drained {
                    uuid: dev.uuid.bytes,
                });
            }
        }
    }
}

/// Wraps a synchronize call so idle hand-back does not fire while the
/// process waits for its own work.
#[inline(always)]
pub fn syncing<F: FnOnce() -> u32>(f: F) -> u32 {
    if !GATED.load(Relaxed) {
        return f();
    }
    SYNCING.fetch_add(1, SeqCst);
    let rc = f();
    SYNCING.fetch_sub(1, SeqCst);
    let now = now_ns();
    for l in LAST_LAUNCH.iter().take(NDEV.load(Relaxed) as usize) {
        l.store(now, Relaxed);
    }
    rc
}

/// Closes `d`'s optimistic window if it has run out without a grant; what
/// went out meanwhile is charged until it has run, so ask for that report.
fn expire_optimism(d: usize, now: u64) {
    let o = &OPTIMISTIC_UNTIL[d];
    let until = o.load(Relaxed);
    if until != 0 && now >= until && o.swap(0, Relaxed) != 0 {
        request_drain(d);
    }
}

/// The child of a fork has no client thread and must not share the
/// parent's connection.
extern "C" fn after_fork_child() {
    // The child has no client thread and must not share the parent's
    // connection: close it and start afresh at its own first context.
    let fd = CONN_FD.swap(-1, SeqCst);
    if fd >= 0 {
        // SAFETY: closing the child's copy of the inherited descriptor.
        unsafe { libc::close(fd) };
    }
    STARTED.store(0, SeqCst);
    GATED.store(false, SeqCst);
    ALL_OPEN.store(false, SeqCst);
    GLOBAL_IN_FLIGHT.store(0, SeqCst);
    // membarrier registration belongs to the parent's address space.
    MEMBARRIER.store(false, SeqCst);
    for s in &SLOTS {
        s.0.store(0, SeqCst);
    }
    close_gates();
    DRAIN_REQ.store(0, SeqCst);
    for o in &OPTIMISTIC_UNTIL {
        o.store(0, SeqCst);
    }
    for c in &IN_FLIGHT {
        c.store(0, SeqCst);
    }
}
