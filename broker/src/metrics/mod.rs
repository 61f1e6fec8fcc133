//! Prometheus metrics over HTTP (`--metrics ADDR`). The event loop hands
//! over a snapshot (the status and the core's counters) at most twice a
//! second and never waits for this room: the snapshot goes through a
//! watch channel to a thread of its own, which folds it into what is kept
//! between snapshots (`tally`), renders the text when scraped (`render`,
//! `text`) and serves it (`http`). Every family is listed in
//! docs/metrics.md.
//!
//! Rooms: `http` (the endpoint and its limits), `board` (what the thread
//! keeps between snapshots and scrapes), `render` (the families),
//! `tally` (bounded labels, counters that outlive processes), `text` (the
//! exposition format), `host` (user names, the broker's own `process_*`).

mod board;
mod host;
mod http;
mod render;
mod tally;
mod text;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tracing::info;

pub use http::TOTAL;
pub use render::Snapshot;

use crate::stats::Stats;
use crate::status::Status;
use board::Board;

/// The loop's end: `publish` replaces the snapshot the metrics thread
/// works from, and returns at once.
#[derive(Clone)]
pub struct Feed(watch::Sender<Option<Arc<Snapshot>>>);

impl Feed {
    pub fn publish(&self, at: u64, status: Status, stats: Stats) {
        let wall = wall_at(at);
        self.0.send_replace(Some(Arc::new(Snapshot {
            at,
            wall,
            status,
            stats,
        })));
    }
}

/// Unix seconds at `at` (monotonic ns). The offset between the two clocks
/// is taken once: a start time made of it does not move between
/// snapshots (a time since, made anew each time, would).
pub fn wall_at(at: u64) -> f64 {
    static OFFSET: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let offset = *OFFSET.get_or_init(|| {
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        unix - gpufrac_common::clock::mono_ns() as f64 / 1e9
    });
    offset + at as f64 / 1e9
}

/// The address `--metrics` names: HOST:PORT as given, or a port alone
/// (`9400`, `:9400`) on loopback, 127.0.0.1:PORT, since the endpoint
/// answers anyone who can reach it.
pub fn address(arg: &str) -> Result<String, String> {
    if let Ok(port) = arg.strip_prefix(':').unwrap_or(arg).parse::<u16>() {
        return Ok(format!("127.0.0.1:{port}"));
    }
    if arg.parse::<SocketAddr>().is_ok()
        || std::net::ToSocketAddrs::to_socket_addrs(arg).is_ok_and(|mut a| a.next().is_some())
    {
        return Ok(arg.to_owned());
    }
    Err(format!(
        "--metrics {arg}: not an address; give a port (served on 127.0.0.1) or HOST:PORT, \
         e.g. --metrics 9400, or --metrics 0.0.0.0:9400 to serve every interface"
    ))
}

/// Serves metrics at `addr` (HOST:PORT; a port of 0 is chosen by the
/// kernel) from a thread of its own. Returns the address bound and the
/// loop's end of the feed.
pub fn serve(addr: &str) -> Result<(SocketAddr, Feed), String> {
    serve_with(addr, host::user_name)
}

fn serve_with(
    addr: &str,
    name_of: fn(u32) -> Option<String>,
) -> Result<(SocketAddr, Feed), String> {
    let (tx, mut rx) = watch::channel::<Option<Arc<Snapshot>>>(None);
    let board = Arc::new(Mutex::new(Board::new(name_of)));
    let b = board.clone();
    let fold = async move {
        while rx.changed().await.is_ok() {
            let snap = rx.borrow_and_update().clone();
            if let Some(s) = snap {
                b.lock().unwrap_or_else(|e| e.into_inner()).fold(s);
            }
        }
    };
    let bound = http::spawn(addr, board, fold)?;
    info!(%bound, "serving Prometheus metrics at /metrics");
    Ok((bound, Feed(tx)))
}

#[cfg(test)]
mod tests;
