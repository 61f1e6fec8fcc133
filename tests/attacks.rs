//! The broker against its own users: each attack a local user could try
//! (floods, invented GPUs, extra connections, a lease's flags dropped from
//! the environment, a broker crash under running jobs), with real
//! processes against a real broker on a socket.
//!
//! Attacks that only mean something from another user (the per-user
//! connection limit) run the attacker as `nobody` when the tests run as
//! root, and are skipped with a message otherwise.

mod support;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

const MS: u64 = 1_000_000;
const KERNEL_NS: u64 = MS;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Kernels completed by each `spin` line in the output.
fn spun(o: &std::process::Output) -> Vec<u64> {
    let out = stdout(o);
    out.lines()
        .filter(|l| l.starts_with("spin "))
        .map(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("kernels="))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no kernel count in {l:?}"))
        })
        .collect()
}

#[test]
fn ten_processes_of_one_job_get_one_share_between_them() {
    let _s = serial();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let start = mono_ns() + 2000 * MS;
    let end = start + 3000 * MS;
    let probe = artifacts().probe.display().to_string();
    let args = spin_args(start, end).join(" ");
    // Ten spinners in one job, each declaring the largest legal share.
    let many = format!(
        "for i in 0 1 2 3 4 5 6 7 8 9; do GPU_COMPUTE_SHARE=100 {probe} {args} & done; wait"
    );
    let attacker = b
        .run(&["--", "sh", "-c", &many])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The victim declares the same legal maximum: one unit each.
    let victim = b
        .run(&["--", "env", "GPU_COMPUTE_SHARE=100"])
        .arg(&artifacts().probe)
        .args(spin_args(start, end))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let a = attacker.wait_with_output().unwrap();
    let v = victim.wait_with_output().unwrap();
    assert!(
        a.status.success() && v.status.success(),
        "{}{}",
        stderr(&a),
        stderr(&v)
    );
    let (a, v) = (spun(&a), spun(&v));
    assert_eq!(a.len(), 10, "ten attacker spinners reported");
    let total: u64 = a.iter().sum::<u64>() + v[0];
    let victim_share = v[0] as f64 / total as f64;
    eprintln!("figure: lone job beside a job of ten: {victim_share:.3} of the GPU");
    // Before jobs were the unit, the victim got 1/11 of the GPU.
    assert!(
        (victim_share - 0.5).abs() < 0.12,
        "the lone job got {victim_share:.2} of the GPU beside a job of ten (want 0.5): {v:?} vs {a:?}"
    );
}

#[test]
fn outside_jobs_a_user_with_ten_processes_gets_one_share() {
    // The victim runs the probe, the shim and the simulated driver from
    // this checkout as nobody.
    if !can_be_nobody() {
        return;
    }
    let _s = serial();
    let b = Broker::start("16G", &["--timeslice", "20ms", "--group", "nogroup"]);
    let dir = b.socket.parent().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, PermissionsExt::from_mode(0o755)).unwrap();
    // The simulated GPU's shared state, which the victim must map too.
    std::fs::set_permissions(&b.state, PermissionsExt::from_mode(0o666)).unwrap();
    let start = mono_ns() + 2000 * MS;
    let end = start + 3000 * MS;
    let spinner = |share: &str| {
        let mut c = b.client(&artifacts().probe);
        c.env("GPU_COMPUTE_SHARE", share)
            .args(spin_args(start, end))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    // Ten processes of root, each declaring the largest legal share (ten
    // connections at share 100 once left another user 208 kernels of
    // 2924).
    let attackers: Vec<Child> = (0..10).map(|_| spinner("100").spawn().unwrap()).collect();
    let mut v = spinner("100");
    let victim = as_user(&mut v, NOBODY).spawn().unwrap();
    let a: Vec<u64> = attackers
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            spun(&o)[0]
        })
        .collect();
    let vo = victim.wait_with_output().unwrap();
    assert!(vo.status.success(), "{}{}", stdout(&vo), stderr(&vo));
    let v = spun(&vo)[0];
    let share = v as f64 / (v + a.iter().sum::<u64>()) as f64;
    eprintln!("figure: one user's process beside another user's ten: {share:.3} of the GPU");
    assert!(
        (share - 0.5).abs() < 0.12,
        "a user with one process got {share:.2} beside a user with ten (want 0.5): {v} vs {a:?}"
    );
}

#[test]
fn a_jobs_limit_holds_whatever_its_processes_environment_says() {
    let _s = serial();
    let b = Broker::start("16G", &["--timeslice", "20ms"]);
    let start = mono_ns() + 1500 * MS;
    let end = start + 3000 * MS;
    let o = b
        .run(&["--gpu-limit", "10%", "--", "env", "-u", "GPU_COMPUTE_LIMIT"])
        .arg(&artifacts().probe)
        .args(spin_args(start, end))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let k = spun(&o)[0];
    let busy = (k * KERNEL_NS) as f64 / (end - start) as f64;
    eprintln!("figure: job under --gpu-limit 10% without the variable: {busy:.3} of the GPU");
    // It once ran at 66% with the variable removed.
    assert!(
        busy < 0.16,
        "a job under --gpu-limit 10% used {busy:.2} of the GPU"
    );
    assert!(busy > 0.04, "the job barely ran: {busy:.2}");
}

#[test]
fn a_jobs_memory_cap_holds_whatever_its_processes_environment_says() {
    let b = Broker::start("16G", &[]);
    let o = b
        .run(&["--gpu-memory", "1G", "--", "env", "GPU_MEM_LIMIT=8G"])
        .arg(&artifacts().probe)
        .args(["ctx", "fill", "alloc", "64M"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let got = num(&line(&o, "fill", 0), "count") * 64 * MIB;
    assert!(
        got <= GIB,
        "the job allocated {got} bytes under a 1 GiB lease with GPU_MEM_LIMIT=8G in its environment"
    );
    assert!(got >= GIB - 128 * MIB, "the job got only {got} bytes");
}

#[test]
fn invented_gpus_are_refused_and_status_stays_whole() {
    let b = Broker::start("16G", &[]);
    for i in 0..50u8 {
        let mut c = RawClient::connect(&b.socket);
        c.send(&gpufrac_common::wire::ClientMsg::hello(
            std::process::id(),
            gpufrac_common::wire::Role::Shim,
        ));
        assert!(matches!(
            c.recv(),
            Some(gpufrac_common::wire::ServerMsg::HelloOk { .. })
        ));
        c.send(&gpufrac_common::wire::ClientMsg::Register {
            command: "x".into(),
            devices: vec![gpufrac_common::wire::DeviceReg {
                uuid: [i.wrapping_add(0x40); 16],
                ordinal: 0,
                mem_cap: 0,
                mem_total: 1 << 40,
            }],
            share: None,
            limit: None,
            priority: gpufrac_common::config::Priority::Normal,
        });
        match c.recv() {
            Some(gpufrac_common::wire::ServerMsg::Error { message, .. }) => {
                assert!(message.contains("does not manage"), "{message}");
            }
            other => panic!("an invented GPU was accepted: {other:?}"),
        }
        assert_eq!(c.recv(), None, "the connection is closed after the refusal");
    }
    let s = status_cli(&b.socket);
    assert_eq!(s["gpus"].as_array().unwrap().len(), 1, "{s}");
}

/// A connection that said it is a CLI client cannot register and take
/// the GPU's turns as a process, nor a shim ask for a lease: each is told
/// which role sends the message and closed, holding nothing, and the
/// broker serves everyone else as before.
#[test]
fn a_connection_cannot_act_outside_its_hello_role() {
    use gpufrac_common::wire::{ClientMsg, DeviceReg, LeaseReq, Role, ServerMsg};
    let b = Broker::start("16G", &[]);
    let uuid = b.first_gpu_uuid();
    let register = ClientMsg::Register {
        command: "posing as a process".into(),
        devices: vec![DeviceReg {
            uuid,
            ordinal: 0,
            mem_cap: 0,
            mem_total: 16 << 30,
        }],
        share: Some(100.0),
        limit: None,
        priority: gpufrac_common::config::Priority::Normal,
    };
    let mut cli = RawClient::connect(&b.socket);
    cli.hello_as(Role::Cli);
    cli.send(&register);
    // The broker may have closed the connection already: a refused write
    // is one more way of not being served.
    let mut acquire = Vec::new();
    gpufrac_common::wire::encode_client(&ClientMsg::Acquire { uuid }, &mut acquire);
    let _ = cli.send_raw(&acquire);
    match cli.recv() {
        Some(ServerMsg::Error { message, .. }) => assert_eq!(
            message,
            "Register is a shim's message (libgpufrac.so in a process); this connection said it \
             is a CLI client (Hello role 2); open another connection with role Shim"
        ),
        other => panic!("a CLI connection registered: {other:?}"),
    }
    assert_eq!(cli.recv(), None, "closed after the refusal");

    let mut shim = RawClient::connect(&b.socket);
    shim.hello_as(Role::Shim);
    shim.send(&register);
    assert!(matches!(shim.recv(), Some(ServerMsg::Registered { .. })));
    shim.send(&ClientMsg::Lease(LeaseReq {
        want_mem: 1 << 30,
        ..Default::default()
    }));
    match shim.recv() {
        Some(ServerMsg::Error { message, .. }) => {
            assert!(
                message.starts_with("Lease is a CLI client's message"),
                "{message}"
            );
            assert!(message.contains("with role Cli"), "{message}");
        }
        other => panic!("a shim asked for a lease: {other:?}"),
    }
    assert_eq!(shim.recv(), None, "closed after the refusal");

    // Nothing of either is held, and others are served.
    wait_until(10.0, "the closed shim gone from status", || {
        status_cli(&b.socket)["gpus"][0]["processes"]
            .as_array()
            .unwrap()
            .is_empty()
    });
    let s = status_cli(&b.socket);
    assert!(s["leases"].as_array().unwrap().is_empty(), "{s}");
    assert!(s["queue"].as_array().unwrap().is_empty(), "{s}");
    let mut other = RawClient::connect(&b.socket);
    other.hello_as(Role::Shim);
    other.send(&register);
    assert!(matches!(other.recv(), Some(ServerMsg::Registered { .. })));
    other.send(&ClientMsg::Acquire { uuid });
    assert!(matches!(other.recv(), Some(ServerMsg::Grant { .. })));
}

#[test]
fn status_pages_through_more_processes_than_one_frame_holds() {
    let b = Broker::start("16G", &["--max-connections-per-user", "3000"]);
    let uuid = b.first_gpu_uuid();
    let long = "x".repeat(2000);
    let mut held = Vec::new();
    for _ in 0..1200 {
        let mut c = RawClient::connect(&b.socket);
        c.send(&gpufrac_common::wire::ClientMsg::hello(
            std::process::id(),
            gpufrac_common::wire::Role::Shim,
        ));
        c.send(&register_msg(
            uuid,
            &long,
            gpufrac_common::config::Priority::Normal,
        ));
        held.push(c);
    }
    // 1200 processes with 2 KB command lines are 2.4 MB of JSON: more
    // than one frame, which once made status fail for everyone.
    // All 1200 registered: none was closed for a hello the broker itself
    // was slow to read (a registration swept so never shows).
    wait_until(20.0, "all 1200 registrations", || {
        match try_status_cli(&b.socket) {
            Ok(s) => s["gpus"][0]["processes"].as_array().unwrap().len() == 1200,
            Err(e) => {
                eprintln!("status failed, trying again: {e}");
                false
            }
        }
    });
    // And a status right after, at once: the broker answers it whole.
    let s = status_cli(&b.socket);
    assert_eq!(s["gpus"][0]["processes"].as_array().unwrap().len(), 1200);
}

/// Opens up to `n` connections that never say hello, as `uid` when given,
/// and reports how many the broker accepted and, after `hold`, how many it
/// had closed.
fn flood(socket: &Path, n: usize, as_nobody: bool, hold_s: f64) -> Child {
    let script = format!(
        r#"
import os, socket, sys, time
if {nobody}:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
socks = []
for i in range({n}):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect({path:?})
        socks.append(s)
    except OSError:
        s.close()
print("opened", len(socks), flush=True)
sys.stdin.readline()
deadline = time.time() + {hold}
closed = 0
for s in socks:
    s.settimeout(max(0.01, deadline - time.time()))
    try:
        data = s.recv(4096)
        if data == b"" or data:
            # A refusal frame or EOF: the broker let go of it.
            closed += 1
    except OSError:
        pass
print("closed", closed, flush=True)
"#,
        nobody = if as_nobody { "True" } else { "False" },
        path = socket.display().to_string(),
        hold = hold_s,
    );
    Command::new("python3")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

#[test]
fn an_idle_flood_from_another_user_neither_stops_the_broker_nor_outlives_itself() {
    if !is_root() {
        eprintln!("skipped: needs root to run the attacker as nobody");
        return;
    }
    let _s = serial();
    let b = Broker::start(
        "16G",
        &["--group", "nogroup", "--max-connections-per-user", "200"],
    );
    // The socket's directory must be traversable by nobody.
    let dir = b.socket.parent().unwrap();
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut f = flood(&b.socket, 1100, true, 6.0);
    let opened = read_line(&mut f);
    assert!(opened.starts_with("opened"), "{opened}");
    // The flood is held open: everyone else is still served at once.
    let t = Instant::now();
    let s = status_cli(&b.socket);
    assert!(s["gpus"].is_array());
    eprintln!(
        "figure: status during an 1100-connection idle flood: {:?}",
        t.elapsed()
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "status took {:?} during the flood",
        t.elapsed()
    );
    let probe = b
        .client(&artifacts().probe)
        .env("GPUFRAC_BROKER", "required")
        .args(["ctx", "launch", "3", "1000"])
        .output()
        .unwrap();
    assert!(probe.status.success(), "{}", stderr(&probe));
    assert_eq!(
        num(&line(&probe, "launch", 0), "rc"),
        0,
        "{}",
        stdout(&probe)
    );
    // And the flood does not outlive its hello deadline: every connection
    // it holds was refused or closed by the broker.
    f.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
    let closed = read_line(&mut f);
    let n: usize = opened.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(closed, format!("closed {n}"), "opened {n}");
    f.wait().unwrap();
}

#[test]
fn out_of_file_descriptors_the_broker_sheds_connections_and_recovers() {
    let _s = serial();
    // A broker whose hard file limit is low: the flood exhausts it.
    let dir = Scratch::new("nofile");
    let socket = dir.0.join("b.sock");
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.args(["broker", "--socket"])
        .arg(&socket)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setrlimit in the child before exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            let rl = libc::rlimit {
                rlim_cur: 96,
                rlim_max: 96,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
            Ok(())
        });
    }
    let mut broker = KillOnDrop(cmd.spawn().unwrap());
    wait_until(20.0, "the broker socket", || {
        UnixStream::connect(&socket).is_ok()
    });
    let mut f = flood(&socket, 300, false, 6.0);
    let opened = read_line(&mut f);
    assert!(opened.starts_with("opened"), "{opened}");
    // Served again within the hello deadline, while the flood still holds
    // its sockets.
    wait_until(10.0, "status to be served during the flood", || {
        Command::new(&artifacts().gpufrac)
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .is_ok_and(|o| o.status.success())
    });
    f.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
    let closed = read_line(&mut f);
    let n: usize = opened.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(closed, format!("closed {n}"));
    f.wait().unwrap();
    assert!(broker.0.try_wait().unwrap().is_none(), "the broker died");
}

#[test]
fn half_sent_frames_cost_bounded_memory_and_are_dropped() {
    let _s = serial();
    let b = Broker::start("16G", &["--max-connections-per-user", "1000"]);
    let pid = b.child.id();
    let before = rss_kb(pid);
    let mut held = Vec::new();
    for i in 0..400 {
        let mut s = UnixStream::connect(&b.socket).unwrap();
        let mut hello = Vec::new();
        gpufrac_common::wire::encode_client(
            &gpufrac_common::wire::ClientMsg::hello(1, gpufrac_common::wire::Role::Cli),
            &mut hello,
        );
        s.write_all(&hello).unwrap();
        // Half the connections claim a 1 MiB frame (refused at once: no
        // client frame is that large); half send 200 KiB of a 250 KiB one.
        if i % 2 == 0 {
            s.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
        } else {
            s.write_all(&(250u32 << 10).to_le_bytes()).unwrap();
            s.write_all(&[0x02]).unwrap();
            let _ = s.write_all(&vec![0u8; 200 << 10]);
        }
        held.push(s);
    }
    let grown_mb = (rss_kb(pid).saturating_sub(before)) / 1024;
    eprintln!("figure: broker growth under 400 half-sent frames: {grown_mb} MB");
    // 800 such frames once took 827 MB.
    assert!(grown_mb < 100, "the broker grew by {grown_mb} MB");
    // Every one of them is closed: at once, or at the frame deadline.
    for mut s in held {
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("a half-sent frame's connection was kept open: {e}"),
            }
        }
    }
    assert!(status_cli(&b.socket)["gpus"].is_array());
}

#[test]
fn a_restarted_broker_keeps_running_leases_and_the_queue() {
    let b0 = Broker::start("16G", &[]);
    let mut b = b0;
    // A holds the only GPU until told; B waits behind it. A holds it once
    // its command runs: a lease is told to its run only when the state
    // that books it is on disk.
    let mut a = b
        .run(&["--gpus", "1", "--", "sh", "-c", "echo started; read x"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(read_line(&mut a), "started");
    let queued = b
        .run(&["--gpus", "1", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until(20.0, "B in the queue", || {
        b.status()["queue"].as_array().is_some_and(|q| q.len() == 1)
    });
    // A request that only waits is written within a second (a lease
    // within 100 ms): the crash comes once B's place is on disk.
    wait_until(10.0, "B's place in the state file", || {
        std::fs::read(b.state_file())
            .ok()
            .and_then(|s| serde_json::from_slice::<serde_json::Value>(&s).ok())
            .is_some_and(|s| s["jobs"].as_array().is_some_and(|j| j.len() == 2))
    });

    b.kill(); // SIGKILL: no clean shutdown, the state file stays.
    let t = Instant::now();
    b.restart();

    wait_until(20.0, "A and B to reclaim their lease and place", || {
        let s = b.status();
        s["leases"]
            .as_array()
            .is_some_and(|l| l.len() == 1 && l[0]["connected"] == serde_json::Value::Bool(true))
            && s["queue"].as_array().is_some_and(|q| q.len() == 1)
    });
    eprintln!(
        "figure: restart to lease and place reclaimed: {:?}",
        t.elapsed()
    );
    // The GPU A holds is not handed out again.
    let o = b
        .run(&["--gpus", "1", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no room now"), "{}", stderr(&o));

    // A ends; B, which kept its place, runs.
    a.stdin.take().unwrap().write_all(b"done\n").unwrap();
    let ao = a.wait_with_output().unwrap();
    assert!(ao.status.success(), "{}", stderr(&ao));
    let bo = queued.wait_with_output().unwrap();
    assert!(bo.status.success(), "B lost its place: {}", stderr(&bo));
}

#[test]
fn a_socket_directory_others_can_write_is_refused() {
    let dir = Scratch::new("opendir");
    let open = dir.0.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let o = sim_command(&artifacts().gpufrac, "16G", false)
        .args(["broker", "--socket"])
        .arg(open.join("b.sock"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("writable by everyone") && stderr(&o).contains("chmod go-w"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_dir(&open).unwrap().count(),
        0,
        "left something behind"
    );
}

#[test]
fn idle_metrics_connections_do_not_delay_a_scrape() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let b = Broker::start("16G", &["--metrics", &addr]);
    let _ = &b;
    let idle: Vec<std::net::TcpStream> = (0..10)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    // Below the 2 s an idle connection may take: answered at once, not
    // after the ten idle ones (20 s before).
    s.set_read_timeout(Some(Duration::from_millis(1500)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    drop(idle);
}

/// Deterministic pseudo-random numbers (xorshift64*): the same sequence
/// every run, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_msg(r: &mut Rng, real: [u8; 16]) -> Vec<u8> {
    use gpufrac_common::config::Priority;
    use gpufrac_common::wire::{ClientMsg, DeviceReg, LeaseReq, Pin, encode_client};
    let uuid = if r.below(4) == 0 {
        [r.below(256) as u8; 16]
    } else {
        real
    };
    let f = |r: &mut Rng| match r.below(5) {
        0 => None,
        1 => Some(f64::NAN),
        2 => Some(1e300),
        3 => Some(-5.0),
        _ => Some(r.below(120) as f64),
    };
    let prio = [Priority::Low, Priority::Normal, Priority::High][r.below(3) as usize];
    let msg = match r.below(12) {
        0 => ClientMsg::Register {
            command: "fuzz".into(),
            devices: vec![DeviceReg {
                uuid,
                ordinal: r.below(4) as u32,
                mem_cap: r.next(),
                mem_total: r.next(),
            }],
            share: f(r),
            limit: f(r),
            priority: prio,
        },
        1 => ClientMsg::Usage {
            uuid,
            used: r.next(),
            peak: r.next(),
            ooms: r.next(),
        },
        2 | 3 => ClientMsg::Acquire { uuid },
        4 | 5 => ClientMsg::Release {
            uuid,
            held_ns: r.next(),
        },
        6 => ClientMsg::Drained { uuid },
        7 => ClientMsg::Status {
            from: r.below(3) as u32,
        },
        8 => ClientMsg::Ping,
        9 => ClientMsg::Lease(LeaseReq {
            want_gpus: r.below(3) as u32,
            want_mem: if r.below(2) == 0 {
                0
            } else {
                r.below(32) << 30
            },
            compute: f(r),
            limit: f(r),
            no_wait: r.below(2) == 0,
            command: "fuzz".into(),
            priority: Some(prio),
            resume: if r.below(4) == 0 { r.next() } else { 0 },
            token: if r.below(4) == 0 { r.next() } else { 0 },
            pin: if r.below(3) == 0 {
                vec![Pin {
                    uuid,
                    mem: r.below(32) << 30,
                }]
            } else {
                Vec::new()
            },
        }),
        10 => ClientMsg::Name {
            pod: "fuzz/pod".into(),
            label: "fuzz".into(),
        },
        _ => {
            // Garbage: a random frame.
            let n = r.below(40) as usize;
            let mut b = (n as u32 + 1).to_le_bytes().to_vec();
            b.extend((0..=n).map(|_| r.below(256) as u8));
            return b;
        }
    };
    let mut b = Vec::new();
    encode_client(&msg, &mut b);
    b
}

#[test]
fn random_client_sequences_leave_the_broker_whole() {
    let b = Broker::start("16G,8G", &[]);
    let real = b.first_gpu_uuid();
    for round in 0..4u64 {
        let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ (round + 1));
        let mut clients: Vec<UnixStream> = Vec::new();
        for _ in 0..24 {
            let mut s = UnixStream::connect(&b.socket).unwrap();
            let mut hello = Vec::new();
            let role = if r.below(2) == 0 {
                gpufrac_common::wire::Role::Shim
            } else {
                gpufrac_common::wire::Role::Cli
            };
            gpufrac_common::wire::encode_client(
                &gpufrac_common::wire::ClientMsg::hello(1, role),
                &mut hello,
            );
            s.write_all(&hello).unwrap();
            s.set_nonblocking(true).unwrap();
            clients.push(s);
        }
        for _ in 0..3000 {
            let i = r.below(clients.len() as u64) as usize;
            let m = random_msg(&mut r, real);
            // A client the broker closed (bad frame) just stops mattering.
            let _ = clients[i].write_all(&m);
            // Drain replies now and then so well-behaved clients stay so.
            if r.below(8) == 0 {
                let mut buf = [0u8; 65536];
                let _ = clients[i].read(&mut buf);
            }
        }
        // The broker still serves everyone, and its books are consistent.
        let s = status_cli(&b.socket);
        for g in s["gpus"].as_array().unwrap() {
            let holders = g["processes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["state"] == "holding")
                .count();
            assert!(holders <= 1, "two holders on one GPU: {g}");
            assert!(g["committed_mem"].as_u64().unwrap() <= g["total_mem"].as_u64().unwrap());
        }
        assert_eq!(s["gpus"].as_array().unwrap().len(), 2, "{s}");
        drop(clients);
        // Nothing outlives its clients: no process, lease or queue entry.
        wait_until(10.0, "the fuzz clients to be forgotten", || {
            let Ok(s) = try_status_cli(&b.socket) else {
                return false;
            };
            s["gpus"]
                .as_array()
                .unwrap()
                .iter()
                .all(|g| g["processes"].as_array().unwrap().is_empty())
                && s["leases"].as_array().unwrap().is_empty()
                && s["queue"].as_array().unwrap().is_empty()
        });
    }
}
