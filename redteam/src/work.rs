//! The work meter: what the broker's core did for a call, counted as the
//! allocations it made on this thread and their bytes. A read of
//! `/proc/PID/cmdline`, an escape, a status page, a frame decoded: each
//! allocates in proportion to its work, so the count grows with a size a
//! user controls exactly where the work does, and it is the same on
//! every machine for a given build (a clock would not be). The harness's
//! own bookkeeping is left out (`paused`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting what each thread allocates.
pub struct Counting;

thread_local! {
    static ALLOCATED: Cell<Tally> = const { Cell::new(Tally { bytes: 0, allocs: 0 }) };
    static PAUSED: Cell<bool> = const { Cell::new(false) };
}

/// Allocations made and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub bytes: u64,
    pub allocs: u64,
}

impl std::ops::Sub for Tally {
    type Output = Tally;
    fn sub(self, o: Tally) -> Tally {
        Tally {
            bytes: self.bytes - o.bytes,
            allocs: self.allocs - o.allocs,
        }
    }
}

fn count(bytes: usize) {
    // `try_with`: an allocation while the thread is being torn down must
    // not panic. The cells have no destructor, so this never fails in
    // practice.
    let _ = PAUSED.try_with(|p| {
        if !p.get() {
            let _ = ALLOCATED.try_with(|a| {
                let t = a.get();
                a.set(Tally {
                    bytes: t.bytes + bytes as u64,
                    allocs: t.allocs + 1,
                });
            });
        }
    });
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// count is a thread-local cell, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A growth copies what was there into room for the new size.
        count(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// What this thread has allocated so far, outside `paused`.
pub fn allocated() -> Tally {
    ALLOCATED.with(Cell::get)
}

/// Runs `f` without counting what it allocates: the harness's own
/// bookkeeping inside a call to the core (the log capture) is no work of
/// the broker's.
pub fn paused<R>(f: impl FnOnce() -> R) -> R {
    let was = PAUSED.with(|p| p.replace(true));
    let r = f();
    PAUSED.with(|p| p.set(was));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_counted_and_paused_ones_are_not() {
        let before = allocated();
        let v: Vec<u8> = Vec::with_capacity(10_000);
        let during = allocated() - before;
        assert!(during.bytes >= 10_000 && during.allocs >= 1, "{during:?}");
        drop(v);
        let before = allocated();
        let v = paused(|| vec![0u8; 10_000]);
        assert!((allocated() - before).bytes < 10_000);
        drop(v);
    }
}
