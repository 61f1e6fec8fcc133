//! `gpufrac status`: the broker's view of GPUs, processes, the queue and
//! leases.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use gpufrac_common::size::format_size;
use gpufrac_common::status::{GpuStatus, LeaseEntry, MigStatus, QueueEntry, Status};

use crate::client::{Client, ConnectError};
use crate::names;

const STATUS_EXAMPLES: &str = "\
Examples:
  gpufrac status
  gpufrac status --json | jq '.gpus[].processes[] | {pid, mem_used}'
  gpufrac top                   the same, live

Each GPU has a line and a table of its processes; then come the queue and
the leases. A dash (-) means none, or not known.

The GPU line: GPU INDEX NAME UUID, then (U/T: used of total)
  committed U/T    memory promised to leases of gpufrac run (--gpu-memory,
                   a slot's share) of the GPU's total: a booking, not
                   memory in use
  slots U/T        slots leased of the GPU's slots (1, or F under
                   gpufrac broker --overprovision F)
  allocated        what its processes have allocated through the shim,
                   together
  free             what a new lease could still have: the total less what
                   is committed (or allocated, where that is more) less
                   what processes outside the shim hold, never more than
                   the driver says is free; placement goes by it
  util             GPU utilisation from NVML (- without NVML)
and, where NVML answers, a line of its health (temperature, power drawn of
its limit, SM clock, ECC errors since the driver loaded, XID events since
the broker started and the last one's XID), a line with what the driver
says of its memory
(used and free by every process, the shim's or not, and the driver's own),
and one with each process the driver lists that is not under the shim
(other: its pid and the memory the driver says it holds; no cap, no lease,
and no job is placed into that memory).

The processes on it (those under the shim):
  PID              the process id
  USER             the user it runs as (its uid where this node has no
                   name for it)
  ALLOCATED        what it has allocated through the shim (the driver's own
                   context memory is not counted)
  CAP              its memory cap on this GPU
  JOB (ALLOCATED)  its job, the pid of its gpufrac run (or `pod NS/NAME`
                   for a pod's under the Kubernetes device plugin), and
                   what all of the job's processes have allocated on this
                   GPU; - for a process outside any job (its user is then
                   its unit of fairness)
  SHARE            the share of GPU time it gets while it is busy and the
                   GPU contended: its weight over the weights of the busy
                   processes of the highest priority class that has work,
                   high ones left out (0% while idle or outranked, and for
                   a high process, which is above the shares: it takes the
                   GPU at once, within --high-share of each window); under
                   gpufrac broker --mps, the share of the GPU's SMs it may
                   use (N% SMs)
  ACHIEVED         the share of GPU time it held over the last second
  LIMIT            its ceiling (GPU_COMPUTE_LIMIT, or its job's --gpu-limit)
  PRIO             its priority class: high, normal or low
  STATE            holding    it may launch work now (it holds the GPU)
                   waiting    it has work and waits for its turn
                   idle       it has no work waiting to launch
                   revoking   told to hand the GPU over and not yet done:
                              no longer the holder, still charged
                   hung       revoking for over 200 ms (a hung kernel, a
                              stopped process): passed over and charged
                   (draining) after any state: work it queued before
                              handing over still runs on the GPU
  COMMAND          its command line, the program without its directory,
                   cut to fit the terminal's width (whole when the output
                   is not a terminal and COLUMNS is unset)

Where more than one user or job has processes on a GPU, a second table
shows how its time is divided before it reaches processes: users with work
share the GPU by their weights, each user's part goes to its jobs (and its
processes outside any job) by their --gpu-compute, and a job's part to its
processes by their GPU_COMPUTE_SHARE:
  USER             the user every process counted here runs for (a
                   job's processes are its user's); its first row, job
                   `all`, is the user's part as a whole
  WEIGHT           the user's weight among users (gpufrac broker
                   --user-weight, --group-weight; 1 by default), or the
                   job's among the user's jobs (its --gpu-compute, else the
                   largest GPU_COMPUTE_SHARE among its processes)
  GPU TIME         GPU time charged to its processes so far
and JOB (- or `no job`: the user's processes outside any job), SHARE and
ACHIEVED as above, summed over its processes.

queue: requests of gpufrac run waiting for GPUs, in the order they go
  POS              the place in the queue (1 goes next)
  JOB              the pid of the gpufrac run that asks (or the pod)
  USER             the job's user
  WANTS            N GPUs, or SIZE of GPU memory (on one GPU)
  WAITING          how long it has waited
  ESCALATED        yes once it has waited longer than the broker's
                   --escalate-after: it then goes ahead of all younger ones
  COMMAND          as above
  and under each request, why it waits: what it needs, what each GPU it
  could use has free and which jobs hold the rest, or which requests
  ahead of it the GPUs it would fit on are held for

leases: jobs that hold GPUs or memory
  JOB              the pid of the gpufrac run (or the pod); messages such as
                   a --no-wait refusal name leases by it
  USER             the job's user
  GPUS             the GPU indices it holds (- for a job that asked for
                   none: every gpufrac run is a job while a broker runs)
  MEM CAP          the job's memory cap, shared by all of its processes
  HELD             how long it has held them
  COMMAND          as above

A broker that started from a state file it could not trust (corrupt,
truncated, another user's) first says so, and for how long more it holds
new placements while running jobs claim their leases back.

Under gpufrac broker --mps a first line describes the MPS control daemon:
its state (starting; running; failed: it would not start, or kept dying
after five restarts; stopped), its pipe directory, pid and restarts.

Under gpufrac broker --mig dynamic a GPU in MIG mode has a line of its own
(instances, how many in use, committed, and the instances created,
destroyed and steps that failed) and a table of its MIG instances:
  GI               GPU instance id (- while it is being created)
  PROFILE          the MIG profile, such as 1g.10gb
  PLACEMENT        start:size in memory slices, as nvidia-smi prints it
  MEMORY           the instance's memory
  STATE            in-use (a job holds it), idle (kept for the next job that
                   fits), creating, or foreign (not gpufrac's: made by hand)
  JOB              the pid of the gpufrac run holding it
  IDLE             how long it has been idle
  MIG DEVICE       MIG-<uuid>: what the job gets in CUDA_VISIBLE_DEVICES
and each instance in use has a line (name, MIG device, committed,
allocated) and a process table of its own, as for a GPU.

--json prints the broker's document, with what the tables leave out (and
each GPU's `users`, with their `jobs`, even where the table would not show
them), users as uids and every size in bytes:
each process's user (uid), peak memory (mem_peak), what the driver reports
for it (driver_mem), refused allocations (ooms) and GPU time charged
(gpu_time_s); each queued request's want_gpus or want_mem (bytes), why it
waits (why) and the GPUs it waits for (waits_for); each lease's compute,
limit and whether its gpufrac run is connected (false for a lease
restored after a broker restart until its run reconnects). With
--history, also the broker's ring of recent samples (history), which
gpufrac top draws from.";

#[derive(Args, Debug)]
#[command(after_help = STATUS_EXAMPLES)]
pub struct StatusArgs {
    /// Print the broker's status document as JSON.
    #[arg(long)]
    pub json: bool,
    /// With --json: keep the broker's ring of recent samples (`history`:
    /// a value a second for the last few minutes, per GPU, user and job),
    /// which is left out otherwise.
    #[arg(long, requires = "json")]
    pub history: bool,
    /// Broker socket [default: $GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

pub fn main(args: StatusArgs) -> u8 {
    let socket = crate::socket_path(args.socket);
    let status = match Client::ask_status(&socket) {
        Ok(s) => Ok(s),
        Err(ConnectError::NoBroker) => {
            eprintln!(
                "gpufrac status: no broker at {}; {}",
                socket.display(),
                crate::client::start_hint(&socket)
            );
            return 1;
        }
        Err(ConnectError::Other(m)) => Err(m),
    };
    let status = match status {
        Ok(s) => s,
        Err(m) => {
            eprintln!("gpufrac status: {m}");
            return 1;
        }
    };
    let mut status = status;
    if !args.history {
        status.history = None;
    }
    let text = if args.json {
        match serde_json::to_string_pretty(&status) {
            Ok(j) => j + "\n",
            Err(e) => {
                eprintln!("gpufrac status: {e}");
                return 1;
            }
        }
    } else {
        render(&status, terminal_width())
    };
    match crate::print_stdout(&text) {
        Ok(()) => 0,
        Err(m) => {
            eprintln!("gpufrac status: {m}");
            1
        }
    }
}

/// The width commands are cut to: the terminal's, else `$COLUMNS`; None
/// (whole commands) when stdout is neither, as in a script's pipe.
pub fn terminal_width() -> Option<usize> {
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills a winsize; on a non-terminal it fails and
    // leaves it alone.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    if rc == 0 && ws.ws_col > 0 {
        return Some(ws.ws_col.into());
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|&c| c > 0)
}

/// The table view, commands cut to fit `width` columns (None: whole).
pub fn render(s: &Status, width: Option<usize>) -> String {
    let mut out = String::new();
    if let Some(r) = &s.recovery {
        let _ = writeln!(out, "RECOVERING: {r}\n");
    }
    if let Some(m) = &s.mps {
        let _ = writeln!(
            out,
            "MPS {} (pipe {}, control daemon {}, {} restarts): jobs share the SMs side by side\n",
            m.state,
            m.pipe_dir,
            m.daemon_pid.map_or("-".to_owned(), |p| format!("pid {p}")),
            m.restarts
        );
    }
    if s.gpus.is_empty() {
        out.push_str("no GPUs\n");
    }
    for (i, g) in s.gpus.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        render_gpu(&mut out, g, width);
    }
    out.push('\n');
    render_queue(&mut out, &s.queue, width);
    out.push('\n');
    render_leases(&mut out, &s.leases, width);
    out
}

fn render_gpu(out: &mut String, g: &GpuStatus, width: Option<usize>) {
    let index = g.index.map_or("?".to_owned(), |i| i.to_string());
    let util = g.utilization.map_or("-".to_owned(), |u| format!("{u}%"));
    let allocated: u64 = g.processes.iter().map(|p| p.mem_used).sum();
    if let Some(m) = &g.mig {
        render_mig_gpu(out, &index, g, m);
        return;
    }
    if g.mig_instance.is_some() {
        let _ = writeln!(
            out,
            "{} {} committed {}/{} allocated {}",
            g.name,
            g.uuid,
            format_size(g.committed_mem),
            format_size(g.total_mem),
            format_size(allocated),
        );
    } else {
        let _ = writeln!(
            out,
            "GPU {index} {} {} committed {}/{} slots {}/{} allocated {} free {} util {util}",
            g.name,
            g.uuid,
            format_size(g.committed_mem),
            format_size(g.total_mem),
            g.slots_used,
            g.slots_total,
            format_size(allocated),
            format_size(g.free_mem),
        );
        if let Some(d) = g.driver {
            let _ = writeln!(
                out,
                "  driver: used {} free {}",
                format_size(d.used),
                format_size(d.free)
            );
        }
        if let Some(h) = g.health {
            let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "  health: {} C, {} W of {} W, SM {} MHz, ECC {}/{} (corrected/not), XID {}{}",
                opt(h.temperature_c.map(|t| t.to_string())),
                opt(h.power_w.map(|p| format!("{p:.0}"))),
                opt(h.power_limit_w.map(|p| format!("{p:.0}"))),
                opt(h.sm_clock_mhz.map(|c| c.to_string())),
                opt(h.ecc_corrected.map(|n| n.to_string())),
                opt(h.ecc_uncorrected.map(|n| n.to_string())),
                h.xid_errors,
                h.last_xid.map_or(String::new(), |x| format!(" (last {x})"))
            );
        }
    }
    if g.unmanaged_processes > 0 {
        let listed: Vec<String> = g
            .unmanaged
            .iter()
            .map(|o| format!("{} {}", o.pid, format_size(o.mem)))
            .collect();
        let more = (g.unmanaged_processes as usize).saturating_sub(listed.len());
        let _ = writeln!(
            out,
            "  other (not under the shim): {}{}",
            listed.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    if g.processes.is_empty() {
        out.push_str("  no processes\n");
        return;
    }
    let mut rows = vec![[
        "PID".to_owned(),
        "USER".to_owned(),
        "ALLOCATED".to_owned(),
        "CAP".to_owned(),
        "JOB (ALLOCATED)".to_owned(),
        "SHARE".to_owned(),
        "ACHIEVED".to_owned(),
        "LIMIT".to_owned(),
        "PRIO".to_owned(),
        "STATE".to_owned(),
        "COMMAND".to_owned(),
    ]];
    for p in &g.processes {
        rows.push([
            p.pid.to_string(),
            names::user(p.uid),
            format_size(p.mem_used),
            p.mem_cap.map_or("-".to_owned(), format_size),
            match (job_name(p.job, &p.pod), p.job_mem_used) {
                (Some(j), Some(m)) => format!("{j} ({})", format_size(m)),
                (Some(j), None) => j,
                _ => "-".to_owned(),
            },
            match p.sm_percent {
                Some(sm) => format!("{sm:.0}% SMs"),
                None => percent(p.share_target),
            },
            percent(p.share_achieved),
            p.limit.map_or("-".to_owned(), percent),
            p.priority.clone(),
            if p.draining {
                format!("{} (draining)", p.state)
            } else {
                p.state.clone()
            },
            command(&p.command),
        ]);
    }
    table(out, &rows, width);
    render_levels(out, g);
}

/// Users, then their jobs: how the GPU's time is divided before it
/// reaches processes. Shown once more than one unit shares the GPU.
fn render_levels(out: &mut String, g: &GpuStatus) {
    let units: usize = g.users.iter().map(|u| u.jobs.len()).sum();
    if units < 2 || g.processes.iter().any(|p| p.sm_percent.is_some()) {
        return;
    }
    let mut rows = vec![[
        "USER".to_owned(),
        "JOB".to_owned(),
        "WEIGHT".to_owned(),
        "SHARE".to_owned(),
        "ACHIEVED".to_owned(),
        "GPU TIME".to_owned(),
    ]];
    for u in &g.users {
        rows.push([
            names::user(u.uid),
            "all".to_owned(),
            weight(u.weight),
            percent(u.share_target),
            percent(u.share_achieved),
            gpu_seconds(u.gpu_time_s),
        ]);
        for j in &u.jobs {
            rows.push([
                String::new(),
                job_name(j.job, &j.pod).unwrap_or_else(|| "no job".to_owned()),
                weight(j.weight),
                percent(j.share_target),
                percent(j.share_achieved),
                gpu_seconds(j.gpu_time_s),
            ]);
        }
    }
    table(out, &rows, None);
}

/// GPU time: tenths of a second count while it is short.
pub(crate) fn gpu_seconds(s: f64) -> String {
    if s.is_finite() && (0.0..60.0).contains(&s) {
        format!("{s:.1}s")
    } else {
        seconds(s)
    }
}

pub(crate) fn weight(w: f64) -> String {
    if w.fract() == 0.0 {
        format!("{w:.0}")
    } else {
        format!("{w:.2}")
    }
}

/// A GPU in MIG mode: its line, then its instances.
fn render_mig_gpu(out: &mut String, index: &str, g: &GpuStatus, m: &MigStatus) {
    let in_use = m.instances.iter().filter(|i| i.state == "in-use").count();
    let _ = writeln!(
        out,
        "GPU {index} {} {} MIG mode: {} instances, {in_use} in use, committed {}/{} \
         (created {}, destroyed {}, failed {})",
        g.name,
        g.uuid,
        m.instances.len(),
        format_size(g.committed_mem),
        format_size(g.total_mem),
        m.created,
        m.destroyed,
        m.failures,
    );
    if m.instances.is_empty() {
        out.push_str("  no MIG instances\n");
        return;
    }
    let mut rows = vec![[
        "GI".to_owned(),
        "PROFILE".to_owned(),
        "PLACEMENT".to_owned(),
        "MEMORY".to_owned(),
        "STATE".to_owned(),
        "JOB".to_owned(),
        "IDLE".to_owned(),
        "MIG DEVICE".to_owned(),
    ]];
    for i in &m.instances {
        rows.push([
            i.gi.map_or("-".to_owned(), |v| v.to_string()),
            i.profile.clone(),
            i.placement.clone(),
            format_size(i.mem),
            i.state.clone(),
            i.job.map_or("-".to_owned(), |v| v.to_string()),
            i.idle_s.map_or("-".to_owned(), seconds),
            i.uuid.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    table(out, &rows, None);
}

fn render_queue(out: &mut String, q: &[QueueEntry], width: Option<usize>) {
    if q.is_empty() {
        out.push_str("queue: empty\n");
        return;
    }
    out.push_str("queue:\n");
    let mut rows = vec![[
        "POS".to_owned(),
        "JOB".to_owned(),
        "USER".to_owned(),
        "WANTS".to_owned(),
        "WAITING".to_owned(),
        "ESCALATED".to_owned(),
        "COMMAND".to_owned(),
    ]];
    for e in q {
        rows.push([
            e.position.to_string(),
            job_name(Some(e.pid), &e.pod).unwrap_or_default(),
            names::user(e.uid),
            e.wants.clone(),
            seconds(e.waiting_s),
            if e.escalated { "yes" } else { "no" }.to_owned(),
            command(&e.command),
        ]);
    }
    let mut lines = String::new();
    table(&mut lines, &rows, width);
    // Each request's row, then why it waits, under it.
    for (i, line) in lines.lines().enumerate() {
        out.push_str(line);
        out.push('\n');
        if let Some(e) = i.checked_sub(1).and_then(|i| q.get(i))
            && !e.why.is_empty()
        {
            for l in wrap(&format!("waits: {}", clean(&e.why)), width, 7) {
                out.push_str(&l);
                out.push('\n');
            }
        }
    }
}

fn render_leases(out: &mut String, leases: &[LeaseEntry], width: Option<usize>) {
    if leases.is_empty() {
        out.push_str("leases: none\n");
        return;
    }
    out.push_str("leases:\n");
    let mut rows = vec![[
        "JOB".to_owned(),
        "USER".to_owned(),
        "GPUS".to_owned(),
        "MEM CAP".to_owned(),
        "HELD".to_owned(),
        "COMMAND".to_owned(),
    ]];
    for l in leases {
        let gpus: Vec<String> = l.gpus.iter().map(u32::to_string).collect();
        rows.push([
            job_name(Some(l.pid), &l.pod).unwrap_or_default(),
            names::user(l.uid),
            if gpus.is_empty() {
                "-".to_owned()
            } else {
                gpus.join(",")
            },
            l.mem_cap.map_or("-".to_owned(), format_size),
            seconds(l.held_s),
            command(&l.command),
        ]);
    }
    table(out, &rows, width);
}

/// A job as the JOB columns name it: its pod if it is one (every pod's
/// lease is asked for by the one device plugin, so its pid tells them
/// apart from nothing), else its run's pid.
pub(crate) fn job_name(pid: Option<u32>, pod: &Option<String>) -> Option<String> {
    match pod {
        Some(p) => Some(format!("pod {}", clean(p))),
        None => pid.map(|p| p.to_string()),
    }
}

/// Left-aligned columns two spaces apart, indented under their heading; the
/// last column is not padded so lines carry no trailing blanks. Given a
/// `width`, the last column (a command) is cut to what is left of it, but
/// to no fewer than `MIN_LAST` characters.
fn table<const N: usize>(out: &mut String, rows: &[[String; N]], width: Option<usize>) {
    // Every cell as it will show: users name commands, labels and pods.
    let rows: Vec<[String; N]> = rows.iter().map(|r| r.clone().map(|c| clean(&c))).collect();
    let mut widths = [0usize; N];
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    // Two of indent, then each column and two of gap.
    let before_last: usize = 2 + widths[..N - 1].iter().map(|w| w + 2).sum::<usize>();
    let last = width.map(|w| w.saturating_sub(before_last).max(MIN_LAST));
    for r in &rows {
        let mut line = String::from(" ");
        for (i, cell) in r.iter().enumerate() {
            line.push(' ');
            if i + 1 < N {
                line.push_str(cell);
                let pad = widths[i] - cell.chars().count() + 1;
                line.extend(std::iter::repeat_n(' ', pad));
            } else {
                line.push_str(&truncate(cell, last.unwrap_or(usize::MAX)));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// A command column is never cut shorter than this, however narrow the
/// terminal: the line wraps instead.
const MIN_LAST: usize = 20;

/// `text` in lines of at most `width` columns (None: one line), broken
/// at spaces, each indented by `indent`.
fn wrap(text: &str, width: Option<usize>, indent: usize) -> Vec<String> {
    let pad = " ".repeat(indent);
    let room = width.map_or(usize::MAX, |w| w.saturating_sub(indent).max(MIN_LAST));
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let len = line.chars().count();
        if len > 0 && len + 1 + word.chars().count() > room {
            lines.push(format!("{pad}{line}"));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(format!("{pad}{line}"));
    }
    lines
}

/// A 0..1 fraction as a whole percentage; NaN and negatives (which only a
/// confused broker would send) print as they are rather than as 0%.
pub(crate) fn percent(f: f64) -> String {
    let p = f * 100.0;
    if p.is_finite() && p > 0.0 && p < 1.0 {
        format!("{p:.1}%")
    } else {
        format!("{p:.0}%")
    }
}

/// "45s", "3m04s", "2h05m".
pub(crate) fn seconds(s: f64) -> String {
    if !s.is_finite() || s < 0.0 {
        return "-".to_owned();
    }
    let s = s as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A command for a table cell: the program without its directory (a long
/// path would use up the whole width), then the rest; `table` cuts it to
/// the width.
pub fn command(s: &str) -> String {
    let s = s.trim_start();
    let (program, rest) = s.split_at(s.find(' ').unwrap_or(s.len()));
    let program = program
        .rsplit('/')
        .next()
        .filter(|p| !p.is_empty())
        .unwrap_or(program);
    clean(&format!("{program}{rest}"))
}

/// Text a user chose as a table or a line shows it: control characters
/// (a command line may hold newlines) become spaces, and format
/// characters (bidirectional overrides, zero-width ones) are escaped, so
/// that nothing reorders or hides what is around it.
pub fn clean(s: &str) -> String {
    gpufrac_common::text::shown(s).into_owned()
}

/// One table cell of at most `max` characters: anything past it becomes
/// an ellipsis.
pub fn truncate(s: &str, max: usize) -> String {
    let clean = clean(s);
    if clean.chars().count() <= max {
        return clean;
    }
    let mut t: String = clean.chars().take(max.saturating_sub(1)).collect();
    t.push('\u{2026}');
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufrac_common::status::{JobShare, ProcStatus, UserShare};

    fn sample() -> Status {
        Status {
            version: "0.1.0".into(),
            socket: "/run/gpufrac/broker.sock".into(),
            timeslice_ms: 20.0,
            inflight_us: 250.0,
            overprovision: 1,
            gpus: vec![GpuStatus {
                index: Some(0),
                mode: "time-slicing".into(),
                uuid: "GPU-0000".into(),
                name: "NVIDIA H100".into(),
                total_mem: 80 << 30,
                slots_total: 1,
                slots_used: 1,
                committed_mem: 4 << 30,
                free_mem: 73 << 30,
                driver: Some(gpufrac_common::status::DriverMem {
                    total: 80 << 30,
                    used: 4 << 30,
                    free: 76 << 30,
                }),
                unmanaged: vec![gpufrac_common::status::UnmanagedProc {
                    pid: 4242,
                    mem: 3 << 30,
                }],
                unmanaged_processes: 1,
                unmanaged_mem: 3 << 30,
                health: Some(gpufrac_common::status::GpuHealth {
                    temperature_c: Some(63),
                    power_w: Some(312.4),
                    power_limit_w: Some(700.0),
                    sm_clock_mhz: Some(1980),
                    ecc_corrected: Some(2),
                    ecc_uncorrected: Some(0),
                    xid_errors: 1,
                    last_xid: Some(79),
                }),
                utilization: Some(37),
                holder: Some(42),
                processes: vec![
                    ProcStatus {
                        pid: 42,
                        command: "python train.py --epochs 100 --batch-size 512".into(),
                        ordinal: 0,
                        mem_used: 1 << 30,
                        mem_peak: 2 << 30,
                        mem_cap: Some(4 << 30),
                        driver_mem: Some((1 << 30) + (300 << 20)),
                        ooms: 0,
                        share_target: 0.3,
                        share_achieved: 0.28,
                        limit: None,
                        state: "holding".into(),
                        priority: "high".into(),
                        gpu_time_s: 12.5,
                        draining: false,
                        uid: 65534,
                        job: Some(41),
                        job_mem_used: Some(3 << 30),
                        sm_percent: None,
                        pod: None,
                        ..ProcStatus::default()
                    },
                    ProcStatus {
                        pid: 7,
                        command: "sleep".into(),
                        mem_cap: None,
                        share_target: 0.7,
                        limit: Some(0.5),
                        state: "idle".into(),
                        job: Some(5),
                        pod: Some("ml/infer-0".into()),
                        ..ProcStatus::default()
                    },
                ],
                users: vec![
                    UserShare {
                        uid: 65534,
                        weight: 1.0,
                        share_target: 0.3,
                        share_achieved: 0.28,
                        gpu_time_s: 12.5,
                        jobs: vec![JobShare {
                            job: Some(41),
                            pod: None,
                            weight: 30.0,
                            share_target: 0.3,
                            share_achieved: 0.28,
                            gpu_time_s: 12.5,
                            processes: 1,
                            ..JobShare::default()
                        }],
                        ..UserShare::default()
                    },
                    UserShare {
                        uid: 0,
                        weight: 2.0,
                        share_target: 0.7,
                        jobs: vec![JobShare {
                            job: Some(5),
                            pod: Some("ml/infer-0".into()),
                            weight: 50.0,
                            share_target: 0.7,
                            processes: 1,
                            ..JobShare::default()
                        }],
                        ..UserShare::default()
                    },
                ],
                mig: None,
                mig_instance: None,
            }],
            queue: vec![QueueEntry {
                position: 1,
                pid: 99,
                pod: None,
                uid: 4_000_000_123,
                command: "torchrun x".into(),
                wants: "2 GPUs".into(),
                want_gpus: Some(2),
                want_mem: None,
                waiting_s: 184.2,
                escalated: true,
                why: "needs 2 whole GPUs; 0 free; GPU 0: held whole by job 41".into(),
                reason: "no_room".into(),
                waits_for: vec![0],
            }],
            leases: vec![
                LeaseEntry {
                    pid: 41,
                    pod: None,
                    uid: 65534,
                    command: "python train.py".into(),
                    gpus: vec![0],
                    mem_cap: Some(4 << 30),
                    held_s: 7500.0,
                    compute: Some(30.0),
                    limit: None,
                    connected: true,
                },
                LeaseEntry {
                    pid: 5,
                    pod: Some("ml/infer-0".into()),
                    uid: 0,
                    command: "container server".into(),
                    gpus: vec![0],
                    mem_cap: Some(2 << 30),
                    held_s: 3.0,
                    compute: None,
                    limit: None,
                    connected: true,
                },
            ],
            next: None,
            truncated: false,
            mps: None,
            recovery: None,
            history: None,
        }
    }

    #[test]
    fn table_view() {
        let t = render(&sample(), Some(120));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "GPU 0 NVIDIA H100 GPU-0000 committed 4.00 GiB/80.00 GiB slots 1/1 \
             allocated 1.00 GiB free 73.00 GiB util 37%"
        );
        // What the driver says, and the process only it knows.
        assert_eq!(lines[1], "  driver: used 4.00 GiB free 76.00 GiB");
        assert_eq!(
            lines[2],
            "  health: 63 C, 312 W of 700 W, SM 1980 MHz, ECC 2/0 (corrected/not), XID 1 (last 79)"
        );
        assert_eq!(lines[3], "  other (not under the shim): 4242 3.00 GiB");
        let lines = &lines[3..];
        assert!(lines[1].starts_with("  PID  USER    ALLOCATED"), "{t}");
        assert!(
            lines[1].contains(" ALLOCATED ")
                && lines[1].contains(" JOB (ALLOCATED) ")
                && lines[1].ends_with(" STATE    COMMAND"),
            "{t}"
        );
        // Users by name.
        assert!(lines[2].starts_with("  42   nobody  1.00 GiB"), "{t}");
        assert!(lines[3].starts_with("  7    root    0 B"), "{t}");
        assert!(lines[2].contains("41 (3.00 GiB)"), "{t}");
        // The command fills the rest of the 120 columns, no more.
        assert!(
            lines[2].ends_with("holding  python train.py --epochs 10\u{2026}"),
            "{t}"
        );
        assert_eq!(lines[2].chars().count(), 120, "{t}");
        assert!(
            lines[2].contains("1.00 GiB") && lines[2].contains("4.00 GiB"),
            "{t}"
        );
        assert!(lines[2].contains("30%") && lines[2].contains("28%"), "{t}");
        assert!(lines[2].contains(" holding "), "{t}");
        assert!(lines[3].contains("70%") && lines[3].contains("50%"), "{t}");
        assert!(lines[3].ends_with("idle     sleep"), "{t}");
        // A pod's process and lease are named by the pod, not by the
        // plugin's pid that all pods share.
        assert!(lines[3].contains(" pod ml/infer-0 "), "{t}");
        assert!(
            t.contains("\n  pod ml/infer-0  root    0     2.00 GiB"),
            "{t}"
        );
        assert!(t.contains("queue:\n"), "{t}");
        assert!(
            t.contains("3m04s") && t.contains("yes") && t.contains("2 GPUs"),
            "{t}"
        );
        // A uid this node has no name for stays a number; why the request
        // waits is under it.
        assert!(
            t.contains(
                "\n  1    99   4000000123  2 GPUs  3m04s    yes        torchrun x\n       \
                 waits: needs 2 whole GPUs; 0 free; GPU 0: held whole by job 41\n"
            ),
            "{t}"
        );
        assert!(t.contains("leases:\n") && t.contains("2h05m"), "{t}");
        // Queue and leases are named by the job's run pid, as messages name
        // them.
        assert!(t.contains("queue:\n  POS  JOB  USER        WANTS"), "{t}");
        assert!(t.contains("leases:\n  JOB             USER "), "{t}");
        assert!(t.contains("\n  41              nobody  0"), "{t}");
        assert!(t.lines().all(|l| l == l.trim_end()), "{t}");
        // Columns line up.
        let col = |l: &str| {
            l.find("COMMAND")
                .or_else(|| l.find("python"))
                .or_else(|| l.find("sleep"))
        };
        assert_eq!(col(lines[1]), col(lines[2]));
        assert_eq!(col(lines[1]), col(lines[3]));
        // Then users and their jobs: each user's part, then its jobs'.
        assert!(lines[4].starts_with("  USER    JOB "), "{t}");
        assert!(
            lines[4].contains(" WEIGHT ") && lines[4].ends_with("GPU TIME"),
            "{t}"
        );
        let row = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(row(lines[5]), "nobody all 1 30% 28% 12.5s");
        assert_eq!(row(lines[6]), "41 30 30% 28% 12.5s");
        assert_eq!(row(lines[7]), "root all 2 70% 0% 0.0s");
        assert_eq!(row(lines[8]), "pod ml/infer-0 50 70% 0% 0.0s");
    }

    /// Commands fit the width they are given, whole without one, and never
    /// shorter than a readable minimum; why a request waits wraps.
    #[test]
    fn commands_fit_the_width() {
        let mut s = sample();
        s.gpus[0].processes[0].command = format!("/usr/bin/python3 {}", "x".repeat(300));
        let whole = render(&s, None);
        assert!(
            whole.contains(&format!("python3 {}\n", "x".repeat(300))),
            "{whole}"
        );
        for width in [120, 132, 200] {
            let t = render(&s, Some(width));
            let line = t.lines().find(|l| l.contains("python3")).unwrap();
            assert_eq!(line.chars().count(), width, "{t}");
            assert!(line.ends_with('\u{2026}'), "{t}");
            for l in t.lines().filter(|l| l.trim_start().starts_with("waits:")) {
                assert!(l.chars().count() <= width, "{l}");
            }
        }
        let narrow = render(&s, Some(30));
        let line = narrow.lines().find(|l| l.contains("python3")).unwrap();
        assert!(
            line.ends_with(&format!("python3 {}\u{2026}", "x".repeat(11))),
            "{line}"
        );
        let waits: Vec<&str> = narrow
            .lines()
            .skip_while(|l| !l.contains("waits:"))
            .take_while(|l| l.starts_with("       "))
            .collect();
        assert!(waits.len() > 2, "{narrow}");
        assert_eq!(
            waits.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" "),
            "waits: needs 2 whole GPUs; 0 free; GPU 0: held whole by job 41"
        );
    }

    fn mig_sample() -> Status {
        use gpufrac_common::status::MigInstance;
        Status {
            gpus: vec![
                GpuStatus {
                    index: Some(0),
                    mode: "mig".into(),
                    uuid: "GPU-0000".into(),
                    name: "A100-SXM4-40GB".into(),
                    total_mem: 40 << 30,
                    committed_mem: 4864 << 20,
                    mig: Some(MigStatus {
                        instances: vec![
                            MigInstance {
                                gi: Some(1),
                                profile: "1g.5gb".into(),
                                placement: "6:1".into(),
                                mem: 4864 << 20,
                                uuid: Some("MIG-aaaa".into()),
                                state: "in-use".into(),
                                job: Some(41),
                                idle_s: None,
                            },
                            MigInstance {
                                gi: Some(2),
                                profile: "3g.20gb".into(),
                                placement: "0:4".into(),
                                mem: 19968 << 20,
                                uuid: Some("MIG-bbbb".into()),
                                state: "idle".into(),
                                job: None,
                                idle_s: Some(125.0),
                            },
                        ],
                        created: 2,
                        destroyed: 1,
                        failures: 0,
                    }),
                    ..GpuStatus::default()
                },
                GpuStatus {
                    index: Some(0),
                    mode: "mig-instance".into(),
                    uuid: "MIG-aaaa".into(),
                    name: "MIG 1g.5gb (GPU 0, GPU instance 1)".into(),
                    total_mem: 4864 << 20,
                    committed_mem: 4864 << 20,
                    mig_instance: Some(1),
                    processes: vec![ProcStatus {
                        pid: 42,
                        command: "probe".into(),
                        mem_used: 1 << 30,
                        state: "holding".into(),
                        ..ProcStatus::default()
                    }],
                    ..GpuStatus::default()
                },
            ],
            ..Status::default()
        }
    }

    #[test]
    fn mig_gpus_and_instances() {
        let s = mig_sample();
        let t = render(&s, Some(200));
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "GPU 0 A100-SXM4-40GB GPU-0000 MIG mode: 2 instances, 1 in use, committed 4.75 GiB/40.00 GiB \
             (created 2, destroyed 1, failed 0)"
        );
        assert_eq!(
            lines[1],
            "  GI  PROFILE  PLACEMENT  MEMORY     STATE   JOB  IDLE   MIG DEVICE"
        );
        assert_eq!(
            lines[2],
            "  1   1g.5gb   6:1        4.75 GiB   in-use  41   -      MIG-aaaa"
        );
        assert_eq!(
            lines[3],
            "  2   3g.20gb  0:4        19.50 GiB  idle    -    2m05s  MIG-bbbb"
        );
        assert_eq!(
            lines[5],
            "MIG 1g.5gb (GPU 0, GPU instance 1) MIG-aaaa committed 4.75 GiB/4.75 GiB allocated 1.00 GiB"
        );
        assert!(lines[6].starts_with("  PID  USER  ALLOCATED"), "{t}");
        assert!(
            lines[7].contains("root") && lines[7].ends_with("holding  probe"),
            "{t}"
        );
        let mut empty = s.gpus[0].clone();
        empty.mig.as_mut().unwrap().instances.clear();
        let mut out = String::new();
        render_gpu(&mut out, &empty, None);
        assert!(out.ends_with("\n  no MIG instances\n"), "{out}");
    }

    /// `status --help` explains every column the tables print, every word
    /// of the GPU line and every state the broker reports.
    #[test]
    fn help_explains_every_column_and_state() {
        let tables = render(&sample(), None) + &render(&mig_sample(), None);
        let headers: Vec<&str> = tables
            .lines()
            .filter(|l| {
                l.starts_with("  ")
                    && !l
                        .chars()
                        .any(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
            })
            .collect();
        // The process, queue, lease and MIG instance tables.
        assert!(headers.len() >= 4, "{tables}");
        for h in headers {
            for col in h.split("  ").map(str::trim).filter(|c| !c.is_empty()) {
                assert!(
                    STATUS_EXAMPLES.contains(&format!("\n  {col} ")),
                    "status --help does not explain the column {col}"
                );
            }
        }
        let gpu_line = tables.lines().next().unwrap();
        for word in gpu_line
            .split_whitespace()
            .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()))
        {
            assert!(
                STATUS_EXAMPLES.contains(&format!("\n  {word} ")),
                "status --help does not explain {word} in the GPU line"
            );
        }
        // Process states (broker/src/server.rs), MIG instance states and the
        // MPS daemon's (broker/src/mps.rs).
        for state in [
            "holding",
            "waiting",
            "idle",
            "revoking",
            "hung",
            "(draining)",
            "in-use",
            "creating",
            "foreign",
            "starting",
            "running",
            "failed",
            "stopped",
        ] {
            assert!(
                STATUS_EXAMPLES.contains(state),
                "status --help does not explain the state {state}"
            );
        }
    }

    #[test]
    fn a_recovering_broker_says_so_first() {
        let mut s = sample();
        s.recovery = Some("the state file is unusable; 12 s more".into());
        let t = render(&s, Some(200));
        assert!(
            t.starts_with("RECOVERING: the state file is unusable; 12 s more\n"),
            "{t}"
        );
        assert!(!render(&sample(), None).contains("RECOVERING"));
    }

    #[test]
    fn empty_broker() {
        let t = render(&Status::default(), None);
        assert_eq!(t, "no GPUs\n\nqueue: empty\n\nleases: none\n");
    }

    #[test]
    fn unknown_values() {
        let mut s = sample();
        s.gpus[0].index = None;
        s.gpus[0].utilization = None;
        let t = render(&s, Some(200));
        assert!(t.starts_with("GPU ? NVIDIA H100"), "{t}");
        assert!(t.lines().next().unwrap().ends_with("util -"), "{t}");
    }

    #[test]
    fn helpers() {
        assert_eq!(truncate("a\nb", 30), "a b");
        assert_eq!(
            command("/usr/bin/python3 /home/me/x.py"),
            "python3 /home/me/x.py"
        );
        assert_eq!(command("./a.out"), "a.out");
        assert_eq!(command("dir/"), "dir/");
        assert_eq!(command(""), "");
        assert_eq!(truncate(&"x".repeat(31), 30).chars().count(), 30);
        assert_eq!(seconds(0.4), "0s");
        assert_eq!(seconds(59.9), "59s");
        assert_eq!(seconds(3600.0), "1h00m");
        assert_eq!(percent(0.005), "0.5%");
        assert_eq!(percent(1.0), "100%");
        assert_eq!(percent(0.0), "0%");
    }
}
