//! MIG handles and the NVML entry points over the instances, with the
//! signatures of `nvml.h`.
#![allow(non_camel_case_types)] // NVML's names, as nvml.h spells them.

use std::ffi::{CStr, c_char, c_uint, c_void};

use gpufrac_common::cuda::*;

use super::profiles::*;
use super::state::{Ci, Gi, Mig, ci_slices};
use crate::nvml::{dev, handle, nvml};
use crate::state::{MAX_DEV, Sim};
use crate::{out, write_cstr};

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
