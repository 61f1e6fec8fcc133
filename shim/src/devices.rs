//! What the shim knows of each device as this process sees it: physical
//! size, UUID (to match NVML's view and to register with the broker) and the
//! resolved cap. Learned once, right after the real `cuInit` succeeds.

use crate::config;
use crate::driver::call;
use crate::ledger::{self, LEDGERS, NO_LIMIT};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use gpufrac_common::size::format_size;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

#[derive(Clone, Copy, Debug)]
pub struct Device {
    pub total: u64,
    pub uuid: CUuuid,
}

static DEVICES: OnceLock<Vec<Device>> = OnceLock::new();
static READY: AtomicU8 = AtomicU8::new(0);
static SETUP: Mutex<()> = Mutex::new(());

/// Makes sure caps are known before any allocation is charged. Until they
/// are, every device's limit would read "none": refusing is the only safe
/// answer, and the driver's own error is the most truthful one.
#[inline]
pub fn ensure() -> Result<(), u32> {
    if READY.load(Ordering::Acquire) == 1 {
        return Ok(());
    }
    slow_ensure()
}

#[cold]
fn slow_ensure() -> Result<(), u32> {
    let cfg = config::get()?;
    let _g = SETUP.lock().unwrap_or_else(|e| e.into_inner());
    if READY.load(Ordering::Acquire) == 1 {
        return Ok(());
    }
    let mut n = 0;
    let rc = unsafe { call::cuDeviceGetCount(&mut n) };
    if rc != CUDA_SUCCESS {
        return Err(rc);
    }
    let mut devs = Vec::with_capacity(n.max(0) as usize);
    for ordinal in 0..n.max(0) {
        let mut dev: CUdevice = 0;
        let rc = unsafe { call::cuDeviceGet(&mut dev, ordinal) };
        if rc != CUDA_SUCCESS {
            return Err(rc);
        }
        let mut total = 0usize;
        let rc = unsafe { call::cuDeviceTotalMem_v2(&mut total, dev) };
        if rc != CUDA_SUCCESS {
            return Err(rc);
        }
        let mut uuid = CUuuid::default();
        if unsafe { call::cuDeviceGetUuid_v2(&mut uuid, dev) } != CUDA_SUCCESS {
            unsafe { call::cuDeviceGetUuid(&mut uuid, dev) };
        }
        let i = ordinal as usize;
        let cap = cfg.limit_for(i).resolve(total as u64).unwrap_or(NO_LIMIT);
        if i >= MAX_DEVICES {
            if cap != NO_LIMIT {
                warn!(
                    "device {i}: more than {MAX_DEVICES} devices are visible; this one is not capped"
                );
            }
        } else {
            LEDGERS[i].limit.store(cap, Ordering::Release);
            if cap != NO_LIMIT {
                info!(
                    "device {i}: memory cap {} of {} physical",
                    format_size(cap),
                    format_size(total as u64)
                );
            }
        }
        devs.push(Device {
            total: total as u64,
            uuid,
        });
    }
    // The job's books (gpufrac run --gpu-memory), opened at initialisation,
    // are joined before any charge, so the first allocation already counts
    // against the job.
    ledger::join_job(&devs.iter().map(|d| d.uuid.bytes).collect::<Vec<_>>());
    let _ = DEVICES.set(devs);
    READY.store(1, Ordering::Release);
    Ok(())
}

pub fn all() -> &'static [Device] {
    DEVICES.get().map_or(&[], |v| v.as_slice())
}

/// The device of the calling thread's current context, as (ordinal,
/// context). None when no context is current: the driver will refuse the
/// call itself.
#[inline]
pub fn current() -> Option<(usize, usize)> {
    let mut dev: CUdevice = 0;
    if unsafe { call::cuCtxGetDevice(&mut dev) } != CUDA_SUCCESS || dev < 0 {
        return None;
    }
    let mut ctx: CUcontext = std::ptr::null_mut();
    unsafe { call::cuCtxGetCurrent(&mut ctx) };
    Some((dev as usize, ctx as usize))
}
