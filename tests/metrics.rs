//! The metrics endpoint of a real broker over real sockets: what it
//! holds up against (connections that trickle, many peers), what it
//! serves on a live node on the simulated driver (caps, users, jobs,
//! shares, the queue, grant latency, refusals; every family listed in
//! docs/metrics.md), and, as engine tests, `promtool check metrics` on its
//! scrapes and a real Prometheus scraping it, against which every query of
//! the Grafana dashboard (deploy/grafana/gpufrac.json) must return data.

mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::*;

/// `GET path` over a fresh connection: (status code, body). HTTP/1.0, so
/// that the body comes whole, never chunked. A bound on the read against
/// a hang, never a measure.
fn get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)
        .map_err(|e| format!("read: {e}"))?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP answer: {reply:?}"))?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    Ok((code, body.to_owned()))
}

fn scrape(addr: &str) -> String {
    let (code, body) = get(addr, "/metrics").unwrap_or_else(|e| panic!("scrape {addr}: {e}"));
    assert_eq!(code, 200, "{body}");
    body
}

/// The value of the sample `series` (as written, labels and all).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The families a scrape names in its HELP lines.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

fn broker_with_metrics(devices: &str, more: &[&str]) -> (Broker, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["--metrics", &addr];
    args.extend_from_slice(more);
    let b = Broker::start(devices, &args);
    wait_until(20.0, "the metrics endpoint", || {
        get(&addr, "/metrics").is_ok()
    });
    (b, addr)
}

/// Connections that each send one byte of a request now and then and
/// never finish it, from 127.0.0.1 like every local user: while they
/// trickle, scrapes are still answered. Before, 32 of them held every
/// serving thread (each read reset a 2 s timeout) and no scrape was.
#[test]
fn a_trickle_of_requests_from_one_peer_never_holds_the_endpoint() {
    let (_b, addr) = broker_with_metrics("16G", &[]);
    let conns: Vec<TcpStream> = (0..32)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(b"G").unwrap();
            s
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let trickle = {
        let stop = stop.clone();
        let mut conns: Vec<TcpStream> = conns.iter().map(|c| c.try_clone().unwrap()).collect();
        std::thread::spawn(move || {
            let mut sent = 1;
            while !stop.load(Ordering::Relaxed) {
                let byte = &b"GET /metrics HTTP/1.1\r\nX-Pad: "[sent % 30..][..1];
                for c in &mut conns {
                    // Those the endpoint closed fail; the rest go on.
                    let _ = c.write_all(byte);
                }
                sent += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    // The endpoint accepts in order: each scrape comes after all 32 began
    // their requests, and while they trickle.
    for i in 0..8 {
        let body = scrape(&addr);
        assert!(body.contains("gpufrac_build_info{"), "scrape {i}: {body}");
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::Relaxed);
    trickle.join().unwrap();
    // Those that made room for the scrapes are counted as such.
    let evicted = value(
        &scrape(&addr),
        "gpufrac_metrics_connections_closed_total{reason=\"evicted\"}",
    );
    assert!(evicted.is_some_and(|n| n >= 1.0), "{evicted:?}");
}

/// A request whose bytes keep coming, ten a second, is cut at its one
/// deadline, however long the trickle would go on (before, each byte
/// restarted a 2 s read timeout up to 8 KiB: about 14 minutes).
#[test]
fn a_request_trickled_forever_is_cut_at_its_deadline() {
    let (_b, addr) = broker_with_metrics("16G", &[]);
    let mut s = TcpStream::connect(&addr).unwrap();
    let mut reader = s.try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // A request line that never ends.
            let head = b"GET /metrics?";
            let mut sent = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let b = head.get(sent).copied().unwrap_or(b'a');
                if s.write_all(&[b]).is_err() {
                    break;
                }
                sent += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            sent
        })
    };
    // The endpoint closes it: the read ends (a bound against a hang only).
    reader
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut buf = [0u8; 256];
    let r = reader.read(&mut buf);
    stop.store(true, Ordering::Relaxed);
    let sent = writer.join().unwrap();
    match r {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("not closed by the endpoint: {other:?} after {sent} bytes"),
    }
    let deadline = value(
        &scrape(&addr),
        "gpufrac_metrics_connections_closed_total{reason=\"deadline\"}",
    );
    assert_eq!(deadline, Some(1.0));
}

/// Hundreds of idle connections from many peer addresses (127.0.0.2 and
/// up) hold no more than the endpoint's bound of descriptors in the
/// broker, and a scrape still gets in.
#[test]
fn connections_from_many_peers_are_bounded_in_all() {
    let (b, addr) = broker_with_metrics("16G", &[]);
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", b.child.id()))
            .unwrap()
            .count()
    };
    let before = fds();
    let target: std::net::SocketAddrV4 = addr.parse().unwrap();
    let mut held = Vec::new();
    for peer in 2..=41u8 {
        for _ in 0..8 {
            let s = connect_from([127, 0, 0, peer], target).expect("connect from 127.0.0.x");
            held.push(s);
        }
    }
    // 320 connections in the kernel's queue or the endpoint's hands (it
    // accepts in order: all of them before the scrape's): a scrape goes
    // through, and the broker holds at most its bound.
    let body = scrape(&addr);
    assert!(body.contains("gpufrac_build_info{"));
    let bound = gpufrac_broker::METRICS_CONNECTIONS;
    let evicted = value(
        &scrape(&addr),
        "gpufrac_metrics_connections_closed_total{reason=\"evicted\"}",
    );
    assert!(
        evicted.is_some_and(|n| n >= (held.len() - bound) as f64),
        "{evicted:?}"
    );
    wait_until(20.0, "the evicted connections closed", || {
        fds().saturating_sub(before) <= bound + 1
    });
    drop(held);
}

/// `--metrics PORT` serves 127.0.0.1:PORT and nothing else.
#[test]
fn a_port_alone_is_served_on_loopback_only() {
    let port = free_port();
    let b = Broker::start("16G", &["--metrics", &port.to_string()]);
    let addr = format!("127.0.0.1:{port}");
    wait_until(20.0, "the metrics endpoint", || {
        get(&addr, "/metrics").is_ok()
    });
    // The listening socket, as the kernel lists it: loopback only.
    let listening: Vec<String> = std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(3) == Some(&"0A") && f[1].ends_with(&format!(":{port:04X}")))
                .then(|| f[1].to_owned())
        })
        .collect();
    assert_eq!(listening, [format!("0100007F:{port:04X}")]);
    assert!(
        !std::fs::read_to_string("/proc/net/tcp6")
            .unwrap_or_default()
            .contains(&format!(
                ":{port:04X} 00000000000000000000000000000000:0000 0A"
            )),
        "also on IPv6"
    );
    drop(b);
}

/// A node on the simulated driver with a bit of everything, its three
/// brokers serving metrics: a plain one (two GPUs: two jobs sharing GPU
/// 0 at 70% and 30% with memory caps, a process outside any job refused
/// memory past its cap, an interactive `high` process, two loops of
/// `gpufrac run --gpus 1` queueing for GPU 1, a `--no-wait` refused),
/// one under `--mps` (the stand-in daemon, a job with an SM share) and
/// one under `--mig dynamic` (a job on an instance). Everything it
/// started stops when it is dropped.
struct Node {
    dir: Scratch,
    plain: Broker,
    mig: Broker,
    mps: KillOnDrop,
    mps_socket: PathBuf,
    addrs: Vec<String>,
    /// What ends when told to stop (the stop file).
    procs: Vec<KillOnDrop>,
    /// What is killed.
    direct: Vec<KillOnDrop>,
}

impl Node {
    fn start() -> Node {
        let dir = Scratch::new("metrics-node");
        let stop = dir.0.join("stop");
        let a = artifacts();
        let (plain, plain_addr) = broker_with_metrics("16G,16G", &[]);
        let (mig, mig_addr) = broker_with_metrics("A100-40GB:mig,16G", &["--mig", "dynamic"]);
        let mps_addr = format!("127.0.0.1:{}", free_port());
        let mps_socket = dir.0.join("mps.sock");
        let path = mps_standin(&dir.0);
        let mps = KillOnDrop(
            sim_command(&a.gpufrac, "16G", false)
                .args(["broker", "--mps", "--metrics", &mps_addr, "--socket"])
                .arg(&mps_socket)
                .arg("--state-dir")
                .arg(dir.0.join("mps-state"))
                .env("PATH", &path)
                .env("GPUFRAC_MPS_STANDIN_LOG", dir.0.join("standin.log"))
                .env("GPUFRAC_SIM_STATE", dir.0.join("mps-sim"))
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(dir.0.join("mps-broker.log")).unwrap(),
                ))
                .spawn()
                .unwrap(),
        );
        let mut node = Node {
            plain,
            mig,
            mps,
            mps_socket,
            addrs: vec![plain_addr, mps_addr, mig_addr],
            procs: Vec::new(),
            direct: Vec::new(),
            dir,
        };
        wait_until(20.0, "the MPS broker's daemon", || {
            try_status_cli(&node.mps_socket).is_ok_and(|s| s["mps"]["state"] == "running")
        });
        let probe = a.probe.display().to_string();
        let loadgen = a.loadgen.display().to_string();
        let hold = format!("wait-file {}", stop.display());
        // Two jobs sharing GPU 0 at 70% and 30%, each under its memory cap,
        // busy with 2 ms kernels until the node stops.
        for (mem, share) in [("4G", "70%"), ("2G", "30%")] {
            let script = format!(
                "{probe} ctx alloc alloc 256M {hold} >/dev/null & \
                 {loadgen} batch 2000 +0 +3600 >/dev/null & l=$!; \
                 while [ ! -e {stop} ]; do sleep 0.05; done; kill $l; wait",
                stop = stop.display()
            );
            let mut c = node
                .plain
                .run(&["--gpu-memory", mem, "--gpu-compute", share, "--"]);
            c.args(["sh", "-c", &script]).stdout(Stdio::null());
            node.procs.push(KillOnDrop(c.spawn().unwrap()));
        }
        // Outside any job: a process refused memory past its own cap, and
        // an interactive `high` one.
        let mut c = node.plain.client(&a.probe);
        c.env("GPU_MEM_LIMIT", "1G")
            .args(["ctx", "alloc", "alloc", "512M", "alloc", "alloc", "2G"])
            .args(hold.split(' '))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        node.procs.push(KillOnDrop(c.spawn().unwrap()));
        let mut c = node.plain.client(&a.loadgen);
        c.env("GPU_COMPUTE_PRIORITY", "high")
            .args(["interactive", "4", "200", "20000", "+0", "+3600"])
            .stdout(Stdio::null());
        node.direct.push(KillOnDrop(c.spawn().unwrap()));
        wait_until(30.0, "both jobs on GPU 0", || {
            node.plain.status()["leases"].as_array().is_some_and(|l| {
                l.iter()
                    .filter(|l| l["gpus"] == serde_json::json!([0]))
                    .count()
                    == 2
            })
        });
        // Two loops of whole-GPU jobs: one holds GPU 1 while the other waits.
        for _ in 0..2 {
            let script = format!(
                "while [ ! -e {} ]; do {} run --socket {} --gpus 1 -- sleep 0.3 || exit 1; done",
                stop.display(),
                a.gpufrac.display(),
                node.plain.socket.display()
            );
            let mut c = sim_command("sh", "16G,16G", false);
            c.env_remove("GPUFRAC_BROKER")
                .env("GPUFRAC_SIM_STATE", &node.plain.state)
                .args(["-c", &script])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            node.procs.push(KillOnDrop(c.spawn().unwrap()));
        }
        // More than the node has room for now: refused.
        let o = node
            .plain
            .run(&["--no-wait", "--gpus", "2", "--", "true"])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{}", stderr(&o));
        // A process of a job that holds a little memory until the node
        // stops: under MPS, with an SM share; under --mig dynamic, on an
        // instance made for it.
        let stop_path = stop.display().to_string();
        let holder = [
            &*probe,
            "ctx",
            "alloc",
            "alloc",
            "64M",
            "wait-file",
            &*stop_path,
        ];
        let mut c = sim_command(&a.gpufrac, "16G", false);
        c.env_remove("GPUFRAC_BROKER")
            .env("GPUFRAC_SIM_STATE", node.dir.0.join("mps-sim"))
            .args(["run", "--socket"])
            .arg(&node.mps_socket)
            .args(["--gpu-memory", "1G", "--gpu-compute", "30%", "--"]);
        let mig = node.mig.run(&["--gpu-memory", "4G", "--"]);
        for mut c in [c, mig] {
            c.args(holder).stdout(Stdio::null());
            node.procs.push(KillOnDrop(c.spawn().unwrap()));
        }
        node
    }

    /// Waits until each broker's scrape shows what the node runs.
    fn wait_busy(&self) {
        let [plain, mps, mig] = [&self.addrs[0], &self.addrs[1], &self.addrs[2]];
        wait_until(60.0, "the node's work in its metrics", || {
            let p = scrape(plain);
            let queued: f64 = p
                .lines()
                .filter(|l| l.starts_with("gpufrac_queue_wait_seconds_count{"))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum();
            let refused = p.lines().any(|l| {
                l.starts_with("gpufrac_user_memory_refusals_total{") && !l.ends_with(" 0")
            });
            queued >= 2.0
                && refused
                && value(&p, "gpufrac_grant_latency_seconds_count{class=\"high\"}")
                    .is_some_and(|n| n >= 1.0)
                && scrape(mps).contains("gpufrac_process_mps_thread_ratio{")
                && scrape(mig).contains("state=\"in-use\"")
        });
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Told to stop, the jobs end their children themselves (a killed
        // `gpufrac run` would leave them behind); killed only if they do
        // not.
        let _ = std::fs::write(self.dir.0.join("stop"), "");
        self.direct.clear();
        let end = std::time::Instant::now() + Duration::from_secs(20);
        for p in &mut self.procs {
            while std::time::Instant::now() < end && p.0.try_wait().is_ok_and(|s| s.is_none()) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.procs.clear();
        // A clean stop tells the MPS daemon to quit.
        // SAFETY: signalling the broker this test started.
        unsafe { libc::kill(self.mps.0.id() as i32, libc::SIGTERM) };
        let _ = self.mps.0.wait();
        self.plain.kill();
        self.mig.kill();
    }
}

/// What a broker serves on a live node: caps, users and jobs, shares, the
/// queue's waits and the grants' latency, refusals by reason; and every
/// family docs/metrics.md lists, no more, no fewer.
#[test]
fn a_live_node_is_measured_and_every_family_is_documented() {
    let _serial = serial();
    let node = Node::start();
    node.wait_busy();
    // Both jobs' processes registered and busy (on a loaded machine the
    // second job's may come after the rest of the node's work).
    let job_targets = |p: &str| {
        p.lines()
            .filter(|l| {
                l.starts_with("gpufrac_job_share_target_ratio{gpu=\"0\"")
                    && !l.contains("job_id=\"none\"")
                    && !l.ends_with(" 0")
            })
            .count()
    };
    let mut p = String::new();
    wait_until(30.0, "both jobs busy on GPU 0", || {
        p = scrape(&node.addrs[0]);
        job_targets(&p) == 2
    });
    let line = |prefix: &str, has: &[&str]| -> f64 {
        let l = p
            .lines()
            .find(|l| l.starts_with(prefix) && has.iter().all(|h| l.contains(h)))
            .unwrap_or_else(|| panic!("no {prefix} with {has:?} in\n{p}"));
        l.rsplit_once(' ').unwrap().1.parse().unwrap()
    };
    let gib = (1u64 << 30) as f64;
    // The jobs' caps; the process outside any job, its own, and the
    // refusal past it, counted for its user (by name).
    let me = format!("user=\"{}\"", user_name());
    let caps: BTreeSet<u64> = p
        .lines()
        .filter(|l| l.starts_with("gpufrac_job_memory_cap_bytes{"))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap() as u64)
        .collect();
    assert!(
        caps.contains(&(4 << 30)) && caps.contains(&(2 << 30)),
        "{caps:?}"
    );
    assert_eq!(
        line(
            "gpufrac_process_memory_cap_bytes{",
            &["job_id=\"none\"", "class=\"normal\""]
        ),
        gib
    );
    assert!(line("gpufrac_user_memory_refusals_total{gpu=\"0\"", &[&me]) >= 1.0);
    assert!(line("gpufrac_job_info{", &[&me, "name=\"sh\""]) == 1.0);
    // The jobs' targets stand as 70 to 30 within the user's part.
    let targets: Vec<f64> = p
        .lines()
        .filter(|l| {
            l.starts_with("gpufrac_job_share_target_ratio{gpu=\"0\"")
                && !l.contains("job_id=\"none\"")
        })
        .map(|l| l.rsplit_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert_eq!(targets.len(), 2, "{p}");
    let (hi, lo) = (targets[0].max(targets[1]), targets[0].min(targets[1]));
    assert!((hi / lo - 70.0 / 30.0).abs() < 0.01, "{targets:?}");
    // What the busy jobs were owed grows as their GPU time does.
    let owed: Vec<f64> = p
        .lines()
        .filter(|l| {
            l.starts_with("gpufrac_job_entitled_seconds_total{gpu=\"0\"")
                && !l.contains("job_id=\"none\"")
        })
        .map(|l| l.rsplit_once(' ').unwrap().1.parse().unwrap())
        .collect();
    assert!(owed.len() == 2 && owed.iter().all(|&v| v > 0.0), "{owed:?}");
    // Grants were timed in the classes that asked; queued requests' waits
    // and the refused --no-wait are counted.
    assert!(line("gpufrac_grant_latency_seconds_count{", &["class=\"high\""]) >= 1.0);
    assert!(
        line(
            "gpufrac_grant_latency_seconds_count{",
            &["class=\"normal\""]
        ) >= 1.0
    );
    assert!(line("gpufrac_queue_wait_seconds_count{", &[&me]) >= 2.0);
    // Refusals and waits are the user's: the refused --no-wait is counted
    // for its user, and said in one line of the broker's log.
    assert!(line("gpufrac_refusals_total{", &["reason=\"no_room\"", &me]) >= 1.0);
    let log = node.plain.log();
    assert!(
        log.lines()
            .any(|l| l.contains("refused a lease") && l.contains("reason=\"no_room\"")),
        "{log}"
    );
    // A quantile of grants that took no time reads 0: the first bucket is
    // 0 itself.
    assert!(p.contains("gpufrac_grant_latency_seconds_bucket{class=\"high\",le=\"0\"}"));
    assert_eq!(
        line("gpufrac_build_info{", &[]),
        1.0,
        "{}",
        p.lines()
            .find(|l| l.starts_with("gpufrac_build_info"))
            .unwrap_or("")
    );
    // The families served, by the three brokers together, are those the
    // document lists.
    let served: BTreeSet<String> = node
        .addrs
        .iter()
        .flat_map(|a| families(&scrape(a)))
        .collect();
    let documented = documented_families();
    assert_eq!(
        served.difference(&documented).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "served, not in docs/metrics.md"
    );
    assert_eq!(
        documented.difference(&served).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "in docs/metrics.md, never served"
    );
}

/// This process's user's login name.
fn user_name() -> String {
    let o = Command::new("id").arg("-un").output().unwrap();
    stdout(&o).trim().to_owned()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The families docs/metrics.md lists: the first cell of its tables' rows.
fn documented_families() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(repo().join("docs/metrics.md")).unwrap();
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|n| n.starts_with("gpufrac_") || n.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

/// Prometheus's `promtool` and `prometheus`, from Debian's package; None
/// (said) where this machine cannot have them.
fn prometheus_installed(what: &str) -> bool {
    if !engines_wanted(what) {
        return false;
    }
    let present =
        || Path::new("/usr/bin/prometheus").exists() && Path::new("/usr/bin/promtool").exists();
    match apt_install(
        "the Prometheus tests of tests/metrics.rs",
        &["prometheus"],
        present,
    ) {
        Ok(()) => true,
        Err(why) => cannot(what, &why),
    }
}

/// A Prometheus of the test's own scraping `targets` every second, its
/// data in `dir`; killed when dropped, or with the test process.
struct Prometheus {
    _child: KillOnDrop,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, targets: &[String]) -> Prometheus {
        let config = dir.join("prometheus.yml");
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files: ['{}']\n\
                 scrape_configs:\n  - job_name: gpufrac\n    static_configs:\n      - targets: [{}]\n",
                repo().join("deploy/prometheus/gpufrac-rules.yml").display(),
                list.join(", ")
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        say(&format!(
            "starting a Prometheus of the test's own on {addr} (data in {}), scraping {}; it stops when the test ends",
            dir.display(),
            targets.join(", ")
        ));
        let mut cmd = Command::new("/usr/bin/prometheus");
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: prctl in the child before exec: it dies with the test.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = KillOnDrop(cmd.spawn().expect("starting prometheus"));
        wait_until(60.0, "Prometheus ready", || {
            get(&addr, "/-/ready").is_ok_and(|(c, _)| c == 200)
        });
        Prometheus {
            _child: child,
            addr,
        }
    }

    /// The result of an instant query: (labels, value) of each series.
    fn query(&self, q: &str) -> Result<Vec<(serde_json::Value, f64)>, String> {
        let (code, body) = get(&self.addr, &format!("/api/v1/query?query={}", encode(q)))?;
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if code != 200 || v["status"] != "success" {
            return Err(format!("{code}: {body}"));
        }
        let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(result
            .into_iter()
            .map(|r| {
                let x = r["value"][1]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(f64::NAN);
                (r["metric"].clone(), x)
            })
            .collect())
    }

    /// The values `label` takes over the series `selector` selects.
    fn label_values(&self, selector: &str, label: &str) -> Result<BTreeSet<String>, String> {
        let (code, body) = get(
            &self.addr,
            &format!("/api/v1/series?match[]={}", encode(selector)),
        )?;
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if code != 200 || v["status"] != "success" {
            return Err(format!("{code}: {body}"));
        }
        Ok(v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s[label].as_str().map(str::to_owned))
            .collect())
    }
}

/// Percent-encoding for a query string: all but unreserved characters.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The dashboard's variables, as "All" selects them, and Grafana's own.
fn substitute(q: &str) -> String {
    let mut q = q.to_owned();
    for (from, to) in [
        ("$__rate_interval", "30s"),
        ("$__interval", "5s"),
        ("$__range", "5m"),
    ] {
        q = q.replace(from, to);
    }
    // ${name} and $name of the dashboard's own variables.
    let mut out = String::new();
    let mut rest = q.as_str();
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (len, _) = match after.strip_prefix('{') {
            Some(a) => (a.find('}').expect("a closed ${…}") + 2, ()),
            None => (
                after
                    .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .unwrap_or(after.len()),
                (),
            ),
        };
        out.push_str(".*");
        rest = &after[len..];
    }
    out.push_str(rest);
    out
}

/// Every panel, rows' panels included.
fn panels(d: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        out.push(p.clone());
        for inner in p["panels"].as_array().into_iter().flatten() {
            out.push(inner.clone());
        }
    }
    out
}

/// `label_values(SELECTOR, LABEL)`, Grafana's variable query.
fn parse_label_values(q: &str) -> Option<(String, String)> {
    let inner = q.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    let (sel, label) = inner.rsplit_once(',')?;
    Some((sel.trim().to_owned(), label.trim().to_owned()))
}

/// Scrapes of brokers running MPS, MIG and a live workload pass
/// `promtool check metrics` (Prometheus's own lint: names, units,
/// suffixes, HELP and TYPE); then a real Prometheus scrapes them, and
/// every query of the dashboard, variables as "All" sets them, returns
/// data (at least one series with a number).
#[test]
fn promtool_finds_the_scrapes_clean_and_every_dashboard_query_returns_data() {
    let what = "the Prometheus tests (promtool and the dashboard)";
    if !prometheus_installed(what) {
        return;
    }
    let _serial = serial();
    let node = Node::start();
    node.wait_busy();
    for addr in &node.addrs {
        let text = scrape(addr);
        let mut c = Command::new("/usr/bin/promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        assert!(
            o.status.success() && o.stdout.is_empty() && o.stderr.is_empty(),
            "promtool check metrics on {addr}:\n{}{}\n{text}",
            stdout(&o),
            stderr(&o)
        );
    }

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/gpufrac.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for p in panels(&dashboard) {
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_else(|| panic!("{t}"));
            // Variables are matched, never compared: "All" must work.
            for v in ["$instance", "$gpu", "$user", "$job"] {
                assert!(
                    !expr.contains(&format!("=\"{v}\"")) && !expr.contains(&format!("!=\"{v}\"")),
                    "{expr}: use =~ with a variable"
                );
            }
            queries.push((
                p["title"].as_str().unwrap_or("").to_owned(),
                substitute(expr),
            ));
        }
    }
    let variables: Vec<(String, String, String)> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let q = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .unwrap_or_default();
            let (sel, label) =
                parse_label_values(q).unwrap_or_else(|| panic!("{q}: not label_values(…)"));
            (
                v["name"].as_str().unwrap_or("").to_owned(),
                substitute(&sel),
                label,
            )
        })
        .collect();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    assert_eq!(variables.len(), 4, "{variables:?}");

    let prom_dir = Scratch::new("prometheus");
    let prom = Prometheus::start(&prom_dir.0, &node.addrs);
    wait_until(60.0, "every broker scraped", || {
        prom.query("up == 1")
            .is_ok_and(|r| r.len() == node.addrs.len())
    });
    let mut missing: Vec<String> = Vec::new();
    wait_until_or(120.0, || {
        missing = queries
            .iter()
            .filter(|(_, q)| {
                !prom
                    .query(q)
                    .is_ok_and(|r| r.iter().any(|(_, v)| v.is_finite()))
            })
            .map(|(title, q)| format!("{title}: {q}"))
            .chain(
                variables
                    .iter()
                    .filter(|(_, sel, label)| {
                        !prom.label_values(sel, label).is_ok_and(|v| !v.is_empty())
                    })
                    .map(|(name, sel, label)| {
                        format!("variable {name}: label_values({sel}, {label})")
                    }),
            )
            .collect();
        missing.is_empty()
    });
    assert!(
        missing.is_empty(),
        "without data from Prometheus:\n{}",
        missing.join("\n")
    );

    // The shipped rules load and evaluate on the live node: every rule is
    // healthy, and every recording rule has data.
    let (code, body) = get(&prom.addr, "/api/v1/rules").unwrap();
    assert_eq!(code, 200, "{body}");
    let rules: serde_json::Value = serde_json::from_str(&body).unwrap();
    let all: Vec<&serde_json::Value> = rules["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    assert!(all.len() >= 13, "{body}");
    for r in &all {
        assert_eq!(r["health"], "ok", "{r}");
    }
    let recorded: Vec<String> = all
        .iter()
        .filter(|r| r["type"] == "recording")
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    let mut empty = recorded.clone();
    wait_until_or(60.0, || {
        empty.retain(|q| {
            !prom
                .query(q)
                .is_ok_and(|r| r.iter().any(|(_, v)| v.is_finite()))
        });
        empty.is_empty()
    });
    assert!(empty.is_empty(), "recording rules without data: {empty:?}");
    // Where shares hold, as between the two jobs at 70% and 30% beside an
    // interactive `high` process, no job is short of what it is owed.
    let deficit = prom
        .query("gpufrac:job_share_deficit:rate10m{job_id!=\"none\"}")
        .unwrap();
    assert!(!deficit.is_empty());
    for (labels, v) in &deficit {
        assert!(*v < 0.05, "{labels}: short of its share by {v}");
    }
}

/// The shipped rules (deploy/prometheus/gpufrac-rules.yml) pass
/// `promtool check rules`, and their unit tests (gpufrac-rules.test.yml:
/// each alert firing on its input and not on what merely looks like it,
/// starvation not on a target that flaps) pass `promtool test rules`.
#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    let what = "the alert rules' promtool tests";
    if !prometheus_installed(what) {
        return;
    }
    let dir = repo().join("deploy/prometheus");
    for args in [
        &["check", "rules", "gpufrac-rules.yml"][..],
        &["test", "rules", "gpufrac-rules.test.yml"][..],
    ] {
        let o = Command::new("/usr/bin/promtool")
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            stdout(&o),
            stderr(&o)
        );
        assert!(stdout(&o).contains("SUCCESS"), "{}", stdout(&o));
    }
}

/// `wait_until` without the panic: whether `cond` came true in time.
fn wait_until_or(secs: f64, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs_f64(secs);
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
