//! What the metrics thread keeps: the latest snapshot, the tally made of
//! all of them, the text rendered from them (until the next snapshot) and
//! what the endpoint closed.

use std::sync::Arc;

use super::host;
use super::render::{self, Snapshot};
use super::tally::Tally;
use super::text::{Family, Kind};

/// Why the endpoint closed connections before their answer.
#[derive(Clone, Copy, Debug, Default)]
pub struct Closed {
    /// Past the deadline.
    pub deadline: u64,
    /// Made room for a newer connection of the same peer, or of anyone
    /// while all connections were taken.
    pub evicted: u64,
    /// At a limit with nothing to evict: every connection held was being
    /// answered.
    pub refused: u64,
}

/// A snapshot older than this says the broker's loop is stuck.
const LIVE_WITHIN_S: f64 = 10.0;

pub struct Board {
    latest: Arc<Snapshot>,
    tally: Tally,
    text: Option<Arc<str>>,
    pub closed: Closed,
}

impl Board {
    pub fn new(name_of: fn(u32) -> Option<String>) -> Board {
        Board {
            latest: Arc::default(),
            tally: Tally::new(name_of),
            text: None,
            closed: Closed::default(),
        }
    }

    pub fn fold(&mut self, snap: Arc<Snapshot>) {
        self.tally.fold(snap.at, &snap.status);
        self.tally.refused(snap.at, &snap.stats);
        self.latest = snap;
        self.text = None;
    }

    /// Whether the broker's event loop still hands snapshots over (it does
    /// twice a second): Ok with the snapshot's age, or why not. `now`:
    /// monotonic ns.
    pub fn live(&self, now: u64) -> Result<String, String> {
        if self.latest.at == 0 {
            return Err("starting: no snapshot of the broker yet\n".into());
        }
        let age = now.saturating_sub(self.latest.at) as f64 / 1e9;
        if age > LIVE_WITHIN_S {
            return Err(format!(
                "the broker's event loop has handed over nothing for {age:.0} s (it does \
                 twice a second): it is stuck\n"
            ));
        }
        Ok(format!("ok: last snapshot {age:.1} s ago\n"))
    }

    /// Whether the broker serves: it has started its loop (a snapshot
    /// came), so its socket is bound and answers.
    pub fn ready(&self) -> Result<String, String> {
        if self.latest.at == 0 {
            return Err("starting: the broker's loop has not run yet\n".into());
        }
        Ok(match &self.latest.status.recovery {
            Some(r) => format!("ok, recovering: {r}\n"),
            None => "ok\n".into(),
        })
    }

    /// The body of a scrape: what the snapshot says, rendered once per
    /// snapshot, then the endpoint's and the process's own figures.
    pub fn text(&mut self) -> String {
        let base = match &self.text {
            Some(t) => t.clone(),
            None => {
                let mut o = String::new();
                for f in render::families(&self.latest, &self.tally) {
                    f.write(&mut o);
                }
                let t: Arc<str> = o.into();
                self.text = Some(t.clone());
                t
            }
        };
        let mut o = String::from(&*base);
        endpoint(&self.closed).write(&mut o);
        for f in host::process_families() {
            f.write(&mut o);
        }
        o
    }
}

fn endpoint(c: &Closed) -> Family {
    let mut f = Family::new(
        "gpufrac_metrics_connections_closed_total",
        Kind::Counter,
        "Connections to this endpoint closed before their answer: past the per-request \
         deadline, evicted to make room for a newer one, or refused at a limit.",
    );
    for (why, n) in [
        ("deadline", c.deadline),
        ("evicted", c.evicted),
        ("refused", c.refused),
    ] {
        f.add(vec![("reason", why.into())], n as f64);
    }
    f
}
