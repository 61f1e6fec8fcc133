//! The device lock and the crash-handling around it: the lock word holds
//! the holder's process token, a waiter that finds the holder dead takes
//! the lock over (the model's committed record is whole, see `model.rs`),
//! and test-only fault injection kills the process at the points where a
//! crash is hardest to survive.

use std::sync::atomic::{AtomicU64, Ordering::*};

use super::crash::{CRASH_HOLDING_LOCK, crash_point};
use super::model::Engine;

pub(super) struct Guard<'a>(&'a AtomicU64);

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Release);
    }
}

const SPINS: u32 = 64;
const YIELDS: u32 = 64;
/// Every this many waits past spinning, ask whether the holder is alive.
const LOOK_EVERY: u32 = 8;

pub(super) fn lock<'a>(eng: &'a Engine, me: u64, alive: impl Fn(u64) -> bool) -> Guard<'a> {
    let mut n: u32 = 0;
    loop {
        let h = eng.lock.load(Relaxed);
        if h == 0 {
            if eng
                .lock
                .compare_exchange_weak(0, me, Acquire, Relaxed)
                .is_ok()
            {
                break;
            }
        } else if h != me
            && n >= SPINS
            && (n - SPINS).is_multiple_of(LOOK_EVERY)
            && !alive(h)
            && eng.lock.compare_exchange(h, me, Acquire, Relaxed).is_ok()
        {
            // Its holder was killed inside: the committed record is whole.
            break;
        }
        n = n.saturating_add(1);
        if n < SPINS {
            std::hint::spin_loop();
        } else if n < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            // The holder is descheduled (or dead): stop competing for CPU.
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
    crash_point(CRASH_HOLDING_LOCK);
    Guard(&eng.lock)
}
