//! `cuGetProcAddress`: base name + requested CUDA version -> exported symbol.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use gpufrac_common::cuda::*;

use crate::config::driver_version;
use crate::ctx::*;
use crate::device::*;
use crate::exec::*;
use crate::graphs::*;
use crate::mem::*;

#[derive(Debug, PartialEq)]
pub struct Entry {
    pub base: &'static str,
    pub min_version: i32,
    /// Address of the exported function (this library's own definition:
    /// the cdylib is linked with -Bsymbolic).
    pub addr: usize,
    /// A `_ptsz`/`_ptds` variant.
    pub per_thread: bool,
}

macro_rules! table {
    ($($base:literal $ver:literal $f:ident;)*) => {
        vec![$(Entry {
            base: $base,
            min_version: $ver,
            addr: $f as *const () as usize,
            per_thread: stringify!($f).ends_with("_ptsz") || stringify!($f).ends_with("_ptds"),
        }),*]
    };
}

pub fn table() -> &'static [Entry] {
    static T: OnceLock<Vec<Entry>> = OnceLock::new();
    T.get_or_init(|| {
        table! {
            "cuInit" 2000 cuInit;
            "cuDriverGetVersion" 2020 cuDriverGetVersion;
            "cuDeviceGet" 2000 cuDeviceGet;
            "cuDeviceGetCount" 2000 cuDeviceGetCount;
            "cuDeviceGetName" 2000 cuDeviceGetName;
            "cuDeviceGetAttribute" 2000 cuDeviceGetAttribute;
            "cuDeviceGetUuid" 9020 cuDeviceGetUuid;
            "cuDeviceGetUuid" 11040 cuDeviceGetUuid_v2;
            "cuDeviceTotalMem" 3020 cuDeviceTotalMem_v2;
            "cuDeviceGetPCIBusId" 4010 cuDeviceGetPCIBusId;
            "cuGetErrorString" 6000 cuGetErrorString;
            "cuGetErrorName" 6000 cuGetErrorName;

            // cuda.h maps cuCtxCreate to _v2 through 12.x and to _v4 from
            // 13.0; _v3 was only ever reachable by its own name.
            "cuCtxCreate" 3020 cuCtxCreate_v2;
            "cuCtxCreate" 13000 cuCtxCreate_v4;
            "cuCtxDestroy" 4000 cuCtxDestroy_v2;
            "cuCtxPushCurrent" 4000 cuCtxPushCurrent_v2;
            "cuCtxPopCurrent" 4000 cuCtxPopCurrent_v2;
            "cuCtxSetCurrent" 4000 cuCtxSetCurrent;
            "cuCtxGetCurrent" 4000 cuCtxGetCurrent;
            "cuCtxGetDevice" 2000 cuCtxGetDevice;
            "cuCtxGetDevice" 13000 cuCtxGetDevice_v2;
            "cuCtxSynchronize" 2000 cuCtxSynchronize;
            "cuCtxSynchronize" 13000 cuCtxSynchronize_v2;
            "cuDevicePrimaryCtxRetain" 7000 cuDevicePrimaryCtxRetain;
            "cuDevicePrimaryCtxRelease" 11000 cuDevicePrimaryCtxRelease_v2;
            "cuDevicePrimaryCtxReset" 11000 cuDevicePrimaryCtxReset_v2;
            "cuDevicePrimaryCtxSetFlags" 11000 cuDevicePrimaryCtxSetFlags_v2;
            "cuDevicePrimaryCtxGetState" 7000 cuDevicePrimaryCtxGetState;
            "cuStreamGetCtx" 9020 cuStreamGetCtx;

            "cuMemAlloc" 3020 cuMemAlloc_v2;
            "cuMemFree" 3020 cuMemFree_v2;
            "cuMemAllocPitch" 3020 cuMemAllocPitch_v2;
            "cuMemGetInfo" 3020 cuMemGetInfo_v2;
            "cuMemAllocManaged" 6000 cuMemAllocManaged;
            "cuMemAllocAsync" 11020 cuMemAllocAsync;
            "cuMemAllocAsync" 11020 cuMemAllocAsync_ptsz;
            "cuMemFreeAsync" 11020 cuMemFreeAsync;
            "cuMemFreeAsync" 11020 cuMemFreeAsync_ptsz;
            "cuMemAllocFromPoolAsync" 11020 cuMemAllocFromPoolAsync;
            "cuMemAllocFromPoolAsync" 11020 cuMemAllocFromPoolAsync_ptsz;
            "cuDeviceGetDefaultMemPool" 11020 cuDeviceGetDefaultMemPool;
            "cuMemPoolCreate" 11020 cuMemPoolCreate;
            "cuMemPoolDestroy" 11020 cuMemPoolDestroy;
            "cuMemCreate" 10020 cuMemCreate;
            "cuMemRelease" 10020 cuMemRelease;
            "cuMemMap" 10020 cuMemMap;
            "cuMemUnmap" 10020 cuMemUnmap;
            "cuMemRetainAllocationHandle" 11000 cuMemRetainAllocationHandle;
            "cuMemExportToShareableHandle" 10020 cuMemExportToShareableHandle;
            "cuMemImportFromShareableHandle" 10020 cuMemImportFromShareableHandle;
            "cuMemAddressReserve" 10020 cuMemAddressReserve;
            "cuMemAddressFree" 10020 cuMemAddressFree;
            "cuMemSetAccess" 10020 cuMemSetAccess;
            "cuMemGetAllocationGranularity" 10020 cuMemGetAllocationGranularity;
            "cuArrayCreate" 3020 cuArrayCreate_v2;
            "cuArray3DCreate" 3020 cuArray3DCreate_v2;
            "cuArrayDestroy" 2000 cuArrayDestroy;
            "cuMipmappedArrayCreate" 5000 cuMipmappedArrayCreate;
            "cuMipmappedArrayDestroy" 5000 cuMipmappedArrayDestroy;
            "cuArrayGetMemoryRequirements" 11060 cuArrayGetMemoryRequirements;
            "cuMipmappedArrayGetMemoryRequirements" 11060 cuMipmappedArrayGetMemoryRequirements;
            "cuMemcpyHtoD" 3020 cuMemcpyHtoD_v2;
            "cuMemcpyHtoD" 7000 cuMemcpyHtoD_v2_ptds;
            "cuMemcpyDtoH" 3020 cuMemcpyDtoH_v2;
            "cuMemcpyDtoH" 7000 cuMemcpyDtoH_v2_ptds;
            "cuMemcpyDtoD" 3020 cuMemcpyDtoD_v2;
            "cuMemcpyDtoD" 7000 cuMemcpyDtoD_v2_ptds;
            "cuMemcpyHtoDAsync" 3020 cuMemcpyHtoDAsync_v2;
            "cuMemcpyHtoDAsync" 7000 cuMemcpyHtoDAsync_v2_ptsz;
            "cuMemcpyDtoHAsync" 3020 cuMemcpyDtoHAsync_v2;
            "cuMemcpyDtoHAsync" 7000 cuMemcpyDtoHAsync_v2_ptsz;
            "cuMemsetD8" 3020 cuMemsetD8_v2;
            "cuMemsetD8" 7000 cuMemsetD8_v2_ptds;
            "cuMemsetD32" 3020 cuMemsetD32_v2;
            "cuMemsetD32" 7000 cuMemsetD32_v2_ptds;
            "cuMemcpyDtoDAsync" 3020 cuMemcpyDtoDAsync_v2;
            "cuMemcpyDtoDAsync" 7000 cuMemcpyDtoDAsync_v2_ptsz;
            "cuMemsetD8Async" 3020 cuMemsetD8Async;
            "cuMemsetD8Async" 7000 cuMemsetD8Async_ptsz;
            "cuMemsetD32Async" 3020 cuMemsetD32Async;
            "cuMemsetD32Async" 7000 cuMemsetD32Async_ptsz;
            "cuDeviceGetMemPool" 11020 cuDeviceGetMemPool;
            "cuMemHostAlloc" 2020 cuMemHostAlloc;
            "cuMemAllocHost" 3020 cuMemAllocHost_v2;
            "cuMemFreeHost" 2000 cuMemFreeHost;

            "cuModuleLoadData" 2000 cuModuleLoadData;
            "cuModuleGetFunction" 2000 cuModuleGetFunction;
            "cuModuleUnload" 2000 cuModuleUnload;
            "cuStreamCreate" 2000 cuStreamCreate;
            "cuStreamCreateWithPriority" 5050 cuStreamCreateWithPriority;
            "cuStreamDestroy" 4000 cuStreamDestroy_v2;
            "cuStreamSynchronize" 2000 cuStreamSynchronize;
            "cuStreamSynchronize" 7000 cuStreamSynchronize_ptsz;
            "cuStreamQuery" 2000 cuStreamQuery;
            "cuStreamQuery" 7000 cuStreamQuery_ptsz;
            "cuEventCreate" 2000 cuEventCreate;
            "cuEventRecord" 2000 cuEventRecord;
            "cuEventRecord" 7000 cuEventRecord_ptsz;
            "cuEventSynchronize" 2000 cuEventSynchronize;
            "cuEventQuery" 2000 cuEventQuery;
            "cuEventElapsedTime" 2000 cuEventElapsedTime;
            "cuEventElapsedTime" 12080 cuEventElapsedTime_v2;
            "cuEventDestroy" 4000 cuEventDestroy_v2;
            "cuStreamWaitEvent" 3020 cuStreamWaitEvent;
            "cuStreamWaitEvent" 7000 cuStreamWaitEvent_ptsz;
            "cuCtxGetStreamPriorityRange" 5050 cuCtxGetStreamPriorityRange;

            "cuLaunchKernel" 4000 cuLaunchKernel;
            "cuLaunchKernel" 7000 cuLaunchKernel_ptsz;
            "cuLaunchKernelEx" 11060 cuLaunchKernelEx;
            "cuLaunchKernelEx" 11060 cuLaunchKernelEx_ptsz;
            "cuLaunchCooperativeKernel" 9000 cuLaunchCooperativeKernel;
            "cuLaunchCooperativeKernel" 9000 cuLaunchCooperativeKernel_ptsz;
            "cuLaunchCooperativeKernelMultiDevice" 9000 cuLaunchCooperativeKernelMultiDevice;
            "cuGraphLaunch" 10000 cuGraphLaunch;
            "cuGraphLaunch" 10000 cuGraphLaunch_ptsz;
            "cuStreamBeginCapture" 10000 cuStreamBeginCapture;
            "cuStreamBeginCapture" 10000 cuStreamBeginCapture_ptsz;
            "cuStreamBeginCapture" 10010 cuStreamBeginCapture_v2;
            "cuStreamBeginCapture" 10010 cuStreamBeginCapture_v2_ptsz;
            "cuStreamEndCapture" 10000 cuStreamEndCapture;
            "cuStreamEndCapture" 10000 cuStreamEndCapture_ptsz;
            "cuStreamIsCapturing" 10000 cuStreamIsCapturing;
            "cuStreamIsCapturing" 10000 cuStreamIsCapturing_ptsz;
            "cuGraphCreate" 10000 cuGraphCreate;
            "cuGraphAddEmptyNode" 10000 cuGraphAddEmptyNode;
            "cuGraphAddMemAllocNode" 11040 cuGraphAddMemAllocNode;
            "cuGraphAddMemFreeNode" 11040 cuGraphAddMemFreeNode;
            "cuGraphClone" 10000 cuGraphClone;
            "cuGraphGetNodes" 10000 cuGraphGetNodes;
            "cuGraphNodeGetType" 10000 cuGraphNodeGetType;
            "cuGraphMemAllocNodeGetParams" 11040 cuGraphMemAllocNodeGetParams;
            // cuda.h maps cuGraphInstantiate to _v2 in 11.x and to
            // cuGraphInstantiateWithFlags from 12.0.
            "cuGraphInstantiate" 10000 cuGraphInstantiate;
            "cuGraphInstantiate" 11000 cuGraphInstantiate_v2;
            "cuGraphInstantiate" 12000 cuGraphInstantiateWithFlags;
            "cuGraphInstantiateWithFlags" 11040 cuGraphInstantiateWithFlags;
            "cuGraphInstantiateWithParams" 12000 cuGraphInstantiateWithParams;
            "cuGraphInstantiateWithParams" 12000 cuGraphInstantiateWithParams_ptsz;
            "cuGraphUpload" 11010 cuGraphUpload;
            "cuGraphUpload" 11010 cuGraphUpload_ptsz;
            "cuGraphDestroy" 10000 cuGraphDestroy;
            "cuGraphExecDestroy" 10000 cuGraphExecDestroy;
            "cuDeviceGraphMemTrim" 11040 cuDeviceGraphMemTrim;
            "cuDeviceGetGraphMemAttribute" 11040 cuDeviceGetGraphMemAttribute;

            "cuGetProcAddress" 11030 cuGetProcAddress;
            "cuGetProcAddress" 12000 cuGetProcAddress_v2;
        }
    })
}

/// Picks the entry for `base` at `version` (capped by the driver version);
/// `Err` carries the `CUdriverProcAddressQueryResult`.
pub fn lookup(base: &[u8], version: c_int, flags: u64) -> Result<&'static Entry, c_int> {
    let cap = version.min(driver_version());
    let mut any = false;
    let mut best: Option<&Entry> = None;
    let mut best_pt: Option<&Entry> = None;
    for e in table().iter().filter(|e| e.base.as_bytes() == base) {
        any = true;
        if e.min_version > cap {
            continue;
        }
        let slot = if e.per_thread {
            &mut best_pt
        } else {
            &mut best
        };
        if slot.is_none_or(|b| b.min_version < e.min_version) {
            *slot = Some(e);
        }
    }
    if !any {
        return Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    }
    let pick = if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        best_pt.or(best)
    } else {
        best
    };
    pick.ok_or(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
}

unsafe fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> Result<(), CUresult> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    let (p, st) = match lookup(name, version, flags) {
        Ok(e) => (e.addr as *mut c_void, CU_GET_PROC_ADDRESS_SUCCESS),
        Err(st) => (std::ptr::null_mut(), st),
    };
    unsafe {
        *pfn = p;
        if !status.is_null() {
            *status = st;
        }
    }
    if p.is_null() {
        Err(CUDA_ERROR_NOT_FOUND)
    } else {
        Ok(())
    }
}

cuda_exports! {
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
        get_proc_address(symbol, pfn, version, flags, std::ptr::null_mut())
    }

    fn cuGetProcAddress_v2(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        version: c_int,
        flags: u64,
        status: *mut c_int,
    ) {
        get_proc_address(symbol, pfn, version, flags, status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(base: &str, v: c_int, flags: u64) -> Result<&'static Entry, c_int> {
        lookup(base.as_bytes(), v, flags)
    }

    #[test]
    fn every_base_has_one_entry_per_version_and_kind() {
        let t = table();
        for (i, a) in t.iter().enumerate() {
            for b in &t[i + 1..] {
                assert!(
                    !(a.base == b.base
                        && a.min_version == b.min_version
                        && a.per_thread == b.per_thread),
                    "duplicate entry for {}@{}",
                    a.base,
                    a.min_version
                );
            }
        }
    }

    #[test]
    fn selection() {
        // Selection is checked against exported addresses in tests/sim.rs;
        // here only the statuses.
        assert!(pick("cuCtxCreate", 12050, 0).is_ok());
        assert_eq!(
            pick("cuCtxCreate", 3000, 0),
            Err(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
        );
        assert_eq!(
            pick("cuNope", 13000, 0),
            Err(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        );
        assert!(pick("cuLaunchKernel", 12000, 2).unwrap().per_thread);
        assert!(!pick("cuLaunchKernel", 12000, 0).unwrap().per_thread);
        assert!(!pick("cuLaunchKernel", 6000, 2).unwrap().per_thread);
    }
}
