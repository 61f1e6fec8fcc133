//! Section 4's simulated shims and brokers, for its periodic rows
//! (`scale`) and its rows that contend (`contend`): a fresh broker, its
//! GPUs, `gpufrac-bench scale-client` processes started and their cycles
//! collected (the deep queue of waiting requests is `queue`'s).

use gpufrac_bench::harness::{Artifacts, Broker, Kid, die_with_parent};
use gpufrac_bench::wirec::parse_uuid;
use std::process::Command;
use std::time::Duration;

pub(super) const MS: u64 = 1_000_000;
/// How long each simulated shim holds a grant.
pub(super) const HOLD_NS: u64 = 100_000;
/// Up to this many clients, one process each; above, threads (one socket
/// each) in PROCESSES_ABOVE processes.
pub(super) const MAX_PROCESSES: usize = 64;
pub(super) const PROCESSES_ABOVE: usize = 16;

/// One Acquire → Grant → Release cycle, CLOCK_MONOTONIC ns.
#[derive(Clone, Copy)]
pub(super) struct Cycle {
    pub gpu: usize,
    pub acquire: u64,
    pub grant: u64,
    pub release: u64,
}

/// A fresh broker on `gpus` simulated 16 GiB GPUs. The bench is one user:
/// its clients and requests are past the per-user limits that protect a
/// shared node.
pub(super) fn start_broker(a: &Artifacts, gpus: usize, more: &[&str]) -> Result<Broker, String> {
    let devices = vec!["16G"; gpus].join(",");
    let mut args = vec![
        "--timeslice",
        "50ms",
        "--max-connections-per-user",
        "4096",
        "--max-queued-per-user",
        "2048",
    ];
    args.extend_from_slice(more);
    Broker::start(a, &devices, &args)
}

/// The UUIDs of the broker's `gpus` GPUs, in its status's order.
pub(super) fn gpu_uuids(broker: &Broker, gpus: usize) -> Result<Vec<String>, String> {
    let st = broker.status()?;
    let uuids: Vec<String> = st["gpus"]
        .as_array()
        .ok_or("no gpus in the broker status")?
        .iter()
        .filter_map(|g| g["uuid"].as_str())
        .filter(|u| parse_uuid(u).is_some())
        .map(str::to_string)
        .collect();
    if uuids.len() != gpus {
        return Err(format!(
            "the broker sees {} GPU(s), expected {gpus}",
            uuids.len()
        ));
    }
    Ok(uuids)
}

/// Simulated shims to start: `n` of them, client i on GPU i mod
/// `uuids.len()`, cycling from `start` to `end` once per `period` (0: each
/// asks again as soon as it let go), as user `uid` (None: the bench's).
pub(super) struct Clients<'a> {
    pub n: usize,
    pub start: u64,
    pub end: u64,
    pub period: u64,
    pub uuids: &'a [String],
    pub uid: Option<u32>,
}

/// Starts `c`'s clients: up to MAX_PROCESSES as processes, more as
/// threads in PROCESSES_ABOVE processes. Returns them and how they run.
pub(super) fn spawn_clients(
    a: &Artifacts,
    broker: &Broker,
    c: Clients<'_>,
) -> Result<(Vec<Kid>, String), String> {
    let (procs, threads) = if c.n <= MAX_PROCESSES {
        (c.n, 1)
    } else {
        (PROCESSES_ABOVE, c.n.div_ceil(PROCESSES_ABOVE))
    };
    let layout = if threads == 1 {
        "processes".to_string()
    } else {
        format!("{procs}×{threads} threads")
    };
    let mut kids = Vec::new();
    for p in 0..procs {
        let mut cmd = Command::new(&a.bench);
        die_with_parent(&mut cmd);
        if let Some(uid) = c.uid {
            std::os::unix::process::CommandExt::uid(&mut cmd, uid);
            std::os::unix::process::CommandExt::gid(&mut cmd, uid);
        }
        cmd.stdin(std::process::Stdio::null()).args([
            "scale-client".to_string(),
            broker.socket.display().to_string(),
            c.start.to_string(),
            c.end.to_string(),
            HOLD_NS.to_string(),
            c.period.to_string(),
            threads.to_string(),
            (p * threads).to_string(),
            c.n.to_string(),
            c.uuids.join(","),
        ]);
        kids.push(Kid::spawn(cmd, "gpufrac-bench scale-client")?);
    }
    Ok((kids, layout))
}

/// The clients' cycles once they are done (waiting up to `span` and half a
/// minute more), and how many clients failed.
pub(super) fn collect(kids: Vec<Kid>, span: Duration) -> Result<(Vec<Cycle>, u64), String> {
    let mut cycles = Vec::new();
    let mut errors = 0;
    for k in kids {
        let out = k.finish(span + Duration::from_secs(30))?;
        for l in out.stdout.lines() {
            let mut w = l.split_whitespace();
            match w.next() {
                Some("c") => {
                    let v: Vec<u64> = w.filter_map(|x| x.parse().ok()).collect();
                    let Some((&gpu, rest)) = v.split_first() else {
                        continue;
                    };
                    cycles.extend(rest.chunks_exact(3).map(|t| Cycle {
                        gpu: gpu as usize,
                        acquire: t[0],
                        grant: t[1],
                        release: t[2],
                    }));
                }
                Some("err") => errors += 1,
                _ => {}
            }
        }
    }
    Ok((cycles, errors))
}
