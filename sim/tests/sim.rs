//! Tests of the simulated driver through its C ABI, loaded with dlopen.
//! Each test runs in its own process (`isolated`) so it can configure the
//! simulator through the environment.

mod support;

use std::ffi::{CString, c_char, c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use support::*;

#[test]
fn init_devices_and_contexts() {
    isolated(
        "init_devices_and_contexts",
        &[("GPUFRAC_SIM_DEVICES", "16G,8G")],
        || unsafe {
            let mut n = 0;
            check(cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
            let mut v = 0;
            ok(cuDriverGetVersion(&mut v));
            assert_eq!(v, 13000);
            let mut s: *const c_char = std::ptr::null();
            ok(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &mut s));
            assert_eq!(
                std::ffi::CStr::from_ptr(s).to_str().unwrap(),
                "out of memory"
            );
            ok(cuGetErrorName(CUDA_ERROR_INVALID_CONTEXT, &mut s));
            assert_eq!(
                std::ffi::CStr::from_ptr(s).to_str().unwrap(),
                "CUDA_ERROR_INVALID_CONTEXT"
            );
            check(cuGetErrorName(12345, &mut s), CUDA_ERROR_INVALID_VALUE);

            check(cuInit(1), CUDA_ERROR_INVALID_VALUE);
            ok(cuInit(0));
            assert_eq!(last(), "cuInit");
            ok(cuDeviceGetCount(&mut n));
            assert_eq!(n, 2);
            let mut d = 0;
            check(cuDeviceGet(&mut d, 2), CUDA_ERROR_INVALID_DEVICE);
            ok(cuDeviceGet(&mut d, 1));
            assert_eq!(d, 1);

            let mut buf = [0 as c_char; 64];
            ok(cuDeviceGetName(buf.as_mut_ptr(), 64, 1));
            assert_eq!(cstr_buf(&buf), "gpufrac-sim GPU 1");
            let mut total = 0;
            ok(cuDeviceTotalMem_v2(&mut total, 0));
            assert_eq!(total, 16 * GIB);
            ok(cuDeviceTotalMem_v2(&mut total, 1));
            assert_eq!(total, 8 * GIB);

            let (mut u0, mut u0b, mut u1) = Default::default();
            ok(cuDeviceGetUuid(&mut u0, 0));
            ok(cuDeviceGetUuid_v2(&mut u0b, 0));
            ok(cuDeviceGetUuid_v2(&mut u1, 1));
            assert_eq!(u0, u0b);
            assert_ne!(u0, u1);
            assert_eq!(last(), "cuDeviceGetUuid_v2");

            let mut a = -1;
            ok(cuDeviceGetAttribute(
                &mut a,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                0,
            ));
            assert_eq!(a, 9);
            ok(cuDeviceGetAttribute(
                &mut a,
                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                0,
            ));
            assert_eq!(a, 0);
            ok(cuDeviceGetAttribute(
                &mut a,
                CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                1,
            ));
            assert_eq!(a, 1);
            ok(cuDeviceGetAttribute(&mut a, 9999, 0));
            assert_eq!(a, 0);
            ok(cuDeviceGetPCIBusId(buf.as_mut_ptr(), 64, 1));
            assert_eq!(cstr_buf(&buf), "0000:02:00.0");

            // No context yet.
            let mut p = 0;
            check(cuMemAlloc_v2(&mut p, 1), CUDA_ERROR_INVALID_CONTEXT);
            let mut cur = null_mut();
            ok(cuCtxGetCurrent(&mut cur));
            assert!(cur.is_null());

            // Creating makes current; push/pop; v4 with NULL params.
            let mut c0 = null_mut();
            ok(cuCtxCreate_v2(&mut c0, 0, 0));
            ok(cuCtxGetCurrent(&mut cur));
            assert_eq!(cur, c0);
            let mut c1 = null_mut();
            ok(cuCtxCreate_v4(&mut c1, null_mut(), 0, 1));
            assert_eq!(last(), "cuCtxCreate_v4");
            ok(cuCtxGetDevice(&mut d));
            assert_eq!(d, 1);
            ok(cuCtxGetDevice_v2(&mut d, c0));
            assert_eq!(d, 0);
            ok(cuCtxPopCurrent_v2(&mut cur));
            assert_eq!(cur, c1);
            ok(cuCtxGetDevice_v2(&mut d, null_mut()));
            assert_eq!(d, 0);
            ok(cuCtxPushCurrent_v2(c1));
            let mut c3 = null_mut();
            ok(cuCtxCreate_v3(&mut c3, null_mut(), 0, 0, 1));
            ok(cuCtxDestroy_v2(c3));
            ok(cuCtxGetCurrent(&mut cur));
            assert_eq!(cur, c1, "destroying the current context pops it");
            check(cuCtxSetCurrent(c3), CUDA_ERROR_INVALID_CONTEXT);
            ok(cuCtxDestroy_v2(c1));
            ok(cuCtxGetCurrent(&mut cur));
            assert_eq!(cur, c0);
            ok(cuStreamGetCtx(null_mut(), &mut cur));
            assert_eq!(cur, c0);

            // Primary contexts: one per device, refcounted, not made current.
            let (mut p1, mut p2) = (null_mut(), null_mut());
            ok(cuDevicePrimaryCtxRetain(&mut p1, 1));
            ok(cuDevicePrimaryCtxRetain(&mut p2, 1));
            assert_eq!(p1, p2);
            ok(cuCtxGetCurrent(&mut cur));
            assert_eq!(cur, c0);
            let (mut flags, mut active) = (7, 0);
            ok(cuDevicePrimaryCtxSetFlags_v2(1, 4));
            ok(cuDevicePrimaryCtxGetState(1, &mut flags, &mut active));
            assert_eq!((flags, active), (4, 1));
            check(cuCtxDestroy_v2(p1), CUDA_ERROR_INVALID_CONTEXT);
            ok(cuCtxSetCurrent(p1));
            ok(cuCtxGetDevice(&mut d));
            assert_eq!(d, 1);
            ok(cuDevicePrimaryCtxRelease_v2(1));
            ok(cuDevicePrimaryCtxRelease_v2(1));
            check(cuDevicePrimaryCtxRelease_v2(1), CUDA_ERROR_INVALID_CONTEXT);
            ok(cuDevicePrimaryCtxGetState(1, &mut flags, &mut active));
            assert_eq!(active, 0);
            ok(cuDevicePrimaryCtxReset_v2(1));
            ok(cuCtxSetCurrent(null_mut()));
            check(cuCtxPopCurrent_v2(null_mut()), CUDA_ERROR_INVALID_CONTEXT);
            check(cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
        },
    );
}

#[test]
fn memory_accounting_and_oom() {
    isolated(
        "memory_accounting_and_oom",
        &[("GPUFRAC_SIM_DEVICES", "1G,512M")],
        || unsafe {
            init_ctx(0);
            let (mut a, mut b, mut c) = (0, 0, 0);
            check(cuMemAlloc_v2(&mut a, 0), CUDA_ERROR_INVALID_VALUE);
            ok(cuMemAlloc_v2(&mut a, 600 * MIB));
            assert!(a != 0 && a % 256 == 0);
            assert_eq!(used(0), 600 * MIB as u64);
            let (mut free, mut total) = (0, 0);
            ok(cuMemGetInfo_v2(&mut free, &mut total));
            assert_eq!((free, total), (424 * MIB, GIB));
            check(
                cuMemGetInfo_v2(null_mut(), &mut total),
                CUDA_ERROR_INVALID_VALUE,
            );
            check(cuMemAlloc_v2(&mut b, 500 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
            ok(cuMemAlloc_v2(&mut b, 400 * MIB));
            assert_ne!(a, b);
            ok(cuMemFree_v2(a));
            check(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);
            check(cuMemFree_v2(0x1234_5600), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(used(0), 400 * MIB as u64);
            ok(cuMemFree_v2(b));
            assert_eq!(used(0), 0);

            // Pitch: width rounded up to 512, charged pitch * height.
            let mut pitch = 0;
            ok(cuMemAllocPitch_v2(&mut a, &mut pitch, 1000, 10, 4));
            assert_eq!(pitch, 1024);
            assert_eq!(used(0), 10240);
            check(
                cuMemAllocPitch_v2(&mut b, &mut pitch, 1000, 10, 3),
                CUDA_ERROR_INVALID_VALUE,
            );
            ok(cuMemFree_v2(a));

            // Managed.
            ok(cuMemAllocManaged(&mut a, MIB, 1));
            check(cuMemAllocManaged(&mut b, MIB, 0), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(used(0), MIB as u64);
            ok(cuMemFree_v2(a));

            // Stream-ordered, from the stream's device, and per-thread variant.
            let mut s = null_mut();
            ok(cuStreamCreate(&mut s, 0));
            ok(cuMemAllocAsync(&mut a, 3 * MIB, s));
            assert_eq!(last(), "cuMemAllocAsync");
            ok(cuMemAllocAsync_ptsz(&mut b, 5 * MIB, null_mut()));
            assert_eq!(last(), "cuMemAllocAsync_ptsz");
            assert_eq!(used(0), 8 * MIB as u64);
            ok(cuMemFreeAsync(a, s));
            ok(cuMemFreeAsync_ptsz(b, null_mut()));
            assert_eq!(last(), "cuMemFreeAsync_ptsz");
            check(cuMemFreeAsync(b, s), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(used(0), 0);

            // Pools: the pool's device is charged, not the stream's.
            let mut pool0 = null_mut();
            ok(cuDeviceGetDefaultMemPool(&mut pool0, 0));
            let mut props = [0u8; 88];
            props[8..12].copy_from_slice(&CU_MEM_LOCATION_TYPE_DEVICE.to_ne_bytes());
            props[12..16].copy_from_slice(&1i32.to_ne_bytes());
            let mut pool1 = null_mut();
            ok(cuMemPoolCreate(&mut pool1, props.as_ptr().cast()));
            ok(cuMemAllocFromPoolAsync(&mut a, 100 * MIB, pool1, s));
            ok(cuMemAllocFromPoolAsync_ptsz(&mut c, MIB, pool0, null_mut()));
            assert_eq!(last(), "cuMemAllocFromPoolAsync_ptsz");
            assert_eq!((used(0), used(1)), (MIB as u64, 100 * MIB as u64));
            check(
                cuMemAllocFromPoolAsync(&mut b, 500 * MIB, pool1, s),
                CUDA_ERROR_OUT_OF_MEMORY,
            );
            ok(cuMemFreeAsync(a, s));
            ok(cuMemFreeAsync(c, s));
            check(cuMemPoolDestroy(pool0), CUDA_ERROR_INVALID_VALUE);
            ok(cuMemPoolDestroy(pool1));
            check(
                cuMemAllocFromPoolAsync(&mut a, MIB, pool1, s),
                CUDA_ERROR_INVALID_VALUE,
            );

            // Destroying a context frees what it allocated.
            let mut ctx1 = null_mut();
            ok(cuCtxCreate_v2(&mut ctx1, 0, 1));
            ok(cuMemAlloc_v2(&mut a, 50 * MIB));
            ok(cuMemGetInfo_v2(&mut free, &mut total));
            assert_eq!((free, total), (462 * MIB, 512 * MIB));
            ok(cuCtxDestroy_v2(ctx1));
            assert_eq!(used(1), 0);
            check(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);

            // So does releasing the last reference to a primary context.
            let mut pc = null_mut();
            ok(cuDevicePrimaryCtxRetain(&mut pc, 1));
            ok(cuCtxPushCurrent_v2(pc));
            ok(cuMemAlloc_v2(&mut a, 10 * MIB));
            assert_eq!(used(1), 10 * MIB as u64);
            ok(cuDevicePrimaryCtxRelease_v2(1));
            assert_eq!(used(1), 0);
            ok(cuCtxPopCurrent_v2(null_mut()));

            // Copies and memsets check pointers only.
            let host = [0u8; 16];
            ok(cuMemAlloc_v2(&mut a, 16));
            ok(cuMemcpyHtoD_v2(a, host.as_ptr().cast(), 16));
            check(
                cuMemcpyHtoD_v2(0, host.as_ptr().cast(), 16),
                CUDA_ERROR_INVALID_VALUE,
            );
            ok(cuMemcpyDtoH_v2(host.as_ptr() as *mut c_void, a, 16));
            ok(cuMemcpyDtoD_v2(a, a, 16));
            ok(cuMemcpyHtoDAsync_v2(a, host.as_ptr().cast(), 16, s));
            ok(cuMemcpyDtoHAsync_v2(host.as_ptr() as *mut c_void, a, 16, s));
            ok(cuMemsetD8_v2(a, 1, 16));
            ok(cuMemsetD8Async(a, 0, 16, s));
            ok(cuMemsetD8Async_ptsz(a, 0, 16, null_mut()));
            assert_eq!(last(), "cuMemsetD8Async_ptsz");
            ok(cuMemsetD32_v2(a, 1, 4));
            check(cuMemsetD32_v2(0, 1, 4), CUDA_ERROR_INVALID_VALUE);
            ok(cuMemFree_v2(a));

            // Host memory is real and not charged to the device.
            let mut h = null_mut();
            ok(cuMemHostAlloc(&mut h, 4096, 0));
            std::ptr::write_bytes(h.cast::<u8>(), 0xab, 4096);
            ok(cuMemFreeHost(h));
            check(cuMemFreeHost(h), CUDA_ERROR_INVALID_VALUE);
            ok(cuMemAllocHost_v2(&mut h, 100));
            ok(cuMemFreeHost(h));
            assert_eq!((used(0), used(1)), (0, 0));
        },
    );
}

#[test]
fn arrays_and_mipmaps() {
    isolated("arrays_and_mipmaps", &[], || unsafe {
        init_ctx(0);
        let d2 = CUDA_ARRAY_DESCRIPTOR {
            Width: 100,
            Height: 10,
            Format: 0x20, // FLOAT
            NumChannels: 4,
        };
        let mut a = null_mut();
        ok(cuArrayCreate_v2(&mut a, &d2));
        // 100*10*16 = 16000 -> 16384
        assert_eq!(used(0), 16384);
        let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
        ok(cuArrayGetMemoryRequirements(&mut req, a, 0));
        assert_eq!((req.size, req.alignment), (16384, 512));

        let d3 = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 7,
            Height: 3,
            Depth: 2,
            Format: 0x01, // UNSIGNED_INT8
            NumChannels: 1,
            Flags: 0,
        };
        let mut b = null_mut();
        ok(cuArray3DCreate_v2(&mut b, &d3));
        ok(cuArrayGetMemoryRequirements(&mut req, b, 0));
        assert_eq!(req.size, 512);
        assert_eq!(used(0), 16384 + 512);

        // Mipmapped: 30*30 + 15*15 = 1125 -> 1536.
        let dm = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 30,
            Height: 30,
            Depth: 0,
            Format: 0x01,
            NumChannels: 1,
            Flags: 0,
        };
        let mut m = null_mut();
        ok(cuMipmappedArrayCreate(&mut m, &dm, 2));
        ok(cuMipmappedArrayGetMemoryRequirements(&mut req, m, 0));
        assert_eq!((req.size, req.alignment), (1536, 512));
        assert_eq!(used(0), 16384 + 512 + 1536);
        check(
            cuArrayGetMemoryRequirements(&mut req, m, 0),
            CUDA_ERROR_INVALID_HANDLE,
        );
        check(
            cuMipmappedArrayCreate(&mut m, &dm, 0),
            CUDA_ERROR_INVALID_VALUE,
        );

        ok(cuArrayDestroy(a));
        ok(cuArrayDestroy(b));
        check(cuArrayDestroy(b), CUDA_ERROR_INVALID_HANDLE);
        ok(cuMipmappedArrayDestroy(m));
        assert_eq!(used(0), 0);
    });
}

#[test]
fn vmm_charges_the_device_of_the_prop() {
    isolated(
        "vmm_charges_the_device_of_the_prop",
        &[("GPUFRAC_SIM_DEVICES", "1G,1G")],
        || unsafe {
            init_ctx(0);
            let prop = device_prop(1);
            let mut g = 0;
            ok(cuMemGetAllocationGranularity(&mut g, &prop, 0));
            assert_eq!(g, 2 * MIB);
            let mut h = 0;
            ok(cuMemCreate(&mut h, 4 * MIB, &prop, 0));
            assert_eq!((used(0), used(1)), (0, 4 * MIB as u64));
            check(
                cuMemCreate(&mut h, 2 * GIB, &prop, 0),
                CUDA_ERROR_OUT_OF_MEMORY,
            );
            check(
                cuMemCreate(&mut h, 2 * MIB, &device_prop(5), 0),
                CUDA_ERROR_INVALID_DEVICE,
            );
            let mut bad = device_prop(0);
            bad.location.type_ = 0;
            check(
                cuMemCreate(&mut h, 2 * MIB, &bad, 0),
                CUDA_ERROR_INVALID_VALUE,
            );

            let mut va = 0;
            ok(cuMemAddressReserve(&mut va, 8 * MIB, 0, 0, 0));
            assert_eq!(va % (2 * MIB as u64), 0);
            ok(cuMemMap(va, 4 * MIB, 0, h, 0));
            check(
                cuMemMap(va + 64 * MIB as u64, 4 * MIB, 0, h, 0),
                CUDA_ERROR_INVALID_VALUE,
            );
            let desc = [0u8; 12];
            ok(cuMemSetAccess(va, 4 * MIB, desc.as_ptr().cast(), 1));
            ok(cuMemUnmap(va, 4 * MIB));
            check(cuMemUnmap(va, 4 * MIB), CUDA_ERROR_INVALID_VALUE);
            ok(cuMemAddressFree(va, 8 * MIB));
            ok(cuMemRelease(h));
            check(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
            assert_eq!(used(1), 0);
        },
    );
}

/// `cuGetProcAddress_v2` result: (return code, pointer, status).
unsafe fn gpa(sym: &str, ver: c_int, flags: u64) -> (u32, usize, c_int) {
    let s = CString::new(sym).unwrap();
    let (mut p, mut st) = (null_mut(), -1);
    let r = unsafe { cuGetProcAddress_v2(s.as_ptr(), &mut p, ver, flags, &mut st) };
    (r, p as usize, st)
}

#[track_caller]
fn maps_to(sym: &str, ver: c_int, flags: u64, exported: &str) {
    let (r, p, st) = unsafe { gpa(sym, ver, flags) };
    assert_eq!((r, st), (0, 0), "{sym}@{ver} flags {flags}");
    assert_eq!(
        p,
        addr(exported),
        "{sym}@{ver} flags {flags} should be {exported}"
    );
}

#[test]
fn proc_address_version_mapping() {
    isolated("proc_address_version_mapping", &[], || unsafe {
        // Works before cuInit.
        maps_to("cuInit", 12000, 0, "cuInit");
        maps_to("cuCtxCreate", 3020, 0, "cuCtxCreate_v2");
        maps_to("cuCtxCreate", 11040, 0, "cuCtxCreate_v2");
        maps_to("cuCtxCreate", 12080, 0, "cuCtxCreate_v2");
        maps_to("cuCtxCreate", 13000, 0, "cuCtxCreate_v4");
        maps_to("cuCtxCreate", 99999, 0, "cuCtxCreate_v4");
        maps_to("cuLaunchKernel", 12000, 0, "cuLaunchKernel");
        maps_to("cuLaunchKernel", 12000, 1, "cuLaunchKernel");
        maps_to("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz");
        maps_to("cuLaunchKernel", 6050, 2, "cuLaunchKernel");
        maps_to("cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz");
        maps_to("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz");
        maps_to("cuMemAllocAsync", 12000, 0, "cuMemAllocAsync");
        maps_to("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz");
        maps_to("cuMemcpyHtoD", 12000, 2, "cuMemcpyHtoD_v2_ptds");
        maps_to("cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2");
        maps_to("cuStreamDestroy", 12000, 2, "cuStreamDestroy_v2");
        maps_to("cuStreamSynchronize", 12000, 2, "cuStreamSynchronize_ptsz");
        maps_to("cuMemAlloc", 12000, 0, "cuMemAlloc_v2");
        maps_to("cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2");
        maps_to("cuDeviceTotalMem", 12000, 0, "cuDeviceTotalMem_v2");
        maps_to("cuDeviceGetUuid", 11000, 0, "cuDeviceGetUuid");
        maps_to("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2");
        maps_to("cuCtxGetDevice", 12080, 0, "cuCtxGetDevice");
        maps_to("cuCtxGetDevice", 13000, 0, "cuCtxGetDevice_v2");
        maps_to("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize_v2");
        maps_to(
            "cuDevicePrimaryCtxRelease",
            12000,
            0,
            "cuDevicePrimaryCtxRelease_v2",
        );
        maps_to("cuGetProcAddress", 11030, 0, "cuGetProcAddress");
        maps_to("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2");
        maps_to(
            "cuArrayGetMemoryRequirements",
            11060,
            0,
            "cuArrayGetMemoryRequirements",
        );

        // Not found / version not sufficient.
        let (r, p, st) = gpa("cuNoSuchThing", 12000, 0);
        assert_eq!(
            (r, p, st),
            (
                CUDA_ERROR_NOT_FOUND,
                0,
                CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
            )
        );
        let (r, p, st) = gpa("cuMemCreate", 10010, 0);
        assert_eq!(
            (r, p, st),
            (
                CUDA_ERROR_NOT_FOUND,
                0,
                CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
            )
        );
        let (r, _, st) = gpa("cuDevicePrimaryCtxRelease", 10020, 0);
        assert_eq!((r, st), (CUDA_ERROR_NOT_FOUND, 2));
        // Status pointer may be NULL; the v1 entry point works too.
        let (mut p, sym) = (null_mut(), c"cuMemFree");
        ok(cuGetProcAddress_v2(
            sym.as_ptr(),
            &mut p,
            12000,
            0,
            null_mut(),
        ));
        assert_eq!(p as usize, addr("cuMemFree_v2"));
        ok(cuGetProcAddress(c"cuCtxCreate".as_ptr(), &mut p, 13000, 0));
        assert_eq!(p as usize, addr("cuCtxCreate_v4"));
        assert_eq!(last(), "cuGetProcAddress");
        check(
            cuGetProcAddress(std::ptr::null(), &mut p, 12050, 0),
            CUDA_ERROR_INVALID_VALUE,
        );

        // The pointers are callable and record their own variant.
        ok(cuInit(0));
        let create: unsafe extern "C" fn(*mut CUcontext, *mut c_void, u32, CUdevice) -> CUresult =
            std::mem::transmute(p);
        let mut c = null_mut();
        ok(create(&mut c, null_mut(), 0, 0));
        assert_eq!(last(), "cuCtxCreate_v4");
    });
}

#[test]
fn proc_address_capped_by_driver_version() {
    isolated(
        "proc_address_capped_by_driver_version",
        &[("GPUFRAC_SIM_DRIVER_VERSION", "12040")],
        || unsafe {
            let mut v = 0;
            ok(cuDriverGetVersion(&mut v));
            assert_eq!(v, 12040);
            maps_to("cuCtxCreate", 13000, 0, "cuCtxCreate_v2");
            maps_to("cuCtxGetDevice", 13000, 0, "cuCtxGetDevice");
            maps_to("cuGetProcAddress", 13000, 0, "cuGetProcAddress_v2");
            let (r, _, st) = gpa("cuCtxGetDevice", 1000, 0);
            assert_eq!((r, st), (CUDA_ERROR_NOT_FOUND, 2));
        },
    );
}

/// With another library exporting the same names preloaded in front (like
/// the shim), cuGetProcAddress must still hand out this library's own
/// functions, i.e. exactly what dlsym on its handle returns.
#[test]
fn proc_address_is_not_interposed() {
    const NAME: &str = "proc_address_is_not_interposed";
    if std::env::var(CHILD_VAR).as_deref() != Ok(NAME) {
        let copy = scratch("preload").with_extension("so");
        std::fs::copy(lib_path(), &copy).unwrap();
        let preload = copy.to_str().unwrap().to_owned();
        isolated(NAME, &[("LD_PRELOAD", &preload)], || {});
        let _ = std::fs::remove_file(&copy);
        return;
    }
    unsafe {
        let global = libc::dlsym(libc::RTLD_DEFAULT, c"cuCtxCreate_v2".as_ptr()) as usize;
        assert_ne!(global, 0, "preloaded copy not found");
        assert_ne!(global, addr("cuCtxCreate_v2"), "preload is not in front");
        maps_to("cuCtxCreate", 13000, 0, "cuCtxCreate_v4");
        maps_to("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz");
        maps_to("cuMemAlloc", 12000, 0, "cuMemAlloc_v2");
    }
}

#[test]
fn launches_are_async_and_syncs_wait() {
    isolated(
        "launches_are_async_and_syncs_wait",
        &[("GPUFRAC_SIM_DEVICES", "1G,1G")],
        || unsafe {
            let ms = 1_000_000u64;
            let ctx0 = init_ctx(0);
            let f = function();
            let mut s = null_mut();
            ok(cuStreamCreate(&mut s, 0));
            let (mut e0, mut e1) = (null_mut(), null_mut());
            ok(cuEventCreate(&mut e0, 0));
            ok(cuEventCreate(&mut e1, 0));

            // Three 20 ms kernels on a stream.
            let t = Instant::now();
            ok(cuEventRecord(e0, s));
            for _ in 0..3 {
                ok(kernel(f, s, 20 * ms));
            }
            ok(cuEventRecord(e1, s));
            assert!(
                t.elapsed() < Duration::from_millis(20),
                "launches must not block"
            );
            check(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
            check(cuEventQuery(e1), CUDA_ERROR_NOT_READY);
            let mut el = 0f32;
            check(cuEventElapsedTime(&mut el, e0, e1), CUDA_ERROR_NOT_READY);
            ok(cuStreamSynchronize(s));
            assert!(t.elapsed() >= Duration::from_millis(60));
            ok(cuStreamQuery(s));
            ok(cuEventQuery(e1));
            ok(cuEventElapsedTime(&mut el, e0, e1));
            assert!((59.0..70.0).contains(&el), "elapsed {el} ms");

            // Event sync waits for the recorded point.
            let t = Instant::now();
            ok(kernel(f, s, 15 * ms));
            ok(cuEventRecord(e1, s));
            ok(cuEventSynchronize(e1));
            assert!(t.elapsed() >= Duration::from_millis(15));

            // Two streams of one process share the engine: 2 x 30 ms >= 60 ms.
            let mut s2 = null_mut();
            ok(cuStreamCreateWithPriority(&mut s2, 1, -1));
            let t = Instant::now();
            ok(kernel(f, s, 30 * ms));
            ok(kernel(f, s2, 30 * ms));
            ok(cuStreamSynchronize(s2));
            assert!(t.elapsed() >= Duration::from_millis(60));

            // A stream waiting on an event is not done before the event.
            ok(kernel(f, s, 20 * ms));
            ok(cuEventRecord(e1, s));
            ok(cuStreamWaitEvent(s2, e1, 0));
            check(cuStreamQuery(s2), CUDA_ERROR_NOT_READY);
            ok(cuStreamSynchronize(s2));
            ok(cuEventQuery(e1));

            // Legacy stream via cuLaunchKernelEx; context sync waits for it.
            let mut d = 20 * ms;
            let mut params = [(&mut d as *mut u64).cast::<c_void>()];
            let cfg = CUlaunchConfig {
                gridDimX: 1,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: 1,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                hStream: null_mut(),
                attrs: null_mut(),
                numAttrs: 0,
            };
            let t = Instant::now();
            ok(cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), null_mut()));
            assert_eq!(last(), "cuLaunchKernelEx");
            check(cuStreamQuery(null_mut()), CUDA_ERROR_NOT_READY);
            ok(cuCtxSynchronize());
            assert!(t.elapsed() >= Duration::from_millis(20));
            check(
                cuLaunchKernelEx(std::ptr::null(), f, null_mut(), null_mut()),
                CUDA_ERROR_INVALID_VALUE,
            );

            // Per-thread default stream (_ptsz with NULL stream).
            let t = Instant::now();
            ok(cuLaunchKernelEx_ptsz(
                &cfg,
                f,
                params.as_mut_ptr(),
                null_mut(),
            ));
            assert_eq!(last(), "cuLaunchKernelEx_ptsz");
            check(cuStreamQuery_ptsz(null_mut()), CUDA_ERROR_NOT_READY);
            ok(cuEventRecord_ptsz(e1, null_mut()));
            ok(cuStreamSynchronize_ptsz(null_mut()));
            assert_eq!(last(), "cuStreamSynchronize_ptsz");
            assert!(t.elapsed() >= Duration::from_millis(20));
            ok(cuEventQuery(e1));

            // Cooperative and graph launches go through the engine too.
            let (b0, k0) = engine(0);
            ok(cuLaunchCooperativeKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
            ));
            ok(cuLaunchCooperativeKernel_ptsz(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null_mut(),
                null_mut(),
            ));
            assert_eq!(last(), "cuLaunchCooperativeKernel_ptsz");
            let mut g = null_mut();
            ok(gpufracSimGraphCreate(&mut g, 5 * ms));
            ok(cuGraphLaunch(g, s));
            ok(cuGraphLaunch_ptsz(g, null_mut()));
            assert_eq!(last(), "cuGraphLaunch_ptsz");
            check(cuGraphLaunch(null_mut(), s), CUDA_ERROR_INVALID_HANDLE);
            // NULL params: a 0 ns kernel that still counts.
            ok(cuLaunchKernel(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                null_mut(),
                null_mut(),
            ));
            // Busy time is work executed: all of it once synchronised.
            let (b1, k1) = engine(0);
            assert!(b1 - b0 < 30 * ms, "{}", b1 - b0);
            assert_eq!(k1 - k0, 5);
            ok(cuCtxSynchronize_v2(ctx0));
            assert_eq!(engine(0).0 - b0, 30 * ms);

            // Devices have independent engines; multi-device launch.
            let mut ctx1 = null_mut();
            ok(cuCtxCreate_v2(&mut ctx1, 0, 1));
            let mut s1 = null_mut();
            ok(cuStreamCreate(&mut s1, 0));
            let mut cur = null_mut();
            ok(cuStreamGetCtx(s1, &mut cur));
            assert_eq!(cur, ctx1);
            let mut d50 = 50 * ms;
            let p = [(&mut d50 as *mut u64).cast::<c_void>()];
            let lp = |stream| CUDA_LAUNCH_PARAMS {
                function: f,
                gridDimX: 1,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: 1,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                hStream: stream,
                kernelParams: p.as_ptr() as *mut *mut c_void,
            };
            let mut list = [lp(s), lp(s1)];
            let t = Instant::now();
            ok(cuLaunchCooperativeKernelMultiDevice(
                list.as_mut_ptr(),
                2,
                0,
            ));
            ok(cuStreamSynchronize(s));
            ok(cuStreamSynchronize(s1));
            let el = t.elapsed();
            assert!(
                el >= Duration::from_millis(50) && el < Duration::from_millis(95),
                "{el:?}"
            );
            assert_eq!(engine(1).1, 1);

            // Bad handles.
            check(kernel(null_mut(), s, 0), CUDA_ERROR_INVALID_HANDLE);
            ok(cuStreamDestroy_v2(s2));
            check(kernel(f, s2, 0), CUDA_ERROR_INVALID_HANDLE);
            check(cuStreamDestroy_v2(s2), CUDA_ERROR_INVALID_HANDLE);
            ok(cuEventDestroy_v2(e0));
            check(cuEventQuery(e0), CUDA_ERROR_INVALID_HANDLE);
            ok(cuCtxDestroy_v2(ctx1));
            check(kernel(f, s1, 0), CUDA_ERROR_INVALID_CONTEXT);
            let mut m = null_mut();
            ok(cuModuleLoadData(&mut m, c"x".as_ptr().cast()));
            ok(cuModuleUnload(m));
            check(cuModuleUnload(m), CUDA_ERROR_INVALID_HANDLE);
        },
    );
}

#[test]
fn launch_cost_is_small() {
    isolated("launch_cost_is_small", &[], || unsafe {
        init_ctx(0);
        let f = function();
        let mut s = null_mut();
        ok(cuStreamCreate(&mut s, 0));
        type Launch = unsafe extern "C" fn(
            CUfunction,
            u32,
            u32,
            u32,
            u32,
            u32,
            u32,
            u32,
            CUstream,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> CUresult;
        let launch: Launch = std::mem::transmute(addr("cuLaunchKernel"));
        let n = 200_000;
        let t = Instant::now();
        for _ in 0..n {
            launch(f, 1, 1, 1, 1, 1, 1, 0, s, null_mut(), null_mut());
        }
        let per = t.elapsed() / n;
        eprintln!("cuLaunchKernel: {per:?} per launch");
        assert!(per < Duration::from_micros(2), "{per:?} per launch");
        assert_eq!(engine(0).1, n as u64);
    });
}

/// Helper process for `two_processes_serialize_kernels`.
#[test]
fn worker_process() {
    if std::env::var(CHILD_VAR).as_deref() != Ok("worker_process") {
        return;
    }
    unsafe {
        init_ctx(0);
        let f = function();
        let mut s = null_mut();
        ok(cuStreamCreate(&mut s, 0));
        // Exits without freeing: the memory must come back when it is gone.
        let mut p = 0;
        ok(cuMemAlloc_v2(&mut p, GIB));
        let mut out = std::io::stdout();
        writeln!(out, "READY {}", std::process::id()).unwrap();
        out.flush().unwrap();
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        for _ in 0..20 {
            ok(kernel(f, s, 5_000_000));
        }
        ok(cuStreamSynchronize(s));
    }
}

#[test]
fn two_processes_serialize_kernels() {
    let state = scratch("state");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        "two_processes_serialize_kernels",
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "4G"),
        ],
        || unsafe {
            init_ctx(0);
            ok(nvmlInit_v2());
            let f = function();
            let mut s = null_mut();
            ok(cuStreamCreate(&mut s, 0));
            let mut mine = 0;
            ok(cuMemAlloc_v2(&mut mine, 512 * MIB));

            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "worker_process",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_VAR, "worker_process")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let pid: u32 = loop {
                let l = lines.next().expect("worker exited early").unwrap();
                // libtest prints "test worker_process ... " before the body runs.
                if let Some(i) = l.find("READY ") {
                    break l[i + 6..].trim().parse().unwrap();
                }
            };
            // The worker's memory is visible here, to CUDA and to NVML.
            assert_eq!(used(0), (GIB + 512 * MIB) as u64);
            let (mut free, mut total) = (0, 0);
            ok(cuMemGetInfo_v2(&mut free, &mut total));
            assert_eq!(free, 4 * GIB - GIB - 512 * MIB);
            let mut big = 0;
            check(cuMemAlloc_v2(&mut big, 3 * GIB), CUDA_ERROR_OUT_OF_MEMORY);
            let mut dev = null_mut();
            ok(nvmlDeviceGetHandleByIndex_v2(0, &mut dev));
            let mut procs = [nvmlProcessInfo_t::default(); 8];
            let mut n = 8;
            ok(nvmlDeviceGetComputeRunningProcesses_v3(
                dev,
                &mut n,
                procs.as_mut_ptr(),
            ));
            let mut seen: Vec<_> = procs[..n as usize]
                .iter()
                .map(|p| (p.pid, p.usedGpuMemory))
                .collect();
            seen.sort();
            let mut want = vec![(pid, GIB as u64), (std::process::id(), 512 * MIB as u64)];
            want.sort();
            assert_eq!(seen, want);

            let (b0, k0) = engine(0);
            let t = Instant::now();
            child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
            for _ in 0..20 {
                ok(kernel(f, s, 5_000_000));
            }
            ok(cuStreamSynchronize(s));
            let st = child.wait().unwrap();
            let el = t.elapsed();
            assert!(st.success(), "worker failed");
            for _ in lines {}
            let (b1, k1) = engine(0);
            assert_eq!((k1 - k0, b1 - b0), (40, 200_000_000));
            assert!(el >= Duration::from_millis(190), "not serialized: {el:?}");

            // The worker exited without freeing: its memory is reclaimed.
            assert_eq!(used(0), 512 * MIB as u64);
            ok(cuMemAlloc_v2(&mut big, 3 * GIB));
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn nvml_agrees_with_cuda() {
    isolated(
        "nvml_agrees_with_cuda",
        &[("GPUFRAC_SIM_DEVICES", "16G,8G")],
        || unsafe {
            let mut n = 0u32;
            check(nvmlDeviceGetCount_v2(&mut n), NVML_ERROR_UNINITIALIZED);
            ok(nvmlInit_v2());
            ok(nvmlInitWithFlags(0));
            // NVML init does not initialise CUDA.
            let mut cn = 0;
            check(cuDeviceGetCount(&mut cn), CUDA_ERROR_NOT_INITIALIZED);
            ok(nvmlDeviceGetCount_v2(&mut n));
            assert_eq!(n, 2);
            init_ctx(1);
            let mut p = 0;
            ok(cuMemAlloc_v2(&mut p, GIB));

            for i in 0..2 {
                let mut dev = null_mut();
                ok(nvmlDeviceGetHandleByIndex_v2(i, &mut dev));
                let mut buf = [0 as c_char; 96];
                ok(nvmlDeviceGetUUID(dev, buf.as_mut_ptr(), 96));
                let nv_uuid = cstr_buf(&buf);
                let mut cu = CUuuid::default();
                ok(cuDeviceGetUuid_v2(&mut cu, i as c_int));
                let mut f = [0u8; 40];
                let len = format_uuid(&cu, &mut f);
                assert_eq!(nv_uuid, std::str::from_utf8(&f[..len]).unwrap());
                assert!(nv_uuid.starts_with("GPU-") && nv_uuid.len() == 40);
                check(
                    nvmlDeviceGetUUID(dev, buf.as_mut_ptr(), 40),
                    NVML_ERROR_INSUFFICIENT_SIZE,
                );
                let mut again = null_mut();
                let c = CString::new(nv_uuid).unwrap();
                ok(nvmlDeviceGetHandleByUUID(c.as_ptr(), &mut again));
                assert_eq!(again, dev);
                let mut idx = 9;
                ok(nvmlDeviceGetIndex(dev, &mut idx));
                assert_eq!(idx, i);

                ok(nvmlDeviceGetName(dev, buf.as_mut_ptr(), 96));
                let mut cbuf = [0 as c_char; 96];
                ok(cuDeviceGetName(cbuf.as_mut_ptr(), 96, i as c_int));
                assert_eq!(cstr_buf(&buf), cstr_buf(&cbuf));

                let mut total = 0;
                ok(cuDeviceTotalMem_v2(&mut total, i as c_int));
                let mut m = nvmlMemory_t::default();
                ok(nvmlDeviceGetMemoryInfo(dev, &mut m));
                let want_used = if i == 1 { GIB as u64 } else { 0 };
                assert_eq!(
                    (m.total, m.used, m.free),
                    (total as u64, want_used, total as u64 - want_used)
                );
                let mut m2 = nvmlMemory_v2_t::default();
                check(
                    nvmlDeviceGetMemoryInfo_v2(dev, &mut m2),
                    NVML_ERROR_INVALID_ARGUMENT,
                );
                m2.version = nvmlMemory_v2;
                ok(nvmlDeviceGetMemoryInfo_v2(dev, &mut m2));
                assert_eq!((m2.total, m2.used, m2.free), (m.total, m.used, m.free));
            }
            let (mut free, mut total) = (0, 0);
            ok(cuMemGetInfo_v2(&mut free, &mut total));
            assert_eq!((free, total), (7 * GIB, 8 * GIB));

            let mut bad = null_mut();
            check(
                nvmlDeviceGetHandleByIndex_v2(2, &mut bad),
                NVML_ERROR_INVALID_ARGUMENT,
            );
            check(
                nvmlDeviceGetHandleByUUID(c"GPU-nope".as_ptr(), &mut bad),
                NVML_ERROR_NOT_FOUND,
            );

            let mut dev1 = null_mut();
            ok(nvmlDeviceGetHandleByIndex_v2(1, &mut dev1));
            let mut procs = [nvmlProcessInfo_t::default(); 4];
            let mut cnt = 0;
            check(
                nvmlDeviceGetComputeRunningProcesses_v3(dev1, &mut cnt, procs.as_mut_ptr()),
                NVML_ERROR_INSUFFICIENT_SIZE,
            );
            assert_eq!(cnt, 1);
            ok(nvmlDeviceGetComputeRunningProcesses_v3(
                dev1,
                &mut cnt,
                procs.as_mut_ptr(),
            ));
            assert_eq!(
                (procs[0].pid, procs[0].usedGpuMemory),
                (std::process::id(), GIB as u64)
            );

            // Utilisation while the engine is busy.
            let f = function();
            for _ in 0..10 {
                ok(kernel(f, null_mut(), 10_000_000));
            }
            let mut u = nvmlUtilization_t::default();
            ok(nvmlDeviceGetUtilizationRates(dev1, &mut u));
            assert_eq!(u.gpu, 100);
            ok(cuCtxSynchronize());
            std::thread::sleep(Duration::from_millis(50));
            ok(nvmlDeviceGetUtilizationRates(dev1, &mut u));
            assert!((50..=100).contains(&u.gpu), "gpu {}%", u.gpu);

            let mut buf = [0 as c_char; 80];
            ok(nvmlSystemGetDriverVersion(buf.as_mut_ptr(), 80));
            assert_eq!(cstr_buf(&buf), "580.00-sim");
            let mut v = 0;
            ok(nvmlSystemGetCudaDriverVersion_v2(&mut v));
            assert_eq!(v, 13000);
            assert_eq!(
                std::ffi::CStr::from_ptr(nvmlErrorString(NVML_ERROR_UNINITIALIZED))
                    .to_str()
                    .unwrap(),
                "Uninitialized"
            );

            ok(nvmlShutdown());
            ok(nvmlShutdown());
            check(nvmlDeviceGetCount_v2(&mut n), NVML_ERROR_UNINITIALIZED);
            check(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
        },
    );
}

// ---------------------------------------------------------------------------
// The engine as a time-slicer, through real processes.

const MS: u64 = 1_000_000;
const US: u64 = 1_000;

/// Tests whose verdict rests on wall-clock latencies run one at a time.
static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn timing() -> std::sync::MutexGuard<'static, ()> {
    TIMING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Parameters a helper received on stdin after saying READY.
fn orders() -> std::collections::HashMap<String, u64> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    fields(&line)
}

fn stream() -> CUstream {
    let mut s = null_mut();
    unsafe { ok(cuStreamCreate(&mut s, 0)) };
    s
}

fn event() -> CUevent {
    let mut e = null_mut();
    unsafe { ok(cuEventCreate(&mut e, 0)) };
    e
}

fn elapsed_ms(a: CUevent, b: CUevent) -> f64 {
    let mut ms = 0f32;
    unsafe { ok(cuEventElapsedTime(&mut ms, a, b)) };
    f64::from(ms)
}

/// Helper process for the engine tests: `ROLE` on device `DEV`, the rest
/// of its orders on stdin once it has said READY.
#[test]
fn engine_helper() {
    if std::env::var(CHILD_VAR).as_deref() != Ok("engine_helper") {
        return;
    }
    let dev = param("DEV") as c_int;
    init_ctx(dev);
    let f = function();
    let s = stream();
    println!("READY");
    let o = orders();
    unsafe {
        match std::env::var("ROLE").unwrap().as_str() {
            // Keeps DEPTH kernels of KERNEL_NS queued from FROM to UNTIL;
            // reports its executed time and the device's switches between
            // START and END.
            "busy" => {
                let (kernel_ns, depth) = (o["KERNEL_NS"], o["DEPTH"] as usize);
                let (start, end) = (o["START"], o["END"]);
                let sampler = std::thread::spawn(move || {
                    sleep_until(start);
                    let (e0, s0) = (executed(dev), switches(dev));
                    sleep_until(end);
                    (executed(dev) - e0, switches(dev) - s0)
                });
                let ev: Vec<CUevent> = (0..depth).map(|_| event()).collect();
                sleep_until(o["FROM"]);
                let mut n = 0;
                while now_ns() < o["UNTIL"] {
                    if n >= depth {
                        ok(cuEventSynchronize(ev[n % depth]));
                    }
                    ok(kernel(f, s, kernel_ns));
                    ok(cuEventRecord(ev[n % depth], s));
                    if n == 0 {
                        println!("LAUNCHING");
                    }
                    n += 1;
                }
                let (ex, sw) = sampler.join().unwrap();
                println!("RESULT executed={ex} switches={sw}");
            }
            // Every PERIOD from FROM until UNTIL: BURST kernels of
            // KERNEL_NS queued at once, then a stream synchronize. Reports
            // the latencies of the bursts as the host saw them (wall_*)
            // and as the GPU did (from the events around each burst: no
            // host scheduling in them).
            "interactive" => {
                let (ea, eb) = (event(), event());
                let (mut wall, mut gpu) = (Vec::new(), Vec::new());
                let mut next = o["FROM"];
                while next + o["PERIOD"] <= o["UNTIL"] {
                    sleep_until(next);
                    let t = now_ns();
                    ok(cuEventRecord(ea, s));
                    for _ in 0..o["BURST"] {
                        ok(kernel(f, s, o["KERNEL_NS"]));
                    }
                    ok(cuEventRecord(eb, s));
                    ok(cuStreamSynchronize(s));
                    wall.push(now_ns() - t);
                    gpu.push((elapsed_ms(ea, eb) * MS as f64) as u64);
                    next += o["PERIOD"];
                }
                let pct = |v: &mut Vec<u64>, q: f64| {
                    v.sort_unstable();
                    v[((q * v.len() as f64).ceil() as usize).max(1) - 1]
                };
                println!(
                    "RESULT n={} p50={} p99={} wall_p50={} wall_p99={}",
                    gpu.len(),
                    pct(&mut gpu, 0.5),
                    pct(&mut gpu, 0.99),
                    pct(&mut wall, 0.5),
                    pct(&mut wall, 0.99),
                );
            }
            // Queues N kernels of KERNEL_NS and waits to be killed.
            "hog" => {
                for _ in 0..o["N"] {
                    ok(kernel(f, s, o["KERNEL_NS"]));
                }
                println!("QUEUED");
                orders();
            }
            // Kills itself inside the engine (gpufracSimCrashInEngine AT).
            "crash" => {
                match o["AT"] {
                    1 => {
                        ok(gpufracSimCrashInEngine(1));
                        let _ = kernel(f, s, MS);
                    }
                    _ => {
                        for _ in 0..3 {
                            ok(kernel(f, s, 6 * MS));
                        }
                        ok(gpufracSimCrashInEngine(2));
                        ok(cuStreamSynchronize(s));
                    }
                }
                println!("SURVIVED");
            }
            r => panic!("unknown role {r}"),
        }
    }
}

fn helper(role: &str, dev: c_int) -> Helper {
    let mut h = Helper::spawn(
        "engine_helper",
        &[("ROLE", role.to_owned()), ("DEV", dev.to_string())],
    );
    h.expect("READY");
    h
}

fn orders_line(kv: &[(&str, u64)]) -> String {
    kv.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn killed_by_sigkill(st: std::process::ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    st.signal() == Some(libc::SIGKILL)
}

#[test]
fn busy_processes_share_the_engine_by_time_slices() {
    const NAME: &str = "busy_processes_share_the_engine_by_time_slices";
    let _t = (std::env::var(CHILD_VAR).is_err()).then(timing);
    let state = scratch("slices");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        NAME,
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "1G"),
        ],
        || {
            let mut hs = [helper("busy", 0), helper("busy", 0)];
            let start = now_ns() + 80 * MS;
            let end = start + 1_500 * MS;
            let o = orders_line(&[
                ("KERNEL_NS", 6 * MS),
                ("DEPTH", 3),
                ("FROM", start - 50 * MS),
                ("START", start),
                ("END", end),
                ("UNTIL", end + 20 * MS),
            ]);
            for h in &mut hs {
                h.send(&o);
            }
            let res: Vec<_> = hs
                .iter_mut()
                .map(|h| fields(&h.expect("RESULT ")))
                .collect();
            for h in hs {
                assert!(h.wait().success());
            }
            let window = (end - start) as f64;
            let shares: Vec<f64> = res.iter().map(|r| r["executed"] as f64 / window).collect();
            let total: f64 = shares.iter().sum();
            // Every 2 ms slice is followed by a 0.1 ms switch.
            let per_slice = window / (2.1 * MS as f64);
            let sw = res[0]["switches"] as f64;
            eprintln!(
                "shares {shares:.3?}, together {total:.3}; {sw} switches, {per_slice:.0} slices"
            );
            for s in &shares {
                assert!((0.40..=0.52).contains(s), "share {s:.3}");
            }
            assert!((0.88..=0.97).contains(&total), "together {total:.3}");
            assert!(
                (0.9 * per_slice..=1.1 * per_slice).contains(&sw),
                "{sw} switches for {per_slice:.0} slices"
            );
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn an_interactive_process_waits_for_a_slice_not_a_queue() {
    const NAME: &str = "an_interactive_process_waits_for_a_slice_not_a_queue";
    let _t = (std::env::var(CHILD_VAR).is_err()).then(timing);
    let state = scratch("interactive");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        NAME,
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "1G,1G"),
        ],
        || {
            // Device 0: a continuous 6 ms neighbour three kernels deep and
            // the interactive process; device 1: the interactive one alone.
            let mut neighbour = helper("busy", 0);
            let mut beside = helper("interactive", 0);
            let mut alone = helper("interactive", 1);
            let t0 = now_ns() + 30 * MS;
            let (from, until) = (t0 + 40 * MS, t0 + 40 * MS + 100 * 20 * MS);
            neighbour.send(&orders_line(&[
                ("KERNEL_NS", 6 * MS),
                ("DEPTH", 3),
                ("FROM", t0),
                ("START", t0),
                ("END", t0),
                ("UNTIL", until + 20 * MS),
            ]));
            let o = orders_line(&[
                ("FROM", from),
                ("UNTIL", until),
                ("PERIOD", 20 * MS),
                ("BURST", 10),
                ("KERNEL_NS", 50 * US),
            ]);
            beside.send(&o);
            alone.send(&o);
            let b = fields(&beside.expect("RESULT "));
            let a = fields(&alone.expect("RESULT "));
            neighbour.expect("RESULT ");
            for h in [neighbour, beside, alone] {
                assert!(h.wait().success());
            }
            let ms = |v: u64| v as f64 / MS as f64;
            for (what, k) in [("GPU", ""), ("wall", "wall_")] {
                eprintln!(
                    "{what}: alone p50 {:.3} p99 {:.3} ms; beside a 6 ms neighbour p50 {:.3} p99 {:.3} ms ({} bursts)",
                    ms(a[&format!("{k}p50")]),
                    ms(a[&format!("{k}p99")]),
                    ms(b[&format!("{k}p50")]),
                    ms(b[&format!("{k}p99")]),
                    b["n"]
                );
            }
            // Alone: its 0.5 ms (the engine idles between bursts and it ran
            // last, so no switch). The events time the GPU, but a host that
            // stops the process between two of its ten launches leaves the
            // engine idle inside a burst: on a busy 2-core machine two
            // bursts in a hundred once took 1.004 ms, so the median is held
            // to the burst and the 99th to under a neighbour's slice.
            assert!(ms(a["p50"]) < 1.0, "alone p50 {:.3} ms", ms(a["p50"]));
            assert!(ms(a["p99"]) < 2.0, "alone p99 {:.3} ms", ms(a["p99"]));
            // Beside: the neighbour's slice ends first (up to 2 ms), then a
            // switch; it never waits for the neighbour's queue (18 ms).
            let extra = ms(b["p99"]) - ms(a["p99"]);
            assert!(
                (1.5..=3.5).contains(&extra),
                "p99 beside exceeds alone by {extra:.3} ms"
            );
            assert!(ms(b["p99"]) < 6.0, "p99 beside {:.3} ms", ms(b["p99"]));
            // What the host saw adds its own wake-ups, on a busy 2-core
            // machine sometimes a few ms.
            assert!(
                ms(b["wall_p99"]) > ms(a["wall_p99"]) && ms(b["wall_p99"]) < 12.0,
                "wall p99 alone {:.3} ms, beside {:.3} ms",
                ms(a["wall_p99"]),
                ms(b["wall_p99"])
            );
            assert!(b["p50"] > a["p50"]);
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn a_killed_process_work_is_dropped() {
    let state = scratch("killed");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        "a_killed_process_work_is_dropped",
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "1G"),
        ],
        || unsafe {
            init_ctx(0);
            let f = function();
            let s = stream();
            let mut hog = helper("hog", 0);
            hog.send(&orders_line(&[("N", 60), ("KERNEL_NS", 6 * MS)]));
            hog.expect("QUEUED");
            // Our 120 ms share the engine with its 360 ms...
            let t0 = now_ns();
            for _ in 0..20 {
                ok(kernel(f, s, 6 * MS));
            }
            std::thread::sleep(Duration::from_millis(40));
            let (t1, e1) = (now_ns(), executed(0));
            hog.child.kill().unwrap();
            assert!(killed_by_sigkill(hog.wait()));
            // ...until it is killed; then ours runs alone at full speed.
            let (t2, e2) = (now_ns(), executed(0));
            std::thread::sleep(Duration::from_millis(40));
            let (t3, e3) = (now_ns(), executed(0));
            let before = e1 as f64 / (t1 - t0) as f64;
            let after = (e3 - e2) as f64 / (t3 - t2) as f64;
            eprintln!("share before the kill {before:.3}, after {after:.3}");
            assert!((0.35..=0.6).contains(&before), "before {before:.3}");
            assert!(after >= 0.95, "after {after:.3}");
            ok(cuStreamSynchronize(s));
            assert_eq!(executed(0), 120 * MS);
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn a_process_killed_inside_the_engine_does_not_wedge_it() {
    let state = scratch("crash");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        "a_process_killed_inside_the_engine_does_not_wedge_it",
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "1G"),
        ],
        || unsafe {
            init_ctx(0);
            let f = function();
            let s = stream();

            // Killed right after taking the device lock.
            let mut h = helper("crash", 0);
            h.send("AT=1");
            assert!(killed_by_sigkill(h.wait()), "no crash");
            let t = now_ns();
            for _ in 0..3 {
                ok(kernel(f, s, 6 * MS));
            }
            ok(cuStreamSynchronize(s));
            let el = now_ns() - t;
            assert!(el < 18 * MS + 5 * MS, "{} ms", el / MS);
            assert_eq!(executed(0), 18 * MS);

            // Killed while ours runs, after writing a scheduling event
            // (ours preempted for it) but before committing it.
            let mut h = helper("crash", 0);
            let (b0, e0) = (engine(0).0, executed(0));
            let t = now_ns();
            for _ in 0..10 {
                ok(kernel(f, s, 6 * MS));
            }
            h.send("AT=2");
            assert!(killed_by_sigkill(h.wait()), "no crash");
            ok(cuStreamSynchronize(s));
            let el = now_ns() - t;
            let busy = engine(0).0 - b0;
            eprintln!(
                "60 ms of ours took {:.3} ms; the engine ran {:.3} ms",
                el as f64 / MS as f64,
                busy as f64 / MS as f64
            );
            assert_eq!(executed(0) - e0, 60 * MS);
            assert!(el < 60 * MS + 8 * MS, "{} ms", el / MS);
            assert!((60 * MS..60 * MS + 5 * MS).contains(&busy), "{busy}");
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn event_elapsed_time_spans_preemption_exactly() {
    const NAME: &str = "event_elapsed_time_spans_preemption_exactly";
    let _t = (std::env::var(CHILD_VAR).is_err()).then(timing);
    let state = scratch("elapsed");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        NAME,
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "1G"),
        ],
        || unsafe {
            init_ctx(0);
            let f = function();
            let s = stream();
            let (e0, e1) = (event(), event());
            let mut neighbour = helper("busy", 0);
            let t0 = now_ns();
            neighbour.send(&orders_line(&[
                ("KERNEL_NS", 6 * MS),
                ("DEPTH", 3),
                ("FROM", t0),
                ("START", t0),
                ("END", t0),
                ("UNTIL", t0 + 700 * MS),
            ]));
            neighbour.expect("LAUNCHING");
            std::thread::sleep(Duration::from_millis(10));

            let before = executed(0);
            let t_a = now_ns();
            ok(cuEventRecord(e0, s));
            for _ in 0..3 {
                ok(kernel(f, s, 6 * MS));
            }
            ok(cuEventRecord(e1, s));
            ok(cuEventSynchronize(e1));
            let wall = (now_ns() - t_a) as f64 / MS as f64;
            let el = elapsed_ms(e0, e1);
            eprintln!("18 ms of work beside a neighbour: events {el:.3} ms, wall {wall:.3} ms");
            assert_eq!(executed(0) - before, 18 * MS);
            // The schedule: up to one slice of the neighbour's and a switch
            // first, then 9 slices of ours with 8 of the neighbour's and 16
            // switches between them: 35.7 to 37.7 ms.
            assert!((35.6..=37.8).contains(&el), "elapsed {el:.3} ms");
            // Within what the host saw, less its own wake-up latency.
            assert!(
                (0.0..5.0).contains(&(wall - el)),
                "elapsed {el:.3} ms, wall {wall:.3} ms"
            );

            // An event recorded behind pending work and asked about only
            // after far more runs than the engine keeps per context.
            let es = event();
            let t_s = now_ns();
            ok(cuEventRecord(es, s));
            for _ in 0..3 {
                ok(kernel(f, s, 6 * MS));
            }
            ok(cuEventRecord(e0, s));
            for _ in 0..30 {
                ok(kernel(f, s, 6 * MS));
            }
            ok(cuEventRecord(e1, s));
            ok(cuEventSynchronize(e1));
            let wall = (now_ns() - t_s) as f64 / MS as f64;
            let (first, all) = (elapsed_ms(es, e0), elapsed_ms(es, e1));
            eprintln!(
                "then 18 ms of 198 after {first:.3} ms, all after {all:.3} ms, wall {wall:.3} ms"
            );
            assert!(
                (35.6..=37.8).contains(&first),
                "first 18 ms in {first:.3} ms"
            );
            assert!(
                (0.0..5.0).contains(&(wall - all)),
                "{all:.3} vs {wall:.3} ms"
            );
            neighbour.expect("RESULT ");
            assert!(neighbour.wait().success());
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn contexts_of_one_process_are_time_sliced_too() {
    isolated(
        "contexts_of_one_process_are_time_sliced_too",
        &[
            ("GPUFRAC_SIM_QUANTUM_US", "5000"),
            ("GPUFRAC_SIM_SWITCH_US", "1000"),
        ],
        || unsafe {
            let a = init_ctx(0);
            let f = function();
            let mut b = null_mut();
            ok(cuCtxCreate_v2(&mut b, 0, 0));
            let events = |c| {
                ok(cuCtxSetCurrent(c));
                (event(), event())
            };
            let ((a0, a1), (b0, b1)) = (events(a), events(b));
            let sw0 = switches(0);
            let t = now_ns();
            for (c, e0, e1) in [(a, a0, a1), (b, b0, b1)] {
                ok(cuCtxSetCurrent(c));
                ok(cuEventRecord(e0, null_mut()));
                ok(kernel(f, null_mut(), 20 * MS));
                ok(cuEventRecord(e1, null_mut()));
            }
            ok(cuCtxSynchronize_v2(a));
            ok(cuCtxSynchronize_v2(b));
            assert!(now_ns() - t >= 48 * MS);
            // A: switch (the first load), 5 ms; B: switch, 5; A ... A ends
            // after its fourth slice at 42 ms, B after its fourth at 48.
            let (ea, eb) = (elapsed_ms(a0, a1), elapsed_ms(b0, b1));
            assert!((ea - 42.0).abs() < 0.3, "A {ea:.3} ms");
            assert!((eb - 48.0).abs() < 0.3, "B {eb:.3} ms");
            assert_eq!(switches(0) - sw0, 8);
            assert_eq!(executed(0), 40 * MS);
            // Destroying a context keeps what it executed on the books.
            ok(cuCtxDestroy_v2(b));
            assert_eq!(executed(0), 40 * MS);
        },
    );
}

#[test]
fn bad_engine_settings_fail_init() {
    isolated(
        "bad_engine_settings_fail_init",
        &[("GPUFRAC_SIM_QUANTUM_US", "0")],
        || unsafe {
            check(cuInit(0), CUDA_ERROR_UNKNOWN);
        },
    );
}

/// Helper process for `nvml_samples_the_processes_whose_kernels_ran`:
/// runs 20 ms of kernels on device 0 when told, says so, and stays alive
/// until its stdin closes.
#[test]
fn nvml_worker() {
    if std::env::var(CHILD_VAR).as_deref() != Ok("nvml_worker") {
        return;
    }
    unsafe {
        init_ctx(0);
        let f = function();
        let s = stream();
        println!("READY {}", std::process::id());
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        for _ in 0..4 {
            ok(kernel(f, s, 5_000_000));
        }
        ok(cuStreamSynchronize(s));
        println!("RAN");
        let _ = std::io::stdin().read_line(&mut line);
    }
}

/// A process's utilisation is how busy it kept the GPU, however many
/// pieces its work ran in: one that runs 1 ms kernels with a gap after
/// each (more runs than the engine keeps) is about half busy, not the
/// few percent its last runs alone would say.
#[test]
fn nvml_utilisation_counts_a_busy_process_in_many_runs() {
    let state = scratch("state");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        "nvml_utilisation_counts_a_busy_process_in_many_runs",
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "4G"),
        ],
        || unsafe {
            ok(nvmlInit_v2());
            let mut dev = null_mut();
            ok(nvmlDeviceGetHandleByIndex_v2(0, &mut dev));
            init_ctx(0);
            let (f, s) = (function(), stream());
            let t0 = now_ns() / 1000;
            for _ in 0..64 {
                ok(kernel(f, s, 1_000_000));
                ok(cuStreamSynchronize(s));
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let mut v = vec![nvmlProcessUtilizationSample_t::default(); 4];
            let mut n = 4;
            ok(nvmlDeviceGetProcessUtilization(
                dev,
                v.as_mut_ptr(),
                &mut n,
                t0,
            ));
            assert_eq!(n, 1, "{v:?}");
            let pct = v[0].smUtil;
            assert!(
                (25..=75).contains(&pct),
                "a process busy half the time: {pct}%"
            );
        },
    );
    let _ = std::fs::remove_file(&state);
}

/// `nvmlDeviceGetProcessUtilization` as NVIDIA documents it: a sample per
/// process whose kernels ran since `lastSeenTimeStamp` (µs), none for one
/// that did not, NVML_ERROR_INSUFFICIENT_SIZE with the count for a NULL or
/// short buffer, NVML_ERROR_NOT_FOUND when no process ran. The broker
/// takes a holder's work from it.
#[test]
fn nvml_samples_the_processes_whose_kernels_ran() {
    let state = scratch("state");
    let state_s = state.to_str().unwrap().to_owned();
    isolated(
        "nvml_samples_the_processes_whose_kernels_ran",
        &[
            ("GPUFRAC_SIM_STATE", &state_s),
            ("GPUFRAC_SIM_DEVICES", "4G,4G"),
        ],
        || unsafe {
            ok(nvmlInit_v2());
            let (mut dev0, mut dev1) = (null_mut(), null_mut());
            ok(nvmlDeviceGetHandleByIndex_v2(0, &mut dev0));
            ok(nvmlDeviceGetHandleByIndex_v2(1, &mut dev1));
            let sample = |dev, last_seen| {
                let mut n = 0;
                let r = nvmlDeviceGetProcessUtilization(dev, null_mut(), &mut n, last_seen);
                if r == NVML_ERROR_NOT_FOUND {
                    return Vec::new();
                }
                check(r, NVML_ERROR_INSUFFICIENT_SIZE);
                assert!(n > 0);
                let mut v = vec![nvmlProcessUtilizationSample_t::default(); n as usize];
                if n > 1 {
                    // One short: the count needed, nothing else.
                    let mut short = n - 1;
                    check(
                        nvmlDeviceGetProcessUtilization(dev, v.as_mut_ptr(), &mut short, last_seen),
                        NVML_ERROR_INSUFFICIENT_SIZE,
                    );
                    assert_eq!(short, n);
                }
                ok(nvmlDeviceGetProcessUtilization(
                    dev,
                    v.as_mut_ptr(),
                    &mut n,
                    last_seen,
                ));
                v.truncate(n as usize);
                v
            };
            let mut n = 0;
            check(
                nvmlDeviceGetProcessUtilization(dev0, null_mut(), null_mut(), 0),
                NVML_ERROR_INVALID_ARGUMENT,
            );
            check(
                nvmlDeviceGetProcessUtilization(dev0, null_mut(), &mut n, 0),
                NVML_ERROR_NOT_FOUND,
            );

            // This process runs 10 ms of kernels on device 0.
            init_ctx(0);
            let f = function();
            let s = stream();
            let t0 = now_ns() / 1000;
            for _ in 0..2 {
                ok(kernel(f, s, 5_000_000));
            }
            ok(cuStreamSynchronize(s));
            let me = std::process::id();
            let mine = sample(dev0, 0);
            assert_eq!(mine.len(), 1, "{mine:?}");
            assert_eq!(mine[0].pid, me);
            assert!(mine[0].timeStamp > t0 + 9_000, "{mine:?} from {t0}");
            assert!(mine[0].smUtil >= 1);
            assert!(sample(dev1, 0).is_empty(), "nothing ran on device 1");
            // Since that sample: nothing ran.
            let seen = mine[0].timeStamp;
            assert!(sample(dev0, seen).is_empty());

            // Another process runs 20 ms: only it is sampled since.
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args(["nvml_worker", "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_VAR, "nvml_worker")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let mut until = |what: &str| loop {
                let l = lines.next().expect("the worker exited early").unwrap();
                if let Some(i) = l.find(what) {
                    break l[i + what.len()..].trim().to_owned();
                }
            };
            let pid: u32 = until("READY ").parse().unwrap();
            child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
            until("RAN");
            let theirs = sample(dev0, seen);
            assert_eq!(
                theirs.iter().map(|x| x.pid).collect::<Vec<_>>(),
                [pid],
                "{theirs:?}"
            );
            // Both, from the start of the buffer.
            let mut both: Vec<u32> = sample(dev0, 0).iter().map(|x| x.pid).collect();
            both.sort_unstable();
            let mut want = vec![me, pid];
            want.sort_unstable();
            assert_eq!(both, want);
            drop(child.stdin.take());
            assert!(child.wait().unwrap().success());
        },
    );
    let _ = std::fs::remove_file(&state);
}
