//! Staged, lazy initialisation. Nothing happens in a library constructor:
//! a process that never calls CUDA (`sh`, `ls`, `python3 -c 1`) gets no
//! thread, no socket, no dlopen and no output from us. The first hook to fire
//! — whichever it is, on whichever thread — parses the configuration, opens
//! the job's books and loads the driver; concurrent first callers wait for
//! it, and a hook that fires re-entrantly during init (on the initialising
//! thread) is told so instead of deadlocking.
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

const UNINIT: u8 = 0;
const BUSY: u8 = 1;
const READY: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static CONFIG: OnceLock<Result<ShimConfig, String>> = OnceLock::new();

thread_local! {
    static INITIALISING: Cell<bool> = const { Cell::new(false) };
}

/// Parses the environment, opens the job's books and loads libcuda.so.1
/// once. Returns the configuration, or the message of what was wrong.
pub fn ensure() -> Option<&'static Result<ShimConfig, String>> {
    if STATE.load(Ordering::Acquire) == READY {
        return CONFIG.get();
    }
    slow_init()
}

/// Whether initialisation has finished (the driver's slots are filled).
#[inline]
pub fn ready() -> bool {
    STATE.load(Ordering::Acquire) == READY
}

#[cold]
fn slow_init() -> Option<&'static Result<ShimConfig, String>> {
    if INITIALISING.with(|c| c.get()) {
        // Re-entered from inside our own init (the driver's constructor
        // calling back into us): the configuration may not exist yet.
        return CONFIG.get();
    }
    match STATE.compare_exchange(UNINIT, BUSY, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            INITIALISING.with(|c| c.set(true));
            do_init();
            INITIALISING.with(|c| c.set(false));
            STATE.store(READY, Ordering::Release);
        }
        Err(_) => {
            while STATE.load(Ordering::Acquire) != READY {
                std::thread::yield_now();
            }
        }
    }
    CONFIG.get()
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
    // SAFETY: registering a plain extern "C" callback.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
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

/// The configuration, if it parsed. `Err(code)` is what a CUDA entry point
/// must answer when it did not.
#[inline]
pub fn config() -> Result<&'static ShimConfig, u32> {
    match ensure() {
        Some(Ok(c)) => Ok(c),
        Some(Err(_)) => Err(CUDA_ERROR_INVALID_VALUE),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// CUDA cannot be used in a child forked after initialisation, so the child
/// starts with clean books: zero usage, fresh maps (the old ones may be
/// locked by threads that do not exist in the child). The VMM tables and
/// the broker session reset their own state the same way.
extern "C" fn after_fork_child() {
    ledger::reset_after_fork();
}
