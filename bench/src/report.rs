//! Section results, the compact terminal tables, docs/benchmarks.md, and
//! docs/benchmarks.json: the same figures with the raw series behind them,
//! which `cargo xtask plots` draws.

use serde_json::{Value, json};
use std::fmt::Write as _;

/// Everything after this line in docs/benchmarks.md is kept when the
/// bench rewrites the file: figures that other programs measure.
pub const KEPT_MARKER: &str =
    "<!-- kept across bench runs: figures measured by tests, not by the bench -->";

/// A table of figures.
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub title: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: &str, headers: &[&str]) -> Table {
        Table {
            title: title.into(),
            headers: headers.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Aligned plain text.
    pub fn text(&self) -> String {
        let n = self.headers.len();
        let mut w: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut o = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(o, "  {}", self.title);
        }
        let line = |o: &mut String, cells: &[String]| {
            o.push_str("  ");
            for (i, c) in cells.iter().enumerate().take(n) {
                let pad = w[i] - c.chars().count();
                if i == 0 {
                    o.push_str(c);
                    o.push_str(&" ".repeat(pad));
                } else {
                    o.push_str("  ");
                    o.push_str(&" ".repeat(pad));
                    o.push_str(c);
                }
            }
            o.push('\n');
        };
        line(&mut o, &self.headers);
        let rule: Vec<String> = w.iter().map(|&k| "-".repeat(k)).collect();
        line(&mut o, &rule);
        for r in &self.rows {
            line(&mut o, r);
        }
        o
    }

    pub fn markdown(&self) -> String {
        let mut o = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(o, "**{}**\n", self.title);
        }
        let _ = writeln!(o, "| {} |", self.headers.join(" | "));
        let align: Vec<&str> = (0..self.headers.len())
            .map(|i| if i == 0 { "---" } else { "---:" })
            .collect();
        let _ = writeln!(o, "| {} |", align.join(" | "));
        for r in &self.rows {
            let _ = writeln!(o, "| {} |", r.join(" | "));
        }
        o
    }
}

/// One figure held against its target.
#[derive(Clone, Debug)]
pub struct Check {
    pub what: String,
    pub value: String,
    pub target: String,
    pub pass: bool,
}

impl Check {
    pub fn new(what: &str, value: String, target: &str, pass: bool) -> Check {
        Check {
            what: what.into(),
            value,
            target: target.into(),
            pass,
        }
    }
}

fn verdict(pass: bool) -> &'static str {
    if pass { "PASS" } else { "MISS" }
}

/// A figure drawn from a section's data by `cargo xtask plots`.
#[derive(Clone, Debug)]
pub struct Plot {
    /// Which drawing xtask makes of the section's data.
    pub kind: &'static str,
    /// Where, relative to the report (docs/): `plots/NAME.svg`.
    pub file: &'static str,
    /// What it shows, as the report's image text.
    pub title: String,
}

/// What one section found.
#[derive(Clone, Debug, Default)]
pub struct Section {
    pub key: &'static str,
    pub title: String,
    /// How it was measured (markdown).
    pub method: Vec<String>,
    pub tables: Vec<Table>,
    pub checks: Vec<Check>,
    pub notes: Vec<String>,
    /// A section that could not run: why.
    pub error: Option<String>,
    /// CPU time stolen by the hypervisor while the section ran, %.
    pub steal_pct: Option<f64>,
    /// The raw series its plots are drawn from (JSON only).
    pub data: Option<Value>,
    /// Its plots, shown in the report under its tables.
    pub plots: Vec<Plot>,
}

impl Section {
    /// The section as docs/benchmarks.json holds it.
    pub fn json(&self) -> Value {
        json!({
            "key": self.key,
            "title": self.title,
            "error": self.error,
            "steal_pct": self.steal_pct,
            "checks": self.checks.iter().map(|c| json!({
                "what": c.what, "value": c.value, "target": c.target, "pass": c.pass,
            })).collect::<Vec<_>>(),
            "plots": self.plots.iter().map(|p| json!({
                "kind": p.kind, "file": p.file, "title": p.title,
            })).collect::<Vec<_>>(),
            "data": self.data,
        })
    }

    pub fn text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\n== {} ==", self.title);
        if let Some(e) = &self.error {
            let _ = writeln!(o, "  ERROR: {e}");
        }
        for t in &self.tables {
            o.push_str(&t.text());
        }
        if !self.checks.is_empty() {
            let mut t = Table::new("targets", &["figure", "value", "target", "result"]);
            for c in &self.checks {
                t.row(vec![
                    c.what.clone(),
                    c.value.clone(),
                    c.target.clone(),
                    verdict(c.pass).into(),
                ]);
            }
            o.push_str(&t.text());
        }
        for n in &self.notes {
            let _ = writeln!(o, "  note: {n}");
        }
        if let Some(p) = self.steal_pct {
            let _ = writeln!(o, "  CPU steal during this section: {p:.1}%");
        }
        o
    }

    pub fn markdown(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "## {}\n", self.title);
        for m in &self.method {
            let _ = writeln!(o, "{m}\n");
        }
        if let Some(e) = &self.error {
            let _ = writeln!(o, "**The section failed:** `{}`\n", e.replace('\n', " "));
        }
        if !self.checks.is_empty() {
            let _ = writeln!(o, "| figure | value | target | result |");
            let _ = writeln!(o, "| --- | ---: | --- | --- |");
            for c in &self.checks {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | **{}** |",
                    c.what,
                    c.value,
                    c.target,
                    verdict(c.pass)
                );
            }
            o.push('\n');
        }
        for t in &self.tables {
            o.push_str(&t.markdown());
            o.push('\n');
        }
        for p in &self.plots {
            let _ = writeln!(o, "![{}]({})\n", p.title, p.file);
        }
        for n in &self.notes {
            let _ = writeln!(o, "- {n}");
        }
        if let Some(p) = self.steal_pct {
            let _ = writeln!(
                o,
                "- CPU time stolen by the hypervisor while this section ran: {p:.1}% \
                 (/proc/stat; anything above ~1% means the VM was descheduled and \
                 latencies above are inflated)."
            );
        }
        if !self.notes.is_empty() || self.steal_pct.is_some() {
            o.push('\n');
        }
        o
    }
}

/// The machine, for the report header.
pub struct Machine {
    pub nproc: usize,
    pub cpu: String,
    pub kernel: String,
}

pub fn machine() -> Machine {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    Machine {
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu,
        kernel,
    }
}

/// Aggregate CPU time counters from /proc/stat: (steal, total) in ticks.
pub fn cpu_steal() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(l) = s.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let v: Vec<u64> = l
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal guest guest_nice; the
    // guest times are already inside user and nice.
    let total = v.iter().take(8).sum();
    (v.get(7).copied().unwrap_or(0), total)
}

/// Percentage of CPU time stolen by the hypervisor between two samples.
pub fn steal_pct(a: (u64, u64), b: (u64, u64)) -> f64 {
    let total = b.1.saturating_sub(a.1);
    if total == 0 {
        return 0.0;
    }
    b.0.saturating_sub(a.0) as f64 * 100.0 / total as f64
}

/// The first three fields of /proc/loadavg.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// UTC date and time of now, `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

pub struct RunInfo {
    pub date: String,
    /// /proc/loadavg at the start and at the end of the run.
    pub load: (String, String),
    /// CPU time stolen by the hypervisor over the whole run, %.
    pub steal_pct: f64,
    pub machine: Machine,
    pub profile: &'static str,
    pub quick: bool,
    pub only: Option<String>,
    pub wall_s: f64,
    pub command: String,
}

/// docs/benchmarks.json: the run's header, and every section's checks,
/// plots and raw data.
pub fn document_json(info: &RunInfo, sections: &[Section]) -> Value {
    json!({
        "version": 1,
        "generated_by": info.command,
        "date": info.date,
        "machine": {
            "cpu": info.machine.cpu,
            "nproc": info.machine.nproc,
            "kernel": info.machine.kernel,
        },
        "driver": "simulated",
        "profile": info.profile,
        "quick": info.quick,
        "only": info.only,
        "load": [info.load.0, info.load.1],
        "steal_pct": info.steal_pct,
        "wall_s": info.wall_s,
        "sections": sections.iter().map(Section::json).collect::<Vec<_>>(),
    })
}

pub fn document(info: &RunInfo, sections: &[Section]) -> String {
    let mut o = String::new();
    o.push_str("# gpufrac benchmarks\n\n");
    o.push_str(
        "Generated by `cargo run --release -p gpufrac-bench` (bench/); do not edit by hand, \
         run it again. The same run wrote [benchmarks.json](benchmarks.json): these figures \
         and the raw series behind them (shares over time, every request's latency, the \
         broker's rows), which `cargo xtask plots` draws as the SVGs in [plots/](plots/).\n\n",
    );
    let _ = writeln!(o, "| | |\n| --- | --- |");
    let _ = writeln!(o, "| date | {} |", info.date);
    let _ = writeln!(
        o,
        "| machine | {}, nproc {}, Linux {} |",
        info.machine.cpu, info.machine.nproc, info.machine.kernel
    );
    let _ = writeln!(o, "| build profile | {} |", info.profile);
    let _ = writeln!(
        o,
        "| driver | simulated (`libgpufrac_sim.so` as libcuda.so.1; no GPU on this machine) |"
    );
    let _ = writeln!(o, "| command | `{}` |", info.command);
    let mode = match (&info.only, info.quick) {
        (Some(s), true) => format!("quick, only {s}"),
        (Some(s), false) => format!("only {s}"),
        (None, true) => "quick (smoke test: short runs, noisy figures)".into(),
        (None, false) => "full".into(),
    };
    let _ = writeln!(o, "| mode | {mode} |");
    let _ = writeln!(
        o,
        "| load average (1/5/15 min) | {} at the start, {} at the end |",
        info.load.0, info.load.1
    );
    let _ = writeln!(
        o,
        "| CPU steal (hypervisor) | {:.1}% of CPU time during the run |",
        info.steal_pct
    );
    let _ = writeln!(o, "| wall time | {:.0} s |\n", info.wall_s);

    let all: Vec<&Check> = sections.iter().flat_map(|s| s.checks.iter()).collect();
    let missed = all.iter().filter(|c| !c.pass).count();
    let _ = writeln!(
        o,
        "**{} of {} targets met.**{}\n",
        all.len() - missed,
        all.len(),
        if missed > 0 {
            " Misses are listed per section with the figure that missed."
        } else {
            ""
        }
    );

    o.push_str("## How to read this\n\n");
    o.push_str(
        "Everything here runs on the simulated CUDA driver, so the figures measure gpufrac's own \
         cost (the shim's hooks, the broker's decisions, the hand-over between processes), not a \
         GPU's. Performance is never judged by an absolute time alone: each overhead is the \
         difference (or ratio) between a run with gpufrac and a baseline run of the same \
         program without it, taken in the same invocation, in alternating rounds so that a \
         noisy neighbour or frequency change hits both sides alike; the median over rounds is \
         reported. \"ns added\" is the median, over rounds, of (with shim − native) within \
         the round. Arbitration quality \
         compares the broker's achieved GPU shares with the shares asked for, and the GPU busy \
         fraction with the broker against the same processes contending freely without it. \
         Sections 5 and 6 put whole programs side by side on one simulated GPU whose engine \
         time-slices contexts as an H100 does (a 2 ms slice while another context waits, \
         100 us per switch), so *without gpufrac* there means the GPU's own time-slicing, and \
         a request's latency includes both processes' wake-ups on this machine. \
         A figure marked MISS did not meet its target in this run; the notes under it say where \
         the time goes. Where the interquartile range shown for a figure straddles its target, \
         its PASS or MISS is within this machine's noise (a shared 2-CPU VM: repeated runs move \
         the nanosecond figures by tens of percent). Absolute nanoseconds depend on this machine (see the header); the ratios \
         and the added costs are what carry over. On a real GPU a launch costs microseconds, so \
         tens of nanoseconds added are well under 1%.\n\n",
    );
    for s in sections {
        o.push_str(&s.markdown());
    }
    o
}
