//! What a queued `gpufrac run` says while it waits, terminal or not (a CI
//! log has none): one line when it starts waiting, one every
//! [`SAY_EVERY`] after, and one when it is placed, with the time waited.
//! Each waiting line says its place in the queue and why: what each GPU
//! has and who holds it, against what the request needs, read from the
//! broker's status (the queue's own report says only the place).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use gpufrac_common::size::format_size;
use gpufrac_common::status::{GpuStatus, Status};
use gpufrac_common::wire::EXACT_POSITIONS;

use crate::client::QueueReport;

/// How often a run that still waits says so.
pub(super) const SAY_EVERY: Duration = Duration::from_secs(30);
/// GPUs named one by one in a line; the rest are counted.
const GPUS_NAMED: usize = 4;
/// A holder's command, cut to this many characters.
const COMMAND_CHARS: usize = 40;

/// What the request asks for: `--gpus N` or `--gpu-memory` in bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Want {
    pub(super) gpus: Option<u32>,
    pub(super) mem: Option<u64>,
}

/// The lines of one wait.
pub(super) struct Waiting {
    start: Instant,
    /// When the last line was said; None: not waiting yet (placed at once
    /// says nothing).
    said: Option<Instant>,
}

impl Waiting {
    pub(super) fn new() -> Waiting {
        Waiting {
            start: Instant::now(),
            said: None,
        }
    }

    /// The line to say now, if one is due: the first queue report starts
    /// the wait, then one every [`SAY_EVERY`]. `status` is asked only when
    /// a line is due.
    pub(super) fn line(
        &mut self,
        now: Instant,
        q: &QueueReport,
        want: Want,
        status: impl FnOnce() -> Option<Status>,
    ) -> Option<String> {
        let first = self.said.is_none();
        if self.said.is_some_and(|t| now.duration_since(t) < SAY_EVERY) {
            return None;
        }
        self.said = Some(now);
        let me = std::process::id();
        let status = status();
        // The broker's reports are exact only near the front; the status
        // read for the line says the place exactly.
        let position = status
            .as_ref()
            .and_then(|s| exact_position(s, me))
            .map_or_else(|| place(q.position), |p| p.to_string());
        let why = status.map_or_else(
            || "the broker's status could not be read to say why".to_owned(),
            |s| broker_why(&s, me).unwrap_or_else(|| why(&s, q, want)),
        );
        Some(if first {
            format!(
                "waiting for {}, position {position} in the queue: {why}",
                q.waiting_for
            )
        } else {
            format!(
                "still waiting for {} after {}, position {position} in the queue: {why}",
                q.waiting_for,
                elapsed(now.duration_since(self.start)),
            )
        })
    }

    /// The line for a placement, after a wait; None when it never waited.
    pub(super) fn placed(&self, now: Instant, gpus: &[u32], mig: &str) -> Option<String> {
        self.said?;
        let on = if !mig.is_empty() {
            format!("MIG device {mig}")
        } else if gpus.len() == 1 {
            format!("GPU {}", gpus[0])
        } else if gpus.is_empty() {
            "no GPU in particular".to_owned()
        } else {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            format!("GPUs {}", list.join(", "))
        };
        Some(format!(
            "placed on {on} after waiting {}",
            elapsed(now.duration_since(self.start))
        ))
    }
}

/// `42s`, `1m05s`, `2h03m`.
pub(super) fn elapsed(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// A holder as a line names it: `pid 4242 (python train.py)`, the command
/// cut and its control and format characters escaped (it is the holder's
/// to choose).
fn holder(pid: u32, command: &str) -> String {
    let mut c = String::new();
    for (i, ch) in command.chars().enumerate() {
        if i == COMMAND_CHARS {
            c.push('…');
            break;
        }
        if gpufrac_common::text::is_hidden(ch) {
            c.extend(ch.escape_default());
        } else {
            c.push(ch);
        }
    }
    if c.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid} ({c})")
    }
}

/// A place in the queue as the broker's reports give it: exact up to
/// [`EXACT_POSITIONS`], "about" beyond, where the broker tells a waiting
/// run its place again only once it moved by a tenth.
pub(super) fn place(position: u32) -> String {
    if position > EXACT_POSITIONS {
        format!("about {position}")
    } else {
        position.to_string()
    }
}

/// Request `pid`'s place, exactly, from the broker's status.
fn exact_position(s: &Status, pid: u32) -> Option<u32> {
    s.queue.iter().find(|e| e.pid == pid).map(|e| e.position)
}

/// Why the broker says request `pid`'s waits (its queue entry's `why`,
/// worked out by the queue itself); None from a broker too old to say,
/// where `why` describes it from the GPUs instead.
fn broker_why(s: &Status, pid: u32) -> Option<String> {
    s.queue
        .iter()
        .find(|e| e.pid == pid && !e.why.is_empty())
        .map(|e| e.why.clone())
}

/// Why the request waits: what each GPU has, who holds it, and what the
/// request needs; and how many requests go first.
pub(super) fn why(s: &Status, q: &QueueReport, want: Want) -> String {
    let gpus: Vec<&GpuStatus> = s
        .gpus
        .iter()
        .filter(|g| g.index.is_some() && g.mode != "mig-instance")
        .collect();
    let mut o = String::new();
    let holders = |g: &GpuStatus| -> Vec<String> {
        s.leases
            .iter()
            .filter(|l| g.index.is_some_and(|i| l.gpus.contains(&i)))
            .map(|l| holder(l.pid, &l.command))
            .collect()
    };
    if gpus.is_empty() {
        o.push_str("the broker lists no GPU");
    }
    for (n, g) in gpus.iter().enumerate() {
        if n == GPUS_NAMED {
            let _ = write!(o, "; {} more GPUs", gpus.len() - n);
            break;
        }
        if n > 0 {
            o.push_str("; ");
        }
        let index = g.index.unwrap_or_default();
        let held = holders(g);
        match want.mem {
            // A fraction: what is left uncommitted is what counts.
            Some(_) if want.gpus.is_none() => {
                let free = g.total_mem.saturating_sub(g.committed_mem);
                let _ = write!(
                    o,
                    "GPU {index} has {} of {} uncommitted",
                    format_size(free),
                    format_size(g.total_mem)
                );
                if !held.is_empty() {
                    let _ = write!(
                        o,
                        " ({} held by {})",
                        format_size(g.committed_mem),
                        held.join(", ")
                    );
                }
            }
            _ => {
                let free_slots = g.slots_total.saturating_sub(g.slots_used);
                if free_slots > 0 && held.is_empty() {
                    let _ = write!(o, "GPU {index} is free");
                } else if g.slots_total > 1 {
                    let _ = write!(
                        o,
                        "GPU {index} has {free_slots} of {} slots free",
                        g.slots_total
                    );
                    if !held.is_empty() {
                        let _ = write!(o, " (held by {})", held.join(", "));
                    }
                } else if held.is_empty() {
                    let _ = write!(o, "GPU {index} is taken");
                } else {
                    let _ = write!(o, "GPU {index} is held by {}", held.join(", "));
                }
            }
        }
    }
    match (want.gpus, want.mem) {
        (Some(n), _) => {
            let _ = write!(
                o,
                "; it needs {}",
                if n == 1 {
                    "a whole GPU".to_owned()
                } else {
                    format!("{n} whole GPUs at once")
                }
            );
        }
        (None, Some(b)) => {
            let _ = write!(o, "; it needs {} on one GPU", format_size(b));
        }
        (None, None) => {}
    }
    let position = exact_position(s, std::process::id()).unwrap_or(q.position);
    if position > 1 {
        let ahead = position - 1;
        let _ = write!(
            o,
            "; {ahead} request{} ahead of it",
            if ahead == 1 { " goes" } else { "s go" }
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufrac_common::status::{LeaseEntry, QueueEntry};

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, committed: u64, slots_used: u32) -> GpuStatus {
        GpuStatus {
            index: Some(index),
            mode: "time-slicing".into(),
            total_mem: 16 * GIB,
            slots_total: 1,
            slots_used,
            committed_mem: committed,
            ..GpuStatus::default()
        }
    }

    fn lease(pid: u32, command: &str, gpus: &[u32]) -> LeaseEntry {
        LeaseEntry {
            pid,
            command: command.into(),
            gpus: gpus.to_vec(),
            ..LeaseEntry::default()
        }
    }

    fn report(position: u32, what: &str) -> QueueReport {
        QueueReport {
            position,
            waiting_for: what.into(),
            token: 1,
        }
    }

    #[test]
    fn a_whole_gpu_request_names_who_holds_each_gpu() {
        let s = Status {
            gpus: vec![gpu(0, 0, 1), gpu(1, 0, 1)],
            leases: vec![
                lease(4242, "python train.py --epochs 10", &[0]),
                lease(4343, "sleep 100", &[1]),
            ],
            ..Status::default()
        };
        let want = Want {
            gpus: Some(1),
            mem: None,
        };
        assert_eq!(
            why(&s, &report(2, "1 GPU"), want),
            "GPU 0 is held by pid 4242 (python train.py --epochs 10); GPU 1 is held by pid \
             4343 (sleep 100); it needs a whole GPU; 1 request goes ahead of it"
        );
    }

    #[test]
    fn a_fraction_is_told_what_each_gpu_has_uncommitted() {
        let s = Status {
            gpus: vec![gpu(0, 12 * GIB, 1)],
            leases: vec![lease(7, "a\nforged line", &[0])],
            ..Status::default()
        };
        let want = Want {
            gpus: None,
            mem: Some(8 * GIB),
        };
        assert_eq!(
            why(&s, &report(1, "8.00 GiB of GPU memory"), want),
            "GPU 0 has 4.00 GiB of 16.00 GiB uncommitted (12.00 GiB held by pid 7 \
             (a\\nforged line)); it needs 8.00 GiB on one GPU"
        );
    }

    #[test]
    fn the_brokers_own_reason_for_this_run_is_said_when_it_gives_one() {
        let mine = QueueEntry {
            pid: 40,
            why: "needs 8.00 GiB on one GPU; GPU 0: 4.00 GiB free".into(),
            ..QueueEntry::default()
        };
        let other = QueueEntry {
            pid: 41,
            why: "another request's reason".into(),
            ..QueueEntry::default()
        };
        let s = Status {
            queue: vec![other, mine],
            ..Status::default()
        };
        assert_eq!(
            broker_why(&s, 40).as_deref(),
            Some("needs 8.00 GiB on one GPU; GPU 0: 4.00 GiB free")
        );
        // A broker too old to say, or a request it does not list: the
        // run describes the GPUs itself.
        assert_eq!(broker_why(&s, 42), None);
        let silent = Status {
            queue: vec![QueueEntry {
                pid: 40,
                ..QueueEntry::default()
            }],
            ..Status::default()
        };
        assert_eq!(broker_why(&silent, 40), None);
    }

    #[test]
    fn many_gpus_and_long_commands_stay_one_bounded_line() {
        let long = "x".repeat(500);
        let s = Status {
            gpus: (0..8).map(|i| gpu(i, 0, 1)).collect(),
            leases: (0..8).map(|i| lease(100 + i, &long, &[i])).collect(),
            ..Status::default()
        };
        let want = Want {
            gpus: Some(2),
            mem: None,
        };
        let w = why(&s, &report(1, "2 GPUs"), want);
        assert!(
            w.contains("; 4 more GPUs; it needs 2 whole GPUs at once"),
            "{w}"
        );
        assert!(w.len() < 400, "{} chars: {w}", w.len());
    }

    /// The broker tells a waiting run its place exactly only up to 10
    /// (within a tenth beyond): the status line says "about" past that,
    /// and the line said every 30 s takes the exact place from the status
    /// it reads.
    #[test]
    fn a_place_past_ten_is_about_and_a_line_says_it_exactly_from_status() {
        assert_eq!(place(10), "10");
        assert_eq!(place(11), "about 11");
        let mut w = Waiting::new();
        let q = report(123, "1 GPU");
        let want = Want {
            gpus: Some(1),
            mem: None,
        };
        let first = w.line(w.start, &q, want, || None).unwrap();
        assert!(
            first.starts_with("waiting for 1 GPU, position about 123 in the queue: "),
            "{first}"
        );
        let s = Status {
            queue: vec![QueueEntry {
                pid: std::process::id(),
                position: 117,
                ..QueueEntry::default()
            }],
            ..Status::default()
        };
        let again = w.line(w.start + SAY_EVERY, &q, want, || Some(s)).unwrap();
        assert!(
            again.contains("position 117 in the queue: ")
                && again.ends_with("116 requests go ahead of it"),
            "{again}"
        );
    }

    #[test]
    fn a_line_when_the_wait_starts_then_every_thirty_seconds_then_placed() {
        let mut w = Waiting::new();
        let t0 = w.start;
        let q = report(1, "1 GPU");
        let want = Want {
            gpus: Some(1),
            mem: None,
        };
        assert_eq!(w.placed(t0, &[0], ""), None, "placed at once: nothing said");
        let first = w.line(t0, &q, want, || None).unwrap();
        assert!(
            first.starts_with("waiting for 1 GPU, position 1 in the queue: "),
            "{first}"
        );
        let mut asked = false;
        let early = w.line(t0 + Duration::from_secs(29), &q, want, || {
            asked = true;
            None
        });
        assert_eq!(early, None);
        assert!(!asked, "the status is read only for a line said");
        let again = w
            .line(t0 + Duration::from_secs(31), &q, want, || {
                Some(Status::default())
            })
            .unwrap();
        assert_eq!(
            again,
            "still waiting for 1 GPU after 31s, position 1 in the queue: the broker lists no \
             GPU; it needs a whole GPU"
        );
        assert_eq!(
            w.line(t0 + Duration::from_secs(60), &q, want, || None),
            None
        );
        assert!(
            w.line(t0 + Duration::from_secs(61), &q, want, || None)
                .is_some()
        );
        assert_eq!(
            w.placed(t0 + Duration::from_secs(72), &[1], "").unwrap(),
            "placed on GPU 1 after waiting 1m12s"
        );
        assert_eq!(elapsed(Duration::from_secs(7384)), "2h03m");
    }
}
