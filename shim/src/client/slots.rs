//! The ALL_OPEN lane's per-thread "inside a launch" flags, a cache line
//! each. With membarrier registered, a launch marks its slot with a plain
//! store and a compiler fence: the full fence that a Dekker handshake needs
//! is paid by the (rare) releaser, through membarrier, instead of by every
//! launch. Slots are never reused; threads beyond them, or a process
//! without membarrier, take the gate's counter instead.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::*};

#[repr(align(64))]
struct Slot(AtomicU32);
const NSLOT: usize = 256;
static SLOTS: [Slot; NSLOT] = [const { Slot(AtomicU32::new(0)) }; NSLOT];
static SLOTS_USED: AtomicU32 = AtomicU32::new(0);
static MEMBARRIER: AtomicBool = AtomicBool::new(false);

thread_local! {
    // This thread's slot: -1 not yet assigned, -3 none left.
    static MY_SLOT: Cell<i32> = const { Cell::new(-1) };
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

/// Marks this thread inside a launch: its slot, or `None` when it must
/// take the counter.
#[inline]
pub fn enter() -> Option<i32> {
    if !MEMBARRIER.load(Relaxed) {
        return None;
    }
    let slot = my_slot();
    if slot < 0 {
        return None;
    }
    SLOTS[slot as usize].0.store(1, Relaxed);
    std::sync::atomic::compiler_fence(SeqCst);
    Some(slot)
}

/// The launch of the thread that holds `slot` is over.
#[inline]
pub fn leave(slot: i32) {
    SLOTS[slot as usize].0.store(0, Release);
}

/// The releaser's half of the handshake: every thread of this process
/// runs a full fence, so a launch either saw the lane closed or its slot
/// is visible to `any_inside`.
pub fn fence_all() {
    if MEMBARRIER.load(Relaxed) {
        // SAFETY: membarrier takes no pointers.
        unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) };
    }
}

/// Some thread is inside a launch through its slot.
pub fn any_inside() -> bool {
    let used = (SLOTS_USED.load(Acquire) as usize).min(NSLOT);
    SLOTS[..used].iter().any(|s| s.0.load(Acquire) != 0)
}

/// membarrier registration belongs to the parent's address space, and no
/// thread of the child is inside a launch.
pub fn reset_after_fork() {
    MEMBARRIER.store(false, SeqCst);
    for s in &SLOTS {
        s.0.store(0, SeqCst);
    }
}
