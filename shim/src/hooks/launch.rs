//! Kernel launch hooks: every way to put work on the GPU passes the compute
//! compute gate first (see client/gate.rs). When this process holds its
//! timeslice, or no arbitration is active, the gate is one atomic load.
//! The launches are settled entry points (hooklist.rs): each hands its
//! driver call's answer back through `Answer::then`, with the gate's
//! bookkeeping as the step after it.

// The launch signatures are the driver's; their argument counts are not ours
// to choose.
#![allow(clippy::too_many_arguments)]

use super::graphmem;
use crate::boundary::Answer;
use crate::client;
use crate::driver::{call, twin};
use gpufrac_common::cuda::*;
use std::ffi::{c_uint, c_void};

/// Every launch: the compute gate, the driver call, the gate's bookkeeping.
#[inline(always)]
fn gated_launch(stream: CUstream, ptsz: bool, real: impl FnOnce() -> Answer) -> u32 {
    match client::may_launch(stream) {
        Ok(pass) => real().then(|rc| client::launched(pass, rc, stream, ptsz)),
        Err(code) => code,
    }
}

/// The same for a graph launch, which fails closed (it may grow a graph's
/// memory pool): a panic refuses it whether or not the driver was called.
fn gated_graph_launch(stream: CUstream, ptsz: bool, real: impl FnOnce() -> u32) -> u32 {
    match client::may_launch(stream) {
        Ok(pass) => {
            let rc = real();
            client::launched(pass, rc, stream, ptsz);
            rc
        }
        Err(code) => code,
    }
}

// Each hook below serves an entry point and its `_ptsz` twin (`PTSZ`, see
// `driver::twin`).

pub unsafe fn launch_kernel<const PTSZ: bool>(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    gated_launch(stream, PTSZ, || unsafe {
        twin!(
            PTSZ,
            cuLaunchKernel
                | cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
        )
    })
}

pub unsafe fn launch_kernel_ex<const PTSZ: bool>(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    let stream = if config.is_null() {
        std::ptr::null_mut()
    } else {
        unsafe { std::ptr::addr_of!((*config).hStream).read_unaligned() }
    };
    gated_launch(stream, PTSZ, || unsafe {
        twin!(
            PTSZ,
            cuLaunchKernelEx | cuLaunchKernelEx_ptsz(config, f, params, extra)
        )
    })
}

pub unsafe fn launch_coop<const PTSZ: bool>(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
) -> u32 {
    gated_launch(stream, PTSZ, || unsafe {
        twin!(
            PTSZ,
            cuLaunchCooperativeKernel
                | cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, stream, params)
        )
    })
}

/// One launch over several devices: each entry passes the gate of its own
/// stream's device (its context made current for the pass), and every pass
/// is given back when the launch returns. A thread holding passes never
/// waits at a gate (a release of a device it holds a pass for would wait
/// for it in turn): it gives them back, waits for that device alone, and
/// starts over.
pub unsafe fn launch_coop_multi(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) -> u32 {
    let streams: Vec<CUstream> = if list.is_null() {
        Vec::new()
    } else {
        (0..n as usize)
            .map(|i| unsafe { std::ptr::addr_of!((*list.add(i)).hStream).read_unaligned() })
            .collect()
    };
    let give_back = |passes: Vec<client::Pass>, rc: u32| {
        for (p, s) in passes.into_iter().zip(&streams) {
            client::launched(p, rc, *s, false);
        }
    };
    'again: loop {
        let mut passes = Vec::with_capacity(streams.len());
        for &stream in &streams {
            let first = passes.is_empty();
            let gated = on_streams_context(stream, || {
                if first {
                    Some(client::may_launch(stream))
                } else {
                    client::may_launch_now(stream)
                }
            });
            match gated {
                Some(Ok(pass)) => passes.push(pass),
                Some(Err(code)) => {
                    give_back(passes, code);
                    return code;
                }
                None => {
                    give_back(passes, CUDA_ERROR_NOT_READY);
                    match on_streams_context(stream, || client::may_launch(stream)) {
                        Ok(pass) => client::launched(pass, CUDA_ERROR_NOT_READY, stream, false),
                        Err(code) => return code,
                    }
                    continue 'again;
                }
            }
        }
        return unsafe { call::cuLaunchCooperativeKernelMultiDevice(list, n, flags) }
            .then(|rc| give_back(passes, rc));
    }
}

/// Runs `f` with `stream`'s context current (the gate looks at the current
/// device); as it is when the stream's context cannot be had.
fn on_streams_context<T>(stream: CUstream, f: impl FnOnce() -> T) -> T {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    let pushed = !stream.is_null()
        && unsafe { call::cuStreamGetCtx(stream, &mut ctx) } == CUDA_SUCCESS
        && !ctx.is_null()
        && unsafe { call::cuCtxPushCurrent_v2(ctx) } == CUDA_SUCCESS;
    let r = f();
    if pushed {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; pops what was pushed above.
        unsafe { call::cuCtxPopCurrent_v2(&mut popped) };
    }
    r
}

pub unsafe fn graph_launch<const PTSZ: bool>(exec: CUgraphExec, stream: CUstream) -> u32 {
    graphmem::launch(exec, || {
        gated_graph_launch(stream, PTSZ, || unsafe {
            twin!(PTSZ, cuGraphLaunch | cuGraphLaunch_ptsz(exec, stream))
        })
    })
}

// Synchronisation: pass-through, but marked, so that a process waiting for
// its own kernels is not mistaken for an idle holder.

pub unsafe fn ctx_sync() -> u32 {
    client::syncing(|| unsafe { call::cuCtxSynchronize() })
}

pub unsafe fn ctx_sync_v2(ctx: CUcontext) -> u32 {
    client::syncing(|| unsafe { call::cuCtxSynchronize_v2(ctx) })
}

pub unsafe fn stream_sync<const PTSZ: bool>(stream: CUstream) -> u32 {
    client::syncing(|| unsafe {
        twin!(PTSZ, cuStreamSynchronize | cuStreamSynchronize_ptsz(stream))
    })
}

pub unsafe fn event_sync(event: CUevent) -> u32 {
    client::syncing(|| unsafe { call::cuEventSynchronize(event) })
}
