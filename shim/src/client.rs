//! The shim's side of the broker: registration, usage reports and the
//! compute gate. (Arbitration is wired in by the broker work; until a broker
//! grants or revokes anything, the gate is open.)

use gpufrac_common::cuda::CUstream;
use std::sync::atomic::{AtomicBool, Ordering};

/// True while launches must ask for the GPU first. Read on every launch.
static GATED: AtomicBool = AtomicBool::new(false);

#[inline(always)]
pub fn may_launch(_stream: CUstream) -> Result<(), u32> {
    if !GATED.load(Ordering::Acquire) {
        return Ok(());
    }
    Ok(())
}

#[inline(always)]
pub fn launched(_rc: u32) {}

pub fn on_context_created() {}

#[inline(always)]
pub fn usage_changed() {}

pub fn reset_after_fork() {
    GATED.store(false, Ordering::Release);
}
