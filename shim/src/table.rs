//! The one table of everything the shim hooks. From it the `hooks!` macro
//! generates, per entry: the exported symbol (what `-lcuda` programs bind
//! to), an atomic slot holding the real driver function, a typed caller for
//! that slot, and a row in `TABLE`, which `dlsym` and `cuGetProcAddress` use
//! to swap a real pointer for its hook. Adding a hook is one line here.

use gpufrac_common::cuda::*;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Which library an entry's real function lives in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Family {
    /// libcuda.so.1
    Cuda,
    /// libnvidia-ml.so.1
    Nvml,
    /// libcudart (found with RTLD_NEXT: it may be linked statically or not at all)
    Cudart,
}

impl Family {
    /// What a hook answers when the library it wraps lacks the function.
    pub const fn missing(self) -> u32 {
        match self {
            Family::Cuda => CUDA_ERROR_NOT_FOUND,
            Family::Nvml => NVML_ERROR_FUNCTION_NOT_FOUND,
            Family::Cudart => 500, // cudaErrorSymbolNotFound
        }
    }
}

pub struct HookEntry {
    /// NUL-terminated exported name.
    pub name: &'static [u8],
    pub family: Family,
    pub hook: *const (),
    pub real: &'static AtomicUsize,
}

// SAFETY: the raw pointers are addresses of functions, immutable for the
// lifetime of the library.
unsafe impl Sync for HookEntry {}

impl HookEntry {
    pub fn name_str(&self) -> &'static str {
        // Built from stringify!, so always ASCII.
        std::str::from_utf8(&self.name[..self.name.len() - 1]).unwrap_or("?")
    }
}

macro_rules! hooks {
    (
        exported { $( $fam:ident fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) => $imp:path; )* }
        internal { $( $ifam:ident fn $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ); )* }
    ) => {
        /// Slots for the real functions, filled when the library is loaded.
        #[allow(non_upper_case_globals)]
        pub mod real {
            use std::sync::atomic::AtomicUsize;
            $( pub static $name: AtomicUsize = AtomicUsize::new(0); )*
            $( pub static $iname: AtomicUsize = AtomicUsize::new(0); )*
        }

        /// Typed calls of the real functions.
        #[allow(non_snake_case, clippy::too_many_arguments, dead_code)]
        pub mod call {
            use super::*;
            $(
                #[inline(always)]
                pub unsafe fn $name($($arg: $ty),*) -> u32 {
                    let p = real::$name.load(Ordering::Acquire);
                    if p == 0 {
                        return Family::$fam.missing();
                    }
                    // SAFETY: the slot holds the address of the function of
                    // this exact name and C signature (see table.rs).
                    let f: unsafe extern "C" fn($($ty),*) -> u32 = unsafe { std::mem::transmute(p) };
                    unsafe { f($($arg),*) }
                }
            )*
            $(
                #[inline(always)]
                pub unsafe fn $iname($($iarg: $ity),*) -> u32 {
                    let p = real::$iname.load(Ordering::Acquire);
                    if p == 0 {
                        return Family::$ifam.missing();
                    }
                    // SAFETY: as above.
                    let f: unsafe extern "C" fn($($ity),*) -> u32 = unsafe { std::mem::transmute(p) };
                    unsafe { f($($iarg),*) }
                }
            )*
        }

        /// The exported hooks: each one is a boundary around its policy.
        #[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]
        pub mod exports {
            use super::*;
            $(
                #[unsafe(no_mangle)]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> u32 {
                    crate::boundary::run(
                        stringify!($name),
                        move || {
                            crate::boundary::test_panic(stringify!($name));
                            unsafe { $imp($($arg),*) }
                        },
                        move || { crate::init::ensure_family(Family::$fam); unsafe { call::$name($($arg),*) } },
                    )
                }
            )*
        }

        /// Every exported hook.
        pub static TABLE: &[HookEntry] = &[
            $( HookEntry {
                name: concat!(stringify!($name), "\0").as_bytes(),
                family: Family::$fam,
                hook: exports::$name as *const (),
                real: &real::$name,
            }, )*
        ];

        /// Real functions the shim calls but does not hook.
        pub static INTERNAL: &[HookEntry] = &[
            $( HookEntry {
                name: concat!(stringify!($iname), "\0").as_bytes(),
                family: Family::$ifam,
                hook: std::ptr::null(),
                real: &real::$iname,
            }, )*
        ];
    };
}

use crate::{graphmem, info, launch, mem, nvml, procaddr, vmm};

hooks! {
    exported {
        Cuda fn cuInit(flags: c_uint) => crate::init::cu_init;
        Cuda fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64) => procaddr::get_v1;
        Cuda fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64, status: *mut c_int) => procaddr::get_v2;

        Cuda fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => mem::alloc;
        Cuda fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) => mem::alloc_pitch;
        Cuda fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) => mem::alloc_managed;
        Cuda fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => mem::alloc_async;
        Cuda fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => mem::alloc_async_ptsz;
        Cuda fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => mem::alloc_pool;
        Cuda fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => mem::alloc_pool_ptsz;
        Cuda fn cuMemFree_v2(dptr: CUdeviceptr) => mem::free;
        Cuda fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => mem::free_async;
        Cuda fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => mem::free_async_ptsz;
        Cuda fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) => mem::create;
        Cuda fn cuMemRelease(handle: CUmemGenericAllocationHandle) => vmm::release;
        Cuda fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) => vmm::retain;
        Cuda fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) => vmm::map;
        Cuda fn cuMemUnmap(ptr: CUdeviceptr, size: usize) => vmm::unmap;
        Cuda fn cuArrayCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => mem::array_create;
        Cuda fn cuArray3DCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => mem::array3d_create;
        Cuda fn cuArrayDestroy(arr: CUarray) => mem::array_destroy;
        Cuda fn cuMipmappedArrayCreate(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) => mem::mipmap_create;
        Cuda fn cuMipmappedArrayDestroy(arr: CUmipmappedArray) => mem::mipmap_destroy;
        Cuda fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const c_void) => mem::pool_create;
        Cuda fn cuMemPoolDestroy(pool: CUmemoryPool) => mem::pool_destroy;
        Cuda fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => mem::default_pool;

        Cuda fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => info::mem_get_info;
        Cuda fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) => info::device_total_mem;

        Cuda fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => mem::ctx_create_v2;
        Cuda fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, nparams: c_int, flags: c_uint, dev: CUdevice) => mem::ctx_create_v3;
        Cuda fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) => mem::ctx_create_v4;
        Cuda fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) => mem::primary_retain;
        Cuda fn cuCtxDestroy_v2(ctx: CUcontext) => mem::ctx_destroy;
        Cuda fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => mem::primary_release;
        Cuda fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) => mem::primary_reset;

        Cuda fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel;
        Cuda fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel_ptsz;
        Cuda fn cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel_ex;
        Cuda fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel_ex_ptsz;
        Cuda fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void) => launch::launch_coop;
        Cuda fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void) => launch::launch_coop_ptsz;
        Cuda fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) => launch::launch_coop_multi;
        Cuda fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => launch::graph_launch;
        Cuda fn cuStreamEndCapture(stream: CUstream, graph: *mut *mut c_void) => graphmem::end_capture;
        Cuda fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: *mut c_void, flags: u64) => graphmem::instantiate_with_flags;
        Cuda fn cuGraphInstantiateWithParams(exec: *mut CUgraphExec, graph: *mut c_void, params: *mut c_void) => graphmem::instantiate_with_params;
        Cuda fn cuGraphDestroy(graph: *mut c_void) => graphmem::graph_destroy;
        Cuda fn cuGraphExecDestroy(exec: CUgraphExec) => graphmem::exec_destroy;
        Cuda fn cuDeviceGraphMemTrim(dev: CUdevice) => graphmem::trim;
        Cuda fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => launch::graph_launch_ptsz;

        Cuda fn cuCtxSynchronize() => launch::ctx_sync;
        Cuda fn cuCtxSynchronize_v2(ctx: CUcontext) => launch::ctx_sync_v2;
        Cuda fn cuStreamSynchronize(stream: CUstream) => launch::stream_sync;
        Cuda fn cuStreamSynchronize_ptsz(stream: CUstream) => launch::stream_sync_ptsz;
        Cuda fn cuEventSynchronize(event: CUevent) => launch::event_sync;

        Nvml fn nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) => nvml::memory_info;
        Nvml fn nvmlDeviceGetMemoryInfo_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) => nvml::memory_info_v2;

        Cudart fn cudaGetDriverEntryPoint(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point;
        Cudart fn cudaGetDriverEntryPoint_ptsz(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point_ptsz;
        Cudart fn cudaGetDriverEntryPointByVersion(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_uint, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point_by_version;
        Cudart fn cudaGetDriverEntryPointByVersion_ptsz(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_uint, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point_by_version_ptsz;
    }
    internal {
        Cuda fn cuCtxGetDevice(dev: *mut CUdevice);
        Cuda fn cuCtxGetCurrent(pctx: *mut CUcontext);
        Cuda fn cuCtxSetCurrent(ctx: CUcontext);
        Cuda fn cuCtxPushCurrent_v2(ctx: CUcontext);
        Cuda fn cuCtxPopCurrent_v2(pctx: *mut CUcontext);
        Cuda fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int);
        Cuda fn cuDeviceGetCount(n: *mut c_int);
        Cuda fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice);
        Cuda fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
        Cuda fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int);
        Cuda fn cuArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, arr: CUarray, dev: CUdevice);
        Cuda fn cuMipmappedArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, arr: CUmipmappedArray, dev: CUdevice);
        Cuda fn cuStreamGetCtx(stream: CUstream, pctx: *mut CUcontext);
        Cuda fn cuEventCreate(event: *mut CUevent, flags: c_uint);
        Cuda fn cuEventRecord(event: CUevent, stream: CUstream);
        Cuda fn cuEventRecord_ptsz(event: CUevent, stream: CUstream);
        Cuda fn cuEventQuery(event: CUevent);
        Cuda fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent);
        Cuda fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent);
        Cuda fn cuEventDestroy_v2(event: CUevent);
        Cuda fn cuStreamIsCapturing(stream: CUstream, status: *mut c_int);
        Cuda fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void);
        Nvml fn nvmlDeviceGetUUID(dev: nvmlDevice_t, buf: *mut c_char, len: c_uint);
    }
}

/// Exact-name lookup in the hook table. Runs on the `dlsym` path, so it
/// neither allocates nor locks; the first-byte filter keeps the common case
/// (a name that is no CUDA symbol) to one comparison.
#[inline]
pub fn find(name: &[u8]) -> Option<&'static HookEntry> {
    if name.len() < 3 || !(name[0] == b'c' || name[0] == b'n') {
        return None;
    }
    TABLE.iter().find(|e| &e.name[..e.name.len() - 1] == name)
}
