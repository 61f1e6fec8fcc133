//! A one-node Slurm cluster in a temporary directory: its own munged (key,
//! socket), slurmctld and slurmd in the foreground as children of the test,
//! on free ports, with the gpufrac lines of deploy/slurm/ in its
//! configuration. Everything it started is killed on drop, and the daemons
//! also die with the test's thread if the test process is killed before
//! that (PR_SET_PDEATHSIG), so that no munged or slurmd outlives the tests.
#![allow(dead_code)]

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::{Scratch, apt_install, artifacts, free_port, sim_command};

/// The node's name in slurm.conf (slurmd is told it with -N, so it need not
/// be the machine's).
pub const NODE: &str = "gpufractest";

/// Where the shipped files name things that the test puts elsewhere.
pub const DOC_GPUFRAC: &str = "/usr/local/bin/gpufrac";
pub const DOC_PROLOG: &str = "/usr/local/libexec/gpufrac-task-prolog";
pub const DOC_DEVICE: &str = "/dev/nvidia0";

const DAEMONS: [&str; 3] = ["munged", "slurmctld", "slurmd"];
const CLIENTS: [&str; 2] = ["srun", "sinfo"];

/// Absolute paths of the Slurm and munge programs.
pub struct Tools {
    dir: Vec<PathBuf>,
}

impl Tools {
    pub fn path(&self, name: &str) -> PathBuf {
        find_program(name, &self.dir).unwrap_or_else(|| panic!("{name} disappeared"))
    }
}

/// Directories searched besides PATH: the daemons live in sbin, which a
/// non-login PATH often lacks.
fn search_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for d in ["/usr/sbin", "/usr/local/sbin", "/sbin", "/usr/bin", "/bin"] {
        v.push(PathBuf::from(d));
    }
    v
}

fn find_program(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(name)).find(|p| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

fn missing(dirs: &[PathBuf]) -> Vec<&'static str> {
    DAEMONS
        .iter()
        .chain(CLIENTS.iter())
        .copied()
        .filter(|n| find_program(n, dirs).is_none())
        .collect()
}

/// The Slurm and munge programs, installed with apt-get when missing. Err
/// is why this machine cannot have them (the caller skips); a failed
/// installation on a machine that could install panics.
pub fn tools() -> Result<Tools, String> {
    let dirs = search_dirs();
    if missing(&dirs).is_empty() {
        return Ok(Tools { dir: dirs });
    }
    apt_install("the Slurm test", &["slurm-wlm", "munge"], || {
        missing(&dirs).is_empty()
    })
    .map_err(|why| format!("{} missing: {why}", missing(&dirs).join(", ")))?;
    let still = missing(&dirs);
    assert!(
        still.is_empty(),
        "slurm-wlm and munge are installed but {} still missing",
        still.join(", ")
    );
    Ok(Tools { dir: dirs })
}

/// The machine's short host name: slurmctld runs only where SlurmctldHost
/// names the machine it is on.
fn short_hostname() -> String {
    let mut buf = [0u8; 256];
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(rc, 0, "gethostname");
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    name.split('.').next().unwrap_or(&name).to_owned()
}

/// The repository's deploy/slurm/NAME with the documented paths replaced
/// by this test's.
pub fn shipped(name: &str, subst: &[(&str, &Path)]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/slurm")
        .join(name);
    let mut text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    for (from, to) in subst {
        assert!(
            text.contains(from),
            "{} no longer names {from}; the test substitutes it",
            path.display()
        );
        text = text.replace(from, &to.display().to_string());
    }
    text
}

/// Lines that are not comments or blank.
pub fn config_lines(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// A process started by the cluster, with its own process group so that
/// whatever it starts goes with it.
struct Daemon {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

pub struct Cluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
    pub tools: Tools,
    daemons: Vec<Daemon>,
    _scratch: Scratch,
}

/// Why the cluster cannot run here; the caller skips.
pub struct Unable(pub String);

impl Cluster {
    /// Starts munged, slurmctld and slurmd, and waits until the node is
    /// idle. The TaskProlog, slurm.conf's gpufrac lines and gres.conf are
    /// deploy/slurm/'s, with only their paths replaced.
    pub fn start(tools: Tools) -> Result<Cluster, Unable> {
        let scratch = Scratch::new("slurm");
        let dir = scratch.0.clone();
        // munged insists that everyone may traverse its socket's directory.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        let mut c = Cluster {
            conf: dir.join("slurm.conf"),
            dir,
            tools,
            daemons: Vec::new(),
            _scratch: scratch,
        };
        c.write_files()?;
        c.start_munged();
        c.spawn("slurmctld", c.tools.path("slurmctld"), &["-D", "-i"]);
        c.spawn("slurmd", c.tools.path("slurmd"), &["-D", "-N", NODE]);
        c.wait_idle();
        Ok(c)
    }

    fn write_files(&self) -> Result<(), Unable> {
        let a = artifacts();
        let d = &self.dir;
        let device = d.join("nvidia0");
        mknod_gpu(&device)?;
        let prolog = d.join("gpufrac-task-prolog");
        write_mode(
            &prolog,
            &shipped("gpufrac-task-prolog", &[(DOC_GPUFRAC, &a.gpufrac)]),
            0o755,
        );
        let gres = shipped("gres.conf.example", &[(DOC_DEVICE, &device)]);
        std::fs::write(d.join("gres.conf"), gres).unwrap();

        let ours = shipped("slurm.conf.example", &[(DOC_PROLOG, &prolog)]);
        let mut gpufrac_lines = String::new();
        let mut node_gres = None;
        for l in config_lines(&ours) {
            if l.starts_with("NodeName=") {
                // The example's node is somebody's; its Gres is what counts.
                node_gres = l.split_whitespace().find(|w| w.starts_with("Gres="));
            } else {
                gpufrac_lines.push_str(l);
                gpufrac_lines.push('\n');
            }
        }
        let node_gres = node_gres.expect("slurm.conf.example has a NodeName line with Gres=");
        let host = short_hostname();
        let (ctld_port, d_port) = (free_port(), free_port());
        let conf = format!(
            "ClusterName=gpufractest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
MailProg=/bin/true
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/slurmd
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{gpufrac_lines}NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=2 {node_gres} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
",
            d = d.display()
        );
        std::fs::write(&self.conf, conf).unwrap();
        for sub in ["ctld", "slurmd"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        Ok(())
    }

    fn start_munged(&mut self) {
        let d = self.dir.clone();
        let mut key = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .expect("reading /dev/urandom");
        let key_path = d.join("munge.key");
        std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&key_path)
            .and_then(|mut f| f.write_all(&key))
            .expect("writing the munge key");
        let socket = d.join("munge.sock");
        let mut args: Vec<OsString> = vec!["-F".into(), "-f".into(), "-S".into()];
        args.push(socket.clone().into());
        for (opt, file) in [
            ("--key-file", "munge.key"),
            ("--log-file", "munged.log"),
            ("--pid-file", "munged.pid"),
            ("--seed-file", "munged.seed"),
        ] {
            let mut a = OsString::from(format!("{opt}="));
            a.push(d.join(file));
            args.push(a);
        }
        let munged = self.tools.path("munged");
        self.spawn("munged", munged, &args);
        self.wait("munged's socket", |_| socket.exists());
    }

    fn spawn<S: AsRef<std::ffi::OsStr>>(
        &mut self,
        name: &'static str,
        program: PathBuf,
        args: &[S],
    ) {
        let log = self.dir.join(format!("{name}.out"));
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = self.command(&program);
        cmd.args(args)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe. The signal comes when the
        // thread that spawned the daemon ends: the test's, which owns the
        // cluster and drops it (killing the daemons) before it ends anyway.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
        self.daemons.push(Daemon { name, child, log });
    }

    /// A command with this cluster's SLURM_CONF, and an environment cleared
    /// of anything from a Slurm job or gpufrac the test itself may run in.
    pub fn command(&self, program: impl AsRef<Path>) -> Command {
        let mut cmd = Command::new(program.as_ref());
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("SLURM_") || k.starts_with("SLURMD_") || k.starts_with("GPUFRAC_") {
                cmd.env_remove(&*k);
            }
        }
        cmd.env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        cmd
    }

    /// `srun ARGS` whose tasks run against the simulated driver with
    /// `devices`; srun hands its whole environment to the tasks.
    pub fn srun(&self, devices: &str, args: &[&str]) -> Output {
        let mut cmd = sim_command(self.tools.path("srun"), devices, false);
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("SLURM_") || k.starts_with("SLURMD_") {
                cmd.env_remove(&*k);
            }
        }
        cmd.env("SLURM_CONF", &self.conf)
            .arg("--time=1")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let t = Instant::now();
        let mut child = cmd.spawn().expect("starting srun");
        let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let drain = |mut r: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let (out, err) = (drain(Box::new(out)), drain(Box::new(err)));
        let status = loop {
            if let Some(st) = child.try_wait().expect("waiting for srun") {
                break st;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "srun {args:?} did not finish in 60s\nstderr:\n{}\n{}",
                    String::from_utf8_lossy(&err.join().unwrap()),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let o = Output {
            status,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
        };
        eprintln!("srun {args:?}: {:.2}s", t.elapsed().as_secs_f64());
        o
    }

    fn node_state(&self) -> Option<String> {
        let o = self
            .command(self.tools.path("sinfo"))
            .args(["-h", "-N", "-o", "%T"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    }

    fn wait_idle(&mut self) {
        let t = Instant::now();
        // A drained or invalid node never gets there: the wait then fails
        // with the daemons' logs, which say why.
        self.wait("the node to be idle", |c| {
            c.node_state().as_deref() == Some("idle")
        });
        eprintln!("slurm cluster ready in {:.2}s", t.elapsed().as_secs_f64());
    }

    /// Polls `cond` every 50 ms for up to 30 s; fails with every daemon's
    /// log if a daemon exits or time runs out.
    fn wait(&mut self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let t = Instant::now();
        loop {
            if cond(self) {
                return;
            }
            let exited = self
                .daemons
                .iter_mut()
                .find_map(|d| Some((d.name, d.child.try_wait().ok()??)));
            if let Some((name, st)) = exited {
                panic!(
                    "{name} exited ({st}) while waiting for {what}\n{}",
                    self.logs()
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "timed out after 30s waiting for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The tail of every daemon's output.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for d in &self.daemons {
            let text = std::fs::read_to_string(&d.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(30);
            s.push_str(&format!("--- {} ({}):\n", d.name, d.log.display()));
            for l in &lines[from..] {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }

    /// Processes the cluster started that left its daemons' process groups
    /// (slurmstepd and the tasks): they all carry this cluster's SLURM_CONF.
    fn strays(&self) -> Vec<libc::pid_t> {
        let mut marker = b"SLURM_CONF=".to_vec();
        marker.extend_from_slice(self.conf.as_os_str().as_encoded_bytes());
        marker.push(0);
        let me = std::process::id() as libc::pid_t;
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<libc::pid_t>().ok())
            .filter(|&pid| pid != me)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split_inclusive(|&b| b == 0).any(|v| v == marker))
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for d in self.daemons.iter_mut().rev() {
            let pid = d.child.id() as libc::pid_t;
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = d.child.kill();
            let _ = d.child.wait();
        }
        // A few rounds: slurmstepd may fork a task while the sweep runs.
        for _ in 0..5 {
            let strays = self.strays();
            if strays.is_empty() {
                break;
            }
            for pid in strays {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn write_mode(path: &Path, text: &str, mode: u32) {
    std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    // The umask may have taken bits the prolog needs.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A stand-in for /dev/nvidia0 with the NVIDIA major number: gres.conf's
/// File= must be a device node.
fn mknod_gpu(path: &Path) -> Result<(), Unable> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, 0)) };
    if rc != 0 {
        return Err(Unable(format!(
            "cannot create a device node for gres.conf (mknod {}: {})",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
