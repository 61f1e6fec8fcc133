//! Simulated CUDA driver and NVML, for tests only.
//!
//! The library is installed as `libcuda.so.1`, `libcuda.so` and
//! `libnvidia-ml.so.1` and exports the driver and NVML entry points the shim
//! hooks. Memory is host bookkeeping only; kernels are work on one execution
//! engine per device that every process sharing the state file
//! (`GPUFRAC_SIM_STATE`) contends for, time-sliced between contexts the way
//! a real GPU does it (`engine/`: the model in `model.rs`, the device lock
//! and its crash handling in `lock.rs`).
//!
//! Environment (read once, at the first `cuInit`/`nvmlInit`):
//! - `GPUFRAC_SIM_DEVICES`: device memory sizes, `16G,8G` (K/M/G/T binary,
//!   optional `i`/`B`; plain bytes). Default one 16G device; empty: none.
//!   An entry may instead name a MIG-capable model, `A100-40GB`,
//!   `A100-80GB` or `H100-80GB` (its memory, SMs and MIG profiles), with
//!   `:mig` when its MIG mode is on (`A100-40GB:mig`; see `mig/`). A GPU
//!   in MIG mode is no CUDA device of its own: its instances are, to a
//!   process whose `CUDA_VISIBLE_DEVICES` starts with their `MIG-<uuid>`.
//! - `GPUFRAC_SIM_STATE`: shared state file (created/sized as needed); unset:
//!   private state.
//! - `GPUFRAC_SIM_DRIVER_VERSION`: default 13000 (`cuDriverGetVersion`, cap
//!   of `cuGetProcAddress` selection; read on first use, also before cuInit).
//! - `GPUFRAC_SIM_QUANTUM_US`: time slice of a context while another waits,
//!   in µs; default 2000, at least 1.
//! - `GPUFRAC_SIM_SWITCH_US`: cost of a context switch (no progress), in µs;
//!   default 100, 0 allowed. The defaults are what an H100 (driver 580) was
//!   measured to do; every process on one state file should use the same.
//!
//! - `GPUFRAC_SIM_XID`: `DEVICE:XID` pairs (comma-separated); an NVML event
//!   set registered for XID events on a device delivers its XID once.
//! - `GPUFRAC_SIM_NVML_LATE`: processes that start between a caller's
//!   count of an NVML process list and its fill (the count leaves them
//!   out); default 0.
//!
//! A bad value makes `cuInit`/`nvmlInit` fail with a message on stderr.
//!
//! Test-only exports (`testing.rs`): `gpufracSimGraphCreate`,
//! `gpufracSimLastVariant`, `gpufracSimEngineStats`, `gpufracSimDeviceUsed`,
//! `gpufracSimExecutedNs` (kernel ns the calling process executed on a
//! device: exact shares), `gpufracSimSwitches`, `gpufracSimCrashInEngine`
//! (fault injection).
//! Kernel duration convention: `kernelParams[0]` points to a u64 of ns.
//!
//! `CUDA_VISIBLE_DEVICES` is read as the real driver reads it
//! (`config::select_visible`): indices (nvidia-smi's numbering) and `GPU-`
//! UUIDs or unique prefixes, renumbered from 0 in the list's order, the list
//! ending at the first entry that names no device; a first entry
//! `MIG-<uuid>` shows that MIG device alone. NVML ignores it, as NVML does.
//!
//! Rules kept throughout:
//! - an exported function never calls another exported function (the shim in
//!   front of us would intercept it); logic lives in private helpers;
//! - no panic crosses the FFI boundary (`guard` turns it into an error code);
//! - the kernel launch path allocates nothing and makes no system call
//!   besides `clock_gettime` (vDSO) in the common case; it holds the device
//!   engine's lock for a few hundred instructions, a lock a dead holder
//!   cannot wedge.
#![allow(
    // Exported C entry points: their contract is the CUDA/NVML documentation.
    clippy::missing_safety_doc,
    // cuLaunchKernel and friends have the driver's argument lists.
    clippy::too_many_arguments,
    non_snake_case
)]

use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};

use gpufrac_common::cuda::{CUDA_ERROR_UNKNOWN, CUresult, NVML_ERROR_UNKNOWN, nvmlReturn_t};

/// Defines exported CUDA entry points. Each records its own name as the
/// thread's last variant and runs its body (returning
/// `Result<(), CUresult>`) behind a panic guard.
macro_rules! cuda_exports {
    ($(
        $(#[$m:meta])*
        fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block
    )*) => {$(
        $(#[$m])*
        #[unsafe(no_mangle)]
        #[allow(unused_unsafe)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> gpufrac_common::cuda::CUresult {
            $crate::set_last(const { $crate::cstr(concat!(stringify!($name), "\0")) });
            $crate::guard(move || -> Result<(), gpufrac_common::cuda::CUresult> {
                unsafe { $body }
            })
        }
    )*};
}

/// Like `cuda_exports!` for NVML: no last-variant bookkeeping.
macro_rules! nvml_exports {
    ($(
        $(#[$m:meta])*
        fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block
    )*) => {$(
        $(#[$m])*
        #[unsafe(no_mangle)]
        #[allow(unused_unsafe)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> gpufrac_common::cuda::nvmlReturn_t {
            $crate::nvml_guard(move || -> Result<(), gpufrac_common::cuda::nvmlReturn_t> {
                unsafe { $body }
            })
        }
    )*};
}

mod config;
mod ctx;
mod device;
mod engine;
mod exec;
mod graphs;
mod health;
mod mem;
mod mig;
mod nvml;
mod objects;
mod procaddr;
mod state;
mod testing;
mod va;

thread_local! {
    static LAST_VARIANT: std::cell::Cell<&'static CStr> = const { std::cell::Cell::new(c"") };
}

#[inline(always)]
pub(crate) fn set_last(name: &'static CStr) {
    // A const thread-local without destructor: always accessible.
    LAST_VARIANT.set(name);
}

pub(crate) fn last_variant() -> &'static CStr {
    LAST_VARIANT.get()
}

pub(crate) const fn cstr(s: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("not NUL-terminated"),
    }
}

#[inline(always)]
pub(crate) fn guard<F: FnOnce() -> Result<(), CUresult>>(f: F) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

pub(crate) fn nvml_guard<F: FnOnce() -> Result<(), nvmlReturn_t>>(f: F) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => e,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// Writes through an out-pointer, failing with `err` when it is NULL.
#[inline(always)]
pub(crate) unsafe fn out<T>(p: *mut T, v: T, err: u32) -> Result<(), u32> {
    if p.is_null() {
        return Err(err);
    }
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// Copies `s` plus a NUL into a C buffer of `len` bytes; `false` if it does
/// not fit (nothing is written then).
pub(crate) unsafe fn write_cstr(buf: *mut std::ffi::c_char, len: usize, s: &[u8]) -> bool {
    if buf.is_null() || len < s.len() + 1 {
        return false;
    }
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    true
}
