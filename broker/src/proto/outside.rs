//! The driver's view beside the broker's: each GPU's health as NVML
//! reports it, and the processes NVML lists on a GPU that are not under
//! the shim (no registered process of this broker on that GPU), with the
//! memory the driver says they hold. Nobody arbitrates them and no lease
//! books their memory, so status shows them (`unmanaged`) and placement
//! counts their memory as taken (`Queue::set_outside`): a job is never
//! placed into memory someone else holds.

use std::collections::HashSet;

use super::Broker;
use crate::status::{DriverMem, GpuHealth, UnmanagedProc};

/// Processes outside gpufrac listed per GPU in status, most memory first;
/// the rest are counted and their memory summed.
pub const UNMANAGED_LISTED: usize = 32;

/// What the driver lists on one GPU outside gpufrac.
#[derive(Debug, Default)]
pub(super) struct Outside {
    /// (pid, bytes), most memory first, at most `UNMANAGED_LISTED`.
    pub listed: Vec<UnmanagedProc>,
    pub count: u32,
    pub mem: u64,
}

impl Broker {
    /// Each GPU's registered processes, as (position in `gpus`, pid).
    pub(super) fn managed(&self) -> HashSet<(usize, u32)> {
        let mut out = HashSet::new();
        for c in self.conns.values() {
            for d in c.devices() {
                out.insert((d.gpu, c.peer.pid));
            }
        }
        out
    }

    /// The processes the driver last listed on GPU `gi` (a position in
    /// `gpus`) that are not under the shim there; None: the driver did not
    /// list its processes (no NVML, a MIG instance, a failed call).
    /// The MPS server the broker's own daemon started is the broker's.
    pub(super) fn outside(&self, gi: usize, managed: &HashSet<(usize, u32)>) -> Option<Outside> {
        let g = &self.gpus[gi];
        if g.mig.is_some() {
            return None;
        }
        let listed = self.telemetry.gpus.get(&g.uuid_str)?.processes.as_ref()?;
        let mps = self.mps.as_ref().and_then(|m| m.daemon_pid);
        let mut procs: Vec<(u32, u64)> = listed
            .iter()
            .copied()
            .filter(|&(pid, _)| !managed.contains(&(gi, pid)))
            .filter(|&(pid, _)| mps.is_none() || self.procs.parent(pid) != mps)
            .collect();
        procs.sort_unstable_by_key(|&(pid, mem)| (std::cmp::Reverse(mem), pid));
        Some(Outside {
            count: procs.len() as u32,
            mem: procs.iter().map(|&(_, m)| m).sum(),
            listed: procs
                .into_iter()
                .take(UNMANAGED_LISTED)
                .map(|(pid, mem)| UnmanagedProc { pid, mem })
                .collect(),
        })
    }

    /// What the driver says of GPU `gi`'s memory, when it was asked.
    pub(super) fn driver_mem(&self, gi: usize) -> Option<DriverMem> {
        let m = self.telemetry.gpus.get(&self.gpus[gi].uuid_str)?.memory?;
        Some(DriverMem {
            total: m.total,
            used: m.used,
            free: m.free,
        })
    }

    /// What the driver says of GPU `gi`'s health, when it was asked.
    pub(super) fn health(&self, gi: usize) -> Option<GpuHealth> {
        let g = &self.gpus[gi];
        if g.mig.is_some() {
            return None;
        }
        let h = self.telemetry.gpus.get(&g.uuid_str)?.health?;
        let watts = |mw: u32| f64::from(mw) / 1000.0;
        Some(GpuHealth {
            temperature_c: h.temperature_c,
            power_w: h.power_mw.map(watts),
            power_limit_w: h.power_limit_mw.map(watts),
            sm_clock_mhz: h.sm_clock_mhz,
            ecc_corrected: h.ecc_corrected,
            ecc_uncorrected: h.ecc_uncorrected,
            xid_errors: h.xid_errors,
            last_xid: h.last_xid,
        })
    }

    /// After a sample: tells the queue what processes outside gpufrac hold
    /// on each GPU it places on, and has it placed again where that
    /// changed (a process that let go of its memory makes room as a
    /// lease's end does). A GPU whose processes the driver did not list
    /// keeps what was last seen.
    pub(super) fn outside_seen(&mut self) {
        let managed = self.managed();
        for gi in 0..self.gpus.len() {
            if let Some(o) = self.outside(gi, &managed) {
                let uuid = self.gpus[gi].uuid_str.clone();
                self.ledger.set_outside(&uuid, o.mem);
            }
        }
    }
}
