//! Error messages that say what to do next, from the real binary: a port
//! where an address belongs, a socket the user may not create or reach,
//! no broker at the socket asked for, a request no GPU can hold, and a
//! busy GPU named by the job that holds it as `gpufrac status` shows it.
//! A hint that suggests a command is pasted into a shell here and run, as
//! a user would; and `--gpu-memory` takes what `GPU_MEM_LIMIT` takes,
//! percentages included.
//!
//! "May not" is real: run as root, the tests run gpufrac as `nobody`
//! (root passes every permission check).

mod support;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use support::*;

/// What the hints must suggest for a socket of one's own.
const XDG: &str = "/run/user/4242";

/// The gpufrac binary copied where any user can run it (a checkout under
/// a home directory may be closed to `nobody`).
fn gpufrac_for_anyone(dir: &Scratch) -> PathBuf {
    let to = dir.0.join("gpufrac");
    copy_executable(&artifacts().gpufrac, &to);
    to
}

/// Drops root, if the tests have it, before `cmd` runs.
fn unprivileged(cmd: &mut Command) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    as_user(cmd, NOBODY);
}

fn own_socket_suggested(err: &str) -> bool {
    err.contains(&format!("--socket {XDG}/gpufrac.sock"))
        && err.contains(&format!("GPUFRAC_SOCKET={XDG}/gpufrac.sock"))
}

/// A usage error like any other (status 2, as clap's own): a name that is
/// no address, a port past 65535.
#[test]
fn a_metrics_address_that_is_none_is_refused_with_one_to_use() {
    let dir = Scratch::new("hint-metrics");
    let socket = dir.0.join("b.sock");
    for bad in ["nowhere", "99999"] {
        let o = sim_command(&artifacts().gpufrac, "16G", false)
            .args(["broker", "--socket"])
            .arg(&socket)
            .args(["--metrics", bad])
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("--metrics {bad}: not an address"))
                && err.contains("--metrics 9400")
                && err.contains("--metrics 0.0.0.0:9400"),
            "{err}"
        );
        assert!(!socket.exists(), "a refused start left its socket");
    }
}

#[test]
fn a_broker_that_may_not_create_its_socket_is_told_where_it_may() {
    let dir = Scratch::new("hint-broker");
    let gpufrac = gpufrac_for_anyone(&dir);
    let locked = dir.0.join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
    // Its directory cannot be created (as with /run/gpufrac for a user),
    // and a directory that exists cannot be written.
    for (socket, failed) in [
        (locked.join("sub/b.sock"), "cannot create"),
        (locked.join("b.sock"), "cannot listen on"),
    ] {
        let mut cmd = sim_command(&gpufrac, "16G", false);
        cmd.args(["broker", "--socket"])
            .arg(&socket)
            .env("XDG_RUNTIME_DIR", XDG)
            .env("RUST_LOG", "error");
        unprivileged(&mut cmd);
        let o = cmd.output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(failed) && err.contains("Permission denied"),
            "{err}"
        );
        assert!(own_socket_suggested(&err), "{err}");
    }
}

#[test]
fn a_client_that_may_not_reach_the_socket_is_told_how_to_reach_a_broker() {
    let dir = Scratch::new("hint-client");
    let gpufrac = gpufrac_for_anyone(&dir);
    let socket = dir.0.join("b.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // Connecting needs write permission on the socket.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o000)).unwrap();
    let mut cmd = sim_command(&gpufrac, "16G", false);
    cmd.args(["status", "--socket"])
        .arg(&socket)
        .env("XDG_RUNTIME_DIR", XDG);
    unprivileged(&mut cmd);
    let o = cmd.output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "cannot connect to the broker at {}",
            socket.display()
        )) && err.contains("Permission denied")
            && err.contains("--group"),
        "{err}"
    );
    assert!(own_socket_suggested(&err), "{err}");
}

/// The lines of a message that are commands to paste (hints indent them
/// by four spaces).
fn commands(message: &str) -> Vec<String> {
    message
        .lines()
        .filter_map(|l| l.strip_prefix("    "))
        .map(str::to_owned)
        .collect()
}

/// `sh -c LINE` against the simulated driver, as a user's shell would run
/// a pasted line.
fn shell(line: &str, devices: &str) -> Command {
    let mut cmd = sim_command("sh", devices, false);
    cmd.env_remove("GPUFRAC_BROKER").arg("-c").arg(line);
    cmd
}

#[test]
fn no_broker_at_a_socket_says_how_to_start_one_there_and_that_command_starts_it() {
    let dir = Scratch::new("hint-none");
    let socket = dir.0.join("none.sock");
    let status = || {
        sim_command(&artifacts().gpufrac, "16G", false)
            .args(["status", "--socket"])
            .arg(&socket)
            .output()
            .unwrap()
    };
    let o = status();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    // Named by the path it was started by: `gpufrac` alone may not be on
    // PATH right after a build.
    let start = format!(
        "{} broker --socket {}",
        artifacts().gpufrac.display(),
        socket.display()
    );
    assert!(
        err.starts_with(&format!(
            "gpufrac status: no broker at {}; start one with:\n",
            socket.display()
        )),
        "{err}"
    );
    assert_eq!(commands(&err), std::slice::from_ref(&start), "{err}");

    let _broker = KillOnDrop(
        shell(&format!("exec {start}"), "16G")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(20.0, "the pasted broker", || status().status.success());
}

#[test]
fn a_request_no_gpu_can_hold_is_told_the_most_it_may_ask_and_that_runs() {
    let b = Broker::start("16G,8G", &[]);
    for (asked, hint) in [
        (["--gpu-memory", "20G"], "--gpu-memory 16G"),
        (["--gpus", "3"], "--gpus 2"),
    ] {
        let o = b
            .run(&[asked[0], asked[1], "--no-wait", "--", "true"])
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        let said = err
            .trim_end()
            .rsplit_once("ask for at most ")
            .map(|(_, flag)| flag)
            .unwrap_or_else(|| panic!("no suggestion ending the message: {err}"));
        assert_eq!(said, hint, "{err}");
        let pasted = format!(
            "{} run --socket {} --no-wait {said} -- true",
            artifacts().gpufrac.display(),
            b.socket.display()
        );
        let o = shell(&pasted, &b.devices)
            .env("GPUFRAC_SIM_STATE", &b.state)
            .output()
            .unwrap();
        assert!(o.status.success(), "{pasted}: {}", stderr(&o));
    }
}

/// What `GPU_MEM_LIMIT` the job's command was given.
fn job_cap(cmd: &mut Command) -> String {
    let o = cmd
        .args(["--", "sh", "-c", "echo $GPU_MEM_LIMIT"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o).trim().to_owned()
}

#[test]
fn gpu_memory_takes_a_percentage_of_the_smallest_gpu_with_a_broker_or_without() {
    let b = Broker::start("16G,8G", &[]);
    assert_eq!(
        job_cap(&mut b.run(&["--gpu-memory", "25%"])),
        (2 * GIB).to_string(),
        "25% of the smaller GPU, 8 GiB"
    );
    // The broker booked that much, as status shows.
    let o = b
        .run(&["--gpu-memory", "100%", "--", "sh", "-c", "read _"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _holder = KillOnDrop(o);
    wait_until(20.0, "the 100% lease", || {
        b.status()["leases"][0]["mem_cap"].as_u64() == Some(8 * GIB)
    });

    let without = || run_alone("16G,12G", &[]);
    // Learned from the driver: 50% of 12 GiB.
    assert_eq!(
        job_cap(without().args(["--gpu-memory", "50%"])),
        (6 * GIB).to_string()
    );
    // No GPU to take a share of: said, with what to give instead.
    let o = without()
        .env("GPUFRAC_SIM_DEVICES", "")
        .args(["--gpu-memory", "50%", "--", "true"])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--gpu-memory 50% is a share of a GPU") && err.contains("such as 4G"),
        "{err}"
    );
}

/// The text status, as a user reads it.
fn status_text(socket: &Path) -> String {
    let o = Command::new(&artifacts().gpufrac)
        .args(["status", "--socket"])
        .arg(socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

#[test]
fn a_busy_gpu_is_named_by_the_job_that_holds_it_as_status_shows_it() {
    let b = Broker::start("16G", &[]);
    // Holds the only GPU until its stdin closes.
    let holder = KillOnDrop(
        b.run(&["--gpus", "1", "--", "sh", "-c", "read _"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let job = holder.0.id();
    wait_until(20.0, "the holder's lease", || {
        b.status()["leases"]
            .as_array()
            .is_some_and(|l| l.len() == 1)
    });
    assert_eq!(b.status()["leases"][0]["pid"].as_u64(), Some(job as u64));

    let o = b
        .run(&["--gpus", "1", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("held whole by job {job}")), "{err}");

    let text = status_text(&b.socket);
    let leases = text.split("leases:\n").nth(1).expect("a leases table");
    assert!(leases.starts_with("  JOB "), "{text}");
    assert!(
        leases
            .lines()
            .any(|l| l.split_whitespace().next() == Some(&job.to_string())),
        "{text}"
    );

    // The job's token is its secret (only the job's processes may hold
    // it): neither the refusal nor status shows it.
    // (The state file is written at most every 100 ms.)
    let mut token = String::new();
    wait_until(10.0, "the job's token in the state file", || {
        let state: serde_json::Value = std::fs::read(b.state_file())
            .ok()
            .and_then(|s| serde_json::from_slice(&s).ok())
            .unwrap_or_default();
        token = state["jobs"][0]["token"]
            .as_u64()
            .map_or_else(String::new, |t| t.to_string());
        !token.is_empty()
    });
    assert!(
        !err.contains(&token) && !text.contains(&token),
        "{err}\n{text}"
    );
}
