//! Prometheus metrics over HTTP (`--metrics ADDR`): the status, rendered
//! by the event loop at most twice a second, served from threads of their
//! own so that no scrape, slow or idle, touches the broker's loop.

use std::io::{Read, Write};
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
/// 20 s) cannot hold up a scrape.
pub fn serve_metrics(addr: &str, text: Arc<Mutex<String>>) -> Result<(), String> {
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("metrics address {addr}: {e}"))?;
    info!(%addr, "serving Prometheus metrics at /metrics");
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
    Ok(())
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
    let path_ok = req.starts_with(b"GET /metrics");
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
