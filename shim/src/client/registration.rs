//! Registering with the broker: what this process registers (its devices
//! and their caps), what the answer imposes (the job's cap, from its
//! lease), and the wait of the first context for that first answer.

use super::idle;
use crate::devices;
use crate::ledger::{LEDGERS, NO_LIMIT};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::wire::DeviceReg;
use std::sync::atomic::Ordering::*;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Set once the first registration was answered or could not be made.
static FIRST_REGISTRATION: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

pub fn first_registration_done() {
    let mut done = FIRST_REGISTRATION
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !*done {
        *done = true;
        FIRST_REGISTRATION.1.notify_all();
    }
}

/// The broker may impose the job's memory cap (its lease's), and the
/// first allocation must already be under it: waits for the first
/// registration to be answered, or to fail, a bounded time.
pub fn wait_first_registration() {
    let mut done = FIRST_REGISTRATION
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let deadline = Instant::now() + Duration::from_millis(1500);
    while !*done {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        done = FIRST_REGISTRATION
            .1
            .wait_timeout(done, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// What this process registers: its devices, with their caps as they are
/// now.
pub fn registration() -> Vec<DeviceReg> {
    let devs: Vec<DeviceReg> = devices::all()
        .iter()
        .enumerate()
        .take(MAX_DEVICES)
        .map(|(i, d)| {
            let cap = LEDGERS[i].limit.load(Relaxed);
            DeviceReg {
                uuid: d.uuid.bytes,
                ordinal: i as u32,
                mem_cap: if cap == NO_LIMIT { 0 } else { cap },
                mem_total: d.total,
            }
        })
        .collect();
    idle::set_devices(devs.len());
    devs
}

/// The job's cap, from its lease: it holds even if the process's
/// environment lost or raised GPU_MEM_LIMIT.
pub fn apply_job_cap(mem_cap: u64) {
    let n = idle::device_count();
    let mut lowered = false;
    for l in &LEDGERS[..n] {
        lowered |= l.limit.fetch_min(mem_cap, AcqRel) > mem_cap;
    }
    if lowered {
        info!("memory cap lowered to the job's {mem_cap} bytes by the broker");
    }
}
