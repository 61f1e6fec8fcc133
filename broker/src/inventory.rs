//! GPU discovery through the CUDA driver API (libcuda as the dynamic loader
//! finds it; no context is created) and, when present, NVML for
//! utilisation. A node without a driver simply has no GPUs to offer.

use nvml_wrapper::Device;
use std::ffi::c_int;

#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: [u8; 16],
    pub name: String,
    pub total_mem: u64,
}

/// Makes the CUDA driver number GPUs as nvidia-smi does (PCI bus order),
/// which is the order `gpufrac run` gives its children with
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`: by default CUDA puts the fastest GPU
/// first, and on a node of mixed GPUs the broker's GPU 0 would then be
/// another GPU than the child's. `all` also drops this process's own
/// `CUDA_VISIBLE_DEVICES`, for a listing of every GPU.
///
/// # Safety
/// Changes the environment: call it before any thread is started and
/// before the CUDA driver is initialised.
pub unsafe fn use_pci_order(all: bool) {
    // SAFETY: the caller guarantees that no other thread runs.
    unsafe {
        std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
        if all {
            std::env::remove_var("CUDA_VISIBLE_DEVICES");
        }
    }
}

pub fn discover() -> Result<Vec<GpuInfo>, String> {
    use cudarc::driver::result;
    // cudarc panics when it cannot load the library; ask first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so.1) found".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    let mut out = Vec::new();
    for i in 0..n {
        let dev =
            result::device::get(i as c_int).map_err(|e| format!("cuDeviceGet({i}): {e:?}"))?;
        let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
        let total = unsafe { result::device::total_mem(dev) }
            .map_err(|e| format!("cuDeviceTotalMem({i}): {e:?}"))?;
        let uuid =
            result::device::get_uuid(dev).map_err(|e| format!("cuDeviceGetUuid({i}): {e:?}"))?;
        out.push(GpuInfo {
            index: i as u32,
            uuid: uuid.bytes.map(|b| b as u8),
            name,
            total_mem: total as u64,
        });
    }
    Ok(out)
}

/// NVML, when the node has it: utilisation per GPU by UUID.
pub struct Nvml(Option<nvml_wrapper::Nvml>);

impl Nvml {
    pub fn open() -> Nvml {
        Nvml(nvml_wrapper::Nvml::init().ok())
    }

    /// Whether NVML was found: without it there is nothing to sample.
    pub fn is_open(&self) -> bool {
        self.0.is_some()
    }

    /// The GPU (or MIG instance) with this UUID, looked up once for all
    /// that a sample asks of it.
    pub fn device(&self, uuid: &str) -> Option<Device<'_>> {
        self.0.as_ref()?.device_by_uuid(uuid).ok()
    }
}

/// Memory per process on `dev` as the driver accounts it (context and
/// module overhead included), by pid.
pub fn process_memory(dev: &Device<'_>) -> Vec<(u32, u64)> {
    dev.running_compute_processes()
        .map(|ps| {
            ps.into_iter()
                .filter_map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some((p.pid, b)),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The processes the driver saw running kernels on `dev` since its
/// timestamp `last_seen` (µs, the driver's own clock: 0 for all it
/// keeps), each with how busy it kept the GPU then (percent, the mean of
/// its samples' SM or memory utilisation, whichever is higher), sorted by
/// pid; and the latest timestamp of those samples. None: the driver does
/// not report per-process work there (MIG, an old GPU or driver); an
/// empty list is a report that nobody ran.
pub fn process_work(dev: &Device<'_>, last_seen: u64) -> Option<(Vec<(u32, u32)>, u64)> {
    match dev.process_utilization_stats(last_seen) {
        Ok(samples) => {
            let latest = samples
                .iter()
                .map(|s| s.timestamp)
                .max()
                .unwrap_or(last_seen);
            let mut busy: Vec<(u32, u32)> = samples
                .iter()
                .map(|s| (s.pid, s.sm_util.max(s.mem_util).min(100)))
                .collect();
            busy.sort_unstable();
            Some((mean_by_pid(&busy), latest))
        }
        // What NVML says when no process ran since `last_seen`.
        Err(nvml_wrapper::error::NvmlError::NotFound) => Some((Vec::new(), last_seen)),
        Err(_) => None,
    }
}

/// Each pid's mean percent over its samples (`samples` sorted by pid),
/// for the pids with a mean above zero.
fn mean_by_pid(samples: &[(u32, u32)]) -> Vec<(u32, u32)> {
    samples
        .chunk_by(|a, b| a.0 == b.0)
        .map(|one| {
            let sum: u32 = one.iter().map(|s| s.1).sum();
            (one[0].0, sum.div_ceil(one.len() as u32))
        })
        .filter(|&(_, pct)| pct > 0)
        .collect()
}

/// `dev`'s utilisation in percent.
pub fn utilization(dev: &Device<'_>) -> Option<u32> {
    dev.utilization_rates().ok().map(|u| u.gpu)
}
