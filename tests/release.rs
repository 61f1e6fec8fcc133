//! The release as a user gets it: `cargo xtask dist` builds a tarball whose
//! binaries need glibc 2.28 at most, whose install.sh lays it out under any
//! prefix, whose gpufrac finds its shim there and caps memory, and whose
//! systemd unit passes `systemd-analyze verify` and starts a broker with its
//! ExecStart line as written. Also: a gpufrac without its library says what
//! to do, and the workspace's rust-version holds for every locked crate.
//!
//! The tarball is a release build with cargo-zigbuild, unoptimised but for
//! the shim (`dist::release_profile` says why, and how to test the
//! optimised one); it is made once per run of this file, in the
//! workspace's target/dist (so a second run only relinks what changed),
//! and written there too (`--out-dir`), not to the repository's dist/.
//! cargo-zigbuild and zig are installed from PyPI into the test cache when
//! they are missing (docs/testing.md). These are engine tests:
//! GPUFRAC_TEST_ENGINES=0 skips the ones that need the
//! tarball.

#[path = "support/dist.rs"]
mod dist;
#[path = "support/engines.rs"]
mod engines;
mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use dist::{cargo, out, xtask_release};
use support::*;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const WHAT: &str = "the release tests (cargo xtask dist with zig)";

/// Where the test's tarball goes: under target/, beside the objects xtask
/// builds it from, not the repository's dist/.
fn out_dir() -> PathBuf {
    target_dir().join("dist")
}

/// The tarball `cargo xtask dist` made, once per run; None when the engine
/// tests are skipped or its tools could not be had (said loudly).
fn tarball() -> Option<&'static Path> {
    static T: OnceLock<Option<PathBuf>> = OnceLock::new();
    T.get_or_init(|| {
        let t = std::time::Instant::now();
        let dir = out_dir();
        let o = xtask_release(WHAT, &["dist", "--out-dir", dir.to_str()?])?;
        assert!(o.status.success(), "cargo xtask dist failed:\n{}", out(&o));
        let path = PathBuf::from(stdout(&o).lines().last().unwrap_or_default().trim());
        let want = format!("gpufrac-{VERSION}-x86_64-unknown-linux-gnu.tar.gz");
        assert_eq!(
            path.file_name().and_then(|n| n.to_str()),
            Some(want.as_str()),
            "{}",
            out(&o)
        );
        assert_eq!(path.parent(), Some(out_dir().as_path()));
        assert!(path.is_file(), "{} is missing", path.display());
        say(&format!(
            "cargo xtask dist took {:.1} s",
            t.elapsed().as_secs_f64()
        ));
        Some(path)
    })
    .as_deref()
}

/// The tarball unpacked into `dir`: returns gpufrac-VERSION/ inside it.
fn unpack(tarball: &Path, dir: &Path) -> PathBuf {
    let o = Command::new("tar")
        .arg("-xzf")
        .arg(tarball)
        .arg("-C")
        .arg(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "tar -x: {}", out(&o));
    dir.join(format!("gpufrac-{VERSION}"))
}

/// Runs the unpacked tarball's install.sh with `args`.
fn install_sh(tree: &Path, args: &[&str]) -> Output {
    let o = Command::new("sh")
        .arg(tree.join("install.sh"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "install.sh {args:?}: {}", out(&o));
    o
}

/// A fresh install of the tarball under `scratch/prefix`; returns the
/// prefix.
fn installed(scratch: &Scratch) -> Option<PathBuf> {
    let tree = unpack(tarball()?, &scratch.0);
    let prefix = scratch.0.join("prefix");
    install_sh(&tree, &["--prefix", prefix.to_str().unwrap()]);
    Some(prefix)
}

#[test]
fn tarball_holds_the_release_and_install_sh_lays_it_out_under_a_prefix() {
    let Some(tarball) = tarball() else { return };
    let o = Command::new("tar")
        .arg("-tzf")
        .arg(tarball)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let mut files: Vec<String> = stdout(&o)
        .lines()
        .filter(|l| !l.ends_with('/'))
        .map(str::to_owned)
        .collect();
    files.sort();
    let want: Vec<String> = [
        "LICENSE",
        "README.md",
        "SECURITY.md",
        "bin/gpufrac",
        "include/gpufrac.h",
        "install.md",
        "install.sh",
        "lib/libgpufrac.so",
        "lib/systemd/system/gpufrac-broker.service",
        "lib/systemd/system/gpufrac-cdi.service",
        "libexec/gpufrac-task-prolog",
        "share/gpufrac/k8s/daemonset.yaml",
        "share/gpufrac/k8s/pod-example.yaml",
        "share/gpufrac/slurm/gres.conf.example",
        "share/gpufrac/slurm/slurm.conf.example",
    ]
    .iter()
    .map(|f| format!("gpufrac-{VERSION}/{f}"))
    .collect();
    assert_eq!(files, want);

    let s = Scratch::new("dist-layout");
    let tree = unpack(tarball, &s.0);
    let license = std::fs::read_to_string(tree.join("LICENSE")).unwrap();
    assert!(
        license.contains("Apache License") && license.contains("Version 2.0, January 2004"),
        "LICENSE is not the Apache-2.0 text"
    );

    // A package build: staged under DESTDIR, every path inside naming the
    // real prefix.
    let destdir = s.0.join("destdir");
    let prefix = "/opt/gpufrac";
    let args = ["--prefix", prefix, "--destdir", destdir.to_str().unwrap()];
    install_sh(&tree, &args);
    let root = destdir.join("opt/gpufrac");
    for (f, mode) in [
        ("bin/gpufrac", 0o755),
        ("lib/libgpufrac.so", 0o755),
        ("include/gpufrac.h", 0o644),
        ("libexec/gpufrac-task-prolog", 0o755),
        ("lib/systemd/system/gpufrac-cdi.service", 0o644),
        ("share/gpufrac/k8s/daemonset.yaml", 0o644),
        ("share/gpufrac/slurm/slurm.conf.example", 0o644),
        ("lib/systemd/system/gpufrac-broker.service", 0o644),
        ("share/doc/gpufrac/install.md", 0o644),
        ("share/doc/gpufrac/LICENSE", 0o644),
    ] {
        let m = std::fs::metadata(root.join(f))
            .unwrap_or_else(|e| panic!("{f} not installed: {e}"))
            .permissions()
            .mode();
        assert_eq!(m & 0o777, mode, "{f}: mode {m:o}");
    }
    let unit =
        std::fs::read_to_string(root.join("lib/systemd/system/gpufrac-broker.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("no ExecStart");
    assert!(
        exec.starts_with("/opt/gpufrac/bin/gpufrac broker "),
        "{exec}"
    );
    assert!(
        !unit.contains("/usr/local/") && !unit.contains(destdir.to_str().unwrap()),
        "the unit names another prefix or the staging directory:\n{unit}"
    );
    let prolog = std::fs::read_to_string(root.join("libexec/gpufrac-task-prolog")).unwrap();
    assert!(
        prolog.contains("exec /opt/gpufrac/bin/gpufrac slurm-task-prolog")
            && !prolog.contains("/usr/local/"),
        "the Slurm TaskProlog names another prefix:\n{prolog}"
    );
    for f in [
        "lib/systemd/system/gpufrac-cdi.service",
        "share/gpufrac/k8s/daemonset.yaml",
    ] {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        assert!(
            text.contains("/opt/gpufrac/bin/gpufrac") && !text.contains("/usr/local/"),
            "{f} names another prefix:\n{text}"
        );
    }

    let v = Command::new(root.join("bin/gpufrac"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", out(&v));
    assert_eq!(stdout(&v).trim(), format!("gpufrac {VERSION}"));

    let mut un = args.to_vec();
    un.push("--uninstall");
    install_sh(&tree, &un);
    let mut left = Vec::new();
    let mut dirs = vec![destdir.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                left.push(p);
            }
        }
    }
    assert!(left.is_empty(), "--uninstall left {left:?}");
}

#[test]
fn installed_gpufrac_run_finds_its_shim_and_caps_memory() {
    let s = Scratch::new("dist-run");
    let Some(prefix) = installed(&s) else { return };
    let probe = artifacts().probe.display().to_string();
    let mut cmd = sim_command(prefix.join("bin/gpufrac"), "16G", false);
    cmd.env_remove("GPUFRAC_BROKER")
        .args(["run", "--socket", "/nonexistent/gpufrac.sock"])
        .args(["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(format!(
            "echo preload=$LD_PRELOAD; exec {probe} ctx info fill alloc 64M"
        ));
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let shim = prefix.join("lib/libgpufrac.so").canonicalize().unwrap();
    assert!(
        stdout(&o).contains(&format!("preload={}\n", shim.display())),
        "the child was not preloaded with the installed shim:\n{}",
        out(&o)
    );
    let info = line(&o, "info", 0);
    assert_eq!(num(&info, "total"), GIB, "{info:?}");
    // 16 blocks of 64 MiB fill 1 GiB exactly; the 17th is refused.
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16, "{}", out(&o));
}

/// The glibc symbol versions an ELF file needs, and its strong undefined
/// symbols that glibc does not version: one the 2.28 stubs lack is left
/// unversioned for the loader to fail on, and our binaries link nothing
/// but glibc.
fn glibc_needs(f: &Path) -> (Vec<(u32, u32)>, Vec<String>) {
    let o = Command::new("objdump")
        .arg("-T")
        .arg(f)
        .output()
        .unwrap_or_else(|e| panic!("objdump (binutils) is needed to check the glibc floor: {e}"));
    assert!(
        o.status.success(),
        "objdump -T {}: {}",
        f.display(),
        out(&o)
    );
    let mut versions = Vec::new();
    let mut foreign = Vec::new();
    for l in stdout(&o).lines() {
        // "0000000000000000      DF *UND*\t0000000000000000 (GLIBC_2.2.5) memcpy",
        // "Base" or nothing in place of the version when there is none, and
        // "w" in the flags for a weak reference.
        let fields: Vec<&str> = l.split_whitespace().collect();
        let Some(i) = fields.iter().position(|f| *f == "*UND*") else {
            continue;
        };
        let version = fields.get(i + 2).filter(|_| fields.len() == i + 4);
        match version.and_then(|v| v.trim_matches(['(', ')']).strip_prefix("GLIBC_")) {
            Some(v) => {
                let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
                versions.push((it.next().unwrap_or(0), it.next().unwrap_or(0)));
            }
            None => {
                let weak = l.get(17..24).is_some_and(|flags| flags.contains('w'));
                if !weak {
                    foreign.push(fields.last().unwrap().to_string());
                }
            }
        }
    }
    (versions, foreign)
}

#[test]
fn every_binary_in_the_tarball_needs_glibc_2_28_at_most() {
    let Some(tarball) = tarball() else { return };
    let s = Scratch::new("dist-glibc");
    let tree = unpack(tarball, &s.0);
    let mut elves = Vec::new();
    let mut dirs = vec![tree];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if std::fs::read(&p).unwrap().starts_with(b"\x7fELF") {
                elves.push(p);
            }
        }
    }
    elves.sort();
    assert_eq!(
        elves.len(),
        2,
        "expected the binary and the shim: {elves:?}"
    );
    for f in &elves {
        let (versions, unversioned) = glibc_needs(f);
        let max = versions.iter().max().copied();
        assert!(
            max.is_some(),
            "{}: no GLIBC_ versions: not dynamically linked against glibc?",
            f.display()
        );
        assert!(
            max <= Some((2, 28)),
            "{} needs GLIBC_{}.{}, above the 2.28 floor",
            f.display(),
            max.unwrap().0,
            max.unwrap().1
        );
        assert!(
            unversioned.is_empty(),
            "{}: undefined symbols that glibc 2.28 does not provide: {unversioned:?}",
            f.display()
        );
    }
}

/// `systemd-analyze`, installed from the distribution when missing.
fn systemd_analyze() -> bool {
    let have = || {
        Command::new("systemd-analyze")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if have() {
        return true;
    }
    match apt_install("systemd-analyze in the release tests", &["systemd"], have) {
        Ok(()) => true,
        Err(why) => cannot(WHAT, &format!("systemd-analyze is missing: {why}")),
    }
}

#[test]
fn installed_unit_passes_systemd_analyze_verify() {
    let s = Scratch::new("dist-verify");
    let Some(prefix) = installed(&s) else { return };
    if !systemd_analyze() {
        return;
    }
    let unit = prefix.join("lib/systemd/system/gpufrac-broker.service");
    let o = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .unwrap();
    // verify exits 0 on unknown keys and bad values too, after a warning
    // that names the file.
    assert!(
        o.status.success() && !out(&o).contains("gpufrac-broker.service"),
        "systemd-analyze verify {}:\n{}",
        unit.display(),
        out(&o)
    );
    // Settings that would blind the broker: it reads other users' /proc
    // entries for ancestry and commands, and needs the real /dev/nvidia*.
    let text = std::fs::read_to_string(&unit).unwrap();
    for bad in [
        "ProtectProc=",
        "ProcSubset=",
        "PrivateDevices=yes",
        "PrivateUsers=",
    ] {
        assert!(
            !text.lines().any(|l| l.starts_with(bad)),
            "the unit sets {bad}"
        );
    }
}

/// `key=value` settings of one section of a unit file, in order.
fn unit_section(text: &str, section: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut v = Vec::new();
    let mut cont = String::new();
    for l in text.lines() {
        let l = l.trim();
        if l.starts_with('[') {
            inside = l == format!("[{section}]");
            continue;
        }
        if !inside || l.starts_with('#') || l.starts_with(';') {
            continue;
        }
        if let Some(part) = l.strip_suffix('\\') {
            cont.push_str(part);
            cont.push(' ');
            continue;
        }
        let full = std::mem::take(&mut cont) + l;
        if let Some((k, val)) = full.split_once('=') {
            v.push((k.trim().to_owned(), val.trim().to_owned()));
        }
    }
    v
}

fn setting<'a>(s: &'a [(String, String)], key: &str) -> &'a str {
    let mut it = s.iter().filter(|(k, _)| k == key);
    let (_, v) = it
        .next()
        .unwrap_or_else(|| panic!("the unit has no {key}="));
    assert!(it.next().is_none(), "{key}= is set twice");
    v
}

/// This process's group, which stands in for the unit's `gpufrac` group.
fn own_group() -> (u32, String) {
    // SAFETY: getgrgid's result is read before any other call that could
    // overwrite it.
    unsafe {
        let gid = libc::getegid();
        let g = libc::getgrgid(gid);
        assert!(!g.is_null(), "no group entry for gid {gid}");
        let name = std::ffi::CStr::from_ptr((*g).gr_name)
            .to_string_lossy()
            .into_owned();
        (gid, name)
    }
}

#[test]
fn installed_unit_execstart_starts_a_broker_that_answers_and_stops_cleanly() {
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new("dist-unit");
    let Some(prefix) = installed(&s) else { return };
    let text =
        std::fs::read_to_string(prefix.join("lib/systemd/system/gpufrac-broker.service")).unwrap();
    let svc = unit_section(&text, "Service");
    let exec = setting(&svc, "ExecStart");
    assert!(
        !exec.contains(['"', '\'', '$', '%']),
        "ExecStart needs systemd's quoting or expansion, which this test does not do: {exec}"
    );
    let runtime = format!("/run/{}", setting(&svc, "RuntimeDirectory"));
    let mode = u32::from_str_radix(setting(&svc, "RuntimeDirectoryMode"), 8).unwrap();
    let group = setting(&svc, "Group");

    // What systemd makes before it starts the broker, here under the
    // scratch directory: the runtime directory, with the unit's mode.
    let run_dir = s.0.join("run").join(setting(&svc, "RuntimeDirectory"));
    std::fs::create_dir_all(&run_dir).unwrap();
    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(mode)).unwrap();
    let (gid, own) = own_group();
    let mut argv: Vec<String> = Vec::new();
    let mut words = exec.split_whitespace().peekable();
    while let Some(w) = words.next() {
        if w == "--group" {
            let g = words.next().expect("--group without a value");
            // The socket's group must be the one the directory admits.
            assert_eq!(g, group, "--group differs from Group=");
            argv.extend(["--group".to_owned(), own.clone()]);
        } else if let Some(rest) = w.strip_prefix(&runtime) {
            argv.push(format!("{}{rest}", run_dir.display()));
        } else {
            argv.push(w.to_owned());
        }
    }
    assert_eq!(
        Path::new(&argv[0]),
        prefix.join("bin/gpufrac"),
        "ExecStart does not run the installed binary"
    );
    let socket = argv
        .iter()
        .skip_while(|a| *a != "--socket")
        .nth(1)
        .map(PathBuf::from)
        .expect("ExecStart names no --socket");
    assert_eq!(socket.parent(), Some(run_dir.as_path()));

    // Its log goes to a file (the journal's part), read when it fails.
    let log = s.0.join("broker.log");
    let mut cmd = sim_command(&argv[0], "16G,8G", false);
    cmd.args(&argv[1..])
        .env("GPUFRAC_SIM_STATE", s.0.join("sim-state"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut broker = KillOnDrop(cmd.spawn().expect("starting the unit's ExecStart"));
    let log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until(20.0, "the broker's socket", || {
        if let Ok(Some(st)) = broker.0.try_wait() {
            panic!("the broker exited: {st}\n{}", log());
        }
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o660, "socket mode {:o}", meta.mode());
    assert_eq!(meta.gid(), gid);

    let status = |json: bool| {
        let mut c = Command::new(prefix.join("bin/gpufrac"));
        c.arg("status").arg("--socket").arg(&socket);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    let o = status(false);
    assert!(o.status.success(), "gpufrac status: {}", out(&o));
    let o = status(true);
    assert!(o.status.success(), "gpufrac status --json: {}", out(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["gpus"].as_array().map(Vec::len), Some(2), "{j}");
    assert_eq!(j["version"], VERSION, "{j}");

    // systemd stops it with SIGTERM (KillMode=process): it must leave by
    // itself, its socket left in place for the next start to rename its
    // own over (the path is never free for another to take).
    // SAFETY: signalling a child this test owns.
    unsafe { libc::kill(broker.0.id() as i32, libc::SIGTERM) };
    let mut code = None;
    wait_until(20.0, "the broker to exit on SIGTERM", || {
        code = broker.0.try_wait().unwrap();
        code.is_some()
    });
    assert!(
        code.unwrap().success(),
        "exit after SIGTERM: {code:?}\n{}",
        log()
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&socket).is_ok_and(|m| m.file_type().is_socket()),
        "the stop freed the socket's path"
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_err(),
        "something still listens after the stop"
    );
}

#[test]
fn gpufrac_without_its_library_says_what_to_do_and_gpufrac_lib_points_to_it() {
    let a = artifacts();
    let s = Scratch::new("dist-nolib");
    // A bare `cargo install`: the binary alone in a bin directory.
    let bin = s.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    copy_executable(&a.gpufrac, &bin.join("gpufrac"));
    let run = |lib: Option<&Path>| {
        let mut c = sim_command(bin.join("gpufrac"), "16G", false);
        c.env_remove("GPUFRAC_BROKER")
            .args(["run", "--socket", "/nonexistent/gpufrac.sock", "--"])
            .args(["sh", "-c", "echo preload=$LD_PRELOAD"]);
        if let Some(l) = lib {
            c.env("GPUFRAC_LIB", l);
        }
        c.output().unwrap()
    };

    let o = run(None);
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    let e = stderr(&o);
    for want in [
        "cannot find libgpufrac.so",
        &bin.join("libgpufrac.so").display().to_string(),
        &s.0.join("lib/libgpufrac.so").display().to_string(),
        "cargo xtask install",
        "GPUFRAC_LIB",
    ] {
        assert!(e.contains(want), "{want:?} missing from:\n{e}");
    }

    let shim = a.shim.canonicalize().unwrap();
    for lib in [shim.clone(), shim.parent().unwrap().to_path_buf()] {
        let o = run(Some(&lib));
        assert!(
            o.status.success(),
            "GPUFRAC_LIB={}: {}",
            lib.display(),
            out(&o)
        );
        assert_eq!(
            stdout(&o).trim(),
            format!("preload={}", shim.display()),
            "GPUFRAC_LIB={}",
            lib.display()
        );
    }

    let missing = s.0.join("nowhere/libgpufrac.so");
    let o = run(Some(&missing));
    assert_eq!(o.status.code(), Some(1), "{}", out(&o));
    assert!(
        stderr(&o).contains(&format!("GPUFRAC_LIB={}", missing.display())),
        "{}",
        out(&o)
    );
}

#[test]
fn no_locked_dependency_needs_a_newer_rust_than_rust_version() {
    let o = cargo()
        .args(["xtask", "msrv-check"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "cargo xtask msrv-check:\n{}", out(&o));
    assert!(
        stdout(&o).contains(&format!(
            "msrv-check: rust-version {};",
            env!("CARGO_PKG_RUST_VERSION")
        )),
        "{}",
        out(&o)
    );
}

/// The `args:` of the broker's container in deploy/k8s/broker/daemonset.yaml,
/// read as a list of plain scalars (tests/k8s.rs checks the whole manifest
/// against Kubernetes' schema).
fn daemonset_args() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s/broker/daemonset.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "args:").skip(1);
    let mut args = Vec::new();
    for l in lines.by_ref() {
        let l = l.trim();
        if l.starts_with('#') {
            continue;
        }
        let Some(a) = l.strip_prefix("- ") else { break };
        args.push(a.trim_matches('"').to_owned());
    }
    assert!(!args.is_empty(), "no args: in {}", path.display());
    args
}

/// An image tag removed from the tests' Podman store when dropped, however
/// the test ends.
struct Image(String);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = engines::Engine::Podman
            .command()
            .args(["rmi", "-f", &self.0])
            .stdin(Stdio::null())
            .output();
    }
}

/// The status line of `GET path` on the container's port 9400, asked from
/// inside its network namespace (the tests' containers have no network but
/// their own loopback) with bash's /dev/tcp: the image has no HTTP client.
fn http_in(ct: &engines::Container, path: &str) -> String {
    let script = format!(
        "exec 3<>/dev/tcp/127.0.0.1/9400 && printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' >&3 \
         && IFS= read -r l <&3 && printf '%s\\n' \"$l\""
    );
    let o = engines::Engine::Podman
        .command()
        .args(["exec", &ct.name, "bash", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    stdout(&o).trim().to_owned()
}

/// The image deploy/container/Containerfile builds from the release
/// tarball, with Podman (runc), on the tests' sealed Debian root in place
/// of debian:bookworm-slim (no registry is reachable). Its default command
/// is the DaemonSet's arguments, and it runs as the DaemonSet runs it (the
/// host's pid namespace, the host's socket directory, privileged): its
/// probes answer 200, it serves a process under the host's shim, which
/// registers with it and is capped by it, and `gpufrac status` on the host
/// sees it. Then a rollout: the pod stopped as the kubelet stops it
/// (SIGTERM, the DaemonSet's grace) exits cleanly, keeping the running
/// job's lease in the host's socket directory, and the next pod's broker
/// has it booked again, claimed back by its `gpufrac run`, and the same
/// process registered again, its cap kept.
#[test]
fn the_release_image_builds_and_its_broker_serves_a_shim() {
    let Some(tarball) = tarball() else { return };
    if !engines::ensure_podman() {
        return;
    }
    let base = engines::image(engines::Engine::Podman);
    let image = Image(format!("localhost/gpufrac-release-test:{VERSION}"));
    let tag = image.0.as_str();
    let containerfile =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/container/Containerfile");
    let name = tarball.file_name().unwrap().to_str().unwrap();
    let o = engines::Engine::Podman
        .command()
        .args(["build", "--network", "none", "-f"])
        .arg(&containerfile)
        .args(["--build-arg", &format!("BASE={base}")])
        .args(["--build-arg", &format!("RELEASE={name}")])
        .args(["-t", tag])
        .arg(tarball.parent().unwrap())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "podman build:\n{}", out(&o));
    // The image's own command is what the DaemonSet runs, so that the pod
    // and a plain `podman run` of the image start the same broker.
    let o = engines::Engine::Podman
        .command()
        .args(["image", "inspect", "--format", "{{json .Config.Cmd}}", tag])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", out(&o));
    let cmd: Vec<String> = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        cmd,
        daemonset_args(),
        "the image's CMD and the DaemonSet's args"
    );

    // The host's socket directory, as the DaemonSet mounts it.
    let run = Scratch::new("image-run");
    std::fs::set_permissions(&run.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let state = run.0.join("sim").join("state");
    std::fs::create_dir_all(state.parent().unwrap()).unwrap();
    let mut args: Vec<String> = vec![
        "--pid".into(),
        "host".into(),
        "--privileged".into(),
        "-v".into(),
        format!("{}:/run/gpufrac", run.0.display()),
        "-e".into(),
        "RUST_LOG=info".into(),
    ];
    args.extend(engines::sim_driver_args());
    args.extend(engines::sim_state_args("16G", &state));
    args.push(tag.to_owned());
    let socket = run.0.join("broker.sock");
    let pod = || {
        let ct = engines::Container::run(engines::Engine::Podman, &args);
        wait_until(
            60.0,
            "the image's broker answering on the host's socket",
            || try_status_cli(&socket).is_ok(),
        );
        ct
    };
    let ct = pod();
    let st = status_cli(&socket);
    assert_eq!(
        st["gpus"].as_array().map(Vec::len),
        Some(1),
        "{st}\n{}",
        ct.stderr()
    );
    // The kubelet's probes, on the port the DaemonSet names.
    for path in ["/readyz", "/healthz", "/metrics"] {
        let line = http_in(&ct, path);
        assert!(
            line.starts_with("HTTP/1.") && line.contains(" 200"),
            "GET {path}: {line:?}\n{}",
            ct.stderr()
        );
    }

    // A job on the host, `gpufrac run` of a process under the host's
    // shim, booked and capped at 1 GiB by the broker in the image: the
    // process registers there and fills to its cap.
    let stop = run.0.join("stop");
    let mut p = sim_command(&artifacts().gpufrac, "16G", false);
    p.env_remove("GPUFRAC_BROKER")
        .env("GPUFRAC_SIM_STATE", &state)
        .args(["run", "--socket"])
        .arg(&socket)
        .args(["--gpu-memory", "1G", "--"])
        .arg(&artifacts().probe)
        .args(["ctx", "fill", "alloc", "64M", "wait-file"])
        .arg(&stop)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut p = Reap(Some(p.spawn().unwrap()));
    let run_pid = u64::from(p.0.as_ref().unwrap().id());
    let capped = |st: &serde_json::Value| -> Option<u64> {
        st["gpus"][0]["processes"]
            .as_array()?
            .iter()
            .find(|x| x["mem_used"] == 1u64 << 30 && x["mem_cap"] == 1u64 << 30)?["pid"]
            .as_u64()
    };
    let mut pid = None;
    wait_until(
        30.0,
        "the host's process registered with the image's broker, at its cap",
        || {
            pid = try_status_cli(&socket).ok().and_then(|st| capped(&st));
            pid.is_some()
        },
    );
    let st = status_cli(&socket);
    assert_eq!(
        st["leases"].as_array().map(Vec::len),
        Some(1),
        "the run's lease: {st}"
    );

    // A rollout: the kubelet stops the pod with SIGTERM and waits the
    // DaemonSet's terminationGracePeriodSeconds (30) before killing it.
    let o = engines::Engine::Podman
        .command()
        .args(["stop", "--time", "30", &ct.name])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "podman stop: {}", out(&o));
    let (status, _) = ct.finish(40);
    assert!(status.success(), "the broker's clean stop: {status}");
    // The socket stays, stale, so that the path is never free for another
    // user to take between two pods (docs/broker.md).
    assert!(
        try_status_cli(&socket).is_err(),
        "nothing answers between two pods"
    );
    // The clean stop kept the running job's lease, in the broker's state
    // directory under the host's socket directory, for the next pod.
    let kept: Vec<PathBuf> = std::fs::read_dir(run.0.join("state"))
        .map(|d| d.map(|e| e.unwrap().path().join("state")).collect())
        .unwrap_or_default();
    assert!(
        kept.len() == 1 && kept[0].is_file(),
        "the state kept for the next pod: {kept:?}"
    );
    // The next pod books it before it serves anyone, the run claims it
    // back (docs/k8s.md, "Upgrading"), and the same process registers
    // again, its cap kept.
    let ct = pod();
    let claimed = |st: &serde_json::Value| {
        st["leases"]
            .as_array()
            .is_some_and(|l| l.len() == 1 && l[0]["pid"] == run_pid && l[0]["connected"] == true)
    };
    wait_until(
        30.0,
        "the run's lease claimed back from the next pod's broker, its process registered again at its cap",
        || try_status_cli(&socket).is_ok_and(|st| claimed(&st) && capped(&st) == pid),
    );

    std::fs::write(&stop, "").unwrap();
    let o = p.0.take().unwrap().wait_with_output().unwrap();
    assert!(o.status.success(), "{}", out(&o));
    assert!(stdout(&o).contains("fill count=16 rc=2"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("lease claimed back from the restarted broker")
            && !stderr(&o).contains("unbooked"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        status_cli(&socket)["leases"].as_array().map(Vec::len),
        Some(0)
    );
    drop(ct);
}
