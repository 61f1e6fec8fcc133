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
//!   driver as the application made it, so the program keeps working —
//!   unless the hook had already made that call before it failed: then the
//!   driver's answer to it is the answer (a free or a launch made twice
//!   would free someone else's memory or run a kernel twice).
//! - [`pass_through_settled`], the same policy for the launches, whose
//!   hooks settle their own driver call ([`Answer::then`]): a panic after
//!   it unwinds carrying the driver's answer, so no record is kept on the
//!   way. [`pass_through`] keeps its record in a thread-local, and in a
//!   preloaded library every thread-local access is a call
//!   (`__tls_get_addr`): two of them were most of what a launch added.
//!
//! Either way one line on stderr, once per entry point, says which entry
//! point failed, where the panic was, and what was done about it.

use gpufrac_common::cuda::CUDA_ERROR_OUT_OF_MEMORY;
use std::cell::Cell;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

thread_local! {
    // Const-initialised and destructor-free: safe to touch from any hook,
    // even one that fires while the thread is being torn down.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
    // The real function the innermost pass-through boundary stands for (its
    // slot's address, 0: none) and the driver's answer once it was called
    // (NOT_REACHED: not yet). One cell, not two: in a preloaded library
    // every thread-local access is a call (__tls_get_addr), and this one is
    // on every launch's path.
    static WATCH: Cell<(usize, u64)> = const { Cell::new((0, NOT_REACHED)) };
}

const NOT_REACHED: u64 = u64::MAX;

/// Called by the driver layer after each real call of a pass-through entry
/// point: when it is the one the innermost boundary stands for, that
/// boundary must never call it again.
#[inline(always)]
pub fn answered(slot: usize, rc: u32) {
    WATCH.with(|w| {
        if w.get().0 == slot {
            w.set((slot, u64::from(rc)));
        }
    });
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

/// Runs the body of an entry point that hands out no memory, whose real
/// function lives in `slot`; if it panics, `forward` makes the
/// application's call to the driver instead — or, when the body had
/// already made it, the driver's answer to that call is returned.
#[inline(always)]
pub fn pass_through<F: FnOnce() -> u32, G: FnOnce() -> u32>(
    name: &str,
    told: &AtomicBool,
    slot: &'static AtomicUsize,
    body: F,
    forward: G,
) -> u32 {
    let me = slot as *const AtomicUsize as usize;
    // Saved and restored: a driver that calls back into another export
    // from inside this one must not lose the outer boundary's watch.
    let outer = WATCH.with(|w| w.replace((me, NOT_REACHED)));
    let r = catch_unwind(AssertUnwindSafe(body));
    let (_, answer) = WATCH.with(|w| w.replace(outer));
    match r {
        Ok(rc) => rc,
        Err(_) if answer != NOT_REACHED => {
            tell(name, told, NOT_TWICE);
            answer as u32
        }
        Err(_) => {
            tell(name, told, FORWARDED);
            forward()
        }
    }
}

/// The driver's answer to the call a settled hook made, carried by the
/// panic that followed it (see [`Answer::then`]).
struct Reached(u32);

/// A settled entry point's driver call, made: its answer, which the hook
/// hands back through [`Answer::then`] (the driver layer's callers of the
/// `pass_through_settled` section return it).
#[must_use = "a settled call is handed back with `then`"]
pub struct Answer {
    rc: u32,
    name: &'static str,
}

impl Answer {
    #[inline(always)]
    pub fn new(rc: u32, name: &'static str) -> Self {
        Answer { rc, name }
    }

    /// Runs `after`, what the hook does once the driver answered, and
    /// returns the answer. A panic in `after` goes on unwinding carrying
    /// the answer, which the boundary returns instead of calling the
    /// driver a second time.
    #[inline(always)]
    pub fn then(self, after: impl FnOnce(u32)) -> u32 {
        let Answer { rc, name } = self;
        let done = catch_unwind(AssertUnwindSafe(|| {
            after(rc);
            fault_after(name);
        }));
        if done.is_err() {
            carry(rc);
        }
        rc
    }
}

#[cold]
#[inline(never)]
fn carry(rc: u32) -> ! {
    std::panic::resume_unwind(Box::new(Reached(rc)))
}

/// [`pass_through`] for an entry point whose hook settles its driver call
/// (see [`Answer`]): a panic that carries the driver's answer returns it,
/// any other forwards the call.
#[inline(always)]
pub fn pass_through_settled<F: FnOnce() -> u32, G: FnOnce() -> u32>(
    name: &str,
    told: &AtomicBool,
    body: F,
    forward: G,
) -> u32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(payload) => match payload.downcast::<Reached>() {
            Ok(reached) => {
                tell(name, told, NOT_TWICE);
                reached.0
            }
            Err(_) => {
                tell(name, told, FORWARDED);
                forward()
            }
        },
    }
}

const NOT_TWICE: &str =
    "the driver's answer to the call the hook had already made is returned (it is not made twice)";
const FORWARDED: &str =
    "the call goes to the driver as the application made it (this entry point hands out no memory)";

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
/// an exported entry point's name (at the start of its boundary),
/// `after:` and a pass-through entry point's name (once its hook returned,
/// the driver called; for a settled one, at the end of the step its hook
/// settles the call with), or `charge` (in the middle of a charge: after the
/// driver allocated, before the allocation is recorded — the worst place
/// for the books).
#[inline(always)]
#[track_caller]
pub fn fault(point: &str) {
    fault_at("", point);
}

/// Fault injection after a hook's body returned (its driver call made):
/// `GPUFRAC_TEST_PANIC=after:<entry point>`.
#[inline(always)]
#[track_caller]
pub fn fault_after(point: &str) {
    fault_at("after:", point);
}

#[inline(always)]
#[track_caller]
fn fault_at(stage: &str, point: &str) {
    #[cfg(debug_assertions)]
    {
        static WHICH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let which = WHICH.get_or_init(|| std::env::var("GPUFRAC_TEST_PANIC").ok());
        if which
            .as_deref()
            .and_then(|w| w.strip_prefix(stage))
            .is_some_and(|w| w == point)
        {
            panic!("GPUFRAC_TEST_PANIC={stage}{point}");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = (stage, point);
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

    static SLOT: AtomicUsize = AtomicUsize::new(0);
    static OTHER: AtomicUsize = AtomicUsize::new(0);

    fn addr(s: &'static AtomicUsize) -> usize {
        s as *const AtomicUsize as usize
    }

    #[test]
    fn a_panic_before_the_driver_call_forwards_the_call_once() {
        let told = AtomicBool::new(false);
        let forwarded = AtomicU32::new(0);
        for _ in 0..2 {
            let rc = pass_through(
                "cuMemGetInfo_v2",
                &told,
                &SLOT,
                || {
                    // Another real function called: not the one forwarded.
                    answered(addr(&OTHER), 0);
                    panic!("in the view")
                },
                || {
                    forwarded.fetch_add(1, Ordering::Relaxed);
                    7
                },
            );
            assert_eq!(rc, 7);
        }
        assert_eq!(forwarded.load(Ordering::Relaxed), 2);
        assert_eq!(pass_through("x", &told, &SLOT, || 3, || unreachable!()), 3);
    }

    #[test]
    fn a_panic_after_the_driver_call_returns_its_answer_without_calling_again() {
        let told = AtomicBool::new(false);
        let rc = pass_through(
            "cuMemFree_v2",
            &told,
            &SLOT,
            || {
                answered(addr(&SLOT), 0);
                panic!("after the free")
            },
            || unreachable!("a free made twice"),
        );
        assert_eq!(rc, 0);
        // The watch ends with the boundary: a call made later is no answer.
        answered(addr(&SLOT), 5);
        let rc = pass_through(
            "cuMemFree_v2",
            &told,
            &SLOT,
            || panic!("before the free"),
            || 9,
        );
        assert_eq!(rc, 9);
    }

    #[test]
    fn an_inner_boundary_keeps_the_outer_ones_watch() {
        let told = AtomicBool::new(false);
        let rc = pass_through(
            "cuLaunchKernel",
            &told,
            &SLOT,
            || {
                answered(addr(&SLOT), 4);
                // The driver calls another export from inside this one.
                let inner = pass_through("cuCtxGetDevice", &told, &OTHER, || 0, || 1);
                assert_eq!(inner, 0);
                panic!("after both")
            },
            || unreachable!("a launch made twice"),
        );
        assert_eq!(rc, 4);
    }

    #[test]
    fn a_settled_call_is_not_made_again_after_a_panic() {
        let told = AtomicBool::new(false);
        let made = AtomicU32::new(0);
        let call = || {
            made.fetch_add(1, Ordering::Relaxed);
            Answer::new(4, "cuLaunchKernel")
        };
        let rc = pass_through_settled(
            "cuLaunchKernel",
            &told,
            || call().then(|_| panic!("after the launch")),
            || unreachable!("a launch made twice"),
        );
        assert_eq!((rc, made.load(Ordering::Relaxed)), (4, 1));
        assert!(told.load(Ordering::Relaxed), "said");
        // Before the call: forwarded.
        let rc = pass_through_settled("cuLaunchKernel", &told, || panic!("in the gate"), || 9);
        assert_eq!(rc, 9);
        // An inner settled boundary's answer stays inside it.
        let rc = pass_through_settled(
            "cuLaunchKernel",
            &told,
            || {
                let inner = pass_through_settled(
                    "cuLaunchKernel_ptsz",
                    &told,
                    || call().then(|_| panic!("inner")),
                    || unreachable!(),
                );
                assert_eq!(inner, 4);
                panic!("before the outer call")
            },
            || 11,
        );
        assert_eq!(rc, 11);
        assert_eq!(
            pass_through_settled("x", &told, || call().then(|_| {}), || 0),
            4
        );
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
