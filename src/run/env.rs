//! The child's environment: the shim preloaded, its caps and flags, where
//! the broker placed it, and MPS's variables when the broker runs MPS.

use std::path::Path;

use gpufrac_common::config::{
    Priority, VAR_BROKER, VAR_COMPUTE_LIMIT, VAR_COMPUTE_PRIORITY, VAR_COMPUTE_SHARE,
    VAR_MEM_LIMIT, VAR_MEM_LIMIT_PREFIX, VAR_SOCKET,
};

use crate::inject::SHIM_NAME;

/// Where the child runs, as far as the broker decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// No broker: the shim enforces the memory cap on its own.
    NoBroker,
    /// A broker is there but nothing was asked of the queue (neither --gpus
    /// nor --gpu-memory): the child sees every GPU and registers itself.
    Unplaced,
    Leased {
        /// nvidia-smi indices.
        gpus: Vec<u32>,
        /// Bytes per GPU; 0 = uncapped.
        mem_cap: u64,
        /// A MIG instance (`MIG-<uuid>`) of `gpus`' one GPU: the device the
        /// child is given instead of the GPU.
        mig: Option<String>,
    },
}

/// The flags that shape the child's environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EnvFlags {
    pub gpu_memory: Option<u64>,
    /// Percent.
    pub compute: Option<f64>,
    /// Percent.
    pub limit: Option<f64>,
    pub priority: Option<Priority>,
}

/// Changes to make to the child's environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChildEnv {
    pub set: Vec<(String, String)>,
    pub remove: Vec<String>,
}

#[cfg(test)]
impl ChildEnv {
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.set
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Builds the child's environment from the placement, the flags and the
/// environment `run` was started with (first occurrence wins, as for
/// `getenv`).
pub fn child_env(
    placement: &Placement,
    flags: &EnvFlags,
    shim: &Path,
    socket: &Path,
    existing: &[(String, String)],
) -> ChildEnv {
    let get = |name: &str| {
        existing
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let mut env = ChildEnv::default();
    let mut set = |k: &str, v: String| env.set.push((k.to_owned(), v));

    set("LD_PRELOAD", prepend_preload(shim, get("LD_PRELOAD")));
    set(VAR_SOCKET, socket.display().to_string());

    let cap = match placement {
        Placement::NoBroker => {
            // The shim would otherwise look for the broker again and print
            // its own warning after ours.
            set(VAR_BROKER, "off".to_owned());
            flags.gpu_memory
        }
        Placement::Unplaced => flags.gpu_memory,
        Placement::Leased {
            mig: Some(m),
            mem_cap,
            ..
        } => {
            // CUDA enumerates the one MIG device named; its UUID says
            // which, so no device order is needed.
            set("CUDA_VISIBLE_DEVICES", m.clone());
            Some(*mem_cap).filter(|&c| c > 0).or(flags.gpu_memory)
        }
        Placement::Leased {
            gpus,
            mem_cap,
            mig: None,
        } => {
            if !gpus.is_empty() {
                let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
                set("CUDA_VISIBLE_DEVICES", list.join(","));
                // The broker numbers GPUs as nvidia-smi does; CUDA's default
                // order (fastest first) can differ.
                set("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned());
            }
            Some(*mem_cap).filter(|&c| c > 0).or(flags.gpu_memory)
        }
    };
    if let Some(cap) = cap {
        set(VAR_MEM_LIMIT, cap.to_string());
    }
    // Shares mean nothing to a shim that may not reach a broker.
    if *placement != Placement::NoBroker {
        if let Some(p) = flags.compute {
            set(VAR_COMPUTE_SHARE, format!("{p}%"));
        }
        if let Some(p) = flags.limit {
            set(VAR_COMPUTE_LIMIT, format!("{p}%"));
        }
        if let Some(p) = flags.priority {
            set(VAR_COMPUTE_PRIORITY, p.as_str().to_owned());
        }
    }
    if cap.is_some() {
        // A per-device override would beat the cap gpufrac promised the
        // broker, and under a new CUDA_VISIBLE_DEVICES it would name another
        // GPU than the user meant anyway.
        for (k, _) in existing {
            if k.strip_prefix(VAR_MEM_LIMIT_PREFIX)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                && !env.remove.contains(k)
            {
                env.remove.push(k.clone());
            }
        }
    }
    env
}

/// The shim first, so its symbols win over any other preloaded library's;
/// left alone when some libgpufrac.so is already there, because two shims
/// would each count the same allocations.
fn prepend_preload(shim: &Path, existing: Option<&str>) -> String {
    let existing = existing.unwrap_or("").trim();
    let has_shim = existing
        .split([':', ' '])
        .any(|e| !e.is_empty() && Path::new(e).file_name().is_some_and(|n| n == SHIM_NAME));
    if has_shim {
        return existing.to_owned();
    }
    let shim = shim.display().to_string();
    if existing.is_empty() {
        shim
    } else {
        format!("{shim}:{existing}")
    }
}

/// A broker running MPS: the child is an MPS client of its daemon, its
/// `--gpu-compute` is the share of SMs it may use, and `--priority low`
/// is MPS's below-normal client priority (MPS has no higher one).
pub(super) fn mps_env(pipe: &str, flags: &EnvFlags) -> Vec<(String, String)> {
    if pipe.is_empty() {
        return Vec::new();
    }
    let mut v = vec![("CUDA_MPS_PIPE_DIRECTORY".to_owned(), pipe.to_owned())];
    if let Some(p) = flags.compute {
        v.push((
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(),
            format!("{}", p.clamp(1.0, 100.0)),
        ));
    }
    if flags.priority == Some(Priority::Low) {
        v.push(("CUDA_MPS_CLIENT_PRIORITY".to_owned(), "1".to_owned()));
    }
    v
}
