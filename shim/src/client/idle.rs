//! What idle hand-back reads: when this process last launched on each
//! device, and whether a thread is waiting for its own work (a
//! synchronize call, or room under the in-flight bound), which is not
//! idleness. The session decides from these (`Gauges`) at its ticks.

use gpufrac_common::clock::mono_ns as now_ns;
use gpufrac_common::config::MAX_DEVICES;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// Threads blocked in a synchronize call or waiting for room.
static SYNCING: AtomicU32 = AtomicU32::new(0);
static LAST_LAUNCH: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Largest device count registered (bounded by MAX_DEVICES).
static NDEV: AtomicU32 = AtomicU32::new(0);

/// Runs a synchronize call, marked, so idle hand-back does not fire while
/// the process waits for its own work; every device counts as just used
/// once it returns.
#[inline(always)]
pub fn syncing<F: FnOnce() -> u32>(f: F) -> u32 {
    SYNCING.fetch_add(1, SeqCst);
    let rc = f();
    SYNCING.fetch_sub(1, SeqCst);
    let now = now_ns();
    for l in LAST_LAUNCH.iter().take(device_count()) {
        l.store(now, Relaxed);
    }
    rc
}

/// Waits for room under `bound` on `d`: waiting for this process's own
/// kernels, so no idle hand-back meanwhile.
pub fn wait_room(d: usize, bound: u64) {
    SYNCING.fetch_add(1, SeqCst);
    crate::inflight::wait_room(d, bound);
    SYNCING.fetch_sub(1, SeqCst);
    stamp(d, now_ns());
}

/// `d` was launched on at `t`.
pub fn stamp(d: usize, t: u64) {
    LAST_LAUNCH[d].store(t, Relaxed);
}

/// Some thread waits for its own work. Read before the stamps: a thread
/// that stops waiting stamps its last launch after, so the stamp is seen
/// with it or the wait is.
pub fn waiting() -> bool {
    SYNCING.load(SeqCst) > 0
}

pub fn last_launch(d: usize) -> u64 {
    LAST_LAUNCH[d].load(Relaxed)
}

/// The registered devices: `n` of them.
pub fn set_devices(n: usize) {
    NDEV.store(n.min(MAX_DEVICES) as u32, Relaxed);
}

pub fn device_count() -> usize {
    (NDEV.load(Relaxed) as usize).min(MAX_DEVICES)
}
