//! Section 4's deep queue, in a process of its own: a lease holding
//! 1 GiB of GPU 0, `n` requests for 16 GiB waiting behind it, and, for
//! the churning rows, arrivals and departures on a clock.
//!
//! Its own process because the broker counts a process into a job by
//! ancestry: had the bench itself asked for the leases, every client it
//! starts (the other user's included) would be a process of the
//! holder's job, and the rows would measure one job's processes sharing
//! their part instead of users sharing the GPU.

use gpufrac_bench::clock::sleep_until;
use gpufrac_bench::harness::{Artifacts, Broker, Kid, die_with_parent};
use gpufrac_bench::wirec::WireClient;
use gpufrac_common::wire::{ClientMsg, LeaseReq, Role, ServerMsg};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

/// What the process prints once every request waits.
const READY: &str = "ready";

/// `gpufrac-bench queue-client SOCKET QUEUED [START WINDOW_NS WINDOWS
/// PER_S [PATTERN]]`: the holder and QUEUED waiting requests; then, with a
/// clock, WINDOWS windows of WINDOW_NS from START (CLOCK_MONOTONIC ns), of
/// the kinds PATTERN takes in turn (`Pattern`; `parts` unless named):
/// quiet, then PER_S bare connections, then PER_S requests, arriving (each
/// with a departure) a second, then quiet again (`Kind`). Prints
/// `ready` once every request waits, then per window `w ARRIVALS TOLD`
/// (TOLD: Queued messages read) at the end; without a clock it holds the
/// requests until it is killed.
#[derive(clap::Args, Debug)]
pub struct QueueArgs {
    socket: PathBuf,
    queued: usize,
    start: Option<u64>,
    window_ns: Option<u64>,
    windows: Option<u64>,
    per_s: Option<u64>,
    #[arg(value_parser = Pattern::parse)]
    pattern: Option<Pattern>,
}

/// The churn of a running queue process: when, how long, how often.
pub(super) struct Churn {
    pub start: u64,
    pub window_ns: u64,
    pub windows: u64,
    pub per_s: u64,
    pub pattern: Pattern,
}

/// Starts the queue process against `broker` and waits until its `n`
/// requests wait (none: no process).
pub(super) fn spawn_queue(
    a: &Artifacts,
    broker: &Broker,
    n: usize,
    churn: Option<&Churn>,
) -> Result<Option<Kid>, String> {
    if n == 0 {
        return Ok(None);
    }
    let mut cmd = Command::new(&a.bench);
    die_with_parent(&mut cmd);
    cmd.stdin(std::process::Stdio::null())
        .arg("queue-client")
        .arg(&broker.socket)
        .arg(n.to_string());
    if let Some(c) = churn {
        cmd.args([c.start, c.window_ns, c.windows, c.per_s].map(|v| v.to_string()))
            .arg(c.pattern.word());
    }
    Kid::spawn_ready(cmd, "gpufrac-bench queue-client", READY).map(Some)
}

/// The churn's counts per window, (arrivals, Queued messages read), once
/// the queue process is done.
pub(super) fn churn_counts(kid: Kid, span: Duration) -> Result<Vec<(u64, u64)>, String> {
    let out = kid.finish(span + Duration::from_secs(30))?;
    Ok(out
        .stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("w")).then_some(())?;
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect())
}

/// A queued `gpufrac run`'s request for `mem` of GPU memory.
fn ask(mem: u64) -> ClientMsg {
    ClientMsg::Lease(LeaseReq {
        want_gpus: 0,
        want_mem: mem,
        compute: None,
        limit: None,
        no_wait: false,
        command: "gpufrac-bench deep-queue".into(),
        priority: None,
        resume: 0,
        token: 0,
        pin: Vec::new(),
    })
}

pub fn queue_main(args: &QueueArgs) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("queue-client: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &QueueArgs) -> Result<(), String> {
    let mut waiting = deep_queue(&args.socket, args.queued)?;
    println!("{READY}");
    let (Some(start), Some(window_ns), Some(windows), Some(per_s)) =
        (args.start, args.window_ns, args.windows, args.per_s)
    else {
        loop {
            std::thread::park();
        }
    };
    // The holder stays first and is never among those that leave.
    let mut queued = waiting.split_off(1);
    let churn = Churn {
        start,
        window_ns,
        windows,
        per_s,
        pattern: args.pattern.unwrap_or(Pattern::Parts),
    };
    let counts = churner(&args.socket, &mut queued, &churn)?;
    for (arrivals, told) in counts {
        println!("w {arrivals} {told}");
    }
    Ok(())
}

/// A lease holding 1 GiB of GPU 0, then `n` requests for 16 GiB that wait
/// behind it (each could fit an empty GPU, so none is refused). Their
/// connections are returned, the holder's first: the requests wait as long
/// as they are open.
fn deep_queue(socket: &Path, n: usize) -> Result<Vec<WireClient>, String> {
    let mut held = Vec::with_capacity(n + 1);
    let mut holder = WireClient::connect_asking(socket, Role::Cli, &ask(1 << 30))?;
    loop {
        match holder.recv()? {
            ServerMsg::Leased(_) => break,
            ServerMsg::Error { message, .. } => return Err(message),
            _ => {}
        }
    }
    held.push(holder);
    for i in 0..n {
        let mut c = WireClient::connect_asking(socket, Role::Cli, &ask(16 << 30))?;
        match c.recv()? {
            ServerMsg::Queued { .. } => {}
            ServerMsg::Error { message, .. } => {
                return Err(format!("queued request {i}: {message}"));
            }
            other => return Err(format!("queued request {i}: {other:?}")),
        }
        held.push(c);
    }
    Ok(held)
}

/// What one window of the churn does: nothing, bare connections that come
/// and go, requests that come and go, or nothing right after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Quiet,
    /// A connection says Hello, is answered, and the one before it closes:
    /// a connection's life with no request in it.
    Bare,
    /// A request arrives (connects, asks, is queued) and a random waiting
    /// one leaves (disconnects).
    Churn,
    /// Nothing arrives, but the requests that moved in the churn are still
    /// told their places (each at most once a `retell_after`): work the
    /// churn caused, which a quiet window right after it would count as
    /// its baseline.
    After,
}

/// The kinds of window a run of the churn takes in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pattern {
    /// Quiet, bare, churn and after: the parts of an arrival-and-departure.
    Parts,
    /// Quiet and churn: each churn window against the quiet ones either
    /// side of it, which the host's slow drifts move alike.
    Alternate,
}

impl Pattern {
    /// Window `w`'s kind.
    pub(super) fn kind(self, w: u64) -> Kind {
        match (self, w % 4) {
            (Pattern::Alternate, n) if n % 2 == 0 => Kind::Quiet,
            (Pattern::Alternate, _) => Kind::Churn,
            (Pattern::Parts, 0) => Kind::Quiet,
            (Pattern::Parts, 1) => Kind::Bare,
            (Pattern::Parts, 2) => Kind::Churn,
            (Pattern::Parts, _) => Kind::After,
        }
    }

    /// Its name on the queue process's command line.
    pub(super) fn word(self) -> &'static str {
        match self {
            Pattern::Parts => "parts",
            Pattern::Alternate => "alternate",
        }
    }

    fn parse(s: &str) -> Result<Pattern, String> {
        [Pattern::Parts, Pattern::Alternate]
            .into_iter()
            .find(|p| p.word() == s)
            .ok_or_else(|| format!("pattern {s:?}: parts or alternate"))
    }
}

impl Kind {
    /// Its name in the report.
    pub(super) fn word(self) -> &'static str {
        match self {
            Kind::Quiet => "quiet",
            Kind::Bare => "bare",
            Kind::Churn => "churn",
            Kind::After => "after",
        }
    }
}

/// Drives the churn from `start`: in each window that is not quiet,
/// `per_s` times a second, a bare connection or a request arrives and one
/// leaves (`Kind`); in every window the waiting requests' messages are
/// read every 50 ms. Per window: (arrivals, messages read).
fn churner(
    socket: &Path,
    waiting: &mut Vec<WireClient>,
    churn: &Churn,
) -> Result<Vec<(u64, u64)>, String> {
    let &Churn {
        start,
        window_ns,
        windows,
        per_s,
        pattern,
    } = churn;
    let tick = 1_000_000_000 / per_s.max(1);
    let reads_every = (50_000_000 / tick).max(1);
    let mut out = vec![(0, 0); windows as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = start;
    let mut k = 0u64;
    let mut bare = Vec::new();
    while next < start + windows * window_ns {
        sleep_until(next);
        let w = ((next - start) / window_ns) as usize;
        match pattern.kind(w as u64) {
            Kind::Quiet | Kind::After => {}
            Kind::Bare => {
                bare.push(WireClient::connect(socket, Role::Cli)?);
                if bare.len() > 1 {
                    drop(bare.remove(0));
                }
                out[w].0 += 1;
            }
            Kind::Churn => {
                let mut c = WireClient::connect_asking(socket, Role::Cli, &ask(16 << 30))?;
                match c.recv()? {
                    ServerMsg::Queued { .. } => {}
                    ServerMsg::Error { message, .. } => return Err(message),
                    other => return Err(format!("a churn request: {other:?}")),
                }
                waiting.push(c);
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let gone = waiting.swap_remove((x >> 33) as usize % waiting.len());
                drop(gone);
                out[w].0 += 1;
            }
        }
        if k.is_multiple_of(reads_every) {
            for c in waiting.iter_mut() {
                out[w].1 += c.drain()? as u64;
            }
        }
        k += 1;
        next += tick;
    }
    Ok(out)
}
