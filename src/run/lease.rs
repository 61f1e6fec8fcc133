//! The lease: asked for and waited on (saying so in lines, and with a
//! status line on a terminal), then held while the child runs, and claimed
//! back from a broker that restarted.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufrac_common::size::format_size;
use gpufrac_common::wire::{ClientMsg, Lease, LeaseReq, Pin};

use super::args::RunArgs;
use super::fail::Fail;
use super::waiting::{Waiting, Want, place};
use crate::client::{Client, LeaseOutcome, QueueReport};

/// "1 GPU", "2 GPUs", "4.00 GiB": what a request waits for, in the broker's
/// own words for when it has not said yet.
pub(super) fn describe_want(gpus: Option<u32>, mem: Option<u64>) -> String {
    match (gpus, mem) {
        (Some(1), _) => "1 GPU".to_owned(),
        (Some(n), _) => format!("{n} GPUs"),
        (None, Some(b)) => format!("a GPU with {} free", format_size(b)),
        (None, None) => "a GPU".to_owned(),
    }
}

/// Holds the lease's connection while the child runs. If the broker goes
/// away (a crash, a restart), reconnects and claims the same lease back,
/// so a restarted broker never hands this job's GPUs to another.
pub(super) fn keep_lease(mut client: Client, req: ClientMsg, socket: PathBuf) {
    loop {
        let why = client.wait_closed();
        eprintln!("gpufrac run: {why}; the command carries on and the lease will be claimed back");
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let Ok(mut c) = Client::connect_asking(&socket, &req) else {
                continue;
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            match c.wait_lease(Some(deadline), Duration::from_secs(1), |_| {}) {
                Ok(LeaseOutcome::Leased(_)) => {
                    eprintln!("gpufrac run: lease claimed back from the restarted broker");
                    client = c;
                    break;
                }
                Ok(LeaseOutcome::Refused(reason)) => {
                    eprintln!(
                        "gpufrac run: the broker would not give the lease back ({reason}); the command carries on unbooked"
                    );
                    return;
                }
                _ => continue,
            }
        }
    }
}

/// `mem`: `--gpu-memory` in bytes, a percentage resolved; `pin`: the GPUs
/// a lease being claimed back holds.
pub(super) fn lease_request(
    args: &RunArgs,
    mem: Option<u64>,
    resume: u64,
    pin: Vec<Pin>,
) -> ClientMsg {
    let command = args
        .command
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    ClientMsg::Lease(LeaseReq {
        want_gpus: args.gpus.unwrap_or(0),
        want_mem: mem.unwrap_or(0),
        compute: args.gpu_compute,
        limit: args.gpu_limit,
        no_wait: args.no_wait,
        command,
        priority: args.priority,
        resume,
        token: 0,
        pin,
    })
}

/// How long a queued `run` waits for a broker that went away to come back
/// before giving up.
const BROKER_RETURN: Duration = Duration::from_secs(60);

/// Sends the lease request (unless it went with the Hello: `asked`) and
/// waits for the answer, keeping a status line on the terminal. If the
/// broker restarts meanwhile, reconnects and asks for the same place in
/// the queue.
pub(super) fn lease(
    mut client: Client,
    args: &RunArgs,
    mem: Option<u64>,
    socket: &Path,
    asked: bool,
) -> Result<(Client, Lease), Fail> {
    if !asked {
        client
            .request_lease(&lease_request(args, mem, 0, Vec::new()))
            .map_err(|m| Fail::new(1, m))?;
    }

    let start = Instant::now();
    let deadline = args
        .timeout
        .as_ref()
        .map(|t| start + Duration::from_nanos(t.ns));
    let tty = std::io::stderr().is_terminal();
    let mut line = StatusLine::default();
    let mut last_report: Option<QueueReport> = None;
    let want = Want {
        gpus: args.gpus,
        mem,
    };
    let mut waiting = Waiting::new();
    loop {
        let outcome = client.wait_lease(deadline, Duration::from_millis(500), |q| {
            let Some(q) = q else { return };
            // Lines, for every log; the status line below them on a
            // terminal.
            if let Some(said) =
                waiting.line(Instant::now(), q, want, || Client::ask_status(socket).ok())
            {
                line.clear();
                eprintln!("gpufrac run: {said}");
            }
            if tty {
                line.draw(q, start.elapsed());
            }
        });
        line.clear();
        let lost = match outcome {
            Ok(LeaseOutcome::Leased(lease)) => {
                if let Some(said) = waiting.placed(Instant::now(), &lease.gpus, &lease.mig) {
                    eprintln!("gpufrac run: {said}");
                }
                return Ok((client, lease));
            }
            Ok(LeaseOutcome::Refused(reason)) => {
                if last_report.is_some() {
                    // A restarted broker that lost its state: queue anew.
                    last_report = None;
                    client
                        .request_lease(&lease_request(args, mem, 0, Vec::new()))
                        .map_err(|m| Fail::new(1, m))?;
                    continue;
                }
                return Err(Fail::new(1, reason));
            }
            Ok(LeaseOutcome::TimedOut(last)) => {
                let (what, pos) = match last.or(last_report) {
                    Some(QueueReport {
                        position,
                        waiting_for,
                        ..
                    }) => (waiting_for, place(position)),
                    None => (describe_want(args.gpus, mem), "unknown".to_owned()),
                };
                let text = args.timeout.as_ref().map_or("", |t| t.text.as_str());
                return Err(Fail::new(
                    124,
                    format!("gave up after {text} waiting for {what} (position {pos})"),
                ));
            }
            Err(m) => m,
        };
        if let Some(r) = client.last_report() {
            last_report = Some(r);
        }
        // The broker went away while we waited: claim our place back
        // when it returns (it keeps the queue across a restart).
        let Some(token) = last_report.as_ref().map(|r| r.token) else {
            return Err(Fail::new(1, lost));
        };
        eprintln!("gpufrac run: {lost}; waiting for the broker to return");
        let back_by = Instant::now() + BROKER_RETURN;
        client = loop {
            if Instant::now() >= back_by {
                return Err(Fail::new(
                    1,
                    format!(
                        "the broker at {} did not come back within {}s",
                        socket.display(),
                        BROKER_RETURN.as_secs()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
            if let Ok(c) =
                Client::connect_asking(socket, &lease_request(args, mem, token, Vec::new()))
            {
                break c;
            }
        };
    }
}

/// The one-line queue display on a terminal.
#[derive(Default)]
struct StatusLine {
    drawn_at: Option<Instant>,
    text: String,
    last: Option<(u32, String)>,
}

impl StatusLine {
    fn draw(&mut self, q: &QueueReport, elapsed: Duration) {
        let text = format!(
            " gpufrac: waiting for {} \u{2014} position {} \u{2014} {}s",
            q.waiting_for,
            place(q.position),
            elapsed.as_secs()
        );
        // A new position shows at once; the clock alone redraws at most
        // twice a second, and not at all when the text would not change.
        let moved = self.last != Some((q.position, q.waiting_for.clone()));
        let due = self
            .drawn_at
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(500));
        if text == self.text || !(moved || due) {
            return;
        }
        // \x1b[K clears what a longer earlier line left behind.
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{text}\x1b[K");
        let _ = err.flush();
        self.drawn_at = Some(Instant::now());
        self.text = text;
        self.last = Some((q.position, q.waiting_for.clone()));
    }

    /// Leaves the terminal as it was, so the command's output starts on a
    /// clean line.
    fn clear(&mut self) {
        // Drawn again in full on the next call.
        self.text.clear();
        if self.drawn_at.take().is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}
