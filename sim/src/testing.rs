//! Test-only exports (prefix `gpufracSim`, never hooked by the shim). They
//! do not touch the last-variant record.

use std::ffi::{c_char, c_int};
use std::sync::atomic::Ordering::*;

use gpufrac_common::cuda::*;

use crate::exec::out_graph;
use crate::state::{Sim, sim};

fn any_sim(device: c_int) -> Result<(&'static Sim, usize), CUresult> {
    let s = sim().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    Ok((s, s.dev(device)?))
}

/// Creates a graph exec whose launch runs one kernel of `duration_ns`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimGraphCreate(
    out: *mut CUgraphExec,
    duration_ns: u64,
) -> CUresult {
    crate::guard(|| out_graph(out, duration_ns))
}

/// Exported name of the last CUDA entry point executed on this thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimLastVariant() -> *const c_char {
    crate::last_variant().as_ptr()
}

/// Shared engine statistics of `device`: total reserved kernel time and count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimEngineStats(
    device: c_int,
    busy_ns: *mut u64,
    kernels: *mut u64,
) -> CUresult {
    crate::guard(|| {
        let (s, d) = any_sim(device)?;
        let dev = s.shared_dev(d);
        unsafe {
            crate::out(
                busy_ns,
                dev.busy_ns_total.load(Acquire),
                CUDA_ERROR_INVALID_VALUE,
            )?;
            crate::out(
                kernels,
                dev.kernels_total.load(Acquire),
                CUDA_ERROR_INVALID_VALUE,
            )
        }
    })
}

/// Physical bytes in use on `device` by all processes sharing the state.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimDeviceUsed(device: c_int, used: *mut u64) -> CUresult {
    crate::guard(|| {
        let (s, d) = any_sim(device)?;
        unsafe { crate::out(used, s.used(d), CUDA_ERROR_INVALID_VALUE) }
    })
}
