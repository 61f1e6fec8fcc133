//! GPU and compute instances in the shared state file, so that every
//! process on one `GPUFRAC_SIM_STATE` sees the same ones, and the rules the
//! driver applies when they are created and destroyed (placements, profile
//! counts, refusals while in use).

use std::sync::atomic::{AtomicU32, Ordering::*};

use gpufrac_common::cuda::*;

use super::profiles::{
    CI_PROFILE_COUNT, GiProfile, MAX_CI, MAX_GI, Model, ModelInfo, ci_profiles, ci_starts,
};
use crate::config::DevSpec;
use crate::state::{MAX_DEV, MIG_SLOTS, Sim};

#[repr(C)]
pub struct SharedCi {
    live: AtomicU32,
    profile: AtomicU32,
    start: AtomicU32,
    serial: AtomicU32,
}

#[repr(C)]
pub struct SharedGi {
    live: AtomicU32,
    /// `NVML_GPU_INSTANCE_PROFILE_*`.
    profile: AtomicU32,
    start: AtomicU32,
    /// MIG slot backing its memory and engine.
    slot: AtomicU32,
    cis: [SharedCi; MAX_CI],
}

/// In the state file, after the devices and process slots. Written only
/// under the MIG lock (`Sim::mig`).
#[repr(C)]
pub struct MigShared {
    /// Last compute instance serial handed out: a MIG UUID is never reused.
    serial: AtomicU32,
    slot_taken: [AtomicU32; MIG_SLOTS],
    gis: [[SharedGi; MAX_GI]; MAX_DEV],
}

/// A live GPU instance.
#[derive(Clone, Copy, Debug)]
pub struct Gi {
    pub phys: usize,
    pub idx: usize,
    pub profile: &'static GiProfile,
    pub start: u32,
    /// MIG slot: `Shared::devs[MAX_DEV + slot]` holds its memory and engine.
    pub slot: usize,
}

impl Gi {
    pub fn id(&self) -> u32 {
        self.idx as u32 + 1
    }

    pub fn memory(&self) -> u64 {
        self.profile.mem_mib << 20
    }

    pub(super) fn key(&self) -> usize {
        self.phys * MAX_GI + self.idx
    }
}

/// A live compute instance: a MIG device.
#[derive(Clone, Copy, Debug)]
pub struct Ci {
    pub gi: Gi,
    pub idx: usize,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` and its slices.
    pub profile: u32,
    pub slices: u32,
    pub start: u32,
    pub serial: u32,
}

impl Ci {
    pub fn id(&self) -> u32 {
        self.idx as u32
    }

    pub fn sms(&self) -> u32 {
        self.gi.profile.sms * self.slices / self.gi.profile.slices
    }

    /// The MIG device's UUID: distinct from every GPU's (which start
    /// 5a1e6f7a) and, by its serial, from every earlier instance's.
    pub fn uuid(&self) -> CUuuid {
        let s = self.serial.to_be_bytes();
        CUuuid {
            bytes: [
                0x3c,
                0x1e,
                0x6f,
                0x7a,
                0xc0,
                0xde,
                0x40,
                0x00,
                0x80,
                self.gi.phys as u8,
                self.gi.idx as u8,
                self.idx as u8,
                s[0],
                s[1],
                s[2],
                s[3],
            ],
        }
    }

    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and
    /// `CUDA_VISIBLE_DEVICES` spell it.
    pub fn uuid_string(&self) -> String {
        let mut buf = [0u8; 40];
        let n = format_uuid(&self.uuid(), &mut buf);
        format!("MIG-{}", String::from_utf8_lossy(&buf[4..n]))
    }

    pub(super) fn key(&self) -> usize {
        self.gi.key() * MAX_CI + self.idx
    }
}

/// The MIG tables, read and changed under the lock `Sim::mig` holds.
pub struct Mig<'a> {
    sh: &'a MigShared,
    phys: &'a [DevSpec],
}

impl<'a> Mig<'a> {
    pub fn new(sh: &'a MigShared, phys: &'a [DevSpec]) -> Mig<'a> {
        Mig { sh, phys }
    }

    /// The model of `p` when its MIG mode is on.
    pub fn enabled(&self, p: usize) -> Option<&'static ModelInfo> {
        let d = self.phys.get(p)?;
        d.model.filter(|_| d.mig).map(Model::info)
    }

    pub(super) fn gi_at(&self, p: usize, idx: usize) -> Option<Gi> {
        let info = self.enabled(p)?;
        let g = &self.sh.gis[p][idx];
        if g.live.load(Acquire) == 0 {
            return None;
        }
        Some(Gi {
            phys: p,
            idx,
            profile: info.by_index(g.profile.load(Acquire))?,
            start: g.start.load(Acquire),
            slot: g.slot.load(Acquire) as usize,
        })
    }

    pub fn gis(&self, p: usize) -> Vec<Gi> {
        if p >= self.phys.len() {
            return Vec::new();
        }
        (0..MAX_GI).filter_map(|i| self.gi_at(p, i)).collect()
    }

    pub(super) fn ci_at(&self, gi: &Gi, idx: usize) -> Option<Ci> {
        let c = &self.sh.gis[gi.phys][gi.idx].cis[idx];
        if c.live.load(Acquire) == 0 {
            return None;
        }
        let profile = c.profile.load(Acquire);
        let slices = ci_profiles(gi.profile.slices)
            .iter()
            .find(|(i, _)| *i == profile)?
            .1;
        Some(Ci {
            gi: *gi,
            idx,
            profile,
            slices,
            start: c.start.load(Acquire),
            serial: c.serial.load(Acquire),
        })
    }

    pub fn cis(&self, gi: &Gi) -> Vec<Ci> {
        (0..MAX_CI).filter_map(|i| self.ci_at(gi, i)).collect()
    }

    /// MIG devices of `p` in NVML's index order.
    pub fn devices(&self, p: usize) -> Vec<Ci> {
        self.gis(p).iter().flat_map(|g| self.cis(g)).collect()
    }

    pub fn find_uuid(&self, uuid: &str) -> Option<Ci> {
        (0..self.phys.len())
            .flat_map(|p| self.devices(p))
            .find(|c| c.uuid_string().eq_ignore_ascii_case(uuid.trim()))
    }

    pub fn device_name(&self, ci: &Ci) -> String {
        let model = self.phys[ci.gi.phys].model.map_or("", |m| m.info().name);
        if ci.slices == ci.gi.profile.slices {
            format!("gpufrac-sim {model} MIG {}", ci.gi.profile.name)
        } else {
            format!(
                "gpufrac-sim {model} MIG {}c.{}",
                ci.slices, ci.gi.profile.name
            )
        }
    }

    fn free_at(&self, p: usize, start: u32, size: u32) -> bool {
        self.gis(p)
            .iter()
            .all(|g| g.start + g.profile.size <= start || start + size <= g.start)
    }

    /// Where `prof` could go now, first first.
    fn free_starts(&self, p: usize, prof: &GiProfile) -> Vec<u32> {
        let n = self
            .gis(p)
            .iter()
            .filter(|g| g.profile.id == prof.id)
            .count() as u32;
        if n >= prof.count {
            return Vec::new();
        }
        prof.starts
            .iter()
            .copied()
            .filter(|&s| self.free_at(p, s, prof.size))
            .collect()
    }

    /// How many more of `prof` fit, placed first-fit.
    pub fn remaining(&self, p: usize, prof: &GiProfile) -> u32 {
        let gis = self.gis(p);
        let n = gis.iter().filter(|g| g.profile.id == prof.id).count() as u32;
        let mut taken: Vec<(u32, u32)> = gis.iter().map(|g| (g.start, g.profile.size)).collect();
        let mut more = 0;
        for &s in prof.starts {
            if n + more >= prof.count {
                break;
            }
            if taken.iter().all(|&(a, z)| a + z <= s || s + prof.size <= a) {
                taken.push((s, prof.size));
                more += 1;
            }
        }
        more
    }

    pub fn create_gi(
        &self,
        p: usize,
        prof: &'static GiProfile,
        start: Option<u32>,
    ) -> Result<Gi, nvmlReturn_t> {
        let start = match start {
            Some(s) => {
                if !prof.starts.contains(&s) {
                    return Err(NVML_ERROR_INVALID_ARGUMENT);
                }
                if !self.free_starts(p, prof).contains(&s) {
                    return Err(NVML_ERROR_INSUFFICIENT_RESOURCES);
                }
                s
            }
            None => *self
                .free_starts(p, prof)
                .first()
                .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?,
        };
        let idx = (0..MAX_GI)
            .find(|&i| self.sh.gis[p][i].live.load(Acquire) == 0)
            .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        // A machine-wide pool: the simulator's only limit beyond the GPU's.
        let slot = (0..MIG_SLOTS)
            .find(|&k| {
                self.sh.slot_taken[k]
                    .compare_exchange(0, 1, AcqRel, Acquire)
                    .is_ok()
            })
            .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        let g = &self.sh.gis[p][idx];
        g.profile.store(prof.index, Release);
        g.start.store(start, Release);
        g.slot.store(slot as u32, Release);
        for c in &g.cis {
            c.live.store(0, Release);
        }
        g.live.store(1, Release);
        Ok(Gi {
            phys: p,
            idx,
            profile: prof,
            start,
            slot,
        })
    }

    pub fn destroy_gi(&self, gi: &Gi) -> Result<(), nvmlReturn_t> {
        if !self.cis(gi).is_empty() {
            return Err(NVML_ERROR_IN_USE);
        }
        let g = &self.sh.gis[gi.phys][gi.idx];
        g.live.store(0, Release);
        self.sh.slot_taken[gi.slot].store(0, Release);
        Ok(())
    }

    fn ci_free_starts(&self, gi: &Gi, slices: u32) -> Vec<u32> {
        let cis = self.cis(gi);
        ci_starts(gi.profile.slices, slices)
            .into_iter()
            .filter(|&s| {
                cis.iter()
                    .all(|c| c.start + c.slices <= s || s + slices <= c.start)
            })
            .collect()
    }

    pub fn create_ci(&self, gi: &Gi, profile: u32) -> Result<Ci, nvmlReturn_t> {
        let slices = ci_slices(gi, profile)?;
        let start = *self
            .ci_free_starts(gi, slices)
            .first()
            .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        let g = &self.sh.gis[gi.phys][gi.idx];
        let idx = (0..MAX_CI)
            .find(|&i| g.cis[i].live.load(Acquire) == 0)
            .ok_or(NVML_ERROR_INSUFFICIENT_RESOURCES)?;
        let serial = self.sh.serial.fetch_add(1, AcqRel).wrapping_add(1).max(1);
        let c = &g.cis[idx];
        c.profile.store(profile, Release);
        c.start.store(start, Release);
        c.serial.store(serial, Release);
        c.live.store(1, Release);
        Ok(Ci {
            gi: *gi,
            idx,
            profile,
            slices,
            start,
            serial,
        })
    }

    /// `in_use`: a live process runs on it (`Sim::mig_in_use`).
    pub fn destroy_ci(&self, ci: &Ci, in_use: bool) -> Result<(), nvmlReturn_t> {
        if in_use {
            return Err(NVML_ERROR_IN_USE);
        }
        self.sh.gis[ci.gi.phys][ci.gi.idx].cis[ci.idx]
            .live
            .store(0, Release);
        Ok(())
    }

    /// Memory in use on `p` and all its instances.
    pub fn phys_used(&self, s: &Sim, p: usize) -> u64 {
        s.slot_used(p)
            + self
                .gis(p)
                .iter()
                .map(|g| s.slot_used(MAX_DEV + g.slot))
                .sum::<u64>()
    }
}

pub(super) fn ci_slices(gi: &Gi, profile: u32) -> Result<u32, nvmlReturn_t> {
    if profile >= CI_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    ci_profiles(gi.profile.slices)
        .iter()
        .find(|(i, _)| *i == profile)
        .map(|(_, s)| *s)
        .ok_or(NVML_ERROR_NOT_SUPPORTED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_devices;

    /// Zeroed tables (no instance), as a new state file has them.
    fn tables() -> Box<MigShared> {
        // SAFETY: MigShared is atomics only, for which zero is valid.
        unsafe { Box::<MigShared>::new_zeroed().assume_init() }
    }

    /// An A100-40GB profile by name.
    fn profile(name: &str) -> &'static GiProfile {
        let info: &'static ModelInfo = Model::A100_40GB.info();
        info.profiles.iter().find(|g| g.name == name).unwrap()
    }

    #[test]
    fn gpu_instances_take_the_first_free_placement_and_run_out() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let p3 = profile("3g.20gb");
        assert_eq!(m.remaining(0, p3), 2);
        let a = m.create_gi(0, p3, None).unwrap();
        let b = m.create_gi(0, p3, None).unwrap();
        assert_eq!((a.start, b.start), (0, 4));
        assert_ne!(
            a.slot, b.slot,
            "each instance has its own memory and engine"
        );
        assert_eq!(
            m.create_gi(0, p3, None).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        assert_eq!(m.remaining(0, p3), 0);
        // Eight memory slices taken: not even the smallest profile fits.
        let p1 = profile("1g.5gb");
        assert_eq!(m.remaining(0, p1), 0);
        assert_eq!(
            m.create_gi(0, p1, None).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        let gis = m.gis(0);
        assert_eq!(
            gis.iter().map(|g| (g.id(), g.start)).collect::<Vec<_>>(),
            [(1, 0), (2, 4)]
        );
        assert_eq!(gis[0].memory(), 19968 << 20);
    }

    #[test]
    fn a_placement_must_be_one_the_profile_allows_and_free() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let p2 = profile("2g.10gb");
        assert_eq!(
            m.create_gi(0, p2, Some(1)).unwrap_err(),
            NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(m.create_gi(0, p2, Some(2)).unwrap().start, 2);
        assert_eq!(
            m.create_gi(0, p2, Some(2)).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        // 4g.20gb starts only at 0, and its four memory slices overlap
        // the 2g.10gb at 2.
        let p4 = profile("4g.20gb");
        assert_eq!(
            m.create_gi(0, p4, None).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        // 1g.5gb fits at 0, 1 and 4..6 beside 2g.10gb at 2..3.
        assert_eq!(m.remaining(0, profile("1g.5gb")), 5);
    }

    #[test]
    fn profile_counts_limit_instances_whatever_the_room() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let me = profile("1g.5gb+me");
        assert_eq!(me.count, 1);
        assert_eq!(m.remaining(0, me), 1);
        m.create_gi(0, me, None).unwrap();
        assert_eq!(m.remaining(0, me), 0);
        assert_eq!(
            m.create_gi(0, me, None).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        // The plain 1g.5gb still fits in the other six slices.
        assert_eq!(m.remaining(0, profile("1g.5gb")), 6);
    }

    #[test]
    fn compute_instances_fill_their_gpu_instance() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let gi = m.create_gi(0, profile("7g.40gb"), None).unwrap();
        // Profile 2: three slices, at 0 and 4 in a 7-slice instance.
        let a = m.create_ci(&gi, 2).unwrap();
        let b = m.create_ci(&gi, 2).unwrap();
        assert_eq!((a.start, b.start, a.slices), (0, 4, 3));
        assert_eq!(
            m.create_ci(&gi, 2).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        // One slice left, at 3.
        assert_eq!(m.create_ci(&gi, 0).unwrap().start, 3);
        assert_eq!(
            m.create_ci(&gi, 0).unwrap_err(),
            NVML_ERROR_INSUFFICIENT_RESOURCES
        );
        // Four slices is no profile of a 7-slice instance; 8 no profile at all.
        assert_eq!(m.create_ci(&gi, 3).unwrap_err(), NVML_ERROR_NOT_SUPPORTED);
        assert_eq!(
            m.create_ci(&gi, 8).unwrap_err(),
            NVML_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(m.devices(0).len(), 3);
        assert_eq!(a.sms(), gi.profile.sms * 3 / 7);
        assert_eq!(
            m.device_name(&a),
            "gpufrac-sim A100-SXM4-40GB MIG 3c.7g.40gb"
        );
    }

    #[test]
    fn instances_in_use_are_not_destroyed() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let gi = m.create_gi(0, profile("3g.20gb"), None).unwrap();
        let ci = m.create_ci(&gi, 2).unwrap();
        assert_eq!(
            m.destroy_gi(&gi).unwrap_err(),
            NVML_ERROR_IN_USE,
            "it has a compute instance"
        );
        assert_eq!(
            m.destroy_ci(&ci, true).unwrap_err(),
            NVML_ERROR_IN_USE,
            "a process runs on it"
        );
        assert_eq!(m.devices(0).len(), 1);
        m.destroy_ci(&ci, false).unwrap();
        m.destroy_gi(&gi).unwrap();
        assert!(m.gis(0).is_empty());
        // The slices and the machine-wide slot are free again.
        assert_eq!(m.remaining(0, profile("3g.20gb")), 2);
        assert_eq!(
            m.create_gi(0, profile("3g.20gb"), None).unwrap().slot,
            gi.slot
        );
    }

    #[test]
    fn a_mig_uuid_is_never_reused() {
        let sh = tables();
        let phys = parse_devices("A100-40GB:mig").unwrap();
        let m = Mig::new(&sh, &phys);
        let gi = m.create_gi(0, profile("1g.5gb"), None).unwrap();
        let first = m.create_ci(&gi, 0).unwrap();
        let uuid = first.uuid_string();
        assert!(uuid.starts_with("MIG-3c1e6f7a-"), "{uuid}");
        assert_eq!(
            m.find_uuid(&uuid.to_ascii_uppercase()).map(|c| c.idx),
            Some(first.idx)
        );
        m.destroy_ci(&first, false).unwrap();
        assert!(m.find_uuid(&uuid).is_none());
        let again = m.create_ci(&gi, 0).unwrap();
        assert_eq!(again.idx, first.idx, "the same slot");
        assert_ne!(again.uuid_string(), uuid, "a new UUID");
    }

    #[test]
    fn nothing_without_mig_mode() {
        let sh = tables();
        let phys = parse_devices("A100-40GB,16G").unwrap();
        let m = Mig::new(&sh, &phys);
        assert!(m.enabled(0).is_none(), "a capable model with MIG off");
        assert!(m.enabled(1).is_none(), "a plain device");
        assert!(m.enabled(2).is_none(), "no such device");
        assert!(m.gis(0).is_empty() && m.gis(7).is_empty());
    }
}
