//! GPU load generator for the latency and share tests and the bench: the
//! two kinds of neighbour users put side by side on one GPU.
//!
//! ```text
//! loadgen batch       KERNEL_US START END [DEPTH [TRACE_MS]]
//! loadgen interactive KERNELS KERNEL_US PERIOD_US START END [samples]
//! ```
//!
//! START and END are CLOCK_MONOTONIC instants in ns (the tests give every
//! process the same window), or `+SECONDS` after loadgen starts
//! (`+1 +11`: from one second from now for ten seconds), for use by hand.
//!
//! `batch` keeps DEPTH (default 4) kernels of KERNEL_US queued from START to
//! END and prints `batch kernels=N executed_ns=T`, T being the GPU time the
//! driver ran for this process inside the window when it can tell (the
//! simulated driver's test export), else N × KERNEL_US. With TRACE_MS (and
//! that export) it also prints `trace step_ms=S executed_ns=A,B,…`: the GPU
//! time run from START to START + S, + 2S, …, up to END (the bench plots
//! shares over time from it).
//!
//! `interactive` sends a request every PERIOD_US: KERNELS kernels of
//! KERNEL_US queued at once, then a stream synchronize; a request's latency
//! runs from its first launch to the synchronize's return. It prints
//! `interactive requests=N p50_us=… p95_us=… p99_us=… max_us=… missed=M`, M being the
//! requests that took longer than the period. With `samples`, it also
//! prints `latencies us=L1,L2,…`, every request's latency in the order sent.
//!
//! It finds the driver as cudarc does (dlopen + dlsym) and uses the
//! simulated driver's kernel convention: the first kernel parameter is the
//! duration in ns. On a real GPU, use gpu/ instead.

// The call! macro transmutes inside its own unsafe block and is also used
// inside unsafe expressions.
#![allow(unused_unsafe)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use gpufrac_common::clock::{mono_ns, sleep_until};

#[path = "support/spin.rs"]
mod spin;
use spin::LaunchKernel;

type R = u32;

struct Gpu {
    lib: *mut c_void,
    func: *mut c_void,
    launch: LaunchKernel,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> R,
}

fn sym(lib: *mut c_void, name: &CStr) -> *mut c_void {
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    assert!(!p.is_null(), "no {name:?} in libcuda.so.1");
    p
}

macro_rules! call {
    ($lib:expr, $name:literal, fn($($t:ty),*)) => {
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> R>(sym(
                $lib,
                $name,
            ))
        }
    };
}

fn check(what: &str, rc: R) {
    if rc != 0 {
        eprintln!("loadgen: {what} failed with CUDA error {rc}");
        std::process::exit(1);
    }
}

impl Gpu {
    fn open() -> Gpu {
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        assert!(!lib.is_null(), "dlopen libcuda.so.1 failed");
        check("cuInit", unsafe { call!(lib, c"cuInit", fn(c_uint))(0) });
        let mut ctx = std::ptr::null_mut();
        let retain = call!(
            lib,
            c"cuDevicePrimaryCtxRetain",
            fn(*mut *mut c_void, c_int)
        );
        check("cuDevicePrimaryCtxRetain", unsafe { retain(&mut ctx, 0) });
        check("cuCtxSetCurrent", unsafe {
            call!(lib, c"cuCtxSetCurrent", fn(*mut c_void))(ctx)
        });
        let mut module = std::ptr::null_mut();
        check("cuModuleLoadData", unsafe {
            call!(
                lib,
                c"cuModuleLoadData",
                fn(*mut *mut c_void, *const c_void)
            )(&mut module, c"sim".as_ptr().cast())
        });
        let mut func = std::ptr::null_mut();
        check("cuModuleGetFunction", unsafe {
            call!(
                lib,
                c"cuModuleGetFunction",
                fn(*mut *mut c_void, *mut c_void, *const c_char)
            )(&mut func, module, c"spin".as_ptr())
        });
        Gpu {
            lib,
            func,
            launch: unsafe {
                std::mem::transmute::<*mut c_void, LaunchKernel>(sym(lib, c"cuLaunchKernel"))
            },
            stream_sync: call!(lib, c"cuStreamSynchronize", fn(*mut c_void)),
        }
    }

    fn kernel(&self, ns: u64) {
        check("cuLaunchKernel", spin::run(self.launch, self.func, ns));
    }

    fn sync(&self) {
        check("cuStreamSynchronize", unsafe {
            (self.stream_sync)(std::ptr::null_mut())
        });
    }

    /// GPU time the driver has run for this process at `t`, when it can
    /// say (the simulated driver's test export).
    fn executed_at(lib: usize, t: u64) -> Option<u64> {
        let p = unsafe { libc::dlsym(lib as *mut c_void, c"gpufracSimExecutedNs".as_ptr()) };
        if p.is_null() {
            return None;
        }
        let f: unsafe extern "C" fn(c_int) -> u64 = unsafe { std::mem::transmute(p) };
        sleep_until(t);
        Some(unsafe { f(0) })
    }
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i).and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        eprintln!("loadgen: argument {i} ({what}) missing or malformed");
        std::process::exit(2)
    })
}

/// An instant: CLOCK_MONOTONIC ns, or `+SECONDS` after `base`.
fn instant(args: &[String], i: usize, what: &str, base: u64) -> u64 {
    match args.get(i).and_then(|s| s.strip_prefix('+')) {
        Some(s) => match s.parse::<f64>() {
            Ok(secs) if secs.is_finite() && secs >= 0.0 => base + (secs * 1e9) as u64,
            _ => {
                eprintln!("loadgen: argument {i} ({what}): expected +SECONDS such as +1 or +10.5");
                std::process::exit(2)
            }
        },
        None => arg(args, i, what),
    }
}

fn batch(args: &[String], base: u64) {
    let kernel_ns = arg::<u64>(args, 0, "KERNEL_US") * 1000;
    let (start, end) = (
        instant(args, 1, "START", base),
        instant(args, 2, "END", base),
    );
    let depth = args.get(3).map_or(4, |_| arg::<usize>(args, 3, "DEPTH"));
    let trace_ns = args
        .get(4)
        .map(|_| arg::<u64>(args, 4, "TRACE_MS") * 1_000_000)
        .filter(|&t| t > 0);
    let gpu = Gpu::open();
    gpu.sync();
    // The GPU time ran inside the window is sampled at its edges (and, for
    // a trace, at every step between) by a thread of its own: the
    // launching thread is usually blocked in a synchronize when the window
    // closes.
    let lib = gpu.lib as usize;
    let sampler = std::thread::spawn(move || {
        let g = Gpu::executed_at(lib, start)?;
        let mut trace = Vec::new();
        if let Some(step) = trace_ns {
            let mut t = start + step;
            while t <= end {
                trace.push(Gpu::executed_at(lib, t)? - g);
                t += step;
            }
        }
        let h = Gpu::executed_at(lib, end)?;
        Some((h - g, trace))
    });
    sleep_until(start);
    let mut done = 0u64;
    while mono_ns() < end {
        for _ in 0..depth {
            gpu.kernel(kernel_ns);
        }
        gpu.sync();
        if mono_ns() <= end {
            done += depth as u64;
        }
    }
    let sampled = sampler.join().ok().flatten();
    let executed = sampled.as_ref().map_or(done * kernel_ns, |s| s.0);
    println!("batch kernels={done} executed_ns={executed}");
    if let (Some(step), Some((_, trace))) = (trace_ns, sampled) {
        let list: Vec<String> = trace.iter().map(u64::to_string).collect();
        println!(
            "trace step_ms={} executed_ns={}",
            step / 1_000_000,
            list.join(",")
        );
    }
}

fn interactive(args: &[String], base: u64) {
    let kernels: usize = arg(args, 0, "KERNELS");
    let kernel_ns = arg::<u64>(args, 1, "KERNEL_US") * 1000;
    let period = arg::<u64>(args, 2, "PERIOD_US") * 1000;
    let (start, end) = (
        instant(args, 3, "START", base),
        instant(args, 4, "END", base),
    );
    let samples = match args.get(5).map(String::as_str) {
        None => false,
        Some("samples") => true,
        Some(other) => {
            eprintln!("loadgen: argument 5: expected `samples` or nothing, got {other:?}");
            std::process::exit(2)
        }
    };
    let gpu = Gpu::open();
    // One warm-up request, outside the measurement, as a server makes
    // before it takes traffic (late enough to go through the broker, which
    // the shim joins in the background).
    sleep_until(start.saturating_sub(200_000_000));
    for _ in 0..kernels {
        gpu.kernel(kernel_ns);
    }
    gpu.sync();
    let mut lat = Vec::new();
    let mut next = start;
    while next < end {
        sleep_until(next);
        let t0 = mono_ns();
        for _ in 0..kernels {
            gpu.kernel(kernel_ns);
        }
        gpu.sync();
        lat.push(mono_ns() - t0);
        next += period;
        // A request late past its whole period skips the slots it missed,
        // as a server with a deadline would.
        while next + period < mono_ns() {
            next += period;
        }
    }
    if samples {
        let list: Vec<String> = lat.iter().map(|l| (l / 1000).to_string()).collect();
        println!("latencies us={}", list.join(","));
    }
    lat.sort_unstable();
    let pct = |p: f64| {
        let i = ((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len().max(1)) - 1;
        lat.get(i).copied().unwrap_or(0) / 1000
    };
    let missed = lat.iter().filter(|&&l| l > period).count();
    println!(
        "interactive requests={} p50_us={} p95_us={} p99_us={} max_us={} missed={missed}",
        lat.len(),
        pct(0.50),
        pct(0.95),
        pct(0.99),
        lat.last().copied().unwrap_or(0) / 1000
    );
}

fn main() {
    // Read once, so that `+1 +11` is one ten-second window.
    let base = mono_ns();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("batch") => batch(&args[1..], base),
        Some("interactive") => interactive(&args[1..], base),
        _ => {
            eprintln!(
                "usage: loadgen batch KERNEL_US START END [DEPTH [TRACE_MS]]\n       loadgen interactive KERNELS KERNEL_US PERIOD_US START END [samples]\n\
                 START, END: CLOCK_MONOTONIC ns, or +SECONDS from now (e.g. +1 +11)"
            );
            std::process::exit(2);
        }
    }
}
