//! Release tasks, run as `cargo xtask TASK` from anywhere in the workspace:
//!
//! - `dist`: the release tarball, built against glibc 2.28 with
//!   cargo-zigbuild so that it runs on any distribution from then on;
//! - `install`: a native release build installed under a prefix by the same
//!   `install.sh` the tarball carries;
//! - `msrv-check`: no locked dependency needs a newer Rust than the
//!   workspace's `rust-version` claims;
//! - `wheel`: the Python package, the tarball's binaries in a manylinux
//!   wheel (wheel.rs);
//! - `plots`: the benchmarks' figures as SVG under docs/plots/, from the
//!   JSON the bench writes (plots.rs);
//! - `redteam`: the searching attacker's longer searches (redteam/, a
//!   release build), each invariant's most harmful strategy printed with
//!   its harm and as a regression test.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use clap::Parser;
use serde_json::Value;

mod plots;
mod wheel;

const TARGET: &str = "x86_64-unknown-linux-gnu";
/// The oldest glibc the release runs on (RHEL 8, Debian 10, Ubuntu 18.10).
const GLIBC: &str = "2.28";
const UNIT: &str = "gpufrac-broker.service";
/// Where the tarball build looks for cargo-zigbuild and zig when they are not
/// on PATH, under the workspace's target directory: a `pip install --target`
/// there touches no Python environment, and tests/release.rs installs there.
const TOOLS_DIR: &str = "dist-tools";

/// Release tasks for gpufrac, run as `cargo xtask TASK`.
#[derive(Parser, Debug)]
#[command(name = "xtask", bin_name = "cargo xtask")]
enum Task {
    /// Build dist/gpufrac-VERSION-x86_64-unknown-linux-gnu.tar.gz (release,
    /// glibc 2.28 and newer). Needs cargo-zigbuild and zig:
    /// python3 -m pip install ziglang cargo-zigbuild
    Dist {
        /// Where to write the tarball [default: dist/ in the workspace].
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
    /// Build natively in release mode and install under PREFIX: bin/gpufrac,
    /// lib/libgpufrac.so, include/gpufrac.h, the systemd unit and the docs.
    Install {
        /// [default: /usr/local]
        #[arg(long, value_name = "PREFIX", value_parser = absolute)]
        prefix: Option<String>,
        /// A staging root that the files go under (for packaging).
        #[arg(long, value_name = "DIR")]
        destdir: Option<String>,
        /// Where the systemd unit goes [default: PREFIX/lib/systemd/system].
        #[arg(long, value_name = "DIR", value_parser = absolute)]
        unitdir: Option<String>,
    },
    /// Build target/wheels/gpufrac-VERSION-py3-none-manylinux_2_28_x86_64.whl:
    /// the binary, the shim and the pytest plugin (python/), for pip
    /// install. Builds what dist builds, with the same tools.
    Wheel {
        /// Where to write the wheel [default: target/wheels].
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
    /// Fail if a locked dependency declares a rust-version newer than the
    /// workspace's.
    MsrvCheck,
    /// Draw the benchmarks' plots (SVG) from the bench's JSON:
    /// docs/benchmarks.json into docs/plots/, as the report shows them.
    Plots {
        /// The bench's JSON [default: docs/benchmarks.json].
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Where the report lives: the plots go under it, at the paths its
        /// sections name (plots/…) [default: the JSON's directory].
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
    /// Search for a hostile user's most harmful strategy against each of
    /// the broker's invariants (redteam/, in a release build): longer
    /// than the test suite's search, with the largest inputs. Prints each
    /// invariant's best strategy with its harm, in words and as a
    /// regression test to paste into redteam/tests/found.rs.
    Redteam {
        /// The search's options, passed on as they are (`--seed`,
        /// `--budget` [default: 400], `--invariant`, `--without`,
        /// `--no-seeds`, `--quick`, `--shims-only`, `--classes`,
        /// `--working`; `cargo xtask redteam --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let result = match Task::parse() {
        Task::Dist { out_dir } => dist(out_dir),
        Task::Install {
            prefix,
            destdir,
            unitdir,
        } => install([prefix, destdir, unitdir]),
        Task::Wheel { out_dir } => wheel::wheel(out_dir),
        Task::MsrvCheck => msrv_check(),
        Task::Plots { json, out_dir } => draw_plots(json, out_dir),
        Task::Redteam { args } => redteam(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn draw_plots(json: Option<PathBuf>, out_dir: Option<PathBuf>) -> Result<(), String> {
    let json = match json {
        Some(j) => j,
        None => workspace()?.root.join("docs/benchmarks.json"),
    };
    let out_dir = out_dir.unwrap_or_else(|| {
        json.parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    });
    for p in plots::plots(&json, &out_dir)? {
        println!("{}", p.display());
    }
    Ok(())
}

/// A path that must not depend on where install.sh runs.
fn absolute(v: &str) -> Result<String, String> {
    if v.starts_with('/') {
        Ok(v.to_owned())
    } else {
        Err(format!("{v}: must be an absolute path"))
    }
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `cmd`, failing with what it was when it does not succeed.
fn run(cmd: &mut Command) -> Result<(), String> {
    let st = cmd
        .status()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed ({st})"))
    }
}

struct Workspace {
    root: PathBuf,
    target: PathBuf,
    version: String,
    rust_version: String,
}

fn metadata(extra: &[&str]) -> Result<Value, String> {
    let out = cargo()
        .args(["metadata", "--format-version", "1"])
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo metadata failed ({})", out.status));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata: {e}"))
}

fn workspace() -> Result<Workspace, String> {
    let m = metadata(&["--no-deps"])?;
    let root = PathBuf::from(m["workspace_root"].as_str().unwrap_or_default());
    let gpufrac = m["packages"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "gpufrac"))
        .ok_or("cargo metadata lists no gpufrac package")?;
    Ok(Workspace {
        target: PathBuf::from(m["target_directory"].as_str().unwrap_or_default()),
        version: gpufrac["version"].as_str().unwrap_or_default().to_owned(),
        rust_version: gpufrac["rust_version"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        root,
    })
}

/// Succeeds when `program args` runs and exits 0.
fn works(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// How to run cargo-zigbuild: from PATH, else from `target/dist-tools`
/// or the directory `GPUFRAC_DIST_TOOLS` names (a `pip install --target`
/// of both; the test suite keeps them in its cache), with zig found there
/// through PYTHONPATH, as cargo-zigbuild falls back to `python3 -m
/// ziglang`. Says exactly what to install when neither has both tools.
fn zigbuild(ws: &Workspace) -> Result<Command, String> {
    let tools = std::env::var_os("GPUFRAC_DIST_TOOLS")
        .filter(|d| !d.is_empty())
        .map_or_else(|| ws.target.join(TOOLS_DIR), PathBuf::from);
    let pythonpath = match std::env::var_os("PYTHONPATH") {
        Some(p) if !p.is_empty() => {
            let mut v = OsString::from(&tools);
            v.push(":");
            v.push(p);
            v
        }
        _ => tools.clone().into(),
    };
    // cargo-zigbuild runs `$CARGO_ZIGBUILD_PYTHON_PATH -m ziglang` (pip's
    // build environment of python/ points it at its own interpreter).
    let python = std::env::var_os("CARGO_ZIGBUILD_PYTHON_PATH")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into());
    let zig_ok = |pp: Option<&OsString>| {
        let mut py = Command::new(&python);
        py.args(["-m", "ziglang", "version"]);
        if let Some(pp) = pp {
            py.env("PYTHONPATH", pp);
        }
        works(Command::new("zig").arg("version")) || works(&mut py)
    };
    if let Some(exe) = on_path("cargo-zigbuild")
        && works(Command::new(&exe).arg("--version"))
        && zig_ok(None)
    {
        return Ok(Command::new(settled(ws, &exe)?));
    }
    let local = tools.join("bin/cargo-zigbuild");
    if works(Command::new(&local).arg("--version")) && zig_ok(Some(&pythonpath)) {
        let mut c = Command::new(settled(ws, &local)?);
        c.env("PYTHONPATH", pythonpath);
        return Ok(c);
    }
    Err(format!(
        "`cargo xtask dist` builds with cargo-zigbuild and zig (to link against glibc {GLIBC}), \
         and did not find both on PATH or in {tools}. Install them with\n\
         \n    python3 -m pip install ziglang cargo-zigbuild\n\
         \nor, leaving the Python environment alone, where xtask looks:\n\
         \n    python3 -m pip install --target {tools} ziglang cargo-zigbuild\n",
        tools = tools.display()
    ))
}

/// `name`'s path on PATH, if it is there.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// cargo-zigbuild `exe`, run from one place in the target directory.
/// cargo-zigbuild names the linker wrappers it gives cargo after its own
/// path, and cargo builds everything again when the linker changes: run
/// from where it was installed, and pip's build of python/ installs it in a
/// new temporary environment every time, each `pip install ./python` built
/// the release from nothing, beside the one `cargo xtask dist` or `wheel`
/// had made. From here, every release build after the first finds the
/// last one's objects, whichever cargo-zigbuild of the same version runs.
fn settled(ws: &Workspace, exe: &Path) -> Result<PathBuf, String> {
    let to = ws.target.join("dist").join("cargo-zigbuild");
    let bytes = fs::read(exe).map_err(|e| format!("cannot read {}: {e}", exe.display()))?;
    if fs::read(&to).is_ok_and(|b| b == bytes) {
        return Ok(to);
    }
    let tmp = to.with_extension(format!("{}.tmp", std::process::id()));
    copy(exe, &tmp, 0o755)?;
    fs::rename(&tmp, &to).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))?;
    Ok(to)
}

fn copy(from: &Path, to: &Path, mode: u32) -> Result<(), String> {
    if let Some(dir) = to.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    fs::copy(from, to)
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot chmod {}: {e}", to.display()))
}

/// Lays out a release tree at `dest` (removed first): what the tarball holds
/// and what install.sh installs from.
fn stage(ws: &Workspace, built: &Path, dest: &Path) -> Result<(), String> {
    if dest.exists() {
        fs::remove_dir_all(dest).map_err(|e| format!("cannot remove {}: {e}", dest.display()))?;
    }
    let r = &ws.root;
    let files: [(PathBuf, &str, u32); 15] = [
        (built.join("gpufrac"), "bin/gpufrac", 0o755),
        (built.join("libgpufrac.so"), "lib/libgpufrac.so", 0o755),
        (r.join("include/gpufrac.h"), "include/gpufrac.h", 0o644),
        (
            r.join("deploy/systemd").join(UNIT),
            "lib/systemd/system/gpufrac-broker.service",
            0o644,
        ),
        (r.join("deploy/install.sh"), "install.sh", 0o755),
        (
            r.join("deploy/slurm/gpufrac-task-prolog"),
            "libexec/gpufrac-task-prolog",
            0o755,
        ),
        (
            r.join("deploy/cdi/gpufrac-cdi.service"),
            "lib/systemd/system/gpufrac-cdi.service",
            0o644,
        ),
        (
            r.join("deploy/k8s/daemonset.yaml"),
            "share/gpufrac/k8s/daemonset.yaml",
            0o644,
        ),
        (
            r.join("deploy/k8s/pod-example.yaml"),
            "share/gpufrac/k8s/pod-example.yaml",
            0o644,
        ),
        (
            r.join("deploy/slurm/slurm.conf.example"),
            "share/gpufrac/slurm/slurm.conf.example",
            0o644,
        ),
        (
            r.join("deploy/slurm/gres.conf.example"),
            "share/gpufrac/slurm/gres.conf.example",
            0o644,
        ),
        (r.join("README.md"), "README.md", 0o644),
        (r.join("LICENSE"), "LICENSE", 0o644),
        (r.join("SECURITY.md"), "SECURITY.md", 0o644),
        (r.join("docs/install.md"), "install.md", 0o644),
    ];
    for (from, to, mode) in &files {
        copy(from, &dest.join(to), *mode)?;
    }
    // Directory modes as a umask of 022 would leave them, whatever this
    // one is, so that the tarball does not depend on who built it.
    let mut dirs = vec![dest.to_path_buf()];
    while let Some(d) = dirs.pop() {
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
        for e in fs::read_dir(&d).map_err(|e| e.to_string())? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.is_dir() {
                dirs.push(p);
            }
        }
    }
    Ok(())
}

/// The time stamp for every file in the tarball: SOURCE_DATE_EPOCH, else the
/// last commit's, so that the same commit gives the same tarball.
fn source_date() -> String {
    if let Ok(s) = std::env::var("SOURCE_DATE_EPOCH")
        && s.parse::<u64>().is_ok()
    {
        return s;
    }
    Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| s.parse::<u64>().is_ok())
        .unwrap_or_else(|| "0".to_owned())
}

/// `tar | gzip -n` of `tree`, under its own name, into `out`, through a
/// temporary file so that a reader never sees half a tarball.
fn tarball(tree: &Path, out: &Path) -> Result<(), String> {
    let (Some(parent), Some(name)) = (tree.parent(), tree.file_name()) else {
        return Err(format!("{} is no directory to pack", tree.display()));
    };
    let tmp = out.with_extension("tmp");
    let file =
        fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut tar = Command::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--format=gnu",
        ])
        .arg(format!("--mtime=@{}", source_date()))
        .arg("-C")
        .arg(parent)
        .args(["-cf", "-"])
        .arg(name)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    let gz = Command::new("gzip")
        .arg("-9n")
        .stdin(tar.stdout.take().expect("piped"))
        .stdout(file)
        .status()
        .map_err(|e| format!("cannot run gzip: {e}"))?;
    let t = tar.wait().map_err(|e| e.to_string())?;
    if !t.success() || !gz.success() {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "making {} failed (tar {t}, gzip {gz})",
            out.display()
        ));
    }
    fs::rename(&tmp, out).map_err(|e| format!("cannot rename {}: {e}", tmp.display()))
}

/// Builds the release against glibc 2.28 and stages it in
/// `target/dist/stage/gpufrac-VERSION`, whose path it returns: the tree the
/// tarball packs and the wheel takes its binaries from, so that both carry
/// the same bytes from one build. The stage does not depend on `dist
/// --out-dir`, and each run lays it out afresh.
fn release_tree(ws: &Workspace) -> Result<PathBuf, String> {
    let mut zb = zigbuild(ws)?;
    // Its own target directory: the glibc-2.28 objects must not mix with
    // native ones, and a second run finds everything built.
    let target_dir = ws.target.join("dist");
    run(zb
        .current_dir(&ws.root)
        .args(["zigbuild", "--release", "--locked", "--target"])
        .arg(format!("{TARGET}.{GLIBC}"))
        .args(["-p", "gpufrac", "-p", "gpufrac-shim", "--target-dir"])
        .arg(&target_dir))?;
    let tree = target_dir
        .join("stage")
        .join(format!("gpufrac-{}", ws.version));
    stage(ws, &target_dir.join(TARGET).join("release"), &tree)?;
    Ok(tree)
}

fn dist(out_dir: Option<PathBuf>) -> Result<(), String> {
    let ws = workspace()?;
    let out_dir = out_dir.unwrap_or_else(|| ws.root.join("dist"));
    let tree = release_tree(&ws)?;
    fs::create_dir_all(&out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let out = out_dir.join(format!("gpufrac-{}-{TARGET}.tar.gz", ws.version));
    tarball(&tree, &out)?;
    println!("{}", out.display());
    Ok(())
}

/// `opts`: --prefix, --destdir and --unitdir, passed on to install.sh.
fn install(opts: [Option<String>; 3]) -> Result<(), String> {
    let ws = workspace()?;
    run(cargo().current_dir(&ws.root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "gpufrac",
        "-p",
        "gpufrac-shim",
    ]))?;
    let dest = ws
        .target
        .join("install-stage")
        .join(format!("gpufrac-{}", ws.version));
    stage(&ws, &ws.target.join("release"), &dest)?;
    let script = dest.join("install.sh");
    let mut sh_args = Vec::new();
    for (name, value) in ["--prefix", "--destdir", "--unitdir"].iter().zip(opts) {
        if let Some(v) = value {
            sh_args.extend([name.to_string(), v]);
        }
    }
    // Building as root would leave root-owned files in the checkout, so a
    // prefix only root can write is finished by hand, from the stage.
    run(Command::new("sh").arg(&script).args(&sh_args)).map_err(|e| {
        format!(
            "{e}\nThe build is staged in {}; if that was for want of permission, finish as root \
             with:\n\n    sudo sh {} {}\n",
            dest.display(),
            script.display(),
            sh_args.join(" ")
        )
    })
}

/// "1.88" or "1.88.0" as (1, 88, 0).
fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let mut it = v.split('.').map(|p| p.parse::<u64>().ok());
    let major = it.next()??;
    let minor = it.next().unwrap_or(Some(0))?;
    let patch = it.next().unwrap_or(Some(0))?;
    it.next().is_none().then_some((major, minor, patch))
}

/// `redteam search` in a release build: the broker's core runs there as
/// it does in the release, ten times faster than in a debug build.
fn redteam(args: &[String]) -> Result<(), String> {
    let ws = workspace()?;
    run(cargo()
        .current_dir(&ws.root)
        .args([
            "run",
            "--release",
            "--quiet",
            "-p",
            "gpufrac-redteam",
            "--",
            "search",
        ])
        .args(args))
}

/// Every package locked for this target (dependencies of every workspace
/// member, dev-dependencies included, since the tests build at the MSRV
/// too) against the workspace's rust-version. Clippy's incompatible_msrv
/// lint checks our own use of std against the same number.
fn msrv_check() -> Result<(), String> {
    let ws = workspace()?;
    let ours = parse_version(&ws.rust_version).ok_or_else(|| {
        format!(
            "the workspace's rust-version {:?} is not a version",
            ws.rust_version
        )
    })?;
    let m = metadata(&["--locked", "--filter-platform", TARGET])?;
    let members: Vec<&str> = m["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let packages = m["packages"]
        .as_array()
        .ok_or("cargo metadata: no packages")?;
    let (mut too_new, mut unset_members, mut declared) = (Vec::new(), Vec::new(), 0);
    let mut highest: Option<((u64, u64, u64), String)> = None;
    for p in packages {
        let name = format!(
            "{} {}",
            p["name"].as_str().unwrap_or("?"),
            p["version"].as_str().unwrap_or("?")
        );
        let member = members.contains(&p["id"].as_str().unwrap_or_default());
        let Some(rv) = p["rust_version"].as_str() else {
            if member {
                unset_members.push(name);
            }
            continue;
        };
        let v = parse_version(rv).ok_or_else(|| format!("{name}: bad rust-version {rv:?}"))?;
        if member {
            if v != ours {
                too_new.push(format!("member {name} declares rust-version {rv}"));
            }
            continue;
        }
        declared += 1;
        if v > ours {
            too_new.push(format!("{name} needs Rust {rv}"));
        }
        if highest.as_ref().is_none_or(|(h, _)| v > *h) {
            highest = Some((v, format!("{name} ({rv})")));
        }
    }
    println!(
        "msrv-check: rust-version {}; of {} dependencies locked for {TARGET}, {declared} declare a rust-version, the highest {}",
        ws.rust_version,
        packages.len() - members.len(),
        highest.map_or("none".to_owned(), |(_, n)| n)
    );
    if !unset_members.is_empty() {
        println!(
            "msrv-check: note: these members declare no rust-version, so clippy's incompatible_msrv does not check them: {}",
            unset_members.join(", ")
        );
    }
    if too_new.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the workspace claims rust-version {}, but:\n  {}\nraise rust-version in Cargo.toml or pin these dependencies to older releases (cargo update -p NAME --precise VERSION)",
            ws.rust_version,
            too_new.join("\n  ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(parse_version("1.88"), Some((1, 88, 0)));
        assert_eq!(parse_version("1.88.1"), Some((1, 88, 1)));
        assert_eq!(parse_version("1"), Some((1, 0, 0)));
        assert!(parse_version("1.88.0") < parse_version("1.88.1"));
        assert!(parse_version("1.9") < parse_version("1.88"));
        assert_eq!(parse_version("1.x"), None);
        assert_eq!(parse_version("1.2.3.4"), None);
    }

    #[test]
    fn task_parsing() {
        let p =
            |v: &[&str]| Task::try_parse_from(std::iter::once("xtask").chain(v.iter().copied()));
        assert!(matches!(
            p(&["install", "--prefix", "/p", "--destdir=/d"]).unwrap(),
            Task::Install { prefix: Some(ref a), destdir: Some(ref b), unitdir: None }
                if a == "/p" && b == "/d"
        ));
        assert!(p(&["install", "--prefix"]).is_err());
        assert!(p(&["install", "--prefix=/a", "--prefix=/b"]).is_err());
        assert!(p(&["install", "--prefix", "relative"]).is_err());
        assert!(p(&["dist", "--bogus=1"]).is_err());
        assert!(p(&["msrv-check"]).is_ok());
    }
}
