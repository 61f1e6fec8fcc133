//! The compute gate as the launch hooks use it: `GATE` (`gate.rs`) in the
//! world of the real driver (the current context's device, the in-flight
//! bound's events, the clock), and the in-flight bound's bookkeeping after
//! a tracked launch.

use super::gate::{GATE, Pass, World};
use crate::driver::call;
use gpufrac_common::cuda::*;

// The precise clock: idle hand-back works in fractions of a millisecond, and
// the coarse clock ticks every few milliseconds.
pub use gpufrac_common::clock::mono_ns as now_ns;

/// The real driver, as the gate sees it.
struct Driver;

impl World for Driver {
    fn device(&self) -> Option<usize> {
        let mut dev: CUdevice = -1;
        // SAFETY: an out-pointer to a local.
        let rc = unsafe { call::cuCtxGetDevice(&mut dev) };
        (rc == CUDA_SUCCESS)
            .then_some(dev)
            .and_then(|d| usize::try_from(d).ok())
    }

    fn wait_room(&self, d: usize, bound: u64) {
        crate::inflight::wait_room(d, bound);
    }

    #[inline(always)]
    fn now(&self) -> u64 {
        now_ns()
    }
}

/// The compute gate. `Ok` means launch now; `launched` must follow with
/// the pass.
#[inline(always)]
pub fn may_launch(_stream: CUstream) -> Result<Pass, u32> {
    GATE.pass(&Driver)
}

/// The gate without waiting for a grant: `None` when this launch would
/// have to. For a thread that already holds a pass: a release of the
/// device that pass counts against waits for it to end.
pub fn may_launch_now(_stream: CUstream) -> Option<Result<Pass, u32>> {
    GATE.pass_now(&Driver)
}

/// After the driver call of a launch that `may_launch` let through with
/// `pass`, on `stream` (`ptsz`: with per-thread default stream
/// semantics).
#[inline(always)]
pub fn launched(pass: Pass, rc: u32, stream: CUstream, ptsz: bool) {
    if let Some(d) = pass.tracked()
        && rc == CUDA_SUCCESS
    {
        crate::inflight::record(d, stream, ptsz);
    }
    GATE.launched(pass);
}

/// Wraps a synchronize call so idle hand-back does not fire while the
/// process waits for its own work.
#[inline(always)]
pub fn syncing<F: FnOnce() -> u32>(f: F) -> u32 {
    GATE.syncing(f)
}
