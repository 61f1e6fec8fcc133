//! The compute gate: what an application thread does before and after a
//! launch, and the gate's side of each decision of the broker session
//! (opening a device, releasing one, closing every gate).
//!
//! With no arbitration (no broker, or `GPUFRAC_BROKER=off`) a launch costs
//! one atomic load. With a broker, a launch on a device this process holds
//! is a handful of atomics and no syscall; only a launch on a device it
//! does not hold asks the broker and waits (`asking.rs`). The client
//! thread (`client.rs`) is the only writer of `OPEN`, `CONTENDED` and
//! `BOUNDED`, through `open`, `release` and `close_gates`, as the session
//! (`session.rs`) decides.

use super::send::{self, send_locked};
use super::{asking, drain, idle, optimism, slots};
use crate::driver::call;
use crate::ledger::LEDGERS;
use crate::session::Gauges;
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use gpufrac_common::wire::ClientMsg;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};

/// Launches must consult the per-device bits.
static GATED: AtomicBool = AtomicBool::new(false);
/// Devices this process may launch on now.
static OPEN: AtomicU64 = AtomicU64::new(0);
/// Every registered device is held under an open-ended grant: launches
/// need not even look up their device (the common case of a job alone on
/// its GPU). Cleared first by anything that closes a device.
static ALL_OPEN: AtomicBool = AtomicBool::new(false);
/// Launches that went through the ALL_OPEN lane on the counter and have not
/// returned (threads without a slot, see slots.rs).
static GLOBAL_IN_FLIGHT: AtomicU32 = AtomicU32::new(0);

/// Devices held under a contended (sliced) grant: idle hand-back applies.
static CONTENDED: AtomicU64 = AtomicU64::new(0);
/// Devices held under a grant with an in-flight bound (others share the
/// GPU): launches there are tracked (see inflight.rs), and idle hand-back
/// applies.
static BOUNDED: AtomicU64 = AtomicU64::new(0);
static BOUND_NS: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static IN_FLIGHT: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];

const SLOT_BASE: i32 = -100;

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
    if let Some(slot) = slots::enter() {
        if ALL_OPEN.load(Relaxed) {
            return Some(Ok(Pass {
                pending: SLOT_BASE - slot,
                track: -1,
            }));
        }
        slots::leave(slot);
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
        let optimistic = OPEN.load(Acquire) & bit == 0 && optimism::is_open(d, now_ns());
        if bounded {
            idle::wait_room(d, BOUND_NS[d].load(Relaxed));
        } else if optimistic {
            idle::wait_room(d, optimism::BOUND_NS);
        }
        IN_FLIGHT[d].fetch_add(1, SeqCst);
        if OPEN.load(SeqCst) & bit != 0 {
            if shared() & bit != 0 {
                idle::stamp(d, now_ns());
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
        if asking::ask(d, true) {
            continue;
        }
        let now = now_ns();
        if optimistic && optimism::is_open(d, now) {
            // Not counted in flight: this process holds no grant that a
            // release would have to wait for.
            return Some(Ok(Pass {
                pending: -1,
                track: dev,
            }));
        }
        optimism::expire(d, now);
        asking::wait_for_grant(d, || GATED.load(Acquire) && OPEN.load(SeqCst) & bit == 0);
    }
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
        slots::leave(SLOT_BASE - d);
    }
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
    asking::forget_all();
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
        idle::stamp(d, t);
    }
    if bound_ns == 0 {
        BOUNDED.fetch_and(!bit, SeqCst);
    } else {
        BOUNDED.fetch_or(bit, SeqCst);
    }
    optimism::close(d);
    if contended {
        CONTENDED.fetch_or(bit, SeqCst);
    } else {
        CONTENDED.fetch_and(!bit, SeqCst);
    }
    OPEN.fetch_or(bit, SeqCst);
    asking::granted(bit);
    ALL_OPEN.store(all_open, SeqCst);
    asking::wake_all();
}

/// Stops launching on `d`, waits for launches already past the gate and
/// tells the broker (`ask_again` first).
pub fn release(d: usize, ask_again: Option<ClientMsg>, msg: &ClientMsg) {
    let bit = 1u64 << d;
    // Held until the Release is on the wire: an application thread that
    // finds the gate closed and asks again must be heard *after* this
    // release, or the broker would take its Acquire for the holder's and
    // then idle it.
    let sending = send::lock();
    ALL_OPEN.store(false, SeqCst);
    slots::fence_all();
    if OPEN.fetch_and(!bit, SeqCst) & bit == 0 {
        // Closed under the session by a contained panic: nothing to hand
        // back.
        return;
    }
    optimism::close(d);
    if let Some(acquire) = ask_again {
        // Still busy: ask again *before* releasing, to keep this process's
        // place in the fair queue instead of going idle.
        asking::asked(bit);
        send_locked(&sending, &acquire);
    }
    while IN_FLIGHT[d].load(SeqCst) > 0 || GLOBAL_IN_FLIGHT.load(SeqCst) > 0 || slots::any_inside()
    {
        std::thread::yield_now();
    }
    CONTENDED.fetch_and(!bit, SeqCst);
    BOUNDED.fetch_and(!bit, SeqCst);
    send_locked(&sending, msg);
}

/// Wraps a synchronize call so idle hand-back does not fire while the
/// process waits for its own work.
#[inline(always)]
pub fn syncing<F: FnOnce() -> u32>(f: F) -> u32 {
    if !GATED.load(Relaxed) {
        return f();
    }
    idle::syncing(f)
}

/// The gate's state, read for a tick of the session (waiting for own work
/// first, see `idle::waiting`).
pub fn gauges() -> Gauges {
    let mut g = Gauges {
        requested: asking::requested(),
        syncing: idle::waiting(),
        ..Gauges::default()
    };
    for d in 0..idle::device_count() {
        if IN_FLIGHT[d].load(Relaxed) != 0 {
            g.in_flight |= 1 << d;
        }
        g.last_launch[d] = idle::last_launch(d);
        let l = &LEDGERS[d];
        g.usage[d] = (
            l.used.load(Relaxed),
            l.peak.load(Relaxed),
            l.ooms.load(Relaxed),
        );
    }
    optimism::read(&mut g.optimistic_until);
    g
}

/// A registered connection: application threads may send on `fd`, and
/// launches are arbitrated from now on (every gate closed until granted).
pub fn arbitrate(fd: i32) {
    close_gates();
    send::publish(fd);
    GATED.store(true, Release);
    asking::wake_all();
}

/// No broker to arbitrate: every gate closed; with `gated` launches wait
/// for one, otherwise they run unarbitrated.
pub fn unarbitrated(gated: bool) {
    close_gates();
    GATED.store(gated, Release);
    asking::wake_all();
}

/// A fork child has no client thread and no connection of its own yet:
/// every gate state goes back to the start.
pub fn reset_after_fork() {
    GATED.store(false, SeqCst);
    ALL_OPEN.store(false, SeqCst);
    GLOBAL_IN_FLIGHT.store(0, SeqCst);
    slots::reset_after_fork();
    close_gates();
    drain::reset_after_fork();
    optimism::reset_after_fork();
    for c in &IN_FLIGHT {
        c.store(0, SeqCst);
    }
}
