//! The live view: the terminal in raw mode on its alternate screen, keys
//! read as they come, and the broker asked once a second on a thread of
//! its own, so that a slow or stopped broker never stops the keys (it says
//! so in the last line instead). The terminal is given back as it was on
//! every way out: `q`, Esc, Ctrl-C, an error, a panic.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use gpufrac_common::status::Status;
use ratatui::crossterm::event::{self, Event, KeyEventKind};

use super::app::App;
use super::model::Model;

/// How often the broker is asked.
const EVERY: Duration = Duration::from_secs(1);

/// Set by SIGTERM, SIGHUP or SIGINT: the loop leaves as on `q`, so that a
/// `kill` gives the terminal back too (in raw mode Ctrl-C is a key).
static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::Relaxed);
}

pub fn run(socket: &Path, mut app: App) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let (stop, stopped) = mpsc::channel::<()>();
    let socket = socket.to_owned();
    std::thread::Builder::new()
        .name("status".into())
        .spawn(move || ask(&socket, &tx, &stopped))
        .map_err(|e| format!("cannot start the status thread: {e}"))?;
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    // Raw mode and the alternate screen, with a panic hook that restores
    // both before the panic is printed.
    let mut term = ratatui::try_init().map_err(|e| format!("cannot set up the terminal: {e}"))?;
    let result = view_loop(&mut term, &mut app, &rx);
    ratatui::restore();
    drop(stop);
    result
}

fn view_loop(
    term: &mut ratatui::DefaultTerminal,
    app: &mut App,
    rx: &Receiver<Result<Status, String>>,
) -> Result<(), String> {
    let mut model = Model::default();
    let mut pending: Option<Status> = None;
    loop {
        while let Ok(r) = rx.try_recv() {
            match r {
                Ok(st) => {
                    pending = Some(st);
                    if app
                        .message
                        .as_deref()
                        .is_some_and(|m| m.starts_with("broker: "))
                    {
                        app.message = None;
                    }
                }
                Err(e) => app.message = Some(format!("broker: {e}")),
            }
        }
        if !app.frozen
            && let Some(st) = pending.take()
        {
            model.update(st);
        }
        term.draw(|f| super::view::draw(f, &model, app))
            .map_err(|e| format!("cannot draw: {e}"))?;
        // Keys at once; otherwise a look for a new status four times a
        // second.
        if event::poll(Duration::from_millis(250)).map_err(|e| format!("cannot read keys: {e}"))? {
            match event::read().map_err(|e| format!("cannot read keys: {e}"))? {
                Event::Key(k) if k.kind != KeyEventKind::Release => app.key(k, &model),
                _ => {}
            }
        }
        if app.quit || SIGNALLED.load(Ordering::Relaxed) {
            return Ok(());
        }
    }
}

/// Asks the broker for its status every `EVERY` until `stop` is dropped,
/// over one connection, made again after a failure.
///
/// It also watches the terminal: once that is gone (its window closed, its
/// ssh session dropped), the process ends. SIGHUP says so only to the
/// session's leader, so a top started by a script (`sh -c 'gpufrac top;
/// …'`) is not told; and the key reader, which then reads end-of-file at
/// once, goes round on it inside `event::poll` without returning (a core
/// busy for ever, the loop's own checks never reached). No terminal is
/// left to give back.
fn ask(socket: &Path, tx: &Sender<Result<Status, String>>, stop: &Receiver<()>) {
    let mut client = None;
    loop {
        if hung_up() {
            std::process::exit(0);
        }
        let started = Instant::now();
        if tx.send(super::fetch(&mut client, socket)).is_err() {
            return;
        }
        match stop.recv_timeout(EVERY.saturating_sub(started.elapsed())) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

/// The terminal drawn to has hung up.
fn hung_up() -> bool {
    let mut p = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}
