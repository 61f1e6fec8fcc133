//! What the broker core reads of the host, behind traits so that the core
//! runs in tests without /proc or a GPU: processes (ancestry from
//! `/proc/PID/stat`, one page at most each, and marks, `ident.rs`); and NVML's view of
//! each GPU, which the shell samples and hands to the core as a
//! `Telemetry` snapshot. Nothing here reads a process's memory (its
//! command line or environment): such a read can be made to block by the
//! process (CVE-2018-1120), and what the broker shows as a process's
//! command is what the process says.

use std::collections::HashMap;

use crate::ident;
use crate::inventory::{self, Health, Nvml};

/// The host's processes.
pub trait Procs {
    /// The mark of the process that holds `pid` (`ident`: its pidfs
    /// inode, else its start time): with the pid, it names one process
    /// even after pids are reused. None: no such process.
    fn ident(&self, pid: u32) -> Option<u64>;
    fn parent(&self, pid: u32) -> Option<u32>;
    /// Both, as one look at the process.
    fn parent_and_ident(&self, pid: u32) -> (Option<u32>, Option<u64>) {
        (self.parent(pid), self.ident(pid))
    }
}

/// `pid` and its ancestors, nearest first, each with its mark (at most
/// 64: a deeper tree is not a job's).
pub fn ancestry(procs: &dyn Procs, pid: u32) -> Vec<(u32, Option<u64>)> {
    let mut out = Vec::new();
    let mut p = pid;
    while p > 1 && out.len() < 64 {
        let (parent, ident) = procs.parent_and_ident(p);
        out.push((p, ident));
        match parent {
            Some(pp) if pp != p => p = pp,
            _ => break,
        }
    }
    out
}

/// /proc, and pidfds where processes are marked by them.
pub struct LiveProcs(pub ident::Kind);

impl Procs for LiveProcs {
    fn ident(&self, pid: u32) -> Option<u64> {
        ident::of_pid(self.0, pid)
    }

    fn parent(&self, pid: u32) -> Option<u32> {
        gpufrac_common::procfs::parent(pid)
    }

    fn parent_and_ident(&self, pid: u32) -> (Option<u32>, Option<u64>) {
        ident::parent_and_mark(self.0, pid)
    }
}

/// What the driver said of each GPU at one moment, by UUID: the shell
/// samples it on its own timer, off the event loop (an NVML call can take
/// milliseconds, more on a busy driver), and hands it to the core, whose
/// status reads only this.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Telemetry {
    pub gpus: HashMap<String, GpuSample>,
}

/// One GPU as the driver saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuSample {
    /// Utilisation in percent (None: not reported, as in MIG mode).
    pub utilization: Option<u32>,
    /// (pid, bytes) of each process on the GPU, as the driver accounts
    /// them (context and module overhead included). None: the driver
    /// would not list them.
    pub processes: Option<Vec<(u32, u64)>>,
    /// The GPU's memory as the driver counts it, bytes: everything every
    /// process holds, the shim's or not, and the driver's own.
    pub memory: Option<DriverMemory>,
    /// Temperature, power, clock, ECC and XID counts, where NVML has them.
    pub health: Option<Health>,
    /// The processes the driver saw running kernels since the previous
    /// sample (NVML's per-process utilisation), sorted by pid, each with
    /// the part of that time it kept the GPU busy, in percent (its
    /// samples' mean). None: the driver does not report per-process work
    /// on this GPU, and the scheduler cannot tell a holder that works
    /// from one that only asks.
    pub working: Option<Vec<(u32, u32)>>,
}

/// NVML's `nvmlDeviceGetMemoryInfo`, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

impl Telemetry {
    pub fn utilization(&self, uuid: &str) -> Option<u32> {
        self.gpus.get(uuid).and_then(|g| g.utilization)
    }

    pub fn process_memory(&self, uuid: &str, pid: u32) -> Option<u64> {
        self.gpus
            .get(uuid)?
            .processes
            .as_ref()?
            .iter()
            .find(|&&(p, _)| p == pid)
            .map(|&(_, b)| b)
    }
}

/// The driver, asked by the shell's sampler.
pub trait Sampler {
    /// The GPUs with these UUIDs, now.
    fn sample(&mut self, uuids: &[String]) -> Telemetry;
}

/// NVML, with the driver's timestamp of the last per-process work it
/// reported on each GPU: the next sample asks only for what came after
/// (the driver's own clock, whatever its origin).
pub struct NvmlSampler {
    nvml: Nvml,
    last_seen: HashMap<String, u64>,
    /// The driver's XID events (None: it has none to give).
    xids: Option<inventory::Xids>,
}

impl NvmlSampler {
    pub fn new(nvml: Nvml) -> NvmlSampler {
        let xids = inventory::Xids::new(&nvml);
        NvmlSampler {
            nvml,
            last_seen: HashMap::new(),
            xids,
        }
    }

    /// One GPU, as the driver sees it now.
    fn gpu(&mut self, u: &str) -> GpuSample {
        let Some(dev) = self.nvml.device(u) else {
            return GpuSample::default();
        };
        let since = self.last_seen.get(u).copied().unwrap_or(0);
        let working = inventory::process_work(&dev, since).map(|(work, latest)| {
            self.last_seen.insert(u.to_owned(), latest);
            work
        });
        let mut health = inventory::health(&dev);
        if let Some(x) = &self.xids {
            (health.xid_errors, health.last_xid) = x.of(u);
        }
        GpuSample {
            utilization: inventory::utilization(&dev),
            processes: inventory::process_memory(&dev),
            memory: inventory::memory(&dev).map(|(total, free, used)| DriverMemory {
                total,
                free,
                used,
            }),
            health: Some(health),
            working,
        }
    }
}

impl Drop for NvmlSampler {
    fn drop(&mut self) {
        if let Some(x) = self.xids.take() {
            x.free(&self.nvml);
        }
    }
}

impl Sampler for NvmlSampler {
    fn sample(&mut self, uuids: &[String]) -> Telemetry {
        // GPUs no longer asked about (a MIG instance destroyed) are dropped.
        self.last_seen.retain(|u, _| uuids.contains(u));
        if let Some(x) = self.xids.as_mut() {
            for u in uuids {
                if let Some(dev) = self.nvml.device(u) {
                    x.watch(&dev, u);
                }
            }
            x.take(&self.nvml);
        }
        let gpus = uuids.iter().map(|u| (u.clone(), self.gpu(u))).collect();
        Telemetry { gpus }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_its_ancestors() {
        let me = std::process::id();
        for kind in [ident::kind(), ident::Kind::StartTime] {
            let live = LiveProcs(kind);
            let chain = ancestry(&live, me);
            assert_eq!(chain[0], (me, live.ident(me)));
            assert!(chain[0].1.is_some());
            assert_eq!(chain.get(1).map(|c| c.0), live.parent(me));
            assert_eq!(
                chain.get(1).map(|c| c.1),
                Some(live.ident(live.parent(me).unwrap()))
            );
            assert_eq!(live.ident(u32::MAX), None);
        }
    }
}
