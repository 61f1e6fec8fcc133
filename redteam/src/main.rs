//! `redteam` (run as `cargo xtask redteam`): longer searches than the
//! test suite's, a strategy played alone, and the fit of the cost model.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpufrac_redteam::attack::Space;
use gpufrac_redteam::check::{Invariant, evaluate};
use gpufrac_redteam::core::{self, NS_PER_ALLOC, NS_PER_CALL, NS_PER_KIB};
use gpufrac_redteam::search::{Plan, search};
use gpufrac_redteam::{Bounds, Priority, Strategy, seeds};

#[derive(Parser)]
#[command(
    name = "redteam",
    about = "An attacker that searches: the broker's invariants under a hostile user's best strategy"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Search for the strategy that harms the victim most, for each
    /// invariant (or those named), and print it with its harm, in words
    /// and as Rust to paste into a regression test.
    Search {
        /// The search's seed (the test suite's is 20261126).
        #[arg(long, default_value_t = gpufrac_redteam::search::SEED)]
        seed: u64,
        /// Strategies played per invariant.
        #[arg(long, default_value_t = 400)]
        budget: usize,
        /// Only these invariants (fairness, service, idle, logs, state,
        /// queue); all by default.
        #[arg(long = "invariant", value_parser = invariant)]
        invariants: Vec<Invariant>,
        /// Leave out the review's strategy of this name from the seeds
        /// (rotation, high-and-normal, ...; see `redteam seeds`).
        #[arg(long, value_name = "NAME")]
        without: Vec<String>,
        /// Start from random strategies only.
        #[arg(long)]
        no_seeds: bool,
        /// Inputs of the test suite's size (256 KiB command lines, 32 KiB
        /// labels) instead of the largest the protocol and /proc allow.
        #[arg(long)]
        quick: bool,
        /// Only shims, with short command lines and no made-up GPUs.
        #[arg(long)]
        shims_only: bool,
        /// Only shims of these classes (high, normal, low), others made
        /// the first of them.
        #[arg(long, value_delimiter = ',', value_parser = class)]
        classes: Vec<Priority>,
        /// Every shim launches while it holds (leaves out the holder
        /// without work, which the broker tells from a busy one only by
        /// the driver's per-process utilisation).
        #[arg(long)]
        working: bool,
    },
    /// The review's strategies, by name.
    Seeds,
    /// Play one of the review's strategies (or all of them, and none)
    /// against one invariant.
    Play {
        #[arg(long = "invariant", value_parser = invariant)]
        invariant: Invariant,
        /// Its name (`redteam seeds`), or `all`.
        name: String,
        /// Inputs of the test suite's size.
        #[arg(long)]
        quick: bool,
        /// Print the broker's log too.
        #[arg(long)]
        log: bool,
        /// Print the victim's questions too: when each was asked and
        /// answered, and the broker's work meanwhile.
        #[arg(long)]
        answers: bool,
    },
    /// Fit the cost model: each call into the core, timed, against its
    /// allocations and their bytes (run it in a release build).
    Calibrate,
}

fn class(s: &str) -> Result<Priority, String> {
    Priority::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("no class {s:?}; the classes are high, normal, low"))
}

fn invariant(s: &str) -> Result<Invariant, String> {
    Invariant::parse(s).ok_or_else(|| {
        let names: Vec<&str> = Invariant::ALL.iter().map(|i| i.name()).collect();
        format!(
            "no invariant {s:?}; the invariants are {}",
            names.join(", ")
        )
    })
}

fn main() -> ExitCode {
    match Cli::parse().task {
        Task::Search {
            seed,
            budget,
            invariants,
            without,
            no_seeds,
            quick,
            shims_only,
            classes,
            working,
        } => {
            let all = seeds();
            for name in &without {
                if !all.iter().any(|(n, _)| n == name) {
                    eprintln!(
                        "redteam: no seed strategy named {name:?}; `redteam seeds` lists them"
                    );
                    return ExitCode::FAILURE;
                }
            }
            let chosen: Vec<_> = if no_seeds {
                Vec::new()
            } else {
                all.into_iter()
                    .filter(|(n, _)| !without.iter().any(|w| w == n))
                    .collect()
            };
            let invariants = if invariants.is_empty() {
                Invariant::ALL.to_vec()
            } else {
                invariants
            };
            let mut broken = 0;
            for inv in invariants {
                let plan = Plan {
                    invariant: inv,
                    seed,
                    budget,
                    bounds: if quick { Bounds::QUICK } else { Bounds::FULL },
                    space: Space {
                        shims_only,
                        classes: classes.clone(),
                        working,
                    },
                    seeds: &chosen,
                };
                let mut log = |n: usize, _: &Strategy, o: &gpufrac_redteam::Outcome| {
                    eprintln!("  {} [{n}] harm {:.3}: {}", inv.name(), o.harm, o.figures);
                };
                let found = search(&plan, Some(&mut log));
                if !found.outcome.holds() {
                    broken += 1;
                }
                println!("{}", gpufrac_redteam::search::report(&found, seed));
            }
            if broken > 0 {
                println!("{broken} invariant(s) broken");
            }
            ExitCode::SUCCESS
        }
        Task::Seeds => {
            for (name, s) in seeds() {
                println!("{name}: {}", s.describe());
            }
            ExitCode::SUCCESS
        }
        Task::Play {
            invariant,
            name,
            quick,
            log,
            answers,
        } => {
            let mut chosen: Vec<_> = seeds()
                .into_iter()
                .filter(|(n, _)| name == "all" || *n == name)
                .collect();
            if name == "all" || name == "nothing" {
                chosen.push(("nothing", Strategy::default()));
            }
            if chosen.is_empty() {
                eprintln!(
                    "redteam: no seed strategy named {name:?}; `redteam seeds` lists them (and `nothing`, the attacker that does nothing)"
                );
                return ExitCode::FAILURE;
            }
            let bounds = if quick { Bounds::QUICK } else { Bounds::FULL };
            for (n, s) in chosen {
                let t = std::time::Instant::now();
                let o = evaluate(invariant, &s, &bounds);
                println!(
                    "{n} in {}: harm {:.3} (threshold {:.3}, {}): {} [{:.1} s]",
                    invariant.name(),
                    o.harm,
                    invariant.threshold(),
                    if o.holds() { "holds" } else { "broken" },
                    o.figures,
                    t.elapsed().as_secs_f64()
                );
                if log {
                    for l in gpufrac_redteam::check::log_of(invariant, &s, &bounds) {
                        println!("  {}", l.text);
                    }
                }
                if answers {
                    for (what, asked, answered, work) in
                        gpufrac_redteam::check::answers_of(invariant, &s, &bounds)
                    {
                        let answered =
                            answered.map_or("never".to_owned(), |t| format!("at {t:.2} ms"));
                        println!(
                            "  {what} asked at {asked:.2} ms, answered {answered}, {work:.2} ms of the broker's work meanwhile"
                        );
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Task::Calibrate => {
            calibrate();
            ExitCode::SUCCESS
        }
    }
}

/// Least squares of each call's real time against (1, allocations,
/// KiB allocated), over every seed strategy in every scene.
fn calibrate() {
    let mut samples = Vec::new();
    for inv in Invariant::ALL {
        for (_, s) in seeds() {
            let (_, mut got) = core::profile(|| evaluate(inv, &s, &Bounds::FULL));
            samples.append(&mut got);
        }
    }
    // Normal equations for real = a + b * allocs + c * kib.
    let mut m = [[0f64; 3]; 3];
    let mut v = [0f64; 3];
    for s in &samples {
        let x = [1.0, s.work.allocs as f64, s.work.bytes as f64 / 1024.0];
        for (row, xi) in m.iter_mut().zip(x) {
            for (cell, xj) in row.iter_mut().zip(x) {
                *cell += xi * xj;
            }
        }
        for (vi, xi) in v.iter_mut().zip(x) {
            *vi += xi * s.real as f64;
        }
    }
    let fit = solve(m, v);
    let total: f64 = samples.iter().map(|s| s.real as f64).sum();
    let model: f64 = samples
        .iter()
        .map(|s| core::cost(s.work) as f64 + NS_PER_CALL as f64)
        .sum();
    println!(
        "{} calls, {:.1} ms in all; fit: {:.0} ns a call, {:.1} ns an allocation, {:.1} ns a KiB",
        samples.len(),
        total / 1e6,
        fit[0],
        fit[1],
        fit[2]
    );
    println!(
        "the model in core.rs ({NS_PER_CALL} ns, {NS_PER_ALLOC} ns, {NS_PER_KIB} ns) gives {:.1} ms for them",
        model / 1e6
    );
    let mut heavy: Vec<_> = samples.iter().filter(|s| s.real > 1_000_000).collect();
    heavy.sort_by_key(|s| std::cmp::Reverse(s.real));
    for s in heavy.iter().take(10) {
        println!(
            "  {:.2} ms real, {:.2} ms modelled: {} allocations, {} KiB",
            s.real as f64 / 1e6,
            (core::cost(s.work) + NS_PER_CALL) as f64 / 1e6,
            s.work.allocs,
            s.work.bytes / 1024
        );
    }
}

/// `m x = v`, by Gaussian elimination.
fn solve(mut m: [[f64; 3]; 3], mut v: [f64; 3]) -> [f64; 3] {
    for i in 0..3 {
        let p = (i..3)
            .max_by(|&a, &b| m[a][i].abs().total_cmp(&m[b][i].abs()))
            .unwrap_or(i);
        m.swap(i, p);
        v.swap(i, p);
        if m[i][i].abs() < 1e-12 {
            continue;
        }
        let (pivot, pv) = (m[i], v[i]);
        for (r, (row, vr)) in m.iter_mut().zip(v.iter_mut()).enumerate() {
            if r != i {
                let f = row[i] / pivot[i];
                for (cell, p) in row.iter_mut().zip(pivot) {
                    *cell -= f * p;
                }
                *vr -= f * pv;
            }
        }
    }
    [v[0] / m[0][0], v[1] / m[1][1], v[2] / m[2][2]]
}
