//! The in-flight bound: while others share its GPU, a holder may keep only
//! about `bound` ns of unfinished work queued there. That is what a newcomer
//! (an interactive request, a `high` process) may have to wait for beyond
//! the time-slicer's own quantum, and what keeps running beside the next
//! holder after a handover.
//!
//! The shim cannot see kernel durations, so it measures them from its own
//! completions: every launch on a bounded device is followed by an event on
//! the same stream, and the time between consecutive completions (the
//! events' elapsed time) feeds the estimate of `estimate.rs`, which says
//! how many launches may be in flight.
//!
//! Only the launch slow lane (a bounded or contended grant) comes here; a
//! process alone on its GPU never does.

use crate::driver::call;
use crate::estimate::{Estimate, MAX_IN_FLIGHT};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use std::collections::VecDeque;
use std::sync::Mutex;

struct Track {
    /// The context the events belong to (events record only on streams of
    /// their own context).
    ctx: usize,
    /// Events of launches not yet seen complete, oldest first.
    ring: VecDeque<usize>,
    free: Vec<usize>,
    /// The most recent completion, to time the next one against.
    last_done: Option<usize>,
    /// Estimated GPU time per launch.
    est: Estimate,
}

impl Track {
    const fn new() -> Self {
        Track {
            ctx: 0,
            ring: VecDeque::new(),
            free: Vec::new(),
            last_done: None,
            est: Estimate::NONE,
        }
    }

    fn recycle(&mut self, ev: usize) {
        if self.free.len() < MAX_IN_FLIGHT * 2 {
            self.free.push(ev);
        } else {
            unsafe { call::cuEventDestroy_v2(ev as CUevent) };
        }
    }

    /// Forgets events of another context (they cannot be recorded on this
    /// one's streams).
    fn switch_to(&mut self, ctx: usize) {
        if self.ctx == ctx {
            return;
        }
        let old: Vec<usize> = self
            .ring
            .drain(..)
            .chain(self.free.drain(..))
            .chain(self.last_done.take())
            .collect();
        for ev in old {
            unsafe { call::cuEventDestroy_v2(ev as CUevent) };
        }
        self.ctx = ctx;
        self.est = Estimate::NONE;
    }

    /// Pops completed launches and learns from their timing.
    fn reap(&mut self) {
        while let Some(&ev) = self.ring.front() {
            if unsafe { call::cuEventQuery(ev as CUevent) } != CUDA_SUCCESS {
                return;
            }
            self.ring.pop_front();
            if let Some(prev) = self.last_done.replace(ev) {
                if let Some(ns) = elapsed_ns(prev, ev) {
                    self.est.learn(ns);
                }
                self.recycle(prev);
            }
        }
        // Nothing queued: the next completion follows an idle gap, which is
        // no kernel's duration.
        if let Some(prev) = self.last_done.take() {
            self.recycle(prev);
        }
    }
}

fn elapsed_ns(a: usize, b: usize) -> Option<u64> {
    let mut ms = 0f32;
    let mut rc = unsafe { call::cuEventElapsedTime_v2(&mut ms, a as CUevent, b as CUevent) };
    if rc == CUDA_ERROR_NOT_FOUND {
        rc = unsafe { call::cuEventElapsedTime(&mut ms, a as CUevent, b as CUevent) };
    }
    (rc == CUDA_SUCCESS && ms.is_finite() && ms >= 0.0).then_some((ms as f64 * 1e6) as u64)
}

static TRACKS: [Mutex<Track>; MAX_DEVICES] = [const { Mutex::new(Track::new()) }; MAX_DEVICES];

fn current_ctx() -> usize {
    let mut ctx: CUcontext = std::ptr::null_mut();
    unsafe { call::cuCtxGetCurrent(&mut ctx) };
    ctx as usize
}

/// Blocks the launching thread until device `d` has room under `bound`.
pub fn wait_room(d: usize, bound: u64) {
    let Some(m) = TRACKS.get(d) else { return };
    let mut t = m.lock().unwrap_or_else(|e| e.into_inner());
    t.switch_to(current_ctx());
    t.reap();
    let n = t.est.allowed(bound);
    while t.ring.len() >= n {
        let Some(&oldest) = t.ring.front() else { break };
        // Not under the lock: a thread finishing a launch records its event
        // under it, and a release waits for that launch.
        drop(t);
        let rc = unsafe { call::cuEventSynchronize(oldest as CUevent) };
        t = m.lock().unwrap_or_else(|e| e.into_inner());
        if t.ring.front() == Some(&oldest) && rc != CUDA_SUCCESS {
            // A broken event must not block launches forever.
            t.ring.pop_front();
            continue;
        }
        t.reap();
        if rc == CUDA_SUCCESS && t.ring.front() == Some(&oldest) {
            // Synchronized means done, whatever a query says: never spin
            // on a driver whose query lags its synchronize.
            t.ring.pop_front();
            if let Some(prev) = t.last_done.replace(oldest) {
                t.recycle(prev);
            }
        }
    }
}

/// Marks the launch just made on `stream` (of device `d`) as in flight.
pub fn record(d: usize, stream: CUstream, ptsz: bool) {
    let Some(m) = TRACKS.get(d) else { return };
    let mut t = m.lock().unwrap_or_else(|e| e.into_inner());
    t.switch_to(current_ctx());
    let ev = match t.free.pop() {
        Some(ev) => ev,
        None => {
            let mut ev: CUevent = std::ptr::null_mut();
            if unsafe { call::cuEventCreate(&mut ev, 0) } != CUDA_SUCCESS || ev.is_null() {
                return;
            }
            ev as usize
        }
    };
    let rc = unsafe {
        if ptsz {
            call::cuEventRecord_ptsz(ev as CUevent, stream)
        } else {
            call::cuEventRecord(ev as CUevent, stream)
        }
    };
    if rc == CUDA_SUCCESS {
        t.ring.push_back(ev);
    } else {
        t.recycle(ev);
    }
}
