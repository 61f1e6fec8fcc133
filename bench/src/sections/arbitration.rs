//! Section 3: how well the broker splits one simulated GPU, what it costs
//! in GPU utilisation against free contention, and what one hand-over costs.

use super::f;
use gpufrac_bench::clock::mono_ns;
use gpufrac_bench::harness::{Artifacts, Broker, Kid, Scratch, sim_command};
use gpufrac_bench::report::{Check, Section, Table};
use gpufrac_bench::stats::median;
use std::path::Path;
use std::time::Duration;

const MS: u64 = 1_000_000;
const KERNEL_NS: u64 = MS;
const BATCH: usize = 2;
/// Time for the processes to start, initialise and register before the
/// common window opens.
const LEAD_NS: u64 = 1200 * MS;

const SHARE_TARGET_PP: f64 = 2.0;
const UTIL_TARGET: f64 = 0.95;
const SOLO_TARGET: f64 = 0.99;

struct Scenario {
    name: &'static str,
    shares: &'static [Option<&'static str>],
    targets: &'static [f64],
}

const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "2 processes, 50/50",
        shares: &[Some("50%"), Some("50%")],
        targets: &[0.5, 0.5],
    },
    Scenario {
        name: "2 processes, 70/30",
        shares: &[Some("70%"), Some("30%")],
        targets: &[0.7, 0.3],
    },
    Scenario {
        name: "3 processes, 1:1:2",
        shares: &[Some("25"), Some("25"), Some("50")],
        targets: &[0.25, 0.25, 0.5],
    },
    Scenario {
        name: "solo",
        shares: &[None],
        targets: &[1.0],
    },
];

/// Totals over the rounds of one (scenario, mode).
#[derive(Default, Clone)]
struct Tally {
    kernels: Vec<u64>,
    stalls: u64,
    window_ns: u64,
    /// Busy fraction of each round.
    rounds: Vec<f64>,
}

impl Tally {
    fn add(&mut self, kernels: &[u64], stalls: u64, window_ns: u64) {
        if self.kernels.is_empty() {
            self.kernels = vec![0; kernels.len()];
        }
        for (t, k) in self.kernels.iter_mut().zip(kernels) {
            *t += k;
        }
        self.stalls += stalls;
        self.window_ns += window_ns;
        self.rounds
            .push((kernels.iter().sum::<u64>() * KERNEL_NS) as f64 / window_ns.max(1) as f64);
    }

    /// The median round's busy fraction: one round disturbed by the machine
    /// (a stalled VM, a neighbour's burst) does not carry the figure.
    fn busy(&self) -> f64 {
        median(&self.rounds)
    }

    /// Every round's busy fraction, in %.
    fn per_round(&self) -> String {
        self.rounds
            .iter()
            .map(|b| f(b * 100.0, 1))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    fn shares(&self) -> Vec<f64> {
        let total = self.kernels.iter().sum::<u64>().max(1) as f64;
        self.kernels.iter().map(|&k| k as f64 / total).collect()
    }

    fn switches_per_s(&self) -> f64 {
        self.stalls as f64 / (self.window_ns as f64 / 1e9)
    }
}

/// One contention run: a spinner per share, in a common window. With a
/// broker the processes are its clients; without, they run under the shim
/// with GPUFRAC_BROKER=off on `state`, contending freely on the engine.
fn contend(
    a: &Artifacts,
    broker: Option<&Broker>,
    state: &Path,
    shares: &[Option<&str>],
    window_ns: u64,
) -> Result<(Vec<u64>, u64), String> {
    let start = mono_ns() + LEAD_NS;
    let end = start + window_ns;
    let mut kids = Vec::new();
    for share in shares {
        let mut cmd = match broker {
            Some(b) => {
                let mut c = b.client(a, &a.hotloop);
                if let Some(s) = share {
                    c.env("GPU_COMPUTE_SHARE", s);
                }
                c
            }
            None => {
                let mut c = sim_command(a, &a.hotloop, "16G", true);
                c.env("GPUFRAC_SIM_STATE", state);
                c
            }
        };
        cmd.args([
            "spin".to_string(),
            start.to_string(),
            end.to_string(),
            KERNEL_NS.to_string(),
            BATCH.to_string(),
        ]);
        kids.push(Kid::spawn(cmd, "gpufrac-hotloop spin")?);
    }
    let limit = Duration::from_nanos(LEAD_NS + window_ns) + Duration::from_secs(20);
    let mut kernels = Vec::new();
    let mut stalls = 0;
    for k in kids {
        let out = k.finish(limit)?;
        kernels.push(out.num("spin", "kernels")? as u64);
        stalls += out.num("spin", "stalls")? as u64;
    }
    Ok((kernels, stalls))
}

pub fn run(a: &Artifacts, quick: bool) -> Result<Section, String> {
    let (rounds, window_ns) = if quick {
        (1, 3000 * MS)
    } else {
        (3, 3500 * MS)
    };
    let b50 = Broker::start(a, "16G", &["--timeslice", "50ms"])?;
    let b10 = Broker::start(a, "16G", &["--timeslice", "10ms"])?;
    let dir = Scratch::new(a, "arbitration")?;
    let free_state = dir.0.join("sim-state");
    // [scenario] -> (broker 50 ms, no broker); plus 50/50 at 10 ms.
    let mut with = vec![Tally::default(); SCENARIOS.len()];
    let mut without = vec![Tally::default(); SCENARIOS.len()];
    let mut at10 = Tally::default();
    for r in 0..rounds {
        for (i, sc) in SCENARIOS.iter().enumerate() {
            // Alternate which mode goes first.
            for k in 0..2 {
                if (k + r) % 2 == 0 {
                    let (kern, st) = contend(a, Some(&b50), &free_state, sc.shares, window_ns)?;
                    with[i].add(&kern, st, window_ns);
                } else {
                    let (kern, st) = contend(a, None, &free_state, sc.shares, window_ns)?;
                    without[i].add(&kern, st, window_ns);
                }
            }
            if i == 0 {
                let (kern, st) = contend(a, Some(&b10), &free_state, sc.shares, window_ns)?;
                at10.add(&kern, st, window_ns);
            }
        }
    }
    drop((b50, b10));

    let mut t = Table::new(
        &format!(
            "{rounds} round(s) of {:.0} s per scenario and mode, 1 ms kernels, batch {BATCH}, 50 ms timeslice",
            window_ns as f64 / 1e9
        ),
        &[
            "scenario",
            "target shares %",
            "achieved %",
            "max error pp",
            "busy, broker",
            "busy, no broker",
            "utilisation ratio",
        ],
    );
    let mut rounds_t = Table::new(
        "busy fraction of every round, % (the table above uses the median round)",
        &["scenario", "broker", "no broker"],
    );
    for (i, sc) in SCENARIOS.iter().enumerate() {
        rounds_t.row(vec![
            sc.name.into(),
            with[i].per_round(),
            without[i].per_round(),
        ]);
    }
    rounds_t.row(vec![
        "2 processes, 50/50, 10 ms slices".into(),
        at10.per_round(),
        "–".into(),
    ]);
    let mut checks = Vec::new();
    for (i, sc) in SCENARIOS.iter().enumerate() {
        let got = with[i].shares();
        let err = got
            .iter()
            .zip(sc.targets)
            .map(|(g, t)| (g - t).abs() * 100.0)
            .fold(0.0, f64::max);
        let ratio = with[i].busy() / without[i].busy();
        let pct = |v: &[f64]| {
            v.iter()
                .map(|x| f(x * 100.0, 1))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        t.row(vec![
            sc.name.into(),
            pct(sc.targets),
            pct(&got),
            f(err, 2),
            format!("{}%", f(with[i].busy() * 100.0, 2)),
            format!("{}%", f(without[i].busy() * 100.0, 2)),
            format!("{}%", f(ratio * 100.0, 2)),
        ]);
        if sc.targets.len() > 1 {
            checks.push(Check::new(
                &format!("{}: share error", sc.name),
                format!("{} pp", f(err, 2)),
                &format!("≤ {SHARE_TARGET_PP} pp"),
                err <= SHARE_TARGET_PP,
            ));
            checks.push(Check::new(
                &format!("{}: utilisation vs no broker", sc.name),
                format!("{}%", f(ratio * 100.0, 2)),
                &format!("≥ {:.0}%", UTIL_TARGET * 100.0),
                ratio >= UTIL_TARGET,
            ));
        } else {
            checks.push(Check::new(
                &format!("{}: utilisation vs no broker", sc.name),
                format!("{}%", f(ratio * 100.0, 2)),
                &format!("≥ {:.0}%", SOLO_TARGET * 100.0),
                ratio >= SOLO_TARGET,
            ));
        }
    }

    // Switch cost: the 50/50 pair at 50 ms and at 10 ms slices. A switch
    // is a launch that blocked in the compute gate (> 200 us) waiting for
    // the timeslice: one per slice handed to the process.
    // What a holder's own gaps (its synchronize wake-ups between batches)
    // cost, with no switch at all: the solo run under the broker.
    let solo = with[3].busy();
    let mut sw = Table::new(
        "switch cost, 2 processes 50/50 (switches counted client-side: launches that blocked > 200 us at the gate)",
        &[
            "timeslice",
            "busy",
            "busy, solo",
            "switches/s",
            "mean turn",
            "GPU idle per switch",
        ],
    );
    let mut long_turns = Vec::new();
    for (label, slice_ms, tally) in [("50 ms", 50.0, &with[0]), ("10 ms", 10.0, &at10)] {
        let rate = tally.switches_per_s();
        let us = (solo - tally.busy()) / rate * 1e6;
        // Every turn ends in a switch: the mean turn is the inverse rate.
        let turn_ms = 1e3 / rate;
        if turn_ms > 1.5 * slice_ms {
            long_turns.push(format!("{} ms at {label}", f(turn_ms, 0)));
        }
        sw.row(vec![
            label.into(),
            format!("{}%", f(tally.busy() * 100.0, 2)),
            format!("{}%", f(solo * 100.0, 2)),
            f(rate, 1),
            format!("{} ms", f(turn_ms, 1)),
            format!("{} us", f(us, 0)),
        ]);
    }
    // The marginal cost: extra busy lost per extra switch between the two
    // slice lengths, which cancels whatever does not scale with the number
    // of switches.
    let extra_rate = at10.switches_per_s() - with[0].switches_per_s();
    let marginal = (with[0].busy() - at10.busy()) / extra_rate * 1e6;
    let mut notes = vec![
        format!(
            "GPU idle per switch = (busy of the solo run under the broker − busy of the pair) ÷ \
             switches/s: the solo run has the same synchronize gaps inside a turn but no \
             hand-over, so what is left is the hand-over (revoke → drain → release → grant → \
             first launch). Marginal estimate, (busy at 50 ms − busy at 10 ms) ÷ the extra \
             switches/s: {} us.",
            f(marginal, 0)
        ),
        "Utilisation against free contention also loses what exclusive turns cannot hide: \
         without a broker one process's kernels fill the other's gaps (its synchronize \
         wake-ups); under a timeslice the holder's own gaps leave the GPU idle — the solo row \
         shows their size on this machine."
            .into(),
        "Shares are each process's completed kernel time inside the window over the total; \
         busy is the total completed kernel time over the window. Without a broker the shares \
         are whatever free contention gives (roughly equal), so only its busy fraction is used."
            .into(),
    ];
    if !long_turns.is_empty() {
        notes.push(format!(
            "Mean turns longer than the timeslice ({}): turns flip between one and two \
             timeslices. At a holder's deadline its virtual time often trails the waiter's by \
             the waiter's last drain (~1 ms), so the scheduler (broker/src/sched/grants.rs, `step`, \
             the `best.is_some_and(|b| vtime >= b)` test) extends the slice by a whole \
             timeslice instead of revoking. Shares stay fair; the wait a waiter sees doubles.",
            long_turns.join(", ")
        ));
    }
    Ok(Section {
        key: "arbitration",
        title: "3. Arbitration quality".into(),
        method: vec![format!(
            "Each scenario starts one `gpufrac-hotloop spin` per process (the probe's `spin`: \
             1 ms kernels, `cuCtxSynchronize` every {BATCH} launches, kernels counted when they \
             complete inside a common CLOCK_MONOTONIC window of {:.0} s, opened {:.1} s after \
             the processes start). *broker*: the processes are clients of a `gpufrac broker \
             --timeslice 50ms` with GPU_COMPUTE_SHARE set; *no broker*: the same processes \
             under the shim with GPUFRAC_BROKER=off, launching freely onto the one shared \
             simulated engine. Broker and no-broker runs alternate, {rounds} round(s) each; \
             shares pool the kernels of all rounds; busy fractions are the \
             median round's.",
            window_ns as f64 / 1e9,
            LEAD_NS as f64 / 1e9
        )],
        tables: vec![t, sw, rounds_t],
        checks,
        notes,
        error: None,
        steal_pct: None,
        ..Section::default()
    })
}
