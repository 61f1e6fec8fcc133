//! What tests of the release artifacts (`cargo xtask dist`, `cargo xtask
//! wheel`) share: cargo-zigbuild and zig, installed from PyPI into the test
//! cache when missing (saying so first), and `cargo xtask` run with them.
//! These are engine tests (docs/testing.md): `GPUFRAC_TEST_ENGINES=0`
//! skips them, and a machine that cannot have their tools skips them
//! loudly, or fails under `GPUFRAC_TEST_ENGINES=1`.
//!
//! Include it beside `support` with `#[path = "support/dist.rs"] mod dist;`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use crate::support::{MachineLock, cannot, engines_wanted, say, stderr, stdout, test_cache};

pub const ROOT: &str = env!("CARGO_MANIFEST_DIR");

pub fn out(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

pub fn cargo() -> Command {
    let mut c = Command::new(env!("CARGO"));
    c.current_dir(ROOT);
    c
}

/// Where cargo-zigbuild and zig are installed for these tests: a
/// `pip install --target` in the test cache, which touches no Python
/// environment.
fn zig_tools() -> PathBuf {
    test_cache().join("zig")
}

/// Installs cargo-zigbuild and zig into `zig_tools()`, for `what`; Err
/// says why it could not.
fn install_zig_tools(what: &str) -> Result<(), String> {
    let tools = zig_tools();
    let _lock = MachineLock::at(&test_cache().join("zig.lock"));
    let pins = build_requirements();
    let stamp = tools.join("gpufrac-test-requirements");
    if tools.join("bin/cargo-zigbuild").exists()
        && std::fs::read_to_string(&stamp).is_ok_and(|s| s == pins.join("\n"))
    {
        return Ok(());
    }
    say(&format!(
        "downloading {} from PyPI (about 420 MB installed) into {}, for {what}",
        pins.join(" "),
        tools.display()
    ));
    let o = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--upgrade",
            "--target",
        ])
        .arg(&tools)
        .args(&pins)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if o.status.success() {
        std::fs::write(&stamp, pins.join("\n")).map_err(|e| format!("{}: {e}", stamp.display()))
    } else {
        Err(format!(
            "pip install ziglang cargo-zigbuild failed: {}",
            out(&o)
        ))
    }
}

/// The versions of zig and cargo-zigbuild that `pip install ./python`
/// builds with (python/pyproject.toml's build requirements): the tests
/// build with the same, so that both ways make the same wheel.
pub fn build_requirements() -> Vec<String> {
    let toml = std::fs::read_to_string(format!("{ROOT}/python/pyproject.toml"))
        .expect("reading python/pyproject.toml");
    let line = toml
        .lines()
        .find(|l| l.starts_with("requires = ["))
        .expect("python/pyproject.toml names its build requirements");
    let pins: Vec<String> = line
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    assert!(
        pins.iter().any(|p| p.starts_with("ziglang=="))
            && pins.iter().any(|p| p.starts_with("cargo-zigbuild==")),
        "python/pyproject.toml pins ziglang and cargo-zigbuild: {line}"
    );
    pins
}

/// `cargo xtask ARGS`, finding the cache's cargo-zigbuild on PATH and its
/// zig through PYTHONPATH (cargo-zigbuild falls back to `python3 -m
/// ziglang`) once they are installed there.
fn xtask(args: &[&str]) -> Output {
    let mut c = cargo();
    c.arg("xtask").args(args).stdin(Stdio::null());
    with_zig(&mut c)
        .output()
        .unwrap_or_else(|e| panic!("running cargo xtask {args:?}: {e}"))
}

/// `cmd` (one that runs `cargo xtask dist` or `wheel`, perhaps through
/// another program, such as pip building ./python) pointed at the cache's
/// cargo-zigbuild and zig: xtask looks in `GPUFRAC_DIST_TOOLS`.
pub fn with_zig(cmd: &mut Command) -> &mut Command {
    release_profile(cmd);
    cmd.env("GPUFRAC_DIST_TOOLS", zig_tools())
}

/// `cmd` (one that builds the release, through xtask or pip) set to build
/// it unoptimised, but for the shim and the code the shim shares, which
/// the workspace's Cargo.toml keeps at opt-level 3. What these tests check
/// (the glibc the binaries need, the tree, a capped job, the unit, the
/// wheel) does not turn on the optimiser, and `cargo xtask dist` took
/// 186 s on 2 cores instead of 438 (2026-11-30, one fresh clone each),
/// a sixth of CI; the optimised gpufrac is what the benchmarks build and
/// run. Every release build of a run must be set alike, or cargo builds
/// it again.
/// To test exactly what ships, set `CARGO_PROFILE_RELEASE_OPT_LEVEL=3`:
/// a value already set is kept.
pub fn release_profile(cmd: &mut Command) -> &mut Command {
    if std::env::var_os("CARGO_PROFILE_RELEASE_OPT_LEVEL").is_none() {
        cmd.env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "0");
    }
    cmd
}

/// `cargo xtask ARGS` for the tests of `what`, with cargo-zigbuild and zig
/// installed first when it says they are missing; None (said loudly) when
/// the engine tests are skipped or the tools could not be had.
pub fn xtask_release(what: &str, args: &[&str]) -> Option<Output> {
    if !engines_wanted(what) {
        return None;
    }
    let tools = zig_tools();
    if tools.join("bin/cargo-zigbuild").exists()
        && std::fs::read_to_string(tools.join("gpufrac-test-requirements"))
            .ok()
            .is_none_or(|s| s != build_requirements().join("\n"))
        && let Err(e) = install_zig_tools(what)
    {
        cannot(
            what,
            &format!("cargo-zigbuild and zig could not be updated: {e}"),
        );
        return None;
    }
    let mut o = xtask(args);
    if !o.status.success() && stderr(&o).contains("did not find both") {
        if let Err(e) = install_zig_tools(what) {
            cannot(
                what,
                &format!("cargo-zigbuild and zig could not be installed: {e}"),
            );
            return None;
        }
        o = xtask(args);
    }
    Some(o)
}
