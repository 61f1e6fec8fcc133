//! `./demo.sh shares`, `./demo.sh env` and `./demo.sh container`, end to
//! end, as a newcomer runs them: the script builds what it needs (nothing,
//! after the test artifacts), sets up the simulated driver itself, starts
//! and stops its own broker, and reports shares and priorities, or a
//! sealed image's memory cap under Podman.

#[path = "support/engines.rs"]
mod engines;
mod support;
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

#[test]
fn shares_demo_runs_on_the_simulated_gpu_and_cleans_up() {
    let o = demo(&["shares"]);
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
