//! Draining a released device: the drain thread waits for the work this
//! process queued there to finish, then posts it to the session, which
//! tells the broker (`Drained`): the broker charges that work as GPU time
//! used. A release never waits for it (the next holder starts at once).

use super::gate::GATE;
use crate::driver::call;
use crate::{contexts, devices};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;

/// The drain thread's body.
pub fn run() {
    loop {
        let req = GATE.drain_requests();
        crate::boundary::fault("drain");
        for d in (0..MAX_DEVICES).filter(|d| req & (1 << d) != 0) {
            for ctx in contexts::of_device(d) {
                unsafe {
                    if call::cuCtxPushCurrent_v2(ctx as CUcontext) == CUDA_SUCCESS {
                        call::cuCtxSynchronize();
                        let mut old: CUcontext = std::ptr::null_mut();
                        call::cuCtxPopCurrent_v2(&mut old);
                    }
                }
            }
            if d < devices::all().len() {
                GATE.drained(d);
            }
        }
    }
}
