//! Shared test harness: builds the shim, the simulated driver, the example
//! programs and the gpufrac binary once per test binary, and runs programs
//! under LD_PRELOAD against the simulated driver.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

pub struct Artifacts {
    /// target/<profile>
    pub dir: PathBuf,
    pub shim: PathBuf,
    /// Directory holding the simulated driver as libcuda.so.1, libcuda.so
    /// and libnvidia-ml.so.1.
    pub simdir: PathBuf,
    pub probe: PathBuf,
    /// examples/loadgen: batch and interactive GPU load.
    pub loadgen: PathBuf,
    pub gpufrac: PathBuf,
    pub fixtures: PathBuf,
}

pub fn artifacts() -> &'static Artifacts {
    // A failed build is kept, not retried: OnceLock retries an initialiser
    // that panicked, so every test of the binary would rerun cargo and
    // print the same compile errors again.
    static A: OnceLock<Result<Artifacts, String>> = OnceLock::new();
    let mut built_here = None;
    let a = A.get_or_init(|| {
        build_artifacts().map_err(|output| {
            built_here = Some(output);
            // libtest names each test's thread after the test.
            std::thread::current()
                .name()
                .unwrap_or("the first test")
                .to_string()
        })
    });
    match (a, built_here) {
        (Ok(a), _) => a,
        (Err(_), Some(output)) => panic!("{output}"),
        (Err(test), None) => panic!(
            "the test artifacts did not build; cargo's output is under \
             `---- {test} stdout ----`"
        ),
    }
}

/// Builds the artifacts, or returns the failed cargo command and its output.
fn build_artifacts() -> Result<Artifacts, String> {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>-<hash>
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let release = dir.file_name().is_some_and(|n| n == "release");
    // Two invocations: target filters such as --bins apply to every
    // package named, and the shim and the simulated driver are libraries.
    // The shim is built with gpufrac, as ./demo.sh and every release build
    // it (gpufrac-common's features are those of all the packages named).
    for args in [
        &["-p", "gpufrac", "-p", "gpufrac-shim", "-p", "gpufrac-sim"][..],
        &["-p", "gpufrac", "--bins", "--examples"][..],
    ] {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--quiet"])
            .args(args);
        // What cargo set for this test process, not for builds: a build
        // script that reruns when one of them changes (ring's watches
        // OUT_DIR, CARGO_MANIFEST_DIR and CARGO_PKG_*) would otherwise be
        // run again, and its dependents rebuilt, by every other build of
        // the tree.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            let set_for_tests = [
                "CARGO_MANIFEST_",
                "CARGO_PKG_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
            ]
            .iter()
            .any(|p| k.starts_with(p))
                || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"]
                    .contains(&k.as_ref());
            if set_for_tests {
                cmd.env_remove(k.as_ref());
            }
        }
        if release {
            cmd.arg("--release");
        }
        let o = cmd
            .output()
            .expect("running cargo build for the test artifacts");
        if !o.status.success() {
            return Err(format!(
                "building the test artifacts failed: cargo build {args:?}\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        // Warnings go straight to the process's stderr, past libtest's
        // capture: the shim is built only here, so nothing else shows them.
        use std::io::Write;
        let _ = std::io::stderr().write_all(&o.stderr);
    }
    let simdir = dir.join("sim-driver");
    std::fs::create_dir_all(&simdir).unwrap();
    for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"] {
        let link = simdir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(dir.join("libgpufrac_sim.so"), &link).unwrap();
    }
    Ok(Artifacts {
        shim: dir.join("libgpufrac.so"),
        probe: dir.join("examples/probe"),
        loadgen: dir.join("examples/loadgen"),
        gpufrac: dir.join("gpufrac"),
        fixtures: PathBuf::from(env!("GPUFRAC_FIXTURES")),
        simdir,
        dir,
    })
}

/// A command that runs against the simulated driver with `devices` (e.g.
/// "16G,8G"), under the shim unless `shim` is false. The environment is
/// cleared of anything gpufrac reads so the host cannot leak in.
pub fn sim_command(program: impl AsRef<Path>, devices: &str, shim: bool) -> Command {
    let a = artifacts();
    let mut cmd = Command::new(program.as_ref());
    scrub_env(&mut cmd);
    cmd.env("LD_LIBRARY_PATH", &a.simdir)
        .env("GPUFRAC_SIM_DEVICES", devices)
        .env("GPUFRAC_BROKER", "off")
        .stdin(Stdio::null());
    if shim {
        cmd.env("LD_PRELOAD", &a.shim);
    }
    cmd
}

/// Removes from `cmd`'s environment everything of this process's that
/// gpufrac, the shim or the simulated driver reads (`GPU_*`, `GPUFRAC_*`,
/// `CUDA_VISIBLE_DEVICES`) and what would load a library in their place
/// (`LD_PRELOAD`, `LD_LIBRARY_PATH`), so that the host cannot leak in.
pub fn scrub_env(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_")
            || k.starts_with("GPUFRAC_")
            || k == "LD_PRELOAD"
            || k == "LD_LIBRARY_PATH"
            || k == "CUDA_VISIBLE_DEVICES"
        {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// `gpufrac run ARGS` on the simulated `devices`, with no broker to talk to.
pub fn run_alone(devices: &str, args: &[&str]) -> Command {
    let mut cmd = sim_command(&artifacts().gpufrac, devices, false);
    cmd.env_remove("GPUFRAC_BROKER")
        .args(["run", "--socket", "/nonexistent/gpufrac.sock"])
        .args(args);
    cmd
}

/// Runs the probe with `env` and `args`, returning its output.
pub fn probe(devices: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = sim_command(&artifacts().probe, devices, true);
    cmd.envs(env.iter().copied()).args(args);
    cmd.output().expect("running probe")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The key=value pairs of the `n`-th (0-based) output line starting with
/// `step`.
pub fn line(o: &Output, step: &str, n: usize) -> HashMap<String, String> {
    let out = stdout(o);
    let l = out
        .lines()
        .filter(|l| l.split_whitespace().next() == Some(step))
        .nth(n)
        .unwrap_or_else(|| {
            panic!(
                "no line #{n} for step {step:?} in output:\n{out}\nstderr:\n{}",
                stderr(o)
            )
        });
    l.split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn num(m: &HashMap<String, String>, key: &str) -> u64 {
    m.get(key)
        .unwrap_or_else(|| panic!("no {key} in {m:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} not a number in {m:?}"))
}

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// CLOCK_MONOTONIC in ns: the clock the probe's `spin` windows use, shared
/// by every process on the machine.
pub use gpufrac_common::clock::mono_ns;

/// What a shim sends to register `command` at `priority`: one 16 GiB
/// device, `uuid`, at ordinal 0, no cap, share or limit of its own.
pub fn register_msg(
    uuid: [u8; 16],
    command: &str,
    priority: gpufrac_common::config::Priority,
) -> gpufrac_common::wire::ClientMsg {
    gpufrac_common::wire::ClientMsg::Register {
        command: command.into(),
        devices: vec![gpufrac_common::wire::DeviceReg {
            uuid,
            ordinal: 0,
            mem_cap: 0,
            mem_total: 16 << 30,
        }],
        share: None,
        limit: None,
        priority,
    }
}

/// A TCP port on 127.0.0.1 nobody listens on now (bound, read, let go).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a free port")
        .port()
}

/// The uid that attacks and victims of another user run as.
pub const NOBODY: u32 = 65534;

/// Makes `cmd` run as `uid` (groups dropped), set in the child before exec.
pub fn as_user(cmd: &mut Command, uid: u32) -> &mut Command {
    as_user_in_group(cmd, uid, uid)
}

/// Makes `cmd` run as `uid` with `gid` its only group (a user in the
/// broker socket's group, say).
pub fn as_user_in_group(cmd: &mut Command, uid: u32, gid: u32) -> &mut Command {
    // SAFETY: setgroups/setgid/setuid in the child before exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Root, and `nobody` can reach the test programs, the shim and the
/// simulated driver (not so for a checkout under /root, say): else says
/// why the calling test is skipped, and false.
pub fn can_be_nobody() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a process as another user");
        return false;
    }
    let a = artifacts();
    let ok = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg("test -x \"$0\" && test -r \"$1\" && test -r \"$2/libcuda.so.1\"")
        .arg(&a.probe)
        .arg(&a.shim)
        .arg(&a.simdir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: user nobody cannot reach the test programs in this checkout");
    }
    ok
}

/// A stand-in `nvidia-cuda-mps-control` (MPS itself needs a GPU; gpu/
/// checks the real one): `-d` starts a daemon that sleeps, and writes its
/// pid in the pipe directory; on stdin, `quit` stops it. What it is called
/// with and told goes to `$GPUFRAC_MPS_STANDIN_LOG`.
pub const MPS_STANDIN: &str = r#"#!/bin/sh
log="$GPUFRAC_MPS_STANDIN_LOG"
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY logdir=$CUDA_MPS_LOG_DIRECTORY cvd=${CUDA_VISIBLE_DEVICES-unset}" >> "$log"
if [ "$1" = "-d" ]; then
  if [ -n "$GPUFRAC_MPS_STANDIN_FAIL" ]; then
    echo "MPS is not supported on this GPU" >&2
    exit 1
  fi
  sleep 1000000 </dev/null >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  exit 0
fi
while read cmd; do
  echo "cmd $cmd" >> "$log"
  if [ "$cmd" = quit ]; then
    kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
  fi
done
"#;

/// Puts the stand-in MPS control daemon in `dir/bin`; returns a PATH that
/// finds it first.
pub fn mps_standin(dir: &Path) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let standin = bin.join("nvidia-cuda-mps-control");
    std::fs::write(&standin, MPS_STANDIN).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&standin, PermissionsExt::from_mode(0o755)).unwrap();
    format!("{}:/usr/bin:/bin", bin.display())
}

/// Resident memory of `pid`, KiB.
pub fn rss_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Waits for `cond`, checking every few ms, up to `secs`.
pub fn wait_until(secs: f64, what: &str, mut cond: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !cond() {
        assert!(
            t.elapsed().as_secs_f64() < secs,
            "timed out after {secs}s waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Copies the executable `from` to `to` (mode 755) and returns once the
/// copy runs. A test thread that forks while the copy is open for writing
/// gives its child that descriptor until the child's exec, and until then
/// running the copy fails with "Text file busy" (seen in CI: hints.rs's
/// tests copy the binary while others spawn processes).
pub fn copy_executable(from: &Path, to: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(from, to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
    wait_until(
        10.0,
        "the copied executable to stop being busy",
        || match Command::new(to)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
        {
            Err(e) => e.raw_os_error() != Some(libc::ETXTBSY),
            Ok(_) => true,
        },
    );
}

/// A scratch directory under the temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        // Under the temp dir, not target/: a Unix socket path must fit in
        // 107 bytes, however deep the checkout is.
        let p = std::env::temp_dir().join(format!(
            "gpufrac-{name}-{}-{}",
            std::process::id(),
            mono_ns() % 1_000_000_000_000
        ));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `gpufrac broker` on a private socket, seeing the simulated
/// devices. Killed on drop.
pub struct Broker {
    pub child: std::process::Child,
    pub socket: PathBuf,
    pub devices: String,
    pub state: PathBuf,
    pub args: Vec<String>,
    _dir: Option<Scratch>,
}

impl Broker {
    pub fn start(devices: &str, args: &[&str]) -> Broker {
        Broker::start_env(devices, args, &[])
    }

    /// A broker whose own environment has `env` too (the simulated
    /// driver's settings, as the broker's NVML reads them).
    pub fn start_env(devices: &str, args: &[&str], env: &[(&str, &str)]) -> Broker {
        let dir = Scratch::new("broker");
        let socket = dir.0.join("broker.sock");
        let state = dir.0.join("sim-state");
        let mut child = spawn_broker_cmd(&socket, devices, &state, args);
        child.envs(env.iter().copied());
        let mut b = Broker {
            child: child.spawn().expect("starting gpufrac broker"),
            socket,
            devices: devices.into(),
            state,
            args: args.iter().map(|s| s.to_string()).collect(),
            _dir: Some(dir),
        };
        b.wait_ready();
        b
    }

    /// A broker other users can talk to: its socket's group is nogroup,
    /// its directory traversable, the simulated GPU's state shared.
    pub fn start_open(devices: &str, args: &[&str]) -> Broker {
        use std::os::unix::fs::PermissionsExt;
        let mut all = vec!["--group", "nogroup"];
        all.extend_from_slice(args);
        let b = Broker::start(devices, &all);
        std::fs::set_permissions(b.socket.parent().unwrap(), PermissionsExt::from_mode(0o755))
            .unwrap();
        std::fs::set_permissions(&b.state, PermissionsExt::from_mode(0o666)).unwrap();
        b
    }

    pub fn wait_ready(&mut self) {
        let sock = self.socket.clone();
        let child = &mut self.child;
        wait_until(20.0, "the broker socket", || {
            if let Ok(Some(st)) = child.try_wait() {
                let log = std::fs::read_to_string(log_file(&sock)).unwrap_or_default();
                panic!("broker exited early ({st}); its log:\n{log}");
            }
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        });
    }

    /// Restarts after a kill, same socket and devices.
    pub fn restart(&mut self) {
        let args: Vec<&str> = self.args.iter().map(|s| s.as_str()).collect();
        self.child = spawn_broker(&self.socket, &self.devices, &self.state, &args);
        self.wait_ready();
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A command for a program outside the shim on this broker's simulated
    /// devices: a process only the driver knows.
    pub fn outsider(&self, program: impl AsRef<Path>) -> Command {
        let mut cmd = sim_command(program, &self.devices, false);
        cmd.env("GPUFRAC_SIM_STATE", &self.state);
        cmd
    }

    /// A command for a program under the shim, wired to this broker and
    /// sharing its simulated devices (one execution engine per device).
    pub fn client(&self, program: impl AsRef<Path>) -> Command {
        let mut cmd = sim_command(program, &self.devices, true);
        cmd.env("GPUFRAC_SOCKET", &self.socket)
            .env("GPUFRAC_BROKER", "optional")
            .env("GPUFRAC_SIM_STATE", &self.state);
        cmd
    }

    pub fn status(&self) -> serde_json::Value {
        let mut c = RawClient::connect(&self.socket);
        c.hello();
        c.send(&gpufrac_common::wire::ClientMsg::Status { from: 0 });
        match c.recv() {
            Some(gpufrac_common::wire::ServerMsg::StatusReply { json }) => {
                serde_json::from_str(&json).unwrap()
            }
            other => panic!("expected a status reply, got {other:?}"),
        }
    }

    /// `gpufrac run` against this broker and its simulated devices.
    pub fn run(&self, args: &[&str]) -> Command {
        self.run_with(&artifacts().gpufrac, args)
    }

    /// `PROGRAM run` (another gpufrac binary: an installed one, the
    /// wheel's) against this broker and its simulated devices.
    pub fn run_with(&self, program: impl AsRef<Path>, args: &[&str]) -> Command {
        let mut cmd = sim_command(program, &self.devices, false);
        cmd.env_remove("GPUFRAC_BROKER")
            .env("GPUFRAC_SIM_STATE", &self.state)
            .arg("run")
            .arg("--socket")
            .arg(&self.socket)
            .args(args);
        cmd
    }

    /// The lease entries of its status.
    pub fn leases(&self) -> Vec<serde_json::Value> {
        self.status()["leases"].as_array().unwrap().clone()
    }

    /// Its status entry for process `pid`, on whichever GPU, once the
    /// process has registered.
    pub fn process(&self, pid: u32) -> Option<serde_json::Value> {
        self.status()["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["processes"].as_array().unwrap().iter())
            .find(|p| p["pid"] == pid)
            .cloned()
    }

    /// The first GPU's UUID as the wire carries it.
    pub fn first_gpu_uuid(&self) -> [u8; 16] {
        first_gpu_uuid_in(&self.status())
    }

    /// The state file (unless the test named its own `--state-dir`).
    pub fn state_file(&self) -> PathBuf {
        state_dir(&self.socket).join("state")
    }

    /// pids registered on any GPU.
    pub fn registered(&self) -> Vec<u64> {
        let s = self.status();
        let mut v: Vec<u64> = s["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| {
                g["processes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|p| p["pid"].as_u64().unwrap())
            })
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// Where `Broker` keeps a broker's private files: beside its socket, in
/// the scratch directory only root can write.
fn state_dir(socket: &Path) -> PathBuf {
    socket.with_file_name("state")
}

/// A daemon's stderr (its log) into `path`, appended, rather than the test
/// run's terminal, where the warnings a test provokes on purpose read as
/// faults.
pub fn log_to<'a>(cmd: &'a mut Command, path: &Path) -> &'a mut Command {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot create the log {}: {e}", path.display()));
    cmd.stderr(f)
}

/// Where `Broker` keeps a broker's log: beside its socket.
fn log_file(socket: &Path) -> PathBuf {
    socket.with_file_name("broker.log")
}

/// The broker's log goes to a file of its own (a restart's after the
/// last), not to the test run's terminal: many tests provoke the warnings
/// they check for, and they read as faults there. A test that fails shows
/// its end (`Broker`'s drop).
fn spawn_broker(socket: &Path, devices: &str, state: &Path, args: &[&str]) -> std::process::Child {
    spawn_broker_cmd(socket, devices, state, args)
        .spawn()
        .expect("starting gpufrac broker")
}

fn spawn_broker_cmd(socket: &Path, devices: &str, state: &Path, args: &[&str]) -> Command {
    let mut cmd = sim_command(&artifacts().gpufrac, devices, false);
    cmd.arg("broker").arg("--socket").arg(socket).args(args);
    if !args.contains(&"--state-dir") {
        // Its private files in its scratch directory, not under /run.
        cmd.arg("--state-dir").arg(state_dir(socket));
    }
    log_to(&mut cmd, &log_file(socket));
    cmd.env("GPUFRAC_SIM_STATE", state)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null());
    cmd
}

impl Broker {
    /// What it has logged so far (at info).
    pub fn log(&self) -> String {
        std::fs::read_to_string(log_file(&self.socket)).unwrap_or_default()
    }

    /// `gpufrac run --gpu-memory MEM` of a command that holds its lease
    /// until a line comes on its stdin ([`release_holding`]); returned once
    /// the command has started.
    pub fn holding(&self, mem: &str) -> std::process::Child {
        start_holding(self.run(&["--gpu-memory", mem, "--"]))
    }
}

/// `run`, a `gpufrac run … --` command line, with a command that holds
/// its lease until a line comes on its stdin ([`release_holding`]);
/// returned once the command has started.
pub fn start_holding(mut run: Command) -> std::process::Child {
    let mut c = run
        .args(["sh", "-c", "echo started; read x"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(read_line(&mut c), "started");
    c
}

/// Lets a [`Broker::holding`] job's command end, and returns its run's
/// stderr.
pub fn release_holding(mut c: std::process::Child) -> String {
    use std::io::Write;
    c.stdin.take().unwrap().write_all(b"done\n").unwrap();
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stderr(&o)
}

impl Drop for Broker {
    fn drop(&mut self) {
        stop(&mut self.child);
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "the broker's log ({}), its last {} lines:\n{}",
                log_file(&self.socket).display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// The first GPU's UUID in a status document, as the wire carries it.
pub fn first_gpu_uuid_in(status: &serde_json::Value) -> [u8; 16] {
    let text = status["gpus"][0]["uuid"].as_str().expect("a GPU in status");
    gpufrac_common::wire::parse_uuid(text).expect("a GPU-… UUID")
}

/// A protocol-level client for poking the broker directly.
pub struct RawClient {
    pub s: std::os::unix::net::UnixStream,
    buf: Vec<u8>,
}

impl RawClient {
    pub fn connect(path: &Path) -> RawClient {
        let s = std::os::unix::net::UnixStream::connect(path).expect("connect to broker");
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        RawClient { s, buf: Vec::new() }
    }

    /// Says hello as a CLI client (`gpufrac status`, `gpufrac run`).
    pub fn hello(&mut self) {
        self.hello_as(gpufrac_common::wire::Role::Cli);
    }

    pub fn hello_as(&mut self, role: gpufrac_common::wire::Role) {
        self.send(&gpufrac_common::wire::ClientMsg::hello(
            std::process::id(),
            role,
        ));
        match self.recv() {
            Some(gpufrac_common::wire::ServerMsg::HelloOk { .. }) => {}
            other => panic!("expected HelloOk, got {other:?}"),
        }
    }

    pub fn send(&mut self, m: &gpufrac_common::wire::ClientMsg) {
        use std::io::Write;
        let mut b = Vec::new();
        gpufrac_common::wire::encode_client(m, &mut b);
        self.s.write_all(&b).unwrap();
    }

    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.s.write_all(bytes)
    }

    /// Next message, or None when the broker closed the connection.
    pub fn recv(&mut self) -> Option<gpufrac_common::wire::ServerMsg> {
        use std::io::Read;
        loop {
            match gpufrac_common::wire::decode_server(&self.buf) {
                Ok((m, n)) => {
                    self.buf.drain(..n);
                    return Some(m);
                }
                Err(gpufrac_common::wire::DecodeError::Incomplete) => {}
                Err(e) => panic!("broker sent a bad frame: {e}"),
            }
            let mut tmp = [0u8; 65536];
            match self.s.read(&mut tmp) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
            }
        }
    }
}

/// The whole status as `gpufrac status --json` prints it (all pages).
pub fn status_cli(socket: &Path) -> serde_json::Value {
    try_status_cli(socket).unwrap_or_else(|e| panic!("status failed: {e}"))
}

/// `gpufrac status --json`, or why it failed: for wait loops, which try
/// again (a broker busy with what the test just did may not answer at
/// once) and say the last failure if the wait runs out.
pub fn try_status_cli(socket: &Path) -> Result<serde_json::Value, String> {
    let o = Command::new(&artifacts().gpufrac)
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .map_err(|e| format!("cannot run gpufrac status: {e}"))?;
    if !o.status.success() {
        return Err(stderr(&o));
    }
    serde_json::from_slice(&o.stdout).map_err(|e| format!("status --json is not JSON: {e}"))
}

/// Tests that measure GPU time, or flood the broker, take this first: one
/// at a time within a test binary.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The probe's arguments for 1 ms kernels, two in flight, from START to END
/// (CLOCK_MONOTONIC ns).
pub fn spin_args(start: u64, end: u64) -> Vec<String> {
    let ms: u64 = 1_000_000;
    vec![
        "ctx".into(),
        "spin".into(),
        start.to_string(),
        end.to_string(),
        ms.to_string(),
        "2".into(),
    ]
}

/// The child's next line of output, without its newline. Unbuffered, so
/// that the rest stays in the pipe for the next call.
pub fn read_line(c: &mut std::process::Child) -> String {
    use std::io::Read;
    let out = c.stdout.as_mut().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

/// A child process stopped however the test ends: asked to stop
/// (SIGTERM), so that a broker cleans up after itself (its state
/// directory, which a kill left behind under /run/gpufrac/state, a dozen
/// per run of the suite), and killed if it has not exited within 2 s.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        stop(&mut self.0);
    }
}

/// A child killed if the test ends before it is taken.
pub struct Reap(pub Option<std::process::Child>);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Stops `child`: SIGTERM, then SIGKILL if it has not exited within 2 s;
/// reaped either way.
pub fn stop(child: &mut std::process::Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(2) {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// An exclusive lock, machine-wide, held until dropped: test binaries (and
/// their threads, and a second `cargo test` beside this one) share dpkg,
/// daemons, images and installers.
pub struct MachineLock(std::fs::File, Option<PathBuf>);

impl MachineLock {
    /// The lock called `name`: a file in the temp dir, which its holder
    /// removes when it lets go, so the suite leaves none behind. Whoever
    /// waited on the file removed meanwhile takes the lock on a new one
    /// (`flock` holds an open file, not a name).
    pub fn take(name: &str) -> MachineLock {
        let path = std::env::temp_dir().join(format!("gpufrac-test-{name}.lock"));
        loop {
            use std::os::unix::fs::MetadataExt;
            let mut lock = Self::at(&path);
            let held = lock.0.metadata().unwrap();
            if std::fs::metadata(&path)
                .is_ok_and(|m| (m.dev(), m.ino()) == (held.dev(), held.ino()))
            {
                lock.1 = Some(path);
                return lock;
            }
        }
    }

    /// The lock on the file at `path`.
    pub fn at(path: &Path) -> MachineLock {
        Self::flock(path, libc::LOCK_EX)
    }

    /// A shared lock on the file at `path`: many holders at once, none
    /// while someone holds it exclusively.
    pub fn shared_at(path: &Path) -> MachineLock {
        Self::flock(path, libc::LOCK_SH)
    }

    fn flock(path: &Path, op: libc::c_int) -> MachineLock {
        use std::os::fd::AsRawFd;
        // Opened close-on-exec (std's default): no child inherits the lock.
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
        // SAFETY: a valid descriptor; flock blocks until the lock is ours.
        let rc = unsafe { libc::flock(f.as_raw_fd(), op) };
        assert_eq!(rc, 0, "flock {}", path.display());
        MachineLock(f, None)
    }
}

impl Drop for MachineLock {
    fn drop(&mut self) {
        // Removed while still held, so no one takes a lock on it after.
        if let Some(path) = self.1.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Straight to the process's stderr: libtest shows a passing test's
/// `eprintln!` to nobody, and what the suite installs, starts or skips must
/// be seen.
pub fn say(msg: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("gpufrac tests: {msg}\n").as_bytes());
}

/// What `GPUFRAC_TEST_ENGINES` asks of the engine tests (Docker, Podman,
/// Slurm, the release built with zig): the tests that install packages,
/// download into the cache and start daemons (docs/testing.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineTests {
    /// `0`: skipped, each saying so.
    Skip,
    /// Unset: run where the machine can have the engines (root, apt-get),
    /// skipped loudly where it cannot.
    Auto,
    /// `1`: run, and a machine that cannot have them fails (CI).
    Required,
}

pub fn engine_tests() -> EngineTests {
    match std::env::var("GPUFRAC_TEST_ENGINES").as_deref() {
        Err(_) | Ok("") => EngineTests::Auto,
        Ok("0") => EngineTests::Skip,
        Ok("1") => EngineTests::Required,
        Ok(other) => panic!(
            "GPUFRAC_TEST_ENGINES={other:?}: expected 0 (skip the engine tests) or 1 \
             (run them, failing where they cannot run); unset runs them where possible"
        ),
    }
}

pub fn skip_banner(what: &str, why: &str) {
    say(&format!(
        "\n################################################################\n\
         SKIPPED: {what}: {why}\n\
         ################################################################"
    ));
}

/// False, after saying so, when `GPUFRAC_TEST_ENGINES=0` skips the engine
/// test `what`.
pub fn engines_wanted(what: &str) -> bool {
    if engine_tests() == EngineTests::Skip {
        skip_banner(what, "GPUFRAC_TEST_ENGINES=0");
        return false;
    }
    true
}

/// The engine test `what` cannot run on this machine, for `why`: skipped
/// loudly, or a failure under `GPUFRAC_TEST_ENGINES=1`, where a skip would
/// hide a broken integration. Returns false, for `if !…{ return }`.
pub fn cannot(what: &str, why: &str) -> bool {
    if engine_tests() == EngineTests::Required {
        panic!("{what} cannot run: {why} (GPUFRAC_TEST_ENGINES=1, so this is a failure)");
    }
    skip_banner(what, why);
    false
}

/// The workspace's target directory: the test executable is
/// target/<profile>/deps/<test>-<hash>.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors()
        .nth(3)
        .expect("the test executable lies in target/<profile>/deps")
        .to_path_buf()
}

/// The one directory the test suite downloads into and keeps state in
/// between runs: `GPUFRAC_TEST_CACHE`, else target/test-cache.
pub fn test_cache() -> PathBuf {
    let dir = match std::env::var_os("GPUFRAC_TEST_CACHE") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => target_dir().join("test-cache"),
    };
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create the test cache {}: {e}", dir.display()));
    dir
}

/// Installs Debian `packages` with apt-get, one installer at a time on the
/// machine, unless `present()` already holds (checked again once the lock
/// is ours: another test may have installed them meanwhile). Says first
/// what it installs and for which tests (`what`). Err says why this
/// machine cannot (not root, no apt-get); on a machine that can, a failed
/// installation panics with what apt-get said, since a skip there would
/// hide it.
pub fn apt_install(
    what: &str,
    packages: &[&str],
    present: impl Fn() -> bool,
) -> Result<(), String> {
    if present() {
        return Ok(());
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!(
            "{} not installed, and installing it needs root",
            packages.join(" ")
        ));
    }
    if !Path::new("/usr/bin/apt-get").exists() {
        return Err(format!(
            "{} not installed, and there is no apt-get",
            packages.join(" ")
        ));
    }
    let _lock = MachineLock::take("apt");
    if present() {
        return Ok(());
    }
    say(&format!(
        "installing the Debian packages {} system-wide with apt-get, for {what} \
         (they stay installed; GPUFRAC_TEST_ENGINES=0 skips these tests)",
        packages.join(" ")
    ));
    let units = services::Units::before_install();
    let apt = |args: &[&str]| {
        let o = Command::new("/usr/bin/apt-get")
            .args(["-o", "DPkg::Lock::Timeout=600", "-qq"])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run apt-get: {e}"));
        assert!(
            o.status.success(),
            "apt-get {args:?} failed:\n{}{}",
            stdout(&o),
            stderr(&o)
        );
    };
    // A fresh machine has no package lists yet.
    apt(&["update"]);
    let mut args = vec!["install", "-y"];
    args.extend_from_slice(packages);
    apt(&args);
    units.stop_the_ones_started();
    assert!(
        present(),
        "installed {packages:?}, but what they provide is still missing"
    );
    Ok(())
}

/// A Python venv called `name` in the test cache with `packages` from PyPI,
/// for the tests of `what`: made on first use, one maker at a time on the
/// machine, and kept. A stamp file in it lists what was installed; a venv
/// without it, or with other packages, is made again. Says first what it
/// downloads (`size`, such as "about 6 MB"). Where `python3 -m venv` fails
/// (Debian keeps venv, with ensurepip, in its own package) python3-venv is
/// installed with apt-get first. None, said loudly, when
/// `GPUFRAC_TEST_ENGINES=0` or no venv can be made here (a failed pip
/// install among them: a failure under `GPUFRAC_TEST_ENGINES=1`).
pub fn venv(name: &str, what: &str, packages: &[&str], size: &str) -> Option<PathBuf> {
    if !engines_wanted(what) {
        return None;
    }
    let cache = test_cache();
    let _lock = MachineLock::at(&cache.join(format!("{name}.lock")));
    let venv = cache.join(name);
    let stamp = venv.join("gpufrac-test-requirements");
    let want = packages.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Some(venv);
    }
    let make = || {
        Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(&venv)
            .stdin(Stdio::null())
            .output()
    };
    let mut o = make();
    if !o.as_ref().is_ok_and(|o| o.status.success()) {
        let has_venv = || make().is_ok_and(|o| o.status.success());
        if let Err(why) = apt_install(what, &["python3-venv"], has_venv) {
            cannot(what, &format!("python3 -m venv does not work here: {why}"));
            return None;
        }
        o = make();
    }
    let o = o.expect("running python3 -m venv");
    assert!(
        o.status.success(),
        "python3 -m venv: {}{}",
        stdout(&o),
        stderr(&o)
    );
    say(&format!(
        "downloading {} from PyPI ({size}) into a venv at {}, for {what} (pip's cache, \
         if it keeps one, in {})",
        packages.join(" "),
        venv.display(),
        cache.join("pip").display()
    ));
    let o = pip(&venv)
        .arg("install")
        .args(packages)
        .output()
        .expect("running pip");
    if !o.status.success() {
        // As for the release tools' download: no PyPI here is a machine
        // the test cannot run on, a failure only where engines are required.
        cannot(
            what,
            &format!(
                "pip install {}: {}{}",
                packages.join(" "),
                stdout(&o),
                stderr(&o)
            ),
        );
        return None;
    }
    std::fs::write(&stamp, want).unwrap();
    Some(venv)
}

/// `VENV/bin/python -m pip`, quiet, its cache (where it keeps one) in the
/// test cache rather than in $HOME; ARGS to follow.
pub fn pip(venv: &Path) -> Command {
    let mut c = Command::new(venv.join("bin/python"));
    c.args(["-m", "pip", "--disable-pip-version-check", "--quiet"])
        .env("PIP_CACHE_DIR", test_cache().join("pip"))
        // A build backend imported from a source tree (`pip wheel
        // ./python`) writes no byte code there.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null());
    c
}

/// Services a package's installation starts by itself on a machine run by
/// systemd (docker.io starts dockerd and containerd, munge munged): the
/// tests start their own, so these are stopped again. Their packages stay
/// installed and enabled, as apt left them.
mod services {
    use std::path::Path;
    use std::process::{Command, Stdio};

    const UNITS: &[&str] = &[
        "docker.socket",
        "docker.service",
        "containerd.service",
        "munge.service",
        "slurmctld.service",
        "slurmd.service",
        "podman.socket",
        "prometheus.service",
        "prometheus-node-exporter.service",
    ];

    pub struct Units(Vec<&'static str>);

    fn active(unit: &str) -> bool {
        Command::new("systemctl")
            .args(["is-active", "--quiet", unit])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    impl Units {
        /// The units running before the installation (none where systemd
        /// does not run the machine: nothing starts them there).
        pub fn before_install() -> Units {
            if !Path::new("/run/systemd/system").exists() {
                return Units(UNITS.to_vec());
            }
            Units(UNITS.iter().copied().filter(|u| active(u)).collect())
        }

        pub fn stop_the_ones_started(self) {
            if !Path::new("/run/systemd/system").exists() {
                return;
            }
            for unit in UNITS.iter().filter(|u| !self.0.contains(u)) {
                if active(unit) {
                    super::say(&format!(
                        "stopping {unit}, which installing its package started"
                    ));
                    let _ = Command::new("systemctl")
                        .args(["stop", unit])
                        .stdin(Stdio::null())
                        .status();
                }
            }
        }
    }
}

/// The shell script of a queued job called `name`: once it starts it
/// writes `DIR/NAME.env` ("CUDA_VISIBLE_DEVICES GPU_MEM_LIMIT", renamed
/// into place whole), then runs until `DIR/NAME.stop` exists. Read with
/// `started` and `wait_started`, ended with `release`.
pub fn job_script(dir: &Path, name: &str) -> String {
    job_script_parts(dir, name, None)
}

/// `job_script`, also running the shell command `meanwhile` in the
/// background from the start; killed, and waited for, once told to stop.
pub fn job_script_with(dir: &Path, name: &str, meanwhile: &str) -> String {
    job_script_parts(dir, name, Some(meanwhile))
}

fn job_script_parts(dir: &Path, name: &str, meanwhile: Option<&str>) -> String {
    let d = dir.display();
    let record = format!(
        "echo \"$CUDA_VISIBLE_DEVICES $GPU_MEM_LIMIT\" > {d}/{name}.env.tmp && \
         mv {d}/{name}.env.tmp {d}/{name}.env"
    );
    // Also ends when the scratch directory goes: a job whose run a test
    // killed is nobody's child, and one that missed its stop file before
    // the directory went would otherwise wait forever.
    let wait = format!("while [ ! -e {d}/{name}.stop ] && [ -d {d} ]; do sleep 0.02; done");
    match meanwhile {
        None => format!("{record}; {wait}"),
        Some(m) => format!("{record}; {m} & p=$!; {wait}; kill $p; wait $p; true"),
    }
}

/// What the job `name` of `job_script` was given, once it has started.
pub fn started(dir: &Path, name: &str) -> Option<(String, String)> {
    let s = std::fs::read_to_string(dir.join(format!("{name}.env"))).ok()?;
    let mut it = s.trim_end_matches('\n').splitn(2, ' ');
    Some((it.next()?.to_string(), it.next().unwrap_or("").to_string()))
}

pub fn wait_started(dir: &Path, name: &str) -> (String, String) {
    let mut r = None;
    wait_until(20.0, &format!("job {name} to start"), || {
        r = started(dir, name);
        r.is_some()
    });
    r.unwrap()
}

/// Tells job `name` to stop and checks that its run ended well.
pub fn release(dir: &Path, name: &str, child: std::process::Child) {
    std::fs::write(dir.join(format!("{name}.stop")), "").unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "job {name}: {}", stderr(&o));
}

/// An HTTP/2 RST_STREAM's PROTOCOL_ERROR code.
pub const HTTP2_PROTOCOL_ERROR: u32 = 1;

/// A gRPC call made by hand over HTTP/2 on a plugin's Unix socket (the
/// device plugin's, the DRA plugin's), with the `:authority` a client
/// chooses and an empty request message: the kubelet (since 1.26) and
/// grpc-go send `localhost`; gRPC's C core (Python grpcio, and grpc-java,
/// old grpcurl) send the socket's path, plain or percent-encoded. What it
/// got on stream 1: `Ok(())` once the response headers and message came,
/// or `Err(code)` of a RST_STREAM.
pub fn grpc_call_with_authority(socket: &Path, authority: &str, path: &str) -> Result<(), u32> {
    use std::io::{Read, Write};
    const DATA: u8 = 0;
    const HEADERS: u8 = 1;
    const RST_STREAM: u8 = 3;
    const SETTINGS: u8 = 4;
    const GOAWAY: u8 = 7;
    const END_STREAM: u8 = 1;
    const END_HEADERS: u8 = 4;
    const ACK: u8 = 1;
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len() as u32;
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }
    // HPACK "literal header field without indexing, new name", no
    // Huffman coding: every header spelled out, nothing to decode.
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        assert!(value.len() < 127, "a one-byte HPACK length: {value}");
        block.push(0);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    out.extend(frame(HEADERS, END_HEADERS, 1, &block));
    // One gRPC message: uncompressed, empty (api.Empty).
    out.extend(frame(DATA, END_STREAM, 1, &[0, 0, 0, 0, 0]));
    s.write_all(&out).unwrap();
    let (mut headers, mut message) = (false, false);
    loop {
        let mut h = [0u8; 9];
        s.read_exact(&mut h)
            .unwrap_or_else(|e| panic!("reading a frame from the plugin ({authority}): {e}"));
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).unwrap();
        match (kind, stream) {
            (SETTINGS, 0) if flags & ACK == 0 => {
                s.write_all(&frame(SETTINGS, ACK, 0, &[])).unwrap()
            }
            (RST_STREAM, 1) => {
                return Err(u32::from_be_bytes(payload[..4].try_into().unwrap()));
            }
            (HEADERS, 1) => headers = true,
            (DATA, 1) if !payload.is_empty() => message = true,
            (GOAWAY, _) => panic!("the plugin closed the connection ({authority}): {payload:?}"),
            _ => {}
        }
        if headers && message {
            return Ok(());
        }
    }
}

/// A TCP connection to `to` from the loopback address `from`: another
/// peer than 127.0.0.1 as far as the server can tell.
pub fn connect_from(
    from: [u8; 4],
    to: std::net::SocketAddrV4,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    let sa = |ip: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, owned by the TcpStream at once; the addresses
    // are sockaddr_in of `len` bytes.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = std::net::TcpStream::from_raw_fd(fd);
        let local = sa(from, 0);
        if libc::bind(fd, (&raw const local).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sa(to.ip().octets(), to.port());
        if libc::connect(fd, (&raw const remote).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// A command's output, or None when it ran longer than `secs` (killed).
pub fn output_within(cmd: &mut Command, secs: u64) -> Option<std::process::Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > std::time::Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Some(child.wait_with_output().unwrap())
}

/// `b` in lowercase hex, as the Python attackers read frames.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The venv that holds kubernetes-validate, made if missing ([`venv`]);
/// `None` where `what`, an engine test, is not to run.
pub fn kubernetes_validate_venv(what: &str) -> Option<PathBuf> {
    venv(
        "kubernetes-validate",
        what,
        &["kubernetes-validate==1.37.0"],
        "about 25 MB",
    )
}

/// `kubernetes-validate --strict` (from the venv at `venv`) on `files`,
/// against the schemas of each Kubernetes release the manifests support.
pub fn kubernetes_validate(venv: &Path, files: &[PathBuf]) {
    for version in ["1.34.0", "1.35.0", "1.36.0"] {
        let o = Command::new(venv.join("bin/kubernetes-validate"))
            .args(["--strict", "--kubernetes-version", version])
            .args(files)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "Kubernetes {version}'s schema refuses:\n{}{}",
            stdout(&o),
            stderr(&o)
        );
    }
}

/// Runs `round` until one passes, three times at most: it ran (the host
/// did not hold it back) and, where the host moves it too, gave the
/// figure judged. Each round gives its figures and whether it passed, and
/// the rounds' figures are in the panic when none did. The judgements a
/// held-back round can still make stay in `round`, made in every round.
pub fn until_a_round_passes<R: std::fmt::Debug>(what: &str, mut round: impl FnMut() -> (R, bool)) {
    let mut rounds = Vec::new();
    for _ in 0..3 {
        let (figures, ran) = round();
        rounds.push(figures);
        if ran {
            return;
        }
    }
    panic!("{what}, three times: {rounds:?}");
}
