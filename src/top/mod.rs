//! `gpufrac top`: a live, read-only view of the broker's status in the
//! terminal, refreshed once a second; `--once` prints one frame as text.
//!
//! Rooms: `model` (what is shown: the status, each process's history
//! since top opened, the rows as sorted and filtered), `cgroup` (the
//! container, pod or Slurm job of a process), `app` (the view's state and
//! the keys), `view` (drawing a frame with ratatui), `live` (the terminal
//! and the thread that asks the broker). It asks only for the status, as
//! `gpufrac status` does, so a user sees in it what status shows them.

mod app;
mod cgroup;
mod live;
mod model;
mod view;

#[cfg(test)]
mod tests;

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;
use ratatui::Terminal;
use ratatui::backend::TestBackend;

use crate::client::{Client, ConnectError};
use app::App;
use model::{Filter, Model, Sort, ViewOpts};

const TOP_EXAMPLES: &str = "\
Examples:
  gpufrac top
  gpufrac top --flat --sort mem
  gpufrac top --filter user:alice
  gpufrac top --once                 one frame as text, for scripts and bug reports
  gpufrac top --once --size 132x50

The header names the broker and its mode (plain time-slicing, MPS or MIG)
and counts GPUs, processes, queued requests and leases. Each GPU has a
strip: its memory as a bar (█ allocated through the shim, ▒ committed to
leases beyond that, ┃ where each lease's cap ends, · free) with the
figures, then its utilisation and a line of its history.

The process pane is a tree of users, their jobs and their processes
(`t` for a flat table): SHARE is the share of GPU time each should get
while busy and contended against the share it held over the last second,
`!` marking one off its target over the last 10 seconds; HISTORY is the
achieved share a second at a time, from the broker's ring of recent
samples for users and jobs and since top opened for processes; USED/CAP
is memory allocated through the shim against the cap, PEAK the most it
held, REF the allocations its cap refused; STATE is holding, waiting,
idle, revoking or hung (* when its queued work still drains), as in
gpufrac status --help. CONTAINER (or [..] in the tree) is the Docker or
Podman container, Kubernetes pod or Slurm job the process's cgroup names.

The queue pane lists requests of gpufrac run in queue order, with why
each waits: what it needs, what each GPU it could use has free and who
holds the rest.

Keys: q or Esc quit, ? help, ↑↓ or j/k move, Tab next pane, Enter the
selected item's detail and history, t tree/flat, s/S sort/reverse,
/ filter (user:NAME job:PID gpu:N class:high|normal|low, or words),
f freeze, u only yours.";

#[derive(Args, Debug)]
#[command(after_help = TOP_EXAMPLES)]
pub struct TopArgs {
    /// Print one frame as text and exit (no terminal needed).
    #[arg(long)]
    pub once: bool,
    /// With --once: the frame's size [default: the terminal's, else
    /// $COLUMNS x $LINES, else 80x24].
    #[arg(long, value_name = "COLSxROWS", value_parser = size, requires = "once")]
    pub size: Option<(u16, u16)>,
    /// A flat table of processes instead of the tree of users, jobs and
    /// processes.
    #[arg(long)]
    pub flat: bool,
    /// Order processes by pid, user, mem, peak, share or state.
    #[arg(long, value_name = "KEY", default_value = "pid", value_parser = Sort::parse)]
    pub sort: Sort,
    /// Reverse the order.
    #[arg(long)]
    pub reverse: bool,
    /// Show only what matches: user:NAME job:PID gpu:N class:CLASS, or
    /// words found in a command, user, job or container.
    #[arg(long, value_name = "FILTER", value_parser = Filter::parse)]
    pub filter: Option<Filter>,
    /// Only your own processes and requests.
    #[arg(long)]
    pub mine: bool,
    /// Broker socket [default: $GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

fn size(s: &str) -> Result<(u16, u16), String> {
    let bad = || format!("expected COLUMNSxROWS such as 80x24, not {s:?}");
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u16, u16) = (
        w.trim().parse().map_err(|_| bad())?,
        h.trim().parse().map_err(|_| bad())?,
    );
    if w == 0 || h == 0 || w > 1000 || h > 1000 {
        return Err(format!(
            "{s}: expected 1 to 1000 columns and rows, such as 80x24"
        ));
    }
    Ok((w, h))
}

pub fn main(args: TopArgs) -> u8 {
    let socket = crate::socket_path(args.socket.clone());
    let opts = ViewOpts {
        tree: !args.flat,
        sort: args.sort,
        reverse: args.reverse,
        filter: args.filter.clone().unwrap_or_default(),
        mine: args.mine,
        ..ViewOpts::default()
    };
    let result = if args.once {
        once(&socket, App::new(opts), args.size)
    } else if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        Err("the live view needs a terminal; gpufrac top --once prints one frame as text".into())
    } else {
        live::run(&socket, App::new(opts))
    };
    match result {
        Ok(()) => 0,
        Err(m) => {
            eprintln!("gpufrac top: {m}");
            1
        }
    }
}

/// The broker's status, or what to say when there is none.
fn fetch(
    client: &mut Option<Client>,
    socket: &std::path::Path,
) -> Result<gpufrac_common::status::Status, String> {
    if client.is_none() {
        *client = Some(Client::connect(socket).map_err(|e| match e {
            ConnectError::NoBroker => format!(
                "no broker at {}; {}",
                socket.display(),
                crate::client::start_hint(socket)
            ),
            ConnectError::Other(m) => m,
        })?);
    }
    let r = client
        .as_mut()
        .map(Client::status)
        .unwrap_or_else(|| Err("not connected".into()));
    if r.is_err() {
        // Connect afresh next time: this connection may be broken.
        *client = None;
    }
    r
}

/// `--once`: one status, one frame, as text.
fn once(socket: &std::path::Path, mut app: App, size: Option<(u16, u16)>) -> Result<(), String> {
    let mut model = Model::default();
    model.update(fetch(&mut None, socket)?);
    let (w, h) = size.unwrap_or_else(frame_size);
    let text = render_text(&model, &mut app, w, h);
    crate::print_stdout(&text)
}

/// The terminal's size, else $COLUMNS x $LINES, else 80x24.
fn frame_size() -> (u16, u16) {
    if let Ok((w, h)) = ratatui::crossterm::terminal::size()
        && w > 0
        && h > 0
        && std::io::stdout().is_terminal()
    {
        return (w, h);
    }
    let env = |k: &str, d: u16| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse::<u16>().ok())
            .filter(|&v| v > 0 && v <= 1000)
            .unwrap_or(d)
    };
    (env("COLUMNS", 80), env("LINES", 24))
}

/// A frame drawn into ratatui's test backend, as lines of text with no
/// trailing blanks.
pub fn render_text(model: &Model, app: &mut App, w: u16, h: u16) -> String {
    let mut term = match Terminal::new(TestBackend::new(w, h)) {
        Ok(t) => t,
        Err(e) => return format!("cannot draw: {e}\n"),
    };
    if let Err(e) = term.draw(|f| view::draw(f, model, app)) {
        return format!("cannot draw: {e}\n");
    }
    let buf = term.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        let mut line = String::new();
        for x in 0..buf.area.width {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
