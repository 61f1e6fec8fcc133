//! Contexts: created, primary (refcounted, one per device), the thread's
//! context stack.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::*;

use gpufrac_common::cuda::*;

use crate::engine;
use crate::mem::free_ctx_allocs;
use crate::objects::Work;
use crate::objects::{self, Ctx, Handle, leak, resolve_stream};
use crate::out;
use crate::state::{Sim, cuda};

fn create(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> Result<(), CUresult> {
    let s = cuda()?;
    let d = s.dev(dev)?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let c = leak(Ctx::new(d, false));
    c.flags.store(flags, Relaxed);
    objects::push(c)?;
    // SAFETY: checked non-NULL.
    unsafe { *pctx = c.handle() };
    Ok(())
}

/// A context argument that must be live.
unsafe fn ctx_arg(c: CUcontext) -> Result<&'static Ctx, CUresult> {
    unsafe { Ctx::from_handle(c) }.ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// A context argument where NULL means the current one.
unsafe fn ctx_or_current(c: CUcontext) -> Result<&'static Ctx, CUresult> {
    if c.is_null() {
        objects::current()
    } else {
        unsafe { ctx_arg(c) }
    }
}

fn primary(s: &Sim, dev: CUdevice) -> Result<&'static Ctx, CUresult> {
    Ok(s.primary[s.dev(dev)?])
}

cuda_exports! {
    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create(pctx, flags, dev)
    }

    fn cuCtxCreate_v3(
        pctx: *mut CUcontext,
        _affinity: *mut c_void,
        num_params: c_int,
        flags: c_uint,
        dev: CUdevice,
    ) {
        if num_params < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        create(pctx, flags, dev)
    }

    fn cuCtxCreate_v4(pctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) {
        create(pctx, flags, dev)
    }

    fn cuCtxDestroy_v2(ctx: CUcontext) {
        let s = cuda()?;
        let c = ctx_arg(ctx)?;
        if c.primary {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        free_ctx_allocs(s, c.id());
        engine::drop_ctx(s, c);
        c.kill();
        objects::pop_if_current(c)
    }

    fn cuCtxSetCurrent(ctx: CUcontext) {
        cuda()?;
        if ctx.is_null() {
            return objects::set_current(std::ptr::null());
        }
        objects::set_current(ctx_arg(ctx)?)
    }

    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        cuda()?;
        out(pctx, objects::current_raw() as CUcontext, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        cuda()?;
        if ctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        objects::push(ctx_arg(ctx)?)
    }

    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        cuda()?;
        let c = objects::pop()?.ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            *pctx = c as CUcontext;
        }
        Ok(())
    }

    fn cuCtxGetDevice(device: *mut CUdevice) {
        cuda()?;
        let c = objects::current()?;
        out(device, c.device as CUdevice, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuCtxGetDevice_v2(device: *mut CUdevice, ctx: CUcontext) {
        cuda()?;
        let c = ctx_or_current(ctx)?;
        out(device, c.device as CUdevice, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuCtxSynchronize() {
        let s = cuda()?;
        engine::wait(s, Work::ctx(objects::current()?));
        Ok(())
    }

    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        let s = cuda()?;
        engine::wait(s, Work::ctx(ctx_or_current(ctx)?));
        Ok(())
    }

    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let c = primary(cuda()?, dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        c.refs.fetch_add(1, AcqRel);
        *pctx = c.handle();
        Ok(())
    }

    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        let s = cuda()?;
        let c = primary(s, dev)?;
        let prev = c
            .refs
            .fetch_update(AcqRel, Acquire, |r| r.checked_sub(1))
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        if prev == 1 {
            // The driver tears the context down.
            free_ctx_allocs(s, c.id());
            engine::drop_ctx(s, c);
        }
        Ok(())
    }

    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) {
        let s = cuda()?;
        let c = primary(s, dev)?;
        c.refs.store(0, Release);
        c.flags.store(0, Release);
        free_ctx_allocs(s, c.id());
        engine::drop_ctx(s, c);
        Ok(())
    }

    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        let c = primary(cuda()?, dev)?;
        if flags.is_null() || active.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *flags = c.flags.load(Acquire);
        *active = (c.refs.load(Acquire) > 0) as c_int;
        Ok(())
    }

    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) {
        let c = primary(cuda()?, dev)?;
        c.flags.store(flags, Release);
        Ok(())
    }

    fn cuStreamGetCtx(stream: CUstream, pctx: *mut CUcontext) {
        cuda()?;
        let t = resolve_stream(stream, false)?;
        out(pctx, t.ctx.handle(), CUDA_ERROR_INVALID_VALUE)
    }
}
