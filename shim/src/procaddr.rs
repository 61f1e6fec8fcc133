//! `cuGetProcAddress` hands out driver pointers by base name and version —
//! the path cudart (≥ 11.3) uses for everything. We call the real one and
//! swap the pointer it returns for the hook of the *same* exported symbol,
//! so a caller asking for the CUDA 13 `cuCtxCreate` gets our `_v4` hook and
//! a per-thread-stream caller gets our `_ptsz` hook: same signature, same
//! stream semantics. Pointers we do not hook come back untouched.

use crate::init;
use crate::table::{TABLE, call};
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
    if let Some(h) = init::hook_for_real(p) {
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

pub unsafe fn get_v1(symbol: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64) -> u32 {
    init::ensure();
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
    init::ensure();
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
    init::ensure_cudart();
    init::ensure();
}

pub unsafe fn cudart_entry_point(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> u32 {
    cudart_ready();
    unsafe {
        handing_out(pfn, symbol, None, flags, || {
            call::cudaGetDriverEntryPoint(symbol, pfn, flags, status)
        })
    }
}

pub unsafe fn cudart_entry_point_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    flags: u64,
    status: *mut c_int,
) -> u32 {
    cudart_ready();
    unsafe {
        handing_out(pfn, symbol, None, flags, || {
            call::cudaGetDriverEntryPoint_ptsz(symbol, pfn, flags, status)
        })
    }
}

pub unsafe fn cudart_entry_point_by_version(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_uint,
    flags: u64,
    status: *mut c_int,
) -> u32 {
    cudart_ready();
    unsafe {
        handing_out(pfn, symbol, Some(ver as i32), flags, || {
            call::cudaGetDriverEntryPointByVersion(symbol, pfn, ver, flags, status)
        })
    }
}

pub unsafe fn cudart_entry_point_by_version_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_uint,
    flags: u64,
    status: *mut c_int,
) -> u32 {
    cudart_ready();
    unsafe {
        handing_out(pfn, symbol, Some(ver as i32), flags, || {
            call::cudaGetDriverEntryPointByVersion_ptsz(symbol, pfn, ver, flags, status)
        })
    }
}
