//! Starting the broker: its options checked before anything is created,
//! the GPUs discovered (MIG ones through NVML), the socket bound, MPS
//! started, the state file loaded, and the core handed to the event loop.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gpufrac_common::size::format_size;
use tracing::{info, warn};

use crate::authority::{Allow, Policy};
use crate::inventory::{self, Nvml};
use crate::mig;
use crate::mig_nvml::{MigDriver, NvmlMig};
use crate::procs::LiveProcs;
use crate::proto::{self, Broker, Budgets};
use crate::queue::{Placement, QueueConfig};
use crate::sched::{SchedConfig, Weights, parse_weight};
use crate::statefile::StateFile;
use gpufrac_common::wire::uuid_string;

#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub socket: PathBuf,
    /// Contended timeslice between busy processes of one class, ns
    /// (default 20 ms).
    pub timeslice: u64,
    /// Most unfinished work a holder may keep queued while others share its
    /// GPU, ns (default 250 µs; 0: unbounded).
    pub inflight: u64,
    /// Group that may use the socket (mode 0660).
    pub group: Option<String>,
    /// Address for Prometheus metrics over HTTP, e.g. 127.0.0.1:9400.
    pub metrics: Option<String>,
    /// Queue escalation age, ns (default 1 h).
    pub escalate_after: u64,
    /// Logical GPUs per physical GPU (default 1).
    pub overprovision: u32,
    /// Allow committed memory beyond physical.
    pub overcommit: bool,
    /// Place fractions on the emptiest GPU instead of best fit.
    pub spread: bool,
    /// Most connections one user may hold open at once.
    pub max_conns_per_user: usize,
    /// Most requests one user may have waiting in the queue.
    pub max_queued_per_user: usize,
    /// Most leases (and queued requests) one user may hold.
    pub max_leases_per_user: usize,
    /// Where leases and the queue are kept across restarts (default: next
    /// to the socket, `<socket>.state`).
    pub state: Option<PathBuf>,
    /// Run NVIDIA MPS for the GPUs: jobs share the SMs at once.
    pub mps: bool,
    /// What to do with GPUs in MIG mode.
    pub mig: MigMode,
    /// Users (names or uids) who, besides root, may send the device
    /// plugin's pinned leases and chosen tokens.
    pub plugin_users: Vec<String>,
    /// Groups (names or gids) likewise.
    pub plugin_groups: Vec<String>,
    /// Who may ask for `high` (users, or `@group`); empty: everyone.
    pub high_allow: Vec<String>,
    /// The most of each window the `high` class holds while lower classes
    /// wait, a fraction in (0, 1].
    pub high_share: f64,
    /// `--user-weight USER=W` and `--group-weight GROUP=W`, as given.
    pub user_weights: Vec<String>,
    pub group_weights: Vec<String>,
    /// After an untrusted state file, how long running jobs have to claim
    /// their leases back before new placements resume, ns.
    pub recovery_grace: u64,
}

/// How the broker uses GPUs in MIG mode (docs/mig.md). It never changes a
/// GPU's MIG mode: that resets the GPU and is the administrator's call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MigMode {
    /// Not at all: CUDA shows no device for such a GPU, and the broker
    /// says so at start.
    #[default]
    Off,
    /// `--mig dynamic`: `gpufrac run --gpu-memory` jobs get MIG instances
    /// made for them (the smallest profile that fits), kept idle after the
    /// job for the next one, and destroyed only when their room is needed.
    Dynamic,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        let budgets = Budgets::default();
        BrokerOptions {
            socket: gpufrac_common::config::DEFAULT_SOCKET.into(),
            timeslice: SchedConfig::default().timeslice,
            inflight: SchedConfig::default().bound,
            group: None,
            metrics: None,
            escalate_after: 3600 * 1_000_000_000,
            overprovision: 1,
            overcommit: false,
            spread: false,
            max_conns_per_user: budgets.connections,
            max_queued_per_user: budgets.queued,
            max_leases_per_user: budgets.leases,
            state: None,
            mps: false,
            mig: MigMode::Off,
            plugin_users: Vec::new(),
            plugin_groups: Vec::new(),
            high_allow: Vec::new(),
            high_share: SchedConfig::default().high_share,
            user_weights: Vec::new(),
            group_weights: Vec::new(),
            recovery_grace: proto::Config::default().recovery_grace,
        }
    }
}

/// A user's uid: a number as it is, a name through the user database.
fn uid_of(name: &str) -> Result<u32, String> {
    id_of(name, "user", |c| {
        // SAFETY: getpwnam with a valid C string; pw_uid is copied at once.
        let pw = unsafe { libc::getpwnam(c.as_ptr()) };
        (!pw.is_null()).then(|| unsafe { (*pw).pw_uid })
    })
}

/// A group's gid: a number as it is, a name through the group database.
fn gid_of(name: &str) -> Result<u32, String> {
    id_of(name, "group", |c| {
        // SAFETY: getgrnam with a valid C string; gr_gid is copied at once.
        let gr = unsafe { libc::getgrnam(c.as_ptr()) };
        (!gr.is_null()).then(|| unsafe { (*gr).gr_gid })
    })
}

fn id_of(
    name: &str,
    what: &str,
    lookup: impl Fn(&std::ffi::CStr) -> Option<u32>,
) -> Result<u32, String> {
    if let Ok(n) = name.parse() {
        return Ok(n);
    }
    let c = std::ffi::CString::new(name).map_err(|_| format!("bad {what} name {name:?}"))?;
    lookup(&c).ok_or_else(|| format!("no such {what}: {name}"))
}

/// The rule set's lists, names resolved once at start.
fn policy(opts: &BrokerOptions) -> Result<Policy, String> {
    let mut plugin = Allow::default();
    for u in &opts.plugin_users {
        plugin
            .uids
            .push(uid_of(u).map_err(|e| format!("--plugin-user {u}: {e}"))?);
    }
    for g in &opts.plugin_groups {
        plugin
            .gids
            .push(gid_of(g).map_err(|e| format!("--plugin-group {g}: {e}"))?);
    }
    let high = if opts.high_allow.is_empty() {
        None
    } else {
        let mut a = Allow::default();
        for h in &opts.high_allow {
            let r = match h.strip_prefix('@') {
                Some(g) => gid_of(g).map(|g| a.gids.push(g)),
                None => uid_of(h).map(|u| a.uids.push(u)),
            };
            r.map_err(|e| format!("--high-allow {h}: {e} (name a user, or a group as @group)"))?;
        }
        Some(a)
    };
    Ok(Policy { plugin, high })
}

/// Runs the broker until SIGTERM/SIGINT. Returns an error message meant for
/// the user (e.g. the socket is already in use).
pub fn run(opts: BrokerOptions) -> Result<(), String> {
    // Every option is checked before anything is created, so a refused
    // start leaves nothing behind.
    if opts.overprovision == 0 {
        return Err("--overprovision must be at least 1".into());
    }
    for (n, flag) in [
        (opts.max_conns_per_user, "--max-connections-per-user"),
        (opts.max_queued_per_user, "--max-queued-per-user"),
        (opts.max_leases_per_user, "--max-leases-per-user"),
    ] {
        if n == 0 {
            return Err(format!("{flag} must be at least 1"));
        }
    }
    if !(opts.high_share > 0.0 && opts.high_share <= 1.0) {
        return Err(format!(
            "--high-share must be a percentage in (0, 100], e.g. 50%; got {}",
            opts.high_share * 100.0
        ));
    }
    if opts.mig == MigMode::Dynamic && opts.mps {
        return Err(
            "--mig dynamic and --mps cannot be combined: choose MIG instances (isolated, fixed sizes) \
             or MPS (shared SMs, one fault domain) for this node"
                .into(),
        );
    }
    let group = match &opts.group {
        Some(g) => Some((
            g.as_str(),
            gid_of(g).map_err(|e| format!("--group {g}: {e}"))?,
        )),
        None => None,
    };
    let policy = policy(&opts)?;
    let mut weights = Weights::default();
    for a in &opts.user_weights {
        let (u, w) = parse_weight("--user-weight", a, uid_of)?;
        weights.users.insert(u, w);
    }
    for a in &opts.group_weights {
        let (g, w) = parse_weight("--group-weight", a, gid_of)?;
        weights.groups.insert(g, w);
    }
    if let Some(addr) = &opts.metrics
        && addr.parse::<std::net::SocketAddr>().is_err()
        && std::net::ToSocketAddrs::to_socket_addrs(addr.as_str()).is_err()
    {
        // `--metrics 9400` (or `:9400`) is the likely slip: a port alone.
        return Err(match addr.trim_start_matches(':').parse::<u16>() {
            Ok(port) => format!(
                "--metrics {addr}: needs an address, not only a port; \
                 use --metrics 127.0.0.1:{port} (or 0.0.0.0:{port} to serve every interface)"
            ),
            Err(_) => {
                format!("--metrics {addr}: not an address; use HOST:PORT, e.g. 127.0.0.1:9400")
            }
        });
    }
    let nofile = crate::listen::raise_nofile();
    let found = match inventory::discover() {
        Ok(g) => g,
        // With --mig dynamic the GPUs may all be in MIG mode, which CUDA
        // does not show as devices; NVML is asked below.
        Err(e) if opts.mig == MigMode::Dynamic => {
            info!("{e}");
            Vec::new()
        }
        Err(e) => {
            warn!(
                "{e}; no GPUs to queue for (compute arbitration still works for clients that register)"
            );
            Vec::new()
        }
    };
    let now = gpufrac_common::clock::mono_ns();
    let (found, planner, mig_driver) = discover_mig(opts.mig, found, now)?;
    let discovered = !found.is_empty() || !planner.is_empty();
    for g in &found {
        info!(index = g.index, name = %g.name, uuid = %uuid_string(&g.uuid), total = %format_size(g.total_mem), "GPU");
    }
    // Bound before the socket: a metrics address in use must not leave a
    // socket behind.
    let metrics = match &opts.metrics {
        Some(addr) => {
            let m = Arc::new(Mutex::new(String::new()));
            crate::metrics::serve_metrics(addr, m.clone())?;
            Some(m)
        }
        None => None,
    };
    let listener = crate::listen::bind(&opts.socket, group)?;
    info!(nofile, "file limit");
    let mps = if opts.mps {
        let dir = opts
            .socket
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."))
            .to_path_buf();
        match crate::mps::Mps::start(&dir) {
            Ok(m) => Some(m),
            Err(e) => {
                // Nothing left behind by a refused start.
                let _ = std::fs::remove_file(&opts.socket);
                return Err(e);
            }
        }
    } else {
        None
    };
    let state = StateFile::new(opts.state.clone().unwrap_or_else(|| {
        let mut p = opts.socket.clone().into_os_string();
        p.push(".state");
        PathBuf::from(p)
    }));
    let cfg = proto::Config {
        sched: SchedConfig {
            timeslice: opts.timeslice,
            bound: opts.inflight,
            high_share: opts.high_share,
            ..SchedConfig::default()
        },
        queue: QueueConfig {
            escalate_after: opts.escalate_after,
            overprovision: opts.overprovision,
            overcommit: opts.overcommit,
            placement: if opts.spread {
                Placement::Spread
            } else {
                Placement::BestFit
            },
        },
        policy,
        weights,
        budgets: Budgets {
            connections: opts.max_conns_per_user,
            queued: opts.max_queued_per_user,
            leases: opts.max_leases_per_user,
            ..Budgets::default()
        },
        socket: opts.socket.display().to_string(),
        mps_pipe: mps.as_ref().map(|m| m.pipe_dir.display().to_string()),
        recovery_grace: opts.recovery_grace,
    };
    let mut core = Broker::new(
        cfg,
        found,
        planner,
        discovered,
        Box::new(LiveProcs),
        Box::new(Nvml::open()),
        now,
    );
    // What a previous broker left is booked before any client is heard.
    core.restore(gpufrac_common::clock::mono_ns(), state.load());
    info!(socket = %opts.socket.display(), timeslice_ms = opts.timeslice as f64 / 1e6, "broker ready");
    crate::server::serve(crate::server::Shell {
        core,
        listener,
        socket: opts.socket.clone(),
        state,
        metrics,
        mps,
        mig_driver,
    })
}

/// GPUs in MIG mode, through NVML. With `--mig dynamic`: their profiles and
/// instances go to the planner (instances found are adopted, idle); they
/// leave the CUDA-found list, whose GPUs take NVML's (nvidia-smi's) index.
/// Without it, a GPU in MIG mode is only mentioned. Returns the GPUs for
/// the queue, the planner and the driver.
#[allow(clippy::type_complexity)]
fn discover_mig(
    mode: MigMode,
    mut found: Vec<inventory::GpuInfo>,
    now: u64,
) -> Result<
    (
        Vec<inventory::GpuInfo>,
        mig::Planner,
        Option<Box<dyn MigDriver + Send>>,
    ),
    String,
> {
    if mode == MigMode::Off {
        if let Ok(all) = NvmlMig::open().and_then(|mut d| d.gpus()) {
            for g in all.iter().filter(|g| g.mig) {
                info!(
                    index = g.index,
                    name = %g.name,
                    "GPU in MIG mode: this broker does not use it; gpufrac broker --mig dynamic hands out its MIG instances"
                );
            }
        }
        return Ok((found, mig::Planner::default(), None));
    }
    let mut d = NvmlMig::open().map_err(|e| {
        format!("--mig dynamic needs NVML to read MIG modes and make instances: {e}")
    })?;
    let all = d.gpus().map_err(|e| format!("--mig dynamic: {e}"))?;
    let mut described = Vec::new();
    for g in all.iter().filter(|g| g.mig) {
        described.push(d.describe(g).map_err(|e| format!("--mig dynamic: {e}"))?);
    }
    let mut planner = mig::Planner::new(described.clone());
    for g in &described {
        let inst = d
            .instances(g.index)
            .map_err(|e| format!("--mig dynamic: {e}"))?;
        planner.sync(now, g.index, &inst);
        let profiles: Vec<&str> = g.profiles.iter().map(|p| p.name.as_str()).collect();
        info!(
            index = g.index,
            name = %g.name,
            uuid = %g.uuid,
            instances = inst.len(),
            profiles = %profiles.join(" "),
            "GPU in MIG mode: its instances are made and destroyed for --gpu-memory jobs"
        );
    }
    if described.is_empty() {
        warn!(
            "--mig dynamic: no GPU is in MIG mode, so there is nothing to manage; an administrator enables \
             MIG with nvidia-smi -i N -mig 1 (gpufrac never changes MIG mode)"
        );
    }
    found.retain(|c| {
        let u = uuid_string(&c.uuid);
        !all.iter().any(|g| g.mig && g.uuid == u)
    });
    for c in &mut found {
        let u = uuid_string(&c.uuid);
        if let Some(g) = all.iter().find(|g| g.uuid == u) {
            c.index = g.index;
        }
    }
    Ok((found, planner, Some(Box::new(d))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_resolve_names_and_numbers_and_say_what_is_wrong() {
        let opts = BrokerOptions {
            plugin_users: vec!["root".into(), "4242".into()],
            plugin_groups: vec!["0".into()],
            high_allow: vec!["root".into(), "@root".into()],
            ..BrokerOptions::default()
        };
        let p = policy(&opts).unwrap();
        assert_eq!(p.plugin.uids, vec![0, 4242]);
        assert_eq!(p.plugin.gids, vec![0]);
        let h = p.high.unwrap();
        assert_eq!((h.uids, h.gids), (vec![0], vec![0]));
        assert!(policy(&BrokerOptions::default()).unwrap().high.is_none());
        let e = policy(&BrokerOptions {
            high_allow: vec!["no-such-user-gpufrac".into()],
            ..BrokerOptions::default()
        })
        .unwrap_err();
        assert!(e.contains("--high-allow") && e.contains("@group"), "{e}");
    }
}
