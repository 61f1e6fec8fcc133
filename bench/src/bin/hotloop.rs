//! gpufrac-hotloop: in-process timing of the CUDA driver calls the shim
//! hooks, run natively or under LD_PRELOAD=libgpufrac.so by gpufrac-bench.
//!
//! It finds the driver the way cudarc and cudart do, with
//! dlopen("libcuda.so.1") + dlsym at run time (so under the shim it gets the
//! hooks through the shim's dlsym), and links neither the shim nor a CUDA
//! binding.
//!
//! Modes (each prints one `key=value` line per measurement):
//!
//! - `hook LAUNCHES PAIRS LOOKUPS [--holder]`: ns/op of `cuLaunchKernel`
//!   of a 0-ns kernel, of a `cuMemAlloc_v2` + `cuMemFree_v2` pair of 4 KiB,
//!   and of `cuGetProcAddress_v2("cuMemAlloc", 12080)`. Work is timed in
//!   chunks of 1000 operations; the median chunk is reported (and the
//!   fastest, `*_min_ns`). Launches are synchronised after every chunk,
//!   outside the timed region (the sync is excluded, not amortised). With `--holder` (broker runs) it
//!   first launches until the broker's status names this process as the
//!   GPU's holder, and checks again after timing.
//! - `free-scale LIVE PAIRS [lifo]`: with LIVE 4 KiB allocations held, ns per
//!   alloc+free pair, twice: freeing the block just allocated (`lifo`) and
//!   freeing a pseudo-random live block (`random`, the new one takes its
//!   place); then, as a reference, the same LIFO pattern on a plain std
//!   HashMap of LIVE entries (no driver, no lock).
//! - `spin START END KERNEL_NS BATCH`: like the probe's `spin` step —
//!   launches KERNEL_NS kernels between START and END (CLOCK_MONOTONIC ns),
//!   syncing every BATCH launches, and counts the kernels completed inside
//!   the window. It also counts launch calls that blocked more than 200 us
//!   (`stalls`: the compute gate waiting for a timeslice) and their time.
//!   It sets its timer slack to 1 ns so that the simulated synchronize,
//!   which sleeps until the last kernel ends, returns as promptly as a real
//!   one (which spin-waits).

use gpufrac_bench::clock::{mono_ns, sleep_until};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

type R = u32;
type LaunchFn = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> R;
type GpaFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> R;

const CHUNK: usize = 1000;
const STALL_NS: u64 = 200_000;

struct Cuda {
    launch: LaunchFn,
    sync: unsafe extern "C" fn() -> R,
    alloc: unsafe extern "C" fn(*mut u64, usize) -> R,
    free: unsafe extern "C" fn(u64) -> R,
    gpa: GpaFn,
    func: *mut c_void,
}

fn die(msg: &str) -> ! {
    eprintln!("gpufrac-hotloop: {msg}");
    std::process::exit(2)
}

fn sym(lib: *mut c_void, name: &CStr) -> *mut c_void {
    // SAFETY: lib is a live dlopen handle; name is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        die(&format!("dlsym({name:?}) failed"));
    }
    p
}

macro_rules! typed {
    ($lib:expr, $name:literal, $t:ty) => {{
        let p = sym($lib, $name);
        // SAFETY: the driver's exported symbol of this name has this C
        // signature.
        unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
    }};
}

fn check(what: &str, rc: R) {
    if rc != 0 {
        die(&format!("{what} returned {rc}"));
    }
}

impl Cuda {
    /// dlopen + cuInit + primary context on device 0 + a module function.
    fn open() -> Cuda {
        // SAFETY: plain dlopen of the driver.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            die("dlopen(libcuda.so.1) failed");
        }
        let init = typed!(lib, c"cuInit", unsafe extern "C" fn(c_uint) -> R);
        let retain = typed!(
            lib,
            c"cuDevicePrimaryCtxRetain",
            unsafe extern "C" fn(*mut *mut c_void, c_int) -> R
        );
        let set = typed!(
            lib,
            c"cuCtxSetCurrent",
            unsafe extern "C" fn(*mut c_void) -> R
        );
        let load = typed!(
            lib,
            c"cuModuleLoadData",
            unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> R
        );
        let getf = typed!(
            lib,
            c"cuModuleGetFunction",
            unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> R
        );
        let mut ctx = std::ptr::null_mut();
        let mut module = std::ptr::null_mut();
        let mut func = std::ptr::null_mut();
        // SAFETY: driver calls with valid out-pointers.
        unsafe {
            check("cuInit", init(0));
            check("cuDevicePrimaryCtxRetain", retain(&mut ctx, 0));
            check("cuCtxSetCurrent", set(ctx));
            check(
                "cuModuleLoadData",
                load(&mut module, c"sim".as_ptr().cast()),
            );
            check(
                "cuModuleGetFunction",
                getf(&mut func, module, c"spin".as_ptr()),
            );
        }
        Cuda {
            launch: typed!(lib, c"cuLaunchKernel", LaunchFn),
            sync: typed!(lib, c"cuCtxSynchronize", unsafe extern "C" fn() -> R),
            alloc: typed!(
                lib,
                c"cuMemAlloc_v2",
                unsafe extern "C" fn(*mut u64, usize) -> R
            ),
            free: typed!(lib, c"cuMemFree_v2", unsafe extern "C" fn(u64) -> R),
            gpa: typed!(lib, c"cuGetProcAddress_v2", GpaFn),
            func,
        }
    }

    #[inline(always)]
    fn launch(&self, params: &mut [*mut c_void; 1]) -> R {
        // SAFETY: a valid function handle and a kernelParams array whose
        // first entry points to the u64 duration (the simulator's convention).
        unsafe {
            (self.launch)(
                self.func,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }

    fn sync(&self) -> R {
        // SAFETY: no arguments.
        unsafe { (self.sync)() }
    }

    #[inline(always)]
    fn alloc(&self, size: usize) -> u64 {
        let mut p = 0u64;
        // SAFETY: valid out-pointer.
        let rc = unsafe { (self.alloc)(&mut p, size) };
        if rc != 0 {
            die(&format!("cuMemAlloc_v2 returned {rc}"));
        }
        p
    }

    #[inline(always)]
    fn free(&self, p: u64) {
        // SAFETY: a pointer this process allocated and has not freed.
        let rc = unsafe { (self.free)(p) };
        if rc != 0 {
            die(&format!("cuMemFree_v2 returned {rc}"));
        }
    }
}

/// Median ns/op over `chunks` timed chunks of CHUNK operations; `between`
/// runs after each chunk, outside the timing.
fn timed(chunks: usize, op: impl FnMut(), between: impl FnMut()) -> f64 {
    timed2(chunks, op, between).0
}

/// (median, minimum) ns/op over the chunks.
fn timed2(chunks: usize, mut op: impl FnMut(), mut between: impl FnMut()) -> (f64, f64) {
    let mut per = Vec::with_capacity(chunks);
    for _ in 0..chunks.max(1) {
        let t = mono_ns();
        for _ in 0..CHUNK {
            op();
        }
        per.push((mono_ns() - t) as f64 / CHUNK as f64);
        between();
    }
    (
        gpufrac_bench::stats::median(&per),
        gpufrac_bench::stats::min(&per),
    )
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die(&format!("argument {i} ({what}) missing or malformed")))
}

/// Is this process the holder of device 0 in the broker's view?
fn holder_is_me() -> Result<bool, String> {
    let socket = std::env::var_os("GPUFRAC_SOCKET").ok_or("GPUFRAC_SOCKET is not set")?;
    let st = gpufrac_bench::wirec::status(std::path::Path::new(&socket))?;
    let me = u64::from(std::process::id());
    Ok(st["gpus"][0]["holder"].as_u64() == Some(me))
}

fn hook(args: &[String]) {
    let launches: usize = arg(args, 0, "LAUNCHES");
    let pairs: usize = arg(args, 1, "PAIRS");
    let lookups: usize = arg(args, 2, "LOOKUPS");
    let holder = args.iter().any(|a| a == "--holder");
    let c = Cuda::open();
    let mut d = 0u64;
    let mut params = [(&mut d as *mut u64).cast::<c_void>()];

    // Warm-up: caches, lazy initialisation, and (with a broker) the
    // registration and the first, open-ended grant.
    let deadline = mono_ns() + 10_000_000_000;
    let mut warm_rounds = 0;
    loop {
        for _ in 0..CHUNK {
            check("cuLaunchKernel", c.launch(&mut params));
        }
        check("cuCtxSynchronize", c.sync());
        let p = c.alloc(4096);
        c.free(p);
        warm_rounds += 1;
        if !holder {
            if warm_rounds >= 20 {
                break;
            }
            continue;
        }
        match holder_is_me() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => die(&format!("broker status: {e}")),
        }
        if mono_ns() > deadline {
            die("this process never became the GPU's holder");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }

    let (launch_ns, launch_min) = timed2(
        launches / CHUNK,
        || {
            let rc = c.launch(&mut params);
            debug_assert_eq!(rc, 0);
        },
        || check("cuCtxSynchronize", c.sync()),
    );
    let (alloc_free_ns, alloc_min) = timed2(
        pairs / CHUNK,
        || {
            let p = c.alloc(4096);
            c.free(p);
        },
        || {},
    );
    let mut pfn = std::ptr::null_mut();
    let mut status: c_int = 0;
    let (gpa_ns, gpa_min) = timed2(
        lookups / CHUNK,
        || {
            // SAFETY: valid name and out-pointers.
            let rc = unsafe { (c.gpa)(c"cuMemAlloc".as_ptr(), &mut pfn, 12080, 0, &mut status) };
            debug_assert_eq!(rc, 0);
        },
        || {},
    );
    let still = if holder {
        match holder_is_me() {
            Ok(b) => u8::from(b).to_string(),
            Err(e) => die(&format!("broker status: {e}")),
        }
    } else {
        "-".into()
    };
    println!(
        "hook launch_ns={launch_ns:.2} alloc_free_ns={alloc_free_ns:.2} gpa_ns={gpa_ns:.2} \
         launch_min_ns={launch_min:.2} alloc_free_min_ns={alloc_min:.2} gpa_min_ns={gpa_min:.2} \
         holder_after={still}"
    );
}

fn free_scale(args: &[String]) {
    let live: usize = arg(args, 0, "LIVE");
    let pairs: usize = arg(args, 1, "PAIRS");
    // `lifo` as a third argument times only that pattern (for profiling).
    let only_lifo = args.get(2).is_some_and(|a| a == "lifo");
    let c = Cuda::open();
    let mut held: Vec<u64> = (0..live.max(1)).map(|_| c.alloc(4096)).collect();
    // Warm the paths once at this size.
    for _ in 0..CHUNK {
        let p = c.alloc(4096);
        c.free(p);
    }
    let lifo = timed(
        pairs / CHUNK,
        || {
            let p = c.alloc(4096);
            c.free(p);
        },
        || {},
    );
    if only_lifo {
        println!("free-scale live={live} lifo_ns={lifo:.2}");
        return;
    }
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let n = held.len() as u64;
    let random = timed(
        pairs / CHUNK,
        || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % n) as usize;
            let p = c.alloc(4096);
            c.free(held[i]);
            held[i] = p;
        },
        || {},
    );
    drop(held);
    // Reference: a plain std HashMap, the structure the shim's ledger uses
    // per shard, with LIVE entries of the shim's record size and keys laid
    // out like the simulated driver's addresses, inserting a fresh key and
    // removing it again. It has no lock and no driver call: its growth with
    // LIVE is what cache and TLB misses alone cost.
    let stride = 4608u64;
    let base = 0x7f00_0000_0000u64;
    let mut map: std::collections::HashMap<u64, (u64, u32, usize)> = (0..live as u64)
        .map(|i| (base + i * stride, (4096, 0, 1)))
        .collect();
    let mut next = base + live as u64 * stride;
    let reference = timed(
        pairs / CHUNK,
        || {
            map.insert(next, (4096, 0, 1));
            std::hint::black_box(map.remove(&next));
            next += stride;
        },
        || {},
    );
    println!(
        "free-scale live={live} lifo_ns={lifo:.2} random_ns={random:.2} hashmap_ns={reference:.2}"
    );
}

fn spin(args: &[String]) {
    let start: u64 = arg(args, 0, "START");
    let end: u64 = arg(args, 1, "END");
    let kernel_ns: u64 = arg(args, 2, "KERNEL_NS");
    let batch: usize = arg(args, 3, "BATCH");
    let c = Cuda::open();
    // A real GPU's synchronize spin-waits and returns within microseconds
    // of the last kernel's end; the simulated one sleeps until then, and
    // with the default 50 us timer slack would add ~4% idle per 2 ms batch
    // to a lone process. 1 ns slack keeps the simulated sync prompt. Set
    // after the context exists, so the shim's client thread (started with
    // the context) keeps the default slack.
    // SAFETY: prctl on the calling thread, no pointers.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let mut d = kernel_ns;
    let mut params = [(&mut d as *mut u64).cast::<c_void>()];
    sleep_until(start);
    let (mut done, mut stalls, mut stall_ns) = (0u64, 0u64, 0u64);
    while mono_ns() < end {
        for _ in 0..batch {
            let t = mono_ns();
            check("cuLaunchKernel", c.launch(&mut params));
            let took = mono_ns() - t;
            if took > STALL_NS && t < end {
                stalls += 1;
                stall_ns += took;
            }
        }
        check("cuCtxSynchronize", c.sync());
        // Count only work that finished inside the window.
        if mono_ns() <= end {
            done += batch as u64;
        }
    }
    println!("spin kernels={done} stalls={stalls} stall_ns={stall_ns}");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("hook") => hook(&args[1..]),
        Some("free-scale") => free_scale(&args[1..]),
        Some("spin") => spin(&args[1..]),
        _ => die(
            "usage: gpufrac-hotloop hook LAUNCHES PAIRS LOOKUPS [--holder] | free-scale LIVE PAIRS | spin START END KERNEL_NS BATCH",
        ),
    }
}
