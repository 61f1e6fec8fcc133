//! Loads the built simulator with `dlopen` and runs each test in a fresh
//! process, because the library reads its configuration once per process.
#![allow(
    dead_code,
    non_snake_case,
    non_camel_case_types,
    clippy::too_many_arguments
)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libloading::Library;

pub use gpufrac_common::cuda::*;

pub const CHILD_VAR: &str = "GPUFRAC_SIM_TEST_CHILD";

/// `<target>/<profile>/libgpufrac_sim.so`, built on demand.
pub fn lib_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary lives in <target>/<profile>/deps");
        let p = profile_dir.join("libgpufrac_sim.so");
        // `cargo test` does not (re)build a cdylib-only library for its
        // integration tests, so the parent test process builds it once;
        // children (which run in parallel) only load it.
        if std::env::var_os(CHILD_VAR).is_none() || !p.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "-p", "gpufrac-sim"]);
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            cmd.arg("--quiet");
            let st = cmd.status().expect("run cargo build");
            assert!(st.success(), "cargo build -p gpufrac-sim failed");
        }
        assert!(p.exists(), "{} not found", p.display());
        p
    })
    .clone()
}

pub fn lib() -> &'static Library {
    static L: OnceLock<Library> = OnceLock::new();
    // SAFETY: the simulator has no unsound initialisers.
    L.get_or_init(|| unsafe { Library::new(lib_path()) }.expect("dlopen simulator"))
}

/// The address `dlsym` gives for `name` in the simulator.
pub fn addr(name: &str) -> usize {
    let n = format!("{name}\0");
    // SAFETY: only the address is taken.
    let s: libloading::Symbol<*mut c_void> =
        unsafe { lib().get(n.as_bytes()) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    *s as usize
}

/// Runs `body` in a child process (this test binary, filtered to `name`)
/// with `env` set, so every test gets a freshly configured simulator.
pub fn isolated(name: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    if std::env::var(CHILD_VAR).as_deref() == Ok(name) {
        body();
        return;
    }
    lib_path();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, name);
    for v in [
        "GPUFRAC_SIM_DEVICES",
        "GPUFRAC_SIM_STATE",
        "GPUFRAC_SIM_DRIVER_VERSION",
        "GPUFRAC_SIM_QUANTUM_US",
        "GPUFRAC_SIM_SWITCH_US",
        "LD_PRELOAD",
        "CUDA_VISIBLE_DEVICES",
    ] {
        cmd.env_remove(v);
    }
    cmd.envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn test child");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait test child") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    assert!(
        status.is_some_and(|s| s.success()) && stdout.contains("1 passed"),
        "child {name} failed ({status:?}; None = killed after {CHILD_TIMEOUT:?}):\n\
         --- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
}

const CHILD_TIMEOUT: Duration = Duration::from_secs(30);

/// A per-test scratch path.
pub fn scratch(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!("gpufrac-sim-{tag}-{}-{nanos}", std::process::id()))
}

macro_rules! api {
    ($(fn $name:ident($($a:ident: $t:ty),* $(,)?) -> $r:ty;)*) => {$(
        pub unsafe fn $name($($a: $t),*) -> $r {
            let f: libloading::Symbol<unsafe extern "C" fn($($t),*) -> $r> =
                unsafe { lib().get(concat!(stringify!($name), "\0").as_bytes()) }
                    .expect(stringify!($name));
            unsafe { f($($a),*) }
        }
    )*};
}

api! {
    fn cuInit(flags: c_uint) -> CUresult;
    fn cuDriverGetVersion(v: *mut c_int) -> CUresult;
    fn cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult;
    fn cuDeviceGetCount(n: *mut c_int) -> CUresult;
    fn cuDeviceGetName(buf: *mut c_char, len: c_int, d: CUdevice) -> CUresult;
    fn cuDeviceGetUuid(u: *mut CUuuid, d: CUdevice) -> CUresult;
    fn cuDeviceGetUuid_v2(u: *mut CUuuid, d: CUdevice) -> CUresult;
    fn cuDeviceTotalMem_v2(b: *mut usize, d: CUdevice) -> CUresult;
    fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, d: CUdevice) -> CUresult;
    fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, d: CUdevice) -> CUresult;
    fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult;
    fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult;

    fn cuCtxCreate_v2(c: *mut CUcontext, flags: c_uint, d: CUdevice) -> CUresult;
    fn cuCtxCreate_v3(c: *mut CUcontext, p: *mut c_void, n: c_int, flags: c_uint, d: CUdevice) -> CUresult;
    fn cuCtxCreate_v4(c: *mut CUcontext, p: *mut c_void, flags: c_uint, d: CUdevice) -> CUresult;
    fn cuCtxDestroy_v2(c: CUcontext) -> CUresult;
    fn cuCtxSetCurrent(c: CUcontext) -> CUresult;
    fn cuCtxGetCurrent(c: *mut CUcontext) -> CUresult;
    fn cuCtxPushCurrent_v2(c: CUcontext) -> CUresult;
    fn cuCtxPopCurrent_v2(c: *mut CUcontext) -> CUresult;
    fn cuCtxGetDevice(d: *mut CUdevice) -> CUresult;
    fn cuCtxGetDevice_v2(d: *mut CUdevice, c: CUcontext) -> CUresult;
    fn cuCtxSynchronize() -> CUresult;
    fn cuCtxSynchronize_v2(c: CUcontext) -> CUresult;
    fn cuDevicePrimaryCtxRetain(c: *mut CUcontext, d: CUdevice) -> CUresult;
    fn cuDevicePrimaryCtxRelease_v2(d: CUdevice) -> CUresult;
    fn cuDevicePrimaryCtxReset_v2(d: CUdevice) -> CUresult;
    fn cuDevicePrimaryCtxGetState(d: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult;
    fn cuDevicePrimaryCtxSetFlags_v2(d: CUdevice, flags: c_uint) -> CUresult;
    fn cuStreamGetCtx(s: CUstream, c: *mut CUcontext) -> CUresult;

    fn cuMemAlloc_v2(p: *mut CUdeviceptr, n: usize) -> CUresult;
    fn cuMemFree_v2(p: CUdeviceptr) -> CUresult;
    fn cuMemAllocPitch_v2(p: *mut CUdeviceptr, pitch: *mut usize, w: usize, h: usize, elem: c_uint) -> CUresult;
    fn cuMemAllocManaged(p: *mut CUdeviceptr, n: usize, flags: c_uint) -> CUresult;
    fn cuMemAllocAsync(p: *mut CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    fn cuMemAllocAsync_ptsz(p: *mut CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    fn cuMemFreeAsync(p: CUdeviceptr, s: CUstream) -> CUresult;
    fn cuMemFreeAsync_ptsz(p: CUdeviceptr, s: CUstream) -> CUresult;
    fn cuMemAllocFromPoolAsync(p: *mut CUdeviceptr, n: usize, pool: CUmemoryPool, s: CUstream) -> CUresult;
    fn cuMemAllocFromPoolAsync_ptsz(p: *mut CUdeviceptr, n: usize, pool: CUmemoryPool, s: CUstream) -> CUresult;
    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, d: CUdevice) -> CUresult;
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const c_void) -> CUresult;
    fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult;
    fn cuMemCreate(h: *mut CUmemGenericAllocationHandle, n: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult;
    fn cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult;
    fn cuMemAddressReserve(p: *mut CUdeviceptr, n: usize, align: usize, addr: CUdeviceptr, flags: u64) -> CUresult;
    fn cuMemAddressFree(p: CUdeviceptr, n: usize) -> CUresult;
    fn cuMemMap(p: CUdeviceptr, n: usize, off: usize, h: CUmemGenericAllocationHandle, flags: u64) -> CUresult;
    fn cuMemUnmap(p: CUdeviceptr, n: usize) -> CUresult;
    fn cuMemSetAccess(p: CUdeviceptr, n: usize, desc: *const c_void, count: usize) -> CUresult;
    fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, opt: c_int) -> CUresult;
    fn cuArrayCreate_v2(a: *mut CUarray, d: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
    fn cuArray3DCreate_v2(a: *mut CUarray, d: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
    fn cuArrayDestroy(a: CUarray) -> CUresult;
    fn cuMipmappedArrayCreate(a: *mut CUmipmappedArray, d: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> CUresult;
    fn cuMipmappedArrayDestroy(a: CUmipmappedArray) -> CUresult;
    fn cuArrayGetMemoryRequirements(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUarray, d: CUdevice) -> CUresult;
    fn cuMipmappedArrayGetMemoryRequirements(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUmipmappedArray, d: CUdevice) -> CUresult;
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult;
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult;
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult;
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult;
    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) -> CUresult;
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult;
    fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CUresult;
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) -> CUresult;
    fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult;
    fn cuMemHostAlloc(p: *mut *mut c_void, n: usize, flags: c_uint) -> CUresult;
    fn cuMemAllocHost_v2(p: *mut *mut c_void, n: usize) -> CUresult;
    fn cuMemFreeHost(p: *mut c_void) -> CUresult;

    fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> CUresult;
    fn cuModuleUnload(m: CUmodule) -> CUresult;
    fn cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) -> CUresult;
    fn cuStreamCreate(s: *mut CUstream, flags: c_uint) -> CUresult;
    fn cuStreamCreateWithPriority(s: *mut CUstream, flags: c_uint, prio: c_int) -> CUresult;
    fn cuStreamDestroy_v2(s: CUstream) -> CUresult;
    fn cuStreamSynchronize(s: CUstream) -> CUresult;
    fn cuStreamSynchronize_ptsz(s: CUstream) -> CUresult;
    fn cuStreamQuery(s: CUstream) -> CUresult;
    fn cuStreamQuery_ptsz(s: CUstream) -> CUresult;
    fn cuEventCreate(e: *mut CUevent, flags: c_uint) -> CUresult;
    fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult;
    fn cuEventRecord_ptsz(e: CUevent, s: CUstream) -> CUresult;
    fn cuEventSynchronize(e: CUevent) -> CUresult;
    fn cuEventQuery(e: CUevent) -> CUresult;
    fn cuEventElapsedTime(ms: *mut f32, a: CUevent, b: CUevent) -> CUresult;
    fn cuEventDestroy_v2(e: CUevent) -> CUresult;
    fn cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) -> CUresult;

    fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
        shared: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
        shared: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
    fn cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
    fn cuLaunchKernelEx_ptsz(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
        shared: c_uint, s: CUstream, params: *mut *mut c_void) -> CUresult;
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
        shared: c_uint, s: CUstream, params: *mut *mut c_void) -> CUresult;
    fn cuLaunchCooperativeKernelMultiDevice(l: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) -> CUresult;
    fn cuGraphLaunch(g: CUgraphExec, s: CUstream) -> CUresult;
    fn cuGraphLaunch_ptsz(g: CUgraphExec, s: CUstream) -> CUresult;

    fn cuGetProcAddress(sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64) -> CUresult;
    fn cuGetProcAddress_v2(sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64, status: *mut c_int) -> CUresult;

    fn gpufracSimGraphCreate(g: *mut CUgraphExec, ns: u64) -> CUresult;
    fn gpufracSimLastVariant() -> *const c_char;
    fn gpufracSimEngineStats(d: c_int, busy: *mut u64, kernels: *mut u64) -> CUresult;
    fn gpufracSimDeviceUsed(d: c_int, used: *mut u64) -> CUresult;
    fn gpufracSimExecutedNs(d: c_int) -> u64;
    fn gpufracSimSwitches(d: c_int) -> u64;
    fn gpufracSimCrashInEngine(at: c_int) -> CUresult;

    fn nvmlInit_v2() -> nvmlReturn_t;
    fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t;
    fn nvmlShutdown() -> nvmlReturn_t;
    fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, d: *mut nvmlDevice_t) -> nvmlReturn_t;
    fn nvmlDeviceGetHandleByUUID(u: *const c_char, d: *mut nvmlDevice_t) -> nvmlReturn_t;
    fn nvmlDeviceGetUUID(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetName(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetIndex(d: nvmlDevice_t, i: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetMemoryInfo(d: nvmlDevice_t, m: *mut nvmlMemory_t) -> nvmlReturn_t;
    fn nvmlDeviceGetMemoryInfo_v2(d: nvmlDevice_t, m: *mut nvmlMemory_v2_t) -> nvmlReturn_t;
    fn nvmlDeviceGetUtilizationRates(d: nvmlDevice_t, u: *mut nvmlUtilization_t) -> nvmlReturn_t;
    fn nvmlDeviceGetComputeRunningProcesses_v3(d: nvmlDevice_t, n: *mut c_uint, p: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    fn nvmlDeviceGetProcessUtilization(d: nvmlDevice_t, s: *mut nvmlProcessUtilizationSample_t, n: *mut c_uint, last_seen: u64) -> nvmlReturn_t;
    fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> nvmlReturn_t;
    fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t;
    fn nvmlErrorString(r: nvmlReturn_t) -> *const c_char;

    fn nvmlDeviceGetMigMode(d: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstanceProfileInfo(d: nvmlDevice_t, profile: c_uint, info: *mut nvmlGpuInstanceProfileInfo_t) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstanceProfileInfoV(d: nvmlDevice_t, profile: c_uint, info: *mut nvmlGpuInstanceProfileInfo_v2_t) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(d: nvmlDevice_t, profile_id: c_uint, p: *mut nvmlGpuInstancePlacement_t, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstanceRemainingCapacity(d: nvmlDevice_t, profile_id: c_uint, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceCreateGpuInstance(d: nvmlDevice_t, profile_id: c_uint, gi: *mut nvmlGpuInstance_t) -> nvmlReturn_t;
    fn nvmlDeviceCreateGpuInstanceWithPlacement(d: nvmlDevice_t, profile_id: c_uint, p: *const nvmlGpuInstancePlacement_t, gi: *mut nvmlGpuInstance_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstances(d: nvmlDevice_t, profile_id: c_uint, gis: *mut nvmlGpuInstance_t, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstanceById(d: nvmlDevice_t, id: c_uint, gi: *mut nvmlGpuInstance_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceGetInfo(gi: nvmlGpuInstance_t, info: *mut nvmlGpuInstanceInfo_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(gi: nvmlGpuInstance_t, profile: c_uint, eng: c_uint, info: *mut nvmlComputeInstanceProfileInfo_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi: nvmlGpuInstance_t, profile: c_uint, eng: c_uint, info: *mut nvmlComputeInstanceProfileInfo_v2_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi: nvmlGpuInstance_t, profile_id: c_uint, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlGpuInstanceCreateComputeInstance(gi: nvmlGpuInstance_t, profile_id: c_uint, ci: *mut nvmlComputeInstance_t) -> nvmlReturn_t;
    fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) -> nvmlReturn_t;
    fn nvmlGpuInstanceGetComputeInstances(gi: nvmlGpuInstance_t, profile_id: c_uint, cis: *mut nvmlComputeInstance_t, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlComputeInstanceGetInfo_v2(ci: nvmlComputeInstance_t, info: *mut nvmlComputeInstanceInfo_t) -> nvmlReturn_t;
    fn nvmlDeviceIsMigDeviceHandle(d: nvmlDevice_t, is_mig: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetGpuInstanceId(d: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetComputeInstanceId(d: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetMaxMigDeviceCount(d: nvmlDevice_t, n: *mut c_uint) -> nvmlReturn_t;
    fn nvmlDeviceGetMigDeviceHandleByIndex(d: nvmlDevice_t, i: c_uint, mig: *mut nvmlDevice_t) -> nvmlReturn_t;
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig: nvmlDevice_t, d: *mut nvmlDevice_t) -> nvmlReturn_t;
}

pub fn last() -> String {
    // SAFETY: returns a static C string.
    unsafe { CStr::from_ptr(gpufracSimLastVariant()) }
        .to_string_lossy()
        .into_owned()
}

pub fn cstr_buf(buf: &[c_char]) -> String {
    // SAFETY: the buffer was NUL-terminated by the callee.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Panics with the code's name unless it is `expected`.
#[track_caller]
pub fn check(r: u32, expected: u32) {
    assert_eq!(r, expected, "got CUresult {r}, expected {expected}");
}

#[track_caller]
pub fn ok(r: u32) {
    check(r, CUDA_SUCCESS);
}

pub fn init_ctx(dev: CUdevice) -> CUcontext {
    let mut c = std::ptr::null_mut();
    unsafe {
        ok(cuInit(0));
        ok(cuCtxCreate_v2(&mut c, 0, dev));
    }
    c
}

pub fn used(dev: c_int) -> u64 {
    let mut u = 0;
    unsafe { ok(gpufracSimDeviceUsed(dev, &mut u)) };
    u
}

pub fn engine(dev: c_int) -> (u64, u64) {
    let (mut b, mut k) = (0, 0);
    unsafe { ok(gpufracSimEngineStats(dev, &mut b, &mut k)) };
    (b, k)
}

/// A fake kernel function handle.
pub fn function() -> CUfunction {
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        ok(cuModuleLoadData(&mut m, c"fake image".as_ptr().cast()));
        ok(cuModuleGetFunction(&mut f, m, c"kernel".as_ptr()));
    }
    f
}

/// Launches one kernel of `ns` nanoseconds with cuLaunchKernel.
pub fn kernel(f: CUfunction, s: CUstream, ns: u64) -> CUresult {
    let mut d = ns;
    let mut params = [(&mut d as *mut u64).cast::<c_void>()];
    unsafe {
        cuLaunchKernel(
            f,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

pub const MIB: usize = 1 << 20;
pub const GIB: usize = 1 << 30;

pub fn device_prop(dev: c_int) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: 1, // CU_MEM_ALLOCATION_TYPE_PINNED
        requestedHandleTypes: 0,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: Default::default(),
    }
}

pub fn executed(dev: c_int) -> u64 {
    unsafe { gpufracSimExecutedNs(dev) }
}

pub fn switches(dev: c_int) -> u64 {
    unsafe { gpufracSimSwitches(dev) }
}

#[allow(unused_imports)] // not every test binary times things
pub use gpufrac_common::clock::{mono_ns as now_ns, sleep_until};

/// A helper process: this test binary running the test `name` (which acts
/// on `env`), its stdin and stdout piped.
pub struct Helper {
    pub child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Helper {
    /// Starts `name` with `env` on top of this process's environment.
    pub fn spawn(name: &str, env: &[(&str, String)]) -> Helper {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_VAR, name)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn helper");
        let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
        Helper { child, lines }
    }

    /// The rest of the first line that contains `tag` (libtest prints
    /// "test name ... " in front of what the body prints first).
    pub fn expect(&mut self, tag: &str) -> String {
        loop {
            let l = self
                .lines
                .next()
                .unwrap_or_else(|| panic!("helper exited before {tag:?}"))
                .unwrap();
            if let Some(i) = l.find(tag) {
                return l[i + tag.len()..].trim().to_owned();
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    pub fn wait(mut self) -> std::process::ExitStatus {
        for _ in self.lines.by_ref() {}
        self.child.wait().unwrap()
    }
}

/// `key=value` pairs of a line, as numbers.
pub fn fields(line: &str) -> std::collections::HashMap<String, u64> {
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.parse().unwrap()))
        .collect()
}

/// A number from this helper's environment.
pub fn param(name: &str) -> u64 {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} not set"))
        .parse()
        .unwrap()
}
