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
    if tools.join("bin/cargo-zigbuild").exists() {
        return Ok(());
    }
    say(&format!(
        "downloading ziglang and cargo-zigbuild from PyPI (about 420 MB installed) into {}, \
         for {what}",
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
        .args(["ziglang", "cargo-zigbuild"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "pip install ziglang cargo-zigbuild failed: {}",
            out(&o)
        ))
    }
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
    cmd.env("GPUFRAC_DIST_TOOLS", zig_tools())
}

/// `cargo xtask ARGS` for the tests of `what`, with cargo-zigbuild and zig
/// installed first when it says they are missing; None (said loudly) when
/// the engine tests are skipped or the tools could not be had.
pub fn xtask_release(what: &str, args: &[&str]) -> Option<Output> {
    if !engines_wanted(what) {
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
