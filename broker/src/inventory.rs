//! GPU discovery through the CUDA driver API (libcuda as the dynamic loader
//! finds it; no context is created) and, when present, NVML for
//! utilisation. A node without a driver simply has no GPUs to offer.

use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{
    nvmlEventData_t, nvmlEventSet_t, nvmlProcessInfo_t, nvmlProcessUtilizationSample_t,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE, nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
    nvmlReturn_enum_NVML_SUCCESS, nvmlReturn_t,
};
use std::collections::HashMap;
use std::ffi::{c_int, c_uint};

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

/// Tries of a list whose length NVML must be told: a list that keeps
/// outgrowing the buffer this often is given up for this sample.
const LIST_TRIES: usize = 4;

/// An NVML list asked for the way the driver wants: `call(count, buf)`
/// with `count` the room in `buf` (first 0 and no buffer, for the count),
/// then again with room for what the driver said plus headroom. Processes
/// start between two calls (a job's workers, all at once): when the list
/// outgrew the buffer the driver says by how much
/// (`NVML_ERROR_INSUFFICIENT_SIZE` with the count needed), and the call is
/// made again with a larger one instead of the sample being lost.
/// `Ok(None)`: `none` was the answer (what some lists say for empty).
fn grow_list<T: Copy>(
    zero: T,
    none: Option<nvmlReturn_t>,
    mut call: impl FnMut(&mut c_uint, *mut T) -> nvmlReturn_t,
) -> Result<Vec<T>, nvmlReturn_t> {
    let mut buf: Vec<T> = Vec::new();
    for _ in 0..LIST_TRIES {
        let room = buf.len() as c_uint;
        let mut count = room;
        let ptr = if buf.is_empty() {
            std::ptr::null_mut()
        } else {
            buf.as_mut_ptr()
        };
        match call(&mut count, ptr) {
            rc if rc == nvmlReturn_enum_NVML_SUCCESS => {
                buf.truncate(count.min(room) as usize);
                return Ok(buf);
            }
            rc if Some(rc) == none => return Ok(Vec::new()),
            rc if rc == nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE => {
                let need = count.max(room.saturating_add(1));
                buf = vec![zero; need.saturating_add(need / 2 + 4) as usize];
            }
            rc => return Err(rc),
        }
    }
    Err(nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE)
}

/// Memory per process on `dev` as the driver accounts it (context and
/// module overhead included), by pid. None: the driver would not say.
pub fn process_memory(dev: &Device<'_>) -> Option<Vec<(u32, u64)>> {
    let f = *dev
        .nvml()
        .lib()
        .nvmlDeviceGetComputeRunningProcesses_v3
        .as_ref()
        .ok()?;
    // SAFETY: the handle is live while `dev` is; the driver writes at most
    // `count` entries into a buffer of `count`.
    let h = unsafe { dev.handle() };
    let zero = nvmlProcessInfo_t {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    let list = grow_list(zero, None, |count, buf| unsafe { f(h, count, buf) }).ok()?;
    Some(
        list.into_iter()
            // NVML_VALUE_NOT_AVAILABLE: the driver does not know (Windows
            // WDDM, some containers).
            .filter(|p| p.usedGpuMemory != u64::MAX)
            .map(|p| (p.pid, p.usedGpuMemory))
            .collect(),
    )
}

/// What the driver says of `dev`'s memory: (total, free, used), bytes.
pub fn memory(dev: &Device<'_>) -> Option<(u64, u64, u64)> {
    dev.memory_info().ok().map(|m| (m.total, m.free, m.used))
}

/// The processes the driver saw running kernels on `dev` since its
/// timestamp `last_seen` (µs, the driver's own clock: 0 for all it
/// keeps), each with how busy it kept the GPU then (percent, the mean of
/// its samples' SM or memory utilisation, whichever is higher), sorted by
/// pid; and the latest timestamp of those samples. None: the driver does
/// not report per-process work there (MIG, an old GPU or driver); an
/// empty list is a report that nobody ran.
pub fn process_work(dev: &Device<'_>, last_seen: u64) -> Option<(Vec<(u32, u32)>, u64)> {
    let f = *dev
        .nvml()
        .lib()
        .nvmlDeviceGetProcessUtilization
        .as_ref()
        .ok()?;
    // SAFETY: as in `process_memory`.
    let h = unsafe { dev.handle() };
    let zero = nvmlProcessUtilizationSample_t {
        pid: 0,
        timeStamp: 0,
        smUtil: 0,
        memUtil: 0,
        encUtil: 0,
        decUtil: 0,
    };
    // NVML_ERROR_NOT_FOUND: no process ran since `last_seen`.
    let samples = grow_list(
        zero,
        Some(nvmlReturn_enum_NVML_ERROR_NOT_FOUND),
        |count, buf| unsafe { f(h, buf, count, last_seen) },
    )
    .ok()?;
    let latest = samples
        .iter()
        .map(|s| s.timeStamp)
        .max()
        .unwrap_or(last_seen);
    let mut busy: Vec<(u32, u32)> = samples
        .iter()
        .map(|s| (s.pid, s.smUtil.max(s.memUtil).min(100)))
        .collect();
    busy.sort_unstable();
    Some((mean_by_pid(&busy), latest))
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

/// A GPU's health as NVML reports it: each figure None where the driver
/// or the GPU has no such counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Health {
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub sm_clock_mhz: Option<u32>,
    /// ECC errors since the driver loaded.
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    /// XID events since the broker started, and the last XID.
    pub xid_errors: u64,
    pub last_xid: Option<u64>,
}

/// What NVML says of `dev`'s health, where it says it (each figure is
/// None where the driver or the GPU has no such counter).
pub fn health(dev: &Device<'_>) -> Health {
    use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
    Health {
        temperature_c: dev.temperature(TemperatureSensor::Gpu).ok(),
        power_mw: dev.power_usage().ok(),
        power_limit_mw: dev.enforced_power_limit().ok(),
        sm_clock_mhz: dev.clock_info(Clock::SM).ok(),
        ecc_corrected: dev
            .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .ok(),
        ecc_uncorrected: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        ..Default::default()
    }
}

/// `nvmlEventTypeXidCriticalError`.
const XID_EVENT: u64 = 0x8;
/// Events taken per sample at most: a storm of XIDs costs bounded work.
const XIDS_PER_SAMPLE: usize = 64;

/// The driver's XID events (critical errors: a GPU fallen off the bus, a
/// page fault, a double-bit ECC error), counted per GPU since the broker
/// started, with the last XID seen. Nothing but events reports them, so
/// the sampler keeps one event set, registers each GPU it is asked about
/// once, and takes what arrived at each sample without waiting.
pub struct Xids {
    set: nvmlEventSet_t,
    /// The UUID of each registered device, by handle.
    devices: HashMap<usize, String>,
    /// Per UUID: XIDs seen, the last one.
    seen: HashMap<String, (u64, u64)>,
}

// SAFETY: the event set is a handle NVML lets any thread use; only the
// sampler's thread does.
unsafe impl Send for Xids {}

impl Xids {
    pub fn new(nvml: &Nvml) -> Option<Xids> {
        let lib = nvml.0.as_ref()?.lib();
        let create = *lib.nvmlEventSetCreate.as_ref().ok()?;
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: NVML writes the set's handle.
        (unsafe { create(&mut set) } == nvmlReturn_enum_NVML_SUCCESS && !set.is_null()).then(|| {
            Xids {
                set,
                devices: HashMap::new(),
                seen: HashMap::new(),
            }
        })
    }

    /// Registers `dev` (UUID `uuid`) for XID events, once.
    pub fn watch(&mut self, dev: &Device<'_>, uuid: &str) {
        // SAFETY: the handle is live while `dev` is.
        let h = unsafe { dev.handle() } as usize;
        if self.devices.contains_key(&h) {
            return;
        }
        let Ok(register) = dev.nvml().lib().nvmlDeviceRegisterEvents.as_ref() else {
            return;
        };
        // SAFETY: a live handle and set; NVML copies what it needs.
        if unsafe { register(h as _, XID_EVENT, self.set) } == nvmlReturn_enum_NVML_SUCCESS {
            self.devices.insert(h, uuid.to_owned());
        }
    }

    /// Takes the events that arrived, without waiting.
    pub fn take(&mut self, nvml: &Nvml) {
        let Some(wait) = nvml
            .0
            .as_ref()
            .and_then(|n| n.lib().nvmlEventSetWait_v2.as_ref().ok().copied())
        else {
            return;
        };
        for _ in 0..XIDS_PER_SAMPLE {
            // SAFETY: all zeroes is a valid nvmlEventData_t (a null device).
            let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
            // SAFETY: a live set; NVML fills `data`.
            if unsafe { wait(self.set, &mut data, 0) } != nvmlReturn_enum_NVML_SUCCESS {
                return;
            }
            if data.eventType & XID_EVENT == 0 {
                continue;
            }
            if let Some(u) = self.devices.get(&(data.device as usize)) {
                let e = self.seen.entry(u.clone()).or_default();
                e.0 += 1;
                e.1 = data.eventData;
            }
        }
    }

    /// XIDs seen on the GPU with this UUID, and the last one.
    pub fn of(&self, uuid: &str) -> (u64, Option<u64>) {
        self.seen
            .get(uuid)
            .map_or((0, None), |&(n, last)| (n, Some(last)))
    }

    /// Frees the set with the library it came from.
    pub fn free(self, nvml: &Nvml) {
        if let Some(free) = nvml
            .0
            .as_ref()
            .and_then(|n| n.lib().nvmlEventSetFree.as_ref().ok().copied())
        {
            // SAFETY: the set is ours, freed once.
            unsafe { free(self.set) };
        }
    }
}

/// `dev`'s utilisation in percent.
pub fn utilization(dev: &Device<'_>) -> Option<u32> {
    dev.utilization_rates().ok().map(|u| u.gpu)
}
