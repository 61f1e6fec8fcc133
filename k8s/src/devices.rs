//! What the plugin advertises and how it answers: the devices of each GPU
//! (slots or memory units), their health, the preferred allocation and the
//! container edits for an allocation. Pure bookkeeping, no I/O, so that all
//! of it is tested without a kubelet.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;

use gpufrac_common::config::{VAR_COMPUTE_SHARE, VAR_MEM_LIMIT, VAR_MEM_LIMIT_PREFIX, VAR_SOCKET};

use crate::api;

pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// The name of the CDI kind that `gpufrac cdi generate` writes, whose
/// devices are named by GPU index.
pub const CDI_KIND: &str = "gpufrac.dev/gpu";

/// More devices than this per GPU make ListAndWatch messages and the
/// kubelet's checkpoint large for no benefit: a finer unit than
/// total/2048 cannot be asked for sensibly anyway.
pub const MAX_UNITS_PER_GPU: u64 = 2048;

/// One GPU as the driver lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// CUDA's index in PCI bus order: nvidia-smi's, `gpufrac cdi generate`'s.
    pub index: u32,
    /// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
    pub uuid: String,
    pub total_mem: u64,
    /// The product name ("NVIDIA H100 80GB HBM3"); empty when the lister
    /// did not say.
    pub name: String,
}

/// What one device of the plugin stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// `gpufrac.dev/gpu`: each GPU is `per_gpu` slots; a slot is total/F of
    /// its memory and 1/F of its compute.
    Slots { per_gpu: u32 },
    /// `gpufrac.dev/gpu-memory`: each GPU is total/unit units of `unit`
    /// bytes.
    Memory { unit: u64 },
}

impl Resource {
    pub fn name(&self) -> &'static str {
        match self {
            Resource::Slots { .. } => "gpufrac.dev/gpu",
            Resource::Memory { .. } => "gpufrac.dev/gpu-memory",
        }
    }

    /// The plugin's socket in the kubelet's directory.
    pub fn endpoint(&self) -> &'static str {
        match self {
            Resource::Slots { .. } => "gpufrac-gpu.sock",
            Resource::Memory { .. } => "gpufrac-gpu-memory.sock",
        }
    }

    /// The word in device IDs: `GPU-<uuid>-slot-3`, `GPU-<uuid>-mem-3`.
    fn tag(&self) -> &'static str {
        match self {
            Resource::Slots { .. } => "slot",
            Resource::Memory { .. } => "mem",
        }
    }

    /// Devices advertised for a GPU of `total` bytes.
    pub fn units(&self, total: u64) -> u64 {
        match *self {
            Resource::Slots { per_gpu } => u64::from(per_gpu),
            Resource::Memory { unit } => total / unit.max(1),
        }
    }
}

/// How the container gets the shim, the socket and the GPU.
#[derive(Clone, Debug)]
pub enum Injection {
    /// Mounts, environment and device nodes in the Allocate answer itself.
    Mounts(Mounts),
    /// CDI device names from `gpufrac cdi generate`'s spec, which brings the
    /// shim, the socket, the device nodes and the driver libraries; the
    /// answer adds only the caps.
    Cdi,
}

#[derive(Clone, Debug)]
pub struct Mounts {
    /// libgpufrac.so on the host.
    pub lib: PathBuf,
    /// Where the container sees it (and what LD_PRELOAD names).
    pub container_lib: String,
    /// The broker socket on the host; its directory is mounted.
    pub socket: PathBuf,
    /// Where the container sees the socket's directory.
    pub container_socket_dir: String,
    /// An ld.so.preload file naming the shim, mounted as /etc/ld.so.preload
    /// instead of setting LD_PRELOAD (for images whose entrypoint resets
    /// it).
    pub preload_file: Option<PathBuf>,
    /// Device nodes every GPU needs (nvidiactl, nvidia-uvm…): host path →
    /// path in the container.
    pub control_nodes: Vec<(PathBuf, String)>,
    /// Directory holding the nvidiaN nodes on the host.
    pub dev_dir: PathBuf,
}

/// A GPU the plugin has seen, with its devices.
#[derive(Clone, Debug)]
struct Known {
    gpu: Gpu,
    /// Listed by the driver at the last look.
    present: bool,
    /// Devices advertised for it (fixed when first seen: the kubelet keeps
    /// device IDs across restarts in its checkpoint).
    units: u64,
    /// Its /dev/nvidiaN minor number, when the kernel module says.
    minor: Option<u32>,
}

/// Every GPU seen since the plugin started, in the order first seen.
#[derive(Debug)]
pub struct Inventory {
    resource: Resource,
    gpus: Vec<Known>,
}

impl Inventory {
    /// The first list of GPUs; refuses settings that would advertise
    /// nothing or an absurd number of devices.
    pub fn new(resource: Resource, gpus: Vec<Gpu>) -> Result<Inventory, String> {
        if gpus.is_empty() {
            return Err(
                "the CUDA driver lists no GPUs, so there is nothing to advertise; run the plugin \
                 on a GPU node (a nodeSelector on the DaemonSet keeps it off the others)"
                    .into(),
            );
        }
        if let Resource::Memory { unit } = resource {
            let largest = gpus.iter().map(|g| g.total_mem).max().unwrap_or(0);
            if unit > largest {
                return Err(format!(
                    "--memory-unit {} is larger than every GPU (the largest has {}), so no GPU \
                     would have a single unit; use a smaller unit such as 1G",
                    human(unit),
                    human(largest)
                ));
            }
            for g in &gpus {
                let n = resource.units(g.total_mem);
                if n > MAX_UNITS_PER_GPU {
                    return Err(format!(
                        "--memory-unit {} makes {n} devices of GPU {} ({} of memory), more than \
                         the {MAX_UNITS_PER_GPU} a GPU may advertise; use a larger unit such as {}",
                        human(unit),
                        g.index,
                        human(g.total_mem),
                        human(g.total_mem.div_ceil(MAX_UNITS_PER_GPU).next_power_of_two())
                    ));
                }
            }
        }
        let mut inv = Inventory {
            resource,
            gpus: Vec::new(),
        };
        inv.update(Ok(gpus));
        Ok(inv)
    }

    pub fn resource(&self) -> Resource {
        self.resource
    }

    /// Applies a fresh list of GPUs (or the failure to get one, which makes
    /// every device unhealthy: a driver that cannot list its GPUs cannot
    /// run a pod's work either). Returns what changed, for the log, or
    /// nothing.
    pub fn update(&mut self, listed: Result<Vec<Gpu>, String>) -> Vec<String> {
        let mut changes = Vec::new();
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                for k in self.gpus.iter_mut().filter(|k| k.present) {
                    k.present = false;
                    changes.push(format!(
                        "GPU {} ({}) is unhealthy: {e}",
                        k.gpu.index, k.gpu.uuid
                    ));
                }
                return changes;
            }
        };
        for k in &mut self.gpus {
            let now = listed.iter().find(|g| g.uuid == k.gpu.uuid);
            match (k.present, now) {
                (true, None) => changes.push(format!(
                    "GPU {} ({}) is gone from the driver's list: its devices are unhealthy",
                    k.gpu.index, k.gpu.uuid
                )),
                (false, Some(g)) => changes.push(format!(
                    "GPU {} ({}) is back: its devices are healthy",
                    g.index, g.uuid
                )),
                _ => {}
            }
            k.present = now.is_some();
            // Indices follow the driver's current numbering (they shift
            // when a GPU before this one goes); IDs do not depend on them.
            if let Some(g) = now {
                k.gpu.index = g.index;
            }
        }
        for g in listed {
            if !self.gpus.iter().any(|k| k.gpu.uuid == g.uuid) {
                let units = self.resource.units(g.total_mem).min(MAX_UNITS_PER_GPU);
                changes.push(format!(
                    "GPU {} ({}, {}): {units} devices of {}",
                    g.index,
                    g.uuid,
                    human(g.total_mem),
                    self.resource.name()
                ));
                self.gpus.push(Known {
                    gpu: g,
                    present: true,
                    units,
                    minor: None,
                });
            }
        }
        changes
    }

    /// Records the /dev/nvidiaN minor numbers the kernel module gives, by
    /// GPU UUID (lower case).
    pub fn set_minors(&mut self, minors: &BTreeMap<String, u32>) {
        for k in &mut self.gpus {
            k.minor = minors.get(&k.gpu.uuid.to_ascii_lowercase()).copied();
        }
    }

    /// The device list for ListAndWatch.
    pub fn devices(&self) -> Vec<api::Device> {
        let mut out = Vec::new();
        for k in &self.gpus {
            let health = if k.present { HEALTHY } else { UNHEALTHY };
            for n in 0..k.units {
                out.push(api::Device {
                    id: device_id(&k.gpu.uuid, self.resource.tag(), n),
                    health: health.into(),
                    topology: None,
                });
            }
        }
        out
    }

    /// The GPUs listed now.
    pub fn present(&self) -> Vec<Gpu> {
        self.gpus
            .iter()
            .filter(|k| k.present)
            .map(|k| k.gpu.clone())
            .collect()
    }

    /// The GPU (its position in `gpus`) and unit number an ID names.
    fn lookup(&self, id: &str) -> Result<(usize, u64), String> {
        let bad = || {
            format!(
                "device ID {id:?} is not one this plugin advertises for {} (its IDs look like \
                 GPU-<uuid>-{}-<n>)",
                self.resource.name(),
                self.resource.tag()
            )
        };
        let (rest, n) = id.rsplit_once('-').ok_or_else(bad)?;
        let n: u64 = n.parse().map_err(|_| bad())?;
        let uuid = rest
            .strip_suffix(self.resource.tag())
            .and_then(|r| r.strip_suffix('-'))
            .ok_or_else(bad)?;
        let i = self
            .gpus
            .iter()
            .position(|k| k.gpu.uuid == uuid && n < k.units)
            .ok_or_else(bad)?;
        Ok((i, n))
    }

    /// GetPreferredAllocation for one container: `size` devices from
    /// `available`, `must` among them.
    ///
    /// Units on as few GPUs as possible: first the GPUs of `must`, then, if
    /// one GPU can hold the rest, the one with the fewest available units
    /// among those that can (best fit, as the broker places memory: it
    /// keeps the emptiest GPUs whole for large requests), else the GPU
    /// with the most available units, and so on. Within a GPU, the lowest
    /// unit numbers first.
    pub fn preferred(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
    ) -> Result<Vec<String>, String> {
        let mut taken: HashSet<&str> = HashSet::new();
        let mut out: Vec<String> = Vec::new();
        for id in must {
            self.lookup(id)?;
            if taken.insert(id) {
                out.push(id.clone());
            }
        }
        // Available units by GPU (position in self.gpus), lowest first.
        let mut free: BTreeMap<usize, Vec<(u64, &str)>> = BTreeMap::new();
        for id in available {
            let (g, n) = self.lookup(id)?;
            if !taken.contains(id.as_str()) {
                free.entry(g).or_default().push((n, id));
            }
        }
        for units in free.values_mut() {
            units.sort_unstable();
            units.dedup();
        }
        let take =
            |g: usize, free: &mut BTreeMap<usize, Vec<(u64, &str)>>, out: &mut Vec<String>| {
                let need = size.saturating_sub(out.len());
                if let Some(units) = free.remove(&g) {
                    out.extend(units.iter().take(need).map(|(_, id)| id.to_string()));
                }
            };
        // The GPUs already in the allocation, those with most of it first.
        let mut must_gpus: Vec<(usize, usize)> = Vec::new();
        for id in must {
            let (g, _) = self.lookup(id)?;
            match must_gpus.iter_mut().find(|(x, _)| *x == g) {
                Some((_, c)) => *c += 1,
                None => must_gpus.push((g, 1)),
            }
        }
        must_gpus.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (g, _) in must_gpus {
            take(g, &mut free, &mut out);
        }
        while out.len() < size && !free.is_empty() {
            let need = size - out.len();
            let fits = free
                .iter()
                .filter(|(_, u)| u.len() >= need)
                .min_by_key(|(g, u)| (u.len(), **g))
                .map(|(g, _)| *g);
            let g = fits.unwrap_or_else(|| {
                *free
                    .iter()
                    .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.cmp(a.0)))
                    .map(|(g, _)| g)
                    .expect("free is not empty")
            });
            take(g, &mut free, &mut out);
        }
        Ok(out)
    }

    /// The answer to Allocate for one container.
    ///
    /// Caps come from the units granted on each GPU. Units on one GPU give
    /// `GPU_MEM_LIMIT`; units on several GPUs give each its own cap with
    /// `GPU_MEM_LIMIT_<N>`, N being the GPU's position in
    /// `CUDA_VISIBLE_DEVICES` (how the container's CUDA numbers them), and
    /// `GPU_MEM_LIMIT` the smallest of them. Slots also give
    /// `GPU_COMPUTE_SHARE` (one share per process, the smallest of the
    /// GPUs' when they differ).
    ///
    /// With it, what the allocation is for the broker's queue.
    pub fn allocate(
        &self,
        ids: &[String],
        inject: &Injection,
    ) -> Result<(api::ContainerAllocateResponse, Booking), String> {
        let Grant {
            gpus,
            caps,
            share,
            booking,
        } = self.grant(ids)?;
        let mut resp = api::ContainerAllocateResponse::default();
        let env = &mut resp.envs;

        let smallest = *caps.iter().min().expect("at least one GPU");
        env.insert(VAR_MEM_LIMIT.into(), env_size(smallest));
        if caps.len() > 1 {
            for (ordinal, cap) in caps.iter().enumerate() {
                env.insert(format!("{VAR_MEM_LIMIT_PREFIX}{ordinal}"), env_size(*cap));
            }
        }
        if let Some((fewest, per_gpu)) = share {
            env.insert(VAR_COMPUTE_SHARE.into(), env_percent(fewest, per_gpu));
        }
        let uuids: Vec<&str> = gpus.iter().map(|(k, _)| k.gpu.uuid.as_str()).collect();
        env.insert("CUDA_VISIBLE_DEVICES".into(), uuids.join(","));

        match inject {
            Injection::Cdi => {
                for (k, _) in &gpus {
                    resp.cdi_devices.push(api::CdiDevice {
                        name: format!("{CDI_KIND}={}", k.gpu.index),
                    });
                }
            }
            Injection::Mounts(m) => {
                // For the NVIDIA container runtime, which then brings the
                // driver libraries (and the same device nodes).
                env.insert("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(","));
                if m.preload_file.is_none() {
                    env.insert("LD_PRELOAD".into(), m.container_lib.clone());
                }
                let socket_name = m
                    .socket
                    .file_name()
                    .map_or_else(|| "broker.sock".into(), |n| n.to_string_lossy());
                env.insert(
                    VAR_SOCKET.into(),
                    format!("{}/{socket_name}", m.container_socket_dir),
                );
                resp.mounts.push(api::Mount {
                    container_path: m.container_lib.clone(),
                    host_path: m.lib.to_string_lossy().into_owned(),
                    read_only: true,
                });
                // The directory rather than the socket: the mount still
                // works after the broker restarts and makes a new socket.
                resp.mounts.push(api::Mount {
                    container_path: m.container_socket_dir.clone(),
                    host_path: m
                        .socket
                        .parent()
                        .unwrap_or(std::path::Path::new("/"))
                        .to_string_lossy()
                        .into_owned(),
                    read_only: false,
                });
                if let Some(f) = &m.preload_file {
                    resp.mounts.push(api::Mount {
                        container_path: "/etc/ld.so.preload".into(),
                        host_path: f.to_string_lossy().into_owned(),
                        read_only: true,
                    });
                }
                for (host, container) in &m.control_nodes {
                    resp.devices
                        .push(device_spec(host.to_string_lossy().into(), container));
                }
                for (k, _) in &gpus {
                    let name = format!("nvidia{}", k.minor.unwrap_or(k.gpu.index));
                    let host = m.dev_dir.join(&name);
                    // Runtimes read the node's numbers from the host path
                    // and refuse a link.
                    let host = host.canonicalize().map_err(|e| {
                        format!(
                            "{}: {e}: GPU {} ({}) has no device node there; point --dev-dir at \
                             the directory holding the NVIDIA device nodes",
                            host.display(),
                            k.gpu.index,
                            k.gpu.uuid
                        )
                    })?;
                    resp.devices.push(device_spec(
                        host.to_string_lossy().into(),
                        &format!("/dev/{name}"),
                    ));
                }
            }
        }
        Ok((resp, booking))
    }
}

impl Inventory {
    /// What an allocation is for the broker's queue (without answering
    /// it): the memory on each GPU, and the compute share of slots.
    pub fn booking(&self, ids: &[String]) -> Result<Booking, String> {
        Ok(self.grant(ids)?.booking)
    }

    /// What devices `ids` come to; refuses IDs that are not ours, on a GPU
    /// gone, or named twice.
    fn grant(&self, ids: &[String]) -> Result<Grant<'_>, String> {
        let gpus = self.granted(ids)?;
        let caps = self.caps(&gpus);
        let share = self.share(&gpus);
        let mut sorted = ids.to_vec();
        sorted.sort();
        let booking = Booking {
            ids: sorted,
            pins: gpus
                .iter()
                .zip(&caps)
                .map(|((k, _), cap)| (k.gpu.uuid.clone(), *cap))
                .collect(),
            compute: share.map(|(n, per_gpu)| n as f64 * 100.0 / per_gpu as f64),
        };
        Ok(Grant {
            gpus,
            caps,
            share,
            booking,
        })
    }

    /// The GPUs an allocation's devices are on, in index order, with the
    /// number of units on each.
    fn granted(&self, ids: &[String]) -> Result<Vec<(&Known, u64)>, String> {
        if ids.is_empty() {
            return Err(format!(
                "an allocation of no devices: ask for at least one {}",
                self.resource.name()
            ));
        }
        let mut per_gpu: BTreeMap<u32, (&Known, HashSet<u64>)> = BTreeMap::new();
        for id in ids {
            let (g, n) = self.lookup(id)?;
            let k = &self.gpus[g];
            if !k.present {
                return Err(format!(
                    "device {id} is on GPU {}, which the driver no longer lists; the kubelet \
                     should not have offered it (it is reported Unhealthy)",
                    k.gpu.uuid
                ));
            }
            let entry = per_gpu.entry(k.gpu.index).or_insert((k, HashSet::new()));
            if !entry.1.insert(n) {
                return Err(format!("device {id} is named twice in one allocation"));
            }
        }
        Ok(per_gpu
            .values()
            .map(|(k, units)| (*k, units.len() as u64))
            .collect())
    }

    /// The memory cap on each of `gpus`.
    fn caps(&self, gpus: &[(&Known, u64)]) -> Vec<u64> {
        gpus.iter()
            .map(|(k, n)| match self.resource {
                Resource::Memory { unit } => n * unit,
                Resource::Slots { per_gpu } => n * (k.gpu.total_mem / u64::from(per_gpu)),
            })
            .collect()
    }

    /// Slots: the compute share, as (slots, per GPU) — one share per
    /// process, the smallest of the GPUs' when they differ.
    fn share(&self, gpus: &[(&Known, u64)]) -> Option<(u64, u64)> {
        let Resource::Slots { per_gpu } = self.resource else {
            return None;
        };
        let fewest = gpus.iter().map(|(_, n)| *n).min()?;
        Some((fewest.min(u64::from(per_gpu)), u64::from(per_gpu)))
    }
}

/// An allocation worked out once, for the answer and the booking alike.
struct Grant<'a> {
    /// Each GPU and the units on it, in index order.
    gpus: Vec<(&'a Known, u64)>,
    /// The memory cap on each.
    caps: Vec<u64>,
    /// Slots: (slots, per GPU) of the compute share.
    share: Option<(u64, u64)>,
    booking: Booking,
}

/// One container's allocation as the broker books it (and the plugin's
/// state file keeps it).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Booking {
    /// The device IDs, sorted: they name the allocation, here and in the
    /// kubelet's pod-resources answers.
    pub ids: Vec<String>,
    /// Each GPU's UUID and the memory on it.
    pub pins: Vec<(String, u64)>,
    /// Slots: `GPU_COMPUTE_SHARE`, percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute: Option<f64>,
}

fn device_spec(host: String, container: &str) -> api::DeviceSpec {
    api::DeviceSpec {
        container_path: container.into(),
        host_path: host,
        permissions: "rw".into(),
    }
}

pub fn device_id(uuid: &str, tag: &str, n: u64) -> String {
    format!("{uuid}-{tag}-{n}")
}

/// A size as `GPU_MEM_LIMIT` reads it: whole GiB or MiB when it is one,
/// else bytes (never rounded: the cap is exactly what was granted).
pub fn env_size(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if bytes >= GIB && bytes.is_multiple_of(GIB) {
        format!("{}G", bytes / GIB)
    } else if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{}M", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

/// `part/whole` as a percentage `GPU_COMPUTE_SHARE` reads: "25%",
/// "33.33%" (two decimals at most, rounded down so a share never adds up
/// to more than the whole).
pub fn env_percent(part: u64, whole: u64) -> String {
    let hundredths = part * 10_000 / whole.max(1);
    let mut s = format!("{}", hundredths / 100);
    let frac = hundredths % 100;
    if frac != 0 {
        let _ = write!(s, ".{frac:02}");
        while s.ends_with('0') {
            s.pop();
        }
    }
    s.push('%');
    s
}

/// For messages: "4.00 GiB".
fn human(bytes: u64) -> String {
    gpufrac_common::size::format_size(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const U0: &str = "GPU-00000000-0000-4000-8000-000000000000";
    const U1: &str = "GPU-11111111-1111-4111-8111-111111111111";

    fn gpus(sizes: &[u64]) -> Vec<Gpu> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, s)| Gpu {
                index: i as u32,
                uuid: [U0, U1][i].into(),
                total_mem: s * GIB,
                name: String::new(),
            })
            .collect()
    }

    fn mem(sizes: &[u64]) -> Inventory {
        Inventory::new(Resource::Memory { unit: GIB }, gpus(sizes)).unwrap()
    }

    fn ids(uuid: &str, tag: &str, ns: impl IntoIterator<Item = u64>) -> Vec<String> {
        ns.into_iter().map(|n| device_id(uuid, tag, n)).collect()
    }

    fn on(ids: &[String], uuid: &str) -> usize {
        ids.iter().filter(|i| i.starts_with(uuid)).count()
    }

    #[test]
    fn memory_units_per_gpu() {
        let inv = mem(&[16, 8]);
        let d = inv.devices();
        assert_eq!(d.len(), 24);
        assert_eq!(d[0].id, format!("{U0}-mem-0"));
        assert_eq!(d[15].id, format!("{U0}-mem-15"));
        assert_eq!(d[16].id, format!("{U1}-mem-0"));
        assert!(d.iter().all(|d| d.health == HEALTHY));
        // The kubelet's limit on an ID's length.
        assert!(d.iter().all(|d| d.id.len() <= 63), "{}", d[23].id);
        // A unit that does not divide the GPU: whole units only.
        let inv = Inventory::new(Resource::Memory { unit: 3 * GIB }, gpus(&[16])).unwrap();
        assert_eq!(inv.devices().len(), 5);
    }

    #[test]
    fn slots_per_gpu() {
        let inv = Inventory::new(Resource::Slots { per_gpu: 4 }, gpus(&[16, 8])).unwrap();
        let d = inv.devices();
        assert_eq!(d.len(), 8);
        assert_eq!(d[3].id, format!("{U0}-slot-3"));
        assert_eq!(d[4].id, format!("{U1}-slot-0"));
    }

    #[test]
    fn settings_that_advertise_nothing_or_too_much_are_refused() {
        let e = Inventory::new(Resource::Memory { unit: GIB }, vec![]).unwrap_err();
        assert!(e.contains("no GPUs") && e.contains("nodeSelector"), "{e}");
        let e = Inventory::new(Resource::Memory { unit: 32 * GIB }, gpus(&[16, 8])).unwrap_err();
        assert!(
            e.contains("--memory-unit 32.00 GiB is larger than every GPU")
                && e.contains("16.00 GiB"),
            "{e}"
        );
        let e = Inventory::new(Resource::Memory { unit: 1 << 20 }, gpus(&[16])).unwrap_err();
        assert!(
            e.contains("16384 devices") && e.contains("larger unit such as 8.00 MiB"),
            "{e}"
        );
    }

    #[test]
    fn a_gpu_that_goes_is_unhealthy_and_one_that_comes_back_healthy() {
        let mut inv = mem(&[16, 8]);
        let ch = inv.update(Ok(gpus(&[16])));
        assert_eq!(ch.len(), 1);
        assert!(ch[0].contains(U1) && ch[0].contains("gone"), "{ch:?}");
        let d = inv.devices();
        assert_eq!(d.len(), 24, "its devices stay listed, as Unhealthy");
        assert!(d[..16].iter().all(|d| d.health == HEALTHY));
        assert!(d[16..].iter().all(|d| d.health == UNHEALTHY));
        assert!(inv.update(Ok(gpus(&[16]))).is_empty(), "no change, no news");
        let ch = inv.update(Ok(gpus(&[16, 8])));
        assert!(ch[0].contains("back"), "{ch:?}");
        assert!(inv.devices().iter().all(|d| d.health == HEALTHY));
        // A driver that cannot list its GPUs: nothing is healthy.
        let ch = inv.update(Err("cuInit failed".into()));
        assert_eq!(ch.len(), 2);
        assert!(ch[0].contains("cuInit failed"), "{ch:?}");
        assert!(inv.devices().iter().all(|d| d.health == UNHEALTHY));
        // The first GPU gone: the other's index shifts, its IDs do not.
        inv.update(Ok(vec![Gpu {
            index: 0,
            uuid: U1.into(),
            total_mem: 8 * GIB,
            name: String::new(),
        }]));
        assert_eq!(inv.present()[0].index, 0);
        assert_eq!(inv.devices()[16].id, format!("{U1}-mem-0"));
        assert_eq!(inv.devices()[16].health, HEALTHY);
    }

    #[test]
    fn preferred_fits_one_gpu_best_fit() {
        let inv = mem(&[16, 8]);
        // 10 free on GPU 0, 6 on GPU 1: 4 fit on either; the fuller one.
        let mut avail = ids(U0, "mem", 6..16);
        avail.extend(ids(U1, "mem", 2..8));
        let p = inv.preferred(&avail, &[], 4).unwrap();
        assert_eq!(p, ids(U1, "mem", 2..6));
        // 8 fit only on GPU 0.
        let p = inv.preferred(&avail, &[], 8).unwrap();
        assert_eq!(p, ids(U0, "mem", 6..14));
        // 12 fit on none: the fewest GPUs, the largest first.
        let p = inv.preferred(&avail, &[], 12).unwrap();
        assert_eq!((on(&p, U0), on(&p, U1)), (10, 2));
        // Ties go to the GPU listed first.
        let mut avail = ids(U0, "mem", 0..4);
        avail.extend(ids(U1, "mem", 0..4));
        assert_eq!(inv.preferred(&avail, &[], 2).unwrap(), ids(U0, "mem", 0..2));
    }

    #[test]
    fn preferred_keeps_must_include_and_its_gpu() {
        let inv = mem(&[16, 8]);
        let mut avail = ids(U0, "mem", 0..16);
        avail.extend(ids(U1, "mem", 0..8));
        let must = ids(U0, "mem", [9]);
        let p = inv.preferred(&avail, &must, 4).unwrap();
        assert_eq!(p[0], must[0]);
        assert_eq!(on(&p, U0), 4, "{p:?}");
        let mut sorted = p.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 4, "no ID twice: {p:?}");
        // The must GPU has too few: the rest on one other GPU.
        let mut avail = ids(U0, "mem", 14..16);
        avail.extend(ids(U1, "mem", 0..8));
        let must = ids(U0, "mem", [14]);
        let p = inv.preferred(&avail, &must, 5).unwrap();
        assert_eq!((on(&p, U0), on(&p, U1)), (2, 3), "{p:?}");
        // Not enough at all: what there is.
        let p = inv.preferred(&ids(U1, "mem", 0..2), &[], 3).unwrap();
        assert_eq!(p.len(), 2);
        let e = inv.preferred(&["GPU-x-mem-0".into()], &[], 1).unwrap_err();
        assert!(
            e.contains("\"GPU-x-mem-0\"") && e.contains("GPU-<uuid>-mem-<n>"),
            "{e}"
        );
    }

    /// A directory of stand-in device nodes, removed with it.
    struct DevDir(PathBuf);

    impl Drop for DevDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Mounts whose device nodes are links to /dev/null (any character
    /// device will do), in a directory of the caller's own: tests run in
    /// parallel.
    fn mounts() -> (Injection, DevDir) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("gpufrac-k8s-dev-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in ["nvidia0", "nvidia1", "nvidia7"] {
            std::os::unix::fs::symlink("/dev/null", dir.join(n)).unwrap();
        }
        let m = Injection::Mounts(Mounts {
            lib: "/opt/gpufrac/lib/libgpufrac.so".into(),
            container_lib: "/usr/lib/gpufrac/libgpufrac.so".into(),
            socket: "/run/gpufrac/broker.sock".into(),
            container_socket_dir: "/run/gpufrac".into(),
            preload_file: None,
            control_nodes: vec![("/dev/nvidiactl".into(), "/dev/nvidiactl".into())],
            dev_dir: dir.clone(),
        });
        (m, DevDir(dir))
    }

    #[test]
    fn allocate_memory_units_on_one_gpu() {
        let inv = mem(&[16, 8]);
        let (inject, _dev) = mounts();
        let r = inv.allocate(&ids(U1, "mem", 0..4), &inject).unwrap().0;
        let e = &r.envs;
        assert_eq!(e["GPU_MEM_LIMIT"], "4G");
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], U1);
        assert_eq!(e["NVIDIA_VISIBLE_DEVICES"], U1);
        assert_eq!(e["LD_PRELOAD"], "/usr/lib/gpufrac/libgpufrac.so");
        assert_eq!(e["GPUFRAC_SOCKET"], "/run/gpufrac/broker.sock");
        assert!(!e.contains_key("GPU_COMPUTE_SHARE"));
        assert!(!e.keys().any(|k| k.starts_with("GPU_MEM_LIMIT_")));
        assert_eq!(r.mounts.len(), 2);
        assert!(r.mounts[0].read_only && r.mounts[0].host_path == "/opt/gpufrac/lib/libgpufrac.so");
        assert_eq!(
            (r.mounts[1].host_path.as_str(), r.mounts[1].read_only),
            ("/run/gpufrac", false)
        );
        let nodes: Vec<(&str, &str)> = r
            .devices
            .iter()
            .map(|d| (d.host_path.as_str(), d.container_path.as_str()))
            .collect();
        assert_eq!(
            nodes,
            [
                ("/dev/nvidiactl", "/dev/nvidiactl"),
                ("/dev/null", "/dev/nvidia1")
            ]
        );
        assert!(r.cdi_devices.is_empty());
    }

    #[test]
    fn preload_file_replaces_ld_preload() {
        let inv = mem(&[16]);
        let (inject, _dev) = mounts();
        let Injection::Mounts(mut m) = inject else {
            unreachable!()
        };
        m.preload_file = Some("/etc/gpufrac/ld.so.preload".into());
        let r = inv
            .allocate(&ids(U0, "mem", [0]), &Injection::Mounts(m))
            .unwrap()
            .0;
        assert!(!r.envs.contains_key("LD_PRELOAD"));
        assert!(r.mounts.contains(&api::Mount {
            container_path: "/etc/ld.so.preload".into(),
            host_path: "/etc/gpufrac/ld.so.preload".into(),
            read_only: true,
        }));
    }

    #[test]
    fn allocate_uses_the_minor_number() {
        let mut inv = mem(&[16, 8]);
        inv.set_minors(&BTreeMap::from([(U1.to_ascii_lowercase(), 7)]));
        let (inject, _dev) = mounts();
        let r = inv.allocate(&ids(U1, "mem", [0]), &inject).unwrap().0;
        assert_eq!(r.devices[1].container_path, "/dev/nvidia7");
        // A node that is not there is named.
        let mut inv = mem(&[16, 8]);
        inv.set_minors(&BTreeMap::from([(U1.to_ascii_lowercase(), 9)]));
        let e = inv.allocate(&ids(U1, "mem", [0]), &inject).unwrap_err();
        assert!(e.contains("nvidia9") && e.contains("--dev-dir"), "{e}");
    }

    #[test]
    fn allocate_slots_caps_memory_and_compute() {
        let inv = Inventory::new(Resource::Slots { per_gpu: 4 }, gpus(&[16, 8])).unwrap();
        let r = inv
            .allocate(&ids(U0, "slot", [2]), &Injection::Cdi)
            .unwrap()
            .0;
        assert_eq!(r.envs["GPU_MEM_LIMIT"], "4G");
        assert_eq!(r.envs["GPU_COMPUTE_SHARE"], "25%");
        let r = inv
            .allocate(&ids(U1, "slot", [0, 3]), &Injection::Cdi)
            .unwrap()
            .0;
        assert_eq!(r.envs["GPU_MEM_LIMIT"], "4G");
        assert_eq!(r.envs["GPU_COMPUTE_SHARE"], "50%");
        let inv = Inventory::new(Resource::Slots { per_gpu: 3 }, gpus(&[16])).unwrap();
        let r = inv
            .allocate(&ids(U0, "slot", [1]), &Injection::Cdi)
            .unwrap()
            .0;
        assert_eq!(r.envs["GPU_MEM_LIMIT"], (16 * GIB / 3).to_string());
        assert_eq!(r.envs["GPU_COMPUTE_SHARE"], "33.33%");
    }

    #[test]
    fn allocate_across_gpus_caps_each() {
        let inv = mem(&[16, 8]);
        let mut want = ids(U1, "mem", 0..2);
        want.extend(ids(U0, "mem", 0..3));
        let (inject, _dev) = mounts();
        let r = inv.allocate(&want, &inject).unwrap().0;
        let e = &r.envs;
        // In CUDA_VISIBLE_DEVICES order, which is index order.
        assert_eq!(e["CUDA_VISIBLE_DEVICES"], format!("{U0},{U1}"));
        assert_eq!(e["GPU_MEM_LIMIT_0"], "3G");
        assert_eq!(e["GPU_MEM_LIMIT_1"], "2G");
        assert_eq!(e["GPU_MEM_LIMIT"], "2G");
        assert_eq!(r.devices.len(), 3);
        let inv = Inventory::new(Resource::Slots { per_gpu: 4 }, gpus(&[16, 8])).unwrap();
        let mut want = ids(U0, "slot", 0..2);
        want.extend(ids(U1, "slot", [1]));
        let (r, booking) = inv.allocate(&want, &Injection::Cdi).unwrap();
        assert_eq!(r.envs["GPU_MEM_LIMIT_0"], "8G");
        assert_eq!(r.envs["GPU_MEM_LIMIT_1"], "2G");
        assert_eq!(r.envs["GPU_COMPUTE_SHARE"], "25%");
        // The broker books the same: each GPU's cap, the share, and the
        // IDs sorted (as the kubelet's pod-resources list is matched).
        want.sort();
        let pins = vec![(U0.to_string(), 8 * GIB), (U1.to_string(), 2 * GIB)];
        assert_eq!(
            booking,
            Booking {
                ids: want.clone(),
                pins,
                compute: Some(25.0),
            }
        );
        assert_eq!(inv.booking(&want).unwrap(), booking);
        let names: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpufrac.dev/gpu=0", "gpufrac.dev/gpu=1"]);
    }

    #[test]
    fn allocate_cdi_names_the_spec_devices_only() {
        let inv = mem(&[16, 8]);
        let r = inv
            .allocate(&ids(U1, "mem", 0..4), &Injection::Cdi)
            .unwrap()
            .0;
        assert_eq!(r.cdi_devices.len(), 1);
        assert_eq!(r.cdi_devices[0].name, "gpufrac.dev/gpu=1");
        assert!(r.mounts.is_empty() && r.devices.is_empty());
        let keys: Vec<&str> = r.envs.keys().map(String::as_str).collect();
        let mut keys = keys;
        keys.sort();
        assert_eq!(keys, ["CUDA_VISIBLE_DEVICES", "GPU_MEM_LIMIT"]);
    }

    #[test]
    fn allocate_refuses_what_it_cannot_grant() {
        let mut inv = mem(&[16, 8]);
        let e = inv.allocate(&[], &Injection::Cdi).unwrap_err();
        assert!(e.contains("at least one gpufrac.dev/gpu-memory"), "{e}");
        let e = inv
            .allocate(&[format!("{U0}-slot-0")], &Injection::Cdi)
            .unwrap_err();
        assert!(e.contains("GPU-<uuid>-mem-<n>"), "{e}");
        let e = inv
            .allocate(&[format!("{U1}-mem-8")], &Injection::Cdi)
            .unwrap_err();
        assert!(e.contains("-mem-8"), "past the GPU's units: {e}");
        let twice = vec![format!("{U0}-mem-1"), format!("{U0}-mem-1")];
        let e = inv.allocate(&twice, &Injection::Cdi).unwrap_err();
        assert!(e.contains("named twice"), "{e}");
        inv.update(Ok(gpus(&[16])));
        let e = inv
            .allocate(&ids(U1, "mem", [0]), &Injection::Cdi)
            .unwrap_err();
        assert!(e.contains("no longer lists"), "{e}");
    }

    #[test]
    fn env_formats() {
        assert_eq!(env_size(4 * GIB), "4G");
        assert_eq!(env_size(512 << 20), "512M");
        assert_eq!(env_size(GIB + (1 << 20)), "1025M");
        assert_eq!(env_size(1000), "1000");
        assert_eq!(env_percent(1, 4), "25%");
        assert_eq!(env_percent(1, 3), "33.33%");
        assert_eq!(env_percent(1, 8), "12.5%");
        assert_eq!(env_percent(4, 4), "100%");
        // What the shim accepts.
        for s in ["4G", "512M", "1025M", "1000"] {
            gpufrac_common::size::parse_mem_limit(s).unwrap();
        }
        for s in ["25%", "33.33%", "12.5%", "100%"] {
            gpufrac_common::size::parse_percent(s).unwrap();
        }
    }
}
