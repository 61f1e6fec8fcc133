//! Modules, streams, events and kernel launches.

use std::ffi::{c_char, c_float, c_int, c_uint, c_void};

use gpufrac_common::cuda::*;

use crate::engine::{self, duration_from_params, launch, now_ns};
use crate::objects::Work;
use crate::objects::{self, Event, Func, GraphExec, Handle, Module, Stream, leak, resolve_stream};
use crate::out;
use crate::state::{Sim, cuda};

/// The common launch path: validate, resolve the stream, reserve the engine.
#[inline(always)]
unsafe fn launch_kernel(
    f: CUfunction,
    dims: [c_uint; 6],
    stream: CUstream,
    ptsz: bool,
    duration: u64,
) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    if f.is_null() {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if dims.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    launch(s, t, duration)
}

unsafe fn launch_ex(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    ptsz: bool,
) -> Result<(), CUresult> {
    cuda()?;
    if config.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let c = unsafe { &*config };
    let dims = [
        c.gridDimX,
        c.gridDimY,
        c.gridDimZ,
        c.blockDimX,
        c.blockDimY,
        c.blockDimZ,
    ];
    unsafe { launch_kernel(f, dims, c.hStream, ptsz, duration_from_params(params)) }
}

unsafe fn graph_launch(exec: CUgraphExec, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    let g = unsafe { GraphExec::from_handle(exec) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    crate::graphs::launch(s, exec)?;
    launch(s, t, g.duration_ns)
}

unsafe fn stream_sync(stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    engine::wait(s, Work::of(t));
    Ok(())
}

unsafe fn stream_query(stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    if engine::is_done(s, Work::of(t)) {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
}

unsafe fn event_record(ev: CUevent, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let e = unsafe { Event::from_handle(ev) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    let work = Work::of(t);
    let at = now_ns();
    // Work already done: the event completes as the engine reaches it, now.
    let done = engine::done_at(s, work).map_or(0, |_| at);
    let generation = e.record(work, at, done);
    if done == 0 {
        engine::watch(e, generation);
    }
    Ok(())
}

/// When the event completed: Ok(None) while it has not, Err if it was
/// never recorded. Its time is the instant the engine reached it (or the
/// record, if later), whoever asks and however late.
fn event_time(s: &Sim, e: &Event) -> Result<Option<u64>, ()> {
    let mut r = e.rec.lock().unwrap_or_else(|p| p.into_inner());
    let Some(work) = r.work else {
        return Err(());
    };
    if r.done == 0
        && let Some(t) = engine::done_at(s, work)
    {
        r.done = t.max(r.at).max(1);
    }
    Ok((r.done != 0).then_some(r.done))
}

unsafe fn elapsed(ms: *mut c_float, start: CUevent, end: CUevent) -> Result<(), CUresult> {
    let s = cuda()?;
    let a = unsafe { Event::from_handle(start) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let b = unsafe { Event::from_handle(end) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if ms.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (ta, tb) = (event_time(s, a), event_time(s, b));
    let (Ok(ta), Ok(tb)) = (ta, tb) else {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    };
    let (Some(ta), Some(tb)) = (ta, tb) else {
        return Err(CUDA_ERROR_NOT_READY);
    };
    unsafe { *ms = ((tb as i128 - ta as i128) as f64 / 1e6) as c_float };
    Ok(())
}

/// Later work on the stream starts no earlier than the event's completion.
unsafe fn stream_wait_event(stream: CUstream, ev: CUevent, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    let e = unsafe { Event::from_handle(ev) }.ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let Some(work) = e.get().work else {
        return Ok(());
    };
    if work.ctx == t.ctx.id() {
        work.order_before(t);
    } else {
        // The engine has no cross-context dependencies: order by waiting
        // here (correct, only less asynchronous).
        engine::wait(s, work);
    }
    Ok(())
}

fn stream_create(ph: *mut CUstream, flags: c_uint, priority: c_int) -> Result<(), CUresult> {
    cuda()?;
    let c = objects::current()?;
    if ph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let s = leak(Stream::new(c, flags, priority));
    // SAFETY: checked non-NULL.
    unsafe { *ph = s.handle() };
    Ok(())
}

cuda_exports! {
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) {
        cuda()?;
        objects::current()?;
        if module.is_null() || image.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *module = leak(Module::new()).handle();
        Ok(())
    }

    fn cuModuleUnload(module: CUmodule) {
        cuda()?;
        Module::from_handle(module).ok_or(CUDA_ERROR_INVALID_HANDLE)?.kill();
        Ok(())
    }

    fn cuModuleGetFunction(f: *mut CUfunction, module: CUmodule, name: *const c_char) {
        cuda()?;
        let m = Module::from_handle(module).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if f.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *f = leak(Func::new(m as *const Module as usize)).handle();
        Ok(())
    }

    fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) {
        stream_create(ph, flags, 0)
    }

    fn cuStreamCreateWithPriority(ph: *mut CUstream, flags: c_uint, priority: c_int) {
        stream_create(ph, flags, priority)
    }

    fn cuStreamDestroy_v2(stream: CUstream) {
        cuda()?;
        Stream::from_handle(stream).ok_or(CUDA_ERROR_INVALID_HANDLE)?.kill();
        Ok(())
    }

    fn cuStreamSynchronize(stream: CUstream) {
        stream_sync(stream, false)
    }

    fn cuStreamSynchronize_ptsz(stream: CUstream) {
        stream_sync(stream, true)
    }

    fn cuStreamQuery(stream: CUstream) {
        stream_query(stream, false)
    }

    fn cuStreamQuery_ptsz(stream: CUstream) {
        stream_query(stream, true)
    }

    fn cuEventCreate(ph: *mut CUevent, flags: c_uint) {
        cuda()?;
        let c = objects::current()?;
        if ph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        *ph = leak(Event::new(c, flags)).handle();
        Ok(())
    }

    fn cuEventRecord(ev: CUevent, stream: CUstream) {
        event_record(ev, stream, false)
    }

    fn cuEventRecord_ptsz(ev: CUevent, stream: CUstream) {
        event_record(ev, stream, true)
    }

    fn cuEventSynchronize(ev: CUevent) {
        let s = cuda()?;
        let e = Event::from_handle(ev).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        // Never recorded: nothing to wait for.
        if let Some(work) = e.get().work {
            engine::wait(s, work);
            let _ = event_time(s, e);
        }
        Ok(())
    }

    fn cuEventQuery(ev: CUevent) {
        let s = cuda()?;
        let e = Event::from_handle(ev).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        match event_time(s, e) {
            Ok(None) => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }

    fn cuEventElapsedTime(ms: *mut c_float, start: CUevent, end: CUevent) {
        elapsed(ms, start, end)
    }

    fn cuEventElapsedTime_v2(ms: *mut c_float, start: CUevent, end: CUevent) {
        elapsed(ms, start, end)
    }

    fn cuStreamWaitEvent(stream: CUstream, ev: CUevent, _flags: c_uint) {
        stream_wait_event(stream, ev, false)
    }

    fn cuStreamWaitEvent_ptsz(stream: CUstream, ev: CUevent, _flags: c_uint) {
        stream_wait_event(stream, ev, true)
    }

    fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) {
        cuda()?;
        objects::current()?;
        if !least.is_null() {
            *least = 0;
        }
        if !greatest.is_null() {
            *greatest = -5;
        }
        Ok(())
    }

    fn cuEventDestroy_v2(ev: CUevent) {
        cuda()?;
        Event::from_handle(ev).ok_or(CUDA_ERROR_INVALID_HANDLE)?.kill();
        Ok(())
    }

    fn cuLaunchKernel(
        f: CUfunction,
        gx: c_uint, gy: c_uint, gz: c_uint,
        bx: c_uint, by: c_uint, bz: c_uint,
        _shared: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        _extra: *mut *mut c_void,
    ) {
        launch_kernel(f, [gx, gy, gz, bx, by, bz], stream, false, duration_from_params(params))
    }

    fn cuLaunchKernel_ptsz(
        f: CUfunction,
        gx: c_uint, gy: c_uint, gz: c_uint,
        bx: c_uint, by: c_uint, bz: c_uint,
        _shared: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        _extra: *mut *mut c_void,
    ) {
        launch_kernel(f, [gx, gy, gz, bx, by, bz], stream, true, duration_from_params(params))
    }

    fn cuLaunchKernelEx(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        _extra: *mut *mut c_void,
    ) {
        launch_ex(config, f, params, false)
    }

    fn cuLaunchKernelEx_ptsz(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        _extra: *mut *mut c_void,
    ) {
        launch_ex(config, f, params, true)
    }

    fn cuLaunchCooperativeKernel(
        f: CUfunction,
        gx: c_uint, gy: c_uint, gz: c_uint,
        bx: c_uint, by: c_uint, bz: c_uint,
        _shared: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
    ) {
        launch_kernel(f, [gx, gy, gz, bx, by, bz], stream, false, duration_from_params(params))
    }

    fn cuLaunchCooperativeKernel_ptsz(
        f: CUfunction,
        gx: c_uint, gy: c_uint, gz: c_uint,
        bx: c_uint, by: c_uint, bz: c_uint,
        _shared: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
    ) {
        launch_kernel(f, [gx, gy, gz, bx, by, bz], stream, true, duration_from_params(params))
    }

    fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, _flags: c_uint) {
        cuda()?;
        if list.is_null() || n == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let list = std::slice::from_raw_parts(list, n as usize);
        // Validate everything before launching anything: one entry per
        // device, as the driver requires.
        let mut devices = Vec::with_capacity(list.len());
        for p in list {
            let t = resolve_stream(p.hStream, false)?;
            if p.function.is_null() {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            if devices.contains(&t.ctx.device) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            devices.push(t.ctx.device);
        }
        for p in list {
            let dims = [p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ];
            launch_kernel(p.function, dims, p.hStream, false, duration_from_params(p.kernelParams))?;
        }
        Ok(())
    }

    fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) {
        graph_launch(exec, stream, false)
    }

    fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) {
        graph_launch(exec, stream, true)
    }
}

/// For the test-only export.
pub fn new_graph(duration_ns: u64) -> CUgraphExec {
    leak(GraphExec::new(duration_ns)).handle()
}

pub fn out_graph(out_ptr: *mut CUgraphExec, duration_ns: u64) -> Result<(), CUresult> {
    cuda()?;
    unsafe { out(out_ptr, new_graph(duration_ns), CUDA_ERROR_INVALID_VALUE) }
}
