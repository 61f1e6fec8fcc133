use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::time::Duration;

use gpufrac_common::config::Priority;

use super::http::CONTENT;
use super::*;
use crate::stats::Refusal;
use crate::status::{
    GpuStatus, JobShare, LeaseEntry, MigInstance, MigStatus, MpsStatus, ProcStatus, QueueEntry,
    UserShare,
};

const GIB: u64 = 1 << 30;

/// The text of one snapshot, alone.
fn render(snap: &Snapshot) -> String {
    let mut b = Board::new(|_| None);
    b.fold(Arc::new(snap.clone()));
    b.text()
}

/// A node with a bit of everything: two users on GPU 0 (one with a job of
/// two processes, one outside any job), a queue, a pod's lease, MPS and a
/// GPU in MIG mode with an instance.
fn snapshot() -> Snapshot {
    let proc = |pid, uid, job, used, cap, state: &str, prio: &str| ProcStatus {
        pid,
        uid,
        job,
        mem_used: used,
        mem_peak: used * 2,
        mem_cap: cap,
        ooms: 3,
        share_target: 0.25,
        share_achieved: 0.2,
        gpu_time_s: 1.5,
        state: state.into(),
        priority: prio.into(),
        ..ProcStatus::default()
    };
    let mut stats = Stats::default();
    stats.acquired(0, 1, 0, Priority::High);
    stats.granted(2_000_000, 1, 0);
    stats.queue_waited(1000, 3_000_000_000);
    stats.refused(1000, Refusal::NoRoom);
    Snapshot {
        at: 1,
        wall: 1_800_000_000.0,
        status: Status {
            gpus: vec![
                GpuStatus {
                    index: Some(0),
                    mode: "mps".into(),
                    uuid: "GPU-0".into(),
                    name: "Sim 16G".into(),
                    total_mem: 16 * GIB,
                    committed_mem: 4 * GIB,
                    slots_total: 1,
                    utilization: Some(37),
                    processes: vec![
                        proc(41, 1000, Some(40), GIB, Some(4 * GIB), "holding", "normal"),
                        proc(42, 1000, Some(40), GIB, Some(4 * GIB), "waiting", "normal"),
                        ProcStatus {
                            sm_percent: Some(30.0),
                            driver_mem: Some(GIB + (300 << 20)),
                            ..proc(50, 1001, None, 2 * GIB, None, "waiting", "high")
                        },
                    ],
                    users: vec![
                        UserShare {
                            uid: 1000,
                            share_target: 0.5,
                            share_achieved: 0.4,
                            gpu_time_s: 3.0,
                            jobs: vec![JobShare {
                                job: Some(40),
                                share_target: 0.5,
                                share_achieved: 0.4,
                                gpu_time_s: 3.0,
                                processes: 2,
                                ..JobShare::default()
                            }],
                            ..UserShare::default()
                        },
                        UserShare {
                            uid: 1001,
                            share_target: 0.5,
                            share_achieved: 0.6,
                            gpu_time_s: 1.5,
                            jobs: vec![JobShare {
                                job: None,
                                share_target: 0.5,
                                share_achieved: 0.6,
                                gpu_time_s: 1.5,
                                processes: 1,
                                ..JobShare::default()
                            }],
                            ..UserShare::default()
                        },
                    ],
                    ..GpuStatus::default()
                },
                GpuStatus {
                    index: Some(1),
                    mode: "mig".into(),
                    uuid: "GPU-1".into(),
                    total_mem: 40 * GIB,
                    mig: Some(MigStatus {
                        instances: vec![MigInstance {
                            gi: Some(7),
                            profile: "1g.5gb".into(),
                            placement: "6:1".into(),
                            mem: 5 * GIB,
                            uuid: Some("MIG-1".into()),
                            state: "idle".into(),
                            job: None,
                            idle_s: Some(12.5),
                        }],
                        created: 2,
                        destroyed: 1,
                        failures: 0,
                    }),
                    ..GpuStatus::default()
                },
            ],
            queue: vec![
                QueueEntry {
                    waiting_s: 12.0,
                    ..QueueEntry::default()
                },
                QueueEntry {
                    waiting_s: 7200.0,
                    escalated: true,
                    reason: "held_for_earlier".into(),
                    ..QueueEntry::default()
                },
            ],
            leases: vec![
                LeaseEntry {
                    pid: 40,
                    uid: 1000,
                    command: "python \"train\".py".into(),
                    mem_cap: Some(4 * GIB),
                    held_s: 60.0,
                    ..LeaseEntry::default()
                },
                LeaseEntry {
                    pid: 9,
                    uid: 0,
                    pod: Some("ml/infer-0".into()),
                    command: "server".into(),
                    ..LeaseEntry::default()
                },
            ],
            mps: Some(MpsStatus {
                state: "running".into(),
                restarts: 1,
                ..MpsStatus::default()
            }),
            ..Status::default()
        },
        stats,
    }
}

/// Families (name → (type, help)) and samples (line → value) of a text.
struct Parsed {
    families: BTreeMap<String, (String, String)>,
    samples: HashMap<String, f64>,
}

fn parse(text: &str) -> Parsed {
    let mut families = BTreeMap::new();
    let mut helps = HashMap::new();
    let mut samples = HashMap::new();
    for l in text.lines() {
        if let Some(h) = l.strip_prefix("# HELP ") {
            let (name, help) = h.split_once(' ').expect("a help text");
            assert!(
                helps.insert(name.to_owned(), help.to_owned()).is_none(),
                "{name} twice"
            );
        } else if let Some(t) = l.strip_prefix("# TYPE ") {
            let (name, kind) = t.split_once(' ').expect("a type");
            let help = helps
                .get(name)
                .unwrap_or_else(|| panic!("TYPE before HELP: {l}"));
            families.insert(name.to_owned(), (kind.to_owned(), help.clone()));
        } else {
            let (series, v) = l.rsplit_once(' ').expect("NAME VALUE");
            let name = series.split('{').next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| families.get(*f).is_some_and(|(k, _)| k == "histogram"))
                .unwrap_or(name);
            assert!(
                families.contains_key(family),
                "{l}: no HELP and TYPE before"
            );
            samples.insert(series.to_owned(), v.parse().expect("a number"));
        }
    }
    Parsed { families, samples }
}

#[test]
fn every_family_has_help_a_type_and_a_name_by_the_conventions() {
    let text = render(&snapshot());
    let p = parse(&text);
    for (name, (kind, help)) in &p.families {
        assert!(
            name.starts_with("gpufrac_") || name.starts_with("process_"),
            "{name}"
        );
        assert!(!help.is_empty(), "{name}");
        match kind.as_str() {
            "counter" => assert!(name.ends_with("_total"), "{name}"),
            "gauge" | "histogram" => assert!(!name.ends_with("_total"), "{name}"),
            k => panic!("{name}: type {k}"),
        }
        // Base units only.
        for bad in ["_ms", "_milliseconds", "_percent", "_mib", "_gib", "_kb"] {
            assert!(!name.contains(bad), "{name}");
        }
    }
}

#[test]
fn caps_shares_users_jobs_and_the_queue_are_there_with_their_values() {
    let p = parse(&render(&snapshot()));
    let gpu0 = "gpu=\"0\",uuid=\"GPU-0\"";
    for (series, want) in [
        ("gpufrac_build_info{version=\"0.1.0\"}".to_owned(), 1.0),
        (
            format!("gpufrac_gpu_info{{{gpu0},name=\"Sim 16G\",mode=\"mps\"}}"),
            1.0,
        ),
        (
            format!("gpufrac_gpu_memory_total_bytes{{{gpu0}}}"),
            16.0 * GIB as f64,
        ),
        (
            format!("gpufrac_gpu_memory_used_bytes{{{gpu0}}}"),
            4.0 * GIB as f64,
        ),
        (format!("gpufrac_gpu_utilization_ratio{{{gpu0}}}"), 0.37),
        (
            format!("gpufrac_gpu_processes{{{gpu0},state=\"waiting\"}}"),
            2.0,
        ),
        (
            format!("gpufrac_gpu_waiting_processes{{{gpu0},class=\"high\"}}"),
            1.0,
        ),
        (
            format!("gpufrac_gpu_waiting_processes{{{gpu0},class=\"low\"}}"),
            0.0,
        ),
        // No name service in this test: users are their uids.
        (
            format!("gpufrac_user_share_target_ratio{{{gpu0},user=\"1000\"}}"),
            0.5,
        ),
        (
            format!("gpufrac_user_share_achieved_ratio{{{gpu0},user=\"1001\"}}"),
            0.6,
        ),
        (
            format!("gpufrac_user_memory_used_bytes{{{gpu0},user=\"1000\"}}"),
            2.0 * GIB as f64,
        ),
        (
            format!("gpufrac_user_memory_refusals_total{{{gpu0},user=\"1000\"}}"),
            6.0,
        ),
        (
            "gpufrac_job_memory_cap_bytes{user=\"1000\",job_id=\"40\"}".to_owned(),
            4.0 * GIB as f64,
        ),
        (
            "gpufrac_job_info{user=\"1000\",job_id=\"40\",name=\"python\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_job_info{user=\"0\",job_id=\"ml/infer-0\",name=\"server\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_job_start_time_seconds{user=\"1000\",job_id=\"40\"}".to_owned(),
            1_800_000_000.0 - 60.0,
        ),
        (
            format!("gpufrac_job_share_target_ratio{{{gpu0},user=\"1001\",job_id=\"none\"}}"),
            0.5,
        ),
        (
            format!("gpufrac_job_gpu_seconds_total{{{gpu0},user=\"1000\",job_id=\"40\"}}"),
            3.0,
        ),
        (
            format!(
                "gpufrac_process_memory_cap_bytes{{{gpu0},pid=\"41\",user=\"1000\",job_id=\"40\",class=\"normal\"}}"
            ),
            4.0 * GIB as f64,
        ),
        (
            format!(
                "gpufrac_process_mps_thread_ratio{{{gpu0},pid=\"50\",user=\"1001\",job_id=\"none\",class=\"high\"}}"
            ),
            0.3,
        ),
        (format!("gpufrac_processes_unlisted{{{gpu0}}}"), 0.0),
        (
            "gpufrac_queue_requests{escalated=\"true\",user=\"0\",reason=\"held_for_earlier\"}"
                .to_owned(),
            1.0,
        ),
        (
            "gpufrac_queue_requests{escalated=\"false\",user=\"0\",reason=\"no_room\"}"
                .to_owned(),
            1.0,
        ),
        (
            "gpufrac_queue_oldest_request_start_time_seconds{user=\"0\"}".to_owned(),
            1_800_000_000.0 - 7200.0,
        ),
        (
            "gpufrac_queue_wait_seconds_bucket{user=\"1000\",le=\"0\"}".to_owned(),
            0.0,
        ),
        (
            "gpufrac_queue_wait_seconds_bucket{user=\"1000\",le=\"1\"}".to_owned(),
            0.0,
        ),
        (
            "gpufrac_queue_wait_seconds_bucket{user=\"1000\",le=\"5\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_queue_wait_seconds_count{user=\"1000\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_grant_latency_seconds_bucket{class=\"high\",le=\"0.0025\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_grant_latency_seconds_count{class=\"normal\"}".to_owned(),
            0.0,
        ),
        (
            "gpufrac_refusals_total{reason=\"no_room\",user=\"1000\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_mig_instance_idle_start_time_seconds{gpu=\"1\",uuid=\"GPU-1\",mig_uuid=\"MIG-1\",profile=\"1g.5gb\"}"
                .to_owned(),
            1_800_000_000.0 - 12.5,
        ),
        ("gpufrac_leases".to_owned(), 2.0),
        ("gpufrac_mps_up".to_owned(), 1.0),
        (
            "gpufrac_mig_instance_info{gpu=\"1\",uuid=\"GPU-1\",mig_uuid=\"MIG-1\",gi=\"7\",profile=\"1g.5gb\",placement=\"6:1\",state=\"idle\",job_id=\"none\"}"
                .to_owned(),
            1.0,
        ),
        (
            "gpufrac_mig_instances{gpu=\"1\",uuid=\"GPU-1\",state=\"idle\"}".to_owned(),
            1.0,
        ),
        (
            "gpufrac_mig_instances_created_total{gpu=\"1\",uuid=\"GPU-1\"}".to_owned(),
            2.0,
        ),
        (
            "gpufrac_metrics_connections_closed_total{reason=\"deadline\"}".to_owned(),
            0.0,
        ),
    ] {
        let got = p.samples.get(&series);
        assert!(
            got.is_some_and(|v| (v - want).abs() < 1e-9),
            "{series}: {got:?}, want {want}; have:\n{:#?}",
            p.samples.keys().filter(|k| k.starts_with(series.split('{').next().unwrap())).collect::<Vec<_>>()
        );
    }
    // A GPU in MIG mode has no processes of its own to count.
    assert!(
        !p.samples
            .keys()
            .any(|k| k.starts_with("gpufrac_gpu_processes{gpu=\"1\""))
    );
}

/// A command reaches a label only as its program's name: no arguments,
/// no directory, nothing but a few plain characters (a bidi override
/// planted in a name cannot turn a dashboard's text around), bounded.
#[test]
fn a_command_is_a_bounded_plain_name_in_labels() {
    use super::render::program_name;
    assert_eq!(program_name("python train.py --token=s3cr3t"), "python");
    assert_eq!(program_name("/opt/conda/bin/python3.11 -m x"), "python3.11");
    assert_eq!(program_name("ev\u{202e}il\"} 1\n"), "ev_il__");
    assert_eq!(program_name(""), "-");
    assert_eq!(program_name(&"x".repeat(100)).len(), 32);
    // The snapshot's command line, arguments and all, is nowhere.
    let s = snapshot();
    let text = render(&s);
    assert!(!text.contains("train.py"), "{text}");
}

#[test]
fn without_mps_or_mig_neither_is_mentioned() {
    let mut s = snapshot();
    s.status.mps = None;
    s.status.gpus.truncate(1);
    let text = render(&s);
    assert!(!text.contains("gpufrac_mig_") && !text.contains("gpufrac_mps_"));
}

/// One request over a real loopback socket.
fn get(addr: SocketAddr, request: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request.as_bytes()).expect("send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("read until closed");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
    (head.to_owned(), body.to_owned())
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_scrape_over_http_gets_what_the_last_snapshot_says() {
    let (addr, feed) = serve_with("127.0.0.1:0", |_| None).expect("bound");
    let s = snapshot();
    feed.publish(s.at, s.status.clone(), s.stats.clone());
    wait_for("the snapshot in a scrape", || {
        get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .1
            .contains("gpufrac_leases 2\n")
    });
    let (head, body) = get(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n",
    );
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains(&format!("content-type: {CONTENT}")), "{head}");
    assert!(
        head.contains(&format!("content-length: {}", body.len())),
        "{head}"
    );
    assert!(head.contains("connection: close"), "{head}");
    // What the loop hands over next is what the next scrape gets.
    let mut next = s.status.clone();
    next.leases.clear();
    feed.publish(2, next, s.stats);
    wait_for("the next snapshot", || {
        get(addr, "GET /metrics?x=1 HTTP/1.0\r\n\r\n")
            .1
            .contains("gpufrac_leases 0\n")
    });
    // HEAD: the head alone.
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut reply = String::new();
    c.read_to_string(&mut reply).unwrap();
    assert!(
        reply.starts_with("HTTP/1.1 200 OK") && reply.ends_with("\r\n\r\n"),
        "{reply}"
    );
}

#[test]
fn other_paths_are_not_found_and_other_methods_not_allowed() {
    let (addr, _feed) = serve_with("127.0.0.1:0", |_| None).expect("bound");
    for req in ["GET / HTTP/1.1\r\n\r\n", "GET /metricsfoo HTTP/1.1\r\n\r\n"] {
        let (head, body) = get(addr, req);
        assert!(
            head.starts_with("HTTP/1.1 404 Not Found"),
            "{req:?}: {head}"
        );
        assert!(body.contains("/metrics"), "{body}");
    }
    let (head, _) = get(addr, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("allow: get, head"),
        "{head}"
    );
}

#[test]
fn an_address_in_use_is_refused_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let e = serve(&addr).err().expect("refused");
    assert!(e.starts_with(&format!("metrics address {addr}: ")), "{e}");
}

#[test]
fn a_port_alone_is_served_on_loopback() {
    assert_eq!(address("9400").unwrap(), "127.0.0.1:9400");
    assert_eq!(address(":9400").unwrap(), "127.0.0.1:9400");
    assert_eq!(address("0.0.0.0:9400").unwrap(), "0.0.0.0:9400");
    assert_eq!(address("[::1]:9400").unwrap(), "[::1]:9400");
    let e = address("nowhere").unwrap_err();
    assert!(
        e.starts_with("--metrics nowhere: not an address") && e.contains("--metrics 9400"),
        "{e}"
    );
    assert!(address("70000").is_err());
}

/// The probes a DaemonSet's kubelet asks: not ready and not live before
/// the loop's first snapshot; both once it hands snapshots over; not live
/// once the last is older than ten seconds (a stuck loop), though still
/// ready.
#[test]
fn health_and_readiness_follow_the_loops_snapshots() {
    let (addr, feed) = serve_with("127.0.0.1:0", |_| None).expect("bound");
    let code = |path: &str| {
        let (head, body) = get(addr, &format!("GET {path} HTTP/1.0\r\n\r\n"));
        let code: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        (code, body)
    };
    assert_eq!(code("/healthz").0, 503);
    let (c, body) = code("/readyz");
    assert!(c == 503 && body.contains("starting"), "{body}");
    let s = snapshot();
    let now = gpufrac_common::clock::mono_ns();
    feed.publish(now, s.status.clone(), s.stats.clone());
    wait_for("the snapshot", || code("/readyz").0 == 200);
    let (c, body) = code("/healthz");
    assert!(c == 200 && body.starts_with("ok"), "{body}");
    // A loop that stopped handing over 30 s ago.
    feed.publish(now - 30_000_000_000, s.status, s.stats);
    wait_for("the stale snapshot", || code("/healthz").0 == 503);
    assert!(code("/healthz").1.contains("stuck"));
    assert_eq!(code("/readyz").0, 200);
}
