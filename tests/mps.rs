//! `gpufrac broker --mps` against a stand-in `nvidia-cuda-mps-control` on
//! PATH that records how it was started and what it was told (MPS itself
//! needs a GPU; gpu/ checks the real one).

mod support;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use support::*;

struct Setup {
    dir: Scratch,
    socket: PathBuf,
    log: PathBuf,
    path: String,
}

fn setup(name: &str) -> Setup {
    let dir = Scratch::new(name);
    let path = mps_standin(&dir.0);
    let run = dir.0.join("run");
    std::fs::create_dir(&run).unwrap();
    Setup {
        socket: run.join("b.sock"),
        log: dir.0.join("standin.log"),
        path,
        dir,
    }
}

fn broker(s: &Setup, path: &str, extra: &[(&str, &str)]) -> Command {
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.args(["broker", "--mps", "--socket"])
        .arg(&s.socket)
        .arg("--state-dir")
        .arg(s.dir.0.join("state"))
        .env("PATH", path)
        .env("GPUFRAC_MPS_STANDIN_LOG", &s.log)
        .env("GPUFRAC_SIM_STATE", s.dir.0.join("sim"))
        .env("RUST_LOG", "warn")
        .envs(extra.iter().copied());
    cmd
}

/// `broker`, started, its log in its directory.
fn spawn_broker(s: &Setup, path: &str, extra: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = broker(s, path, extra);
    log_to(&mut cmd, &s.dir.0.join("broker.log"));
    cmd.stdout(Stdio::null()).spawn().unwrap()
}

fn log(s: &Setup) -> String {
    std::fs::read_to_string(&s.log).unwrap_or_default()
}

fn alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn the_broker_starts_supervises_and_stops_the_mps_daemon() {
    let s = setup("mps");
    let mut b = KillOnDrop(spawn_broker(&s, &s.path, &[]));
    wait_until(20.0, "the broker", || {
        std::os::unix::net::UnixStream::connect(&s.socket).is_ok()
    });
    // In the broker's private directory, never beside the socket.
    let run_dir = s.dir.0.join("state");
    wait_until(20.0, "the daemon started", || {
        status_cli(&s.socket)["mps"]["state"] == "running"
    });
    let first = log(&s);
    assert!(
        first.contains(&format!(
            "call -d pipe={} logdir={} cvd=unset",
            run_dir.join("mps-pipe").display(),
            run_dir.join("mps-log").display()
        )),
        "{first}"
    );
    let st = status_cli(&s.socket);
    assert_eq!(st["mps"]["state"], "running", "{st}");
    assert_eq!(st["gpus"][0]["mode"], "mps", "{st}");
    let pid = st["mps"]["daemon_pid"].as_u64().unwrap();
    assert!(alive(pid));

    // The daemon dies: the broker starts another.
    // SAFETY: killing the stand-in daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_until(10.0, "a restarted daemon", || {
        let st = status_cli(&s.socket);
        st["mps"]["restarts"] == 1 && st["mps"]["daemon_pid"].as_u64().is_some_and(|p| p != pid)
    });
    let pid2 = status_cli(&s.socket)["mps"]["daemon_pid"].as_u64().unwrap();

    // Jobs are MPS clients: the pipe, and their compute share as an SM
    // percentage; their launches are never held back by the broker.
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .env("GPUFRAC_SIM_STATE", s.dir.0.join("sim"))
        .args(["run", "--socket"])
        .arg(&s.socket)
        .args(["--gpu-memory", "1G", "--gpu-compute", "30%", "--", "sh", "-c"])
        .arg(format!(
            "echo env $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $GPU_MEM_LIMIT; {} ctx launch 20 100000",
            artifacts().probe.display()
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains(&format!(
            "env {} 30 {}",
            run_dir.join("mps-pipe").display(),
            1u64 << 30
        )),
        "{}",
        stdout(&o)
    );
    assert_eq!(num(&line(&o, "launch", 0), "rc"), 0, "{}", stdout(&o));

    // Containers too: docker-args mounts the pipe directory and passes it
    // as the container sees it, and the host IPC namespace.
    let o = Command::new(&artifacts().gpufrac)
        .args(["docker-args", "--socket"])
        .arg(&s.socket)
        .args(["--gpu-memory", "1G", "--gpu-compute", "30%"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let a = stdout(&o);
    let mount = format!("{}:/run/gpufrac-mps", run_dir.join("mps-pipe").display());
    for want in [
        mount.as_str(),
        "CUDA_MPS_PIPE_DIRECTORY=/run/gpufrac-mps",
        "--ipc=host",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
    ] {
        assert!(a.contains(want), "{want} missing from {a}");
    }

    // A clean stop tells the daemon to quit.
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
    let st = b.0.wait().unwrap();
    assert!(st.success());
    assert!(log(&s).contains("cmd quit"), "{}", log(&s));
    wait_until(5.0, "the daemon gone", || !alive(pid2));
}

#[test]
fn without_mps_the_broker_refuses_to_start_and_says_why() {
    let s = setup("nomps");
    let o = broker(&s, "/usr/bin:/bin", &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("nvidia-cuda-mps-control is not on PATH") && e.contains("drop --mps"),
        "{e}"
    );
    assert!(!s.socket.exists(), "a refused start left its socket");
}

#[test]
fn a_daemon_that_will_not_start_is_reported() {
    let s = setup("mpsfail");
    let o = broker(&s, &s.path, &[("GPUFRAC_MPS_STANDIN_FAIL", "1")])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("MPS is not supported on this GPU"),
        "{}",
        stderr(&o)
    );
    assert!(!s.socket.exists(), "a refused start left its socket");
}

/// A job's `gpufrac run` under `--mps`, holding its lease until its input
/// ends.
fn holding(s: &Setup) -> std::process::Child {
    let mut run = sim_command(&artifacts().gpufrac, "16G", false);
    run.env("GPUFRAC_SIM_STATE", s.dir.0.join("sim"))
        .args(["run", "--socket"])
        .arg(&s.socket)
        .args(["--gpu-memory", "1G", "--"]);
    start_holding(run)
}

/// A clean stop while a job runs keeps its lease for the next broker (a
/// restart, an upgrade); the job runs on as an MPS client, so the stop
/// leaves the control daemon (and the server its job is a client of)
/// running, and the next broker takes it over instead of starting a
/// second. Before, the stop told it to quit under the running job. With
/// no job left, the next stop does tell it to quit.
#[test]
fn a_clean_stop_with_a_job_running_leaves_the_daemon_to_the_next_broker() {
    let s = setup("mps-kept");
    let info = [("RUST_LOG", "info")];
    let mut b = KillOnDrop(spawn_broker(&s, &s.path, &info));
    wait_until(20.0, "the daemon started", || {
        std::os::unix::net::UnixStream::connect(&s.socket).is_ok()
            && status_cli(&s.socket)["mps"]["daemon_pid"]
                .as_u64()
                .is_some()
    });
    let pid = status_cli(&s.socket)["mps"]["daemon_pid"].as_u64().unwrap();
    let mut job = Reap(Some(holding(&s)));
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
    assert!(b.0.wait().unwrap().success());
    let broker_log = std::fs::read_to_string(s.dir.0.join("broker.log")).unwrap();
    assert!(
        broker_log.contains("leaving the MPS control daemon running"),
        "{broker_log}"
    );
    assert!(!log(&s).contains("cmd quit"), "{}", log(&s));
    assert!(alive(pid), "the daemon was stopped under the running job");

    let mut b = KillOnDrop(spawn_broker(&s, &s.path, &info));
    wait_until(20.0, "the next broker", || {
        std::os::unix::net::UnixStream::connect(&s.socket).is_ok()
    });
    let st = status_cli(&s.socket);
    assert_eq!(st["mps"]["state"], "running", "{st}");
    assert_eq!(st["mps"]["daemon_pid"].as_u64(), Some(pid), "{st}");
    assert_eq!(
        log(&s).matches("call -d").count(),
        1,
        "a second daemon was started: {}",
        log(&s)
    );
    release_holding(job.0.take().unwrap());

    // Nothing runs now: the stop tells the daemon to quit.
    wait_until(20.0, "the job's lease to end", || {
        status_cli(&s.socket)["leases"]
            .as_array()
            .is_some_and(Vec::is_empty)
    });
    // SAFETY: signalling the broker this test started.
    unsafe { libc::kill(b.0.id() as i32, libc::SIGTERM) };
    assert!(b.0.wait().unwrap().success());
    assert!(log(&s).contains("cmd quit"), "{}", log(&s));
    wait_until(5.0, "the daemon gone", || !alive(pid));
}
