//! `gpufrac run` end to end: the queue, whole-GPU and fractional placement,
//! over-provisioning, exit codes, signals and leases, against a real broker
//! and the simulated driver.

mod support;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use support::*;

/// A job that records what it was given, then holds its lease until
/// `release(dir, name)`.
fn job(b: &Broker, dir: &Path, name: &str, args: &[&str]) -> Child {
    let script = job_script(dir, name);
    let mut cmd = b.run(args);
    cmd.args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

fn queued(b: &Broker) -> usize {
    b.status()["queue"].as_array().unwrap().len()
}

fn scratch(name: &str) -> (Scratch, PathBuf) {
    let s = Scratch::new(name);
    let p = s.0.clone();
    (s, p)
}

#[test]
fn whole_gpus_go_to_distinct_devices_and_the_third_waits() {
    let b = Broker::start("16G,16G", &[]);
    let (_s, d) = scratch("whole");
    let a = job(&b, &d, "a", &["--gpus", "1"]);
    let (cvd_a, _) = wait_started(&d, "a");
    let c = job(&b, &d, "b", &["--gpus", "1"]);
    let (cvd_b, _) = wait_started(&d, "b");
    let mut got = [cvd_a.clone(), cvd_b];
    got.sort();
    assert_eq!(
        got,
        ["0".to_string(), "1".to_string()],
        "lowest indices, distinct"
    );
    let third = job(&b, &d, "c", &["--gpus", "1"]);
    wait_until(10.0, "the third job to queue", || queued(&b) == 1);
    assert!(started(&d, "c").is_none());
    release(&d, "a", a);
    let (cvd_c, _) = wait_started(&d, "c");
    assert_eq!(cvd_c, cvd_a, "the third gets the freed GPU");
    release(&d, "b", c);
    release(&d, "c", third);
}

#[test]
fn a_small_job_overtakes_a_big_one_until_the_big_one_escalates() {
    let b = Broker::start("16G,16G", &["--escalate-after", "2s"]);
    let (_s, d) = scratch("order");
    let a = job(&b, &d, "a", &["--gpus", "1"]);
    wait_started(&d, "a");
    let x = job(&b, &d, "x", &["--gpus", "1"]);
    wait_started(&d, "x");
    // Both GPUs busy. A 2-GPU job queues first, then a 1-GPU job.
    let big = job(&b, &d, "big", &["--gpus", "2"]);
    wait_until(10.0, "the big job to queue", || queued(&b) == 1);
    let small = job(&b, &d, "small", &["--gpus", "1"]);
    wait_until(10.0, "the small job to queue", || queued(&b) == 2);
    let s = b.status();
    assert_eq!(
        s["queue"][0]["wants"], "1 GPU",
        "fewer GPUs first: {}",
        s["queue"]
    );
    release(&d, "a", a);
    wait_started(&d, "small");
    assert!(started(&d, "big").is_none());
    // Let the big one wait past --escalate-after: now it goes first and
    // holds back younger small jobs.
    wait_until(10.0, "escalation", || {
        b.status()["queue"][0]["escalated"] == true
    });
    let late = job(&b, &d, "late", &["--gpus", "1"]);
    wait_until(10.0, "the late job to queue", || queued(&b) == 2);
    let small_run = small.id();
    release(&d, "small", small);
    // GPU 0 is free, but the escalated 2-GPU job comes first. The broker
    // places what it can in the turn that ends a lease, so once status no
    // longer shows small's lease the decision is made: late still waits.
    wait_until(10.0, "small's lease to end", || {
        !b.status()["leases"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["pid"] == small_run)
    });
    let s = b.status();
    assert_eq!(
        queued(&b),
        2,
        "a younger job must not take the GPU the escalated one waits for: {s}"
    );
    assert!(started(&d, "late").is_none());
    release(&d, "x", x);
    let (cvd, _) = wait_started(&d, "big");
    assert_eq!(cvd, "0,1");
    release(&d, "big", big);
    wait_started(&d, "late");
    release(&d, "late", late);
}

#[test]
fn memory_fractions_pack_best_fit_and_wait() {
    let b = Broker::start("16G,8G", &[]);
    let (_s, d) = scratch("frac");
    let six = (6 * GIB).to_string();
    let j1 = job(&b, &d, "j1", &["--gpu-memory", "6G"]);
    assert_eq!(
        wait_started(&d, "j1"),
        ("1".into(), six.clone()),
        "best fit: the 8G GPU"
    );
    let j2 = job(&b, &d, "j2", &["--gpu-memory", "6G"]);
    assert_eq!(wait_started(&d, "j2"), ("0".into(), six.clone()));
    let j3 = job(&b, &d, "j3", &["--gpu-memory", "6G"]);
    assert_eq!(wait_started(&d, "j3"), ("0".into(), six.clone()));
    let j4 = job(&b, &d, "j4", &["--gpu-memory", "6G"]);
    wait_until(10.0, "the fourth to queue", || queued(&b) == 1);
    let s = b.status();
    let g0 = s["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["index"] == 0)
        .unwrap();
    assert_eq!(g0["committed_mem"].as_u64(), Some(12 * GIB));
    release(&d, "j1", j1);
    assert_eq!(wait_started(&d, "j4"), ("1".into(), six));
    for (n, c) in [("j2", j2), ("j3", j3), ("j4", j4)] {
        release(&d, n, c);
    }
}

#[test]
fn the_child_runs_under_its_cap() {
    let b = Broker::start("16G", &[]);
    let mut cmd = b.run(&["--gpu-memory", "64M", "--"]);
    cmd.arg(&artifacts().probe)
        .args(["ctx", "fill", "alloc", "4M", "info"]);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
    assert_eq!(num(&line(&o, "info", 0), "total"), 64 * MIB);
}

#[test]
fn impossible_requests_are_refused_at_once() {
    let b = Broker::start("16G,8G", &[]);
    for (args, words) in [
        (&["--gpus", "3"][..], "3 GPUs"),
        (&["--gpu-memory", "100G"][..], "100"),
    ] {
        let t = std::time::Instant::now();
        let o = b.run(args).args(["--", "true"]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.starts_with("gpufrac run: ") && err.contains(words),
            "{err}"
        );
        assert!(t.elapsed().as_secs() < 5, "refused at once, not queued");
    }
    let o = b.run(&["--gpus", "0", "--", "true"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--gpus"), "{}", stderr(&o));
}

#[test]
fn no_wait_and_timeout() {
    let b = Broker::start("16G", &[]);
    let (_s, d) = scratch("nowait");
    let a = job(&b, &d, "a", &["--gpus", "1"]);
    wait_started(&d, "a");
    let o = b
        .run(&["--gpus", "1", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("gpufrac run:"), "{}", stderr(&o));
    let o = b
        .run(&["--gpus", "1", "--timeout", "500ms", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(124));
    assert!(stderr(&o).contains("gave up after 500ms"), "{}", stderr(&o));
    release(&d, "a", a);
}

#[test]
fn exit_status_and_signals_pass_through() {
    let b = Broker::start("16G", &[]);
    let o = b
        .run(&["--gpus", "1", "--", "sh", "-c", "exit 7"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7));
    let (_s, d) = scratch("signals");
    let ready = d.join("ready");
    let script = format!(
        "trap 'echo got-term; exit 3' TERM; touch {}; while true; do sleep 0.02; done",
        ready.display()
    );
    let mut cmd = b.run(&["--gpus", "1", "--", "sh", "-c", &script]);
    let child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    wait_until(10.0, "the child to start", || ready.exists());
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(stdout(&o).trim(), "got-term");
    assert_eq!(o.status.code(), Some(3));
}

/// A signal sent to `run` goes to any of its threads that does not block
/// it; only the main thread passes it on to the child. With the lease's
/// keeper thread open to it, a SIGTERM that came in the moment between the
/// child's start and the handler's ended `run` alone (its default action):
/// the child ran on, parentless, and the test above waited forever for
/// its output. Every other thread of a running `run` blocks the signals it
/// forwards.
#[test]
fn only_runs_main_thread_takes_the_signals_it_forwards() {
    let b = Broker::start("16G", &[]);
    let (_s, d) = scratch("sigmask");
    let mut run = job(&b, &d, "a", &["--gpus", "1"]);
    wait_started(&d, "a");
    let pid = run.id();
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap();
        let blocked = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
            .unwrap();
        threads.push((t.file_name().to_string_lossy().into_owned(), blocked));
    }
    let forwarded = [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGQUIT,
        libc::SIGUSR1,
        libc::SIGUSR2,
    ]
    .iter()
    .fold(0u64, |m, s| m | 1 << (s - 1));
    assert!(
        threads.len() >= 2,
        "run and its lease's keeper: {threads:?}"
    );
    for (tid, blocked) in &threads {
        let main = *tid == pid.to_string();
        assert_eq!(
            blocked & forwarded,
            if main { 0 } else { forwarded },
            "thread {tid} of run {pid} (main: {main}) blocks {blocked:#x}"
        );
    }
    std::fs::write(d.join("a.stop"), "").unwrap();
    assert!(run.wait().unwrap().success());
}

#[test]
fn killing_run_frees_its_lease() {
    let b = Broker::start("16G", &[]);
    let (_s, d) = scratch("kill");
    let mut a = job(&b, &d, "a", &["--gpus", "1"]);
    wait_started(&d, "a");
    let w = job(&b, &d, "w", &["--gpus", "1"]);
    wait_until(10.0, "the second job to queue", || queued(&b) == 1);
    unsafe { libc::kill(a.id() as i32, libc::SIGKILL) };
    let _ = a.wait();
    wait_started(&d, "w");
    // The orphaned child of the killed run still waits for its stop file.
    std::fs::write(d.join("a.stop"), "").unwrap();
    release(&d, "w", w);
}

#[test]
fn overprovisioning_admits_f_jobs_per_gpu_with_a_share_of_memory() {
    let b = Broker::start("16G", &["--overprovision", "2"]);
    let (_s, d) = scratch("overprov");
    let eight = (8 * GIB).to_string();
    let a = job(&b, &d, "a", &["--gpus", "1"]);
    assert_eq!(wait_started(&d, "a"), ("0".into(), eight.clone()));
    let c = job(&b, &d, "b", &["--gpus", "1"]);
    assert_eq!(wait_started(&d, "b"), ("0".into(), eight));
    let third = job(&b, &d, "c", &["--gpus", "1"]);
    wait_until(10.0, "the third to queue", || queued(&b) == 1);
    let s = b.status();
    assert_eq!(s["gpus"][0]["slots_used"].as_u64(), Some(2));
    assert_eq!(s["gpus"][0]["slots_total"].as_u64(), Some(2));
    release(&d, "a", a);
    wait_started(&d, "c");
    release(&d, "b", c);
    release(&d, "c", third);
}

#[test]
fn without_a_broker_run_still_caps_memory() {
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.env_remove("GPUFRAC_BROKER")
        .args([
            "run",
            "--socket",
            "/nonexistent/broker.sock",
            "--gpu-memory",
            "64M",
            "--",
        ])
        .arg(&artifacts().probe)
        .args(["ctx", "fill", "alloc", "4M"]);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
    let err = stderr(&o);
    assert!(
        err.contains("no broker") && err.contains("gpufrac broker"),
        "{err}"
    );
    // run's line, and the shim's line for the refusal that ended the fill:
    // no warning from the shim about the broker too.
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[1].starts_with("gpufrac: device 0: refused 4 MiB: cap 64 MiB reached"),
        "{err}"
    );

    // Whole GPUs cannot be booked without a broker: refused, nothing run.
    let dir = Scratch::new("nobroker");
    let marker = dir.0.join("ran");
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .env_remove("GPUFRAC_BROKER")
        .args([
            "run",
            "--socket",
            "/nonexistent/broker.sock",
            "--gpus",
            "1",
            "--",
            "touch",
        ])
        .arg(&marker)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--gpus 1 needs the broker"),
        "{}",
        stderr(&o)
    );
    assert!(!marker.exists(), "the command ran without a booked GPU");
}

#[test]
fn docker_args_inject_the_shim_into_a_sealed_image() {
    let a = artifacts();
    let o = Command::new(&a.gpufrac)
        .args([
            "docker-args",
            "--gpu-memory",
            "8G",
            "--gpu-compute",
            "50%",
            "--gpus",
            "0",
            "--socket",
            "/run/gpufrac/broker.sock",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let args: Vec<String> = stdout(&o).lines().map(String::from).collect();
    let pair = |flag: &str, value: &str| args.windows(2).any(|w| w[0] == flag && w[1] == value);
    let lib = std::fs::canonicalize(&a.shim).unwrap();
    assert!(
        pair(
            "-v",
            &format!("{}:/usr/lib/gpufrac/libgpufrac.so:ro", lib.display())
        ),
        "{args:?}"
    );
    assert!(pair("-v", "/run/gpufrac:/run/gpufrac"), "{args:?}");
    assert!(
        pair("-e", "LD_PRELOAD=/usr/lib/gpufrac/libgpufrac.so"),
        "{args:?}"
    );
    assert!(pair("-e", "GPU_MEM_LIMIT=8G"), "{args:?}");
    assert!(pair("-e", "GPU_COMPUTE_SHARE=50%"), "{args:?}");
    assert!(
        pair("-e", "GPUFRAC_SOCKET=/run/gpufrac/broker.sock"),
        "{args:?}"
    );
    assert!(pair("--gpus", "device=0"), "{args:?}");
    // An image whose entrypoint clears LD_PRELOAD: a mounted preload file.
    let (_s, d) = scratch("docker");
    let f = d.join("ld.so.preload");
    let o = Command::new(&a.gpufrac)
        .args(["docker-args", "--gpu-memory", "8G", "--preload-file"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(&format!("{}:/etc/ld.so.preload:ro", f.display())),
        "{out}"
    );
    assert!(!out.contains("LD_PRELOAD="), "{out}");
    assert_eq!(
        std::fs::read_to_string(&f).unwrap().trim(),
        "/usr/lib/gpufrac/libgpufrac.so"
    );
}

#[test]
fn waiting_on_a_terminal_shows_a_status_line_and_off_a_terminal_lines_only() {
    let b = Broker::start("16G", &[]);
    let (_s, d) = scratch("tty");
    let a = job(&b, &d, "a", &["--gpus", "1"]);
    wait_started(&d, "a");
    // Under a pseudo-terminal (script(1)), the waiting line is drawn.
    let inner = format!(
        "{} run --socket {} --gpus 1 --timeout 1500ms -- true",
        artifacts().gpufrac.display(),
        b.socket.display()
    );
    let mut cmd = sim_command("script", &b.devices, false);
    cmd.env_remove("GPUFRAC_BROKER")
        .args(["-qec", &inner, "/dev/null"]);
    let o = cmd.output().unwrap();
    let out = stdout(&o);
    assert!(
        out.contains("waiting for 1 GPU") && out.contains("position 1"),
        "{out:?}"
    );
    // Not a terminal: lines only, no status line drawn over itself.
    let o = b
        .run(&["--gpus", "1", "--timeout", "500ms", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(124));
    let err = stderr(&o);
    assert!(
        !err.contains("position 1 —") && !err.contains('\r'),
        "{err}"
    );
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(
        lines[0].starts_with("gpufrac run: waiting for 1 GPU, position 1 in the queue: "),
        "{err}"
    );
    assert!(lines[1].contains("gave up after 500ms"), "{err}");
    release(&d, "a", a);
}

/// Off a terminal (every CI log), a queued run says that it waits, its
/// place and why (the broker's reason: what the run needs, what each GPU
/// has left and who holds it); and once placed, where and after how
/// long.
#[test]
fn a_queued_run_says_why_it_waits_and_when_it_is_placed() {
    let b = Broker::start("16G,16G", &[]);
    let (_s, d) = scratch("why");
    let a = job(&b, &d, "a", &["--gpu-memory", "12G"]);
    wait_started(&d, "a");
    let x = job(&b, &d, "x", &["--gpu-memory", "12G"]);
    wait_started(&d, "x");
    let log = d.join("w.stderr");
    let mut cmd = b.run(&["--gpu-memory", "8G"]);
    cmd.args(["--", "sh", "-c", &job_script(&d, "w")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let w = cmd.spawn().unwrap();
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until(10.0, "the waiting line", || said().contains("waiting for"));
    let first = said();
    let first = first.lines().next().unwrap().to_owned();
    // The broker's own reason (its queue's), naming each GPU's holder
    // as status names leases, by its run's pid.
    assert!(
        first.starts_with(
            "gpufrac run: waiting for 8.00 GiB of GPU memory, position 1 in the queue: needs \
             8.00 GiB on one GPU; GPU 0: 4.00 GiB free of 16.00 GiB (the rest held by job "
        ),
        "{first}"
    );
    for pid in [a.id(), x.id()] {
        assert!(first.contains(&format!("held by job {pid})")), "{first}");
    }
    release(&d, "a", a);
    wait_started(&d, "w");
    release(&d, "x", x);
    std::fs::write(d.join("w.stop"), "").unwrap();
    let mut w = w;
    assert!(w.wait().unwrap().success(), "{}", said());
    let all = said();
    let placed: Vec<&str> = all.lines().filter(|l| l.contains("placed on")).collect();
    assert_eq!(placed.len(), 1, "{all}");
    assert!(
        placed[0].starts_with("gpufrac run: placed on GPU ")
            && placed[0].contains(" after waiting "),
        "{all}"
    );
}

#[test]
fn priority_reaches_the_child_and_the_broker() {
    let b = Broker::start("16G", &[]);
    let o = b
        .run(&["--gpu-memory", "64M", "--priority", "high", "--"])
        .args(["sh", "-c", "echo \"prio=$GPU_COMPUTE_PRIORITY\""])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("prio=high"), "{}", stdout(&o));

    // A job that runs for a while under the shim registers with its class.
    let start = mono_ns();
    let end = start + 3_000_000_000;
    let mut cmd = b.run(&["--gpu-memory", "64M", "--priority", "low", "--"]);
    cmd.arg(&artifacts().loadgen)
        .args(["batch", "1000", &start.to_string(), &end.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    wait_until(10.0, "the low-priority job in status", || {
        b.status()["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["priority"] == "low")
    });
    let _ = child.kill();
    let _ = child.wait();

    let e = b
        .run(&["--priority", "urgent", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(e.status.code(), Some(2));
    assert!(stderr(&e).contains("high, normal, low"), "{}", stderr(&e));
}

/// A job without placement (a compute share only) still holds a lease, and
/// status counts how long it has held it.
#[test]
fn an_unplaced_job_counts_its_time_held() {
    let b = Broker::start("16G", &[]);
    let mut run = KillOnDrop(
        b.run(&["--gpu-compute", "30%", "--", "sh", "-c", "cat > /dev/null"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = u64::from(run.0.id());
    wait_until(20.0, "the unplaced lease's time held to grow", || {
        b.status()["leases"].as_array().is_some_and(|l| {
            l.iter()
                .any(|e| e["pid"].as_u64() == Some(pid) && e["held_s"].as_f64() > Some(0.05))
        })
    });
    drop(run.0.stdin.take());
    assert!(run.0.wait().unwrap().success());
}

/// The device plugin's side of the protocol, spoken raw: a lease pinned to
/// a GPU under a token the client chose, its name, and what is refused.
#[test]
fn pinned_leases_take_their_gpu_under_the_chosen_token() {
    use gpufrac_common::wire::{self, ClientMsg, LeaseReq, Pin, ServerMsg};
    let b = Broker::start("16G,16G", &[]);
    let second = {
        let s = b.status();
        s["gpus"][1]["uuid"].as_str().unwrap().to_owned()
    };
    let mut uuid = [0u8; 16];
    let hex: Vec<u8> = second[4..].bytes().filter(|&c| c != b'-').collect();
    for (i, byte) in uuid.iter_mut().enumerate() {
        *byte =
            u8::from_str_radix(std::str::from_utf8(&hex[2 * i..2 * i + 2]).unwrap(), 16).unwrap();
    }
    let lease = |token: u64, pin: Vec<Pin>, want_mem: u64| {
        ClientMsg::Lease(LeaseReq {
            want_mem,
            command: "pod".into(),
            token,
            pin,
            ..Default::default()
        })
    };
    let pin = || vec![Pin { uuid, mem: 4 << 30 }];

    // Name before any lease: an error that says what to do.
    let mut c = RawClient::connect(&b.socket);
    c.hello();
    c.send(&ClientMsg::Name {
        pod: "ml/a".into(),
        label: "x".into(),
    });
    match c.recv() {
        Some(ServerMsg::Error { message, .. }) => {
            assert!(message.contains("Lease first"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Pins and a size at once are refused.
    c.send(&lease(0, pin(), 1 << 30));
    match c.recv() {
        Some(ServerMsg::Refused { reason }) => assert!(reason.contains("not both"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // Placed on the pinned GPU (best fit alone would take GPU 0), under
    // the chosen token, and named.
    c.send(&lease(0xfeed, pin(), 0));
    match c.recv() {
        Some(ServerMsg::Leased(l)) => {
            assert_eq!((l.gpus, l.token, l.mem_cap), (vec![1], 0xfeed, 4 << 30))
        }
        other => panic!("{other:?}"),
    }
    c.send(&ClientMsg::Name {
        pod: "ml/a".into(),
        label: "container main".into(),
    });
    wait_until(20.0, "the lease named after its pod", || {
        b.status()["leases"][0]["pod"] == "ml/a"
    });
    let l = &b.status()["leases"][0];
    assert_eq!(l["command"], "container main");
    assert_eq!(l["gpus"], serde_json::json!([1]));
    // The same token again is refused while the job lives.
    let mut d = RawClient::connect(&b.socket);
    d.hello();
    d.send(&lease(0xfeed, pin(), 0));
    match d.recv() {
        Some(ServerMsg::Refused { reason }) => {
            assert!(reason.contains("another job's"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Its connection gone, the lease ends, and the token is free again.
    drop(c);
    wait_until(20.0, "the lease to end with its connection", || {
        b.status()["leases"].as_array().unwrap().is_empty()
    });
    d.send(&lease(0xfeed, pin(), 0));
    assert!(matches!(
        d.recv(),
        Some(ServerMsg::Leased(wire::Lease { token: 0xfeed, .. }))
    ));
}

/// Once, an escalated `--gpus 2` request beside its own user's 1-byte
/// lease on GPU 0 stopped placement for everyone: another user's request
/// timed out with GPU 1 idle, and `--no-wait` was refused. Its own user's
/// lease blocks it, so it holds nothing back from other users.
#[test]
fn a_users_own_lease_never_freezes_the_queue_for_others() {
    if !can_be_nobody() {
        return;
    }
    let b = Broker::start("16G,16G", &["--escalate-after", "1s", "--group", "nogroup"]);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(b.socket.parent().unwrap(), PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&b.state, PermissionsExt::from_mode(0o666)).unwrap();
    let (_s, d) = scratch("freeze");
    std::fs::set_permissions(&d, PermissionsExt::from_mode(0o777)).unwrap();
    let as_nobody = |name: &str, args: &[&str]| {
        let script = job_script(&d, name);
        let mut cmd = b.run(args);
        cmd.args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        as_user(&mut cmd, NOBODY).spawn().unwrap()
    };
    let byte = as_nobody("byte", &["--gpu-memory", "1"]);
    assert_eq!(wait_started(&d, "byte").0, "0");
    let big = KillOnDrop(as_nobody("big", &["--gpus", "2"]));
    wait_until(10.0, "the 2-GPU request to escalate", || {
        b.status()["queue"][0]["escalated"] == true
    });
    // Another user: at once with --no-wait, and from the queue.
    let now = job(&b, &d, "now", &["--gpus", "1", "--no-wait"]);
    assert_eq!(wait_started(&d, "now").0, "1", "GPU 1 was idle");
    release(&d, "now", now);
    let queued_job = job(&b, &d, "queued", &["--gpus", "1"]);
    assert_eq!(wait_started(&d, "queued").0, "1");
    release(&d, "queued", queued_job);
    assert!(started(&d, "big").is_none());
    drop(big);
    release(&d, "byte", byte);
}
