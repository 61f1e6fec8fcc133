//! Staged, lazy initialisation, as one state machine (`Stages`): nothing
//! happens in a library constructor. A process that never calls CUDA
//! (`sh`, `ls`, `python3 -c 1`) gets no thread, no socket, no dlopen and no
//! output from us. The first entry point to fire — whichever it is, on
//! whichever thread — sets the process up (`set_up`, which
//! `hooks::process` drives): it parses the configuration, opens the job's
//! books and loads the driver; concurrent first callers wait for it, and a
//! hook that fires re-entrantly during set-up (on the initialising thread)
//! is told so instead of deadlocking. The first context then starts the
//! broker client (`arbitrate`), once; a fork child goes back to before
//! that (`reset_after_fork`).
//!
//! A configuration that cannot be honoured — a malformed variable, or job
//! books that cannot be used — is kept as an error: every CUDA entry point
//! that needs it answers `CUDA_ERROR_INVALID_VALUE`, and stderr said why.

use crate::{driver, ledger, log};
use gpufrac_common::config::{ConfigError, ShimConfig, VAR_JOB_LEDGER, from_raw_vars};
use gpufrac_common::cuda::*;
use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The process's stages under the shim, one byte:
///
/// ```text
/// UNSET --begin--> SETTING_UP --finish--> READY --arbitrate--> ARBITRATED
///                                           ^                     |
///                                           +--- fork (child) ----+
/// ```
///
/// READY: configured, the driver's slots filled. ARBITRATED: the broker
/// client was started (at the first context; never with
/// `GPUFRAC_BROKER=off`). A fork child keeps its configuration and has
/// no client thread: it starts its own at its own first context.
pub struct Stages(AtomicU8);

const UNSET: u8 = 0;
const SETTING_UP: u8 = 1;
const READY: u8 = 2;
const ARBITRATED: u8 = 3;

impl Stages {
    pub const fn new() -> Stages {
        Stages(AtomicU8::new(UNSET))
    }

    /// Set up: the configuration and the driver are there to read.
    #[inline]
    pub fn ready(&self) -> bool {
        self.0.load(Ordering::Acquire) >= READY
    }

    /// True for the one caller that is to set the process up.
    fn begin(&self) -> bool {
        self.0
            .compare_exchange(UNSET, SETTING_UP, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn finish(&self) {
        self.0.store(READY, Ordering::Release);
    }

    /// Whether another thread is setting the process up now.
    fn setting_up(&self) -> bool {
        self.0.load(Ordering::Acquire) == SETTING_UP
    }

    /// True for the one caller that is to start the broker client: the
    /// process is set up and nobody has started it yet.
    pub fn arbitrate(&self) -> bool {
        self.0
            .compare_exchange(READY, ARBITRATED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// A fork child has no client thread: back to READY (an atomic store,
    /// async-signal-safe).
    pub fn reset_after_fork(&self) {
        let _ = self
            .0
            .compare_exchange(ARBITRATED, READY, Ordering::AcqRel, Ordering::Acquire);
    }
}

static STAGES: Stages = Stages::new();
static CONFIG: OnceLock<Result<ShimConfig, String>> = OnceLock::new();

thread_local! {
    static INITIALISING: Cell<bool> = const { Cell::new(false) };
}

/// The configuration, or the message of what was wrong; None before the
/// process is set up (or re-entered while it is). Sets nothing up itself:
/// entry points reach it through `hooks::process`, which does.
#[inline]
pub fn current() -> Option<&'static Result<ShimConfig, String>> {
    if STAGES.ready() {
        return CONFIG.get();
    }
    wait_for_set_up()
}

/// Whether the process is set up (the driver's slots are filled).
#[inline]
pub fn ready() -> bool {
    STAGES.ready()
}

/// `current`, as a CUDA entry point must answer: `Err(code)` when the
/// configuration did not parse, or is not there yet.
#[inline]
pub fn settled(
    cfg: Option<&'static Result<ShimConfig, String>>,
) -> Result<&'static ShimConfig, u32> {
    match cfg {
        Some(Ok(c)) => Ok(c),
        Some(Err(_)) => Err(CUDA_ERROR_INVALID_VALUE),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// `current` as an entry point answers it (see `settled`).
#[inline]
pub fn get() -> Result<&'static ShimConfig, u32> {
    settled(current())
}

#[cold]
fn wait_for_set_up() -> Option<&'static Result<ShimConfig, String>> {
    if INITIALISING.with(|c| c.get()) {
        // Re-entered from inside our own set-up (the driver's constructor
        // calling back into us): the configuration may not exist yet.
        return CONFIG.get();
    }
    while STAGES.setting_up() {
        std::thread::yield_now();
    }
    CONFIG.get()
}

/// Sets the process up once: parses the environment, opens the job's
/// books, loads libcuda.so.1, then runs `then` (what the layer above
/// needs done before any other thread sees the process set up: its fork
/// handler). Returns the configuration, or the message of what was wrong.
#[cold]
pub fn set_up(then: impl FnOnce()) -> Option<&'static Result<ShimConfig, String>> {
    if STAGES.ready() || INITIALISING.with(|c| c.get()) {
        return CONFIG.get();
    }
    if STAGES.begin() {
        INITIALISING.with(|c| c.set(true));
        do_init();
        then();
        INITIALISING.with(|c| c.set(false));
        STAGES.finish();
    }
    wait_for_set_up()
}

/// The child of a fork keeps its configuration; its broker client starts
/// anew at its first context.
pub fn reset_after_fork() {
    STAGES.reset_after_fork();
}

/// True for the one caller that is to start the broker client.
pub fn arbitrate() -> bool {
    STAGES.arbitrate()
}

fn do_init() {
    crate::boundary::install_panic_hook();
    // Bytes, not strings: a value that is not UTF-8 must be reported as
    // malformed, never skipped (skipping a cap would run uncapped).
    use std::os::unix::ffi::OsStrExt;
    let vars: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os()
        .filter(|(k, _)| {
            let k = k.as_bytes();
            k.starts_with(b"GPU_") || k.starts_with(b"GPUFRAC_")
        })
        .collect();
    let cfg = from_raw_vars(vars.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))
        .map_err(|e| e.to_string())
        .and_then(open_books);
    match &cfg {
        Ok(c) => log::set_level(c.log),
        Err(msg) => log::write_line(format_args!(
            "{msg}; CUDA initialisation will fail with CUDA_ERROR_INVALID_VALUE until this is fixed"
        )),
    }
    let _ = CONFIG.set(cfg);
    if !driver::load_cuda() {
        warn!("libcuda.so.1 could not be loaded; CUDA calls will fail");
    }
}

/// A process of a job (`gpufrac run --gpu-memory`) charges the job's books:
/// books it cannot use fail its initialisation as a malformed variable does.
/// Running capped on its own instead would let the job as a whole pass its
/// cap, one process at a time.
fn open_books(cfg: ShimConfig) -> Result<ShimConfig, String> {
    let Some(path) = &cfg.job_ledger else {
        return Ok(cfg);
    };
    match ledger::open_job(path) {
        Ok(()) => Ok(cfg),
        Err(e) => Err(ConfigError {
            var: VAR_JOB_LEDGER.to_owned(),
            value: path.clone(),
            problem: format!("the job's memory books cannot be used: {e}"),
            example: "the books that `gpufrac run --gpu-memory` made for this job (start the job again)",
        }
        .to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    #[test]
    fn one_caller_sets_up_and_one_starts_the_client_once_per_process() {
        let s = Stages::new();
        assert!(!s.ready());
        assert!(!s.arbitrate(), "no client before the process is set up");
        assert!(s.begin() && !s.begin());
        assert!(s.setting_up() && !s.ready());
        s.finish();
        assert!(s.ready() && !s.setting_up());
        assert!(s.arbitrate() && !s.arbitrate());
        assert!(s.ready(), "arbitrated is still set up");
    }

    #[test]
    fn a_fork_child_keeps_its_set_up_and_starts_its_own_client() {
        let s = Stages::new();
        s.reset_after_fork();
        assert!(!s.ready(), "a child of an unset parent is unset");
        assert!(s.begin());
        s.finish();
        s.reset_after_fork();
        assert!(s.ready() && s.arbitrate(), "a set-up child, never arbitrated");
        s.reset_after_fork();
        assert!(s.ready() && !s.begin(), "set up once: the child keeps it");
        assert!(s.arbitrate(), "its own client, at its first context");
    }

    #[test]
    fn of_racing_first_callers_exactly_one_sets_up_and_one_arbitrates() {
        let s = Arc::new(Stages::new());
        let n = 8;
        let go = Arc::new(Barrier::new(n));
        let won: Vec<(bool, bool)> = (0..n)
            .map(|_| {
                let (s, go) = (s.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let began = s.begin();
                    if began {
                        s.finish();
                    }
                    while !s.ready() {
                        std::thread::yield_now();
                    }
                    (began, s.arbitrate())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(won.iter().filter(|w| w.0).count(), 1, "{won:?}");
        assert_eq!(won.iter().filter(|w| w.1).count(), 1, "{won:?}");
    }
}
