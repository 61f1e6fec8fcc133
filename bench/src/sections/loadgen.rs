//! Running examples/loadgen for sections 5 and 6: where its processes run
//! (bare on a shared simulated GPU, or as clients of a fresh broker) and
//! what they print.

use gpufrac_bench::harness::{Artifacts, Broker, Finished, Kid, Scratch, sim_command};
use std::process::Command;
use std::time::Duration;

pub const MS: u64 = 1_000_000;
pub const US: u64 = 1_000;
/// The simulated engine's time slice and context switch, set explicitly on
/// every process so the targets that name "one quantum" mean the quantum
/// the engine ran with (an H100 with driver 580 measured ~2 ms, ~100 us).
pub const QUANTUM_NS: u64 = 2 * MS;
pub const SWITCH_NS: u64 = 100 * US;
/// Time for the processes to start, initialise and register before their
/// common window opens.
pub const LEAD_NS: u64 = 1000 * MS;

/// How many kernels a batch job keeps queued between synchronizes: about
/// 1 ms of work for short kernels (a training job keeps far more queued;
/// a shallow queue would leave the GPU idle at every wake-up), fewer for
/// long ones, because loadgen's GPU time includes its last batch, which
/// finishes after the window closes.
pub fn batch_depth(kernel_us: u64) -> usize {
    match kernel_us {
        0..=100 => 20,
        101..=10_000 => 2,
        _ => 1,
    }
}

/// Kernel length as the tables show it.
pub fn kernel_label(kernel_us: u64) -> String {
    if kernel_us >= 1000 {
        format!("{} ms", kernel_us / 1000)
    } else {
        format!("{kernel_us} us")
    }
}

/// Where the processes of one scenario run.
pub enum Place {
    /// No shim, no broker: the processes share one simulated GPU (a common
    /// state file) and its time-slicer alone arbitrates.
    Native(Scratch),
    /// Under the shim, clients of a broker at its default settings.
    Gpufrac(Broker),
}

impl Place {
    pub fn native(a: &Artifacts) -> Result<Place, String> {
        Ok(Place::Native(Scratch::new(a, "native")?))
    }

    /// A fresh broker per scenario: nothing one scenario's clients left in
    /// the scheduler (virtual times, class clocks) carries into the next.
    pub fn gpufrac(a: &Artifacts) -> Result<Place, String> {
        Ok(Place::Gpufrac(Broker::start(a, "16G", &[])?))
    }

    fn command(&self, a: &Artifacts) -> Command {
        let mut c = match self {
            Place::Native(dir) => {
                let mut c = sim_command(a, &a.loadgen, "16G", false);
                c.env("GPUFRAC_SIM_STATE", dir.0.join("sim-state"));
                c
            }
            Place::Gpufrac(b) => b.client(a, &a.loadgen),
        };
        c.env("GPUFRAC_SIM_QUANTUM_US", (QUANTUM_NS / US).to_string())
            .env("GPUFRAC_SIM_SWITCH_US", (SWITCH_NS / US).to_string());
        c
    }

    /// `loadgen batch` from `start` to `end`, with `env` added; with
    /// `trace_ms`, its GPU time sampled every that many ms as well.
    pub fn batch(
        &self,
        a: &Artifacts,
        kernel_us: u64,
        (start, end): (u64, u64),
        trace_ms: Option<u64>,
        env: &[(&str, &str)],
    ) -> Result<Kid, String> {
        let mut c = self.command(a);
        c.envs(env.iter().copied()).args([
            "batch".to_string(),
            kernel_us.to_string(),
            start.to_string(),
            end.to_string(),
            batch_depth(kernel_us).to_string(),
        ]);
        if let Some(t) = trace_ms {
            c.arg(t.to_string());
        }
        Kid::spawn(c, "loadgen batch")
    }

    /// `loadgen interactive`: `kernels` kernels of `kernel_us` every
    /// `period_us`, from `start` to `end`.
    pub fn interactive(
        &self,
        a: &Artifacts,
        (kernels, kernel_us, period_us): (usize, u64, u64),
        start: u64,
        end: u64,
        env: &[(&str, &str)],
    ) -> Result<Kid, String> {
        let mut c = self.command(a);
        c.envs(env.iter().copied()).args([
            "interactive".to_string(),
            kernels.to_string(),
            kernel_us.to_string(),
            period_us.to_string(),
            start.to_string(),
            end.to_string(),
            // Every request's latency, for the plots' distributions.
            "samples".to_string(),
        ]);
        Kid::spawn(c, "loadgen interactive")
    }

    /// What the broker runs with, from its status: (timeslice, in-flight
    /// bound), for the method text.
    pub fn broker_settings(&self) -> Option<(f64, f64)> {
        let Place::Gpufrac(b) = self else {
            return None;
        };
        let s = b.status().ok()?;
        Some((s["timeslice_ms"].as_f64()?, s["inflight_us"].as_f64()?))
    }
}

/// How long to give a loadgen process whose window ends `window_ns` after
/// `LEAD_NS`: its last batch may run past the end (one 120 ms kernel shared
/// with a neighbour), and a 2-CPU machine may be slow to start it.
pub fn limit(window_ns: u64) -> Duration {
    Duration::from_nanos(LEAD_NS + window_ns) + Duration::from_secs(30)
}

/// What `loadgen interactive` printed.
#[derive(Clone, Debug, Default)]
pub struct Latency {
    pub requests: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub missed: u64,
    /// Every request's latency, us, in the order sent.
    pub samples: Vec<u64>,
}

impl Latency {
    pub fn parse(out: &Finished) -> Result<Latency, String> {
        let n = |k: &str| out.num("interactive", k);
        Ok(Latency {
            requests: n("requests")? as u64,
            p50_us: n("p50_us")?,
            p99_us: n("p99_us")?,
            max_us: n("max_us")?,
            missed: n("missed")? as u64,
            samples: list(out, "latencies", "us")?,
        })
    }
}

/// A comma-separated list of numbers, `key=` of the `step` line.
fn list(out: &Finished, step: &str, key: &str) -> Result<Vec<u64>, String> {
    let kv = out.line(step)?;
    let v = kv
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .ok_or_else(|| format!("no {key}= on loadgen's `{step}` line"))?;
    v.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse()
                .map_err(|_| format!("loadgen's `{step}` {key}= holds {x:?}, not a number"))
        })
        .collect()
}

/// The GPU time `loadgen batch` ran from its window's start to each step
/// of its trace, ns, and the step in ms.
pub fn trace(out: &Finished) -> Result<(u64, Vec<u64>), String> {
    Ok((
        out.num("trace", "step_ms")? as u64,
        list(out, "trace", "executed_ns")?,
    ))
}

/// GPU time `loadgen batch` ran in its window, ns.
pub fn executed_ns(out: &Finished) -> Result<u64, String> {
    Ok(out.num("batch", "executed_ns")? as u64)
}

/// Median of the values in `v` (NaN when empty); the rounds of a figure.
pub fn med(v: impl IntoIterator<Item = f64>) -> f64 {
    gpufrac_bench::stats::median(&v.into_iter().collect::<Vec<_>>())
}
