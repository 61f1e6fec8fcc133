//! The units of arbitration as one part: the GPUs the broker found, the
//! MIG instances made on them, and, for a broker without a driver, the
//! GPUs its clients named (learnt, bounded per user). Each has its own
//! scheduler. What a client may name, and which entry a GPU takes, are
//! decided here.

use std::collections::HashMap;
use std::ops::{Index, IndexMut};

use gpufrac_common::wire::{self, uuid_string};
use tracing::warn;

use crate::sched::{SchedConfig, Scheduler};

/// GPUs a broker that found none itself arbitrates for one user's
/// processes (named by them at registration): a user's own made-up UUIDs
/// take only that user's room, and an entry goes when no registered
/// process names it any more.
pub(super) const LEARNED_GPUS_PER_USER: usize = 16;

/// A GPU, or a MIG instance, as a unit of arbitration.
pub(super) struct Gpu {
    pub index: Option<u32>,
    pub uuid: [u8; 16],
    pub uuid_str: String,
    pub name: String,
    pub total_mem: u64,
    pub sched: Scheduler,
    /// A MIG instance (`--mig dynamic`): the index of its GPU and its GPU
    /// instance id.
    pub mig: Option<(u32, u32)>,
    /// A GPU the broker did not find but learnt from its clients (a broker
    /// without a driver): how many registered processes of each user name
    /// it. Empty, the entry is vacant (shown nowhere, reused for the next
    /// GPU learnt): what a client names is kept only while a process of its
    /// names it.
    pub learned: Option<HashMap<u32, u32>>,
    /// While the driver samples its per-process work: each process's
    /// connection registered here since the last sample (None: it had
    /// several, so its work is no one connection's). Rebuilt at each
    /// sample, so it holds the processes of one sample period.
    pub since_sample: Option<HashMap<u32, Option<super::ConnId>>>,
}

impl Gpu {
    /// Connection `id` of process `pid` is registered here.
    pub fn registered(&mut self, pid: u32, id: super::ConnId) {
        if let Some(seen) = self.since_sample.as_mut() {
            let e = seen.entry(pid).or_insert(Some(id));
            if *e != Some(id) {
                *e = None;
            }
        }
    }

    /// Whether `id` was process `pid`'s one connection here since the
    /// last sample.
    pub fn lone(&self, pid: u32, id: super::ConnId) -> bool {
        self.since_sample
            .as_ref()
            .and_then(|seen| seen.get(&pid))
            .is_none_or(|&c| c == Some(id))
    }

    /// A learnt GPU no registered process names any more.
    pub fn vacant(&self) -> bool {
        self.learned.as_ref().is_some_and(HashMap::is_empty)
    }
}

pub(super) struct Gpus {
    units: Vec<Gpu>,
    /// The broker found GPUs itself: a client naming another is refused.
    discovered: bool,
    sched: SchedConfig,
}

impl Index<usize> for Gpus {
    type Output = Gpu;
    fn index(&self, g: usize) -> &Gpu {
        &self.units[g]
    }
}

impl IndexMut<usize> for Gpus {
    fn index_mut(&mut self, g: usize) -> &mut Gpu {
        &mut self.units[g]
    }
}

impl Gpus {
    /// The GPUs found through CUDA (PCI bus order); `discovered`: they are
    /// the node's (a client naming another is refused).
    pub fn new(found: &[crate::inventory::GpuInfo], sched: SchedConfig, discovered: bool) -> Gpus {
        Gpus {
            units: found
                .iter()
                .map(|g| Gpu {
                    index: Some(g.index),
                    uuid: g.uuid,
                    uuid_str: uuid_string(&g.uuid),
                    name: g.name.clone(),
                    total_mem: g.total_mem,
                    sched: Scheduler::new(sched),
                    mig: None,
                    learned: None,
                    since_sample: None,
                })
                .collect(),
            discovered,
            sched,
        }
    }

    pub fn len(&self) -> usize {
        self.units.len()
    }

    pub fn get(&self, g: usize) -> Option<&Gpu> {
        self.units.get(g)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Gpu> {
        self.units.iter()
    }

    /// When a scheduler next has something to do.
    pub fn next_timeout(&self) -> Option<u64> {
        self.units
            .iter()
            .filter_map(|g| g.sched.next_timeout())
            .min()
    }

    /// The entry of this UUID, vacant ones aside.
    pub fn find(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.units
            .iter()
            .position(|g| &g.uuid == uuid && !g.vacant())
    }

    /// The UUIDs the shell's sampler asks the driver about: every GPU, and
    /// every MIG instance among `live` (those that exist now).
    pub fn telemetry_uuids(&self, live: &[String]) -> Vec<String> {
        self.units
            .iter()
            .filter(|g| !g.vacant() && (g.mig.is_none() || live.contains(&g.uuid_str)))
            .map(|g| g.uuid_str.clone())
            .collect()
    }

    /// Whether a process of `uid`, which names the entries `mine` now, may
    /// name the GPUs `asked`: only GPUs this node has when the broker found
    /// its GPUs itself (a client inventing UUIDs once grew the broker by
    /// 400 MB and broke status for everyone); without a driver, GPUs learnt
    /// from clients, at most `LEARNED_GPUS_PER_USER` named by one user's
    /// processes at once, so that one user's made-up UUIDs take only that
    /// user's room. Else why not.
    pub fn may_name(&self, uid: u32, mine: &[usize], asked: &[[u8; 16]]) -> Result<(), String> {
        let learned = |i: usize| self.units[i].learned.is_some();
        if self.discovered {
            let unknown: Vec<String> = asked
                .iter()
                .filter(|u| self.find(u).is_none_or(learned))
                .map(uuid_string)
                .collect();
            if unknown.is_empty() {
                return Ok(());
            }
            let known: Vec<&str> = self
                .units
                .iter()
                .filter(|g| g.learned.is_none())
                .map(|g| g.uuid_str.as_str())
                .collect();
            return Err(format!(
                "this broker does not manage {} (it manages: {}); \
                 run the process where the broker sees its GPUs, or with GPUFRAC_BROKER=off",
                unknown.join(", "),
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                }
            ));
        }
        // Learnt GPUs this user's other processes name, and those this
        // registration would add.
        let named_elsewhere = |i: usize| {
            self.units[i]
                .learned
                .as_ref()
                .is_some_and(|m| m.get(&uid).copied().unwrap_or(0) > u32::from(mine.contains(&i)))
        };
        let before = (0..self.units.len())
            .filter(|&i| named_elsewhere(i))
            .count();
        let added = asked
            .iter()
            .filter(|u| match self.find(u) {
                Some(i) => learned(i) && !named_elsewhere(i),
                None => true,
            })
            .count();
        if before + added > LEARNED_GPUS_PER_USER {
            return Err(format!(
                "this broker found no GPU itself and arbitrates the GPUs its clients name, at most \
                 {LEARNED_GPUS_PER_USER} for one user's processes at once; user {uid}'s would name {}; \
                 register fewer GPUs (CUDA_VISIBLE_DEVICES), or run with GPUFRAC_BROKER=off",
                before + added
            ));
        }
        Ok(())
    }

    /// The GPU of this UUID; a GPU the broker did not find (it runs
    /// without a driver; `may_name` said it may be learnt) is arbitrated
    /// all the same, by UUID, in a vacant entry if there is one.
    pub fn by_uuid(&mut self, uuid: &[u8; 16], total: u64) -> usize {
        if let Some(i) = self.find(uuid) {
            return i;
        }
        let unit = Gpu {
            index: None,
            uuid: *uuid,
            uuid_str: uuid_string(uuid),
            name: "unknown".into(),
            total_mem: total,
            sched: Scheduler::new(self.sched),
            mig: None,
            learned: Some(HashMap::new()),
            since_sample: None,
        };
        match self.units.iter().position(Gpu::vacant) {
            Some(i) => {
                self.units[i] = unit;
                i
            }
            None => {
                self.units.push(unit);
                self.units.len() - 1
            }
        }
    }

    /// A learnt GPU is named by one more registered process of `uid`.
    pub fn name(&mut self, g: usize, uid: u32) {
        if let Some(m) = self.units[g].learned.as_mut() {
            *m.entry(uid).or_insert(0) += 1;
        }
    }

    /// A process of `uid` no longer names GPU `g`: a learnt GPU no process
    /// names is forgotten (its entry vacant, for the next one learnt).
    pub fn unname(&mut self, g: usize, uid: u32) {
        if let Some(m) = self.units[g].learned.as_mut()
            && let Some(n) = m.get_mut(&uid)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&uid);
            }
        }
    }

    /// A MIG instance becomes a unit of arbitration, so that its processes
    /// (registering with its MIG device UUID) are known. The entry of an
    /// instance that is gone (not among `live`), and that no process
    /// names any more (`in_use`), is reused: entries stay bounded by the
    /// instances a node can hold.
    pub fn add_mig(
        &mut self,
        (parent, gi): (u32, u32),
        uuid: &str,
        (profile, mem): (&str, u64),
        live: &[String],
        in_use: impl Fn(usize) -> bool,
    ) {
        let Some(bytes) = wire::parse_uuid(uuid) else {
            warn!(
                gpu = parent,
                gi,
                "MIG device {uuid} has a UUID of the old form (driver before R470); its processes cannot register with the broker"
            );
            return;
        };
        if self.units.iter().any(|g| g.uuid == bytes) {
            return;
        }
        let unit = Gpu {
            index: Some(parent),
            uuid: bytes,
            uuid_str: uuid.to_owned(),
            name: format!("MIG {profile} (GPU {parent}, GPU instance {gi})"),
            total_mem: mem,
            sched: Scheduler::new(self.sched),
            mig: Some((parent, gi)),
            learned: None,
            since_sample: None,
        };
        let stale = (0..self.units.len()).find(|&i| {
            self.units[i].mig.is_some() && !live.contains(&self.units[i].uuid_str) && !in_use(i)
        });
        match stale {
            Some(i) => self.units[i] = unit,
            None => self.units.push(unit),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(n: u8) -> [u8; 16] {
        [n; 16]
    }

    fn found(n: u8) -> Vec<crate::inventory::GpuInfo> {
        (0..n)
            .map(|i| crate::inventory::GpuInfo {
                index: u32::from(i),
                uuid: uuid(i + 1),
                name: "H100".into(),
                total_mem: 80 << 30,
            })
            .collect()
    }

    #[test]
    fn a_broker_that_found_its_gpus_refuses_any_other() {
        let g = Gpus::new(&found(2), SchedConfig::default(), true);
        assert_eq!(g.may_name(1000, &[], &[uuid(1), uuid(2)]), Ok(()));
        let err = g.may_name(1000, &[], &[uuid(2), uuid(9)]).unwrap_err();
        assert!(err.contains(&uuid_string(&uuid(9))), "{err}");
        assert!(
            err.contains(&uuid_string(&uuid(1))),
            "names what it manages: {err}"
        );
    }

    #[test]
    fn a_driverless_broker_learns_gpus_within_each_users_room() {
        let mut g = Gpus::new(&[], SchedConfig::default(), false);
        let asked: Vec<[u8; 16]> = (0..LEARNED_GPUS_PER_USER as u8).map(uuid).collect();
        assert_eq!(g.may_name(1000, &[], &asked), Ok(()));
        // Each named as it is learnt (unnamed, an entry is vacant).
        let named: Vec<usize> = asked
            .iter()
            .map(|u| {
                let i = g.by_uuid(u, 1 << 30);
                g.name(i, 1000);
                i
            })
            .collect();
        assert_eq!(g.len(), LEARNED_GPUS_PER_USER);
        // A new one is past alice's room, not bob's; one she already
        // names costs her nothing.
        let more = [uuid(200)];
        assert!(g.may_name(1000, &[], &more).is_err());
        assert_eq!(g.may_name(1001, &[], &more), Ok(()));
        assert_eq!(g.may_name(1000, &[], &asked[..1]), Ok(()));
        // The process that named one re-registers: its own names are not
        // counted against it.
        assert_eq!(g.may_name(1000, &named[..1], &more), Ok(()));
        // Unnamed, an entry is vacant and the next GPU learnt takes it.
        g.unname(named[3], 1000);
        assert!(g[named[3]].vacant());
        assert_eq!(g.find(&uuid(3)), None);
        assert_eq!(g.by_uuid(&uuid(200), 1 << 30), named[3]);
        assert_eq!(g.len(), LEARNED_GPUS_PER_USER);
        assert_eq!(
            g.by_uuid(&uuid(0), 0),
            named[0],
            "a known GPU keeps its entry"
        );
    }

    #[test]
    fn mig_instances_take_the_entry_of_one_gone_that_no_process_names() {
        let mut g = Gpus::new(&found(1), SchedConfig::default(), true);
        let a = "MIG-11111111-1111-1111-1111-111111111111";
        let b = "MIG-22222222-2222-2222-2222-222222222222";
        let c = "MIG-33333333-3333-3333-3333-333333333333";
        g.add_mig((0, 1), a, ("3g.40gb", 40 << 30), &[], |_| false);
        g.add_mig((0, 1), a, ("3g.40gb", 40 << 30), &[], |_| false);
        assert_eq!(g.len(), 2, "added once");
        assert_eq!(g.telemetry_uuids(&[a.into()]).len(), 2);
        assert_eq!(
            g.telemetry_uuids(&[]).len(),
            1,
            "a MIG instance gone is not sampled"
        );
        // `a` is gone but a process still names it: kept.
        g.add_mig((0, 2), b, ("3g.40gb", 40 << 30), &[b.into()], |i| i == 1);
        assert_eq!(g.len(), 3);
        // Now nobody names `a`: its entry is reused.
        g.add_mig(
            (0, 1),
            c,
            ("3g.40gb", 40 << 30),
            &[b.into(), c.into()],
            |_| false,
        );
        assert_eq!(g.len(), 3);
        assert_eq!(g[1].uuid_str, c);
        assert_eq!(g[1].mig, Some((0, 1)));
        // An old-form UUID cannot be a unit.
        g.add_mig((0, 3), "MIG-GPU-x/1/0", ("1g.10gb", 10 << 30), &[], |_| {
            false
        });
        assert_eq!(g.len(), 3);
    }
}
