//! The simulated driver's "spin" kernel as the example programs launch it:
//! one 1×1×1 block on the default stream whose first parameter is its
//! duration in ns. Shared by `probe` and `loadgen` (`#[path]`-included; a
//! folder without main.rs is no example of its own).

use std::ffi::{c_uint, c_void};

/// `cuLaunchKernel` and `cuLaunchKernel_ptsz` alike.
pub type LaunchKernel = unsafe extern "C" fn(
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
) -> u32;

/// Launches `func` through `launch` to run for `ns`; the driver's result.
pub fn run(launch: LaunchKernel, func: *mut c_void, ns: u64) -> u32 {
    let mut d = ns;
    let mut params = [(&mut d as *mut u64).cast::<c_void>()];
    // SAFETY: `launch` is the driver's cuLaunchKernel (or _ptsz) and
    // `params` outlives the call, which copies the parameters.
    unsafe {
        launch(
            func,
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
