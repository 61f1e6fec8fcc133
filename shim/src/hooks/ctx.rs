//! Context hooks. Creating a context is when a process becomes a GPU user:
//! the broker session starts then, never earlier. Destroying one frees
//! everything it owned, so its charges are returned.

use crate::driver::call;
use super::process;
use crate::{client, contexts, ledger};
use gpufrac_common::cuda::*;
use std::ffi::{c_int, c_uint, c_void};

fn created(rc: u32, pctx: *mut CUcontext, dev: CUdevice) -> u32 {
    if rc == CUDA_SUCCESS && !pctx.is_null() && dev >= 0 {
        let ctx = unsafe { pctx.read_unaligned() } as usize;
        contexts::remember(dev as usize, ctx);
        client::on_context_created();
    }
    rc
}

pub unsafe fn create_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> u32 {
    if let Err(code) = process::config() {
        return code;
    }
    created(unsafe { call::cuCtxCreate_v2(pctx, flags, dev) }, pctx, dev)
}

pub unsafe fn create_v3(
    pctx: *mut CUcontext,
    params: *mut c_void,
    n: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    if let Err(code) = process::config() {
        return code;
    }
    created(
        unsafe { call::cuCtxCreate_v3(pctx, params, n, flags, dev) },
        pctx,
        dev,
    )
}

pub unsafe fn create_v4(
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    if let Err(code) = process::config() {
        return code;
    }
    created(
        unsafe { call::cuCtxCreate_v4(pctx, params, flags, dev) },
        pctx,
        dev,
    )
}

pub unsafe fn primary_retain(pctx: *mut CUcontext, dev: CUdevice) -> u32 {
    if let Err(code) = process::config() {
        return code;
    }
    let rc = unsafe { call::cuDevicePrimaryCtxRetain(pctx, dev) };
    if rc == CUDA_SUCCESS && !pctx.is_null() && dev >= 0 {
        contexts::set_primary(dev as usize, unsafe { pctx.read_unaligned() } as usize);
    }
    created(rc, pctx, dev)
}

pub unsafe fn destroy(ctx: CUcontext) -> u32 {
    let rc = unsafe { call::cuCtxDestroy_v2(ctx) };
    if rc == CUDA_SUCCESS {
        ledger::release_context(ctx as usize);
        contexts::forget(ctx as usize);
    }
    rc
}

pub unsafe fn primary_release(dev: CUdevice) -> u32 {
    let rc = unsafe { call::cuDevicePrimaryCtxRelease_v2(dev) };
    if rc == CUDA_SUCCESS && dev >= 0 {
        let (mut flags, mut active) = (0u32, 1i32);
        let st = unsafe { call::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
        if st == CUDA_SUCCESS
            && active == 0
            && let Some(ctx) = contexts::primary_of(dev as usize)
        {
            ledger::release_context(ctx);
            contexts::forget(ctx);
        }
    }
    rc
}

pub unsafe fn primary_reset(dev: CUdevice) -> u32 {
    let rc = unsafe { call::cuDevicePrimaryCtxReset_v2(dev) };
    if rc == CUDA_SUCCESS
        && dev >= 0
        && let Some(ctx) = contexts::primary_of(dev as usize)
    {
        ledger::release_context(ctx);
    }
    rc
}
