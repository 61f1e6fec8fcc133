//! Section 6: whether GPU time splits as asked when kernels are short,
//! longer than the engine's quantum, or longer than the broker's timeslice,
//! and what a shared GPU keeps busy against one job alone.

use super::f;
use super::loadgen::{
    LEAD_NS, MS, Place, QUANTUM_NS, batch_depth, executed_ns, kernel_label, limit, med, trace,
};
use gpufrac_bench::clock::mono_ns;
use gpufrac_bench::harness::Artifacts;
use gpufrac_bench::report::{Check, Plot, Section, Table};

const KERNELS_US: [u64; 3] = [50, 6000, 120_000];
const SHARES: [&str; 2] = ["70%", "30%"];
const FIRST: f64 = 0.70;
const SPLIT_TARGET_PP: f64 = 2.0;
const BUSY_TARGET: f64 = 0.95;

/// Samples of each job's GPU time over the window, for the plot of shares
/// over time.
const TRACE_POINTS: u64 = 40;

/// How a pair's GPU time grew over the window: the step in ms, and each
/// job's GPU time from the window's start to every step.
type Trace = (u64, [Vec<u64>; 2]);

/// One round of one kernel length.
#[derive(Clone, Debug)]
struct Round {
    /// GPU time of the 70% and the 30% job, ns.
    pair: [u64; 2],
    /// How their GPU time grew over the window.
    trace: Trace,
    /// GPU time of one job alone, ns.
    alone: u64,
    window_ns: u64,
}

impl Round {
    fn first(&self) -> f64 {
        self.pair[0] as f64 / (self.pair[0] + self.pair[1]).max(1) as f64
    }

    fn pair_busy(&self) -> f64 {
        (self.pair[0] + self.pair[1]) as f64 / self.window_ns as f64
    }

    fn alone_busy(&self) -> f64 {
        self.alone as f64 / self.window_ns as f64
    }
}

/// A 120 ms kernel is a large step of GPU time: the window must hold many
/// of them for the split to be resolved to well under 2 pp.
fn window_ns(kernel_us: u64, quick: bool) -> u64 {
    let base = if quick { 2000 * MS } else { 4000 * MS };
    if kernel_us * 1000 > 20 * MS {
        3 * base
    } else {
        base
    }
}

/// The 70/30 pair through a fresh broker; their GPU times, and how they
/// grew over the window.
fn pair(a: &Artifacts, kernel_us: u64, window: u64) -> Result<([u64; 2], Trace), String> {
    let place = Place::gpufrac(a)?;
    let start = mono_ns() + LEAD_NS;
    let end = start + window;
    let step_ms = (window / TRACE_POINTS / MS).max(1);
    let kids = SHARES
        .iter()
        .map(|s| {
            place.batch(
                a,
                kernel_us,
                (start, end),
                Some(step_ms),
                &[("GPU_COMPUTE_SHARE", s)],
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = [0; 2];
    let mut traces: [Vec<u64>; 2] = Default::default();
    for ((o, t), k) in out.iter_mut().zip(traces.iter_mut()).zip(kids) {
        let done = k.finish(limit(window))?;
        *o = executed_ns(&done)?;
        *t = trace(&done)?.1;
    }
    Ok((out, (step_ms, traces)))
}

/// One job alone on the GPU, without gpufrac: all the GPU there is.
fn alone(a: &Artifacts, kernel_us: u64, window: u64) -> Result<u64, String> {
    let place = Place::native(a)?;
    let start = mono_ns() + LEAD_NS;
    let k = place.batch(a, kernel_us, (start, start + window), None, &[])?;
    executed_ns(&k.finish(limit(window))?)
}

fn pct(v: f64, d: usize) -> String {
    format!("{}%", f(v * 100.0, d))
}

pub fn run(a: &Artifacts, quick: bool) -> Result<Section, String> {
    let rounds = if quick { 1 } else { 3 };
    let mut res = vec![Vec::<Round>::new(); KERNELS_US.len()];
    for r in 0..rounds {
        for (ki, &k) in KERNELS_US.iter().enumerate() {
            let w = window_ns(k, quick);
            // Pair and baseline alternate which goes first.
            let (p, x) = if (r + ki) % 2 == 0 {
                let p = pair(a, k, w)?;
                (p, alone(a, k, w)?)
            } else {
                let x = alone(a, k, w)?;
                (pair(a, k, w)?, x)
            };
            res[ki].push(Round {
                pair: p.0,
                trace: p.1,
                alone: x,
                window_ns: w,
            });
        }
    }

    let mut t = Table::new(
        &format!(
            "two batch jobs at GPU_COMPUTE_SHARE 70% / 30% through the broker; {rounds} round(s)"
        ),
        &[
            "kernels",
            "window",
            "target split",
            "achieved split",
            "error",
            "pair busy",
            "one alone busy",
            "pair ÷ alone",
        ],
    );
    let mut spread = Table::new(
        "every round (the split above pools the rounds' GPU time; busy figures are the median round's)",
        &[
            "kernels",
            "70% job's part per round",
            "pair ÷ alone per round",
        ],
    );
    let mut checks = Vec::new();
    let mut kernels = Vec::new();
    for (ki, &k) in KERNELS_US.iter().enumerate() {
        let rs = &res[ki];
        let a_ns: u64 = rs.iter().map(|x| x.pair[0]).sum();
        let b_ns: u64 = rs.iter().map(|x| x.pair[1]).sum();
        let first = a_ns as f64 / (a_ns + b_ns).max(1) as f64;
        let err = (first - FIRST).abs() * 100.0;
        let ratio = med(rs.iter().map(|x| x.pair_busy() / x.alone_busy()));
        t.row(vec![
            kernel_label(k),
            format!("{:.0} s", window_ns(k, quick) as f64 / 1e9),
            "70.0 / 30.0".into(),
            format!("{} / {}", f(first * 100.0, 1), f((1.0 - first) * 100.0, 1)),
            format!("{} pp", f(err, 2)),
            pct(med(rs.iter().map(Round::pair_busy)), 1),
            pct(med(rs.iter().map(Round::alone_busy)), 1),
            pct(ratio, 1),
        ]);
        spread.row(vec![
            kernel_label(k),
            rs.iter()
                .map(|x| f(x.first() * 100.0, 1))
                .collect::<Vec<_>>()
                .join(" / "),
            rs.iter()
                .map(|x| pct(x.pair_busy() / x.alone_busy(), 1))
                .collect::<Vec<_>>()
                .join(" / "),
        ]);
        kernels.push(serde_json::json!({
            "kernel_us": k,
            "label": kernel_label(k),
            "window_s": window_ns(k, quick) as f64 / 1e9,
            "error_pp": err,
            "rounds": rs.iter().map(|x| serde_json::json!({
                "first_share": x.first(),
                "error_pp": (x.first() - FIRST).abs() * 100.0,
                "trace_step_ms": x.trace.0,
                "executed_ns": [x.trace.1[0], x.trace.1[1]],
            })).collect::<Vec<_>>(),
        }));
        checks.push(Check::new(
            &format!("70/30, {} kernels: split error", kernel_label(k)),
            format!("{} pp", f(err, 2)),
            &format!("≤ {SPLIT_TARGET_PP} pp"),
            err <= SPLIT_TARGET_PP,
        ));
        checks.push(Check::new(
            &format!("70/30, {} kernels: pair busy vs one alone", kernel_label(k)),
            pct(ratio, 1),
            &format!("≥ {:.0}%", BUSY_TARGET * 100.0),
            ratio >= BUSY_TARGET,
        ));
    }
    let method = vec![format!(
        "Two `loadgen batch` processes (examples/loadgen.rs) run under the shim as clients of a \
         fresh `gpufrac broker` (default settings) with GPU_COMPUTE_SHARE=70% and 30%, queueing \
         kernels of 50 us ({} per synchronize), 6 ms ({}) or 120 ms ({}) for a common window; \
         the simulated engine time-slices contexts with a {} ms quantum. Each job's GPU time \
         is the simulated driver's count of the kernel time it ran (`gpufracSimExecutedNs`), \
         as loadgen prints it; the split is the 70% job's part of the pair's total, pooled \
         over the rounds. *Busy* is GPU time over the window; the baseline is one such job \
         alone on the GPU without gpufrac (no shim, no broker), the pair's figure of merit \
         being its busy over the lone job's in the same round. Pair and baseline alternate \
         which goes first; {rounds} round(s).",
        batch_depth(50),
        batch_depth(6000),
        batch_depth(120_000),
        QUANTUM_NS / MS,
    )];
    let notes = vec![
        "120 ms kernels are six times the broker's 20 ms timeslice: a kernel cannot be \
         interrupted by the broker, so the split has to come from charging each job for the \
         GPU time it actually used and choosing the next holder accordingly; the window is \
         three times longer so that one kernel is a small part of it."
            .into(),
        "GPU time includes each job's last batch, which may finish after the window closes \
         (the depths above bound it); it inflates busy slightly, for the pair and the lone \
         job alike."
            .into(),
    ];
    Ok(Section {
        key: "accuracy",
        title: "6. Share accuracy across kernel lengths".into(),
        method,
        tables: vec![t, spread],
        checks,
        notes,
        error: None,
        steal_pct: None,
        data: Some(serde_json::json!({
            "targets": [FIRST, 1.0 - FIRST],
            "error_target_pp": SPLIT_TARGET_PP,
            "kernels": kernels,
        })),
        plots: vec![
            Plot {
                kind: "shares-over-time",
                file: "plots/shares-over-time.svg",
                title: "Achieved share of two jobs at 70% and 30% over the window, against \
                        their targets, for 50 us, 6 ms and 120 ms kernels"
                    .into(),
            },
            Plot {
                kind: "share-error",
                file: "plots/share-error.svg",
                title: "Share error against kernel length, every round, against the 2 pp \
                        target"
                    .into(),
            },
        ],
    })
}
