//! Real container engines for tests: Docker and Podman installed and
//! answering, a sealed Debian image built once per cache, the arguments
//! that put the simulated driver and the test programs inside a container,
//! and containers removed however a test ends.
//!
//! Include it beside `support` with
//! `#[path = "support/engines.rs"] mod engines;`.
//!
//! On a machine without the engines (a fresh Debian 12 CI runner) the
//! helpers install them with apt-get, saying so first; they give up, loudly,
//! only where that is impossible (not root, no apt-get) or where
//! `GPUFRAC_TEST_ENGINES=0` says to. Tests then return early:
//! `if !engines::ensure_docker() { return; }`.
//!
//! What they keep lives in the test cache (`support::test_cache()`): the
//! image's root file system, the data root of the dockerd they start, and
//! Podman's image store. A dockerd already answering on the default socket
//! is used as it is and left alone; otherwise the tests start their own,
//! on a socket of their own, and stop it when the last test process that
//! used it has exited, however it exited (see `docker_daemon`).
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use crate::support::MachineLock;
use crate::support::{Broker, apt_install, artifacts, cannot, engines_wanted, say, test_cache};
/// The sealed image: Debian bookworm's essential packages and nothing else
/// (no CUDA, no gpufrac), imported from a tarball since no registry is
/// reachable. The tag is ours; nothing else uses it.
pub const IMAGE: &str = "gpufrac-test:bookworm";
/// Where the test programs appear inside containers.
pub const PROBE: &str = "/gpufrac-test/probe";
pub const LOADGEN: &str = "/gpufrac-test/loadgen";
/// Where `sim_driver_args` puts the simulated driver.
pub const SIM_LIB_DIR: &str = "/gpufrac-test/lib";

/// This client talks to the daemon installed beside it; a newer client
/// elsewhere on PATH may not (it may speak an API the daemon lacks).
const DOCKER: &str = "/usr/bin/docker";
const DOCKERD: &str = "/usr/sbin/dockerd";
const PODMAN: &str = "/usr/bin/podman";
const MMDEBSTRAP: &str = "/usr/bin/mmdebstrap";
const RUNC: &[&str] = &["/usr/sbin/runc", "/usr/bin/runc"];

/// Podman's settings in tests. Its default ulimits (nofile 1048576) exceed
/// the hard limit on many CI machines and containers fail to start. The
/// OCI runtime is runc unless `runtime` is None (Podman's own default,
/// crun where installed, which cannot run on hybrid cgroups whose v2 holds
/// a controller). Its temporary files and event log go to the tests' run
/// directory, and its image store (storage.conf) to the cache, so that it
/// leaves nothing in the machine's own.
fn containers_conf_text(run: &Path, runtime: Option<&str>) -> String {
    format!(
        "[containers]
default_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]

[engine]
{runtime}tmp_dir = \"{run}/podman-tmp\"
events_logger = \"file\"
events_logfile_path = \"{run}/podman-events.log\"
",
        runtime = runtime
            .map(|r| format!("runtime = \"{r}\"\n"))
            .unwrap_or_default(),
        run = run.display()
    )
}

fn storage_conf_text(cache: &Path, run: &Path) -> String {
    format!(
        "[storage]
driver = \"overlay\"
graphroot = \"{}\"
runroot = \"{}\"
",
        cache.join("podman").display(),
        run.join("podman-run").display()
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Docker,
    Podman,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Docker => "docker",
            Engine::Podman => "podman",
        }
    }

    /// The engine's CLI program.
    pub fn program(self) -> &'static str {
        match self {
            Engine::Docker => DOCKER,
            Engine::Podman => PODMAN,
        }
    }

    /// The environment the CLI needs in tests: give it to a command that
    /// runs the engine itself (`gpufrac run -- podman run …`).
    pub fn env(self) -> Vec<(&'static str, PathBuf)> {
        match self {
            Engine::Docker => docker_host()
                .map(|h| ("DOCKER_HOST", PathBuf::from(h)))
                .into_iter()
                .collect(),
            Engine::Podman => {
                let (conf, storage) = podman_conf();
                vec![
                    ("CONTAINERS_CONF", conf.to_path_buf()),
                    ("CONTAINERS_STORAGE_CONF", storage.to_path_buf()),
                ]
            }
        }
    }

    /// The engine's CLI, configured for tests.
    pub fn command(self) -> Command {
        let mut c = Command::new(self.program());
        c.envs(self.env());
        c
    }

    /// `run --rm --name NAME --network none`: how every test container
    /// starts, so that `Container` can remove it by name.
    pub fn run_args(name: &str) -> Vec<String> {
        ["run", "--rm", "--name", name, "--network", "none"]
            .map(str::to_owned)
            .to_vec()
    }

    /// Runs the CLI with `args`, panicking with its output if it fails.
    pub fn run_ok(self, args: &[&str]) -> String {
        let o = self
            .command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.name()));
        assert!(
            o.status.success(),
            "{} {args:?} failed: {}{}",
            self.name(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn quiet_ok(self, args: &[&str]) -> bool {
        self.command()
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Installs Debian packages so that every path in `need` exists; false
/// (after saying why) where this machine cannot.
fn install(what: &str, need: &[&[&str]], packages: &[&str]) -> bool {
    let present = || {
        need.iter()
            .all(|alts| alts.iter().any(|p| Path::new(p).exists()))
    };
    match apt_install(what, packages, present) {
        Ok(()) => true,
        Err(why) => cannot(what, &why),
    }
}

/// A short directory of the tests' own under the temp dir for sockets and
/// runtime state (a socket path must fit in 107 bytes, and containerd's
/// under dockerd's exec root deeper still), one per test cache so that two
/// checkouts' suites do not share a daemon.
///
/// It is removed once no test process uses it any more, however they end:
/// each holds a shared lock on its `users.lock` for as long as it lives
/// (the kernel drops it with the process), as does the shell that stops
/// the tests' dockerd until dockerd is gone; a janitor started with it
/// waits for an exclusive lock, then removes the directory.
fn run_dir() -> &'static Path {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        test_cache().hash(&mut h);
        let d = std::env::temp_dir().join(format!("gpufrac-test-{:08x}", h.finish() as u32));
        use_run_dir(&d);
        d
    })
}

/// Takes a shared lock on `d/users.lock`, making `d` if need be, and leaks
/// it (held until this process exits); then leaves a janitor that removes
/// `d` once nobody holds such a lock.
fn use_run_dir(d: &Path) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let lock = d.join("users.lock");
    loop {
        std::fs::create_dir_all(d).unwrap();
        // A janitor may remove the directory between these steps: then
        // the open fails, or the lock taken is on the file it unlinked.
        let Ok(f) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock)
        else {
            continue;
        };
        // SAFETY: a valid descriptor; flock blocks until the lock is ours.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) }, 0);
        let held = f.metadata().unwrap();
        let at_path = std::fs::metadata(&lock);
        if at_path.is_ok_and(|m| (m.dev(), m.ino()) == (held.dev(), held.ino())) {
            std::mem::forget(f);
            break;
        }
    }
    // The janitor removes the directory only if its lock file is still the
    // one it waited on: another janitor may have removed it, and a test
    // process started since made it anew.
    let script = r#"
exec 9<"$RUN/users.lock" || exit 0
flock -x 9
[ "$(stat -c %d:%i "$RUN/users.lock" 2>/dev/null)" = "$(stat -L -c %d:%i /proc/self/fd/9)" ] &&
    rm -rf --one-file-system "$RUN"
"#;
    let janitor = Command::new("/bin/sh")
        .args(["-c", script])
        .env("RUN", d)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // A ^C to cargo test must not reach it: it waits for the tests.
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start /bin/sh: {e}"));
    // Not waited for: it outlives this process on purpose.
    std::mem::forget(janitor);
}

/// Where the tests' own dockerd listens.
fn own_docker_socket() -> PathBuf {
    run_dir().join("docker.sock")
}

/// DOCKER_HOST for the engine's CLI: None for the machine's own daemon,
/// else the tests' dockerd. Decided once, by `ensure_docker`.
static DOCKER_HOST: OnceLock<Option<String>> = OnceLock::new();

fn docker_host() -> Option<String> {
    DOCKER_HOST.get().cloned().flatten()
}

/// `docker info` succeeds against the daemon at `host`.
fn docker_answers(host: &str) -> bool {
    Command::new(DOCKER)
        .env("DOCKER_HOST", host)
        .arg("info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Docker installed and a daemon answering. False, after a loud message,
/// where the machine cannot have it or GPUFRAC_TEST_ENGINES=0.
pub fn ensure_docker() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !engines_wanted("the Docker tests") {
            return false;
        }
        // Until DOCKER_HOST is set below, Engine::Docker's CLI talks to
        // the daemon the environment names (DOCKER_HOST, else the default
        // socket). A machine where someone runs Docker (and a user in the
        // docker group) needs nothing more, unless the image is still to be
        // built.
        let answers = || Engine::Docker.quiet_ok(&["info"]);
        if Path::new(DOCKER).exists()
            && answers()
            && (Path::new(MMDEBSTRAP).exists() || image_exists(Engine::Docker))
        {
            say("using the Docker daemon already running on this machine (left running)");
            DOCKER_HOST.set(None).unwrap();
            return true;
        }
        if !install(
            "the Docker tests",
            &[&[DOCKER], &[DOCKERD], RUNC, &[MMDEBSTRAP]],
            &["docker.io", "runc", "mmdebstrap"],
        ) {
            return false;
        }
        if answers() {
            DOCKER_HOST.set(None).unwrap();
            return true;
        }
        if !is_root() {
            return cannot(
                "the Docker tests",
                "dockerd is not running and we are not root",
            );
        }
        let host = docker_daemon();
        DOCKER_HOST.set(Some(host)).unwrap();
        true
    })
}

/// The tests' own dockerd, started unless one is running for this cache,
/// its DOCKER_HOST.
///
/// It is stopped when no test process needs it any more, however those
/// processes end (a panic, ^C, SIGKILL): each one holds a shared lock on
/// `dockerd-users.lock` for as long as it lives (the kernel drops it with the
/// process), and the shell that started dockerd waits for an exclusive lock
/// on that file, then stops dockerd, holding the lock until it is gone so
/// that a test process starting meanwhile waits and starts a new one.
fn docker_daemon() -> String {
    let run = run_dir();
    let socket = own_docker_socket();
    let host = format!("unix://{}", socket.display());
    let _start = MachineLock::at(&run.join("dockerd-start.lock"));
    // Held until this process exits: leaked on purpose.
    std::mem::forget(MachineLock::shared_at(&run.join("dockerd-users.lock")));
    if docker_answers(&host) {
        return host;
    }
    let data = test_cache().join("docker");
    let log_path = run.join("dockerd.log");
    say(&format!(
        "starting a dockerd of the tests' own on {} (data root {}, log {}); it stops \
         when the tests that use it have ended",
        socket.display(),
        data.display(),
        log_path.display()
    ));
    std::fs::create_dir_all(&data).unwrap();
    let log = std::fs::File::create(&log_path).unwrap();
    // No iptables and no bridge: CI machines often lack netfilter, and the
    // tests run with --network none. Its own containerd namespace, in case
    // the machine runs a containerd of its own that it would share.
    let script = r#"
"$DOCKERD" --iptables=false --bridge=none --data-root "$DATA" --exec-root "$RUN/docker-exec" \
    --pidfile "$RUN/docker.pid" -H "unix://$RUN/docker.sock" \
    --containerd-namespace gpufrac-test --containerd-plugins-namespace gpufrac-test-plugins &
d=$!
trap '' HUP INT
exec 8<"$RUN/users.lock"
flock -s 8
exec 9<"$RUN/dockerd-users.lock"
flock -x 9
kill -TERM "$d" 2>/dev/null
( sleep 60 & s=$!; trap 'kill $s; exit' TERM; wait $s; kill -KILL "$d" 2>/dev/null ) &
k=$!
if wait "$d"; then rm -rf --one-file-system "$RUN/docker-exec"; fi
kill "$k" 2>/dev/null
echo "gpufrac tests: dockerd stopped"
"#;
    let mut child = Command::new("/bin/sh")
        .args(["-c", script])
        .env("DOCKERD", DOCKERD)
        .env("DATA", &data)
        .env("RUN", run)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        // Its own process group: a ^C to cargo test must not reach it; it
        // stops dockerd itself once the test processes are gone.
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {DOCKERD}: {e}"));
    let t = Instant::now();
    while !docker_answers(&host) {
        let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "dockerd exited ({st}) before answering; its log:\n{}",
                log()
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "dockerd did not answer `docker info` within 90 s; its log:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Not waited for: it outlives this process on purpose.
    std::mem::forget(child);
    host
}

/// Podman installed (it has no daemon). False, after a loud message,
/// where the machine cannot have it or GPUFRAC_TEST_ENGINES=0.
pub fn ensure_podman() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !engines_wanted("the Podman tests") {
            return false;
        }
        if !is_root() {
            // Rootless Podman keeps images elsewhere, and the CDI test
            // writes /var/run/cdi.
            return cannot("the Podman tests", "they need root");
        }
        install(
            "the Podman tests",
            &[&[PODMAN], RUNC, &[MMDEBSTRAP]],
            &["podman", "runc", "mmdebstrap"],
        )
    })
}

/// Writes `text` to `name` in the tests' run directory whole, renamed into
/// place (the content never changes, so whichever process wrote last does
/// not matter).
fn write_run_file(name: &str, text: String) -> PathBuf {
    let run = run_dir();
    let p = run.join(name);
    let tmp = run.join(format!("{name}.{}", std::process::id()));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    p
}

/// The containers.conf and storage.conf Podman runs with in tests: one
/// pair for every test process.
pub fn podman_conf() -> (&'static Path, &'static Path) {
    static P: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    let (c, s) = P.get_or_init(|| {
        let run = run_dir();
        (
            write_run_file("containers.conf", containers_conf_text(run, Some("runc"))),
            write_run_file("storage.conf", storage_conf_text(&test_cache(), run)),
        )
    });
    (c, s)
}

/// `Engine::Podman.env()`, but leaving Podman its own default OCI runtime,
/// as a newcomer's Podman runs: crun where Debian's podman brought it.
pub fn podman_env_default_runtime() -> Vec<(&'static str, PathBuf)> {
    let conf = write_run_file(
        "containers-default-runtime.conf",
        containers_conf_text(run_dir(), None),
    );
    vec![
        ("CONTAINERS_CONF", conf),
        ("CONTAINERS_STORAGE_CONF", podman_conf().1.to_path_buf()),
    ]
}

/// The controllers cgroup v2 holds on a host with hybrid cgroups (v1
/// controllers, v2 mounted at /sys/fs/cgroup/unified), where crun refuses
/// to start a container ("cgroups in hybrid mode not supported") and runc
/// runs; None on any other host, unified or legacy, where both run.
pub fn crun_refuses_here() -> Option<String> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let fs_type = |p: &str| {
        let c = std::ffi::CString::new(p).unwrap();
        // SAFETY: a valid path and a zeroed statfs to fill.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
    };
    if fs_type("/sys/fs/cgroup") == Some(CGROUP2_SUPER_MAGIC)
        || fs_type("/sys/fs/cgroup/unified") != Some(CGROUP2_SUPER_MAGIC)
    {
        return None;
    }
    let held = std::fs::read_to_string("/sys/fs/cgroup/unified/cgroup.controllers").ok()?;
    let held = held.trim();
    (!held.is_empty()).then(|| held.to_owned())
}

/// The OCI runtime Podman runs with under `env` (`podman info`).
pub fn podman_runtime(env: &[(&str, PathBuf)]) -> String {
    let o = Command::new(PODMAN)
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .args(["info", "--format", "{{.Host.OCIRuntime.Name}}"])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {PODMAN}: {e}"));
    assert!(
        o.status.success(),
        "podman info failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

/// The sealed test image in `engine`'s store, built on first use on this
/// machine: `mmdebstrap --variant=essential bookworm` into a tarball kept
/// in the cache (so the other engine imports the same root without a
/// second download), then imported.
pub fn image(engine: Engine) -> &'static str {
    static DONE: [OnceLock<()>; 2] = [OnceLock::new(), OnceLock::new()];
    DONE[engine as usize].get_or_init(|| {
        if image_exists(engine) {
            return;
        }
        let _lock = MachineLock::at(&test_cache().join("image.lock"));
        if image_exists(engine) {
            return;
        }
        let tar = rootfs_tarball();
        say(&format!(
            "importing {} into {} as {IMAGE} (its store: {})",
            tar.display(),
            engine.name(),
            match engine {
                Engine::Docker if docker_host().is_some() => test_cache().join("docker"),
                Engine::Docker => PathBuf::from("the machine's Docker daemon"),
                Engine::Podman => test_cache().join("podman"),
            }
            .display()
        ));
        engine.run_ok(&["import", tar.to_str().unwrap(), IMAGE]);
    });
    IMAGE
}

fn image_exists(engine: Engine) -> bool {
    match engine {
        Engine::Docker => engine.quiet_ok(&["image", "inspect", IMAGE]),
        Engine::Podman => engine.quiet_ok(&["image", "exists", IMAGE]),
    }
}

/// Called with the image lock held.
fn rootfs_tarball() -> PathBuf {
    let dir = test_cache();
    let tar = dir.join("bookworm-essential.tar");
    if tar.exists() {
        return tar;
    }
    // Renamed once whole, so an interrupted build is not taken for one.
    let part = dir.join("bookworm-essential.part.tar");
    say(&format!(
        "downloading Debian bookworm's essential packages (about 140 MB) with mmdebstrap \
         into {}, the test image's root (once per test cache)",
        tar.display()
    ));
    let st = Command::new(MMDEBSTRAP)
        .args(["--variant=essential", "--format=tar", "bookworm"])
        .arg(&part)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .unwrap_or_else(|e| panic!("cannot run {MMDEBSTRAP}: {e}"));
    assert!(
        st.success(),
        "mmdebstrap failed ({st}); it needs a Debian mirror"
    );
    std::fs::rename(&part, &tar).unwrap();
    tar
}

/// `-v`/`-e` arguments: the simulated driver as libcuda.so.1 and
/// libnvidia-ml.so.1 in `SIM_LIB_DIR`, on the loader's path. (The host's
/// sim-driver directory holds absolute symlinks, which would dangle inside.)
pub fn sim_driver_args() -> Vec<String> {
    let sim = artifacts().dir.join("libgpufrac_sim.so");
    let mut v = Vec::new();
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        v.push("-v".into());
        v.push(format!("{}:{SIM_LIB_DIR}/{name}:ro", sim.display()));
    }
    v.push("-e".into());
    v.push(format!("LD_LIBRARY_PATH={SIM_LIB_DIR}"));
    v
}

/// `-v`/`-e` arguments that make the container's processes share the
/// simulated GPUs `devices` with the host's processes on state file
/// `state`: its directory is mounted at the same path.
pub fn sim_state_args(devices: &str, state: &Path) -> Vec<String> {
    let dir = state.parent().unwrap().display().to_string();
    vec![
        "-v".into(),
        format!("{dir}:{dir}"),
        "-e".into(),
        format!("GPUFRAC_SIM_DEVICES={devices}"),
        "-e".into(),
        format!("GPUFRAC_SIM_STATE={}", state.display()),
    ]
}

/// `-v` arguments for the test programs, at `PROBE` and `LOADGEN`.
pub fn program_args() -> Vec<String> {
    let a = artifacts();
    vec![
        "-v".into(),
        format!("{}:{PROBE}:ro", a.probe.display()),
        "-v".into(),
        format!("{}:{LOADGEN}:ro", a.loadgen.display()),
    ]
}

/// Everything a container needs to run the test programs against `b`'s
/// simulated GPUs: driver, shared state and programs.
pub fn sim_args(b: &Broker) -> Vec<String> {
    let mut v = sim_driver_args();
    v.extend(sim_state_args(&b.devices, &b.state));
    v.extend(program_args());
    v
}

/// `gpufrac docker-args ARGS`, one argument per element.
pub fn docker_args(args: &[&str]) -> Vec<String> {
    let o = Command::new(&artifacts().gpufrac)
        .arg("docker-args")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "gpufrac docker-args {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A container run attached (`ENGINE run --rm --name NAME --network none
/// ARGS…`), removed with `rm -f` when dropped, however the test ends. Its
/// stdout arrives line by line.
pub struct Container {
    pub engine: Engine,
    pub name: String,
    child: Child,
    lines: Receiver<String>,
    /// Every stdout line seen so far.
    pub seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    stderr_thread: Option<std::thread::JoinHandle<()>>,
}

/// A container name no other test (of any process) uses.
pub fn container_name() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "gpufrac-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl Container {
    /// `ENGINE run --rm --name NAME --network none ARGS…`; `args`: run
    /// options, the image, then the command.
    pub fn run<S: AsRef<str>>(engine: Engine, args: &[S]) -> Container {
        let name = container_name();
        let mut cmd = engine.command();
        cmd.args(Engine::run_args(&name))
            .args(args.iter().map(AsRef::as_ref));
        Container::attach(engine, name, cmd)
    }

    /// Starts `cmd`, which runs container `name` attached, however it does
    /// (`gpufrac run … -- docker run` + `Engine::run_args(name)` + …), and
    /// takes charge of its output and of removing the container.
    pub fn attach(engine: Engine, name: String, mut cmd: Command) -> Container {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
        let (tx, lines) = channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        let stderr_thread = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Container {
            engine,
            name,
            child,
            lines,
            seen: Vec::new(),
            stderr,
            stderr_thread: Some(stderr_thread),
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The pid of the command that runs the container (the engine's client,
    /// or the `gpufrac run` around it).
    pub fn client_pid(&self) -> u32 {
        self.child.id()
    }

    fn context(&self) -> String {
        format!(
            "{} container {}\nstdout:\n{}\nstderr:\n{}",
            self.engine.name(),
            self.name,
            self.seen.join("\n"),
            self.stderr()
        )
    }

    /// The key=value pairs of the next stdout line whose first word is
    /// `step` (lines before it are kept in `seen`), waiting up to `secs`.
    pub fn wait_line(&mut self, step: &str, secs: u64) -> HashMap<String, String> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.split_whitespace().next() == Some(step) {
                        return l
                            .split_whitespace()
                            .skip(1)
                            .filter_map(|kv| kv.split_once('='))
                            .map(|(k, v)| (k.to_owned(), v.to_owned()))
                            .collect();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("no {step:?} line within {secs} s from {}", self.context())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = self.child.wait();
                    // All of stderr for the message.
                    if let Some(t) = self.stderr_thread.take() {
                        let _ = t.join();
                    }
                    panic!(
                        "the container ended without a {step:?} line: {}",
                        self.context()
                    )
                }
            }
        }
    }

    /// Waits up to `secs` for the container to end; its status and every
    /// stdout line.
    pub fn finish(mut self, secs: u64) -> (ExitStatus, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("still running after {secs} s: {}", self.context())
                }
            }
        }
        let st = self.child.wait().unwrap();
        if let Some(t) = self.stderr_thread.take() {
            let _ = t.join();
        }
        (st, std::mem::take(&mut self.seen))
    }

    /// The host pid of the container's first process (its entrypoint, or
    /// what that exec'd).
    pub fn host_pid(&self) -> u32 {
        let t = Instant::now();
        loop {
            let out = self
                .engine
                .command()
                .args(["inspect", "-f", "{{.State.Pid}}", &self.name])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            if let Ok(pid) = String::from_utf8_lossy(&out.stdout).trim().parse::<u32>()
                && pid != 0
            {
                return pid;
            }
            // The client may not have created the container yet.
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{} inspect {} gives no pid: {}",
                self.engine.name(),
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The key=value pairs of the `n`-th line of `lines` whose first word is
/// `step`.
pub fn step(lines: &[String], name: &str, n: usize) -> HashMap<String, String> {
    let l = lines
        .iter()
        .filter(|l| l.split_whitespace().next() == Some(name))
        .nth(n)
        .unwrap_or_else(|| panic!("no line #{n} for {name:?} in:\n{}", lines.join("\n")));
    l.split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

impl Drop for Container {
    fn drop(&mut self) {
        // Killing the client would leave the container running. Podman
        // would first send SIGTERM and wait 10 s, and a program running as
        // the container's pid 1 ignores a signal it has no handler for.
        let mut rm = vec!["rm", "-f", self.name.as_str()];
        if self.engine == Engine::Podman {
            rm.extend(["--time", "0"]);
        }
        let _ = self
            .engine
            .command()
            .args(&rm)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
