//! The memory charge: whether a memory hook accounts at all (`accounting`:
//! not when re-entered from the driver, nor before the driver is up), and
//! the reserve-call-record sequence every allocation follows, so that no
//! thread passes the cap and the books never drift. (The compute gate,
//! which launches pass, is `client/gate.rs`.)

use crate::boundary::{HookGuard, reentered};
use crate::devices;
use crate::ledger::{self, Entry, Kind, Refusal};
use gpufrac_common::config::ShimConfig;
use gpufrac_common::cuda::*;

/// What a memory hook does with this call.
pub enum Accounting {
    /// Re-entered from the driver, or no driver yet: pass through.
    Pass,
    /// Configuration broken or caps unknown: answer this code.
    Refuse(u32),
    Account,
}

/// `config` is the configuration as the hooks reach it (setting the
/// process up if nothing has yet: `hooks::accounting`).
#[inline(always)]
pub fn accounting(config: impl FnOnce() -> Result<&'static ShimConfig, u32>) -> Accounting {
    if reentered() {
        return Accounting::Pass;
    }
    if let Err(code) = config() {
        return Accounting::Refuse(code);
    }
    match devices::ensure() {
        Ok(()) => Accounting::Account,
        // The driver is not initialised: let it say so itself.
        Err(CUDA_ERROR_NOT_INITIALIZED) => Accounting::Pass,
        Err(code) => Accounting::Refuse(code),
    }
}

/// The answer to a refused charge of `size` on `dev`: counted, and said
/// by the ledger.
#[cold]
pub fn refuse(dev: usize, size: u64, why: Refusal) -> u32 {
    ledger::refused(dev, size, why);
    CUDA_ERROR_OUT_OF_MEMORY
}

/// Reserves `size` on `dev` and calls the driver; on a refusal or a driver
/// error the reservation is gone again and the code to answer comes back
/// as `Err`.
#[inline]
pub fn reserve_then(dev: usize, size: u64, real: impl FnOnce() -> u32) -> Result<(), u32> {
    if let Err(why) = ledger::reserve(dev, size) {
        return Err(refuse(dev, size, why));
    }
    let rc = real();
    if rc != CUDA_SUCCESS {
        ledger::unreserve(dev, size);
        return Err(rc);
    }
    Ok(())
}

/// Reserve, call, record — or give the reservation back.
#[inline]
pub fn charge(
    kind: Kind,
    dev: usize,
    ctx: usize,
    size: u64,
    real: impl FnOnce() -> u32,
    key: impl FnOnce() -> u64,
) -> u32 {
    if size == 0 {
        return real();
    }
    if let Err(rc) = reserve_then(dev, size, real) {
        return rc;
    }
    crate::boundary::fault("charge");
    ledger::insert(
        kind,
        key(),
        Entry {
            size,
            dev: dev as u32,
            ctx,
        },
    );
    CUDA_SUCCESS
}

/// Forget, call, give back — or restore the record if the driver refused.
/// The record is removed *before* the driver frees, so no other thread can
/// be handed the same address and have its record clobbered.
#[inline]
pub fn uncharge(kind: Kind, key: u64, real: impl FnOnce() -> u32) -> u32 {
    if reentered() {
        return real();
    }
    let _g = HookGuard::enter();
    let entry = ledger::remove(kind, key);
    let rc = real();
    match entry {
        Some(e) if rc == CUDA_SUCCESS => ledger::unreserve(e.dev as usize, e.size),
        Some(e) => ledger::insert(kind, key, e),
        None => {}
    }
    rc
}
