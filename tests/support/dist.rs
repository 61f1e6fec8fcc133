//! What tests of the release artifacts (`cargo xtask dist`, `cargo xtask
//! wheel`) share: the workspace's target directory, cargo-zigbuild and zig
//! installed from PyPI where xtask looks for them, and a loud skip that is a
//! failure in CI.
//!
//! Include it beside `support` with `#[path = "support/dist.rs"] mod dist;`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::support::{MachineLock, stderr, stdout};

pub const ROOT: &str = env!("CARGO_MANIFEST_DIR");

pub fn out(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

pub fn cargo() -> Command {
    let mut c = Command::new(env!("CARGO"));
    c.current_dir(ROOT);
    c
}

/// The workspace's target directory, as xtask finds it.
pub fn target_dir() -> PathBuf {
    let o = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .expect("running cargo metadata");
    assert!(o.status.success(), "cargo metadata: {}", stderr(&o));
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    PathBuf::from(m["target_directory"].as_str().unwrap())
}

/// A prerequisite that could not be installed: loud, and a failure in CI,
/// where the machine can always install it and a skipped release test
/// would hide a broken release.
pub fn cannot(what: &str) {
    let msg = format!("SKIPPED: {what}");
    if std::env::var_os("CI").is_some() {
        panic!("{msg} (CI is set, so this is a failure)");
    }
    eprintln!("\n========\n{msg}\n========\n");
}

/// Installs cargo-zigbuild and zig into target/dist-tools, where xtask
/// looks; Err says why it could not.
pub fn install_zig_tools(target: &Path) -> Result<(), String> {
    let tools = target.join("dist-tools");
    std::fs::create_dir_all(target).map_err(|e| e.to_string())?;
    let _lock = MachineLock::at(&target.join("dist-tools.lock"));
    let o = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
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

/// `cargo xtask TASK`, with cargo-zigbuild and zig installed first when
/// it says they are missing; None (said loudly) when they could not be.
pub fn xtask_release(task: &str) -> Option<Output> {
    let run = || {
        cargo()
            .args(["xtask", task])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running cargo xtask {task}: {e}"))
    };
    let mut o = run();
    if !o.status.success() && stderr(&o).contains("did not find both") {
        if let Err(e) = install_zig_tools(&target_dir()) {
            cannot(&format!(
                "cargo xtask {task} needs cargo-zigbuild and zig, and they could not be installed: {e}"
            ));
            return None;
        }
        o = run();
    }
    Some(o)
}
