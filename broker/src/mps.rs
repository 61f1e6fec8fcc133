//! `gpufrac broker --mps`: NVIDIA MPS run by the broker. The broker starts
//! `nvidia-cuda-mps-control -d` with pipe and log directories of its own
//! (in its private state directory), restarts it if it dies, and tells it
//! `quit` on shutdown. Jobs then run as MPS clients, truly side by side on
//! the GPU's SMs; the shim still caps their memory.
//!
//! Only process management here; the socket layer decides what MPS mode
//! means for arbitration.

use crate::status::MpsStatus;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tracing::{info, warn};

pub const CONTROL: &str = "nvidia-cuda-mps-control";
/// Restarts of a control daemon that keeps dying before the broker gives
/// up on it (and says so in status).
const MAX_RESTARTS: u32 = 5;

pub struct Mps {
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    control: PathBuf,
    pub restarts: u32,
    pub state: &'static str,
    last_check: Instant,
    /// Whether the status last given had the daemon's pid.
    pid_known: bool,
}

/// Whether process `pid` exists.
fn running(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `nvidia-cuda-mps-control` as found on PATH.
fn find_control() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(CONTROL))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

impl Mps {
    /// Starts the control daemon for the broker's GPUs. Refuses, saying
    /// why and what to do, when MPS is not there or will not start.
    pub fn start(state_dir: &Path) -> Result<Mps, String> {
        let control = find_control().ok_or_else(|| {
            format!(
                "--mps needs NVIDIA MPS, and {CONTROL} is not on PATH; install the NVIDIA driver's \
                 MPS utilities (or drop --mps to time-slice the GPUs instead)"
            )
        })?;
        // In the broker's private directory, never beside the socket: a
        // directory planted there by another user would hold the pid file
        // the daemon writes as root, and the pipe every job connects to.
        let pipe_dir = state_dir.join("mps-pipe");
        let log_dir = state_dir.join("mps-log");
        for (d, what) in [
            (&pipe_dir, "the MPS pipe directory"),
            (&log_dir, "the MPS log directory"),
        ] {
            // 0755: MPS clients of every user reach the pipe; only the
            // broker's user writes either.
            gpufrac_common::files::private_dir(d, 0o755, what)?;
        }
        let mut m = Mps {
            pipe_dir,
            log_dir,
            control,
            restarts: 0,
            state: "starting",
            last_check: Instant::now(),
            pid_known: false,
        };
        // A clean stop with jobs running leaves its daemon for them; the
        // next broker, on the same private directory, takes it over.
        // By its pid only: a control pipe left by a daemon that was killed
        // is no daemon.
        if let Some(pid) = m.daemon_pid().filter(|&p| running(p)) {
            m.state = "running";
            info!(
                pipe = %m.pipe_dir.display(),
                pid,
                "MPS control daemon already running (left for its jobs by the broker before): taken over"
            );
            return Ok(m);
        }
        m.spawn()?;
        info!(pipe = %m.pipe_dir.display(), "MPS control daemon started");
        Ok(m)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.control);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            // Every GPU of the node: the broker manages them all.
            .env_remove("CUDA_VISIBLE_DEVICES");
        c
    }

    fn spawn(&mut self) -> Result<(), String> {
        let out = self
            .command()
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.control.display()))?;
        if !out.status.success() {
            self.state = "failed";
            return Err(format!(
                "{} -d failed ({}): {}; check that the GPUs are in the Default compute mode and see {}",
                self.control.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                self.log_dir.display()
            ));
        }
        self.state = "running";
        Ok(())
    }

    /// The control daemon's pid, from the file it keeps in its pipe
    /// directory.
    pub fn daemon_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.pipe_dir.join("nvidia-cuda-mps-control.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// By its pid file when there is one; else by its control pipe (the
    /// pid file's name is what NVIDIA's daemon writes, but a daemon
    /// without it must not be restarted in a loop).
    fn alive(&self) -> bool {
        match self.daemon_pid() {
            Some(p) => running(p),
            None => self.pipe_dir.join("control").exists(),
        }
    }

    /// What status shows of the daemon.
    pub fn status(&self) -> MpsStatus {
        MpsStatus {
            state: self.state.into(),
            pipe_dir: self.pipe_dir.display().to_string(),
            daemon_pid: self.daemon_pid(),
            restarts: self.restarts,
        }
    }

    /// Called from the broker's loop: supervises the daemon, and gives
    /// what status should show of it when that may have changed (after
    /// each look, and until a started daemon's pid file has appeared), so
    /// that the loop, which turns far more often, does not read the pid
    /// file each time.
    pub fn poll(&mut self) -> Option<MpsStatus> {
        if !self.supervise() && self.pid_known {
            return None;
        }
        let st = self.status();
        self.pid_known = st.daemon_pid.is_some();
        Some(st)
    }

    /// Restarts a daemon that died (at most `MAX_RESTARTS` times); checks
    /// at most every 500 ms. True when it looked.
    fn supervise(&mut self) -> bool {
        if self.last_check.elapsed() < Duration::from_millis(500) || self.state == "failed" {
            return false;
        }
        self.last_check = Instant::now();
        if self.alive() {
            return true;
        }
        if self.restarts >= MAX_RESTARTS {
            self.state = "failed";
            warn!(
                "the MPS control daemon keeps dying ({} restarts); MPS clients will fail until it is fixed (see {})",
                self.restarts,
                self.log_dir.display()
            );
            return true;
        }
        self.restarts += 1;
        warn!(
            restarts = self.restarts,
            "the MPS control daemon is gone; restarting it"
        );
        if let Err(e) = self.spawn() {
            warn!("{e}");
        }
        true
    }

    /// Tells the daemon to quit (it stops its servers, then itself).
    pub fn quit(&mut self) {
        let child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(mut c) => {
                if let Some(mut i) = c.stdin.take() {
                    let _ = i.write_all(b"quit\n");
                }
                let _ = c.wait();
                self.state = "stopped";
                info!("MPS control daemon told to quit");
            }
            Err(e) => warn!("cannot tell the MPS control daemon to quit: {e}"),
        }
    }
}
