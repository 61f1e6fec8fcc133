//! gpufrac-bench: the benchmark instrument.
//!
//! `cargo run --release -p gpufrac-bench [-- --quick] [-- --only SECTION[,SECTION…]]`
//! builds the shim, the simulated driver and the binaries, runs every
//! section on the simulated driver, prints a compact table per section and
//! writes docs/benchmarks.md.
//!
//! Sections: `hook` (1: hook overhead), `free` (2: free stays O(1)),
//! `arbitration` (3: shares, utilisation, switch cost), `scale` (4: broker
//! scale), `latency` (5: an interactive process beside batch work),
//! `accuracy` (6: shares with short and long kernels). `gpufrac-bench
//! scale-client …` is the simulated shim of section 4 (an internal
//! subcommand).

mod sections;

use gpufrac_bench::harness;
use gpufrac_bench::report::{self, RunInfo, Section};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "\
usage: gpufrac-bench [--quick] [--only SECTION[,SECTION…]] [--out FILE]

  --quick         short runs (a smoke test; figures are noisy)
  --only SECTION  hook | free | arbitration | scale | latency | accuracy (or
                  1..6); a comma-separated list, or --only more than once,
                  runs several
  --out FILE      where to write the report [default: docs/benchmarks.md for a
                  full run, target/<profile>/benchmarks-partial.md with --quick
                  or --only, so a smoke test never overwrites the real figures]";

struct Opts {
    quick: bool,
    /// Empty: every section.
    only: Vec<&'static str>,
    out: Option<PathBuf>,
}

fn section_key(s: &str) -> Option<&'static str> {
    match s {
        "1" | "hook" | "overhead" => Some("hook"),
        "2" | "free" => Some("free"),
        "3" | "arbitration" | "arb" => Some("arbitration"),
        "4" | "scale" => Some("scale"),
        "5" | "latency" => Some("latency"),
        "6" | "accuracy" => Some("accuracy"),
        _ => None,
    }
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        quick: false,
        only: Vec::new(),
        out: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--only" => {
                let v = it.next().ok_or("--only needs a section")?;
                for part in v.split(',') {
                    let k = section_key(part.trim())
                        .ok_or_else(|| format!("unknown section {part:?}"))?;
                    if !o.only.contains(&k) {
                        o.only.push(k);
                    }
                }
            }
            "--out" => o.out = Some(it.next().ok_or("--out needs a file")?.into()),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("scale-client") {
        return sections::scale::client_main(&args[1..]);
    }
    let opts = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("gpufrac-bench: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
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
    let all: [(&str, &str, Runner); 6] = [
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
    ];
    let mut done = Vec::new();
    for (key, title, run) in all {
        if !opts.only.is_empty() && !opts.only.contains(&key) {
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
    let checks: Vec<_> = done.iter().flat_map(|s| s.checks.iter()).collect();
    let missed = checks.iter().filter(|c| !c.pass).count();
    let failed = done.iter().filter(|s| s.error.is_some()).count();
    println!(
        "\n{} of {} targets met{}; report written to {} ({:.0} s)",
        checks.len() - missed,
        checks.len(),
        if failed > 0 {
            format!(", {failed} section(s) FAILED to run")
        } else {
            String::new()
        },
        out.display(),
        info.wall_s
    );
    if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
