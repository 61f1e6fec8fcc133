//! The process's life under the shim, in one room: its set-up, which the
//! first entry point to fire drives (the stages are `config::Stages`: set
//! up, then arbitrated at the first context), and the one fork handler,
//! which puts each layer back as a fork child must find it.
//!
//! The handler lives here, at the top of the layers that keep state, so
//! that it calls each layer's reset downward (`hooks::vmm`'s tables, the
//! broker client's gate, the books, the stages) and none of them reaches
//! up; it is registered once, while the process is set up, before any of
//! that state exists.

use super::vmm;
use crate::{client, config, ledger};
use gpufrac_common::config::ShimConfig;

/// Sets the process up if nobody has yet, and returns its configuration,
/// or the message of what was wrong (None: re-entered from inside the
/// set-up itself).
#[inline]
pub fn ensure() -> Option<&'static Result<ShimConfig, String>> {
    match config::current() {
        Some(c) => Some(c),
        None => set_up(),
    }
}

/// `ensure`, as a CUDA entry point answers it: `Err(code)` when the
/// configuration did not parse (or is being made on this very thread).
#[inline]
pub fn config() -> Result<&'static ShimConfig, u32> {
    config::settled(ensure())
}

#[cold]
fn set_up() -> Option<&'static Result<ShimConfig, String>> {
    config::set_up(|| {
        // SAFETY: registering a plain extern "C" callback, once per
        // process (a fork child inherits it).
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    })
}

/// CUDA cannot be used in a child forked after initialisation, so the
/// child starts from nothing but its configuration: fresh books and VMM
/// tables (the old ones may be locked by threads that do not exist in the
/// child, so they are leaked), no broker connection and no client thread
/// (its own starts at its first context). Top layer first; each reset
/// touches only its own layer's state.
extern "C" fn after_fork_child() {
    vmm::reset_after_fork();
    client::reset_after_fork();
    ledger::reset_after_fork();
    config::reset_after_fork();
}
