//! Test-only exports (prefix `gpufracSim`, never hooked by the shim). They
//! do not touch the last-variant record.

use std::ffi::{c_char, c_int};

use gpufrac_common::cuda::*;

use crate::engine;
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

/// Shared engine statistics of `device`: kernel ns executed so far (all
/// processes, switches excluded) and kernels submitted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimEngineStats(
    device: c_int,
    busy_ns: *mut u64,
    kernels: *mut u64,
) -> CUresult {
    crate::guard(|| {
        let (s, d) = any_sim(device)?;
        let st = engine::stats(s, d);
        unsafe {
            crate::out(busy_ns, st.busy_ns, CUDA_ERROR_INVALID_VALUE)?;
            crate::out(kernels, st.kernels, CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// Kernel ns executed so far on `device` by the calling process's contexts
/// (destroyed ones included); 0 for a bad device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimExecutedNs(device: c_int) -> u64 {
    let r = std::panic::catch_unwind(|| {
        any_sim(device).map_or(0, |(s, d)| engine::executed_by_me(s, d) + s.retired(d))
    });
    r.unwrap_or(0)
}

/// Context switches on `device` so far (all processes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimSwitches(device: c_int) -> u64 {
    let r = std::panic::catch_unwind(|| {
        any_sim(device).map_or(0, |(s, d)| engine::stats(s, d).switches)
    });
    r.unwrap_or(0)
}

/// Fault injection: the calling process kills itself with SIGKILL at the
/// next `at` in the engine: 1, right after taking a device lock; 2, after
/// writing the next scheduling event but before committing it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimCrashInEngine(at: c_int) -> CUresult {
    match at as u32 {
        a @ (engine::CRASH_HOLDING_LOCK | engine::CRASH_BEFORE_COMMIT) => {
            engine::arm_crash(a);
            0
        }
        _ => CUDA_ERROR_INVALID_VALUE,
    }
}

/// Physical bytes in use on `device` by all processes sharing the state.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpufracSimDeviceUsed(device: c_int, used: *mut u64) -> CUresult {
    crate::guard(|| {
        let (s, d) = any_sim(device)?;
        unsafe { crate::out(used, s.used(d), CUDA_ERROR_INVALID_VALUE) }
    })
}
