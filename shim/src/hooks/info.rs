//! What the process sees of memory through CUDA: a GPU the size of its cap
//! (`view.rs`), and in a job no more free than the job has left.

use super::accounting;
use crate::charge::Accounting;
use crate::driver::call;
use crate::ledger::{self, NO_LIMIT};
use crate::view::virtual_view;
use super::process;
use crate::devices;
use gpufrac_common::cuda::*;

pub unsafe fn mem_get_info(free: *mut usize, total: *mut usize) -> u32 {
    let real = || unsafe { call::cuMemGetInfo_v2(free, total) };
    match accounting() {
        Accounting::Pass => real(),
        Accounting::Refuse(code) => code,
        Accounting::Account => {
            let Some((dev, _)) = devices::current() else {
                return real();
            };
            let cap = ledger::limit(dev);
            if cap == NO_LIMIT {
                return real();
            }
            if free.is_null() || total.is_null() {
                // Let the driver decide what a NULL out-pointer means, then
                // overwrite whatever it filled in.
                let rc = real();
                if rc != CUDA_SUCCESS {
                    return rc;
                }
            }
            let (mut f, mut t) = (0usize, 0usize);
            let rc = unsafe { call::cuMemGetInfo_v2(&mut f, &mut t) };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            let (vt, vf) = virtual_view(t as u64, f as u64, cap, ledger::used(dev));
            // In a job, what the job's other processes hold is not free.
            let vf = vf.min(ledger::job_room(dev));
            unsafe {
                if !free.is_null() {
                    free.write_unaligned(vf as usize);
                }
                if !total.is_null() {
                    total.write_unaligned(vt as usize);
                }
            }
            rc
        }
    }
}

pub unsafe fn device_total_mem(bytes: *mut usize, dev: CUdevice) -> u32 {
    if let Err(code) = process::config() {
        return code;
    }
    let rc = unsafe { call::cuDeviceTotalMem_v2(bytes, dev) };
    if rc == CUDA_SUCCESS && !bytes.is_null() && dev >= 0 && devices::ensure().is_ok() {
        let cap = ledger::limit(dev as usize);
        unsafe { bytes.write_unaligned((bytes.read_unaligned() as u64).min(cap) as usize) };
    }
    rc
}
