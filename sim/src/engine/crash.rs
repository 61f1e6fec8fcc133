//! Test-only fault injection: the engine's process dies with SIGKILL at a
//! chosen point (holding the engine lock, or just before committing), so
//! the tests can check that a killed process never leaves the shared
//! engine unusable. Below both `lock` and `model`, which call it.

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;

pub const CRASH_HOLDING_LOCK: u32 = 1;
pub const CRASH_BEFORE_COMMIT: u32 = 2;
static CRASH: AtomicU32 = AtomicU32::new(0);

pub fn arm_crash(at: u32) {
    CRASH.store(at, Relaxed);
}

#[inline(always)]
pub(super) fn crash_point(at: u32) {
    if CRASH.load(Relaxed) == at {
        // SAFETY: plain syscalls.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
