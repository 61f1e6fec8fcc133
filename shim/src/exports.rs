//! The export table, on top of everything: the hook list (`hooklist.rs`)
//! expanded into the exported symbols (what `-lcuda` programs bind to),
//! each a boundary around its hook, and into `TABLE`, which `dlsym` and
//! `cuGetProcAddress` use to swap a real pointer for its hook.
//!
//! The lookups that hand hooks out (`cuGetProcAddress`, cudart's
//! `cudaGetDriverEntryPoint`) are hooks themselves, listed in the table
//! they read: they live here with it, in `procaddr` below.
//!
//! Compiled into the library only, never into the unit tests: its exported
//! `cu*` symbols (and `dlsym`'s) would take over the test binary itself.

use crate::driver::{self, Family, real};
use crate::hooks::{ctx, graphmem, info, init, launch, mem, nvml, process, vmm};
use crate::{boundary, config};
use gpufrac_common::cuda::*;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
        driver::name_str(self.name)
    }
}

macro_rules! define_exports {
    (
        fail_closed { $( $afam:ident fn $aname:ident ( $($aarg:ident : $aty:ty),* $(,)? ) => $aimp:path; )* }
        pass_through { $( $pfam:ident fn $pname:ident ( $($parg:ident : $pty:ty),* $(,)? ) => $pimp:path; )* }
        pass_through_settled { $( $sfam:ident fn $sname:ident ( $($sarg:ident : $sty:ty),* $(,)? ) => $simp:path; )* }
        internal { $( $ifam:ident fn $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ); )* }
    ) => {
        /// The exported hooks: each one is a boundary around its policy.
        #[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]
        pub mod symbols {
            use super::*;
            $(
                #[unsafe(no_mangle)]
                pub unsafe extern "C" fn $aname($($aarg: $aty),*) -> u32 {
                    static TOLD: AtomicBool = AtomicBool::new(false);
                    boundary::fail_closed(stringify!($aname), &TOLD, move || {
                        boundary::fault(stringify!($aname));
                        unsafe { $aimp($($aarg),*) }
                    })
                }
            )*
            $(
                #[unsafe(no_mangle)]
                pub unsafe extern "C" fn $pname($($parg: $pty),*) -> u32 {
                    static TOLD: AtomicBool = AtomicBool::new(false);
                    boundary::pass_through(
                        stringify!($pname),
                        &TOLD,
                        &real::$pname,
                        move || {
                            boundary::fault(stringify!($pname));
                            let rc = unsafe { $pimp($($parg),*) };
                            boundary::fault_after(stringify!($pname));
                            rc
                        },
                        // Inlined into the unwinding path, as it was when
                        // the boundary took it directly: an outlined
                        // closure makes every call spill its arguments.
                        #[inline(always)]
                        move || {
                            ensure_family(Family::$pfam);
                            unsafe { driver::call::$pname($($parg),*) }
                        },
                    )
                }
            )*
            $(
                #[unsafe(no_mangle)]
                pub unsafe extern "C" fn $sname($($sarg: $sty),*) -> u32 {
                    static TOLD: AtomicBool = AtomicBool::new(false);
                    boundary::pass_through_settled(
                        stringify!($sname),
                        &TOLD,
                        move || {
                            boundary::fault(stringify!($sname));
                            unsafe { $simp($($sarg),*) }
                        },
                        #[inline(always)]
                        move || {
                            ensure_family(Family::$sfam);
                            unsafe { driver::forward::$sname($($sarg),*) }
                        },
                    )
                }
            )*
        }

        /// Every exported hook.
        pub static TABLE: &[HookEntry] = &[
            $( HookEntry {
                name: concat!(stringify!($aname), "\0").as_bytes(),
                family: Family::$afam,
                hook: symbols::$aname as *const (),
                real: &real::$aname,
            }, )*
            $( HookEntry {
                name: concat!(stringify!($pname), "\0").as_bytes(),
                family: Family::$pfam,
                hook: symbols::$pname as *const (),
                real: &real::$pname,
            }, )*
            $( HookEntry {
                name: concat!(stringify!($sname), "\0").as_bytes(),
                family: Family::$sfam,
                hook: symbols::$sname as *const (),
                real: &real::$sname,
            }, )*
        ];
    };
}

crate::hooklist::with_hook_list!(define_exports);

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

/// Makes sure the real functions of a family are resolved (a hook that
/// failed still has to reach the driver).
pub fn ensure_family(f: Family) {
    match f {
        Family::Cuda => {
            process::ensure();
        }
        Family::Nvml => driver::ensure_nvml(),
        Family::Cudart => ensure_cudart(),
    }
}

/// Resolves cudart's functions, never taking our own export for one.
pub fn ensure_cudart() {
    driver::ensure_cudart(|slot| {
        TABLE
            .iter()
            .find(|e| e.name == slot.name)
            .map_or(0, |e| e.hook as usize)
    });
}

/// Sorted (real function address, hook address) pairs for every CUDA hook,
/// used to swap pointers handed out by `cuGetProcAddress`.
static REVERSE: OnceLock<Vec<(usize, usize)>> = OnceLock::new();

/// Maps a real driver function address to our hook for the same versioned
/// symbol; None when we do not hook it, or the driver is not loaded yet.
pub fn hook_for_real(p: usize) -> Option<usize> {
    let rev = match REVERSE.get() {
        Some(rev) => rev,
        // The slots are still being filled (a lookup made from inside the
        // driver's own initialisation): nothing to build the map from yet.
        None if !config::ready() => return None,
        None => REVERSE.get_or_init(|| {
            let mut rev: Vec<(usize, usize)> = TABLE
                .iter()
                .filter(|e| e.family == Family::Cuda)
                .filter_map(|e| {
                    let r = e.real.load(Ordering::Acquire);
                    (r != 0).then_some((r, e.hook as usize))
                })
                .collect();
            rev.sort_unstable();
            rev
        }),
    };
    rev.binary_search_by_key(&p, |&(r, _)| r)
        .ok()
        .map(|i| rev[i].1)
}

/// `cuGetProcAddress` hands out driver pointers by base name and version —
/// the path cudart (≥ 11.3) uses for everything. We call the real one and
/// swap the pointer it returns for the hook of the *same* exported symbol,
/// so a caller asking for the CUDA 13 `cuCtxCreate` gets our `_v4` hook and
/// a per-thread-stream caller gets our `_ptsz` hook: same signature, same
/// stream semantics. Pointers we do not hook come back untouched.
mod procaddr {
    use super::{TABLE, ensure_cudart, hook_for_real};
    use crate::hooks::process;
    use crate::driver::{call, twin};
    use gpufrac_common::cuda::*;
    use gpufrac_common::versions::versioned;
    use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
    use std::sync::atomic::Ordering;

    /// Replaces `*pfn` by our hook for the same symbol.
    unsafe fn swap(pfn: *mut *mut c_void, symbol: *const c_char, ver: Option<i32>, flags: u64) {
        if pfn.is_null() {
            return;
        }
        let p = unsafe { pfn.read_unaligned() } as usize;
        if p == 0 {
            return;
        }
        if let Some(h) = hook_for_real(p) {
            unsafe { pfn.write_unaligned(h as *mut c_void) };
            return;
        }
        // A pointer that is no exported driver symbol: map by versioned name,
        // but only to a hook whose real function the driver does export.
        let (Some(ver), false) = (ver, symbol.is_null()) else {
            return;
        };
        let Ok(base) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
            return;
        };
        if let Some(name) = versioned(base, ver, flags)
            && let Some(e) = TABLE.iter().find(|e| e.name_str() == name)
            && e.real.load(Ordering::Acquire) != 0
        {
            debug!("cuGetProcAddress({base}, {ver}): unknown pointer, mapped to {name} by version");
            unsafe { pfn.write_unaligned(e.hook as *mut c_void) };
        }
    }

    /// Calls something that hands out a driver pointer into `pfn` and, when it
    /// succeeded, swaps the pointer for our hook.
    unsafe fn handing_out(
        pfn: *mut *mut c_void,
        symbol: *const c_char,
        ver: Option<i32>,
        flags: u64,
        real: impl FnOnce() -> u32,
    ) -> u32 {
        let rc = real();
        if rc == CUDA_SUCCESS {
            unsafe { swap(pfn, symbol, ver, flags) };
        }
        rc
    }

    pub unsafe fn get_v1(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        ver: c_int,
        flags: u64,
    ) -> u32 {
        process::ensure();
        unsafe {
            handing_out(pfn, symbol, Some(ver), flags, || {
                call::cuGetProcAddress(symbol, pfn, ver, flags)
            })
        }
    }

    pub unsafe fn get_v2(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        ver: c_int,
        flags: u64,
        status: *mut c_int,
    ) -> u32 {
        process::ensure();
        unsafe {
            handing_out(pfn, symbol, Some(ver), flags, || {
                call::cuGetProcAddress_v2(symbol, pfn, ver, flags, status)
            })
        }
    }

    // cudart's entry-point getters hand driver pointers straight to
    // applications. cudart normally obtains them through our cuGetProcAddress
    // already (then these swaps find nothing to do); a cudart that reached the
    // driver some other way is caught here. Only exact pointer matches are
    // swapped when the caller's CUDA version is unknown.

    fn cudart_ready() {
        ensure_cudart();
        process::ensure();
    }

    /// `cudaGetDriverEntryPoint` and its `_ptsz` twin (`driver::twin`).
    pub unsafe fn cudart_entry_point<const PTSZ: bool>(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        flags: u64,
        status: *mut c_int,
    ) -> u32 {
        cudart_ready();
        unsafe {
            handing_out(pfn, symbol, None, flags, || {
                twin!(
                    PTSZ,
                    cudaGetDriverEntryPoint
                        | cudaGetDriverEntryPoint_ptsz(symbol, pfn, flags, status)
                )
            })
        }
    }

    /// `cudaGetDriverEntryPointByVersion` and its `_ptsz` twin.
    pub unsafe fn cudart_entry_point_by_version<const PTSZ: bool>(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        ver: c_uint,
        flags: u64,
        status: *mut c_int,
    ) -> u32 {
        cudart_ready();
        unsafe {
            handing_out(pfn, symbol, Some(ver as i32), flags, || {
                twin!(
                    PTSZ,
                    cudaGetDriverEntryPointByVersion
                        | cudaGetDriverEntryPointByVersion_ptsz(symbol, pfn, ver, flags, status)
                )
            })
        }
    }
}
