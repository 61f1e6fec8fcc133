//! The node's GPUs as the DRA plugin publishes them: each under a device
//! name (`gpu-0`) that stays the GPU's for as long as the plugin runs, so
//! that a claim allocated before a GPU before it went away still names the
//! GPU it was given. Pure bookkeeping, no I/O.

use std::collections::BTreeMap;

use crate::devices::Gpu;

/// A GPU the plugin has seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Known {
    pub gpu: Gpu,
    /// Its device name in the ResourceSlice.
    pub name: String,
    /// Listed by the driver at the last look.
    pub present: bool,
    /// Its /dev/nvidiaN minor number, when the kernel module says.
    pub minor: Option<u32>,
}

impl Known {
    /// The N of its /dev/nvidiaN: the minor number, else the index.
    pub fn node_number(&self) -> u32 {
        self.minor.unwrap_or(self.gpu.index)
    }
}

/// Every GPU seen since the plugin started, in the order first seen.
#[derive(Clone, Debug, Default)]
pub struct Gpus {
    known: Vec<Known>,
}

impl Gpus {
    pub fn new(listed: Vec<Gpu>) -> Result<Gpus, String> {
        if listed.is_empty() {
            return Err(
                "the CUDA driver lists no GPUs, so there is nothing to publish; run the plugin on \
                 GPU nodes only (a nodeSelector on the DaemonSet keeps it off the others)"
                    .into(),
            );
        }
        let mut g = Gpus::default();
        g.update(Ok(listed));
        Ok(g)
    }

    /// Applies a fresh list (or the failure to get one: every GPU is then
    /// taken as gone, since a driver that cannot list its GPUs cannot run
    /// a pod's work either). Returns what changed, for the log.
    pub fn update(&mut self, listed: Result<Vec<Gpu>, String>) -> Vec<String> {
        let mut changes = Vec::new();
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                for k in self.known.iter_mut().filter(|k| k.present) {
                    k.present = false;
                    changes.push(format!(
                        "{} ({}) is withdrawn: listing the GPUs failed: {e}",
                        k.name, k.gpu.uuid
                    ));
                }
                return changes;
            }
        };
        for k in &mut self.known {
            let now = listed.iter().find(|g| g.uuid == k.gpu.uuid);
            match (k.present, now) {
                (true, None) => changes.push(format!(
                    "{} ({}) is gone from the driver's list: withdrawn from the ResourceSlice",
                    k.name, k.gpu.uuid
                )),
                (false, Some(_)) => changes.push(format!(
                    "{} ({}) is back: published again",
                    k.name, k.gpu.uuid
                )),
                _ => {}
            }
            k.present = now.is_some();
            if let Some(g) = now {
                // The index follows the driver's numbering; the name stays.
                k.gpu.index = g.index;
            }
        }
        for g in listed {
            if self.known.iter().any(|k| k.gpu.uuid == g.uuid) {
                continue;
            }
            // Named after its index, unless a GPU seen earlier has that name.
            let mut n = g.index;
            while self.known.iter().any(|k| k.name == device_name(n)) {
                n += 1;
            }
            let name = device_name(n);
            changes.push(format!(
                "{name}: GPU {} ({}, {}{})",
                g.index,
                g.uuid,
                gpufrac_common::size::format_size(g.total_mem),
                if g.name.is_empty() {
                    String::new()
                } else {
                    format!(", {}", g.name)
                }
            ));
            self.known.push(Known {
                gpu: g,
                name,
                present: true,
                minor: None,
            });
        }
        changes
    }

    /// Records the /dev/nvidiaN minor numbers the kernel module gives, by
    /// GPU UUID (lower case).
    pub fn set_minors(&mut self, minors: &BTreeMap<String, u32>) {
        for k in &mut self.known {
            k.minor = minors.get(&k.gpu.uuid.to_ascii_lowercase()).copied();
        }
    }

    /// The GPUs listed now, as published.
    pub fn present(&self) -> impl Iterator<Item = &Known> {
        self.known.iter().filter(|k| k.present)
    }

    /// The GPU a device name stands for, listed now or not.
    pub fn by_name(&self, name: &str) -> Option<&Known> {
        self.known.iter().find(|k| k.name == name)
    }

    /// The GPU of a UUID, listed now or not.
    pub fn by_uuid(&self, uuid: &str) -> Option<&Known> {
        self.known.iter().find(|k| k.gpu.uuid == uuid)
    }
}

pub fn device_name(n: u32) -> String {
    format!("gpu-{n}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> Gpu {
        Gpu {
            index,
            uuid: uuid.into(),
            total_mem: 16 << 30,
            name: "gpufrac-sim".into(),
        }
    }

    #[test]
    fn names_stay_with_their_gpus() {
        let mut g = Gpus::new(vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")]).unwrap();
        let names: Vec<&str> = g.present().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1"]);
        // GPU 0 goes: GPU-b is index 0 now, still gpu-1.
        let ch = g.update(Ok(vec![gpu(0, "GPU-b")]));
        assert!(ch[0].contains("gpu-0 (GPU-a) is gone"), "{ch:?}");
        assert_eq!(g.by_name("gpu-1").unwrap().gpu.uuid, "GPU-b");
        assert!(!g.by_name("gpu-0").unwrap().present);
        // A new GPU at index 1 cannot take gpu-1.
        g.update(Ok(vec![gpu(0, "GPU-b"), gpu(1, "GPU-c")]));
        assert_eq!(g.by_uuid("GPU-c").unwrap().name, "gpu-2");
        // A failed listing withdraws them all.
        let ch = g.update(Err("cuInit failed".into()));
        assert_eq!(ch.len(), 2);
        assert_eq!(g.present().count(), 0);
        let e = Gpus::new(vec![]).unwrap_err();
        assert!(e.contains("nodeSelector"), "{e}");
    }

    #[test]
    fn minors_name_the_device_nodes() {
        let mut g = Gpus::new(vec![gpu(0, "GPU-AB")]).unwrap();
        assert_eq!(g.by_name("gpu-0").unwrap().node_number(), 0);
        g.set_minors(&BTreeMap::from([("gpu-ab".to_string(), 3)]));
        assert_eq!(g.by_name("gpu-0").unwrap().node_number(), 3);
    }
}
