//! The FFI boundary every export goes through. No panic may unwind into the
//! host program, and what the shim does instead depends on what the entry
//! point does (the sections of `hooklist.rs`):
//!
//! - [`fail_closed`], for entry points that hand out device memory: an
//!   internal error refuses the call with `CUDA_ERROR_OUT_OF_MEMORY`. The
//!   shim cannot tell what state the panic left its books in, and a user
//!   who asked for a cap must never run past it; an allocation refused is
//!   a condition every CUDA program already handles.
//! - [`pass_through`], for entry points that hand out none (lookups,
//!   launches, frees, queries): an internal error forwards the call to the
//!   driver as the application made it, so the program keeps working.
//!
//! Either way one line on stderr, once per entry point, says which entry
//! point failed, where the panic was, and what was done about it.

use gpufrac_common::cuda::CUDA_ERROR_OUT_OF_MEMORY;
use std::cell::Cell;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    // Const-initialised and destructor-free: safe to touch from any hook,
    // even one that fires while the thread is being torn down.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Where the last panic happened: kept by the panic hook (which must not
/// allocate or print) for the line the catcher prints. One for the
/// process, not per thread: panics are rare, and a thread-local of this
/// size would sit in every thread's block beside the launch gate's.
static PANIC_AT: Mutex<Where> = Mutex::new(Where::UNKNOWN);

/// Where a panic happened.
#[derive(Clone, Copy)]
pub struct Where {
    file: [u8; 96],
    len: u8,
    line: u32,
}

impl Where {
    const UNKNOWN: Where = Where {
        file: [0; 96],
        len: 0,
        line: 0,
    };

    /// The location of the last panic, forgotten once taken.
    pub fn take() -> Where {
        let mut at = PANIC_AT.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *at, Where::UNKNOWN)
    }
}

impl fmt::Display for Where {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.file[..self.len as usize]) {
            Ok(file) if self.len > 0 => write!(f, "panic at {file}:{}", self.line),
            _ => f.write_str("panic"),
        }
    }
}

/// Runs the body of an entry point that hands out memory; if it panics,
/// the allocation is refused.
#[inline(always)]
pub fn fail_closed<F: FnOnce() -> u32>(name: &str, told: &AtomicBool, body: F) -> u32 {
    contain(
        name,
        told,
        body,
        "the allocation is refused with CUDA_ERROR_OUT_OF_MEMORY (an entry point that hands out memory never bypasses the cap)",
        || CUDA_ERROR_OUT_OF_MEMORY,
    )
}

/// Runs the body of an entry point that hands out no memory; if it
/// panics, `forward` makes the application's call to the driver instead.
#[inline(always)]
pub fn pass_through<F: FnOnce() -> u32, G: FnOnce() -> u32>(
    name: &str,
    told: &AtomicBool,
    body: F,
    forward: G,
) -> u32 {
    contain(
        name,
        told,
        body,
        "the call goes to the driver as the application made it (this entry point hands out no memory)",
        forward,
    )
}

/// Runs `body`; on a panic, says `what` is done (once per `told`) and
/// does it.
#[inline(always)]
fn contain<F: FnOnce() -> u32, G: FnOnce() -> u32>(
    name: &str,
    told: &AtomicBool,
    body: F,
    what: &str,
    instead: G,
) -> u32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            tell(name, told, what);
            instead()
        }
    }
}

#[cold]
fn tell(name: &str, told: &AtomicBool, what: &str) {
    let at = Where::take();
    if !told.swap(true, Ordering::Relaxed) {
        crate::log::write_line(format_args!("internal error in {name} ({at}); {what}"));
    }
}

/// True when this thread is already inside one of our hooks: a driver that
/// calls its own exported entry points must not be accounted twice.
#[inline(always)]
pub fn reentered() -> bool {
    IN_HOOK.with(|c| c.get())
}

/// Marks this thread as inside a hook until the guard drops.
pub struct HookGuard(bool);

impl HookGuard {
    #[inline(always)]
    pub fn enter() -> Self {
        HookGuard(IN_HOOK.with(|c| c.replace(true)))
    }
}

impl Drop for HookGuard {
    #[inline(always)]
    fn drop(&mut self) {
        let prev = self.0;
        IN_HOOK.with(|c| c.set(prev));
    }
}

/// Replaces the default panic message (which allocates and may interleave
/// with the host's output) by a note of where it happened, for the one
/// line its catcher prints. Our cdylib carries its own copy of std, so
/// this does not touch the host program's hook.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let mut w = Where::UNKNOWN;
        if let Some(loc) = info.location() {
            let file = loc.file().as_bytes();
            // Keep the end of the path: the file name is what matters.
            let keep = &file[file.len().saturating_sub(w.file.len())..];
            w.file[..keep.len()].copy_from_slice(keep);
            w.len = keep.len() as u8;
            w.line = loc.line();
        }
        // Never waits: a panic elsewhere at this very moment keeps its own.
        if let Ok(mut at) = PANIC_AT.try_lock() {
            *at = w;
        }
    }));
}

/// Fault injection for the tests, compiled into debug builds only (the
/// tests run the debug library; a release build has no such variable):
/// with `GPUFRAC_TEST_PANIC=<point>` the shim panics at `point`, which is
/// an exported entry point's name (at the start of its boundary) or
/// `charge` (in the middle of a charge: after the driver allocated, before
/// the allocation is recorded — the worst place for the books).
#[inline(always)]
#[track_caller]
pub fn fault(point: &str) {
    #[cfg(debug_assertions)]
    {
        static WHICH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let which = WHICH.get_or_init(|| std::env::var("GPUFRAC_TEST_PANIC").ok());
        if which.as_deref() == Some(point) {
            panic!("GPUFRAC_TEST_PANIC={point}");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = point;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_panic_where_memory_is_handed_out_refuses_it() {
        let told = AtomicBool::new(false);
        let rc = fail_closed("cuMemAlloc_v2", &told, || panic!("in the charge"));
        assert_eq!(rc, CUDA_ERROR_OUT_OF_MEMORY);
        assert!(told.load(Ordering::Relaxed), "said once");
        assert_eq!(fail_closed("cuMemAlloc_v2", &told, || 0), 0);
    }

    #[test]
    fn a_panic_elsewhere_forwards_the_call_once() {
        let told = AtomicBool::new(false);
        let forwarded = AtomicU32::new(0);
        for _ in 0..2 {
            let rc = pass_through(
                "cuMemGetInfo_v2",
                &told,
                || panic!("in the view"),
                || {
                    forwarded.fetch_add(1, Ordering::Relaxed);
                    7
                },
            );
            assert_eq!(rc, 7);
        }
        assert_eq!(forwarded.load(Ordering::Relaxed), 2);
        assert_eq!(pass_through("x", &told, || 3, || unreachable!()), 3);
    }

    #[test]
    fn a_location_is_shown_with_its_file_and_line() {
        let mut w = Where::UNKNOWN;
        assert_eq!(w.to_string(), "panic");
        w.file[..9].copy_from_slice(b"ledger.rs");
        w.len = 9;
        w.line = 42;
        assert_eq!(w.to_string(), "panic at ledger.rs:42");
    }
}
