//! Compute arbitration end to end: a real `gpufrac broker`, real client
//! processes under the shim, and the simulated driver's shared execution
//! engine, on which kernels of different processes really serialize.
//!
//! Shares are measured as each process's completed kernel time inside a
//! common window. Tolerances are loose enough for a loaded 2-core CI
//! machine; `bench/` reports the precise figures.

mod support;
use std::process::{Child, Stdio};
use support::*;

const MS: u64 = 1_000_000;

/// The tests that measure shares of GPU time run one at a time: on a
/// 2-core CI machine, spinners of two such tests would steal each other's
/// CPU and blur what is being measured.
static TIMED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn timed() -> std::sync::MutexGuard<'static, ()> {
    TIMED.lock().unwrap_or_else(|e| e.into_inner())
}
const KERNEL_NS: u64 = MS;

fn spawn_spinner(b: &Broker, share: Option<&str>, start: u64, end: u64) -> Child {
    let mut cmd = b.client(&artifacts().probe);
    if let Some(s) = share {
        cmd.env("GPU_COMPUTE_SHARE", s);
    }
    cmd.args([
        "ctx",
        "spin",
        &start.to_string(),
        &end.to_string(),
        &KERNEL_NS.to_string(),
        "2",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

fn kernels(c: Child) -> u64 {
    let o = c.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "spinner failed: {}{}",
        stdout(&o),
        stderr(&o)
    );
    num(&line(&o, "spin", 0), "kernels")
}

/// Runs one spinner per share over a 3 s window and returns each one's
/// fraction of the GPU time used, plus the busy fraction of the window.
fn contend(b: &Broker, shares: &[Option<&str>]) -> (Vec<f64>, f64) {
    let start = mono_ns() + 1500 * MS;
    let end = start + 3000 * MS;
    let kids: Vec<Child> = shares
        .iter()
        .map(|s| spawn_spinner(b, *s, start, end))
        .collect();
    let k: Vec<u64> = kids.into_iter().map(kernels).collect();
    let total: u64 = k.iter().sum();
    let busy = (total * KERNEL_NS) as f64 / (end - start) as f64;
    (
        k.iter().map(|&x| x as f64 / total.max(1) as f64).collect(),
        busy,
    )
}

fn assert_shares(got: &[f64], want: &[f64], tol: f64) {
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= tol,
            "achieved {got:?}, target {want:?} (±{tol})"
        );
    }
}

#[test]
fn two_processes_split_by_their_shares() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let (s, busy) = contend(&b, &[Some("50%"), Some("50%")]);
    assert_shares(&s, &[0.5, 0.5], 0.10);
    assert!(busy > 0.75, "GPU busy {busy:.2} of the window");
    let (s, busy) = contend(&b, &[Some("70%"), Some("30%")]);
    assert_shares(&s, &[0.7, 0.3], 0.10);
    assert!(busy > 0.75, "GPU busy {busy:.2} of the window");
}

#[test]
fn three_processes_1_1_2() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let (s, _) = contend(&b, &[Some("25"), Some("25"), Some("50")]);
    assert_shares(&s, &[0.25, 0.25, 0.5], 0.10);
}

#[test]
fn a_lone_process_runs_unthrottled() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let (_, busy) = contend(&b, &[None]);
    assert!(
        busy > 0.85,
        "a process alone kept the GPU busy only {busy:.2} of the time"
    );
}

#[test]
fn an_idle_holder_hands_the_gpu_back() {
    let _serial = timed();
    // A trickler launches one short kernel every 60 ms and then idles; a
    // spinner wants the GPU all the time. With 50 ms slices, a holder that
    // kept its slice while idle would cost the spinner most of each period.
    let b = Broker::start("16G", &["--timeslice", "50ms"]);
    let start = mono_ns() + 1500 * MS;
    let end = start + 3000 * MS;
    let mut t = b.client(&artifacts().probe);
    t.args([
        "ctx",
        "trickle",
        &start.to_string(),
        &end.to_string(),
        "60",
        "100000",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let trickler = t.spawn().unwrap();
    let spinner = spawn_spinner(&b, None, start, end);
    let k = kernels(spinner);
    let o = trickler.wait_with_output().unwrap();
    assert!(
        num(&line(&o, "trickle", 0), "kernels") > 10,
        "the trickler ran too: {}",
        stdout(&o)
    );
    let busy = (k * KERNEL_NS) as f64 / (end - start) as f64;
    assert!(
        busy > 0.70,
        "spinner got only {busy:.2} of the GPU next to an idle holder"
    );
}

#[test]
fn killing_the_holder_frees_the_gpu_at_once() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let t0 = mono_ns();
    let victim = spawn_spinner(&b, None, t0 + 1000 * MS, t0 + 60_000 * MS);
    let victim_pid = victim.id() as u64;
    let survivor = spawn_spinner(&b, None, t0 + 1000 * MS, t0 + 4000 * MS);
    let survivor_pid = survivor.id() as u64;
    wait_until(10.0, "both registered", || {
        let r = b.registered();
        r.contains(&victim_pid) && r.contains(&survivor_pid)
    });
    while mono_ns() < t0 + 1500 * MS {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut victim = victim;
    unsafe { libc::kill(victim.id() as i32, libc::SIGKILL) };
    let _ = victim.wait();
    wait_until(5.0, "the killed process to leave", || {
        !b.registered().contains(&victim_pid)
    });
    // 0.5 s shared, then 2.5 s alone: ~0.92 of the window; without the
    // release on disconnect the survivor would stay near 0.5.
    let k = kernels(survivor);
    let busy = (k * KERNEL_NS) as f64 / (3000 * MS) as f64;
    assert!(busy > 0.75, "survivor got {busy:.2} after the holder died");
}

/// The drain thread of a process dies (a panic, contained) at its first
/// drain, after a revoke: its session hands back what it holds, each
/// device with its Release, closes its connection and stops arbitrating,
/// so the broker holds nothing of it while it runs on, and the other
/// process gets the GPU. (Before, the gates closed behind the session's
/// back and the connection stayed: a Release the session then decided was
/// never sent, and the broker saw a hung holder.)
#[test]
fn a_dead_drain_thread_hands_everything_back_and_ends_arbitration() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let t0 = mono_ns();
    let mut cmd = b.client(&artifacts().probe);
    cmd.env("GPUFRAC_TEST_PANIC", "drain")
        .args([
            "ctx",
            "spin",
            &(t0 + 500 * MS).to_string(),
            &(t0 + 60_000 * MS).to_string(),
            &KERNEL_NS.to_string(),
            "2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut broken = cmd.spawn().unwrap();
    let broken_pid = broken.id() as u64;
    let other = spawn_spinner(&b, None, t0 + 500 * MS, t0 + 4000 * MS);
    let other_pid = other.id() as u64;
    wait_until(10.0, "both registered", || {
        let r = b.registered();
        r.contains(&broken_pid) && r.contains(&other_pid)
    });
    // Its first drain (a revoke's, or an optimistic window's end) kills
    // the thread; the process runs on, no longer the broker's client.
    wait_until(20.0, "the broken process to leave the broker", || {
        !b.registered().contains(&broken_pid)
    });
    assert!(
        broken.try_wait().unwrap().is_none(),
        "it left the broker by exiting, not by ending its session"
    );
    assert!(kernels(other) > 0, "the other process never got the GPU");
    unsafe { libc::kill(broken.id() as i32, libc::SIGKILL) };
    let o = broken.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("internal error in the drain thread")
            && err.contains("compute is not arbitrated from now on"),
        "{err}"
    );
}

#[test]
fn broker_restart_clients_keep_caps_and_reregister() {
    let mut b = Broker::start("16G", &["--timeslice", "20ms"]);
    let mut cmd = b.client(&artifacts().probe);
    cmd.env("GPU_MEM_LIMIT", "64M")
        .args(["ctx", "alloc", "alloc", "4M", "launch", "2", "1000"])
        .args([
            "sleep-ms", "1500", "fill", "alloc", "4M", "launch", "20", "1000", "sleep-ms", "4000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let pid = child.id() as u64;
    wait_until(10.0, "the client to register", || {
        b.registered().contains(&pid)
    });
    b.kill();
    // While the broker is gone (the client's fill runs ~1.5 s in): the cap
    // still holds and launches go through unarbitrated.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    b.restart();
    wait_until(10.0, "the client to re-register", || {
        b.registered().contains(&pid)
    });
    let s = b.status();
    let p = &s["gpus"][0]["processes"][0];
    assert_eq!(p["mem_cap"].as_u64(), Some(64 * MIB));
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(
        num(&line(&o, "fill", 0), "count"),
        15,
        "cap enforced without the broker"
    );
    assert_eq!(
        num(&line(&o, "launch", 1), "rc"),
        0,
        "launches ran unarbitrated"
    );
}

#[test]
fn required_broker_missing_fails_clearly() {
    let o = probe(
        "16G",
        &[
            ("GPUFRAC_BROKER", "required"),
            ("GPUFRAC_SOCKET", "/nonexistent/gpufrac.sock"),
        ],
        &["ctx"],
    );
    assert_eq!(
        num(&line(&o, "init", 0), "rc"),
        802,
        "CUDA_ERROR_SYSTEM_NOT_READY"
    );
    let err = stderr(&o);
    assert!(
        err.contains("GPUFRAC_BROKER=required") && err.contains("/nonexistent/gpufrac.sock"),
        "{err}"
    );
}

#[test]
fn bad_frames_close_only_the_offending_client() {
    let b = Broker::start("16G", &[]);
    let mut cmd = b.client(&artifacts().probe);
    cmd.args(["ctx", "sleep-ms", "3000"]).stdout(Stdio::null());
    let mut shim = cmd.spawn().unwrap();
    let pid = shim.id() as u64;
    wait_until(10.0, "the client to register", || {
        b.registered().contains(&pid)
    });

    let mut garbage = RawClient::connect(&b.socket);
    garbage
        .send_raw(&[0x07, 0, 0, 0, 0xee, 1, 2, 3, 4, 5, 6])
        .unwrap();
    assert!(matches!(
        garbage.recv(),
        Some(gpufrac_common::wire::ServerMsg::Error { .. }) | None
    ));
    assert!(
        garbage.recv().is_none(),
        "connection closed after a bad frame"
    );

    let mut huge = RawClient::connect(&b.socket);
    huge.hello();
    let _ = huge.send_raw(&(200u32 << 20).to_le_bytes());
    let _ = huge.send_raw(&[0x01; 1024]);
    while let Some(m) = huge.recv() {
        assert!(
            matches!(m, gpufrac_common::wire::ServerMsg::Error { .. }),
            "{m:?}"
        );
    }

    let mut wrong_version = RawClient::connect(&b.socket);
    wrong_version.send(&gpufrac_common::wire::ClientMsg::Hello {
        magic: gpufrac_common::wire::MAGIC,
        version: 99,
        pid: 1,
        role: gpufrac_common::wire::Role::Cli,
        max_version: 99,
    });
    match wrong_version.recv() {
        Some(gpufrac_common::wire::ServerMsg::Error { message, .. }) => {
            assert!(message.contains("99"), "{message}")
        }
        other => panic!("expected a version error, got {other:?}"),
    }

    // Everyone else is unaffected.
    assert!(b.registered().contains(&pid));
    let _ = shim.wait();
}

#[test]
fn a_hundred_clients_at_once_are_all_served() {
    let b = Broker::start("16G", &[]);
    let served: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..100)
            .map(|_| {
                s.spawn(|| {
                    let mut c = RawClient::connect(&b.socket);
                    c.hello();
                    c.send(&gpufrac_common::wire::ClientMsg::Status { from: 0 });
                    matches!(
                        c.recv(),
                        Some(gpufrac_common::wire::ServerMsg::StatusReply { .. })
                    ) as usize
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(served, 100);
}

#[test]
fn status_shows_processes_with_memory_and_shares() {
    let b = Broker::start("16G", &[]);
    let mut cmd = b.client(&artifacts().probe);
    cmd.env("GPU_MEM_LIMIT", "64M")
        .env("GPU_COMPUTE_SHARE", "30%")
        .args(["ctx", "alloc", "alloc", "12M", "sleep-ms", "3000"])
        .stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as u64;
    // Usage reports are coalesced (~100 ms): wait for the figure to arrive.
    wait_until(10.0, "usage to be reported", || {
        let s = b.status();
        s["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"].as_u64() == Some(pid) && p["mem_used"].as_u64() == Some(12 * MIB))
    });
    let s = b.status();
    let p = &s["gpus"][0]["processes"][0];
    assert_eq!(p["mem_cap"].as_u64(), Some(64 * MIB));
    assert!(p["command"].as_str().unwrap().contains("probe"), "{p}");
    assert_eq!(s["gpus"][0]["total_mem"].as_u64(), Some(16 * GIB));
    let _ = child.wait();
}

#[test]
fn metrics_are_served_over_http() {
    // A free port: bind, read it, let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let b = Broker::start("16G", &["--metrics", &addr]);
    let mut cmd = b.client(&artifacts().probe);
    cmd.env("GPU_MEM_LIMIT", "64M")
        .args(["ctx", "alloc", "alloc", "8M", "sleep-ms", "3000"])
        .stdout(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let pid = child.id();
    let get = || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    };
    let want = "gpufrac_process_memory_used_bytes{gpu=\"0\",uuid=\"GPU-";
    wait_until(10.0, "the process's usage in /metrics", || {
        let m = get();
        m.lines().any(|l| {
            l.starts_with(want)
                && l.contains(&format!("pid=\"{pid}\""))
                && l.ends_with(&(8 * MIB).to_string())
        })
    });
    let m = get();
    assert!(m.starts_with("HTTP/1.1 200 OK"), "{m}");
    assert!(m.contains("gpufrac_gpu_memory_total_bytes"), "{m}");
    assert!(
        m.lines()
            .any(|l| l.starts_with("gpufrac_process_gpu_seconds_total{")
                && l.contains(&format!("pid=\"{pid}\""))
                && l.contains("class=\"normal\"")),
        "{m}"
    );
    let _ = child.wait();
}

#[test]
fn a_compute_limit_is_a_ceiling_even_alone() {
    let _serial = timed();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let start = mono_ns() + 1500 * MS;
    let end = start + 3000 * MS;
    let mut cmd = b.client(&artifacts().probe);
    cmd.env("GPU_COMPUTE_LIMIT", "30%")
        .args([
            "ctx",
            "spin",
            &start.to_string(),
            &end.to_string(),
            &KERNEL_NS.to_string(),
            "2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let k = kernels(cmd.spawn().unwrap());
    let busy = (k * KERNEL_NS) as f64 / (end - start) as f64;
    assert!(
        (0.2..=0.4).contains(&busy),
        "limited to 30% but used {busy:.2} of the GPU"
    );
}

#[test]
fn declared_shares_and_usage_are_bounded_by_the_gpu() {
    use gpufrac_common::config::Priority;
    use gpufrac_common::wire::{ClientMsg, DeviceReg};
    let b = Broker::start("16G", &[]);
    let uuid = b.first_gpu_uuid();
    let join = |command: &str, share: f64| {
        let mut c = RawClient::connect(&b.socket);
        c.hello_as(gpufrac_common::wire::Role::Shim);
        c.send(&ClientMsg::Register {
            command: command.into(),
            devices: vec![DeviceReg {
                uuid,
                ordinal: 0,
                mem_cap: 0,
                mem_total: 16 * GIB,
            }],
            share: Some(share),
            limit: None,
            priority: Priority::Normal,
        });
        c.send(&ClientMsg::Acquire { uuid });
        c
    };
    let mut greedy = join("greedy", 1e300);
    let _fair = join("fair", 100.0);
    // Its word on memory is bounded by the GPU too.
    greedy.send(&ClientMsg::Usage {
        uuid,
        used: 4 << 60,
        peak: u64::MAX,
        ooms: 0,
    });
    // Both connections are this test process (the broker names processes
    // from /proc, not from what they say): tell them apart by the figures.
    let targets = || -> Vec<f64> {
        b.status()["gpus"][0]["processes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| p["share_target"].as_f64())
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_until(10.0, "both clients asking for the GPU", || {
        let t = targets();
        t.len() == 2 && t.iter().all(|&x| x > 0.0)
    });
    assert_eq!(targets(), vec![0.5, 0.5]);
    let most = |key: &str| -> Option<u64> {
        b.status()["gpus"][0]["processes"]
            .as_array()?
            .iter()
            .filter_map(|p| p[key].as_u64())
            .max()
    };
    wait_until(10.0, "the usage report", || {
        most("mem_used").is_some_and(|u| u > 0)
    });
    assert_eq!(most("mem_used"), Some(16 * GIB));
    assert_eq!(most("mem_peak"), Some(16 * GIB));
}

#[test]
fn a_socket_path_that_names_a_file_is_refused_and_the_file_kept() {
    let dir = Scratch::new("notasocket");
    let file = dir.0.join("precious.txt");
    std::fs::write(&file, "keep me").unwrap();
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .args(["broker", "--socket"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is not a socket"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

/// Utilisation comes from NVML (the simulator's here), sampled by the
/// broker on a thread of its own: status shows it once sampled, and it
/// follows a process that keeps the GPU busy.
#[test]
fn status_shows_utilisation_as_the_broker_sampled_it() {
    let _serial = timed();
    let b = Broker::start("16G", &[]);
    let util = |b: &Broker| b.status()["gpus"][0]["utilization"].as_u64();
    wait_until(20.0, "status shows the GPU's utilisation", || {
        util(&b).is_some()
    });
    let start = mono_ns() + 200 * MS;
    let mut spinner = spawn_spinner(&b, None, start, start + 30_000 * MS);
    wait_until(
        25.0,
        "utilisation rises while a process keeps the GPU busy",
        || util(&b).is_some_and(|u| u > 0),
    );
    let _ = spinner.kill();
    let _ = spinner.wait();
}

/// A process forked after its parent's session began has no client thread
/// and must not share the parent's connection: the shim's fork handler
/// puts the child back to "set up, not arbitrated", so that its own first
/// context starts a session of its own, which the broker sees under the
/// child's pid beside the parent's, and its launches run.
#[test]
fn a_forked_child_registers_a_session_of_its_own() {
    let b = Broker::start("16G", &[]);
    let dir = Scratch::new("fork-session");
    let go = dir.0.join("go");
    let mut cmd = b.client(&artifacts().probe);
    cmd.args([
        "ctx", "launch", "2", "1000", "fork", "ctx", "launch", "2", "1000",
    ])
    .arg("await-file")
    .arg(&go)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut p = Reap(Some(cmd.spawn().unwrap()));
    let c = p.0.as_mut().unwrap();
    let parent = c.id() as u64;
    let mut lines = Vec::new();
    let child = loop {
        let l = read_line(c);
        assert!(!l.is_empty(), "the probe ended early: {lines:?}");
        if let Some(pid) = l.strip_prefix("forked pid=") {
            break pid.parse::<u64>().unwrap();
        }
        lines.push(l);
    };
    assert!(
        lines.contains(&"ctx rc=0".to_string())
            && lines.iter().any(|l| l.starts_with("launch rc=0 ")),
        "the parent's context and launch: {lines:?}"
    );
    assert_eq!(read_line(c), "ctx rc=0", "the child's context");
    assert!(
        read_line(c).starts_with("launch rc=0 "),
        "the child's launch"
    );
    wait_until(10.0, "the child's own session beside the parent's", || {
        let r = b.registered();
        r.contains(&parent) && r.contains(&child)
    });
    std::fs::write(&go, b"").unwrap();
    let o = p.0.take().unwrap().wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).lines().collect::<Vec<_>>(),
        ["await-file done=1", &format!("fork child={child} exited=0")],
    );
}

/// The broker reads a socket until a short read says it is empty, and
/// then waits for the poll, except after the peer hung up: then no edge
/// comes again, so it reads on to the end. Forced here by stopping the
/// broker while a client sends a frame and shuts its end, so that the
/// broker's next poll sees both at once: the frame is answered and the
/// connection closed, not left open behind a read that stopped short.
#[test]
fn a_frame_sent_with_a_hangup_is_answered_and_the_connection_closed() {
    use std::io::Read;
    let b = Broker::start("16G", &[]);
    let mut c = RawClient::connect(&b.socket);
    c.hello();
    let pid = b.child.id() as i32;
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
    };
    // SAFETY: signals to the broker this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    wait_until(10.0, "the broker to stop", || state() == Some('T'));
    c.send(&gpufrac_common::wire::ClientMsg::Ping);
    c.s.shutdown(std::net::Shutdown::Write).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(c.recv(), Some(gpufrac_common::wire::ServerMsg::Pong));
    let mut rest = [0u8; 64];
    match c.s.read(&mut rest) {
        Ok(0) => {}
        other => panic!("expected the broker to close the connection, got {other:?}"),
    }
}
