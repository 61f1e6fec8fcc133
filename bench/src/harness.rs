//! Processes: building the artifacts, running programs against the
//! simulated driver (with or without the shim), a broker on a private
//! socket, and children that are always killed and reaped — on drop, on
//! panic, on timeout, and (PR_SET_PDEATHSIG) when the benchmark itself dies.

use crate::clock::mono_ns;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::Duration;

pub struct Artifacts {
    /// The workspace root.
    pub root: PathBuf,
    /// `target/<profile>`
    pub dir: PathBuf,
    pub profile: &'static str,
    pub shim: PathBuf,
    /// Directory holding the simulated driver as libcuda.so.1, libcuda.so
    /// and libnvidia-ml.so.1.
    pub simdir: PathBuf,
    pub gpufrac: PathBuf,
    pub hotloop: PathBuf,
    /// examples/loadgen: the batch and interactive load of sections 5 and 6.
    pub loadgen: PathBuf,
    /// This program (re-run as `scale-client`).
    pub bench: PathBuf,
}

/// Builds the shim, the simulated driver, the gpufrac binary, this crate's
/// binaries and the load generator example in the profile this program was
/// built in, and links the simulated driver under the names the loader
/// looks for.
pub fn build() -> Result<Artifacts, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/gpufrac-bench
    let dir = exe
        .parent()
        .ok_or("cannot locate the target directory")?
        .to_path_buf();
    let release = dir.file_name().is_some_and(|n| n == "release");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("no workspace root")?
        .to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!(
        "gpufrac-bench: building the shim, the simulated driver and the binaries ({})",
        if release { "release" } else { "debug" }
    );
    // Separate invocations because a target filter applies to every package
    // named: with `--bins`, the shim and the simulated driver (libraries
    // only) would not be built at all, and the load generator is an example
    // of the root package.
    for args in [
        &["-p", "gpufrac-shim", "-p", "gpufrac-sim"][..],
        &["-p", "gpufrac", "-p", "gpufrac-bench", "--bins"][..],
        &["-p", "gpufrac", "--example", "loadgen"][..],
    ] {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&root).args(["build", "--quiet"]).args(args);
        if release {
            cmd.arg("--release");
        }
        let st = cmd
            .status()
            .map_err(|e| format!("running cargo build: {e}"))?;
        if !st.success() {
            return Err(format!("cargo build {} failed ({st})", args.join(" ")));
        }
    }
    remove_stale_scratch(&dir.join("bench-scratch"));
    let simdir = dir.join("bench-sim-driver");
    std::fs::create_dir_all(&simdir).map_err(|e| e.to_string())?;
    for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"] {
        let link = simdir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(dir.join("libgpufrac_sim.so"), &link)
            .map_err(|e| format!("symlink {}: {e}", link.display()))?;
    }
    let a = Artifacts {
        shim: dir.join("libgpufrac.so"),
        gpufrac: dir.join("gpufrac"),
        hotloop: dir.join("gpufrac-hotloop"),
        loadgen: dir.join("examples/loadgen"),
        bench: exe,
        profile: if release { "release" } else { "debug" },
        simdir,
        root,
        dir,
    };
    for p in [
        &a.shim,
        &a.gpufrac,
        &a.hotloop,
        &a.loadgen,
        &a.dir.join("libgpufrac_sim.so"),
    ] {
        if !p.exists() {
            return Err(format!("{} was not built", p.display()));
        }
    }
    Ok(a)
}

/// Removes scratch directories left by a benchmark that was killed (their
/// name carries the pid of the run that made them).
fn remove_stale_scratch(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Makes a child die with the benchmark (SIGKILL when the parent exits).
/// Children are spawned from the main thread only: the death signal fires
/// when the spawning *thread* exits.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe; nothing else runs in the hook.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// The CPU timing runs are pinned to: the last one. On a small VM, CPU 0
/// takes most interrupts and host noise; pinning every mode of a
/// comparison to the same quiet CPU makes the rounds comparable. None on a
/// single-CPU machine.
pub fn timing_cpu() -> Option<usize> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (n > 1).then(|| n - 1)
}

/// Pins the child to `cpu` before it runs.
pub fn pin(cmd: &mut Command, cpu: usize) {
    // SAFETY: sched_setaffinity is a plain syscall, async-signal-safe; the
    // set is built on the stack.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            Ok(())
        });
    }
}

/// A command that runs `program` against the simulated driver with
/// `devices` (e.g. "16G,16G"), under the shim when `shim`. The environment
/// is cleared of everything gpufrac reads so the host cannot leak in.
pub fn sim_command(a: &Artifacts, program: &Path, devices: &str, shim: bool) -> Command {
    let mut cmd = Command::new(program);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("GPU_")
            || k.starts_with("GPUFRAC_")
            || k == "LD_PRELOAD"
            || k == "CUDA_VISIBLE_DEVICES"
            || k == "RUST_LOG"
        {
            cmd.env_remove(&*k);
        }
    }
    cmd.env("LD_LIBRARY_PATH", &a.simdir)
        .env("GPUFRAC_SIM_DEVICES", devices)
        .env("GPUFRAC_BROKER", "off")
        .stdin(Stdio::null());
    if shim {
        cmd.env("LD_PRELOAD", &a.shim);
    }
    die_with_parent(&mut cmd);
    cmd
}

/// A child process killed and reaped on drop.
pub struct Kid {
    child: Option<Child>,
    what: String,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
}

pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    /// The key=value pairs of the first stdout line starting with `step`.
    pub fn line(&self, step: &str) -> Result<Vec<(String, String)>, String> {
        let l = self
            .stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(step))
            .ok_or_else(|| {
                format!(
                    "no `{step}` line in the output\nstdout: {}\nstderr: {}",
                    self.stdout.trim(),
                    self.stderr.trim()
                )
            })?;
        Ok(l.split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }

    /// A numeric field of the first `step` line.
    pub fn num(&self, step: &str, key: &str) -> Result<f64, String> {
        let kv = self.line(step)?;
        kv.iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
            .ok_or_else(|| format!("no numeric {key} in the `{step}` line: {kv:?}"))
    }
}

fn drain(r: Option<impl Read + Send + 'static>) -> Option<std::thread::JoinHandle<String>> {
    let mut r = r?;
    Some(std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = r.read_to_end(&mut b);
        String::from_utf8_lossy(&b).into_owned()
    }))
}

impl Kid {
    /// Spawns with stdout and stderr captured (read on threads, so a chatty
    /// child never blocks on a full pipe).
    pub fn spawn(mut cmd: Command, what: &str) -> Result<Kid, String> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        Self::spawn_raw(cmd, what)
    }

    /// Spawns with stdout and stderr captured, and waits for the first
    /// line of its stdout to be `ready`: anything else, or its end, is an
    /// error carrying what it said.
    pub fn spawn_ready(mut cmd: Command, what: &str, ready: &str) -> Result<Kid, String> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut first = String::new();
        let mut kid = Self::start(cmd, what, |out| {
            let mut out = out.map(std::io::BufReader::new);
            if let Some(o) = out.as_mut() {
                let _ = std::io::BufRead::read_line(o, &mut first);
            }
            drain(out)
        })?;
        if first.trim_end() == ready {
            return Ok(kid);
        }
        kid.kill();
        let stderr = kid
            .err
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        Err(format!(
            "{what} did not start: its first line was {:?}, not {ready:?}; stderr: {}",
            first.trim_end(),
            stderr.trim()
        ))
    }

    /// Spawns with stdio as the command has it.
    pub fn spawn_raw(cmd: Command, what: &str) -> Result<Kid, String> {
        Self::start(cmd, what, drain)
    }

    /// Spawns, its stdout handed to `out` (which returns what reads the
    /// rest of it), its stderr read on a thread.
    fn start(
        mut cmd: Command,
        what: &str,
        out: impl FnOnce(Option<ChildStdout>) -> Option<std::thread::JoinHandle<String>>,
    ) -> Result<Kid, String> {
        let mut child = cmd.spawn().map_err(|e| format!("starting {what}: {e}"))?;
        let err = drain(child.stderr.take());
        let out = out(child.stdout.take());
        Ok(Kid {
            child: Some(child),
            what: what.into(),
            out,
            err,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits up to `timeout`; kills it when it runs longer. A non-zero exit
    /// is an error carrying its output.
    pub fn finish(mut self, timeout: Duration) -> Result<Finished, String> {
        let deadline = mono_ns() + timeout.as_nanos() as u64;
        let mut child = self.child.take().ok_or("no child")?;
        let status = loop {
            match child.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) if mono_ns() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "{} ran past its {:.0} s limit and was killed",
                        self.what,
                        timeout.as_secs_f64()
                    ));
                }
                Err(e) => return Err(format!("waiting for {}: {e}", self.what)),
            }
        };
        let stdout = self
            .out
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        let stderr = self
            .err
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        if !status.success() {
            return Err(format!(
                "{} failed ({status})\nstdout: {}\nstderr: {}",
                self.what,
                stdout.trim(),
                stderr.trim()
            ));
        }
        Ok(Finished {
            status,
            stdout,
            stderr,
        })
    }

    /// Stops it: SIGTERM, then SIGKILL if it is still there after 2 s. A
    /// broker stopped cleanly removes the state directory it made; killed
    /// outright, every run of the bench left dozens under
    /// /run/gpufrac/state.
    pub fn kill(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        if matches!(c.try_wait(), Ok(None))
            && let Ok(pid) = i32::try_from(c.id())
        {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = mono_ns() + 2_000_000_000;
            while matches!(c.try_wait(), Ok(None)) && mono_ns() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A scratch directory under `target/<profile>/bench-scratch`, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(a: &Artifacts, name: &str) -> Result<Scratch, String> {
        let p = a.dir.join("bench-scratch").join(format!(
            "{name}-{}-{}",
            std::process::id(),
            mono_ns()
        ));
        std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(Scratch(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `gpufrac broker` on a private socket, seeing the simulated
/// devices, with its own simulated-engine state file. Killed on drop.
pub struct Broker {
    pub kid: Kid,
    pub socket: PathBuf,
    pub devices: String,
    pub state: PathBuf,
    pub log: PathBuf,
    _dir: Scratch,
}

impl Broker {
    pub fn start(a: &Artifacts, devices: &str, args: &[&str]) -> Result<Broker, String> {
        let dir = Scratch::new(a, "broker")?;
        let socket = dir.0.join("broker.sock");
        let state = dir.0.join("sim-state");
        let log = dir.0.join("broker.log");
        let logf = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = sim_command(a, &a.gpufrac, devices, false);
        cmd.arg("broker")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .env("GPUFRAC_SIM_STATE", &state)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(logf);
        let kid = Kid::spawn_raw(cmd, "gpufrac broker")?;
        let mut b = Broker {
            kid,
            socket,
            devices: devices.into(),
            state,
            log,
            _dir: dir,
        };
        let deadline = mono_ns() + 20_000_000_000;
        loop {
            if !b.kid.alive() {
                return Err(format!("the broker exited early: {}", b.log_tail()));
            }
            if std::os::unix::net::UnixStream::connect(&b.socket).is_ok() {
                return Ok(b);
            }
            if mono_ns() > deadline {
                return Err("the broker socket never appeared".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pid(&self) -> u32 {
        self.kid.pid()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// A command for `program` under the shim, wired to this broker and
    /// sharing its simulated devices (one execution engine per device).
    pub fn client(&self, a: &Artifacts, program: &Path) -> Command {
        let mut cmd = sim_command(a, program, &self.devices, true);
        cmd.env("GPUFRAC_SOCKET", &self.socket)
            .env("GPUFRAC_BROKER", "optional")
            .env("GPUFRAC_SIM_STATE", &self.state);
        cmd
    }

    pub fn status(&self) -> Result<serde_json::Value, String> {
        crate::wirec::status(&self.socket)
    }
}

/// utime + stime of `pid` in seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is parenthesised and may hold
    // spaces: state is field 3, utime 14, stime 15.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ut: f64 = f.get(11)?.parse().ok()?;
    let st: f64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some((ut + st) / hz)
}

/// CPU time of all threads of `pid` in seconds, from
/// `/proc/<pid>/task/*/schedstat` (the scheduler's run time in ns: the
/// utime+stime of `/proc/<pid>/stat` without its 10 ms tick granularity);
/// falls back to `/proc/<pid>/stat`.
pub fn cpu_seconds_precise(pid: u32) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut ns: u64 = 0;
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
            continue;
        };
        if let Some(v) = s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        {
            ns += v;
            any = true;
        }
    }
    if any {
        Some(ns as f64 / 1e9)
    } else {
        cpu_seconds(pid)
    }
}

/// How often the threads of `pid` have gone to sleep (their voluntary
/// context switches, from `/proc/<pid>/task/*/status`): each sleep ends
/// in a wake, which the kernel charges to the process woken.
pub fn sleeps(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut n = None;
    for t in tasks.flatten() {
        let Ok(s) = std::fs::read_to_string(t.path().join("status")) else {
            continue;
        };
        let v = s
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(v) = v {
            n = Some(n.unwrap_or(0) + v);
        }
    }
    n
}

/// A `Vm*` line of `/proc/<pid>/status`, in KiB.
pub fn vm_kib(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}
