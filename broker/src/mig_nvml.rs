//! Carries out the MIG planner's decisions (`mig/`) through NVML: the
//! I/O half of `--mig dynamic`. [`MigDriver`] is the little the broker
//! needs; [`NvmlMig`] implements it with the MIG calls of `nvml.h` through
//! nvml-wrapper's bindings, against the real driver or, in tests, the
//! simulated one (`sim/src/mig/`), which answers the same calls.
//!
//! MIG mode is only ever read (`nvmlDeviceGetMigMode`): enabling it resets
//! the GPU and is the administrator's decision, never the broker's.

use std::ffi::{CStr, c_char, c_uint};
use std::mem::MaybeUninit;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::*;

pub use crate::mig::FoundInstance;
use crate::mig::{MigGpu, Profile, Range};

/// A GPU as NVML sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundGpu {
    /// NVML's (nvidia-smi's) index.
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_mem: u64,
    /// MIG mode is on.
    pub mig: bool,
}

/// What the broker asks of the driver for dynamic MIG. Errors say what
/// failed, where, and NVML's reason.
pub trait MigDriver {
    /// Every GPU, with its MIG mode (read, never set).
    fn gpus(&mut self) -> Result<Vec<FoundGpu>, String>;
    /// The GPU-instance profiles of a MIG-mode GPU and their placements.
    fn describe(&mut self, gpu: &FoundGpu) -> Result<MigGpu, String>;
    /// Its GPU instances now.
    fn instances(&mut self, index: u32) -> Result<Vec<FoundInstance>, String>;
    /// A GPU instance of `profile` at `placement` and a compute instance
    /// spanning it: (GPU instance id, MIG device UUID). Nothing is left
    /// behind when it fails.
    fn create(
        &mut self,
        index: u32,
        profile: u32,
        placement: Range,
    ) -> Result<(u32, String), String>;
    /// Destroys GPU instance `gi` with its compute instances.
    fn destroy(&mut self, index: u32, gi: u32) -> Result<(), String>;
}

/// NVML's reason for `code`, with the code. nvml-wrapper has no words
/// for some of the codes MIG calls return.
fn why(code: nvmlReturn_t) -> String {
    let text = if code == nvmlReturn_enum_NVML_ERROR_IN_USE {
        "in use (a process runs on it, or a GPU instance still has compute instances)".into()
    } else if code == nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES {
        "insufficient resources (the placement is taken, or the profile's instances are all made)"
            .into()
    } else if code == nvmlReturn_enum_NVML_ERROR_NO_PERMISSION {
        "no permission (making and destroying MIG instances needs root)".into()
    } else {
        NvmlError::from(code).to_string()
    };
    format!("{text} (NVML error {code})")
}

fn check(code: nvmlReturn_t, what: impl FnOnce() -> String) -> Result<(), String> {
    if code == nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(format!("{}: {}", what(), why(code)))
    }
}

/// A function of the loaded library, or an error saying the driver lacks
/// it (MIG needs R450 or later).
macro_rules! sym {
    ($lib:expr, $name:ident) => {
        $lib.$name.as_ref().map_err(|_| {
            format!(
                "the NVML library has no {}; MIG needs NVIDIA driver R450 or later",
                stringify!($name)
            )
        })?
    };
}

fn c_string(buf: &[c_char]) -> String {
    // SAFETY: NVML NUL-terminates what it writes; the buffer was zeroed.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

pub struct NvmlMig {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlMig {
    pub fn open() -> Result<NvmlMig, String> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| NvmlMig { nvml })
            .map_err(|e| format!("cannot load NVML (libnvidia-ml.so.1): {e}"))
    }

    fn device(&self, index: u32) -> Result<nvmlDevice_t, String> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| format!("GPU {index}: {e}"))?;
        // SAFETY: the handle is only passed back to NVML while `self`
        // (and so the library) lives.
        Ok(unsafe { d.handle() })
    }

    /// MIG device UUIDs of GPU `dev`, by GPU instance id.
    fn mig_devices(&self, index: u32, dev: nvmlDevice_t) -> Result<Vec<(u32, String)>, String> {
        let lib = self.nvml.lib();
        let max_fn = sym!(lib, nvmlDeviceGetMaxMigDeviceCount);
        let by_index = sym!(lib, nvmlDeviceGetMigDeviceHandleByIndex);
        let gi_id = sym!(lib, nvmlDeviceGetGpuInstanceId);
        let uuid_fn = sym!(lib, nvmlDeviceGetUUID);
        let mut max = 0;
        // SAFETY: NVML calls with valid out-pointers.
        unsafe {
            check(max_fn(dev, &mut max), || {
                format!("GPU {index}: counting MIG devices")
            })?;
        }
        let mut out = Vec::new();
        for i in 0..max {
            let mut mig: nvmlDevice_t = std::ptr::null_mut();
            // SAFETY: as above; an index without a device answers
            // NOT_FOUND, and indices need not be dense.
            if unsafe { by_index(dev, i, &mut mig) } != nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            let mut gi = 0;
            let mut buf = [0 as c_char; 96];
            unsafe {
                check(gi_id(mig, &mut gi), || {
                    format!("GPU {index}: MIG device {i}'s GPU instance")
                })?;
                check(uuid_fn(mig, buf.as_mut_ptr(), buf.len() as c_uint), || {
                    format!("GPU {index}: MIG device {i}'s UUID")
                })?;
            }
            out.push((gi, c_string(&buf)));
        }
        Ok(out)
    }

    fn gpu_instance(
        &self,
        index: u32,
        dev: nvmlDevice_t,
        gi: u32,
    ) -> Result<nvmlGpuInstance_t, String> {
        let f = sym!(self.nvml.lib(), nvmlDeviceGetGpuInstanceById);
        let mut h: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: NVML call with a valid out-pointer.
        unsafe {
            check(f(dev, gi, &mut h), || {
                format!("GPU {index}: GPU instance {gi}")
            })?;
        }
        Ok(h)
    }

    /// The compute instance profile spanning a GPU instance (as
    /// `nvidia-smi mig -cgi … -C` makes), and each profile's instances.
    fn ci_profiles(
        &self,
        gi: nvmlGpuInstance_t,
    ) -> Result<Vec<nvmlComputeInstanceProfileInfo_t>, String> {
        let f = sym!(
            self.nvml.lib(),
            nvmlGpuInstanceGetComputeInstanceProfileInfo
        );
        let mut out = Vec::new();
        for p in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let mut info = MaybeUninit::<nvmlComputeInstanceProfileInfo_t>::zeroed();
            // SAFETY: NVML fills the struct; an unsupported profile leaves
            // it unread.
            let rc = unsafe {
                f(
                    gi,
                    p,
                    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    info.as_mut_ptr(),
                )
            };
            if rc == nvmlReturn_enum_NVML_SUCCESS {
                out.push(unsafe { info.assume_init() });
            }
        }
        Ok(out)
    }

    fn destroy_gi(&self, index: u32, gi_id: u32, gi: nvmlGpuInstance_t) -> Result<(), String> {
        let lib = self.nvml.lib();
        let list = sym!(lib, nvmlGpuInstanceGetComputeInstances);
        let destroy_ci = sym!(lib, nvmlComputeInstanceDestroy);
        let destroy_gi = sym!(lib, nvmlGpuInstanceDestroy);
        for p in self.ci_profiles(gi)? {
            let mut cis = vec![std::ptr::null_mut(); p.instanceCount.max(1) as usize];
            let mut n = cis.len() as c_uint;
            // SAFETY: the array holds as many as the profile allows.
            unsafe {
                check(list(gi, p.id, cis.as_mut_ptr(), &mut n), || {
                    format!("GPU {index}: listing GPU instance {gi_id}'s compute instances")
                })?;
            }
            for &ci in &cis[..(n as usize).min(cis.len())] {
                // SAFETY: a handle NVML just gave.
                unsafe {
                    check(destroy_ci(ci), || {
                        format!(
                            "GPU {index}: destroying a compute instance of GPU instance {gi_id}"
                        )
                    })?;
                }
            }
        }
        // SAFETY: as above.
        unsafe {
            check(destroy_gi(gi), || {
                format!("GPU {index}: destroying GPU instance {gi_id}")
            })
        }
    }
}

/// `NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)`.
const GI_PROFILE_INFO_V2: c_uint =
    std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as c_uint | (2 << 24);

impl MigDriver for NvmlMig {
    fn gpus(&mut self) -> Result<Vec<FoundGpu>, String> {
        let n = self
            .nvml
            .device_count()
            .map_err(|e| format!("NVML cannot count GPUs: {e}"))?;
        let mut out = Vec::new();
        for index in 0..n {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| format!("GPU {index}: {e}"))?;
            let mig = match d.mig_mode() {
                Ok(m) => m.current == NVML_DEVICE_MIG_ENABLE,
                // Not MIG-capable.
                Err(NvmlError::NotSupported) => false,
                Err(e) => return Err(format!("GPU {index}: reading its MIG mode: {e}")),
            };
            out.push(FoundGpu {
                index,
                uuid: d.uuid().map_err(|e| format!("GPU {index}: {e}"))?,
                name: d.name().unwrap_or_else(|_| "unknown".into()),
                total_mem: d.memory_info().map(|m| m.total).unwrap_or(0),
                mig,
            });
        }
        Ok(out)
    }

    fn describe(&mut self, gpu: &FoundGpu) -> Result<MigGpu, String> {
        let index = gpu.index;
        let dev = self.device(index)?;
        let lib = self.nvml.lib();
        let info_v = lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref().ok();
        let info_v1 = sym!(lib, nvmlDeviceGetGpuInstanceProfileInfo);
        let placements = sym!(lib, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
        let mut profiles = Vec::new();
        for p in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            let mut v1 = MaybeUninit::<nvmlGpuInstanceProfileInfo_t>::zeroed();
            // SAFETY: NVML fills the struct on success; a profile the GPU
            // lacks answers NOT_SUPPORTED (or INVALID_ARGUMENT past what
            // the driver knows).
            if unsafe { info_v1(dev, p, v1.as_mut_ptr()) } != nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            let v1 = unsafe { v1.assume_init() };
            // The name ("MIG 1g.5gb") comes with v2; a driver without it
            // gets one made the same way from slices and memory.
            let name = info_v
                .and_then(|f| {
                    let mut v2 = MaybeUninit::<nvmlGpuInstanceProfileInfo_v2_t>::zeroed();
                    // SAFETY: version set before the call, as the API asks.
                    unsafe {
                        (*v2.as_mut_ptr()).version = GI_PROFILE_INFO_V2;
                        (f(dev, p, v2.as_mut_ptr()) == nvmlReturn_enum_NVML_SUCCESS)
                            .then(|| c_string(&v2.assume_init().name))
                    }
                })
                .map(|n| n.trim_start_matches("MIG ").to_owned())
                .unwrap_or_else(|| {
                    format!("{}g.{}gb", v1.sliceCount, v1.memorySizeMB.div_ceil(1024))
                });
            let mut count = 0;
            // SAFETY: NULL asks for the count only.
            unsafe {
                check(
                    placements(dev, v1.id, std::ptr::null_mut(), &mut count),
                    || format!("GPU {index}: placements of profile {name}"),
                )?;
            }
            let mut v = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
            // SAFETY: the array holds `count` placements.
            unsafe {
                check(placements(dev, v1.id, v.as_mut_ptr(), &mut count), || {
                    format!("GPU {index}: placements of profile {name}")
                })?;
            }
            v.truncate(count as usize);
            profiles.push(Profile {
                id: v1.id,
                name,
                slices: v1.sliceCount,
                mem: v1.memorySizeMB << 20,
                max: v1.instanceCount,
                placements: v
                    .iter()
                    .map(|p| Range {
                        start: p.start,
                        size: p.size,
                    })
                    .collect(),
            });
        }
        if profiles.is_empty() {
            return Err(format!(
                "GPU {index} ({}) is in MIG mode but NVML lists no GPU-instance profiles",
                gpu.name
            ));
        }
        Ok(MigGpu {
            index,
            uuid: gpu.uuid.clone(),
            name: gpu.name.clone(),
            total_mem: gpu.total_mem,
            slices: profiles.iter().map(|p| p.slices).max().unwrap_or(0),
            profiles,
        })
    }

    fn instances(&mut self, index: u32) -> Result<Vec<FoundInstance>, String> {
        let dev = self.device(index)?;
        let lib = self.nvml.lib();
        let info_v1 = sym!(lib, nvmlDeviceGetGpuInstanceProfileInfo);
        let list = sym!(lib, nvmlDeviceGetGpuInstances);
        let gi_info = sym!(lib, nvmlGpuInstanceGetInfo);
        let devices = self.mig_devices(index, dev)?;
        let mut out = Vec::new();
        for p in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            let mut v1 = MaybeUninit::<nvmlGpuInstanceProfileInfo_t>::zeroed();
            // SAFETY: as in `describe`.
            if unsafe { info_v1(dev, p, v1.as_mut_ptr()) } != nvmlReturn_enum_NVML_SUCCESS {
                continue;
            }
            let v1 = unsafe { v1.assume_init() };
            let mut gis = vec![std::ptr::null_mut(); v1.instanceCount.max(1) as usize];
            let mut n = gis.len() as c_uint;
            // SAFETY: the array holds as many as the profile allows.
            unsafe {
                check(list(dev, v1.id, gis.as_mut_ptr(), &mut n), || {
                    format!("GPU {index}: listing GPU instances of profile {}", v1.id)
                })?;
            }
            for &gi in &gis[..(n as usize).min(gis.len())] {
                let mut info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
                // SAFETY: a handle NVML just gave.
                let info = unsafe {
                    check(gi_info(gi, info.as_mut_ptr()), || {
                        format!("GPU {index}: a GPU instance's placement")
                    })?;
                    info.assume_init()
                };
                let uuids = devices
                    .iter()
                    .filter(|(g, _)| *g == info.id)
                    .map(|(_, u)| u.clone())
                    .collect();
                out.push((
                    info.id,
                    info.profileId,
                    Range {
                        start: info.placement.start,
                        size: info.placement.size,
                    },
                    uuids,
                ));
            }
        }
        Ok(out)
    }

    fn create(
        &mut self,
        index: u32,
        profile: u32,
        placement: Range,
    ) -> Result<(u32, String), String> {
        let dev = self.device(index)?;
        let lib = self.nvml.lib();
        let create_gi = sym!(lib, nvmlDeviceCreateGpuInstanceWithPlacement);
        let gi_info = sym!(lib, nvmlGpuInstanceGetInfo);
        let create_ci = sym!(lib, nvmlGpuInstanceCreateComputeInstance);
        let at = nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: NVML calls with valid pointers.
        let info = unsafe {
            check(create_gi(dev, profile, &at, &mut gi), || {
                format!("GPU {index}: creating a GPU instance of profile {profile} at {placement}")
            })?;
            let mut info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
            check(gi_info(gi, info.as_mut_ptr()), || {
                format!("GPU {index}: the new GPU instance at {placement}")
            })?;
            info.assume_init()
        };
        // The compute instance that spans the GPU instance: one MIG device
        // with all its slices.
        let made = self.ci_profiles(gi).and_then(|ps| {
            let full = ps.iter().max_by_key(|p| p.sliceCount).ok_or_else(|| {
                format!(
                    "GPU {index}: GPU instance {} offers no compute instance profile",
                    info.id
                )
            })?;
            let mut ci = std::ptr::null_mut();
            // SAFETY: as above.
            unsafe {
                check(create_ci(gi, full.id, &mut ci), || {
                    format!("GPU {index}: creating the compute instance of GPU instance {}", info.id)
                })?;
            }
            self.mig_devices(index, dev)?
                .into_iter()
                .find(|(g, _)| *g == info.id)
                .map(|(_, u)| u)
                .ok_or_else(|| {
                    format!(
                        "GPU {index}: GPU instance {} has a compute instance but NVML lists no MIG device for it",
                        info.id
                    )
                })
        });
        match made {
            Ok(uuid) => Ok((info.id, uuid)),
            Err(e) => {
                // Leave nothing half made.
                let _ = self.destroy_gi(index, info.id, gi);
                Err(e)
            }
        }
    }

    fn destroy(&mut self, index: u32, gi: u32) -> Result<(), String> {
        let dev = self.device(index)?;
        let h = self.gpu_instance(index, dev, gi)?;
        self.destroy_gi(index, gi, h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_nvml_reasons() {
        let e = check(nvmlReturn_enum_NVML_ERROR_IN_USE, || {
            "GPU 0: destroying GPU instance 3".into()
        })
        .unwrap_err();
        assert!(e.starts_with("GPU 0: destroying GPU instance 3: "), "{e}");
        assert!(e.ends_with("in use (a process runs on it, or a GPU instance still has compute instances) (NVML error 19)"), "{e}");
        assert!(why(23).starts_with("insufficient resources"), "{}", why(23));
        assert!(check(0, || unreachable!()).is_ok());
        assert_eq!(
            GI_PROFILE_INFO_V2,
            std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32 | 0x0200_0000
        );
    }
}
