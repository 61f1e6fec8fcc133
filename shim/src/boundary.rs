//! The FFI boundary every export goes through: a panic inside the shim must
//! never unwind into the host program, and must not cost it its CUDA call.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    // Const-initialised and destructor-free: safe to touch from any hook,
    // even one that fires while the thread is being torn down.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body`; if it panics, logs once per call and answers with `fallback`
/// (the plain driver call) instead.
#[inline(always)]
pub fn run<F: FnOnce() -> u32, G: FnOnce() -> u32>(name: &str, body: F, fallback: G) -> u32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            crate::log::write_line(format_args!(
                "internal error in {name}; passing the call to the driver unchanged"
            ));
            fallback()
        }
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
/// with the host's output) by one raw line. Our cdylib carries its own copy
/// of std, so this does not touch the host program's hook.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let loc = info.location();
        crate::log::write_line(format_args!(
            "internal panic at {}:{}",
            loc.map(|l| l.file()).unwrap_or("?"),
            loc.map(|l| l.line()).unwrap_or(0)
        ));
    }));
}

/// Fault injection for the tests, in debug builds only: the hook named by
/// `GPUFRAC_TEST_PANIC` panics inside its boundary, to prove that the panic
/// is contained and the call still reaches the driver. Release builds
/// compile this to nothing.
#[inline(always)]
pub fn test_panic(name: &str) {
    #[cfg(debug_assertions)]
    {
        static WHICH: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let which = WHICH.get_or_init(|| std::env::var("GPUFRAC_TEST_PANIC").ok());
        if which.as_deref() == Some(name) {
            panic!("GPUFRAC_TEST_PANIC={name}");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = name;
}
