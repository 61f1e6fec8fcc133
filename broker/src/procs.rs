//! What the broker core reads of the host, behind traits so that the core
//! runs in tests without /proc or a GPU: processes (ancestry, start times,
//! command lines) and NVML's view of each GPU.

use crate::inventory::Nvml;

/// The host's processes.
pub trait Procs {
    /// When `pid` started (clock ticks after boot): with the pid, it names
    /// one process even after pids are reused. None: no such process.
    fn start_time(&self, pid: u32) -> Option<u64>;
    fn parent(&self, pid: u32) -> Option<u32>;
    /// Both, as one look at the process (one read of /proc).
    fn parent_and_start(&self, pid: u32) -> (Option<u32>, Option<u64>) {
        (self.parent(pid), self.start_time(pid))
    }
    /// The command line, arguments joined by spaces; empty when unknown
    /// (another pid namespace, a process already gone).
    fn cmdline(&self, pid: u32) -> String;
}

/// `pid` and its ancestors, nearest first, each with its start time (at
/// most 64: a deeper tree is not a job's).
pub fn ancestry(procs: &dyn Procs, pid: u32) -> Vec<(u32, Option<u64>)> {
    let mut out = Vec::new();
    let mut p = pid;
    while p > 1 && out.len() < 64 {
        let (parent, start) = procs.parent_and_start(p);
        out.push((p, start));
        match parent {
            Some(pp) if pp != p => p = pp,
            _ => break,
        }
    }
    out
}

/// /proc.
pub struct LiveProcs;

impl Procs for LiveProcs {
    fn start_time(&self, pid: u32) -> Option<u64> {
        gpufrac_common::procfs::start_time(pid)
    }

    fn parent(&self, pid: u32) -> Option<u32> {
        gpufrac_common::procfs::parent(pid)
    }

    fn parent_and_start(&self, pid: u32) -> (Option<u32>, Option<u64>) {
        gpufrac_common::procfs::parent_and_start(pid)
    }

    fn cmdline(&self, pid: u32) -> String {
        gpufrac_common::procfs::cmdline(pid)
    }
}

/// What the driver says of a GPU, for status.
pub trait Telemetry {
    /// (pid, bytes) of each process on the GPU with this UUID.
    fn process_memory(&self, uuid: &str) -> Vec<(u32, u64)>;
    /// Utilisation in percent.
    fn utilization(&self, uuid: &str) -> Option<u32>;
}

impl Telemetry for Nvml {
    fn process_memory(&self, uuid: &str) -> Vec<(u32, u64)> {
        Nvml::process_memory(self, uuid)
    }

    fn utilization(&self, uuid: &str) -> Option<u32> {
        Nvml::utilization(self, uuid)
    }
}

/// No driver to ask.
pub struct NoTelemetry;

impl Telemetry for NoTelemetry {
    fn process_memory(&self, _: &str) -> Vec<(u32, u64)> {
        Vec::new()
    }

    fn utilization(&self, _: &str) -> Option<u32> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_its_ancestors() {
        let me = std::process::id();
        let chain = ancestry(&LiveProcs, me);
        assert_eq!(chain[0], (me, LiveProcs.start_time(me)));
        assert!(chain[0].1.is_some());
        assert_eq!(chain.get(1).map(|c| c.0), LiveProcs.parent(me));
        assert!(LiveProcs.cmdline(me).contains("gpufrac_broker"));
        assert_eq!(LiveProcs.start_time(u32::MAX), None);
    }
}
