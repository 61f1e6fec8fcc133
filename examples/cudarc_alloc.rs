//! A real cudarc 0.19 program that allocates device memory until it is
//! refused, used to check that libgpufrac.so caps programs which find the
//! driver the way cudarc does (dlopen("libcuda.so") + dlsym of each versioned
//! symbol). It runs against the simulated driver in the test suite and
//! against a real GPU in `gpu/run_suite.sh`.
//!
//! ```text
//! cudarc_alloc [--safe] [--block SIZE_MIB] [--max N] [--hold SECONDS]
//! ```
//!
//! - default (`mode=result`): cudarc's low-level `driver::result` API: cuInit,
//!   device 0, retain the primary context, make it current, then
//!   `result::malloc_sync` (cuMemAlloc_v2) blocks of SIZE_MIB MiB;
//! - `--safe` (`mode=safe`): the safe API: `CudaContext::new(0)`, the default
//!   stream and `stream.alloc_zeros::<u8>` (cuMemAllocAsync + cuMemsetD8Async
//!   on devices with memory pools, cuMemAlloc_v2 otherwise).
//!
//! It allocates until an allocation fails or N blocks are held, then prints
//! (holding the blocks for SECONDS after the first two lines, so that
//! `gpufrac status` can be seen with it running):
//!
//! ```text
//! cudarc mode=<result|safe> count=<n> err=<CUDA_ERROR_… | none>
//! cudarc info free=<bytes> total=<bytes>
//! cudarc realloc ok=<true|false>[ err=<CUDA_ERROR_…>]
//! cudarc freed ok=<true|false>[ err=<CUDA_ERROR_…>]
//! ```
//!
//! Exit status 0 when it ran to the end (an out-of-memory stop is the expected
//! outcome under a cap); 1 on an unexpected driver error; 2 on bad arguments.

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{CudaContext, CudaSlice};

const MIB: usize = 1 << 20;

struct Args {
    safe: bool,
    block_mib: usize,
    max: usize,
    hold: std::time::Duration,
}

fn usage(msg: &str) -> ! {
    eprintln!("cudarc_alloc: {msg}");
    eprintln!("usage: cudarc_alloc [--safe] [--block SIZE_MIB] [--max N] [--hold SECONDS]");
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut args = Args {
        safe: false,
        block_mib: 256,
        max: usize::MAX,
        hold: std::time::Duration::ZERO,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--safe" => args.safe = true,
            "--block" | "--max" => {
                let v = it
                    .next()
                    .unwrap_or_else(|| usage(&format!("{a} needs a value")));
                let n: usize = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("{a}: not a number: {v:?}")));
                if n == 0 {
                    usage(&format!("{a} must be at least 1"));
                }
                if a == "--block" {
                    args.block_mib = n;
                } else {
                    args.max = n;
                }
            }
            "--hold" => {
                let v = it.next().unwrap_or_else(|| usage("--hold needs a value"));
                args.hold = v
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
                    .unwrap_or_else(|| usage(&format!("--hold: not a number of seconds: {v:?}")));
            }
            "-h" | "--help" => usage("help"),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    if args.block_mib.checked_mul(MIB).is_none() {
        usage("--block is too large");
    }
    args
}

/// The CUresult's name (`CUDA_ERROR_OUT_OF_MEMORY`), taken from the enum so
/// that printing it needs no driver call (cuGetErrorName).
fn name(e: &DriverError) -> String {
    format!("{:?}", e.0)
}

fn err_suffix(r: &Result<(), DriverError>) -> String {
    match r {
        Ok(()) => String::new(),
        Err(e) => format!(" err={}", name(e)),
    }
}

fn report_count(mode: &str, count: usize, stop: Option<&DriverError>) {
    let err = stop.map_or_else(|| "none".to_string(), name);
    println!("cudarc mode={mode} count={count} err={err}");
}

fn report_info(info: Result<(usize, usize), DriverError>) -> bool {
    match info {
        Ok((free, total)) => {
            println!("cudarc info free={free} total={total}");
            true
        }
        Err(e) => {
            println!("cudarc info free=? total=? err={}", name(&e));
            false
        }
    }
}

/// Low-level `cudarc::driver::result` path. Returns whether everything that
/// should have worked did.
fn run_result(args: &Args) -> Result<bool, DriverError> {
    let bytes = args.block_mib * MIB;
    result::init()?;
    let dev = result::device::get(0)?;
    // SAFETY: `dev` comes from device::get.
    let ctx = unsafe { result::primary_ctx::retain(dev) }?;
    // SAFETY: `ctx` is the primary context just retained.
    unsafe { result::ctx::set_current(ctx) }?;

    let mut ok = true;
    let mut blocks = Vec::new();
    let mut stop = None;
    while blocks.len() < args.max {
        // SAFETY: the memory is only ever freed, never read.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(p) => blocks.push(p),
            Err(e) => {
                stop = Some(e);
                break;
            }
        }
    }
    let count = blocks.len();
    report_count("result", count, stop.as_ref());

    ok &= report_info(result::mem_get_info());
    std::thread::sleep(args.hold);

    // Free one block and allocate one again: the cap must give it back.
    let mut freed = Ok(());
    if let Some(p) = blocks.pop() {
        // SAFETY: `p` came from malloc_sync and is freed once.
        freed = unsafe { result::free_sync(p) };
    }
    let realloc = match freed {
        Ok(()) => unsafe { result::malloc_sync(bytes) }.map(|p| blocks.push(p)),
        Err(e) => Err(e),
    };
    println!(
        "cudarc realloc ok={}{}",
        realloc.is_ok(),
        err_suffix(&realloc)
    );
    // With no block held before, a block larger than the cap fails here too.
    ok &= realloc.is_ok() || count == 0;

    let mut all = Ok(());
    for p in blocks.drain(..) {
        // SAFETY: each pointer came from malloc_sync and is freed once.
        let r = unsafe { result::free_sync(p) };
        if all.is_ok() {
            all = r;
        }
    }
    println!("cudarc freed ok={}{}", all.is_ok(), err_suffix(&all));
    ok &= all.is_ok();

    // SAFETY: `dev` is valid and its primary context was retained above.
    let released = unsafe { result::primary_ctx::release(dev) };
    if let Err(e) = released {
        eprintln!("cudarc_alloc: cuDevicePrimaryCtxRelease_v2: {}", name(&e));
        ok = false;
    }
    Ok(ok)
}

/// Safe `CudaContext` / `CudaStream` path.
fn run_safe(args: &Args) -> Result<bool, DriverError> {
    let bytes = args.block_mib * MIB;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();

    let mut ok = true;
    let mut blocks: Vec<CudaSlice<u8>> = Vec::new();
    let mut stop = None;
    while blocks.len() < args.max {
        match stream.alloc_zeros::<u8>(bytes) {
            Ok(s) => blocks.push(s),
            Err(e) => {
                stop = Some(e);
                break;
            }
        }
    }
    let count = blocks.len();
    report_count("safe", count, stop.as_ref());

    ok &= report_info(ctx.mem_get_info());
    std::thread::sleep(args.hold);

    // Dropping a CudaSlice frees it (cuMemFreeAsync on pool-capable devices);
    // errors from Drop are kept in the context and read by check_err.
    let had_block = blocks.pop().is_some();
    let freed = ctx.check_err();
    let realloc = match freed {
        Ok(()) => stream.alloc_zeros::<u8>(bytes).map(|s| blocks.push(s)),
        Err(e) => Err(e),
    };
    println!(
        "cudarc realloc ok={}{}",
        realloc.is_ok(),
        err_suffix(&realloc)
    );
    ok &= realloc.is_ok() || !had_block;

    blocks.clear();
    let all = ctx.check_err().and_then(|()| stream.synchronize());
    println!("cudarc freed ok={}{}", all.is_ok(), err_suffix(&all));
    ok &= all.is_ok();
    Ok(ok)
}

fn main() {
    let args = parse_args();
    let run = if args.safe { run_safe } else { run_result };
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            println!(
                "cudarc mode={} error={}",
                if args.safe { "safe" } else { "result" },
                name(&e)
            );
            eprintln!("cudarc_alloc: unexpected driver error: {e:?}");
            std::process::exit(1);
        }
    }
}
