//! Registering with the broker: what this process registers (its devices
//! and their caps), and what the answer imposes (the job's cap, from its
//! lease).

use super::gate::GATE;
use crate::devices;
use crate::ledger::{LEDGERS, NO_LIMIT};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::wire::DeviceReg;
use std::sync::atomic::Ordering::*;

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
    GATE.set_devices(devs.len());
    devs
}

/// The job's cap, from its lease: it holds even if the process's
/// environment lost or raised GPU_MEM_LIMIT.
pub fn apply_job_cap(mem_cap: u64) {
    let n = GATE.device_count();
    let mut lowered = false;
    for l in &LEDGERS[..n] {
        lowered |= l.limit.fetch_min(mem_cap, AcqRel) > mem_cap;
    }
    if lowered {
        info!("memory cap lowered to the job's {mem_cap} bytes by the broker");
    }
}
