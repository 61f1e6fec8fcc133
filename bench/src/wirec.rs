//! A blocking client of the broker protocol (gpufrac_common::wire), for
//! status queries and for the scale section's simulated shims.

use gpufrac_common::wire::{self, ClientMsg, DecodeError, Role, ServerMsg};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub struct WireClient {
    s: UnixStream,
    buf: Vec<u8>,
    out: Vec<u8>,
}

impl WireClient {
    /// Connects and completes the handshake as `role`.
    pub fn connect(path: &Path, role: Role) -> Result<WireClient, String> {
        WireClient::open(path, role, None)
    }

    /// Connects as `role` with `first` in the same write as the Hello, and
    /// completes the handshake, as `gpufrac run` sends its lease request
    /// and `gpufrac status` its first page: `first`'s answer is read next.
    pub fn connect_asking(
        path: &Path,
        role: Role,
        first: &ClientMsg,
    ) -> Result<WireClient, String> {
        WireClient::open(path, role, Some(first))
    }

    fn open(path: &Path, role: Role, first: Option<&ClientMsg>) -> Result<WireClient, String> {
        let s =
            UnixStream::connect(path).map_err(|e| format!("connect to {}: {e}", path.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let mut c = WireClient {
            s,
            buf: Vec::new(),
            out: Vec::with_capacity(256),
        };
        wire::encode_client(&ClientMsg::hello(std::process::id(), role), &mut c.out);
        if let Some(m) = first {
            wire::encode_client(m, &mut c.out);
        }
        c.s.write_all(&c.out).map_err(|e| e.to_string())?;
        match c.recv()? {
            ServerMsg::HelloOk { .. } => Ok(c),
            other => Err(format!("expected HelloOk, got {other:?}")),
        }
    }

    pub fn set_timeout(&self, d: Duration) {
        let _ = self.s.set_read_timeout(Some(d));
    }

    pub fn send(&mut self, m: &ClientMsg) -> Result<(), String> {
        self.out.clear();
        wire::encode_client(m, &mut self.out);
        self.s.write_all(&self.out).map_err(|e| e.to_string())
    }

    /// Next message; an error on timeout, a closed connection or a bad frame.
    pub fn recv(&mut self) -> Result<ServerMsg, String> {
        loop {
            match wire::decode_server(&self.buf) {
                Ok((m, n)) => {
                    self.buf.drain(..n);
                    return Ok(m);
                }
                Err(DecodeError::Incomplete) => {}
                Err(e) => return Err(format!("bad frame from the broker: {e}")),
            }
            let mut tmp = [0u8; 8192];
            match self.s.read(&mut tmp) {
                Ok(0) => return Err("the broker closed the connection".into()),
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Reads what has arrived without waiting: how many messages.
    pub fn drain(&mut self) -> Result<usize, String> {
        self.s.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut tmp = [0u8; 8192];
        let read = loop {
            match self.s.read(&mut tmp) {
                Ok(0) => break Err("the broker closed the connection".to_string()),
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break Ok(()),
                Err(e) => break Err(e.to_string()),
            }
        };
        self.s.set_nonblocking(false).map_err(|e| e.to_string())?;
        read?;
        let mut n = 0;
        while let Ok((_, len)) = wire::decode_server(&self.buf) {
            self.buf.drain(..len);
            n += 1;
        }
        Ok(n)
    }

    /// The broker's status document.
    pub fn status(&mut self) -> Result<serde_json::Value, String> {
        self.send(&ClientMsg::Status { from: 0 })?;
        loop {
            match self.recv()? {
                ServerMsg::StatusReply { json } => {
                    return serde_json::from_str(&json).map_err(|e| e.to_string());
                }
                ServerMsg::Error { message, .. } => return Err(message),
                _ => {}
            }
        }
    }
}

/// One-shot status query.
pub fn status(socket: &Path) -> Result<serde_json::Value, String> {
    WireClient::connect(socket, Role::Cli)?.status()
}

pub use gpufrac_common::wire::parse_uuid;
