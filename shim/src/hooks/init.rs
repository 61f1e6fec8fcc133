//! The `cuInit` hook: refuses to initialise CUDA under a configuration that
//! cannot be honoured (a malformed variable, unusable job books: a user who
//! asked for a cap must never run uncapped), and learns the devices'
//! physical sizes once the driver is up.

use crate::driver::call;
use super::process;
use crate::{client, devices};
use gpufrac_common::cuda::*;
use std::ffi::c_uint;

pub unsafe fn cu_init(flags: c_uint) -> u32 {
    let cfg = match process::config() {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Err(code) = client::check_required(cfg) {
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
