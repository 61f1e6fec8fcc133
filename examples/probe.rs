//! Test program that drives the CUDA driver API the way real applications
//! find it, so tests can run it under LD_PRELOAD=libgpufrac.so.
//!
//! Lookup paths (`--lookup`):
//! - `cudart`: dlopen("libcuda.so.1") + dlsym("cuGetProcAddress_v2"), then
//!   every entry point by base name and `--cuda-version` (what cudart ≥ 12
//!   does);
//! - `dlsym`: dlopen + dlsym of each versioned symbol (what cudarc, ctypes
//!   and older cudart do).
//!
//! Steps run in order and each prints one line `step key=value …`
//! (`window` prints its line when the probe ends).
//! Sizes accept K/M/G suffixes (binary).

// The f! macro transmutes inside its own unsafe block and is also used inside
// unsafe expressions.
#![allow(unused_unsafe)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::Mutex;

type R = u32;
type GetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;

struct Cuda {
    lib: *mut c_void,
    gpa: Option<GetProcAddress>,
    version: i32,
    ptsz: bool,
}

unsafe impl Sync for Cuda {}
unsafe impl Send for Cuda {}

impl Cuda {
    fn open(lookup: &str, version: i32, ptsz: bool) -> Cuda {
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        assert!(!lib.is_null(), "dlopen libcuda.so.1 failed");
        let gpa = if lookup == "cudart" {
            let p = unsafe { libc::dlsym(lib, c"cuGetProcAddress_v2".as_ptr()) };
            assert!(!p.is_null(), "no cuGetProcAddress_v2");
            Some(unsafe { std::mem::transmute::<*mut c_void, GetProcAddress>(p) })
        } else {
            None
        };
        Cuda {
            lib,
            gpa,
            version,
            ptsz,
        }
    }

    /// Looks up `base` (cudart path) or `versioned` (dlsym path).
    fn sym(&self, base: &str, versioned: &str) -> *mut c_void {
        match self.gpa {
            Some(gpa) => {
                let name = CString::new(base).unwrap();
                let mut p = std::ptr::null_mut();
                let mut status = 0;
                let flags = if self.ptsz { 2 } else { 0 };
                let rc = unsafe { gpa(name.as_ptr(), &mut p, self.version, flags, &mut status) };
                assert!(
                    rc == 0 && !p.is_null(),
                    "cuGetProcAddress_v2({base}) = {rc}"
                );
                p
            }
            None => {
                let name = CString::new(versioned).unwrap();
                let p = unsafe { libc::dlsym(self.lib, name.as_ptr()) };
                assert!(!p.is_null(), "dlsym({versioned}) failed");
                p
            }
        }
    }
}

macro_rules! f {
    ($cuda:expr, $base:literal, $ver:expr, fn($($t:ty),* $(,)?)) => {{
        let p = $cuda.sym($base, $ver);
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> R>(p) }
    }};
}

fn ptsz_name(c: &Cuda, plain: &'static str, ptsz: &'static str) -> &'static str {
    if c.ptsz { ptsz } else { plain }
}

/// A size argument as `GPU_MEM_LIMIT` spells one ("4M", "1.5G", "512").
fn parse_size(s: &str) -> usize {
    gpufrac_common::size::parse_size(s).unwrap_or_else(|e| panic!("size {s:?}: {e}")) as usize
}

#[derive(Clone, Copy)]
enum Held {
    Ptr(u64),
    AsyncPtr(u64),
    Vmm(u64),
    /// A VMM allocation mapped at this address and released at once (the
    /// documented idiom): only unmapping frees it.
    Mapped(u64, usize),
    Array(usize),
    Mipmap(usize),
}

unsafe impl Send for Held {}

struct Probe {
    c: Cuda,
    ctx: usize,
    dev: c_int,
    held: Mutex<Vec<Held>>,
    pool: Mutex<HashMap<c_int, usize>>,
}

impl Probe {
    fn set_current(&self) {
        let set = f!(
            self.c,
            "cuCtxSetCurrent",
            "cuCtxSetCurrent",
            fn(*mut c_void)
        );
        unsafe { set(self.ctx as *mut c_void) };
    }

    /// One allocation of `kind`; Ok(held) or Err(rc).
    fn alloc(&self, kind: &str, size: usize) -> Result<Held, R> {
        let c = &self.c;
        let mut p: u64 = 0;
        let rc = match kind {
            "alloc" => unsafe {
                f!(c, "cuMemAlloc", "cuMemAlloc_v2", fn(*mut u64, usize))(&mut p, size)
            },
            "managed" => unsafe {
                f!(
                    c,
                    "cuMemAllocManaged",
                    "cuMemAllocManaged",
                    fn(*mut u64, usize, c_uint)
                )(&mut p, size, 1)
            },
            "pitch" => {
                // size is the row width; 4 rows.
                let mut pitch = 0usize;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemAllocPitch",
                        "cuMemAllocPitch_v2",
                        fn(*mut u64, *mut usize, usize, usize, c_uint)
                    )(&mut p, &mut pitch, size, 4, 4)
                };
                if rc == 0 {
                    println!("pitch pitch={pitch}");
                }
                rc
            }
            "async" => {
                let name = ptsz_name(c, "cuMemAllocAsync", "cuMemAllocAsync_ptsz");
                let fp = c.sym("cuMemAllocAsync", name);
                let fp: unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> R =
                    unsafe { std::mem::transmute(fp) };
                let rc = unsafe { fp(&mut p, size, std::ptr::null_mut()) };
                if rc == 0 {
                    return Ok(Held::AsyncPtr(p));
                }
                rc
            }
            "pool" => {
                let pool = *self
                    .pool
                    .lock()
                    .unwrap()
                    .entry(self.dev)
                    .or_insert_with(|| {
                        let mut pool: *mut c_void = std::ptr::null_mut();
                        let get = f!(
                            c,
                            "cuDeviceGetDefaultMemPool",
                            "cuDeviceGetDefaultMemPool",
                            fn(*mut *mut c_void, c_int)
                        );
                        assert_eq!(unsafe { get(&mut pool, self.dev) }, 0);
                        pool as usize
                    });
                let name = ptsz_name(c, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz");
                let fp = c.sym("cuMemAllocFromPoolAsync", name);
                let fp: unsafe extern "C" fn(*mut u64, usize, *mut c_void, *mut c_void) -> R =
                    unsafe { std::mem::transmute(fp) };
                let rc = unsafe { fp(&mut p, size, pool as *mut c_void, std::ptr::null_mut()) };
                if rc == 0 {
                    return Ok(Held::AsyncPtr(p));
                }
                rc
            }
            "vmmap" => {
                let h = match self.alloc("vmm", size) {
                    Ok(Held::Vmm(h)) => h,
                    Ok(_) => unreachable!(),
                    Err(rc) => return Err(rc),
                };
                let va = vmm_map(c, h, size, 0, size)?;
                let rc = unsafe { f!(c, "cuMemRelease", "cuMemRelease", fn(u64))(h) };
                if rc != 0 {
                    return Err(rc);
                }
                return Ok(Held::Mapped(va, size));
            }
            k if k.starts_with("vmm") => {
                // vmm or vmm@N: placed on device N whatever the current context.
                let dev: c_int = k
                    .strip_prefix("vmm@")
                    .map_or(self.dev, |d| d.parse().unwrap());
                // CUmemAllocationProp: type, handle types, location {type, id}.
                let mut prop = [0u64; 4];
                prop[0] = 1; // CU_MEM_ALLOCATION_TYPE_PINNED
                prop[1] = 1 | ((dev as u32 as u64) << 32); // location = DEVICE, id
                let prop: [u8; 32] = unsafe { std::mem::transmute(prop) };
                let prop = &prop;
                let mut h: u64 = 0;
                let create = f!(
                    c,
                    "cuMemCreate",
                    "cuMemCreate",
                    fn(*mut u64, usize, *const u8, u64)
                );
                let rc = unsafe { create(&mut h, size, prop.as_ptr(), 0) };
                if rc == 0 {
                    return Ok(Held::Vmm(h));
                }
                rc
            }
            "array" => {
                // FLOAT x1, size/4 wide, 1 row.
                let desc: [usize; 3] = [size / 4, 1, 0x20 | (1 << 32)];
                let mut a: *mut c_void = std::ptr::null_mut();
                let create = f!(
                    c,
                    "cuArrayCreate",
                    "cuArrayCreate_v2",
                    fn(*mut *mut c_void, *const usize)
                );
                let rc = unsafe { create(&mut a, desc.as_ptr()) };
                if rc == 0 {
                    return Ok(Held::Array(a as usize));
                }
                rc
            }
            "array3d" => {
                // UINT8 x1, (size/4) x 2 x 2.
                let desc: [usize; 5] = [size / 4, 2, 2, 0x01 | (1 << 32), 0];
                let mut a: *mut c_void = std::ptr::null_mut();
                let create = f!(
                    c,
                    "cuArray3DCreate",
                    "cuArray3DCreate_v2",
                    fn(*mut *mut c_void, *const usize)
                );
                let rc = unsafe { create(&mut a, desc.as_ptr()) };
                if rc == 0 {
                    return Ok(Held::Array(a as usize));
                }
                rc
            }
            "mipmap" => {
                // UINT8 x1 2D, size bytes at level 0, 3 levels.
                let side = (size as f64).sqrt() as usize;
                let desc: [usize; 5] = [side, side, 0, 0x01 | (1 << 32), 0];
                let mut a: *mut c_void = std::ptr::null_mut();
                let create = f!(
                    c,
                    "cuMipmappedArrayCreate",
                    "cuMipmappedArrayCreate",
                    fn(*mut *mut c_void, *const usize, c_uint)
                );
                let rc = unsafe { create(&mut a, desc.as_ptr(), 3) };
                if rc == 0 {
                    return Ok(Held::Mipmap(a as usize));
                }
                rc
            }
            other => panic!("unknown allocation kind {other}"),
        };
        if rc == 0 { Ok(Held::Ptr(p)) } else { Err(rc) }
    }

    fn free(&self, h: Held) -> R {
        let c = &self.c;
        unsafe {
            match h {
                Held::Ptr(p) => f!(c, "cuMemFree", "cuMemFree_v2", fn(u64))(p),
                Held::AsyncPtr(p) => {
                    let name = ptsz_name(c, "cuMemFreeAsync", "cuMemFreeAsync_ptsz");
                    let fp: unsafe extern "C" fn(u64, *mut c_void) -> R =
                        std::mem::transmute(c.sym("cuMemFreeAsync", name));
                    fp(p, std::ptr::null_mut())
                }
                Held::Vmm(h) => f!(c, "cuMemRelease", "cuMemRelease", fn(u64))(h),
                Held::Mapped(va, size) => {
                    let rc = f!(c, "cuMemUnmap", "cuMemUnmap", fn(u64, usize))(va, size);
                    f!(c, "cuMemAddressFree", "cuMemAddressFree", fn(u64, usize))(va, size);
                    rc
                }
                Held::Array(a) => {
                    f!(c, "cuArrayDestroy", "cuArrayDestroy", fn(*mut c_void))(a as *mut c_void)
                }
                Held::Mipmap(a) => f!(
                    c,
                    "cuMipmappedArrayDestroy",
                    "cuMipmappedArrayDestroy",
                    fn(*mut c_void)
                )(a as *mut c_void),
            }
        }
    }

    fn fill(&self, kind: &str, size: usize, limit: usize) -> (usize, R) {
        let mut n = 0;
        loop {
            if n >= limit {
                return (n, 0);
            }
            match self.alloc(kind, size) {
                Ok(h) => {
                    self.held.lock().unwrap().push(h);
                    n += 1;
                }
                Err(rc) => return (n, rc),
            }
        }
    }
}

fn last_variant(c: &Cuda) -> String {
    let p = unsafe { libc::dlsym(c.lib, c"gpufracSimLastVariant".as_ptr()) };
    if p.is_null() {
        return "?".into();
    }
    let f: unsafe extern "C" fn() -> *const c_char = unsafe { std::mem::transmute(p) };
    unsafe { CStr::from_ptr(f()) }
        .to_string_lossy()
        .into_owned()
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut lookup = "cudart".to_string();
    let mut version = 12080;
    let mut ptsz = false;
    let mut dev: c_int = 0;
    while let Some(a) = args.first().cloned() {
        match a.as_str() {
            "--lookup" => lookup = args.remove(1),
            "--cuda-version" => version = args.remove(1).parse().unwrap(),
            "--ptsz" => ptsz = true,
            "--device" => dev = args.remove(1).parse().unwrap(),
            _ => break,
        }
        args.remove(0);
    }
    let c = Cuda::open(&lookup, version, ptsz);
    let init = f!(c, "cuInit", "cuInit", fn(c_uint));
    let rc = unsafe { init(0) };
    println!("init rc={rc}");
    if rc != 0 {
        std::process::exit(3);
    }
    let mut probe = Probe {
        c,
        ctx: 0,
        dev,
        held: Mutex::new(Vec::new()),
        pool: Mutex::new(HashMap::new()),
    };
    let mut windows = Vec::new();
    let mut g = Graph::default();
    let mut i = 0;
    let next = |i: &mut usize| {
        *i += 1;
        args[*i - 1].clone()
    };
    while i < args.len() {
        let step = next(&mut i);
        match step.as_str() {
            // Primary context on --device, made current.
            "ctx" => {
                let retain = f!(
                    probe.c,
                    "cuDevicePrimaryCtxRetain",
                    "cuDevicePrimaryCtxRetain",
                    fn(*mut *mut c_void, c_int)
                );
                let mut ctx = std::ptr::null_mut();
                let rc = unsafe { retain(&mut ctx, probe.dev) };
                probe.ctx = ctx as usize;
                probe.set_current();
                println!("ctx rc={rc}");
            }
            // cuCtxCreate as this CUDA version defines it (v2 before 13.0, v4 after).
            "ctx-create" => {
                let d: c_int = next(&mut i).parse().unwrap();
                let mut ctx: *mut c_void = std::ptr::null_mut();
                let rc = if probe.c.version >= 13000 {
                    let f = f!(
                        probe.c,
                        "cuCtxCreate",
                        "cuCtxCreate_v4",
                        fn(*mut *mut c_void, *mut c_void, c_uint, c_int)
                    );
                    unsafe { f(&mut ctx, std::ptr::null_mut(), 0, d) }
                } else {
                    let f = f!(
                        probe.c,
                        "cuCtxCreate",
                        "cuCtxCreate_v2",
                        fn(*mut *mut c_void, c_uint, c_int)
                    );
                    unsafe { f(&mut ctx, 0, d) }
                };
                let variant = last_variant(&probe.c);
                probe.ctx = ctx as usize;
                probe.dev = d;
                let mut got: c_int = -1;
                // The CUDA 11/12 signature, whatever version this probe asks
                // for (CUDA 13's cuCtxGetDevice takes a context as well).
                let p = unsafe { libc::dlsym(probe.c.lib, c"cuCtxGetDevice".as_ptr()) };
                let getdev: unsafe extern "C" fn(*mut c_int) -> R =
                    unsafe { std::mem::transmute(p) };
                unsafe { getdev(&mut got) };
                println!("ctx-create rc={rc} device={got} variant={variant}");
            }
            "ctx-destroy" => {
                let f = f!(probe.c, "cuCtxDestroy", "cuCtxDestroy_v2", fn(*mut c_void));
                let rc = unsafe { f(probe.ctx as *mut c_void) };
                probe.held.lock().unwrap().clear();
                println!("ctx-destroy rc={rc}");
            }
            "alloc" => {
                let kind = next(&mut i);
                let size = parse_size(&next(&mut i));
                match probe.alloc(&kind, size) {
                    Ok(h) => {
                        probe.held.lock().unwrap().push(h);
                        println!("alloc rc=0 variant={}", last_variant(&probe.c));
                    }
                    Err(rc) => println!("alloc rc={rc} variant={}", last_variant(&probe.c)),
                }
            }
            "fill" => {
                let kind = next(&mut i);
                let size = parse_size(&next(&mut i));
                let (n, rc) = probe.fill(&kind, size, usize::MAX);
                println!("fill count={n} rc={rc}");
            }
            "free-one" => {
                let h = probe.held.lock().unwrap().pop();
                let rc = h.map_or(0, |h| probe.free(h));
                println!("free-one rc={rc}");
            }
            "free-all" => {
                let held: Vec<Held> = std::mem::take(&mut *probe.held.lock().unwrap());
                let bad = held
                    .into_iter()
                    .map(|h| probe.free(h))
                    .filter(|&rc| rc != 0)
                    .count();
                println!("free-all failures={bad}");
            }
            "free-unknown" => {
                let rc = unsafe { f!(probe.c, "cuMemFree", "cuMemFree_v2", fn(u64))(0xdead_0000) };
                println!("free-unknown rc={rc}");
            }
            "churn" => {
                let kind = next(&mut i);
                let size = parse_size(&next(&mut i));
                let n: usize = next(&mut i).parse().unwrap();
                let mut fails = 0;
                for _ in 0..n {
                    match probe.alloc(&kind, size) {
                        Ok(h) => fails += (probe.free(h) != 0) as usize,
                        Err(_) => fails += 1,
                    }
                }
                println!("churn n={n} failures={fails}");
            }
            "race" => {
                let threads: usize = next(&mut i).parse().unwrap();
                let kind = next(&mut i);
                let size = parse_size(&next(&mut i));
                let barrier = std::sync::Barrier::new(threads);
                let total: usize = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..threads)
                        .map(|_| {
                            s.spawn(|| {
                                probe.set_current();
                                barrier.wait();
                                probe.fill(&kind, size, usize::MAX).0
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).sum()
                });
                println!("race count={total}");
            }
            "info" => {
                let (mut free, mut total) = (0usize, 0usize);
                let rc = unsafe {
                    f!(
                        probe.c,
                        "cuMemGetInfo",
                        "cuMemGetInfo_v2",
                        fn(*mut usize, *mut usize)
                    )(&mut free, &mut total)
                };
                let mut dt = 0usize;
                let rc2 = unsafe {
                    f!(
                        probe.c,
                        "cuDeviceTotalMem",
                        "cuDeviceTotalMem_v2",
                        fn(*mut usize, c_int)
                    )(&mut dt, probe.dev)
                };
                println!("info rc={rc} free={free} total={total} devtotal_rc={rc2} devtotal={dt}");
            }
            // VMM lifetimes: create, map whole at A and half at B, retain
            // through A, release both references, unmap A, unmap B. After
            // each stage: what the shim charges (gpufrac_mem_used, 0
            // without the shim) and what the driver holds (total - free).
            "vmm-life" => {
                let size = parse_size(&next(&mut i));
                let c = &probe.c;
                let stage = || charged_and_held(c, probe.dev);
                let mut out = Vec::new();
                let h = match probe.alloc("vmm", size) {
                    Ok(Held::Vmm(h)) => h,
                    other => panic!("cuMemCreate: {:?}", other.err()),
                };
                out.push(stage());
                let a = vmm_map(c, h, size, 0, size).expect("map A");
                let b = vmm_map(c, h, size / 2, size / 2, size / 2).expect("map B");
                let mut h2 = 0u64;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemRetainAllocationHandle",
                        "cuMemRetainAllocationHandle",
                        fn(*mut u64, u64)
                    )(&mut h2, a + 4096)
                };
                assert_eq!((rc, h2), (0, h), "retain");
                let release = f!(c, "cuMemRelease", "cuMemRelease", fn(u64));
                assert_eq!(unsafe { release(h) }, 0);
                out.push(stage());
                assert_eq!(unsafe { release(h2) }, 0);
                out.push(stage());
                let unmap = f!(c, "cuMemUnmap", "cuMemUnmap", fn(u64, usize));
                assert_eq!(unsafe { unmap(a, size) }, 0);
                out.push(stage());
                assert_eq!(unsafe { unmap(b, size / 2) }, 0);
                out.push(stage());
                println!("vmm-life stages={}", out.join(","));
            }
            // A VMM allocation shared through a file descriptor: created
            // exportable, mapped at A, exported and imported as a second
            // handle; the first released and A unmapped; the second mapped
            // at B, retained through B, released; B unmapped; the retained
            // reference released. CHARGED/HELD after each stage.
            "vmm-share" => {
                let size = parse_size(&next(&mut i));
                let c = &probe.c;
                let stage = || charged_and_held(c, probe.dev);
                let mut out = Vec::new();
                let mut prop = [0u64; 4];
                // Pinned, exportable as a POSIX file descriptor, on --device.
                prop[0] = 1 | (1 << 32);
                prop[1] = 1 | ((probe.dev as u32 as u64) << 32);
                let mut h = 0u64;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemCreate",
                        "cuMemCreate",
                        fn(*mut u64, usize, *const [u64; 4], u64)
                    )(&mut h, size, &prop, 0)
                };
                assert_eq!(rc, 0, "cuMemCreate");
                out.push(stage());
                let a = vmm_map(c, h, size, 0, size).expect("map A");
                let mut fd: c_int = -1;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemExportToShareableHandle",
                        "cuMemExportToShareableHandle",
                        fn(*mut c_int, u64, c_uint, u64)
                    )(&mut fd, h, 1, 0)
                };
                assert_eq!(rc, 0, "export");
                let mut h2 = 0u64;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemImportFromShareableHandle",
                        "cuMemImportFromShareableHandle",
                        fn(*mut u64, *mut c_void, c_uint)
                    )(&mut h2, fd as usize as *mut c_void, 1)
                };
                assert_eq!(rc, 0, "import");
                assert_ne!(h2, h, "a handle of its own");
                out.push(stage());
                let release = f!(c, "cuMemRelease", "cuMemRelease", fn(u64));
                let unmap = f!(c, "cuMemUnmap", "cuMemUnmap", fn(u64, usize));
                assert_eq!(unsafe { release(h) }, 0);
                assert_eq!(unsafe { unmap(a, size) }, 0);
                out.push(stage());
                // Whether as much again fits now (given back at once).
                let mid = match probe.alloc("alloc", size) {
                    Ok(held) => probe.free(held),
                    Err(rc) => rc,
                };
                let b = vmm_map(c, h2, size, 0, size).expect("map B");
                let mut h3 = 0u64;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemRetainAllocationHandle",
                        "cuMemRetainAllocationHandle",
                        fn(*mut u64, u64)
                    )(&mut h3, b)
                };
                assert_eq!((rc, h3), (0, h2), "retain");
                assert_eq!(unsafe { release(h2) }, 0);
                out.push(stage());
                assert_eq!(unsafe { unmap(b, size) }, 0);
                out.push(stage());
                assert_eq!(unsafe { release(h3) }, 0);
                out.push(stage());
                unsafe { libc::close(fd) };
                println!("vmm-share stages={} alloc_meanwhile={mid}", out.join(","));
            }
            "info-null" => {
                let mut total = 0usize;
                let rc = unsafe {
                    f!(
                        probe.c,
                        "cuMemGetInfo",
                        "cuMemGetInfo_v2",
                        fn(*mut usize, *mut usize)
                    )(std::ptr::null_mut(), &mut total)
                };
                println!("info-null rc={rc} total={total}");
            }
            "nvml" => nvml_report(),
            // Every device CUDA shows, by ordinal: its UUID and memory.
            "devices" => {
                let count = f!(
                    probe.c,
                    "cuDeviceGetCount",
                    "cuDeviceGetCount",
                    fn(*mut c_int)
                );
                let get = f!(probe.c, "cuDeviceGet", "cuDeviceGet", fn(*mut c_int, c_int));
                let uuid = f!(
                    probe.c,
                    "cuDeviceGetUuid",
                    "cuDeviceGetUuid_v2",
                    fn(*mut [u8; 16], c_int)
                );
                let total = f!(
                    probe.c,
                    "cuDeviceTotalMem",
                    "cuDeviceTotalMem_v2",
                    fn(*mut usize, c_int)
                );
                let mut n = 0;
                let rc = unsafe { count(&mut n) };
                println!("devices rc={rc} count={n}");
                for o in 0..n {
                    let (mut d, mut u, mut t) = (0, [0u8; 16], 0usize);
                    unsafe {
                        get(&mut d, o);
                        uuid(&mut u, d);
                        total(&mut t, d);
                    }
                    println!("device ordinal={o} uuid={} total={t}", uuid_string(&u));
                }
            }
            // The processes NVML lists on each device.
            "nvml-procs" => nvml_procs(),
            // gpufrac_mem_refusals(device) of the shim, when it is there.
            "refusals" => {
                let p =
                    unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_refusals".as_ptr()) };
                if p.is_null() {
                    println!("refusals present=0");
                } else {
                    let f: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(p) };
                    println!("refusals present=1 count={}", f(probe.dev));
                }
            }
            // gpufrac_mem_wanted and gpufrac_mem_peak: what the process
            // asked to hold at most, refused requests included, and held.
            "wanted" => {
                let w = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_wanted".as_ptr()) };
                let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_peak".as_ptr()) };
                if w.is_null() || p.is_null() {
                    println!("wanted present=0");
                } else {
                    let wanted: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(w) };
                    let peak: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(p) };
                    println!(
                        "wanted present=1 wanted={} peak={}",
                        wanted(probe.dev),
                        peak(probe.dev)
                    );
                }
            }
            "limit-api" => {
                let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_limit".as_ptr()) };
                let q = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_used".as_ptr()) };
                if p.is_null() || q.is_null() {
                    println!("limit-api present=0");
                } else {
                    let lim: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(p) };
                    let used: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(q) };
                    println!(
                        "limit-api present=1 limit={} used={}",
                        lim(probe.dev),
                        used(probe.dev)
                    );
                }
            }
            "launch" => {
                // launch N kernels of D ns on the (per-thread) default stream, then sync.
                let n: usize = next(&mut i).parse().unwrap();
                let ns: u64 = next(&mut i).parse().unwrap();
                let (rc, variant) = launch(&probe.c, n, ns);
                println!("launch rc={rc} variant={variant}");
            }
            "lookup" => {
                // dlsym(RTLD_DEFAULT, NAME) from the application.
                let name = CString::new(next(&mut i)).unwrap();
                let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
                println!("lookup found={}", !p.is_null() as u8);
            }
            "spin" => {
                // Launch KERNEL_NS kernels from START to END (CLOCK_MONOTONIC
                // ns, shared by every process on the machine), syncing every
                // BATCH launches like a training loop does; count the
                // kernels that completed inside the window.
                let start: u64 = next(&mut i).parse().unwrap();
                let end: u64 = next(&mut i).parse().unwrap();
                let kernel_ns: u64 = next(&mut i).parse().unwrap();
                let batch: usize = next(&mut i).parse().unwrap();
                let (kernels, rc) = spin(&probe.c, start, end, kernel_ns, batch);
                println!(
                    "spin kernels={kernels} rc={rc} gpu_ns={}",
                    kernels * kernel_ns
                );
            }
            "trickle" => {
                // One kernel every PERIOD_MS from START to END: a process
                // that holds the GPU only briefly now and then.
                let start: u64 = next(&mut i).parse().unwrap();
                let end: u64 = next(&mut i).parse().unwrap();
                let period_ms: u64 = next(&mut i).parse().unwrap();
                let kernel_ns: u64 = next(&mut i).parse().unwrap();
                let mut n = 0;
                gpufrac_common::clock::sleep_until(start);
                while mono_ns() < end {
                    if launch(&probe.c, 1, kernel_ns).0 == 0 {
                        n += 1;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(period_ms));
                }
                println!("trickle kernels={n}");
            }
            "cudart-entry" => {
                // cudaGetDriverEntryPoint of a cudart loaded RTLD_LOCAL (as
                // frameworks load it), then an allocation through the
                // pointer it handed out.
                let lib = CString::new(next(&mut i)).unwrap();
                let sym = CString::new(next(&mut i)).unwrap();
                let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
                assert!(!h.is_null(), "dlopen {lib:?}");
                let f = unsafe { libc::dlsym(h, c"cudaGetDriverEntryPoint".as_ptr()) };
                let f: unsafe extern "C" fn(*const c_char, *mut *mut c_void, u64, *mut c_int) -> R =
                    unsafe { std::mem::transmute(f) };
                let mut p: *mut c_void = std::ptr::null_mut();
                let mut status = -1;
                let rc = unsafe { f(sym.as_ptr(), &mut p, 0, &mut status) };
                let mut d: u64 = 0;
                let arc = if rc == 0 {
                    let alloc: unsafe extern "C" fn(*mut u64, usize) -> R =
                        unsafe { std::mem::transmute(p) };
                    unsafe { alloc(&mut d, 48 << 20) }
                } else {
                    999
                };
                println!(
                    "cudart-entry rc={rc} origin={} alloc48M_rc={arc}",
                    origin(p)
                );
            }
            // CUDA graph memory: capture a cuMemAllocAsync of SIZE on a new
            // stream into a graph, instantiate it, then launch it N times;
            // after each launch the allocation is freed outside the graph
            // unless HOLD is "hold". Prints every launch's rc, and after
            // each what the shim charges and the driver holds on the device;
            // then trims the graph pool and prints them again.
            "graph-mem" => {
                let size = parse_size(&next(&mut i));
                let n: usize = next(&mut i).parse().unwrap();
                let hold = next(&mut i) == "hold";
                let c = &probe.c;
                let dev = probe.dev;
                let stage = || charged_and_held(c, dev);
                let mut stream: *mut c_void = std::ptr::null_mut();
                unsafe {
                    assert_eq!(
                        f!(
                            c,
                            "cuStreamCreate",
                            "cuStreamCreate",
                            fn(*mut *mut c_void, c_uint)
                        )(&mut stream, 1),
                        0
                    );
                    assert_eq!(
                        f!(
                            c,
                            "cuStreamBeginCapture",
                            "cuStreamBeginCapture_v2",
                            fn(*mut c_void, c_int)
                        )(stream, 0),
                        0
                    );
                }
                let mut p = 0u64;
                let rc = unsafe {
                    f!(
                        c,
                        "cuMemAllocAsync",
                        "cuMemAllocAsync",
                        fn(*mut u64, usize, *mut c_void)
                    )(&mut p, size, stream)
                };
                assert_eq!(rc, 0, "captured alloc");
                let mut graph: *mut c_void = std::ptr::null_mut();
                let mut exec: *mut c_void = std::ptr::null_mut();
                unsafe {
                    assert_eq!(
                        f!(
                            c,
                            "cuStreamEndCapture",
                            "cuStreamEndCapture",
                            fn(*mut c_void, *mut *mut c_void)
                        )(stream, &mut graph),
                        0
                    );
                    assert_eq!(
                        f!(
                            c,
                            "cuGraphInstantiateWithFlags",
                            "cuGraphInstantiateWithFlags",
                            fn(*mut *mut c_void, *mut c_void, u64)
                        )(&mut exec, graph, 0),
                        0
                    );
                }
                let captured = stage();
                let launch = f!(
                    c,
                    "cuGraphLaunch",
                    "cuGraphLaunch",
                    fn(*mut c_void, *mut c_void)
                );
                let sync = f!(
                    c,
                    "cuStreamSynchronize",
                    "cuStreamSynchronize",
                    fn(*mut c_void)
                );
                let free = f!(c, "cuMemFreeAsync", "cuMemFreeAsync", fn(u64, *mut c_void));
                let mut rcs = Vec::new();
                let mut after = Vec::new();
                for _ in 0..n {
                    let rc = unsafe { launch(exec, stream) };
                    rcs.push(rc.to_string());
                    unsafe { sync(stream) };
                    after.push(stage());
                    if rc == 0 && !hold {
                        unsafe {
                            free(p, stream);
                            sync(stream);
                        }
                    }
                }
                unsafe {
                    f!(c, "cuDeviceGraphMemTrim", "cuDeviceGraphMemTrim", fn(c_int))(dev);
                }
                println!(
                    "graph-mem captured={captured} launches={} after={} trimmed={}",
                    rcs.join(","),
                    after.join(","),
                    stage()
                );
            }
            // CUDA graphs step by step (`g-*`): one graph, its executable
            // graph and its allocation at a time. Each prints its rc and
            // then CHARGED/HELD (what the shim charges, what the driver
            // holds) on --device. With --ptsz, captures run on the
            // per-thread default stream through the _ptsz entry points.
            //
            // g-capture SIZE: a cuMemAllocAsync of SIZE captured.
            "g-capture" => {
                let size = parse_size(&next(&mut i));
                let rc = g.capture(&probe.c, size);
                println!(
                    "g-capture rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-create: an empty graph (cuGraphCreate) with an empty node.
            "g-create" => {
                let rc = g.create(&probe.c);
                println!("g-create rc={rc}");
            }
            // g-node SIZE: an allocation node of SIZE on --device added to
            // the graph (cuGraphCreate first if there is none).
            "g-node" => {
                let size = parse_size(&next(&mut i));
                let rc = g.node(&probe.c, size, probe.dev);
                println!(
                    "g-node rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-clone: the graph replaced by its clone (cuGraphClone).
            "g-clone" => {
                let rc = g.clone_graph(&probe.c);
                println!("g-clone rc={rc}");
            }
            // g-instantiate HOW: v1, v2, flags, auto-free, params or
            // params-upload (cuGraphInstantiateWithParams, _ptsz with
            // --ptsz; uploading on a new stream).
            "g-instantiate" => {
                let how = next(&mut i);
                let rc = g.instantiate(&probe.c, &how);
                println!(
                    "g-instantiate rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-upload: cuGraphUpload of the executable graph.
            "g-upload" => {
                let rc = g.upload(&probe.c);
                println!(
                    "g-upload rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-launch N free|free-sync|hold: N launches; after each the
            // allocation is freed with cuMemFreeAsync (cuMemFree with
            // free-sync) unless "hold". Every launch's rc, and CHARGED/HELD
            // after each.
            "g-launch" => {
                let n: usize = next(&mut i).parse().unwrap();
                let how = next(&mut i);
                let (rcs, after) = g.launch(&probe.c, probe.dev, n, &how);
                println!("g-launch rcs={} after={}", rcs.join(","), after.join(","));
            }
            // g-race SIZE: two threads each capture and instantiate a
            // graph allocating SIZE on a stream of their own, meet at a
            // barrier, and launch at once. The launches' rcs (sorted) and
            // CHARGED/HELD after both.
            "g-race" => {
                let size = parse_size(&next(&mut i));
                let barrier = std::sync::Barrier::new(2);
                let c = &probe.c;
                let mut rcs: Vec<R> = std::thread::scope(|sc| {
                    let hs: Vec<_> = (0..2)
                        .map(|_| {
                            sc.spawn(|| {
                                probe.set_current();
                                let mut mine = Graph::default();
                                assert_eq!(mine.capture(c, size), 0);
                                assert_eq!(mine.instantiate(c, "flags"), 0);
                                barrier.wait();
                                let (rcs, _) = mine.launch(c, probe.dev, 1, "hold");
                                rcs[0].parse::<R>().unwrap()
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                rcs.sort_unstable();
                let rcs: Vec<String> = rcs.iter().map(R::to_string).collect();
                println!(
                    "g-race rcs={} now={}",
                    rcs.join(","),
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-foreign NS: an executable graph the shim never saw
            // instantiated (the simulated driver's test export), launched.
            "g-foreign" => {
                let ns: u64 = next(&mut i).parse().unwrap();
                let p = unsafe { libc::dlsym(probe.c.lib, c"gpufracSimGraphCreate".as_ptr()) };
                assert!(!p.is_null(), "not the simulated driver");
                let create: unsafe extern "C" fn(*mut *mut c_void, u64) -> R =
                    unsafe { std::mem::transmute(p) };
                let mut e = std::ptr::null_mut();
                assert_eq!(unsafe { create(&mut e, ns) }, 0);
                let launch = f!(
                    probe.c,
                    "cuGraphLaunch",
                    "cuGraphLaunch",
                    fn(*mut c_void, *mut c_void)
                );
                let rc = unsafe { launch(e, std::ptr::null_mut()) };
                println!("g-foreign rc={rc}");
            }
            // g-trim: cuDeviceGraphMemTrim of --device.
            "g-trim" => {
                let rc = unsafe {
                    f!(
                        probe.c,
                        "cuDeviceGraphMemTrim",
                        "cuDeviceGraphMemTrim",
                        fn(c_int)
                    )(probe.dev)
                };
                println!(
                    "g-trim rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            // g-destroy: the executable graph and the graph destroyed.
            "g-destroy" => {
                let rc = g.destroy(&probe.c);
                println!(
                    "g-destroy rc={rc} now={}",
                    charged_and_held(&probe.c, probe.dev)
                );
            }
            "fork-used" => {
                // What the shim charges in a child forked after CUDA init.
                let q = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_used".as_ptr()) };
                assert!(!q.is_null());
                let used: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(q) };
                let parent = used(probe.dev);
                let mut fds = [0; 2];
                unsafe { libc::pipe(fds.as_mut_ptr()) };
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    let v = used(probe.dev).to_le_bytes();
                    unsafe {
                        libc::write(fds[1], v.as_ptr().cast(), 8);
                        libc::_exit(0);
                    }
                }
                let mut v = [0u8; 8];
                unsafe {
                    libc::read(fds[0], v.as_mut_ptr().cast(), 8);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                println!("fork-used parent={parent} child={}", u64::from_le_bytes(v));
            }
            // The steps after this one run in a child forked here, which
            // says its pid first; this process waits for it, says how it
            // ended, and runs nothing more.
            "fork" => {
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    println!("forked pid={}", std::process::id());
                    continue;
                }
                let mut status = 0;
                unsafe { libc::waitpid(pid, &mut status, 0) };
                println!(
                    "fork child={pid} exited={}",
                    if libc::WIFEXITED(status) {
                        libc::WEXITSTATUS(status)
                    } else {
                        -1
                    }
                );
                i = args.len();
            }
            // One cooperative launch over devices 0 and 1: a kernel of NS
            // on a new stream of each device's primary context, then both
            // streams synchronised; the context of --device is current again
            // afterwards.
            "coop-multi" => {
                let ns: u64 = next(&mut i).parse().unwrap();
                let (rc, sync_rc) = coop_multi(&probe.c, ns);
                probe.set_current();
                println!("coop-multi rc={rc} sync_rc={sync_rc}");
            }
            // Kernels the simulated engine of --device was given so far.
            "kernels" => {
                let p = unsafe { libc::dlsym(probe.c.lib, c"gpufracSimEngineStats".as_ptr()) };
                assert!(!p.is_null(), "not the simulated driver");
                let stats: unsafe extern "C" fn(c_int, *mut u64, *mut u64) -> R =
                    unsafe { std::mem::transmute(p) };
                let (mut busy, mut n) = (0u64, 0u64);
                let rc = unsafe { stats(probe.dev, &mut busy, &mut n) };
                println!("kernels rc={rc} count={n}");
            }
            // Waits for PATH to exist: the test says when to go on.
            "await-file" => {
                let path = next(&mut i);
                while !std::path::Path::new(&path).exists() {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                println!("await-file done=1");
            }
            // Holds everything until PATH exists, so that a test can look
            // at this process from outside while it holds memory; or until
            // PATH's directory is gone (a test that failed has removed it).
            "wait-file" => {
                let path = next(&mut i);
                let path = std::path::Path::new(&path);
                while !path.exists() && path.parent().is_none_or(|d| d.exists()) {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                println!("wait-file done=1");
            }
            "sleep-ms" => {
                let ms: u64 = next(&mut i).parse().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(ms));
                println!("sleep-ms done=1");
            }
            "origin" => {
                // Which library the pointer for BASE/VERSIONED comes from,
                // by the cuGetProcAddress path and by plain dlsym.
                let base = next(&mut i);
                let versioned = next(&mut i);
                let via_gpa = origin(probe.c.sym(&base, &versioned));
                let name = CString::new(versioned.as_str()).unwrap();
                let via_dlsym = origin(unsafe { libc::dlsym(probe.c.lib, name.as_ptr()) });
                println!("origin via_lookup={via_gpa} via_dlsym={via_dlsym}");
            }
            "window" => {
                // In the background: kernel ns this process executes on
                // --device from START to END (CLOCK_MONOTONIC ns) and the
                // device's context switches meanwhile, exact (simulated
                // driver only); printed when the probe ends.
                let start: u64 = next(&mut i).parse().unwrap();
                let end: u64 = next(&mut i).parse().unwrap();
                let (lib, dev) = (probe.c.lib as usize, probe.dev);
                windows.push(std::thread::spawn(move || {
                    let executed = sim_counter(lib, c"gpufracSimExecutedNs");
                    let switches = sim_counter(lib, c"gpufracSimSwitches");
                    gpufrac_common::clock::sleep_until(start);
                    let (e0, s0) = unsafe { (executed(dev), switches(dev)) };
                    gpufrac_common::clock::sleep_until(end);
                    let (e1, s1) = unsafe { (executed(dev), switches(dev)) };
                    format!(
                        "window executed_ns={} switches={} window_ns={}",
                        e1 - e0,
                        s1 - s0,
                        end - start
                    )
                }));
            }
            "burst" => {
                // An interactive process: every PERIOD_US from START to END,
                // N kernels of KERNEL_NS queued at once on the default
                // stream, then cuStreamSynchronize; latencies in µs.
                let start: u64 = next(&mut i).parse().unwrap();
                let end: u64 = next(&mut i).parse().unwrap();
                let period_us: u64 = next(&mut i).parse().unwrap();
                let n: usize = next(&mut i).parse().unwrap();
                let kernel_ns: u64 = next(&mut i).parse().unwrap();
                let mut lat = burst(&probe.c, start, end, period_us * 1000, n, kernel_ns);
                lat.sort_unstable();
                let p = |q: f64| {
                    let k = ((q * lat.len() as f64).ceil() as usize).clamp(1, lat.len().max(1));
                    lat.get(k - 1).map_or(0, |v| v / 1000)
                };
                println!(
                    "burst n={} p50_us={} p99_us={} max_us={}",
                    lat.len(),
                    p(0.5),
                    p(0.99),
                    lat.last().map_or(0, |v| v / 1000)
                );
            }
            other => panic!("unknown step {other}"),
        }
    }
    for w in windows {
        println!("{}", w.join().unwrap());
    }
}

/// A `u64 f(int device)` test-only export of the simulated driver.
fn sim_counter(lib: usize, name: &CStr) -> unsafe extern "C" fn(c_int) -> u64 {
    let p = unsafe { libc::dlsym(lib as *mut c_void, name.as_ptr()) };
    assert!(!p.is_null(), "{name:?}: not the simulated driver");
    unsafe { std::mem::transmute(p) }
}

/// Latencies (ns) of bursts of `n` kernels queued at once then
/// synchronised, one every `period` ns from `start` to `end`.
fn burst(c: &Cuda, start: u64, end: u64, period: u64, n: usize, ns: u64) -> Vec<u64> {
    let k = Kernel::new(c, "cuLaunchKernel");
    let sync = f!(
        c,
        "cuStreamSynchronize",
        "cuStreamSynchronize",
        fn(*mut c_void)
    );
    let mut lat = Vec::new();
    let mut next = start;
    while next + period <= end {
        gpufrac_common::clock::sleep_until(next);
        let t = mono_ns();
        for _ in 0..n {
            k.run(ns);
        }
        unsafe { sync(std::ptr::null_mut()) };
        lat.push(mono_ns() - t);
        next += period;
    }
    lat
}

/// File name of the shared object containing `p`.
/// "CHARGED/HELD" on `dev`: what the shim charges (gpufrac_mem_used, 0
/// without the shim) and what the simulated driver holds, past the shim.
fn charged_and_held(c: &Cuda, dev: c_int) -> String {
    let q = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gpufrac_mem_used".as_ptr()) };
    let charged = if q.is_null() {
        0
    } else {
        let f: extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(q) };
        f(dev)
    };
    let p = unsafe { libc::dlsym(c.lib, c"gpufracSimDeviceUsed".as_ptr()) };
    assert!(!p.is_null(), "not the simulated driver");
    let held_fn: unsafe extern "C" fn(c_int, *mut u64) -> R = unsafe { std::mem::transmute(p) };
    let mut held = 0u64;
    unsafe { held_fn(dev, &mut held) };
    format!("{charged}/{held}")
}

/// The probe's one graph (`g-*` steps).
struct Graph {
    stream: *mut c_void,
    graph: *mut c_void,
    exec: *mut c_void,
    /// The graph's allocation.
    ptr: u64,
}

impl Default for Graph {
    fn default() -> Graph {
        Graph {
            stream: std::ptr::null_mut(),
            graph: std::ptr::null_mut(),
            exec: std::ptr::null_mut(),
            ptr: 0,
        }
    }
}

impl Graph {
    /// The stream captures and launches run on: a new one, or with --ptsz
    /// the per-thread default stream (NULL to the _ptsz entry points).
    fn stream(&mut self, c: &Cuda) -> *mut c_void {
        if !c.ptsz && self.stream.is_null() {
            let create = f!(
                c,
                "cuStreamCreate",
                "cuStreamCreate",
                fn(*mut *mut c_void, c_uint)
            );
            assert_eq!(unsafe { create(&mut self.stream, 1) }, 0);
        }
        self.stream
    }

    fn capture(&mut self, c: &Cuda, size: usize) -> R {
        let s = self.stream(c);
        let begin = f!(
            c,
            "cuStreamBeginCapture",
            ptsz_name(c, "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz"),
            fn(*mut c_void, c_int)
        );
        let rc = unsafe { begin(s, 0) };
        if rc != 0 {
            return rc;
        }
        let alloc = f!(
            c,
            "cuMemAllocAsync",
            ptsz_name(c, "cuMemAllocAsync", "cuMemAllocAsync_ptsz"),
            fn(*mut u64, usize, *mut c_void)
        );
        let rc = unsafe { alloc(&mut self.ptr, size, s) };
        if rc != 0 {
            return rc;
        }
        let end = f!(
            c,
            "cuStreamEndCapture",
            ptsz_name(c, "cuStreamEndCapture", "cuStreamEndCapture_ptsz"),
            fn(*mut c_void, *mut *mut c_void)
        );
        unsafe { end(s, &mut self.graph) }
    }

    fn create(&mut self, c: &Cuda) -> R {
        let create = f!(
            c,
            "cuGraphCreate",
            "cuGraphCreate",
            fn(*mut *mut c_void, c_uint)
        );
        let rc = unsafe { create(&mut self.graph, 0) };
        if rc != 0 {
            return rc;
        }
        let empty = f!(
            c,
            "cuGraphAddEmptyNode",
            "cuGraphAddEmptyNode",
            fn(*mut *mut c_void, *mut c_void, *const *mut c_void, usize)
        );
        let mut node = std::ptr::null_mut();
        unsafe { empty(&mut node, self.graph, std::ptr::null(), 0) }
    }

    fn node(&mut self, c: &Cuda, size: usize, dev: c_int) -> R {
        if self.graph.is_null() {
            let rc = self.create(c);
            if rc != 0 {
                return rc;
            }
        }
        let add = f!(
            c,
            "cuGraphAddMemAllocNode",
            "cuGraphAddMemAllocNode",
            fn(
                *mut *mut c_void,
                *mut c_void,
                *const *mut c_void,
                usize,
                *mut gpufrac_common::cuda::CUDA_MEM_ALLOC_NODE_PARAMS,
            )
        );
        let mut p = gpufrac_common::cuda::CUDA_MEM_ALLOC_NODE_PARAMS {
            poolProps: gpufrac_common::cuda::CUmemPoolProps {
                allocType: 1,
                handleTypes: 0,
                location: gpufrac_common::cuda::CUmemLocation { type_: 1, id: dev },
                win32SecurityAttributes: std::ptr::null_mut(),
                maxSize: 0,
                usage: 0,
                reserved: [0; 54],
            },
            accessDescs: std::ptr::null(),
            accessDescCount: 0,
            bytesize: size,
            dptr: 0,
        };
        let mut node = std::ptr::null_mut();
        let rc = unsafe { add(&mut node, self.graph, std::ptr::null(), 0, &mut p) };
        self.ptr = p.dptr;
        rc
    }

    fn clone_graph(&mut self, c: &Cuda) -> R {
        let clone = f!(
            c,
            "cuGraphClone",
            "cuGraphClone",
            fn(*mut *mut c_void, *mut c_void)
        );
        let mut g = std::ptr::null_mut();
        let rc = unsafe { clone(&mut g, self.graph) };
        if rc == 0 {
            self.graph = g;
        }
        rc
    }

    fn instantiate(&mut self, c: &Cuda, how: &str) -> R {
        let g = self.graph;
        let e = &mut self.exec as *mut *mut c_void;
        match how {
            "v1" | "v2" => {
                let f = f!(
                    c,
                    "cuGraphInstantiate",
                    if how == "v1" {
                        "cuGraphInstantiate"
                    } else {
                        "cuGraphInstantiate_v2"
                    },
                    fn(*mut *mut c_void, *mut c_void, *mut *mut c_void, *mut c_char, usize)
                );
                let mut node = std::ptr::null_mut();
                let mut log = [0 as c_char; 64];
                unsafe { f(e, g, &mut node, log.as_mut_ptr(), log.len()) }
            }
            "flags" | "auto-free" => {
                let f = f!(
                    c,
                    "cuGraphInstantiateWithFlags",
                    "cuGraphInstantiateWithFlags",
                    fn(*mut *mut c_void, *mut c_void, u64)
                );
                unsafe { f(e, g, u64::from(how == "auto-free")) }
            }
            "params" | "params-upload" => {
                let f = f!(
                    c,
                    "cuGraphInstantiateWithParams",
                    ptsz_name(
                        c,
                        "cuGraphInstantiateWithParams",
                        "cuGraphInstantiateWithParams_ptsz"
                    ),
                    fn(
                        *mut *mut c_void,
                        *mut c_void,
                        *mut gpufrac_common::cuda::CUDA_GRAPH_INSTANTIATE_PARAMS,
                    )
                );
                let upload = how == "params-upload";
                let mut p = gpufrac_common::cuda::CUDA_GRAPH_INSTANTIATE_PARAMS {
                    flags: if upload { 2 } else { 0 },
                    hUploadStream: if upload {
                        self.stream(c)
                    } else {
                        std::ptr::null_mut()
                    },
                    hErrNode_out: std::ptr::null_mut(),
                    result_out: -1,
                };
                unsafe { f(e, g, &mut p) }
            }
            other => panic!("g-instantiate: unknown {other}"),
        }
    }

    fn upload(&mut self, c: &Cuda) -> R {
        let s = self.stream(c);
        let f = f!(
            c,
            "cuGraphUpload",
            ptsz_name(c, "cuGraphUpload", "cuGraphUpload_ptsz"),
            fn(*mut c_void, *mut c_void)
        );
        unsafe { f(self.exec, s) }
    }

    fn launch(&mut self, c: &Cuda, dev: c_int, n: usize, how: &str) -> (Vec<String>, Vec<String>) {
        let s = self.stream(c);
        let launch = f!(
            c,
            "cuGraphLaunch",
            ptsz_name(c, "cuGraphLaunch", "cuGraphLaunch_ptsz"),
            fn(*mut c_void, *mut c_void)
        );
        let sync = f!(
            c,
            "cuStreamSynchronize",
            ptsz_name(c, "cuStreamSynchronize", "cuStreamSynchronize_ptsz"),
            fn(*mut c_void)
        );
        let free = f!(
            c,
            "cuMemFreeAsync",
            ptsz_name(c, "cuMemFreeAsync", "cuMemFreeAsync_ptsz"),
            fn(u64, *mut c_void)
        );
        let (mut rcs, mut after) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let rc = unsafe { launch(self.exec, s) };
            rcs.push(rc.to_string());
            unsafe { sync(s) };
            after.push(charged_and_held(c, dev));
            if rc == 0 && how == "free-sync" {
                let f = f!(c, "cuMemFree", "cuMemFree_v2", fn(u64));
                assert_eq!(unsafe { f(self.ptr) }, 0, "cuMemFree");
            } else if rc == 0 && how != "hold" {
                unsafe {
                    free(self.ptr, s);
                    sync(s);
                }
            }
        }
        (rcs, after)
    }

    fn destroy(&mut self, c: &Cuda) -> R {
        let e = f!(
            c,
            "cuGraphExecDestroy",
            "cuGraphExecDestroy",
            fn(*mut c_void)
        );
        let d = f!(c, "cuGraphDestroy", "cuGraphDestroy", fn(*mut c_void));
        let rc = unsafe { e(self.exec) };
        let rc2 = unsafe { d(self.graph) };
        *self = Graph {
            stream: self.stream,
            ..Graph::default()
        };
        if rc != 0 { rc } else { rc2 }
    }
}

/// `cuLaunchCooperativeKernelMultiDevice` of the spin kernel for `ns` on
/// devices 0 and 1 (a stream of each one's primary context); its result
/// and the streams' synchronisation's (the first failure).
fn coop_multi(c: &Cuda, ns: u64) -> (R, R) {
    let retain = f!(
        c,
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRetain",
        fn(*mut *mut c_void, c_int)
    );
    let set = f!(c, "cuCtxSetCurrent", "cuCtxSetCurrent", fn(*mut c_void));
    let create = f!(
        c,
        "cuStreamCreate",
        "cuStreamCreate",
        fn(*mut *mut c_void, c_uint)
    );
    let mut d = ns;
    let mut params = [(&mut d as *mut u64).cast::<c_void>()];
    let mut list = Vec::new();
    let mut ctxs = Vec::new();
    for dev in 0..2 {
        let mut ctx = std::ptr::null_mut();
        let mut stream = std::ptr::null_mut();
        unsafe {
            assert_eq!(retain(&mut ctx, dev), 0, "primary context of {dev}");
            set(ctx);
            assert_eq!(create(&mut stream, 1), 0, "stream on {dev}");
        }
        ctxs.push(ctx);
        list.push(gpufrac_common::cuda::CUDA_LAUNCH_PARAMS {
            function: Kernel::new(c, "cuLaunchKernel").func,
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 1,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream,
            kernelParams: params.as_mut_ptr(),
        });
    }
    let launch = f!(
        c,
        "cuLaunchCooperativeKernelMultiDevice",
        "cuLaunchCooperativeKernelMultiDevice",
        fn(*mut gpufrac_common::cuda::CUDA_LAUNCH_PARAMS, c_uint, c_uint)
    );
    // Launched from device 0, as a program driving several GPUs from one
    // thread usually is.
    unsafe { set(ctxs[0]) };
    let rc = unsafe { launch(list.as_mut_ptr(), list.len() as c_uint, 0) };
    let sync = f!(
        c,
        "cuStreamSynchronize",
        "cuStreamSynchronize",
        fn(*mut c_void)
    );
    let sync_rc = list
        .iter()
        .map(|p| unsafe { sync(p.hStream) })
        .find(|&r| r != 0)
        .unwrap_or(0);
    (rc, sync_rc)
}

/// Reserves a range of `size` bytes and maps `len` bytes of handle `h`
/// from `offset` at its start.
fn vmm_map(c: &Cuda, h: u64, size: usize, offset: usize, len: usize) -> Result<u64, R> {
    let mut va = 0u64;
    let rc = unsafe {
        f!(
            c,
            "cuMemAddressReserve",
            "cuMemAddressReserve",
            fn(*mut u64, usize, usize, u64, u64)
        )(&mut va, size, 0, 0, 0)
    };
    if rc != 0 {
        return Err(rc);
    }
    let rc = unsafe {
        f!(c, "cuMemMap", "cuMemMap", fn(u64, usize, usize, u64, u64))(va, len, offset, h, 0)
    };
    if rc != 0 {
        return Err(rc);
    }
    Ok(va)
}

fn origin(p: *mut c_void) -> String {
    if p.is_null() {
        return "null".into();
    }
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_fname.is_null() {
        return "unknown".into();
    }
    let f = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    f.rsplit('/').next().unwrap_or(&f).to_string()
}

#[path = "support/spin.rs"]
mod spin;
use spin::LaunchKernel;

/// The simulated driver's "spin" kernel and the launch entry point named
/// `variant`: one 1×1×1 launch on the default stream lasts `ns`.
struct Kernel {
    func: *mut c_void,
    launch: LaunchKernel,
}

impl Kernel {
    fn new(c: &Cuda, variant: &str) -> Kernel {
        let mut module: *mut c_void = std::ptr::null_mut();
        let load = f!(
            c,
            "cuModuleLoadData",
            "cuModuleLoadData",
            fn(*mut *mut c_void, *const c_void)
        );
        unsafe { load(&mut module, c"sim".as_ptr().cast()) };
        let mut func: *mut c_void = std::ptr::null_mut();
        let getf = f!(
            c,
            "cuModuleGetFunction",
            "cuModuleGetFunction",
            fn(*mut *mut c_void, *mut c_void, *const c_char)
        );
        unsafe { getf(&mut func, module, c"spin".as_ptr()) };
        let launch = unsafe {
            std::mem::transmute::<*mut c_void, LaunchKernel>(c.sym("cuLaunchKernel", variant))
        };
        Kernel { func, launch }
    }

    fn run(&self, ns: u64) -> R {
        spin::run(self.launch, self.func, ns)
    }
}

fn launch(c: &Cuda, n: usize, ns: u64) -> (R, String) {
    let k = Kernel::new(c, ptsz_name(c, "cuLaunchKernel", "cuLaunchKernel_ptsz"));
    let mut rc = 0;
    let mut variant = String::new();
    for _ in 0..n {
        rc = k.run(ns);
        variant = last_variant(c);
        if rc != 0 {
            break;
        }
    }
    let sync = f!(c, "cuCtxSynchronize", "cuCtxSynchronize", fn());
    unsafe { sync() };
    (rc, variant)
}

use gpufrac_common::clock::mono_ns;

fn spin(c: &Cuda, start: u64, end: u64, ns: u64, batch: usize) -> (u64, R) {
    let k = Kernel::new(c, "cuLaunchKernel");
    let sync = f!(c, "cuCtxSynchronize", "cuCtxSynchronize", fn());
    gpufrac_common::clock::sleep_until(start);
    let mut done = 0u64;
    loop {
        if mono_ns() >= end {
            return (done, 0);
        }
        for _ in 0..batch {
            let rc = k.run(ns);
            if rc != 0 {
                return (done, rc);
            }
        }
        unsafe { sync() };
        // Count only work that finished inside the window.
        if mono_ns() <= end {
            done += batch as u64;
        }
    }
}

fn uuid_string(u: &[u8; 16]) -> String {
    let mut s = String::from("GPU-");
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// `nvml-procs index=I uuid=U pids=P,Q` for each NVML device.
fn nvml_procs() {
    let lib = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
    assert!(!lib.is_null(), "dlopen libnvidia-ml.so.1");
    let sym = |n: &CStr| {
        let p = unsafe { libc::dlsym(lib, n.as_ptr()) };
        assert!(!p.is_null(), "{n:?}");
        p
    };
    unsafe {
        let init: unsafe extern "C" fn() -> R = std::mem::transmute(sym(c"nvmlInit_v2"));
        assert_eq!(init(), 0);
        let count: unsafe extern "C" fn(*mut c_uint) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetCount_v2"));
        let handle: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetHandleByIndex_v2"));
        let uuid: unsafe extern "C" fn(*mut c_void, *mut c_char, c_uint) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetUUID"));
        // nvmlProcessInfo_t: pid, usedGpuMemory, gpuInstanceId, computeInstanceId.
        let procs: unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut [u64; 3]) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetComputeRunningProcesses_v3"));
        let mut n = 0;
        count(&mut n);
        for i in 0..n {
            let mut h = std::ptr::null_mut();
            handle(i, &mut h);
            let mut buf = [0 as c_char; 96];
            uuid(h, buf.as_mut_ptr(), buf.len() as c_uint);
            let mut infos = [[0u64; 3]; 64];
            let mut k = infos.len() as c_uint;
            let rc = procs(h, &mut k, infos.as_mut_ptr());
            let pids: Vec<String> = infos[..(k as usize).min(infos.len())]
                .iter()
                .map(|p| (p[0] as u32).to_string())
                .collect();
            println!(
                "nvml-procs index={i} rc={rc} uuid={} pids={}",
                CStr::from_ptr(buf.as_ptr()).to_string_lossy(),
                pids.join(",")
            );
        }
    }
}

fn nvml_report() {
    let lib = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
    assert!(!lib.is_null(), "dlopen libnvidia-ml.so.1");
    let sym = |n: &CStr| {
        let p = unsafe { libc::dlsym(lib, n.as_ptr()) };
        assert!(!p.is_null(), "{n:?}");
        p
    };
    unsafe {
        let init: unsafe extern "C" fn() -> R = std::mem::transmute(sym(c"nvmlInit_v2"));
        assert_eq!(init(), 0);
        let count: unsafe extern "C" fn(*mut c_uint) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetCount_v2"));
        let handle: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetHandleByIndex_v2"));
        let info: unsafe extern "C" fn(*mut c_void, *mut [u64; 3]) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetMemoryInfo"));
        let info2: unsafe extern "C" fn(*mut c_void, *mut [u64; 5]) -> R =
            std::mem::transmute(sym(c"nvmlDeviceGetMemoryInfo_v2"));
        let mut n = 0;
        count(&mut n);
        for i in 0..n {
            let mut h = std::ptr::null_mut();
            handle(i, &mut h);
            let mut m = [0u64; 3];
            let rc = info(h, &mut m);
            let mut m2 = [0u64; 5];
            m2[0] = (40u64) | (2 << 24);
            let rc2 = info2(h, &mut m2);
            println!(
                "nvml index={i} rc={rc} total={} free={} used={} rc2={rc2} total2={} free2={} used2={}",
                m[0], m[1], m[2], m2[1], m2[3], m2[4]
            );
        }
    }
}
