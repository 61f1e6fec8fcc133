//! The end of a job: one line on stderr of what it had (how long it
//! queued and held its lease, its GPU time against what it was owed, its
//! peak memory against its cap, the allocations refused), asked of the
//! broker just before the lease ends; `--report FILE` writes the same as
//! JSON, with the command's exit code and the run's own wall time.

use std::path::Path;
use std::time::Instant;

use gpufrac_common::size::format_size;
use gpufrac_common::status::JobSummary;

use crate::client::Client;
use crate::status::seconds;

/// The part of the time held: GPU time or what was owed over it.
fn ratio(s: f64, held: f64) -> Option<f64> {
    (held > 0.0).then(|| (s / held).clamp(0.0, 1.0))
}

/// The one line, from the broker's figures.
pub(super) fn line(s: &JobSummary, code: u8) -> String {
    let pct = |r: Option<f64>| r.map_or("-".into(), |r| format!("{:.0}%", r * 100.0));
    let mem = match s.mem_cap {
        Some(cap) => format!(
            "peak {} of its {} cap",
            format_size(s.peak_mem),
            format_size(cap)
        ),
        None => format!("peak {}", format_size(s.peak_mem)),
    };
    format!(
        "job {} ended (exit {code}): held {} after {} queued; GPU {} ({} of the time held, {} owed); {mem}; {} refused",
        s.job,
        seconds(s.held_s),
        seconds(s.queued_s),
        crate::status::gpu_seconds(s.gpu_s),
        pct(ratio(s.gpu_s, s.held_s)),
        pct(ratio(s.owed_s, s.held_s)),
        match s.refusals {
            1 => "1 allocation".to_owned(),
            n => format!("{n} allocations"),
        }
    )
}

/// Says how the job went and writes the report: `token`, the job's
/// (None: no broker, nothing measured).
pub(super) fn finish(
    socket: &Path,
    token: Option<u64>,
    report: Option<&Path>,
    started: Instant,
    code: u8,
) {
    let got = token.map(|t| {
        Client::connect(socket)
            .map_err(|e| match e {
                crate::client::ConnectError::NoBroker => "it no longer answers".to_owned(),
                crate::client::ConnectError::Other(m) => m,
            })
            .and_then(|mut c| c.summary(t))
    });
    let (summary, missing) = match got {
        Some(Ok(s)) => (Some(s), None),
        Some(Err(e)) => (None, Some(format!("the broker could not say: {e}"))),
        None => (None, Some("no broker: nothing was measured".into())),
    };
    match (&summary, &missing) {
        (Some(s), _) => eprintln!("gpufrac run: {}", line(s, code)),
        (None, Some(why)) if token.is_some() => {
            eprintln!("gpufrac run: the job ended (exit {code}); no summary: {why}")
        }
        _ => {}
    }
    let Some(path) = report else {
        return;
    };
    // The broker's figures, with the command's exit code, the run's wall
    // time and the two ratios of the line (or why the figures are missing).
    let mut r = summary
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_else(|| serde_json::json!({}));
    r["exit_code"] = code.into();
    r["wall_s"] = started.elapsed().as_secs_f64().into();
    if let Some(s) = &summary {
        r["achieved_ratio"] = ratio(s.gpu_s, s.held_s).into();
        r["owed_ratio"] = ratio(s.owed_s, s.held_s).into();
    }
    if let Some(why) = missing {
        r["missing"] = why.into();
    }
    let text = serde_json::to_string_pretty(&r).unwrap_or_default() + "\n";
    if let Err(e) = std::fs::write(path, text) {
        eprintln!(
            "gpufrac run: cannot write the report to {}: {e}",
            path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_each_figure() {
        let s = JobSummary {
            job: 4242,
            queued_s: 8.2,
            held_s: 1204.0,
            gpu_s: 723.0,
            owed_s: 698.3,
            peak_mem: 14 << 30,
            mem_cap: Some(16 << 30),
            refusals: 3,
            ..JobSummary::default()
        };
        assert_eq!(
            line(&s, 0),
            "job 4242 ended (exit 0): held 20m04s after 8s queued; GPU 12m03s (60% of the time \
             held, 58% owed); peak 14.00 GiB of its 16.00 GiB cap; 3 allocations refused"
        );
        let none = JobSummary {
            refusals: 1,
            ..JobSummary::default()
        };
        assert!(
            line(&none, 1)
                .ends_with("GPU 0.0s (- of the time held, - owed); peak 0 B; 1 allocation refused")
        );
    }
}
