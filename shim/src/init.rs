//! Staged, lazy initialisation. Nothing happens in a library constructor:
//! a process that never calls CUDA (`sh`, `ls`, `python3 -c 1`) gets no
//! thread, no socket, no dlopen and no output from us. The first hook to fire
//! — whichever it is, on whichever thread — parses the configuration and
//! loads the driver; concurrent first callers wait for it, and a hook that
//! fires re-entrantly during init (on the initialising thread) is told so
//! instead of deadlocking.

use crate::table::{Family, INTERNAL, TABLE, call};
use crate::{devices, dlsym, ledger, log};
use gpufrac_common::config::{ShimConfig, from_raw_vars};
use gpufrac_common::cuda::*;
use std::cell::Cell;
use std::ffi::{c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

const UNINIT: u8 = 0;
const BUSY: u8 = 1;
const READY: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static CONFIG: OnceLock<Result<ShimConfig, String>> = OnceLock::new();
static CUDA_HANDLE: AtomicUsize = AtomicUsize::new(0);
static NVML_STATE: AtomicU8 = AtomicU8::new(UNINIT);

thread_local! {
    static INITIALISING: Cell<bool> = const { Cell::new(false) };
}

/// Sorted (real function address, hook address) pairs for every CUDA hook,
/// used to swap pointers handed out by `cuGetProcAddress`.
static REVERSE: OnceLock<Vec<(usize, usize)>> = OnceLock::new();

/// Parses the environment and loads libcuda.so.1 once. Returns the
/// configuration, or the message of the variable that was malformed.
pub fn ensure() -> Option<&'static Result<ShimConfig, String>> {
    if STATE.load(Ordering::Acquire) == READY {
        return CONFIG.get();
    }
    slow_init()
}

#[cold]
fn slow_init() -> Option<&'static Result<ShimConfig, String>> {
    if INITIALISING.with(|c| c.get()) {
        // Re-entered from inside our own init (the driver's constructor
        // calling back into us): the configuration may not exist yet.
        return CONFIG.get();
    }
    match STATE.compare_exchange(UNINIT, BUSY, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            INITIALISING.with(|c| c.set(true));
            do_init();
            INITIALISING.with(|c| c.set(false));
            STATE.store(READY, Ordering::Release);
        }
        Err(_) => {
            while STATE.load(Ordering::Acquire) != READY {
                std::thread::yield_now();
            }
        }
    }
    CONFIG.get()
}

fn do_init() {
    crate::boundary::install_panic_hook();
    // Bytes, not strings: a value that is not UTF-8 must be reported as
    // malformed, never skipped (skipping a cap would run uncapped).
    use std::os::unix::ffi::OsStrExt;
    let vars: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os()
        .filter(|(k, _)| {
            let k = k.as_bytes();
            k.starts_with(b"GPU_") || k.starts_with(b"GPUFRAC_")
        })
        .collect();
    let cfg = from_raw_vars(vars.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))
        .map_err(|e| e.to_string());
    match &cfg {
        Ok(c) => log::set_level(c.log),
        Err(msg) => log::write_line(format_args!(
            "{msg}; CUDA initialisation will fail with CUDA_ERROR_INVALID_VALUE until this is fixed"
        )),
    }
    let _ = CONFIG.set(cfg);
    load_cuda();
    register_fork_handlers();
}

/// Loads the real driver and resolves every CUDA slot from *its* handle, so
/// our own exports are never mistaken for the driver's.
fn load_cuda() {
    // SAFETY: plain dlopen of the driver by its soname.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        warn!("libcuda.so.1 could not be loaded; CUDA calls will fail");
        return;
    }
    CUDA_HANDLE.store(h as usize, Ordering::Release);
    resolve_family(h, Family::Cuda);
    let mut rev: Vec<(usize, usize)> = TABLE
        .iter()
        .filter(|e| e.family == Family::Cuda)
        .filter_map(|e| {
            let r = e.real.load(Ordering::Acquire);
            (r != 0).then_some((r, e.hook as usize))
        })
        .collect();
    rev.sort_unstable();
    let _ = REVERSE.set(rev);
}

fn resolve_family(handle: *mut c_void, fam: Family) {
    for e in TABLE
        .iter()
        .chain(INTERNAL.iter())
        .filter(|e| e.family == fam)
    {
        // SAFETY: name is NUL-terminated; real_dlsym is glibc's dlsym.
        let p = unsafe { dlsym::real_dlsym(handle, e.name.as_ptr().cast()) };
        e.real.store(p as usize, Ordering::Release);
    }
}

/// Loads NVML lazily: only a process that calls an NVML hook pays for it.
pub fn ensure_nvml() {
    if NVML_STATE.load(Ordering::Acquire) == READY {
        return;
    }
    if NVML_STATE
        .compare_exchange(UNINIT, BUSY, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // SAFETY: dlopen by soname; the application already loaded it.
        let h = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
        if !h.is_null() {
            resolve_family(h, Family::Nvml);
        }
        NVML_STATE.store(READY, Ordering::Release);
    } else {
        while NVML_STATE.load(Ordering::Acquire) != READY {
            std::thread::yield_now();
        }
    }
}

/// cudart may be linked statically, loaded globally, or — as frameworks do
/// — as a dependency of a library opened with RTLD_LOCAL, which RTLD_NEXT
/// cannot see although our export still interposes its callers. So after
/// RTLD_NEXT, every loaded object is asked in turn.
pub fn ensure_cudart() {
    for e in TABLE.iter().filter(|e| e.family == Family::Cudart) {
        if e.real.load(Ordering::Acquire) != 0 {
            continue;
        }
        // SAFETY: RTLD_NEXT from our own code finds the next definition.
        let mut p = unsafe { dlsym::real_dlsym(libc::RTLD_NEXT, e.name.as_ptr().cast()) } as usize;
        if p == 0 {
            p = search_loaded_objects(e.name, e.hook as usize);
        }
        debug!("{}: real at {p:#x}", e.name_str());
        e.real.store(p, Ordering::Release);
    }
}

fn search_loaded_objects(name: &'static [u8], ours: usize) -> usize {
    struct Ctx {
        name: &'static [u8],
        ours: usize,
        found: usize,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> libc::c_int {
        let ctx = unsafe { &mut *data.cast::<Ctx>() };
        let obj = unsafe { (*info).dlpi_name };
        if obj.is_null() || unsafe { *obj } == 0 {
            return 0;
        }
        // SAFETY: a path the loader gave us; NOLOAD only takes a reference.
        let h = unsafe { libc::dlopen(obj, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if h.is_null() {
            return 0;
        }
        let p = unsafe { dlsym::real_dlsym(h, ctx.name.as_ptr().cast()) } as usize;
        unsafe { libc::dlclose(h) };
        if p != 0 && p != ctx.ours {
            ctx.found = p;
            return 1;
        }
        0
    }
    let mut ctx = Ctx {
        name,
        ours,
        found: 0,
    };
    // SAFETY: the callback only reads loader-provided data.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut ctx as *mut Ctx).cast()) };
    ctx.found
}

/// Makes sure the real functions of a family are resolved (used by the
/// panic fallback path, which must still reach the driver).
pub fn ensure_family(f: Family) {
    match f {
        Family::Cuda => {
            ensure();
        }
        Family::Nvml => ensure_nvml(),
        Family::Cudart => ensure_cudart(),
    }
}

/// The configuration, if it parsed. `Err(code)` is what a CUDA entry point
/// must answer when it did not.
#[inline]
pub fn config() -> Result<&'static ShimConfig, u32> {
    match ensure() {
        Some(Ok(c)) => Ok(c),
        Some(Err(_)) => Err(CUDA_ERROR_INVALID_VALUE),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// Maps a real driver function address to our hook for the same versioned
/// symbol, or returns it unchanged when we do not hook it.
pub fn hook_for_real(p: usize) -> Option<usize> {
    let rev = REVERSE.get()?;
    rev.binary_search_by_key(&p, |&(r, _)| r)
        .ok()
        .map(|i| rev[i].1)
}

/// `cuInit` hook: refuses to initialise CUDA under a malformed
/// configuration (a user who asked for a cap must never run uncapped), and
/// learns the devices' physical sizes once the driver is up.
pub unsafe fn cu_init(flags: c_uint) -> u32 {
    let cfg = match config() {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Err(code) = crate::client::check_required(cfg) {
        return code;
    }
    let rc = unsafe { call::cuInit(flags) };
    if rc == CUDA_SUCCESS {
        // Caps are learned now; if that fails, allocations retry it and
        // refuse until it succeeds.
        let _ = devices::ensure();
    }
    rc
}

fn register_fork_handlers() {
    // SAFETY: registering plain extern "C" callbacks.
    unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_child));
    }
}

/// CUDA cannot be used in a child forked after initialisation, so the child
/// starts with clean books: zero usage, fresh maps (the old ones may be
/// locked by threads that do not exist in the child), no broker connection.
extern "C" fn after_fork_child() {
    ledger::reset_after_fork();
    crate::vmm::reset_after_fork();
    crate::client::reset_after_fork();
}
