//! The world outside the core as one part (`World`): /proc (`procs`),
//! where job tokens come from, the driver's view as the shell last
//! sampled it (`telemetry`) and the MPS daemon's state.
//!
//! The driver's view beside the broker's: each GPU's health as NVML
//! reports it, and the processes NVML lists on a GPU that are not under
//! the shim (no registered process of this broker on that GPU), with the
//! memory the driver says they hold. Nobody arbitrates them and no lease
//! books their memory, so status shows them (`unmanaged`) and placement
//! counts their memory as taken (`Queue::set_outside`): a job is never
//! placed into memory someone else holds.

use std::collections::HashSet;

use super::{Broker, Tokens};
use crate::jobs::Job;
use crate::procs::{Procs, Telemetry};
use crate::status::{DriverMem, GpuHealth, MpsStatus, UnmanagedProc};

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

/// What the core learns of the world and does not decide: processes,
/// tokens, the driver and the MPS daemon.
pub(super) struct World {
    procs: Box<dyn Procs>,
    tokens: Tokens,
    /// The driver's view, as the shell last sampled it.
    telemetry: Telemetry,
    mps: Option<MpsStatus>,
}

impl World {
    pub fn new(procs: Box<dyn Procs>, tokens: Tokens) -> World {
        World {
            procs,
            tokens,
            telemetry: Telemetry::default(),
            mps: None,
        }
    }

    pub fn procs(&self) -> &dyn Procs {
        self.procs.as_ref()
    }

    /// Where new job tokens come from.
    pub fn tokens(&mut self) -> &mut Tokens {
        &mut self.tokens
    }

    pub fn telemetry(&self) -> &Telemetry {
        &self.telemetry
    }

    pub fn set_telemetry(&mut self, t: Telemetry) {
        self.telemetry = t;
    }

    pub fn mps(&self) -> Option<&MpsStatus> {
        self.mps.as_ref()
    }

    pub fn set_mps(&mut self, mps: Option<MpsStatus>) {
        self.mps = mps;
    }

    /// Whether a job's `gpufrac run` is still the process that asked.
    pub fn alive(&self, j: &Job) -> bool {
        self.procs.ident(j.pid) == Some(j.ident)
    }

    /// The processes the driver last listed on GPU `uuid` (position `gi`)
    /// that are not `managed` there; None: the driver did not list its
    /// processes (no NVML, a failed call). The MPS server the broker's own
    /// daemon started is the broker's.
    pub fn outside(
        &self,
        gi: usize,
        uuid: &str,
        managed: &HashSet<(usize, u32)>,
    ) -> Option<Outside> {
        let listed = self.telemetry.gpus.get(uuid)?.processes.as_ref()?;
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

    /// What the driver says of GPU `uuid`'s memory, when it was asked.
    pub fn driver_mem(&self, uuid: &str) -> Option<DriverMem> {
        let m = self.telemetry.gpus.get(uuid)?.memory?;
        Some(DriverMem {
            total: m.total,
            used: m.used,
            free: m.free,
        })
    }

    /// What the driver says of GPU `uuid`'s health, when it was asked.
    pub fn health(&self, uuid: &str) -> Option<GpuHealth> {
        let h = self.telemetry.gpus.get(uuid)?.health?;
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
        self.world.outside(gi, &g.uuid_str, managed)
    }

    /// What the driver says of GPU `gi`'s memory, when it was asked.
    pub(super) fn driver_mem(&self, gi: usize) -> Option<DriverMem> {
        self.world.driver_mem(&self.gpus[gi].uuid_str)
    }

    /// What the driver says of GPU `gi`'s health, when it was asked.
    pub(super) fn health(&self, gi: usize) -> Option<GpuHealth> {
        let g = &self.gpus[gi];
        if g.mig.is_some() {
            return None;
        }
        self.world.health(&g.uuid_str)
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::jobs::sample;
    use crate::procs::{DriverMemory, GpuSample};

    /// pid -> (parent, mark).
    struct Table(HashMap<u32, (u32, u64)>);

    impl Procs for Table {
        fn ident(&self, pid: u32) -> Option<u64> {
            self.0.get(&pid).map(|p| p.1)
        }

        fn parent(&self, pid: u32) -> Option<u32> {
            self.0.get(&pid).map(|p| p.0)
        }
    }

    const GPU: &str = "GPU-00000000-0000-0000-0000-000000000000";

    fn world(procs: &[(u32, u32, u64)]) -> World {
        let table = procs.iter().map(|&(p, pp, st)| (p, (pp, st))).collect();
        let mut n = 0;
        World::new(
            Box::new(Table(table)),
            Box::new(move || {
                n += 1;
                n
            }),
        )
    }

    fn listing(procs: Vec<(u32, u64)>) -> Telemetry {
        let sample = GpuSample {
            processes: Some(procs),
            memory: Some(DriverMemory {
                total: 80,
                free: 30,
                used: 50,
            }),
            ..GpuSample::default()
        };
        Telemetry {
            gpus: [(GPU.to_owned(), sample)].into(),
        }
    }

    #[test]
    fn a_run_is_alive_only_while_its_pid_names_the_process_that_asked() {
        let job = sample(1);
        let w = world(&[(job.pid, 1, job.ident)]);
        assert!(w.alive(&job));
        let w = world(&[(job.pid, 1, job.ident + 1)]);
        assert!(!w.alive(&job), "the pid was reused");
        assert!(!world(&[]).alive(&job), "gone");
    }

    #[test]
    fn outside_lists_what_the_driver_sees_beyond_managed_and_mps_processes() {
        let mut w = world(&[(30, 7, 1), (40, 1, 1)]);
        assert!(
            w.outside(0, GPU, &HashSet::new()).is_none(),
            "no sample yet"
        );
        let many: Vec<(u32, u64)> = (100..100 + UNMANAGED_LISTED as u32 + 2)
            .map(|p| (p, 1))
            .chain([(10, 5), (20, 9), (30, 7), (40, 3)])
            .collect();
        w.set_telemetry(listing(many));
        // Pid 20 is a registered process on this GPU; 30 is the MPS
        // server the broker's daemon (pid 7) started.
        w.set_mps(Some(MpsStatus {
            daemon_pid: Some(7),
            ..MpsStatus::default()
        }));
        let o = w
            .outside(0, GPU, &[(0, 20), (1, 10)].into())
            .expect("listed");
        let first: Vec<(u32, u64)> = o.listed.iter().take(2).map(|p| (p.pid, p.mem)).collect();
        assert_eq!(first, [(10, 5), (40, 3)], "most memory first");
        assert_eq!(o.count, UNMANAGED_LISTED as u32 + 4);
        assert_eq!(o.mem, UNMANAGED_LISTED as u64 + 2 + 8);
        assert_eq!(o.listed.len(), UNMANAGED_LISTED);
        assert_eq!(w.driver_mem(GPU).map(|m| m.used), Some(50));
        assert!(w.health(GPU).is_none(), "health not sampled");
    }

    #[test]
    fn tokens_come_from_the_source_given() {
        let mut w = world(&[]);
        let t = w.tokens();
        assert_eq!((t(), t()), (1, 2));
    }
}
