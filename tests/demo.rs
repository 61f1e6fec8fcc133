//! `./demo.sh shares`, `./demo.sh env` and `./demo.sh container`, end to
//! end, as a newcomer runs them: the script builds what it needs (nothing,
//! after the test artifacts), sets up the simulated driver itself, starts
//! and stops its own broker, and reports shares and priorities, or a
//! sealed image's memory cap under Podman.

#[path = "support/engines.rs"]
mod engines;
mod support;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};
use support::*;

/// `./demo.sh ARGS` on the profile and target directory the tests use, in
/// an environment without anything gpufrac reads.
fn demo(args: &[&str]) -> Output {
    demo_with(args, &[])
}

/// `demo` with these variables set too.
fn demo_with(args: &[&str], vars: &[(&str, &std::ffi::OsStr)]) -> Output {
    let a = artifacts();
    let profile = a.dir.file_name().unwrap().to_str().unwrap();
    let mut cmd = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.sh"));
    scrub_env(&mut cmd)
        .args(args)
        .env("GPUFRAC_DEMO_PROFILE", profile)
        .env("CARGO", env!("CARGO"))
        .env("CARGO_TARGET_DIR", a.dir.parent().unwrap())
        .envs(vars.iter().copied())
        .output()
        .expect("running demo.sh")
}

/// The number after `key` on the line that has it, e.g. `got 69.7%`.
fn figure(out: &str, line_has: &str, key: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.contains(line_has))
        .unwrap_or_else(|| panic!("no line with {line_has:?} in:\n{out}"));
    let after = line.split_once(key).map(|(_, r)| r).unwrap_or("");
    let num: String = after
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse()
        .unwrap_or_else(|_| panic!("no number after {key:?} in {line:?}"))
}

/// `demo(args)`, as root in a mount namespace of its own whose /run is
/// empty at the start: with what it left under /run (None, said loudly,
/// where the machine cannot: not root, no unshare).
fn demo_in_an_empty_run(args: &[&str]) -> (Output, Option<String>) {
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let probe = root
        && Command::new("unshare")
            .args(["-m", "true"])
            .status()
            .is_ok_and(|s| s.success());
    if !probe {
        skip_banner(
            "what the demo leaves under /run",
            "it runs the demo in a mount namespace of its own, which needs root and unshare",
        );
        return (demo(args), None);
    }
    let s = Scratch::new("demo-run");
    let left = s.0.join("left");
    let a = artifacts();
    let profile = a.dir.file_name().unwrap().to_str().unwrap();
    let mut cmd = Command::new("unshare");
    scrub_env(&mut cmd)
        .args(["-m", "sh", "-c"])
        .arg(
            "mount -t tmpfs -o mode=755 tmpfs /run || exit 99; \"$0\" \"$@\"; rc=$?; \
             ls -A /run >\"$LEFT\"; exit $rc",
        )
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.sh"))
        .args(args)
        .env("LEFT", &left)
        .env("GPUFRAC_DEMO_PROFILE", profile)
        .env("CARGO", env!("CARGO"))
        .env("CARGO_TARGET_DIR", a.dir.parent().unwrap());
    let o = cmd.output().expect("running demo.sh");
    (o, std::fs::read_to_string(&left).ok())
}

#[test]
fn shares_demo_runs_on_the_simulated_gpu_and_cleans_up() {
    let (o, left) = demo_in_an_empty_run(&["shares"]);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    // Nothing to build (the tests built it): not a word of what a first
    // build costs.
    assert!(!err.contains("== Building"), "{err}");
    // The status table, halfway, shows both jobs at their shares.
    assert!(out.contains("| GPU 0 gpufrac-sim"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("loadgen batch") && l.contains(" 70% ")),
        "{out}"
    );
    let (seventy, thirty) = (
        figure(&out, "asked 70%", "got "),
        figure(&out, "asked 30%", "got "),
    );
    assert!(seventy > thirty, "{out}");
    assert!((seventy + thirty - 100.0).abs() < 0.5, "{out}");
    let (normal, low) = (
        figure(&out, "normal, batch", ": "),
        figure(&out, "low, batch", ": "),
    );
    assert!(normal > low, "the low job outran the normal one:\n{out}");
    figure(&out, "high, interactive", "p99 ");
    figure(&out, "high, interactive", "(alone: p50 ");
    // Its broker is gone with its socket directory.
    let socket = out
        .split_whitespace()
        .find(|w| w.ends_with("/broker.sock"))
        .unwrap_or_else(|| panic!("no socket named in:\n{out}"));
    let dir = Path::new(socket).parent().unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());
    // Nothing under /run either (a broker keeps its state in
    // /run/gpufrac/state by default, as root): the demo gives its broker a
    // directory of its own.
    if let Some(left) = left {
        assert_eq!(left, "", "left under /run");
    }
}

#[test]
fn env_demo_puts_a_shell_on_the_simulated_driver() {
    let o = demo(&["env"]);
    let exports = stdout(&o);
    assert!(o.status.success(), "{exports}\n{}", stderr(&o));
    assert!(!stderr(&o).contains("== Building"), "{}", stderr(&o));
    // A shell that evaluates the exports runs a CUDA program on two
    // simulated GPUs, without anything else set.
    let probe = format!(
        "{} --block 256 --max 2",
        artifacts().dir.join("examples/cudarc_alloc").display()
    );
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!("{exports}\nexec {probe}"))
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .env_remove("GPUFRAC_SIM_DEVICES")
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("total=17179869184"), "{out}");
}

/// With something to build (here nothing built yet, and a cargo that
/// builds nothing), the demo says first what a first build costs.
#[test]
fn the_demo_says_what_a_build_costs_only_when_it_builds() {
    let empty = Scratch::new("demo-unbuilt");
    let o = demo_with(
        &["env"],
        &[
            ("CARGO", std::ffi::OsStr::new("true")),
            ("CARGO_TARGET_DIR", empty.0.as_os_str()),
        ],
    );
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.starts_with("== Building the shim and the simulated driver"),
        "{err}"
    );
}

/// The memory cap on a sealed image with Podman, as `./demo.sh container`
/// shows it: the same program stops at 64 blocks of 256 MiB alone and at 16
/// under the flags `gpufrac docker-args --gpu-memory 4G` prints, in the
/// tests' image and store (the demo makes its own image where none is
/// named). Podman keeps its own default runtime, as a newcomer's does: on
/// a host with hybrid cgroups that is Debian's crun, which cannot run
/// there, and the demo runs runc instead, saying why.
#[test]
fn container_demo_caps_a_sealed_image() {
    if !engines::ensure_podman() {
        return;
    }
    let image = engines::image(engines::Engine::Podman);
    let podman_env = engines::podman_env_default_runtime();
    let runtime = engines::podman_runtime(&podman_env);
    let refuses = engines::crun_refuses_here();
    if runtime != "crun" || refuses.is_none() {
        skip_banner(
            "the demo's choice of runc over crun",
            &format!(
                "Podman's runtime here is {runtime} and cgroups are {}: the demo runs \
                 as it is, with nothing to choose",
                if refuses.is_some() {
                    "hybrid, v2 holding controllers"
                } else {
                    "not hybrid with controllers on v2"
                }
            ),
        );
    }
    let mut vars: Vec<(&str, std::ffi::OsString)> = vec![
        ("GPUFRAC_DEMO_ENGINE", "podman".into()),
        ("GPUFRAC_DEMO_IMAGE", image.into()),
    ];
    vars.extend(podman_env.into_iter().map(|(k, v)| (k, v.into_os_string())));
    let vars: Vec<(&str, &std::ffi::OsStr)> =
        vars.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    let o = demo_with(&["container"], &vars);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    if let (Some(held), "crun") = (&refuses, runtime.as_str()) {
        assert!(
            out.contains(&format!(
                "crun cannot run on this host's hybrid cgroups (cgroup v2 holds {held}): using runc"
            )),
            "{out}"
        );
    }
    let counts: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("cudarc mode=result"))
        .collect();
    assert_eq!(counts.len(), 2, "{out}");
    assert!(counts[0].contains("count=64"), "alone: {out}");
    assert!(
        counts[1].contains("count=16") && counts[1].contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "capped: {out}"
    );
    assert!(out.contains("cudarc info free=0 total=4294967296"), "{out}");
    assert!(out.contains("gpufrac docker-args said: -v "), "{out}");
}

/// On a host where crun cannot run and runc is not there (hidden here in a
/// mount namespace of the demo's own), the container demo stops before it
/// builds anything, in one line that says what to install.
#[test]
fn container_demo_says_to_install_runc_where_crun_cannot_run() {
    if !engines::ensure_podman() {
        return;
    }
    let Some(held) = engines::crun_refuses_here() else {
        skip_banner(
            "the container demo without runc on hybrid cgroups",
            "this host's cgroups are not hybrid with controllers on v2, where crun runs",
        );
        return;
    };
    let podman_env = engines::podman_env_default_runtime();
    if engines::podman_runtime(&podman_env) != "crun" {
        skip_banner(
            "the container demo without runc on hybrid cgroups",
            "Podman's default runtime here is not crun",
        );
        return;
    }
    let nothing = Scratch::new("demo-no-runc");
    let empty = nothing.0.join("not-runc");
    std::fs::write(&empty, "").unwrap();
    // Each runc Podman would find, covered by an empty file it cannot run.
    let hide: String = [
        "/usr/local/sbin/runc",
        "/usr/local/bin/runc",
        "/usr/sbin/runc",
        "/usr/bin/runc",
        "/sbin/runc",
        "/bin/runc",
    ]
    .iter()
    .filter(|p| Path::new(p).exists())
    .map(|p| format!("mount --bind {} {p} && ", empty.display()))
    .collect();
    let a = artifacts();
    let profile = a.dir.file_name().unwrap().to_str().unwrap();
    let mut cmd = Command::new("unshare");
    scrub_env(&mut cmd)
        .args(["-m", "sh", "-c", &format!("{hide}exec \"$0\" container")])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.sh"))
        .env("GPUFRAC_DEMO_PROFILE", profile)
        .env("GPUFRAC_DEMO_ENGINE", "podman")
        // A cargo that would say so if the demo built anything.
        .env("CARGO", "false")
        .envs(podman_env);
    let o = cmd.output().expect("running unshare");
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert_eq!(
        err,
        format!(
            "./demo.sh container: Podman's runtime crun cannot run on this host's hybrid cgroups \
             (cgroup v2 holds {held}) and runc is not installed: apt-get install runc\n"
        ),
        "{out}"
    );
}

/// With Docker chosen and no daemon answering, the container demo says in
/// one line how to start one on this host: by systemd where it is PID 1's,
/// else dockerd itself.
#[test]
fn container_demo_says_how_to_start_a_docker_daemon() {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("docker").exists()));
    if !on_path {
        skip_banner(
            "the container demo without a Docker daemon",
            "no docker on PATH (apt-get install docker.io)",
        );
        return;
    }
    let dir = Scratch::new("demo-no-dockerd");
    let host = format!("unix://{}", dir.0.join("docker.sock").display());
    let o = demo_with(
        &["container"],
        &[
            ("GPUFRAC_DEMO_ENGINE", std::ffi::OsStr::new("docker")),
            ("DOCKER_HOST", std::ffi::OsStr::new(&host)),
            ("CARGO", std::ffi::OsStr::new("false")),
        ],
    );
    let (out, err) = (stdout(&o), stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let start = if Path::new("/run/systemd/system").exists() {
        "systemctl start docker"
    } else {
        "this host has no systemd to start it: run (as root) dockerd"
    };
    assert!(
        err.starts_with(&format!(
            "./demo.sh container: Docker's daemon is not running on {host}"
        )) && err.contains(start),
        "{err}"
    );
}

/// `./demo.sh top` without a terminal: a frame while two jobs share the
/// GPU at 70% and 30% and a third waits, a frame once the third runs; and
/// nothing of it left after.
#[test]
fn top_demo_shows_the_jobs_converge_and_the_queued_one_start() {
    let o = demo(&["top"]);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    let (first, second) = out
        .split_once("22 s in")
        .unwrap_or_else(|| panic!("two frames:\n{out}"));
    let jobs: Vec<&str> = first.lines().filter(|l| l.contains("▾ job")).collect();
    assert_eq!(jobs.len(), 2, "{out}");
    assert!(
        jobs[0].contains("2G/6G") && jobs[0].contains("70/"),
        "{out}"
    );
    assert!(
        jobs[1].contains("1G/8G") && jobs[1].contains("30/"),
        "{out}"
    );
    assert!(first.contains("needs 8.00 GiB on one GPU"), "{out}");
    assert!(second.contains("queue: empty"), "{out}");
    assert!(
        second
            .lines()
            .any(|l| l.contains("▾ job") && l.contains("512M/8G")),
        "the queued job runs:\n{out}"
    );
    let socket = out
        .split_whitespace()
        .find(|w| w.ends_with("/broker.sock"))
        .unwrap_or_else(|| panic!("no socket named in:\n{out}"));
    let dir = Path::new(socket).parent().unwrap();
    assert!(!dir.exists(), "{} left behind", dir.display());
    // Its broker and the jobs' processes are gone with it.
    let mine = dir.to_string_lossy().into_owned();
    wait_until(10.0, "the demo's processes to end", || {
        std::fs::read_dir("/proc").unwrap().flatten().all(|p| {
            ["cmdline", "environ"].iter().all(|f| {
                std::fs::read(p.path().join(f))
                    .map(|c| !String::from_utf8_lossy(&c).contains(&mine))
                    .unwrap_or(true)
            })
        })
    });
}

/// The README's Quickstart, as its block says.
fn quickstart() -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let after = readme
        .split_once("## Quickstart")
        .expect("a Quickstart section")
        .1;
    let block = after.split_once("```sh\n").expect("its sh block").1;
    block
        .split_once("```")
        .expect("the block's end")
        .0
        .to_owned()
}

/// The README's Quickstart, run as it is in a checkout of its own whose
/// `target/release` holds the tests' builds (a `cargo` first on PATH that
/// builds nothing) and with the broker on a socket of its own: while its
/// job runs, `gpufrac status` lists the job's process under its cap and
/// `gpufrac top --once` shows the job; the broker's log gives each job's
/// end its peak.
#[test]
fn the_quickstart_shows_a_live_job_in_status_and_top() {
    let a = artifacts();
    let s = Scratch::new("quickstart");
    let release = s.0.join("target/release");
    std::fs::create_dir_all(release.join("examples")).unwrap();
    for (from, to) in [
        (a.gpufrac.clone(), "gpufrac"),
        (a.dir.join("libgpufrac.so"), "libgpufrac.so"),
        (a.dir.join("libgpufrac_sim.so"), "libgpufrac_sim.so"),
        (a.dir.join("examples/cudarc_alloc"), "examples/cudarc_alloc"),
    ] {
        std::os::unix::fs::symlink(from, release.join(to)).unwrap();
    }
    std::os::unix::fs::symlink(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.sh"),
        s.0.join("demo.sh"),
    )
    .unwrap();
    let tools = s.0.join("tools");
    std::fs::create_dir(&tools).unwrap();
    let cargo = tools.join("cargo");
    std::fs::write(&cargo, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", tools.display(), std::env::var("PATH").unwrap());
    // Its broker stops with the block; waited for, so that its log is whole.
    let script = format!("set -e\n{}\nwait $broker\n", quickstart());
    let (out_file, err_file) = (s.0.join("out"), s.0.join("err"));
    let mut cmd = Command::new("bash");
    scrub_env(&mut cmd)
        .arg("-c")
        .arg(&script)
        .current_dir(&s.0)
        .env("PATH", path)
        .env("TMPDIR", &s.0)
        .env("GPUFRAC_SOCKET", s.0.join("broker.sock"))
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO")
        .stdout(std::fs::File::create(&out_file).unwrap())
        .stderr(std::fs::File::create(&err_file).unwrap())
        .process_group(0);
    let mut child = cmd.spawn().unwrap();
    // Bounded (a live `gpufrac top`, as the block once had, never ends),
    // and nothing of it left after, the broker it started included.
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t.elapsed() > std::time::Duration::from_secs(120) {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    // SAFETY: signalling the process group this test made.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    let read = |f: &Path| {
        let t = std::fs::read_to_string(f).unwrap_or_default();
        t.chars().take(20_000).collect::<String>()
    };
    let (out, err) = (read(&out_file), read(&err_file));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?} (None: still running after 120 s)\n{out}\n{err}"
    );
    // The status table while the job runs: its process, with its cap.
    let row = out
        .lines()
        .skip_while(|l| !(l.trim_start().starts_with("PID ") && l.contains(" ALLOCATED ")))
        .find(|l| l.contains("cudarc_alloc --max 64 --hold 10"))
        .unwrap_or_else(|| panic!("the job's process is not in status:\n{out}"));
    assert!(row.contains("4.00 GiB"), "{row}");
    // And in top's frame, its job at its cap.
    let top = out
        .split_once("gpufrac top ")
        .unwrap_or_else(|| panic!("no top frame:\n{out}"))
        .1;
    assert!(
        top.lines()
            .any(|l| l.contains("▾ job") && l.contains("/4G")),
        "{top}"
    );
    // The broker's log (in the block's mktemp -d, under TMPDIR) gives each
    // job's end its peak.
    let log = std::fs::read_dir(&s.0)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("broker.log"))
        .find(|p| p.exists())
        .expect("the Quickstart's broker log");
    let log = std::fs::read_to_string(log).unwrap();
    let ended: Vec<&str> = log.lines().filter(|l| l.contains("lease ended")).collect();
    assert_eq!(ended.len(), 2, "{log}");
    assert!(ended[0].contains("peak=\"4.00 GiB\""), "{log}");
    assert!(ended[1].contains("peak=\"1.00 GiB\""), "{log}");
    // Its state directory, named in the log, goes with it.
    if let Some(dir) = log
        .lines()
        .find_map(|l| l.split_once(" state_dir=").map(|(_, r)| r))
        .and_then(|r| r.split_whitespace().next())
    {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Cargo's plan for `cargo build ARGS` (`--unit-graph`, read on a stable
/// toolchain through RUSTC_BOOTSTRAP): each unit it would build, named by
/// what decides whether a build made by another invocation serves it
/// (package, target, mode, profile, features, platform and, recursively,
/// those of its dependencies), with a line that says which it is.
fn planned_units(args: &[&str]) -> std::collections::HashMap<String, String> {
    let o = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("build")
        .args(args)
        .args(["-Z", "unstable-options", "--unit-graph"])
        .env("RUSTC_BOOTSTRAP", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "cargo build {args:?} --unit-graph: {}",
        stderr(&o)
    );
    let g: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let units = g["units"].as_array().unwrap();
    fn key(units: &[serde_json::Value], i: usize, memo: &mut Vec<Option<String>>) -> String {
        if let Some(k) = &memo[i] {
            return k.clone();
        }
        let u = &units[i];
        let mut deps: Vec<String> = u["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| key(units, d["index"].as_u64().unwrap() as usize, memo))
            .collect();
        deps.sort();
        let whole = serde_json::json!([
            u["pkg_id"],
            u["target"]["name"],
            u["target"]["kind"],
            u["mode"],
            u["profile"],
            u["features"],
            u["platform"],
            deps
        ])
        .to_string();
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        whole.hash(&mut h);
        let k = format!("{:016x}", h.finish());
        memo[i] = Some(k.clone());
        k
    }
    let mut memo = vec![None; units.len()];
    (0..units.len())
        .map(|i| {
            let u = &units[i];
            let pkg = u["pkg_id"].as_str().unwrap_or("?");
            let what = format!(
                "{} {} ({}) features {}",
                pkg.rsplit('#').next().unwrap_or(pkg),
                u["target"]["name"].as_str().unwrap_or("?"),
                u["mode"].as_str().unwrap_or("?"),
                u["features"]
            );
            (key(units, i, &mut memo), what)
        })
        .collect()
}

/// The Quickstart's builds after `./demo.sh`: the same units, so cargo
/// compiles nothing again. (Building the example over the default members,
/// `cargo build --release --example cudarc_alloc`, let the shim's test-only
/// dependencies into feature resolution and planned 15 units the demo had
/// not built.)
#[test]
fn the_quickstart_builds_nothing_the_demo_did_not() {
    // The demo's cargo invocations, as it makes them.
    let s = Scratch::new("demo-builds");
    let record = s.0.join("cargo");
    let calls = s.0.join("calls");
    std::fs::write(
        &record,
        format!("#!/bin/sh\necho \"$*\" >>{}\n", calls.display()),
    )
    .unwrap();
    std::fs::set_permissions(&record, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for what in ["cap", "env"] {
        let o = demo_with(&[what], &[("CARGO", record.as_os_str())]);
        assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    }
    let calls = std::fs::read_to_string(&calls).unwrap();
    let mut built = std::collections::HashSet::new();
    for call in calls.lines() {
        let args: Vec<&str> = call.split_whitespace().skip(1).collect();
        built.extend(planned_units(&args).into_keys());
    }
    // The Quickstart's, in the tests' profile (the profile does not change
    // which features are chosen).
    let q = quickstart();
    let builds: Vec<Vec<&str>> = q
        .lines()
        .filter_map(|l| {
            l.split('#')
                .next()
                .unwrap()
                .trim()
                .strip_prefix("cargo build")
        })
        .map(|rest| {
            rest.split_whitespace()
                .filter(|a| *a != "--release")
                .collect()
        })
        .collect();
    assert_eq!(builds.len(), 2, "{q}");
    for args in builds {
        let mut new: Vec<String> = planned_units(&args)
            .into_iter()
            .filter(|(k, _)| !built.contains(k))
            .map(|(_, what)| what)
            .collect();
        new.sort();
        assert!(
            new.is_empty(),
            "`cargo build {}` builds {} units `./demo.sh` did not ({calls}):\n{}",
            args.join(" "),
            new.len(),
            new.join("\n")
        );
    }
}
