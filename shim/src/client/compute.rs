//! The compute gate: what an application thread does before and after a
//! launch, and the gate's side of each decision of the broker session
//! (opening a device, releasing one, closing every gate).
//!
//! With no arbitration (no broker, or `GPUFRAC_BROKER=off`) a launch costs
//! one atomic load. With a broker, a launch on a device this process holds
//! is a handful of atomics and no syscall; only a launch on a device it
//! does not hold asks the broker and waits. The client thread (`client.rs`)
//! is the only writer of `OPEN`, `CONTENDED` and `BOUNDED`, through `open`,
//! `release` and `close_gates`, as the session (`session.rs`) decides.

use crate::devices;
use crate::driver::call;
use crate::ledger::LEDGERS;
use crate::session::Gauges;
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use gpufrac_common::wire::{self, ClientMsg};
use std::cell::Cell;
use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

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

/// Raw fd of the live connection (-1 none), for app threads sending
/// Acquire and for a fork child to close.
static CONN_FD: AtomicI32 = AtomicI32::new(-1);
static SEND: Mutex<()> = Mutex::new(());
static WAIT: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Largest device count registered (bounded by MAX_DEVICES).
static NDEV: AtomicU32 = AtomicU32::new(0);

thread_local! {
    // This thread's slot: -1 not yet assigned, -3 none left.
    static MY_SLOT: Cell<i32> = const { Cell::new(-1) };
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

pub fn register_membarrier() {
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
pub use gpufrac_common::clock::mono_ns as now_ns;

/// What one pass of the gate holds until its launch returns, handed back
/// to `launched`. Returned, not kept in a thread-local: in a preloaded
/// library each thread-local access is a call, and a launch would pay two.
#[must_use]
#[derive(Clone, Copy)]
pub struct Pass {
    /// A device's IN_FLIGHT (>= 0), nothing (-1), the ALL_OPEN counter
    /// (ALL_LANE), or a slot (SLOT_BASE - slot).
    pending: i32,
    /// The device whose in-flight bound the launch counts against (-1:
    /// none).
    track: i32,
}

impl Pass {
    const FREE: Pass = Pass {
        pending: -1,
        track: -1,
    };
}

/// The compute gate. `Ok` means launch now; `launched` must follow with
/// the pass.
#[inline(always)]
pub fn may_launch(_stream: CUstream) -> Result<Pass, u32> {
    if !GATED.load(Acquire) {
        return Ok(Pass::FREE);
    }
    // Waiting, it never gives up.
    gate_slow(true).unwrap_or(Ok(Pass::FREE))
}

/// The gate without asking the broker or waiting for a grant: `None` when
/// this launch would have to. For a thread that already holds a pass:
/// asking takes the send lock, which a release of the device that pass
/// counts against holds while it waits for that pass to end.
pub fn may_launch_now(_stream: CUstream) -> Option<Result<Pass, u32>> {
    if !GATED.load(Acquire) {
        return Some(Ok(Pass::FREE));
    }
    gate_slow(false)
}

#[cold]
#[inline(never)]
fn gate_slow(wait: bool) -> Option<Result<Pass, u32>> {
    if MEMBARRIER.load(Relaxed) {
        let slot = my_slot();
        if slot >= 0 {
            let flag = &SLOTS[slot as usize].0;
            flag.store(1, Relaxed);
            std::sync::atomic::compiler_fence(SeqCst);
            if ALL_OPEN.load(Relaxed) {
                return Some(Ok(Pass {
                    pending: SLOT_BASE - slot,
                    track: -1,
                }));
            }
            flag.store(0, Release);
        }
    }
    // Same Dekker handshake as the per-device lane below, on one counter.
    GLOBAL_IN_FLIGHT.fetch_add(1, SeqCst);
    if ALL_OPEN.load(SeqCst) {
        return Some(Ok(Pass {
            pending: ALL_LANE,
            track: -1,
        }));
    }
    GLOBAL_IN_FLIGHT.fetch_sub(1, SeqCst);
    let mut dev: CUdevice = -1;
    if unsafe { call::cuCtxGetDevice(&mut dev) } != CUDA_SUCCESS
        || !(0..MAX_DEVICES as i32).contains(&dev)
    {
        // No context: the driver will refuse the launch itself.
        return Some(Ok(Pass::FREE));
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
            return Some(Ok(Pass {
                pending: dev,
                track: if bounded { dev } else { -1 },
            }));
        }
        // Never send while counted in flight: a release in progress holds
        // the send lock while it waits for that count to drop.
        IN_FLIGHT[d].fetch_sub(1, SeqCst);
        if !GATED.load(Acquire) {
            return Some(Ok(Pass::FREE));
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
            return Some(Ok(Pass {
                pending: -1,
                track: dev,
            }));
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

/// `Pass::pending` of a launch that went through the ALL_OPEN lane.
const ALL_LANE: i32 = -2;

/// After the driver call of a launch that `may_launch` let through with
/// `pass`, on `stream` (`ptsz`: with per-thread default stream
/// semantics). A launch that spans several streams passes once per stream
/// and gives back every pass (a pass never given back is an in-flight
/// count that a release waits for forever).
#[inline(always)]
pub fn launched(pass: Pass, rc: u32, stream: CUstream, ptsz: bool) {
    let t = pass.track;
    if t >= 0 && rc == CUDA_SUCCESS {
        crate::inflight::record(t as usize, stream, ptsz);
    }
    let d = pass.pending;
    if d >= 0 {
        IN_FLIGHT[d as usize].fetch_sub(1, SeqCst);
    } else if d == ALL_LANE {
        GLOBAL_IN_FLIGHT.fetch_sub(1, SeqCst);
    } else if d <= SLOT_BASE {
        SLOTS[(SLOT_BASE - d) as usize].0.store(0, Release);
    }
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
pub fn send(msg: &ClientMsg) -> bool {
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

/// Opens `dev` under a grant (see `Action::Open`).
pub fn open(d: usize, contended: bool, bound_ns: u64, stamp: Option<u64>, all_open: bool) {
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

/// Stops launching on `d`, waits for launches already past the gate and
/// tells the broker (`ask_again` first).
pub fn release(d: usize, ask_again: Option<ClientMsg>, msg: &ClientMsg) {
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

pub fn request_drain(d: usize) {
    DRAIN_REQ.fetch_or(1 << d, SeqCst);
    let _g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    DRAIN_WAIT.1.notify_one();
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

/// The gate's state, read for a tick of the session. Syncing is read
/// first: a thread that stops waiting for its own work stamps its last
/// launch after, so the stamp is seen with it or the wait is.
pub fn gauges() -> Gauges {
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

/// The registered devices: `n` of them.
pub fn set_devices(n: usize) {
    NDEV.store(n.min(MAX_DEVICES) as u32, Relaxed);
}

pub fn device_count() -> usize {
    (NDEV.load(Relaxed) as usize).min(MAX_DEVICES)
}

/// A registered connection: application threads may send on `fd`, and
/// launches are arbitrated from now on (every gate closed until granted).
pub fn arbitrate(fd: i32) {
    close_gates();
    CONN_FD.store(fd, Release);
    GATED.store(true, Release);
    wake_all();
}

/// No broker to arbitrate: every gate closed; with `gated` launches wait
/// for one, otherwise they run unarbitrated.
pub fn unarbitrated(gated: bool) {
    close_gates();
    GATED.store(gated, Release);
    wake_all();
}

/// The connection is going: no thread sends on it from now on.
pub fn unpublish() {
    CONN_FD.store(-1, Release);
}

/// Returns once a send in progress has finished.
pub fn wait_for_senders() {
    drop(SEND.lock().unwrap_or_else(|e| e.into_inner()));
}

/// Some optimistic window is open: the session needs a fine tick.
pub fn any_optimistic() -> bool {
    OPTIMISTIC_UNTIL.iter().any(|o| o.load(Relaxed) != 0)
}

/// Ends `d`'s optimistic window if it is still the one that ends at
/// `until`, and drains what went out meanwhile. An application thread
/// may have closed it first (and drained), or opened a new one.
pub fn end_optimism(d: usize, until: u64) {
    if OPTIMISTIC_UNTIL[d]
        .compare_exchange(until, 0, Relaxed, Relaxed)
        .is_ok()
    {
        request_drain(d);
    }
}

/// Blocks until some released device is to be drained; returns them.
pub fn drains() -> u64 {
    let mut g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let r = DRAIN_REQ.swap(0, SeqCst);
        if r != 0 {
            return r;
        }
        g = DRAIN_WAIT.1.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// A fork child has no client thread and no connection of its own yet:
/// every gate state goes back to the start.
pub fn reset_after_fork() {
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

/// The connection's descriptor, for a fork child to close (-1: none).
pub fn take_fd() -> i32 {
    CONN_FD.swap(-1, SeqCst)
}
