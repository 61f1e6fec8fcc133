//! The execution engine: one serial timeline per device, shared by every
//! process on the state file, in CLOCK_MONOTONIC nanoseconds.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::*};

use crate::objects::Target;
use crate::state::Sim;

pub use gpufrac_common::clock::{mono_ns as now_ns, sleep_until as wait_until};

/// The kernel duration convention: `kernelParams[0]` points to a u64 of
/// nanoseconds; NULL anywhere means 0.
#[inline(always)]
pub unsafe fn duration_from_params(params: *mut *mut c_void) -> u64 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: the caller's kernelParams array has at least one entry when
    // non-NULL, as the convention requires.
    let p0 = unsafe { *params };
    if p0.is_null() {
        0
    } else {
        unsafe { (p0 as *const u64).read_unaligned() }
    }
}

/// Reserves `d` ns on the device engine after everything already queued and
/// after the stream's own tail. Returns the kernel's end time.
#[inline(always)]
pub fn launch(sim: &Sim, t: Target, d: u64) -> u64 {
    let dev = sim.shared_dev(t.ctx.device);
    let now = now_ns();
    let floor = now.max(t.tail.load(Acquire));
    let mut cur = dev.engine_free_at.load(Acquire);
    let end = loop {
        let end = floor.max(cur).saturating_add(d);
        match dev
            .engine_free_at
            .compare_exchange_weak(cur, end, AcqRel, Acquire)
        {
            Ok(_) => break end,
            Err(c) => cur = c,
        }
    };
    fetch_max(t.tail, end);
    if !std::ptr::eq(t.tail, &t.ctx.tail) {
        fetch_max(&t.ctx.tail, end);
    }
    dev.busy_ns_total.fetch_add(d, Relaxed);
    dev.kernels_total.fetch_add(1, Relaxed);
    end
}

#[inline(always)]
fn fetch_max(a: &AtomicU64, v: u64) {
    // Skip the read-modify-write when it would change nothing (common for
    // the context tail).
    if a.load(Relaxed) < v {
        a.fetch_max(v, AcqRel);
    }
}

/// When all work submitted so far to `t` completes (for events and syncs).
#[inline]
pub fn completion(t: Target) -> u64 {
    t.tail.load(Acquire)
}
