//! NVML seen from inside a capped process reports the same GPU as CUDA does,
//! so `nvidia-smi`, pynvml and frameworks that size pools from NVML agree
//! with `cuMemGetInfo`. NVML and CUDA number devices differently (NVML
//! ignores CUDA_VISIBLE_DEVICES), so devices are matched by UUID.

use crate::driver::{self, call};
use crate::ledger::{self, NO_LIMIT};
use crate::view::{same_uuid, virtual_view};
use super::process;
use crate::devices;
use gpufrac_common::cuda::*;
use std::ffi::c_char;

/// (cap, used) for an NVML device, or None when uncapped.
fn view_for(dev: nvmlDevice_t, phys_total: u64) -> Option<(u64, u64)> {
    let cfg = process::config().ok()?;
    let mut buf = [0u8; 96];
    let rc = unsafe {
        call::nvmlDeviceGetUUID(dev, buf.as_mut_ptr().cast::<c_char>(), buf.len() as u32)
    };
    if rc == NVML_SUCCESS {
        if devices::ensure() == Err(CUDA_ERROR_NOT_INITIALIZED) {
            // A process that only asks NVML (nvidia-smi) never initialised
            // CUDA; doing so creates no context and lets us map UUIDs.
            unsafe { call::cuInit(0) };
        }
        if devices::ensure().is_ok() {
            let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            for (i, d) in devices::all().iter().enumerate() {
                let mut s = [0u8; 40];
                let n = format_uuid(&d.uuid, &mut s);
                if same_uuid(&s[..n], &buf[..len]) {
                    let cap = ledger::limit(i);
                    return (cap != NO_LIMIT).then(|| (cap, ledger::used(i)));
                }
            }
        }
    }
    // Not visible to CUDA in this process: the global cap still describes
    // what this process would be allowed there.
    cfg.mem_limit.resolve(phys_total).map(|cap| (cap, 0))
}

pub unsafe fn memory_info(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) -> u32 {
    driver::ensure_nvml();
    let rc = unsafe { call::nvmlDeviceGetMemoryInfo(dev, mem) };
    if rc != NVML_SUCCESS || mem.is_null() {
        return rc;
    }
    let mut m = unsafe { mem.read_unaligned() };
    if let Some((cap, used)) = view_for(dev, m.total) {
        let (t, f) = virtual_view(m.total, m.free, cap, used);
        m.total = t;
        m.free = f;
        m.used = t - f;
        unsafe { mem.write_unaligned(m) };
    }
    rc
}

pub unsafe fn memory_info_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) -> u32 {
    driver::ensure_nvml();
    let rc = unsafe { call::nvmlDeviceGetMemoryInfo_v2(dev, mem) };
    if rc != NVML_SUCCESS || mem.is_null() {
        return rc;
    }
    let mut m = unsafe { mem.read_unaligned() };
    if let Some((cap, used)) = view_for(dev, m.total) {
        let (t, f) = virtual_view(m.total, m.free, cap, used);
        m.total = t;
        m.free = f;
        m.reserved = 0;
        m.used = t - f;
        unsafe { mem.write_unaligned(m) };
    }
    rc
}
