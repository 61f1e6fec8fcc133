//! NVML over the same simulated devices.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering::*};

use gpufrac_common::cuda::*;

use crate::config::{driver_version, nvml_late};
use crate::config::{phys_name, uuid_string};
use crate::mig::{self, mig_handle};
use crate::state::{MAX_DEV, Sim, init, sim};
use crate::{out, write_cstr};

/// Static per-device records; an `nvmlDevice_t` points at one.
#[repr(C)]
pub struct NvmlDev {
    index: u32,
}

static DEVS: [NvmlDev; MAX_DEV] = {
    let mut a = [const { NvmlDev { index: 0 } }; MAX_DEV];
    let mut i = 0;
    while i < MAX_DEV {
        a[i].index = i as u32;
        i += 1;
    }
    a
};

static REFS: AtomicU32 = AtomicU32::new(0);

/// How far back the driver keeps per-process utilisation samples.
const SAMPLE_BUFFER_NS: u64 = 1_000_000_000;

pub(crate) fn nvml() -> Result<&'static Sim, nvmlReturn_t> {
    if REFS.load(Acquire) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    sim().ok_or(NVML_ERROR_UNINITIALIZED)
}

fn nvml_init() -> Result<(), nvmlReturn_t> {
    init().map_err(|e| {
        eprintln!("gpufrac-sim: {e}");
        NVML_ERROR_UNKNOWN
    })?;
    REFS.fetch_add(1, AcqRel);
    Ok(())
}

pub(crate) fn handle(i: usize) -> nvmlDevice_t {
    &DEVS[i] as *const NvmlDev as *mut c_void
}

/// (simulator, physical device index) for a physical device handle.
pub(crate) fn dev(h: nvmlDevice_t) -> Result<(&'static Sim, usize), nvmlReturn_t> {
    let s = nvml()?;
    let base = DEVS.as_ptr() as usize;
    let off = (h as usize).wrapping_sub(base);
    let sz = std::mem::size_of::<NvmlDev>();
    if h.is_null() || off & (sz - 1) != 0 || off / sz >= s.nphys() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok((s, DEVS[off / sz].index as usize))
}

/// (total, free, used) of a physical device (with all its MIG instances)
/// or of a MIG device (its GPU instance's memory).
fn memory(h: nvmlDevice_t) -> Result<(u64, u64, u64), nvmlReturn_t> {
    let (total, used) = if mig_handle(h).is_some() {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let ci = mig::live_mig_device(&m, h)?;
        (
            ci.gi.memory(),
            s.slot_used(crate::state::MAX_DEV + ci.gi.slot),
        )
    } else {
        let (s, d) = dev(h)?;
        let (_g, m) = s.mig();
        (s.phys[d].total, m.phys_used(s, d))
    };
    let used = used.min(total);
    Ok((total, total - used, used))
}

const ERRORS: &[(nvmlReturn_t, &CStr)] = &[
    (0, c"Success"),
    (1, c"Uninitialized"),
    (2, c"Invalid Argument"),
    (3, c"Not Supported"),
    (4, c"Insufficient Permissions"),
    (5, c"Already Initialized"),
    (6, c"Not Found"),
    (7, c"Insufficient Size"),
    (8, c"Insufficient External Power"),
    (9, c"Driver Not Loaded"),
    (10, c"Timeout"),
    (12, c"NVML Shared Library Not Found"),
    (13, c"Function Not Found"),
    (15, c"GPU is lost"),
    (19, c"In use by another client"),
    (23, c"Insufficient resources"),
    (25, c"Argument version mismatch"),
];

/// `nvmlErrorString`: never fails.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    ERRORS
        .iter()
        .find(|(c, _)| *c == result)
        .map_or(c"Unknown Error".as_ptr(), |(_, s)| s.as_ptr())
}

nvml_exports! {
    fn nvmlInit_v2() {
        nvml_init()
    }

    fn nvmlInitWithFlags(_flags: c_uint) {
        nvml_init()
    }

    fn nvmlShutdown() {
        REFS.fetch_update(AcqRel, Acquire, |r| r.checked_sub(1))
            .map_err(|_| NVML_ERROR_UNINITIALIZED)?;
        Ok(())
    }

    fn nvmlDeviceGetCount_v2(count: *mut c_uint) {
        let s = nvml()?;
        out(count, s.nphys() as c_uint, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) {
        let s = nvml()?;
        if index as usize >= s.nphys() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        out(device, handle(index as usize), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetHandleByUUID(u: *const c_char, device: *mut nvmlDevice_t) {
        let s = nvml()?;
        if u.is_null() || device.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if let Some(h) = mig::handle_by_uuid(s, CStr::from_ptr(u)) {
            *device = h;
            return Ok(());
        }
        let want = CStr::from_ptr(u).to_bytes();
        let i = (0..s.nphys())
            .find(|&i| {
                let (b, n) = uuid_string(i);
                &b[..n] == want
            })
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        *device = handle(i);
        Ok(())
    }

    fn nvmlDeviceGetUUID(device: nvmlDevice_t, buf: *mut c_char, len: c_uint) {
        if mig_handle(device).is_some() {
            let s = nvml()?;
            let (_g, m) = s.mig();
            return mig::write_uuid(&m, device, buf, len);
        }
        let (_, d) = dev(device)?;
        if buf.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (b, n) = uuid_string(d);
        if !write_cstr(buf, len as usize, &b[..n]) {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        Ok(())
    }

    fn nvmlDeviceGetName(device: nvmlDevice_t, buf: *mut c_char, len: c_uint) {
        let name = if mig_handle(device).is_some() {
            let s = nvml()?;
            let (_g, m) = s.mig();
            m.device_name(&mig::live_mig_device(&m, device)?)
        } else {
            let (s, d) = dev(device)?;
            phys_name(d, &s.phys[d])
        };
        if buf.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if !write_cstr(buf, len as usize, name.as_bytes()) {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        Ok(())
    }

    fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) {
        let (_, d) = dev(device)?;
        out(index, d as c_uint, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, mem: *mut nvmlMemory_t) {
        let (total, free, used) = memory(device)?;
        out(mem, nvmlMemory_t { total, free, used }, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) {
        let (total, free, used) = memory(device)?;
        if mem.is_null() || (*mem).version != nvmlMemory_v2 {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *mem = nvmlMemory_v2_t { version: nvmlMemory_v2, total, reserved: 0, free, used };
        Ok(())
    }

    /// Not supported in MIG mode, as on a real GPU.
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, util: *mut nvmlUtilization_t) {
        let (s, d) = dev(device)?;
        if s.phys[d].mig {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if util.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *util = nvmlUtilization_t { gpu: s.utilization(d), memory: 0 };
        Ok(())
    }

    fn nvmlDeviceGetComputeRunningProcesses_v3(
        device: nvmlDevice_t,
        count: *mut c_uint,
        infos: *mut nvmlProcessInfo_t,
    ) {
        let (s, d) = dev(device)?;
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // In MIG mode, each process with its GPU and compute instance.
        let mut procs: Vec<(u32, u64, u32, u32)> = s
            .slot_processes(d)
            .into_iter()
            .map(|(pid, used, _)| (pid, used, u32::MAX, u32::MAX))
            .collect();
        {
            let (_g, m) = s.mig();
            for gi in m.gis(d) {
                let cis = m.cis(&gi);
                for (pid, used, serial) in s.slot_processes(crate::state::MAX_DEV + gi.slot) {
                    let ci = cis.iter().find(|c| c.serial == serial).map_or(0, |c| c.id());
                    procs.push((pid, used, gi.id(), ci));
                }
            }
        }
        let room = *count as usize;
        if room == 0 {
            // Asked for the count: those that start meanwhile are not in it.
            let counted = procs.len().saturating_sub(nvml_late());
            *count = counted as c_uint;
            return if counted > 0 { Err(NVML_ERROR_INSUFFICIENT_SIZE) } else { Ok(()) };
        }
        *count = procs.len() as c_uint;
        if procs.len() > room {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        if !procs.is_empty() && infos.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        for (i, (pid, used, gi, ci)) in procs.into_iter().enumerate() {
            *infos.add(i) = nvmlProcessInfo_t {
                pid,
                usedGpuMemory: used,
                gpuInstanceId: gi,
                computeInstanceId: ci,
            };
        }
        Ok(())
    }

    /// One sample per process whose kernels ran on the device after
    /// `last_seen` (µs) and within the driver's buffer (the last second):
    /// `timeStamp` is when it last ran (µs of CLOCK_MONOTONIC here; a real
    /// driver's are the CPU's clock, which a caller only ever hands back),
    /// `smUtil` the share of that span it ran (at least 1: it did run).
    /// As a real driver: a NULL buffer or one too small is
    /// NVML_ERROR_INSUFFICIENT_SIZE with the count needed, no process
    /// NVML_ERROR_NOT_FOUND, and MIG mode NVML_ERROR_NOT_SUPPORTED.
    fn nvmlDeviceGetProcessUtilization(
        device: nvmlDevice_t,
        samples: *mut nvmlProcessUtilizationSample_t,
        count: *mut c_uint,
        last_seen: u64,
    ) {
        if mig_handle(device).is_some() {
            nvml()?;
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let (s, d) = dev(device)?;
        if s.phys[d].mig {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let since = last_seen
            .saturating_mul(1000)
            .max(crate::engine::now_ns().saturating_sub(SAMPLE_BUFFER_NS));
        let (now, mut ran) = s.process_work(d, since);
        ran.retain(|&(_, _, last)| last / 1000 > last_seen);
        ran.sort_unstable();
        if ran.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        let room = *count as usize;
        if samples.is_null() || room == 0 {
            // Asked for the count: those that ran meanwhile are not in it.
            let counted = ran.len().saturating_sub(nvml_late());
            *count = counted as c_uint;
            return Err(if counted > 0 {
                NVML_ERROR_INSUFFICIENT_SIZE
            } else {
                NVML_ERROR_NOT_FOUND
            });
        }
        *count = ran.len() as c_uint;
        if ran.len() > room {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        let span = now.saturating_sub(since).max(1);
        for (i, (pid, ns, last)) in ran.into_iter().enumerate() {
            let pct = (u128::from(ns) * 100 / u128::from(span)).clamp(1, 100) as c_uint;
            *samples.add(i) = nvmlProcessUtilizationSample_t {
                pid,
                timeStamp: last / 1000,
                smUtil: pct,
                ..Default::default()
            };
        }
        Ok(())
    }

    fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) {
        nvml()?;
        if buf.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if !write_cstr(buf, len as usize, b"580.00-sim") {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        Ok(())
    }

    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) {
        nvml()?;
        out(version, driver_version(), NVML_ERROR_INVALID_ARGUMENT)
    }
}
