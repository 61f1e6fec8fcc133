//! Connecting to the broker: the socket and the handshake, each attempt
//! within a deadline (a full accept queue or a stopped broker never
//! answers, and `connect` on a Unix socket would block with it), and the
//! one attempt `GPUFRAC_BROKER=required` makes in cuInit. A listener that
//! is not the broker (`net::believe`: not root, nor the owner of the
//! socket's directory) is told nothing and counts as no broker, so
//! `required` fails closed on it.

use gpufrac_common::config::{BrokerMode, ShimConfig};
use gpufrac_common::cuda::*;
use gpufrac_common::net;
use gpufrac_common::wire::{self, ClientMsg, Role, ServerMsg};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::time::{Duration, Instant};

/// Connecting and the handshake, per attempt of the client thread (which
/// retries every ~0.5 s anyway). A live broker answers in microseconds; a
/// full accept queue (a flood of idle connections) or a stopped broker
/// never does, and `connect` on a Unix socket would block with it.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The same for the one attempt `GPUFRAC_BROKER=required` makes in cuInit,
/// whose failure fails the process: more patience with a busy broker.
const REQUIRED_TIMEOUT: Duration = Duration::from_secs(5);

/// `GPUFRAC_BROKER=required`: called from cuInit; fails initialisation when
/// no broker answers within `REQUIRED_TIMEOUT`.
pub fn check_required(cfg: &ShimConfig) -> Result<(), u32> {
    // Frameworks call cuInit more than once; one successful check is enough.
    static CHECKED: AtomicBool = AtomicBool::new(false);
    if cfg.broker != BrokerMode::Required || CHECKED.load(Acquire) {
        return Ok(());
    }
    match connect(cfg, REQUIRED_TIMEOUT) {
        Ok(_) => {
            CHECKED.store(true, Release);
            Ok(())
        }
        Err(e) => {
            let hint = match e {
                ConnectFail::Silent(_) => "set GPUFRAC_BROKER=optional to run without it",
                ConnectFail::Other(_) => {
                    "start one with `gpufrac broker` or set GPUFRAC_BROKER=optional"
                }
                ConnectFail::NotTheBroker(_) => "this program does not start without its broker",
            };
            crate::log::write_line(format_args!(
                "GPUFRAC_BROKER=required but {}; {hint}",
                e.what(&cfg.socket)
            ));
            Err(CUDA_ERROR_SYSTEM_NOT_READY)
        }
    }
}

/// Why no session with the broker could be opened.
pub enum ConnectFail {
    /// It did not complete the handshake within this time: accept queue
    /// full, stopped, or wedged.
    Silent(Duration),
    /// Something else listens on the socket's path; nothing was sent to it.
    NotTheBroker(net::NotTheBroker),
    Other(String),
}

impl ConnectFail {
    /// "no broker at PATH (why)" or "the broker at PATH did not answer ...".
    pub fn what(&self, socket: &str) -> String {
        match self {
            ConnectFail::Silent(t) => format!(
                "the broker at {socket} did not answer within {} s (it may be overloaded or stopped)",
                t.as_secs()
            ),
            ConnectFail::NotTheBroker(e) => e.to_string(),
            ConnectFail::Other(e) => format!("no broker at {socket} ({e})"),
        }
    }
}

/// Connects and completes the handshake within `timeout`.
pub fn connect(cfg: &ShimConfig, timeout: Duration) -> Result<UnixStream, ConnectFail> {
    let deadline = Instant::now() + timeout;
    let fail = |e: std::io::Error| {
        if e.kind() == ErrorKind::TimedOut {
            ConnectFail::Silent(timeout)
        } else {
            ConnectFail::Other(e.to_string())
        }
    };
    let path = std::path::Path::new(&cfg.socket);
    let mut s = net::connect_unix(path, deadline).map_err(fail)?;
    net::believe(&s, path).map_err(ConnectFail::NotTheBroker)?;
    let mut buf = Vec::new();
    wire::encode_client(&ClientMsg::hello(std::process::id(), Role::Shim), &mut buf);
    // A fresh connection's send buffer is empty: this cannot block.
    s.write_all(&buf).map_err(fail)?;
    let mut inbuf = Vec::new();
    loop {
        match wire::decode_server(&inbuf) {
            Ok((ServerMsg::HelloOk { version }, _)) => match wire::accept_version(version) {
                Ok(_) => break,
                Err(why) => return Err(ConnectFail::Other(why)),
            },
            Ok((ServerMsg::Error { message, .. }, _)) => return Err(ConnectFail::Other(message)),
            Ok((other, _)) => {
                return Err(ConnectFail::Other(format!("unexpected answer {other:?}")));
            }
            Err(wire::DecodeError::Incomplete) => {}
            Err(e) => return Err(ConnectFail::Other(format!("bad frame from broker: {e}"))),
        }
        net::wait_for(&s, libc::POLLIN, deadline).map_err(fail)?;
        let mut tmp = [0u8; 4096];
        match s.read(&mut tmp) {
            Ok(0) => return Err(ConnectFail::Other("broker closed the connection".into())),
            Ok(n) => inbuf.extend_from_slice(&tmp[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(fail(e)),
        }
    }
    // The session reads only after ppoll says so; this is a backstop.
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(fail)?;
    Ok(s)
}
