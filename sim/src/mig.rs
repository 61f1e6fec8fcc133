//! MIG on the simulated devices: the GPU models whose MIG profiles NVIDIA
//! documents, GPU and compute instances kept in the shared state (so every
//! process on one `GPUFRAC_SIM_STATE` sees the same instances), MIG device
//! UUIDs and handles, and the NVML entry points over them with the
//! signatures of `nvml.h`.
//!
//! Profiles, memory sizes and placements are what `nvidia-smi mig -lgip`
//! and `-lgipp` print on these GPUs (NVIDIA's MIG user guide): a GPU has 7
//! compute slices and 8 memory slices, and a profile may start only where
//! the hardware allows (`1g.5gb` at 0..6, `2g.10gb` at 0, 2, 4, `3g.20gb`
//! at 0 and 4, `4g.20gb` and `7g.40gb` at 0). Engine counts (copy engines,
//! decoders, JPEG, OFA) are approximate; nothing in gpufrac reads them.
//!
//! Like the real driver, the simulator refuses to destroy a GPU instance
//! that still has compute instances (`NVML_ERROR_IN_USE`), and a compute
//! instance that a live process runs on (one that loaded the simulator with
//! `CUDA_VISIBLE_DEVICES=MIG-<uuid>`). MIG mode itself is read-only: it
//! comes from `GPUFRAC_SIM_DEVICES` (`A100-40GB:mig`) and nothing sets it.
//!
//! Simplifications: GPU instance ids are 1..=8 and compute instance ids
//! 0..=7 in creation slots (the driver's ids depend on the placement);
//! every MIG device has its own execution engine, shared by the compute
//! instances of one GPU instance; `nvmlDeviceCreateGpuInstance` and
//! compute instance creation take the first free placement.
#![allow(non_camel_case_types)] // NVML's names, as nvml.h spells them.

use std::ffi::{CStr, c_char, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering::*};

use gpufrac_common::cuda::*;

use crate::config::DevSpec;
use crate::nvml::{dev, handle, nvml};
use crate::state::{MAX_DEV, MIG_SLOTS, Shared, Sim};
use crate::{out, write_cstr};

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of current headers: profile numbers
/// at or past it are invalid arguments, below it merely unsupported.
const GI_PROFILE_COUNT: u32 = 17;
const CI_PROFILE_COUNT: u32 = 8;
const CI_ENGINE_PROFILE_SHARED: u32 = 0;
/// GPU instances per GPU (the hardware has at most 7) and compute
/// instances per GPU instance.
pub const MAX_GI: usize = 8;
pub const MAX_CI: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    A100_40GB,
    A100_80GB,
    H100_80GB,
}

/// A GPU instance profile as NVML describes it.
#[derive(Debug)]
pub struct GiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: what `nvmlDeviceGetGpuInstanceProfileInfo`
    /// takes.
    pub index: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id` (nvidia-smi's profile ID): what
    /// placement queries and creation take.
    pub id: u32,
    pub name: &'static str,
    /// Compute slices (of 7).
    pub slices: u32,
    /// Memory slices a placement occupies (of 8).
    pub size: u32,
    pub mem_mib: u64,
    pub sms: u32,
    /// Most instances of this profile at once.
    pub count: u32,
    /// Where a placement may start.
    pub starts: &'static [u32],
    pub ce: u32,
    pub dec: u32,
    pub jpeg: u32,
    pub ofa: u32,
}

pub struct ModelInfo {
    /// As NVML and CUDA name the GPU, less "NVIDIA ".
    pub name: &'static str,
    /// What nvidia-smi reports as the GPU's total memory.
    pub total_mib: u64,
    pub sms: u32,
    pub profiles: [GiProfile; 7],
}

const ONE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO: &[u32] = &[0, 2, 4, 6];
const TWO_G: &[u32] = &[0, 2, 4];
const THREE: &[u32] = &[0, 4];
const FULL: &[u32] = &[0];

/// (index, id, slices, size, count, starts, copy engines, OFA) of a profile:
/// what every model here shares.
type Shape = (u32, u32, u32, u32, u32, &'static [u32], u32, u32);

/// The seven profiles in NVML's order; sizes and SMs differ by model.
#[allow(clippy::too_many_arguments)]
const fn profiles(
    names: [&'static str; 7],
    mib: [u64; 7],
    sms: [u32; 7],
    dec: [u32; 7],
    jpeg: [u32; 7],
) -> [GiProfile; 7] {
    const SHAPE: [Shape; 7] = [
        (0, 19, 1, 1, 7, ONE, 1, 0),
        (7, 20, 1, 1, 1, ONE, 1, 1),
        (9, 15, 1, 2, 4, TWO, 1, 0),
        (1, 14, 2, 2, 3, TWO_G, 2, 0),
        (2, 9, 3, 4, 2, THREE, 3, 0),
        (3, 5, 4, 4, 1, FULL, 4, 0),
        (4, 0, 7, 8, 1, FULL, 7, 1),
    ];
    let mut out = [const {
        GiProfile {
            index: 0,
            id: 0,
            name: "",
            slices: 0,
            size: 0,
            mem_mib: 0,
            sms: 0,
            count: 0,
            starts: &[],
            ce: 0,
            dec: 0,
            jpeg: 0,
            ofa: 0,
        }
    }; 7];
    let mut i = 0;
    while i < 7 {
        let (index, id, slices, size, count, starts, ce, ofa) = SHAPE[i];
        out[i] = GiProfile {
            index,
            id,
            name: names[i],
            slices,
            size,
            mem_mib: mib[i],
            sms: sms[i],
            count,
            starts,
            ce,
            dec: dec[i],
            jpeg: jpeg[i],
            ofa,
        };
        i += 1;
    }
    out
}

static A100_40GB: ModelInfo = ModelInfo {
    name: "A100-SXM4-40GB",
    total_mib: 40960,
    sms: 108,
    profiles: profiles(
        [
            "1g.5gb",
            "1g.5gb+me",
            "1g.10gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
        ],
        [4864, 4864, 9856, 9856, 19968, 19968, 40192],
        [14, 14, 14, 28, 42, 56, 98],
        [0, 1, 1, 1, 2, 2, 5],
        [0, 1, 0, 0, 0, 0, 1],
    ),
};

static A100_80GB: ModelInfo = ModelInfo {
    name: "A100-SXM4-80GB",
    total_mib: 81920,
    sms: 108,
    profiles: profiles(
        [
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
        ],
        [9728, 9728, 19968, 19968, 40192, 40192, 80896],
        [14, 14, 14, 28, 42, 56, 98],
        [0, 1, 1, 1, 2, 2, 5],
        [0, 1, 0, 0, 0, 0, 1],
    ),
};

static H100_80GB: ModelInfo = ModelInfo {
    name: "H100 80GB HBM3",
    total_mib: 81559,
    sms: 132,
    profiles: profiles(
        [
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
        ],
        [9984, 9984, 20096, 20096, 40448, 40448, 81152],
        [16, 16, 26, 32, 60, 64, 132],
        [1, 1, 1, 2, 3, 4, 7],
        [1, 1, 1, 2, 3, 4, 7],
    ),
};

impl Model {
    pub const NAMES: [&'static str; 3] = ["A100-40GB", "A100-80GB", "H100-80GB"];

    pub fn parse(s: &str) -> Option<Model> {
        let all = [Model::A100_40GB, Model::A100_80GB, Model::H100_80GB];
        Model::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(s.trim()))
            .map(|i| all[i])
    }

    pub fn info(self) -> &'static ModelInfo {
        match self {
            Model::A100_40GB => &A100_40GB,
            Model::A100_80GB => &A100_80GB,
            Model::H100_80GB => &H100_80GB,
        }
    }
}

impl ModelInfo {
    pub fn by_index(&'static self, index: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.index == index)
    }

    pub fn by_id(&'static self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }
}

/// Compute instance profiles a GPU instance of `slices` compute slices
/// offers (`NVML_COMPUTE_INSTANCE_PROFILE_*` numbers and their slices).
fn ci_profiles(slices: u32) -> &'static [(u32, u32)] {
    match slices {
        1 => &[(0, 1)],
        2 => &[(0, 1), (1, 2)],
        3 => &[(0, 1), (1, 2), (2, 3)],
        4 => &[(0, 1), (1, 2), (3, 4)],
        7 => &[(0, 1), (1, 2), (2, 3), (4, 7)],
        _ => &[],
    }
}

/// Where a compute instance of `c` slices may start in a GPU instance of
/// `s` slices.
fn ci_starts(s: u32, c: u32) -> Vec<u32> {
    if (s, c) == (7, 3) {
        return vec![0, 4];
    }
    (0..s).step_by(c as usize).filter(|x| x + c <= s).collect()
}

// --- Shared state -----------------------------------------------------------

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

    fn key(&self) -> usize {
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

    fn key(&self) -> usize {
        self.gi.key() * MAX_CI + self.idx
    }
}

/// The MIG tables, read and changed under the lock `Sim::mig` holds.
pub struct Mig<'a> {
    sh: &'a MigShared,
    phys: &'a [DevSpec],
}

impl<'a> Mig<'a> {
    pub fn new(shared: &'a Shared, phys: &'a [DevSpec]) -> Mig<'a> {
        Mig {
            sh: &shared.mig,
            phys,
        }
    }

    /// The model of `p` when its MIG mode is on.
    pub fn enabled(&self, p: usize) -> Option<&'static ModelInfo> {
        let d = self.phys.get(p)?;
        d.model.filter(|_| d.mig).map(Model::info)
    }

    fn gi_at(&self, p: usize, idx: usize) -> Option<Gi> {
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

    fn ci_at(&self, gi: &Gi, idx: usize) -> Option<Ci> {
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

fn ci_slices(gi: &Gi, profile: u32) -> Result<u32, nvmlReturn_t> {
    if profile >= CI_PROFILE_COUNT {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    ci_profiles(gi.profile.slices)
        .iter()
        .find(|(i, _)| *i == profile)
        .map(|(_, s)| *s)
        .ok_or(NVML_ERROR_NOT_SUPPORTED)
}

// --- Handles ------------------------------------------------------------------

/// Handles are addresses in these arrays (one record per possible
/// instance), so they stay valid pointers whatever is destroyed; the
/// values tell the arrays apart.
#[repr(C)]
pub struct Rec(u32);

const N_GI: usize = MAX_DEV * MAX_GI;
const N_CI: usize = N_GI * MAX_CI;

const fn recs<const N: usize>(tag: u32) -> [Rec; N] {
    let mut a = [const { Rec(0) }; N];
    let mut i = 0;
    while i < N {
        a[i] = Rec(tag | i as u32);
        i += 1;
    }
    a
}

static GI_HANDLES: [Rec; N_GI] = recs(0x1000_0000);
static CI_HANDLES: [Rec; N_CI] = recs(0x2000_0000);
static MIG_HANDLES: [Rec; N_CI] = recs(0x3000_0000);

fn to_handle(a: &'static [Rec], i: usize) -> *mut c_void {
    &a[i] as *const Rec as *mut c_void
}

fn from_handle(a: &'static [Rec], h: *mut c_void) -> Option<usize> {
    let off = (h as usize).wrapping_sub(a.as_ptr() as usize);
    let sz = std::mem::size_of::<Rec>();
    (!h.is_null() && off.is_multiple_of(sz) && off / sz < a.len()).then_some(off / sz)
}

/// `(physical device, GPU instance slot, compute instance slot)` of a MIG
/// device handle; no liveness check.
pub fn mig_handle(h: nvmlDevice_t) -> Option<(usize, usize, usize)> {
    from_handle(&MIG_HANDLES, h).map(|k| (k / (MAX_GI * MAX_CI), (k / MAX_CI) % MAX_GI, k % MAX_CI))
}

pub fn mig_device_handle(ci: &Ci) -> nvmlDevice_t {
    to_handle(&MIG_HANDLES, ci.key())
}

/// The live MIG device behind a MIG device handle.
pub fn live_mig_device(m: &Mig<'_>, h: nvmlDevice_t) -> Result<Ci, nvmlReturn_t> {
    let (p, g, c) = mig_handle(h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let gi = m.gi_at(p, g).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    m.ci_at(&gi, c).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

fn gi_handle(gi: &Gi) -> nvmlGpuInstance_t {
    to_handle(&GI_HANDLES, gi.key())
}

fn ci_handle(ci: &Ci) -> nvmlComputeInstance_t {
    to_handle(&CI_HANDLES, ci.key())
}

fn gi_of(m: &Mig<'_>, h: nvmlGpuInstance_t) -> Result<Gi, nvmlReturn_t> {
    let k = from_handle(&GI_HANDLES, h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    m.gi_at(k / MAX_GI, k % MAX_GI)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

fn ci_of(m: &Mig<'_>, h: nvmlComputeInstance_t) -> Result<Ci, nvmlReturn_t> {
    let k = from_handle(&CI_HANDLES, h).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let gi = m
        .gi_at(k / (MAX_GI * MAX_CI), (k / MAX_CI) % MAX_GI)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    m.ci_at(&gi, k % MAX_CI).ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

fn name96(s: &str) -> [c_char; 96] {
    let mut b = [0 as c_char; 96];
    for (d, &c) in b.iter_mut().zip(s.as_bytes().iter().take(95)) {
        *d = c as c_char;
    }
    b
}

fn gi_info(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.count,
        multiprocessorCount: p.sms,
        copyEngineCount: p.ce,
        decoderCount: p.dec,
        encoderCount: 0,
        jpegCount: p.jpeg,
        ofaCount: p.ofa,
        memorySizeMB: p.mem_mib,
    }
}

fn ci_info(gi: &Gi, profile: u32, slices: u32) -> nvmlComputeInstanceProfileInfo_t {
    let g = gi.profile;
    nvmlComputeInstanceProfileInfo_t {
        id: profile,
        sliceCount: slices,
        instanceCount: ci_starts(g.slices, slices).len() as u32,
        multiprocessorCount: g.sms * slices / g.slices,
        sharedCopyEngineCount: g.ce,
        sharedDecoderCount: g.dec,
        sharedEncoderCount: 0,
        sharedJpegCount: g.jpeg,
        sharedOfaCount: g.ofa,
    }
}

/// A physical device handle of a MIG-capable model (any MIG mode).
fn capable(h: nvmlDevice_t) -> Result<(&'static Sim, usize, &'static ModelInfo), nvmlReturn_t> {
    let (s, p) = dev(h)?;
    let info = s.phys[p].model.ok_or(NVML_ERROR_NOT_SUPPORTED)?.info();
    Ok((s, p, info))
}

/// A physical device handle in MIG mode.
fn enabled(h: nvmlDevice_t) -> Result<(&'static Sim, usize, &'static ModelInfo), nvmlReturn_t> {
    let (s, p, info) = capable(h)?;
    if !s.phys[p].mig {
        return Err(NVML_ERROR_NOT_SUPPORTED);
    }
    Ok((s, p, info))
}

/// Writes `items` into a caller's array whose capacity `*count` says (the
/// header leaves it to the caller to size it right; a short one is
/// refused here rather than overrun), or only the count when `arr` is NULL
/// and `null_ok`.
unsafe fn fill<T: Copy>(
    arr: *mut T,
    count: *mut c_uint,
    items: &[T],
    null_ok: bool,
) -> Result<(), nvmlReturn_t> {
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if arr.is_null() {
        if null_ok {
            unsafe { *count = items.len() as c_uint };
            return Ok(());
        }
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let room = unsafe { *count } as usize;
    unsafe { *count = items.len() as c_uint };
    if items.len() > room {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (i, v) in items.iter().enumerate() {
        unsafe { arr.add(i).write_unaligned(*v) };
    }
    Ok(())
}

nvml_exports! {
    fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) {
        let (s, p, _) = capable(device)?;
        let m = u32::from(s.phys[p].mig);
        out(current, m, NVML_ERROR_INVALID_ARGUMENT)?;
        out(pending, m, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetGpuInstanceProfileInfo(
        device: nvmlDevice_t,
        profile: c_uint,
        info: *mut nvmlGpuInstanceProfileInfo_t,
    ) {
        let (_, _, model) = capable(device)?;
        if profile >= GI_PROFILE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let p = model.by_index(profile).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        out(info, gi_info(p), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetGpuInstanceProfileInfoV(
        device: nvmlDevice_t,
        profile: c_uint,
        info: *mut nvmlGpuInstanceProfileInfo_v2_t,
    ) {
        let (_, _, model) = capable(device)?;
        if info.is_null() || profile >= GI_PROFILE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let version = (*info).version;
        let p = model.by_index(profile).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        let i = gi_info(p);
        let name = name96(&format!("MIG {}", p.name));
        match version {
            GI_PROFILE_INFO_V2 => {
                *info = nvmlGpuInstanceProfileInfo_v2_t {
                    version,
                    id: i.id,
                    isP2pSupported: i.isP2pSupported,
                    sliceCount: i.sliceCount,
                    instanceCount: i.instanceCount,
                    multiprocessorCount: i.multiprocessorCount,
                    copyEngineCount: i.copyEngineCount,
                    decoderCount: i.decoderCount,
                    encoderCount: i.encoderCount,
                    jpegCount: i.jpegCount,
                    ofaCount: i.ofaCount,
                    memorySizeMB: i.memorySizeMB,
                    name,
                };
            }
            GI_PROFILE_INFO_V3 => {
                *(info as *mut nvmlGpuInstanceProfileInfo_v3_t) = nvmlGpuInstanceProfileInfo_v3_t {
                    version,
                    id: i.id,
                    sliceCount: i.sliceCount,
                    instanceCount: i.instanceCount,
                    multiprocessorCount: i.multiprocessorCount,
                    copyEngineCount: i.copyEngineCount,
                    decoderCount: i.decoderCount,
                    encoderCount: i.encoderCount,
                    jpegCount: i.jpegCount,
                    ofaCount: i.ofaCount,
                    memorySizeMB: i.memorySizeMB,
                    name,
                    capabilities: 0,
                };
            }
            _ => return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
        }
        Ok(())
    }

    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
        device: nvmlDevice_t,
        profileId: c_uint,
        placements: *mut nvmlGpuInstancePlacement_t,
        count: *mut c_uint,
    ) {
        let (_, _, model) = capable(device)?;
        let p = model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let v: Vec<nvmlGpuInstancePlacement_t> = p
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t { start, size: p.size })
            .collect();
        fill(placements, count, &v, true)
    }

    fn nvmlDeviceGetGpuInstanceRemainingCapacity(
        device: nvmlDevice_t,
        profileId: c_uint,
        count: *mut c_uint,
    ) {
        let (s, p, model) = enabled(device)?;
        let prof = model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let (_g, m) = s.mig();
        out(count, m.remaining(p, prof), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceCreateGpuInstance(
        device: nvmlDevice_t,
        profileId: c_uint,
        gpuInstance: *mut nvmlGpuInstance_t,
    ) {
        let (s, p, model) = enabled(device)?;
        let prof = model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if gpuInstance.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (_g, m) = s.mig();
        let gi = m.create_gi(p, prof, None)?;
        *gpuInstance = gi_handle(&gi);
        Ok(())
    }

    fn nvmlDeviceCreateGpuInstanceWithPlacement(
        device: nvmlDevice_t,
        profileId: c_uint,
        placement: *const nvmlGpuInstancePlacement_t,
        gpuInstance: *mut nvmlGpuInstance_t,
    ) {
        let (s, p, model) = enabled(device)?;
        let prof = model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        if gpuInstance.is_null() || placement.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let want = placement.read_unaligned();
        if want.size != prof.size {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (_g, m) = s.mig();
        let gi = m.create_gi(p, prof, Some(want.start))?;
        *gpuInstance = gi_handle(&gi);
        Ok(())
    }

    fn nvmlGpuInstanceDestroy(gpuInstance: nvmlGpuInstance_t) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        m.destroy_gi(&gi)
    }

    fn nvmlDeviceGetGpuInstances(
        device: nvmlDevice_t,
        profileId: c_uint,
        gpuInstances: *mut nvmlGpuInstance_t,
        count: *mut c_uint,
    ) {
        let (s, p, model) = enabled(device)?;
        let prof = model.by_id(profileId).ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let (_g, m) = s.mig();
        let v: Vec<nvmlGpuInstance_t> = m
            .gis(p)
            .iter()
            .filter(|g| g.profile.id == prof.id)
            .map(gi_handle)
            .collect();
        fill(gpuInstances, count, &v, false)
    }

    fn nvmlDeviceGetGpuInstanceById(device: nvmlDevice_t, id: c_uint, gpuInstance: *mut nvmlGpuInstance_t) {
        let (s, p, _) = enabled(device)?;
        let (_g, m) = s.mig();
        let gi = m.gis(p).into_iter().find(|g| g.id() == id).ok_or(NVML_ERROR_NOT_FOUND)?;
        out(gpuInstance, gi_handle(&gi), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlGpuInstanceGetInfo(gpuInstance: nvmlGpuInstance_t, info: *mut nvmlGpuInstanceInfo_t) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        out(
            info,
            nvmlGpuInstanceInfo_t {
                device: handle(gi.phys),
                id: gi.id(),
                profileId: gi.profile.id,
                placement: nvmlGpuInstancePlacement_t { start: gi.start, size: gi.profile.size },
            },
            NVML_ERROR_INVALID_ARGUMENT,
        )
    }

    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gpuInstance: nvmlGpuInstance_t,
        profile: c_uint,
        engProfile: c_uint,
        info: *mut nvmlComputeInstanceProfileInfo_t,
    ) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        if engProfile != CI_ENGINE_PROFILE_SHARED {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let slices = ci_slices(&gi, profile)?;
        out(info, ci_info(&gi, profile, slices), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        gpuInstance: nvmlGpuInstance_t,
        profile: c_uint,
        engProfile: c_uint,
        info: *mut nvmlComputeInstanceProfileInfo_v2_t,
    ) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        if info.is_null() || engProfile != CI_ENGINE_PROFILE_SHARED {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let version = (*info).version;
        let slices = ci_slices(&gi, profile)?;
        let i = ci_info(&gi, profile, slices);
        let name = if slices == gi.profile.slices {
            format!("MIG {}", gi.profile.name)
        } else {
            format!("MIG {slices}c.{}", gi.profile.name)
        };
        let v2 = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: i.id,
            sliceCount: i.sliceCount,
            instanceCount: i.instanceCount,
            multiprocessorCount: i.multiprocessorCount,
            sharedCopyEngineCount: i.sharedCopyEngineCount,
            sharedDecoderCount: i.sharedDecoderCount,
            sharedEncoderCount: i.sharedEncoderCount,
            sharedJpegCount: i.sharedJpegCount,
            sharedOfaCount: i.sharedOfaCount,
            name: name96(&name),
        };
        match version {
            CI_PROFILE_INFO_V2 => *info = v2,
            CI_PROFILE_INFO_V3 => {
                *(info as *mut nvmlComputeInstanceProfileInfo_v3_t) = nvmlComputeInstanceProfileInfo_v3_t {
                    version,
                    id: v2.id,
                    sliceCount: v2.sliceCount,
                    instanceCount: v2.instanceCount,
                    multiprocessorCount: v2.multiprocessorCount,
                    sharedCopyEngineCount: v2.sharedCopyEngineCount,
                    sharedDecoderCount: v2.sharedDecoderCount,
                    sharedEncoderCount: v2.sharedEncoderCount,
                    sharedJpegCount: v2.sharedJpegCount,
                    sharedOfaCount: v2.sharedOfaCount,
                    name: v2.name,
                    capabilities: 0,
                };
            }
            _ => return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
        }
        Ok(())
    }

    fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        gpuInstance: nvmlGpuInstance_t,
        profileId: c_uint,
        count: *mut c_uint,
    ) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        let slices = ci_slices(&gi, profileId)?;
        // Aligned first-fit is what creation does, so counting its free
        // starts greedily counts what creation would manage.
        let mut taken: Vec<(u32, u32)> = m.cis(&gi).iter().map(|c| (c.start, c.slices)).collect();
        let mut n = 0;
        for st in ci_starts(gi.profile.slices, slices) {
            if taken.iter().all(|&(a, z)| a + z <= st || st + slices <= a) {
                taken.push((st, slices));
                n += 1;
            }
        }
        out(count, n, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlGpuInstanceCreateComputeInstance(
        gpuInstance: nvmlGpuInstance_t,
        profileId: c_uint,
        computeInstance: *mut nvmlComputeInstance_t,
    ) {
        let s = nvml()?;
        if computeInstance.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        let ci = m.create_ci(&gi, profileId)?;
        *computeInstance = ci_handle(&ci);
        Ok(())
    }

    fn nvmlComputeInstanceDestroy(computeInstance: nvmlComputeInstance_t) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let ci = ci_of(&m, computeInstance)?;
        m.destroy_ci(&ci, s.mig_in_use(ci.serial))
    }

    fn nvmlGpuInstanceGetComputeInstances(
        gpuInstance: nvmlGpuInstance_t,
        profileId: c_uint,
        computeInstances: *mut nvmlComputeInstance_t,
        count: *mut c_uint,
    ) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let gi = gi_of(&m, gpuInstance)?;
        ci_slices(&gi, profileId)?;
        let v: Vec<nvmlComputeInstance_t> = m
            .cis(&gi)
            .iter()
            .filter(|c| c.profile == profileId)
            .map(ci_handle)
            .collect();
        fill(computeInstances, count, &v, false)
    }

    fn nvmlComputeInstanceGetInfo_v2(computeInstance: nvmlComputeInstance_t, info: *mut nvmlComputeInstanceInfo_t) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let ci = ci_of(&m, computeInstance)?;
        out(
            info,
            nvmlComputeInstanceInfo_t {
                device: handle(ci.gi.phys),
                gpuInstance: gi_handle(&ci.gi),
                id: ci.id(),
                profileId: ci.profile,
                placement: nvmlGpuInstancePlacement_t { start: ci.start, size: ci.slices },
            },
            NVML_ERROR_INVALID_ARGUMENT,
        )
    }

    fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, isMigDevice: *mut c_uint) {
        let s = nvml()?;
        if mig_handle(device).is_some() {
            let (_g, m) = s.mig();
            live_mig_device(&m, device)?;
            return out(isMigDevice, 1, NVML_ERROR_INVALID_ARGUMENT);
        }
        dev(device)?;
        out(isMigDevice, 0, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) {
        let s = nvml()?;
        if mig_handle(device).is_none() {
            dev(device)?;
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let (_g, m) = s.mig();
        let ci = live_mig_device(&m, device)?;
        out(id, ci.gi.id(), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint) {
        let s = nvml()?;
        if mig_handle(device).is_none() {
            dev(device)?;
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let (_g, m) = s.mig();
        let ci = live_mig_device(&m, device)?;
        out(id, ci.id(), NVML_ERROR_INVALID_ARGUMENT)
    }

    /// 0 when MIG is not supported or not enabled, as documented.
    fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) {
        let (s, p) = dev(device)?;
        let n = if s.phys[p].mig && s.phys[p].model.is_some() { 7 } else { 0 };
        out(count, n, NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, index: c_uint, migDevice: *mut nvmlDevice_t) {
        let (s, p, _) = enabled(device)?;
        let (_g, m) = s.mig();
        let ci = *m.devices(p).get(index as usize).ok_or(NVML_ERROR_NOT_FOUND)?;
        out(migDevice, mig_device_handle(&ci), NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: nvmlDevice_t, device: *mut nvmlDevice_t) {
        let s = nvml()?;
        let (_g, m) = s.mig();
        let ci = live_mig_device(&m, migDevice)?;
        out(device, handle(ci.gi.phys), NVML_ERROR_INVALID_ARGUMENT)
    }
}

/// For `nvmlDeviceGetHandleByUUID`: the MIG device handle of `uuid`.
pub fn handle_by_uuid(s: &Sim, uuid: &CStr) -> Option<nvmlDevice_t> {
    let u = uuid.to_str().ok()?;
    if !u.starts_with("MIG-") {
        return None;
    }
    let (_g, m) = s.mig();
    m.find_uuid(u).map(|c| mig_device_handle(&c))
}

/// `nvmlDeviceGetUUID` on a MIG device handle.
pub unsafe fn write_uuid(
    m: &Mig<'_>,
    h: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> Result<(), nvmlReturn_t> {
    let ci = live_mig_device(m, h)?;
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if !unsafe { write_cstr(buf, len as usize, ci.uuid_string().as_bytes()) } {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    Ok(())
}
