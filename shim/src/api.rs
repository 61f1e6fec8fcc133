//! The small C query API of `include/gpufrac.h`, for applications that want
//! to know their cap and usage: every `gpufrac_*` export lives here.
//! Reached with `dlsym(RTLD_DEFAULT, …)` or by linking; returns 0 when
//! there is nothing to report. Like the other exports, compiled into the
//! library only.

use crate::hooks::process;
use crate::{devices, ledger};
use std::ffi::{c_char, c_int};
use std::panic::catch_unwind;

/// Cap in bytes for CUDA device `device` (as this process numbers it), or 0
/// when uncapped. Percentage caps are known once CUDA is initialised.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_limit(device: c_int) -> u64 {
    catch_unwind(|| {
        let Ok(cfg) = process::config() else { return 0 };
        if device < 0 {
            return 0;
        }
        let i = device as usize;
        if devices::ensure().is_ok() {
            let l = ledger::limit(i);
            return if l == ledger::NO_LIMIT { 0 } else { l };
        }
        match cfg.limit_for(i) {
            gpufrac_common::size::MemLimit::Bytes(b) => b,
            _ => 0,
        }
    })
    .unwrap_or(0)
}

/// Sets this process's own cap on `device` to `bytes` (0: back to the cap
/// it started with), never above the cap it started with (`GPU_MEM_LIMIT`;
/// none: any), and returns the cap now in force (0: none, or no such
/// device). A test runner narrows a worker to one test's reservation and
/// widens it after. An allocation already held past the new cap stays;
/// the next one is refused.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_limit_set(device: c_int, bytes: u64) -> u64 {
    catch_unwind(|| {
        let Ok(cfg) = process::config() else { return 0 };
        if device < 0 {
            return 0;
        }
        let i = device as usize;
        let mut cap = ledger::set_limit(i, bytes);
        // Before CUDA is initialised the environment's cap is not in the
        // books yet; a byte cap is known all the same.
        if let gpufrac_common::size::MemLimit::Bytes(b) = cfg.limit_for(i)
            && b > 0
        {
            cap = cap.min(b);
        }
        if cap == ledger::NO_LIMIT { 0 } else { cap }
    })
    .unwrap_or(0)
}

/// Bytes currently charged to this process on `device`.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_used(device: c_int) -> u64 {
    if device < 0 {
        0
    } else {
        ledger::used(device as usize)
    }
}

/// Highest usage seen on `device`.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_peak(device: c_int) -> u64 {
    if device < 0 {
        return 0;
    }
    ledger::peak(device as usize)
}

/// Starts a new peak on `device` from what is charged now, and returns the
/// peak before it: per-test peaks for a test runner.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_peak_reset(device: c_int) -> u64 {
    if device < 0 {
        return 0;
    }
    ledger::reset_peak(device as usize)
}

/// The most this process asked to hold on `device` since its peak was last
/// reset: its peak, or what it held when an allocation was refused plus
/// that allocation, whichever is more. A test runner learns a test's
/// budget from it: a test refused at its first allocation peaks at 0.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_wanted(device: c_int) -> u64 {
    if device < 0 {
        return 0;
    }
    ledger::wanted(device as usize)
}

/// Allocations the shim refused on `device` (its cap, the job's cap, or
/// books it could not trust) since the process started: read before and
/// after a piece of work, it says whether that work ran out of memory by
/// its cap, whatever the application made of the error.
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_mem_refusals(device: c_int) -> u64 {
    if device < 0 {
        return 0;
    }
    ledger::refusals(device as usize)
}

/// Number of live allocations tracked (all devices).
#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_live_allocations() -> u64 {
    catch_unwind(ledger::live_count).unwrap_or(0) as u64
}

#[unsafe(no_mangle)]
pub extern "C" fn gpufrac_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
