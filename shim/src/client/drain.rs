//! Draining a released device: the drain thread waits for the work this
//! process queued there to finish, then tells the broker, which charges
//! that work as GPU time used. A release never waits for it (the next
//! holder starts at once); the requests come from the gate and the session.

use super::send::send;
use crate::driver::call;
use crate::{contexts, devices};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use gpufrac_common::wire::ClientMsg;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Condvar, Mutex};

/// Devices released whose queued work the drain thread still has to see
/// finish before telling the broker.
static DRAIN_REQ: AtomicU64 = AtomicU64::new(0);
static DRAIN_WAIT: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Asks the drain thread to drain `d`.
pub fn request(d: usize) {
    DRAIN_REQ.fetch_or(1 << d, SeqCst);
    let _g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    DRAIN_WAIT.1.notify_one();
}

/// Blocks until some released device is to be drained; returns them.
fn requests() -> u64 {
    let mut g = DRAIN_WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let r = DRAIN_REQ.swap(0, SeqCst);
        if r != 0 {
            return r;
        }
        g = DRAIN_WAIT.1.wait(g).unwrap_or_else(|e| e.into_inner());
    }
}

/// The drain thread's body.
pub fn run() {
    loop {
        let req = requests();
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
            if let Some(dev) = devices::all().get(d) {
                send(&ClientMsg::Drained {
                    uuid: dev.uuid.bytes,
                });
            }
        }
    }
}

/// A fork child drains nothing of its parent's.
pub fn reset_after_fork() {
    DRAIN_REQ.store(0, SeqCst);
}
