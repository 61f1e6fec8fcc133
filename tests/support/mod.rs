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
    pub gpufrac: PathBuf,
    pub fixtures: PathBuf,
}

pub fn artifacts() -> &'static Artifacts {
    static A: OnceLock<Artifacts> = OnceLock::new();
    A.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        // target/<profile>/deps/<test>-<hash>
        let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args([
            "build",
            "--quiet",
            "-p",
            "gpufrac-shim",
            "-p",
            "gpufrac-sim",
            "-p",
            "gpufrac",
            "--bins",
            "--examples",
        ]);
        if release {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("running cargo build for the test artifacts");
        assert!(st.success(), "building the shim, simulated driver and examples failed");
        let simdir = dir.join("sim-driver");
        std::fs::create_dir_all(&simdir).unwrap();
        for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"] {
            let link = simdir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(dir.join("libgpufrac_sim.so"), &link).unwrap();
        }
        Artifacts {
            shim: dir.join("libgpufrac.so"),
            probe: dir.join("examples/probe"),
            gpufrac: dir.join("gpufrac"),
            fixtures: PathBuf::from(env!("GPUFRAC_FIXTURES")),
            simdir,
            dir,
        }
    })
}

/// A command that runs against the simulated driver with `devices` (e.g.
/// "16G,8G"), under the shim unless `shim` is false. The environment is
/// cleared of anything gpufrac reads so the host cannot leak in.
pub fn sim_command(program: impl AsRef<Path>, devices: &str, shim: bool) -> Command {
    let a = artifacts();
    let mut cmd = Command::new(program.as_ref());
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_") || k.starts_with("GPUFRAC_") || k == "LD_PRELOAD" || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.env("LD_LIBRARY_PATH", &a.simdir)
        .env("GPUFRAC_SIM_DEVICES", devices)
        .env("GPUFRAC_BROKER", "off")
        .stdin(Stdio::null());
    if shim {
        cmd.env("LD_PRELOAD", &a.shim);
    }
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
        .unwrap_or_else(|| panic!("no line #{n} for step {step:?} in output:\n{out}\nstderr:\n{}", stderr(o)));
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
