//! The one list of everything the shim hooks, X-macro style:
//! `with_hook_list!(m)` hands the whole list to the macro `m`. The driver
//! layer (`driver.rs`) expands it into the slots that hold the real
//! functions and their typed callers; the export layer (`exports.rs`)
//! expands the same list into the exported symbols and the table that
//! `dlsym` and `cuGetProcAddress` hand out. Adding a hook is one line here.
//!
//! Each entry names the function that implements its policy (`=> path`),
//! resolved where the exports are expanded; the driver layer's expansion
//! never reads it, so the base of the shim does not depend on its hooks.
//! An entry point and its per-thread-default-stream twin (`_ptsz`) share
//! one policy, generic over `const PTSZ: bool`: `::<false>` and `::<true>`
//! (`driver::twin` picks the real function).
//!
//! The sections say what an entry point does when the shim fails inside it
//! (a panic, see `boundary.rs`):
//! - `fail_closed`: it hands out device memory (or, for a graph launch,
//!   upload or instantiation, may grow a graph's memory pool). An internal error refuses it with
//!   `CUDA_ERROR_OUT_OF_MEMORY`: a cap is never bypassed.
//! - `pass_through`: it hands out none. An internal error forwards the call
//!   to the driver as the application made it, or, once the hook made that
//!   call, returns the driver's answer (a thread-local records it).
//! - `pass_through_settled`: the same, for the launches, whose hooks hand
//!   the driver's answer back themselves (`boundary::Answer`): their
//!   typed callers return one, and no thread-local is touched on the way.
//! - `internal`: real functions the shim calls but does not export.

macro_rules! with_hook_list {
    ($then:ident) => {
        $then! {
            fail_closed {
                Cuda fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => mem::alloc;
                Cuda fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) => mem::alloc_pitch;
                Cuda fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) => mem::alloc_managed;
                Cuda fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => mem::alloc_async::<false>;
                Cuda fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => mem::alloc_async::<true>;
                Cuda fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => mem::alloc_pool::<false>;
                Cuda fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => mem::alloc_pool::<true>;
                Cuda fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) => mem::create;
                Cuda fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, kind: c_uint) => vmm::import;
                Cuda fn cuArrayCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => mem::array_create;
                Cuda fn cuArray3DCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => mem::array3d_create;
                Cuda fn cuMipmappedArrayCreate(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) => mem::mipmap_create;
                Cuda fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => launch::graph_launch::<false>;
                Cuda fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => launch::graph_launch::<true>;
                Cuda fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) => graphmem::graph_upload::<false>;
                Cuda fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) => graphmem::graph_upload::<true>;
                Cuda fn cuGraphInstantiate(exec: *mut CUgraphExec, graph: *mut c_void, err_node: *mut CUgraphNode, log: *mut c_char, log_size: usize) => graphmem::instantiate_v1;
                Cuda fn cuGraphInstantiate_v2(exec: *mut CUgraphExec, graph: *mut c_void, err_node: *mut CUgraphNode, log: *mut c_char, log_size: usize) => graphmem::instantiate_v2;
                Cuda fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: *mut c_void, flags: u64) => graphmem::instantiate_with_flags;
                Cuda fn cuGraphInstantiateWithParams(exec: *mut CUgraphExec, graph: *mut c_void, params: *mut c_void) => graphmem::instantiate_with_params::<false>;
                Cuda fn cuGraphInstantiateWithParams_ptsz(exec: *mut CUgraphExec, graph: *mut c_void, params: *mut c_void) => graphmem::instantiate_with_params::<true>;
            }
            pass_through {
                Cuda fn cuInit(flags: c_uint) => init::cu_init;
                Cuda fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64) => procaddr::get_v1;
                Cuda fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64, status: *mut c_int) => procaddr::get_v2;

                Cuda fn cuMemFree_v2(dptr: CUdeviceptr) => mem::free;
                Cuda fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => mem::free_async::<false>;
                Cuda fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => mem::free_async::<true>;
                Cuda fn cuMemRelease(handle: CUmemGenericAllocationHandle) => vmm::release;
                Cuda fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) => vmm::retain;
                Cuda fn cuMemExportToShareableHandle(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_uint, flags: u64) => vmm::export;
                Cuda fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) => vmm::map;
                Cuda fn cuMemUnmap(ptr: CUdeviceptr, size: usize) => vmm::unmap;
                Cuda fn cuArrayDestroy(arr: CUarray) => mem::array_destroy;
                Cuda fn cuMipmappedArrayDestroy(arr: CUmipmappedArray) => mem::mipmap_destroy;
                Cuda fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const c_void) => mem::pool_create;
                Cuda fn cuMemPoolDestroy(pool: CUmemoryPool) => mem::pool_destroy;
                Cuda fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => mem::default_pool;

                Cuda fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => info::mem_get_info;
                Cuda fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) => info::device_total_mem;

                Cuda fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => ctx::create_v2;
                Cuda fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, nparams: c_int, flags: c_uint, dev: CUdevice) => ctx::create_v3;
                Cuda fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) => ctx::create_v4;
                Cuda fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) => ctx::primary_retain;
                Cuda fn cuCtxDestroy_v2(ctx: CUcontext) => ctx::destroy;
                Cuda fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => ctx::primary_release;
                Cuda fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) => ctx::primary_reset;

                Cuda fn cuGraphExecDestroy(exec: CUgraphExec) => graphmem::exec_destroy;
                Cuda fn cuDeviceGraphMemTrim(dev: CUdevice) => graphmem::trim;

                Cuda fn cuCtxSynchronize() => launch::ctx_sync;
                Cuda fn cuCtxSynchronize_v2(ctx: CUcontext) => launch::ctx_sync_v2;
                Cuda fn cuStreamSynchronize(stream: CUstream) => launch::stream_sync::<false>;
                Cuda fn cuStreamSynchronize_ptsz(stream: CUstream) => launch::stream_sync::<true>;
                Cuda fn cuEventSynchronize(event: CUevent) => launch::event_sync;

                Nvml fn nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) => nvml::memory_info;
                Nvml fn nvmlDeviceGetMemoryInfo_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) => nvml::memory_info_v2;

                Cudart fn cudaGetDriverEntryPoint(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point::<false>;
                Cudart fn cudaGetDriverEntryPoint_ptsz(symbol: *const c_char, pfn: *mut *mut c_void, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point::<true>;
                Cudart fn cudaGetDriverEntryPointByVersion(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_uint, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point_by_version::<false>;
                Cudart fn cudaGetDriverEntryPointByVersion_ptsz(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_uint, flags: u64, status: *mut c_int) => procaddr::cudart_entry_point_by_version::<true>;
            }
            pass_through_settled {
                Cuda fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel::<false>;
                Cuda fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel::<true>;
                Cuda fn cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel_ex::<false>;
                Cuda fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::launch_kernel_ex::<true>;
                Cuda fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void) => launch::launch_coop::<false>;
                Cuda fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shmem: c_uint, stream: CUstream, params: *mut *mut c_void) => launch::launch_coop::<true>;
                Cuda fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) => launch::launch_coop_multi;
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
                Cuda fn cuStreamIsCapturing_ptsz(stream: CUstream, status: *mut c_int);
                Cuda fn cuGraphGetNodes(graph: *mut c_void, nodes: *mut CUgraphNode, num: *mut usize);
                Cuda fn cuGraphNodeGetType(node: CUgraphNode, kind: *mut c_int);
                Cuda fn cuGraphMemAllocNodeGetParams(node: CUgraphNode, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS);
                Cuda fn cuGraphChildGraphNodeGetGraph(node: CUgraphNode, graph: *mut *mut c_void);
                Cuda fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void);
                Nvml fn nvmlDeviceGetUUID(dev: nvmlDevice_t, buf: *mut c_char, len: c_uint);
            }
        }
    };
}

pub(crate) use with_hook_list;
