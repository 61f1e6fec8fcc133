//! Starting the broker: its options checked before anything is created,
//! its private directory made or checked, the GPUs discovered (MIG ones
//! through NVML), the socket bound, MPS started, the state file loaded,
//! and the core handed to the event loop.

use std::path::{Path, PathBuf};

use gpufrac_common::size::format_size;
use tracing::{info, warn};

use crate::authority::{Allow, Policy};
use crate::inventory::{self, Nvml};
use crate::mig;
use crate::mig_nvml::{MigDriver, NvmlMig};
use crate::procs::LiveProcs;
use crate::proto::{self, Broker, Budgets};
use crate::queue::{Placement, QueueConfig};
use crate::sched::SchedConfig;
use crate::statefile::StateFile;
use crate::weights::{Weights, parse_weight};
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
    /// Address for Prometheus metrics over HTTP: HOST:PORT, or a port
    /// alone for 127.0.0.1:PORT.
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
    /// The broker's private directory: the state file (leases and the
    /// queue, kept across restarts) and, with `--mps`, MPS's pipe and log
    /// directories. Default: [`default_state_dir`] of the socket.
    pub state_dir: Option<PathBuf>,
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
            state_dir: None,
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

/// Where a broker on `socket` keeps its private files when `--state-dir`
/// does not say: as root `/run/gpufrac/state/KEY`, else
/// `$XDG_RUNTIME_DIR/gpufrac/KEY` (or `/tmp/gpufrac-UID/KEY` without one
/// of this user's own),
/// KEY naming the socket, so that brokers of different sockets (tests,
/// CI) never share state. Never beside the socket: its directory may be a
/// sticky one others can write.
pub fn default_state_dir(socket: &Path) -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let base = if uid == 0 {
        PathBuf::from("/run/gpufrac/state")
    } else {
        // Only a runtime directory of this user's own: one inherited from
        // another user's environment (su, sudo -u) is not.
        use std::os::unix::fs::MetadataExt;
        match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
            Some(d) if d.is_absolute() && std::fs::metadata(&d).is_ok_and(|m| m.uid() == uid) => {
                d.join("gpufrac")
            }
            _ => PathBuf::from(format!("/tmp/gpufrac-{uid}")),
        }
    };
    base.join(socket_key(socket))
}

/// The socket's file name, cut to what is safe in a name, and a hash of
/// its whole absolute path (FNV-1a: stable from one release to the next,
/// so that a restarted broker finds its state).
fn socket_key(socket: &Path) -> String {
    let abs = std::path::absolute(socket).unwrap_or_else(|_| socket.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in std::os::unix::ffi::OsStrExt::as_bytes(abs.as_os_str()) {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let name: String = abs
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let name = name.trim_start_matches('.');
    format!("{name}-{h:016x}")
}

/// The broker's private directory, made or checked (`files::private_dir`)
/// before anything else is created, and whether it was made now (a clean
/// stop then removes it if nothing is left in it). Traversable by others
/// under `--mps`, whose clients of every user must reach the pipe
/// directory in it.
fn state_dir(opts: &BrokerOptions) -> Result<(PathBuf, bool), String> {
    let dir = match &opts.state_dir {
        Some(d) => {
            std::path::absolute(d).map_err(|e| format!("--state-dir {}: {e}", d.display()))?
        }
        None => default_state_dir(&opts.socket),
    };
    let mode = if opts.mps { 0o711 } else { 0o700 };
    let made = std::fs::symlink_metadata(&dir).is_err();
    gpufrac_common::files::private_dir(&dir, mode, "the state directory (--state-dir)")?;
    if opts.mps {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(&dir)
            .map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?
            .permissions()
            .mode();
        if m & 0o011 != 0o011 {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode((m | 0o011) & 0o755))
                .map_err(|e| format!("cannot let MPS clients reach {}: {e}", dir.display()))?;
        }
    }
    Ok((dir, made))
}

/// The state directory this start made, removed (if empty) when the start
/// fails after making it.
struct Made(Option<PathBuf>);

impl Drop for Made {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Releases before the private directory kept the state file beside the
/// socket (`<socket>.state`, and `.prev`). After an upgrade that restarts
/// a crashed broker, its leases are taken over from there, but only from a
/// directory nobody else can write (root's or this user's, no write for
/// group or others, sticky or not), and only a file of the broker's own
/// user: what sits beside a socket in /tmp is anyone's and is never read.
fn adopt_state_beside(socket: &Path, state: &Path) {
    use std::os::unix::fs::MetadataExt;
    let mut old = socket.as_os_str().to_owned();
    old.push(".state");
    let old = PathBuf::from(old);
    if state.exists() || std::fs::symlink_metadata(&old).is_err() {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let dir = socket.parent().filter(|d| !d.as_os_str().is_empty());
    let private = dir
        .and_then(|d| std::fs::metadata(d).ok())
        .is_some_and(|m| (m.uid() == 0 || m.uid() == me) && m.mode() & 0o022 == 0);
    if !private {
        warn!(
            "{} is left unread: a state file beside a socket in a directory others can write could be \
             anyone's; this broker keeps its state in {}",
            old.display(),
            state.display()
        );
        return;
    }
    // A directory closed since (as a refused socket directory is) keeps
    // what others planted while it was open: only the broker user's own
    // file is its state.
    let theirs = std::fs::symlink_metadata(&old)
        .ok()
        .filter(|m| !m.file_type().is_file() || m.uid() != me);
    if let Some(m) = theirs {
        warn!(
            "{} is left unread: it is not a file of this broker's user (uid {me}) but {} of uid {}; \
             this broker keeps its state in {}",
            old.display(),
            if m.file_type().is_file() {
                "a file"
            } else {
                "something else"
            },
            m.uid(),
            state.display()
        );
        return;
    }
    let mut prev_new = state.as_os_str().to_owned();
    prev_new.push(".prev");
    let mut prev_old = old.as_os_str().to_owned();
    prev_old.push(".prev");
    let _ = std::fs::rename(&prev_old, &prev_new);
    match std::fs::rename(&old, state) {
        Ok(()) => {
            info!(from = %old.display(), to = %state.display(), "took over the state file of an earlier release")
        }
        Err(e) => warn!(
            "cannot move {} to {}: {e}; its leases are not restored",
            old.display(),
            state.display()
        ),
    }
}

/// A user's uid: a number as it is, a name through the user database.
pub fn uid_of(name: &str) -> Result<u32, String> {
    id_of(name, "user", |c| {
        // SAFETY: getpwnam with a valid C string; pw_uid is copied at once.
        let pw = unsafe { libc::getpwnam(c.as_ptr()) };
        (!pw.is_null()).then(|| unsafe { (*pw).pw_uid })
    })
}

/// A group's gid: a number as it is, a name through the group database.
pub fn gid_of(name: &str) -> Result<u32, String> {
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
    let metrics_addr = opts
        .metrics
        .as_deref()
        .map(crate::metrics::address)
        .transpose()?;
    let (state_dir, made) = state_dir(&opts)?;
    // A start refused from here on leaves nothing behind, this directory
    // included.
    let mut made = Made(made.then(|| state_dir.clone()));
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
    let metrics = match &metrics_addr {
        Some(addr) => Some(crate::metrics::serve(addr)?.1),
        None => None,
    };
    let listener = crate::listen::bind(&opts.socket, group)?;
    info!(nofile, "file limit");
    let mps = if opts.mps {
        match crate::mps::Mps::start(&state_dir) {
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
    let state = StateFile::new(state_dir.join("state"));
    adopt_state_beside(&opts.socket, state.path());
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
        Box::new(LiveProcs(crate::ident::kind())),
        crate::jobs::token_source(),
        now,
    );
    // Sampled off the event loop, and only where there is a driver to ask.
    let nvml = Nvml::open();
    let sampler: Option<Box<dyn crate::procs::Sampler + Send>> = nvml
        .is_open()
        .then(|| Box::new(crate::procs::NvmlSampler::new(nvml)) as _);
    // What a previous broker left is booked before any client is heard.
    core.restore(gpufrac_common::clock::mono_ns(), state.load());
    info!(socket = %opts.socket.display(), state_dir = %state_dir.display(), timeslice_ms = opts.timeslice as f64 / 1e6, "broker ready");
    crate::server::serve(crate::server::Shell {
        core,
        listener,
        state,
        // Removed at a clean stop when nothing is left in it: the one this
        // start made, or the socket's own default one, whoever made it (a
        // broker killed before this one left it, and a restart that did
        // not make it would otherwise keep it for good). An
        // administrator's `--state-dir` that was there before stays.
        made_dir: made
            .0
            .take()
            .or_else(|| opts.state_dir.is_none().then_some(state_dir)),
        metrics,
        mps,
        mig_driver,
        sampler,
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

    #[test]
    fn each_socket_has_a_state_directory_of_its_own() {
        let a = default_state_dir(Path::new("/tmp/ci-1/gpufrac.sock"));
        let b = default_state_dir(Path::new("/tmp/ci-2/gpufrac.sock"));
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("gpufrac.sock-") && name.len() == 13 + 16,
            "{name}"
        );
        // Stable: a restarted broker finds what its predecessor left.
        assert_eq!(a, default_state_dir(Path::new("/tmp/ci-1/gpufrac.sock")));
        // Never beside the socket, whatever the socket's directory.
        assert!(!a.starts_with("/tmp/ci-1"), "{}", a.display());
        // A name that would not be one stays one.
        let odd = socket_key(Path::new("/x/..hidden sock\n"));
        assert!(
            odd.starts_with("hidden_sock_-") && !odd.contains('/'),
            "{odd}"
        );
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(a.starts_with("/run/gpufrac/state"), "{}", a.display());
        }
    }

    #[test]
    fn an_earlier_releases_state_is_taken_over_only_from_a_private_directory_and_its_own_user() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("gpufrac-adopt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        // A closed directory with a file of another user's left in it
        // (planted while it was open) needs root to make.
        let mut cases = vec![("private", 0o755, me, true), ("sticky", 0o1777, me, false)];
        if me == 0 {
            cases.push(("closed", 0o755, 65534, false));
        }
        for (sub, mode, owner, adopted) in cases {
            let run = d.join(sub);
            std::fs::create_dir_all(&run).unwrap();
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
            let socket = run.join("b.sock");
            std::fs::write(run.join("b.sock.state"), b"old").unwrap();
            std::fs::write(run.join("b.sock.state.prev"), b"older").unwrap();
            std::os::unix::fs::chown(run.join("b.sock.state"), Some(owner), None).unwrap();
            let state_dir = d.join(format!("{sub}-state"));
            std::fs::create_dir_all(&state_dir).unwrap();
            let state = state_dir.join("state");
            adopt_state_beside(&socket, &state);
            assert_eq!(state.exists(), adopted, "{sub}");
            assert_eq!(run.join("b.sock.state").exists(), !adopted, "{sub}");
            if adopted {
                assert_eq!(
                    std::fs::read(state_dir.join("state.prev")).unwrap(),
                    b"older"
                );
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
