//! Prometheus metrics over HTTP (`--metrics ADDR`): the status, rendered
//! by the event loop at most twice a second, served from threads of their
//! own so that no scrape, slow or idle, touches the broker's loop.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};

use crate::status::Status;

pub fn render_metrics(s: &Status) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP gpufrac_gpu_memory_total_bytes Physical memory of the GPU."
    );
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_total_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_total_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.total_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_memory_committed_bytes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_memory_committed_bytes{{uuid=\"{}\"}} {}",
            g.uuid, g.committed_mem
        );
    }
    let _ = writeln!(o, "# TYPE gpufrac_gpu_processes gauge");
    for g in &s.gpus {
        let _ = writeln!(
            o,
            "gpufrac_gpu_processes{{uuid=\"{}\"}} {}",
            g.uuid,
            g.processes.len()
        );
    }
    for (name, help) in [
        (
            "gpufrac_process_memory_used_bytes",
            "Memory charged to the process by the shim.",
        ),
        (
            "gpufrac_process_share_target",
            "Compute share promised when contended (0..1).",
        ),
        (
            "gpufrac_process_share_achieved",
            "Compute share held over the last window (0..1).",
        ),
        (
            "gpufrac_process_ooms_total",
            "Allocations refused by the memory cap.",
        ),
        (
            "gpufrac_process_gpu_seconds_total",
            "GPU time charged to the process (split evenly while shared).",
        ),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(
            o,
            "# TYPE {name} {}",
            if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            }
        );
        for g in &s.gpus {
            for p in &g.processes {
                let v = match name {
                    "gpufrac_process_memory_used_bytes" => p.mem_used as f64,
                    "gpufrac_process_share_target" => p.share_target,
                    "gpufrac_process_share_achieved" => p.share_achieved,
                    "gpufrac_process_gpu_seconds_total" => p.gpu_time_s,
                    _ => p.ooms as f64,
                };
                let _ = writeln!(
                    o,
                    "{name}{{uuid=\"{}\",pid=\"{}\",priority=\"{}\"}} {v}",
                    g.uuid, p.pid, p.priority
                );
            }
        }
    }
    if s.gpus.iter().any(|g| g.mig.is_some()) {
        let _ = writeln!(
            o,
            "# HELP gpufrac_mig_instance A MIG instance on a GPU under --mig dynamic (always 1): \
             profile, placement (start:size in memory slices), state (in-use, idle, foreign) \
             and the pid of the gpufrac run holding it."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mig_instance gauge");
        for g in &s.gpus {
            for i in g.mig.iter().flat_map(|m| m.instances.iter()) {
                let _ = writeln!(
                    o,
                    "gpufrac_mig_instance{{uuid=\"{}\",mig_uuid=\"{}\",gi=\"{}\",profile=\"{}\",placement=\"{}\",state=\"{}\",job=\"{}\"}} 1",
                    g.uuid,
                    i.uuid.as_deref().unwrap_or(""),
                    i.gi.map_or_else(String::new, |v| v.to_string()),
                    i.profile,
                    i.placement,
                    i.state,
                    i.job.map_or_else(String::new, |v| v.to_string())
                );
            }
        }
        let _ = writeln!(
            o,
            "# HELP gpufrac_mig_instance_idle_seconds How long an idle MIG instance has had no job."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mig_instance_idle_seconds gauge");
        for g in &s.gpus {
            for i in g.mig.iter().flat_map(|m| m.instances.iter()) {
                if let (Some(idle), Some(u)) = (i.idle_s, &i.uuid) {
                    let _ = writeln!(
                        o,
                        "gpufrac_mig_instance_idle_seconds{{uuid=\"{}\",mig_uuid=\"{u}\",profile=\"{}\"}} {idle}",
                        g.uuid, i.profile
                    );
                }
            }
        }
        for (name, help) in [
            (
                "gpufrac_mig_instances_created_total",
                "MIG instances this broker created.",
            ),
            (
                "gpufrac_mig_instances_destroyed_total",
                "Idle MIG instances this broker destroyed to make room.",
            ),
            (
                "gpufrac_mig_failures_total",
                "MIG instances that could not be made or destroyed.",
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} counter");
            for g in &s.gpus {
                if let Some(m) = &g.mig {
                    let v = match name {
                        "gpufrac_mig_instances_created_total" => m.created,
                        "gpufrac_mig_instances_destroyed_total" => m.destroyed,
                        _ => m.failures,
                    };
                    let _ = writeln!(o, "{name}{{uuid=\"{}\"}} {v}", g.uuid);
                }
            }
        }
    }
    if let Some(m) = &s.mps {
        let _ = writeln!(
            o,
            "# HELP gpufrac_mps_up The MPS control daemon the broker runs is up (1) or not (0)."
        );
        let _ = writeln!(o, "# TYPE gpufrac_mps_up gauge");
        let _ = writeln!(o, "gpufrac_mps_up {}", u8::from(m.state == "running"));
    }
    let _ = writeln!(o, "# TYPE gpufrac_queue_waiting gauge");
    let _ = writeln!(o, "gpufrac_queue_waiting {}", s.queue.len());
    o
}

/// Scrapes served at once; more are answered 503 at once.
const METRICS_CONNS: usize = 32;

/// Serves each connection on its own short-lived thread with a short read
/// deadline, so idle or slow connections (ten once delayed a scrape by
/// 20 s) cannot hold up a scrape. Returns the address bound (a port of 0
/// is chosen by the kernel).
pub fn serve_metrics(addr: &str, text: Arc<Mutex<String>>) -> Result<SocketAddr, String> {
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("metrics address {addr}: {e}"))?;
    let bound = l
        .local_addr()
        .map_err(|e| format!("metrics address {addr}: {e}"))?;
    info!(%bound, "serving Prometheus metrics at /metrics");
    let busy = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else {
                    // Out of descriptors, most likely: let some close.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if busy.load(Ordering::Relaxed) >= METRICS_CONNS {
                    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
                    let _ = s.write_all(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    );
                    continue;
                }
                busy.fetch_add(1, Ordering::Relaxed);
                let (text, busy) = (text.clone(), busy.clone());
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .spawn(move || {
                        answer_scrape(&mut s, &text);
                        busy.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    warn!("cannot start a metrics thread");
                }
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(bound)
}

fn answer_scrape(s: &mut std::net::TcpStream, text: &Mutex<String>) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let mut req = Vec::new();
    let mut chunk = [0u8; 1024];
    // The request line is enough; stop at the end of the headers or 8 KiB.
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => req.extend_from_slice(&chunk[..n]),
        }
        if req.starts_with(b"GET ") && req.contains(&b'\n') {
            break;
        }
    }
    // `/metrics`, with or without a query; not `/metricsfoo`.
    let path_ok = req.starts_with(b"GET /metrics")
        && matches!(req.get(12), Some(b' ' | b'?' | b'\r' | b'\n'));
    let body = if path_ok {
        text.lock().unwrap_or_else(|e| e.into_inner()).clone()
    } else {
        String::new()
    };
    let head = if path_ok { "200 OK" } else { "404 Not Found" };
    let _ = write!(
        s,
        "HTTP/1.1 {head}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{GpuStatus, ProcStatus, QueueEntry};

    fn status() -> Status {
        Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                total_mem: 16 << 30,
                committed_mem: 4 << 30,
                processes: vec![ProcStatus {
                    pid: 42,
                    mem_used: 1 << 30,
                    share_target: 0.5,
                    share_achieved: 0.25,
                    ooms: 3,
                    gpu_time_s: 1.5,
                    priority: "normal".into(),
                    ..ProcStatus::default()
                }],
                ..GpuStatus::default()
            }],
            queue: vec![QueueEntry::default(), QueueEntry::default()],
            ..Status::default()
        }
    }

    #[test]
    fn each_gauge_and_counter_of_the_status_is_rendered() {
        let text = render_metrics(&status());
        for line in [
            "# TYPE gpufrac_gpu_memory_total_bytes gauge",
            "gpufrac_gpu_memory_total_bytes{uuid=\"GPU-1\"} 17179869184",
            "gpufrac_gpu_memory_committed_bytes{uuid=\"GPU-1\"} 4294967296",
            "gpufrac_gpu_processes{uuid=\"GPU-1\"} 1",
            "# TYPE gpufrac_process_ooms_total counter",
            "gpufrac_process_memory_used_bytes{uuid=\"GPU-1\",pid=\"42\",priority=\"normal\"} 1073741824",
            "gpufrac_process_share_target{uuid=\"GPU-1\",pid=\"42\",priority=\"normal\"} 0.5",
            "gpufrac_process_share_achieved{uuid=\"GPU-1\",pid=\"42\",priority=\"normal\"} 0.25",
            "gpufrac_process_ooms_total{uuid=\"GPU-1\",pid=\"42\",priority=\"normal\"} 3",
            "gpufrac_process_gpu_seconds_total{uuid=\"GPU-1\",pid=\"42\",priority=\"normal\"} 1.5",
            "gpufrac_queue_waiting 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Without MIG or MPS, neither is mentioned.
        assert!(!text.contains("gpufrac_mig_") && !text.contains("gpufrac_mps_"));
        // Every sample line is NAME{labels} VALUE or NAME VALUE.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').expect("a value");
            assert!(v.parse::<f64>().is_ok(), "not a number in {l:?}");
        }
    }

    /// One request over a real loopback socket, as Prometheus sends it.
    fn get(addr: SocketAddr, request: &str) -> (String, String) {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(request.as_bytes()).expect("send");
        let mut reply = String::new();
        s.read_to_string(&mut reply).expect("read until closed");
        let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
        (head.to_owned(), body.to_owned())
    }

    #[test]
    fn a_scrape_over_http_gets_the_latest_text() {
        let text = Arc::new(Mutex::new(render_metrics(&status())));
        let addr = serve_metrics("127.0.0.1:0", text.clone()).expect("bound");
        let (head, body) = get(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n",
        );
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains("Content-Type: text/plain; version=0.0.4"));
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        assert_eq!(body, *text.lock().unwrap());
        // What the loop renders next is what the next scrape gets.
        *text.lock().unwrap() = "gpufrac_queue_waiting 7\n".into();
        let (_, body) = get(addr, "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert_eq!(body, "gpufrac_queue_waiting 7\n");
    }

    #[test]
    fn other_paths_and_methods_are_not_found() {
        let text = Arc::new(Mutex::new("gpufrac_queue_waiting 1\n".into()));
        let addr = serve_metrics("127.0.0.1:0", text).expect("bound");
        for req in [
            "GET / HTTP/1.1\r\n\r\n",
            "GET /metricsfoo HTTP/1.1\r\n\r\n",
            "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        ] {
            let (head, body) = get(addr, req);
            assert!(
                head.starts_with("HTTP/1.1 404 Not Found"),
                "{req:?}: {head}"
            );
            assert!(body.is_empty());
        }
    }

    #[test]
    fn an_address_in_use_is_refused_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let e = serve_metrics(&addr, Arc::default()).unwrap_err();
        assert!(e.starts_with(&format!("metrics address {addr}: ")), "{e}");
    }
}
