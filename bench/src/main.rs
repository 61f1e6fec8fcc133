//! gpufrac-bench: the benchmark instrument.
//!
//! `cargo run --release -p gpufrac-bench [-- --quick] [-- --only SECTION[,SECTION…]]`
//! builds the shim, the simulated driver and the binaries, runs every
//! section on the simulated driver, prints a compact table per section and
//! writes docs/benchmarks.md, and docs/benchmarks.json with the raw series
//! behind the figures (`cargo xtask plots` draws docs/plots/ from it).
//!
//! Sections: `hook` (1: hook overhead), `free` (2: free stays O(1)),
//! `arbitration` (3: shares, utilisation, switch cost), `scale` (4: broker
//! scale), `latency` (5: an interactive process beside batch work),
//! `accuracy` (6: shares with short and long kernels); `contend` and
//! `churn` run those parts of section 4 alone, only when named. `gpufrac-bench
//! scale-client …` is the simulated shim of section 4, `gpufrac-bench
//! queue-client …` its deep queue (internal subcommands).

mod sections;

use clap::{Parser, Subcommand};
use gpufrac_bench::harness;
use gpufrac_bench::report::{self, RunInfo, Section};
use std::path::PathBuf;
use std::process::ExitCode;

/// The benchmark instrument: every section on the simulated driver, a
/// table per section on stdout, and the report written as Markdown.
#[derive(Parser, Debug)]
#[command(name = "gpufrac-bench", args_conflicts_with_subcommands = true)]
struct Opts {
    /// Short runs (a smoke test; figures are noisy).
    #[arg(long)]
    quick: bool,
    /// hook | free | arbitration | scale | latency | accuracy (or 1..6); a
    /// comma-separated list, or --only more than once, runs several.
    /// `contend` and `churn` run those parts of scale alone.
    #[arg(long, value_name = "SECTION", value_delimiter = ',', value_parser = section_key)]
    only: Vec<&'static str>,
    /// Where to write the report [default: docs/benchmarks.md for a full
    /// run, target/<profile>/benchmarks-partial.md with --quick or --only,
    /// so a smoke test never overwrites the real figures].
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Where to write the figures and their raw series as JSON [default:
    /// the report's path with .json for .md].
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    #[command(subcommand)]
    internal: Option<Internal>,
}

#[derive(Subcommand, Debug)]
enum Internal {
    /// The simulated shim of section 4 (started by the section itself).
    #[command(hide = true)]
    ScaleClient(sections::scale::ClientArgs),
    /// Section 4's deep queue, in a process of its own (started by the
    /// section itself).
    #[command(hide = true)]
    QueueClient(sections::queue::QueueArgs),
}

fn section_key(s: &str) -> Result<&'static str, String> {
    match s.trim() {
        "1" | "hook" | "overhead" => Ok("hook"),
        "2" | "free" => Ok("free"),
        "3" | "arbitration" | "arb" => Ok("arbitration"),
        "4" | "scale" => Ok("scale"),
        "5" | "latency" => Ok("latency"),
        "6" | "accuracy" => Ok("accuracy"),
        "contend" => Ok("contend"),
        "churn" => Ok("churn"),
        other => Err(format!(
            "unknown section {other:?}; expected hook, free, arbitration, scale, latency, \
             accuracy or 1..6 (or contend, churn: parts of scale alone)"
        )),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = Opts::parse();
    match &opts.internal {
        Some(Internal::ScaleClient(c)) => return sections::scale::client_main(c),
        Some(Internal::QueueClient(q)) => return sections::queue::queue_main(q),
        None => {}
    }
    opts.only.sort_unstable();
    opts.only.dedup();
    let t0 = std::time::Instant::now();
    let load0 = report::loadavg();
    let steal_start = report::cpu_steal();
    let a = match harness::build() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpufrac-bench: {e}");
            return ExitCode::from(1);
        }
    };
    type Runner = fn(&harness::Artifacts, bool) -> Result<Section, String>;
    // `contend` and `churn` are parts of `scale`, run alone only when
    // named.
    let parts = ["contend", "churn"];
    let all: [(&str, &str, Runner); 8] = [
        ("hook", "1. Hook overhead", sections::hook::run),
        ("free", "2. Free stays O(1)", sections::free::run),
        (
            "arbitration",
            "3. Arbitration quality",
            sections::arbitration::run,
        ),
        ("scale", "4. Broker scale", sections::scale::run),
        (
            "latency",
            "5. Interactive latency beside batch work",
            sections::latency::run,
        ),
        (
            "accuracy",
            "6. Share accuracy across kernel lengths",
            sections::accuracy::run,
        ),
        (
            "contend",
            sections::contend::CONTEND_TITLE,
            sections::contend::contend_section,
        ),
        (
            "churn",
            sections::contend::CHURN_TITLE,
            sections::contend::churn_section,
        ),
    ];
    let mut done = Vec::new();
    for (key, title, run) in all {
        let named = opts.only.contains(&key);
        if (!opts.only.is_empty() || parts.contains(&key)) && !named {
            continue;
        }
        eprintln!("gpufrac-bench: section {title} …");
        let ts = std::time::Instant::now();
        let steal0 = report::cpu_steal();
        let mut s = match run(&a, opts.quick) {
            Ok(s) => s,
            Err(e) => Section {
                key,
                title: title.into(),
                error: Some(e),
                ..Section::default()
            },
        };
        s.steal_pct = Some(report::steal_pct(steal0, report::cpu_steal()));
        print!("{}", s.text());
        eprintln!(
            "gpufrac-bench: section {title} took {:.0} s",
            ts.elapsed().as_secs_f64()
        );
        done.push(s);
    }
    let info = RunInfo {
        date: report::utc_now(),
        load: (load0, report::loadavg()),
        steal_pct: report::steal_pct(steal_start, report::cpu_steal()),
        machine: report::machine(),
        profile: a.profile,
        quick: opts.quick,
        only: (!opts.only.is_empty()).then(|| opts.only.join(", ")),
        wall_s: t0.elapsed().as_secs_f64(),
        command: std::iter::once(if a.profile == "release" {
            "cargo run --release -p gpufrac-bench".to_string()
        } else {
            "cargo run -p gpufrac-bench".to_string()
        })
        .chain((!args.is_empty()).then(|| format!("-- {}", args.join(" "))))
        .collect::<Vec<_>>()
        .join(" "),
    };
    let out = opts.out.clone().unwrap_or_else(|| {
        if opts.quick || !opts.only.is_empty() {
            a.dir.join("benchmarks-partial.md")
        } else {
            a.root.join("docs/benchmarks.md")
        }
    });
    let mut doc = report::document(&info, &done);
    // Figures measured elsewhere (by tests against real engines, the
    // broker's attack tests) live below this marker and survive a rerun.
    if let Ok(old) = std::fs::read_to_string(&out)
        && let Some(at) = old.find(report::KEPT_MARKER)
    {
        if !doc.ends_with('\n') {
            doc.push('\n');
        }
        doc.push('\n');
        doc.push_str(&old[at..]);
    }
    if let Some(dir) = out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = std::fs::write(&out, doc) {
        eprintln!("gpufrac-bench: writing {}: {e}", out.display());
        return ExitCode::from(1);
    }
    let json_out = opts
        .json
        .clone()
        .unwrap_or_else(|| out.with_extension("json"));
    let json = report::document_json(&info, &done);
    let text = serde_json::to_string_pretty(&json).unwrap_or_default() + "\n";
    if let Err(e) = std::fs::write(&json_out, text) {
        eprintln!("gpufrac-bench: writing {}: {e}", json_out.display());
        return ExitCode::from(1);
    }
    let checks: Vec<_> = done.iter().flat_map(|s| s.checks.iter()).collect();
    let missed = checks.iter().filter(|c| !c.pass).count();
    let failed = done.iter().filter(|s| s.error.is_some()).count();
    println!(
        "\n{} of {} targets met{}; report written to {} and {} ({:.0} s)",
        checks.len() - missed,
        checks.len(),
        if failed > 0 {
            format!(", {failed} section(s) FAILED to run")
        } else {
            String::new()
        },
        out.display(),
        json_out.display(),
        info.wall_s
    );
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
