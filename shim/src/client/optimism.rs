//! The optimistic window: a process that starts launching after being idle
//! does not wait for the broker's answer. Until the window (per device)
//! ends, its launches go straight to the GPU, as they would without
//! gpufrac, while the broker makes room. Waiting first is what would make
//! sharing through gpufrac slower than the GPU's own time-slicing. What
//! went out meanwhile is charged until it has run: a window that ends
//! without a grant asks for that report (a drain).

use super::drain;
use gpufrac_common::clock::mono_ns as now_ns;
use gpufrac_common::config::MAX_DEVICES;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// When each device's window ends (0: none open).
static OPTIMISTIC_UNTIL: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
const OPTIMISTIC_NS: u64 = 1_000_000;
/// What a process may queue before the broker answers: a request of short
/// kernels goes out whole, a batch job that wakes up queues no more than
/// one long kernel (the broker's own burst bound).
pub const BOUND_NS: u64 = 2_000_000;

/// Opens `d`'s window, as its request is about to leave (so that a quick
/// grant closes it).
pub fn open(d: usize) {
    OPTIMISTIC_UNTIL[d].store(now_ns() + OPTIMISTIC_NS, Relaxed);
}

/// `d`'s window is open at `now`.
pub fn is_open(d: usize, now: u64) -> bool {
    now < OPTIMISTIC_UNTIL[d].load(Relaxed)
}

/// A grant or a release ends `d`'s window: nothing to drain for it.
pub fn close(d: usize) {
    OPTIMISTIC_UNTIL[d].store(0, Relaxed);
}

/// Closes `d`'s window if it has run out without a grant, and drains.
pub fn expire(d: usize, now: u64) {
    let o = &OPTIMISTIC_UNTIL[d];
    let until = o.load(Relaxed);
    if until != 0 && now >= until && o.swap(0, Relaxed) != 0 {
        drain::request(d);
    }
}

/// Ends `d`'s window if it is still the one that ends at `until`, and
/// drains what went out meanwhile. An application thread may have closed
/// it first (and drained), or opened a new one.
pub fn end(d: usize, until: u64) {
    if OPTIMISTIC_UNTIL[d]
        .compare_exchange(until, 0, Relaxed, Relaxed)
        .is_ok()
    {
        drain::request(d);
    }
}

/// Some window is open: the session needs a fine tick.
pub fn any() -> bool {
    OPTIMISTIC_UNTIL.iter().any(|o| o.load(Relaxed) != 0)
}

/// Every window's end, for the session's gauges.
pub fn read(into: &mut [u64; MAX_DEVICES]) {
    for (g, o) in into.iter_mut().zip(&OPTIMISTIC_UNTIL) {
        *g = o.load(Relaxed);
    }
}

/// A fork child has asked for nothing yet.
pub fn reset_after_fork() {
    for o in &OPTIMISTIC_UNTIL {
        o.store(0, SeqCst);
    }
}
