//! One lease held with the broker: a connection that books the lease
//! pinned to GPUs already chosen (by the kubelet, or by the scheduler for a
//! DRA claim) under a token the plugin chose and already handed to the
//! containers, names it for status, and holds it for as long as the task
//! lives, booking it again after the broker restarts. The device plugin
//! (`leases`) and the DRA plugin (`dra`) each hold their leases this way.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufrac_common::size::format_size;
use gpufrac_common::wire::{
    self, ClientMsg, DecodeError, LeaseReq, Pin, Role, ServerMsg, parse_uuid,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::watch;

/// Reconnecting to a broker that is away starts this soon and backs off to
/// `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(30);
/// What the broker's handshake gets.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// What a lease is called in the broker's status: the pod it is
/// (`namespace/name`) and a label in place of a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseName {
    pub pod: String,
    pub label: String,
}

/// A lease to hold.
#[derive(Clone, Debug)]
pub struct Lease {
    /// Each GPU's UUID and the memory booked on it.
    pub pins: Vec<(String, u64)>,
    /// The job's compute share, percent.
    pub compute: Option<f64>,
    /// The lease's command in status until it is named.
    pub unnamed: String,
    /// What the log calls it ("the allocation of 4 devices …").
    pub what: String,
}

/// "4.00 GiB on GPU-…, 2.00 GiB on GPU-…", for the log.
pub fn describe_pins(pins: &[(String, u64)]) -> String {
    pins.iter()
        .map(|(uuid, mem)| format!("{} on {uuid}", format_size(*mem)))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Lease {
    /// What the log calls it. Pod, claim and container names are the
    /// API server's (DNS names, nothing hidden in them); escaped all the
    /// same, by the rule every gpufrac log line keeps.
    fn said(&self, name: Option<&LeaseName>) -> String {
        let s = match name {
            Some(n) => format!("{} of pod {} ({})", self.what, n.pod, n.label),
            None => self.what.clone(),
        };
        gpufrac_common::text::shown(&s).into_owned()
    }
}

/// Holds one lease for as long as the task lives, booking it again after
/// the broker restarts. `resume`: the lease was booked by an earlier run
/// of the plugin, whose connection is gone; it is taken back where it was
/// if the broker still knows it, else booked anew under the same token.
pub async fn hold(
    socket: PathBuf,
    lease: Lease,
    token: u64,
    mut names: watch::Receiver<Option<LeaseName>>,
    mut resume: bool,
) {
    let mut backoff = FIRST_RETRY;
    let mut said: Option<String> = None;
    loop {
        let mut booked = false;
        let e = session(&socket, &lease, token, &mut names, &mut resume, &mut booked).await;
        if booked {
            // It held: the next trouble is news, and worth a quick retry.
            said = None;
            backoff = FIRST_RETRY;
        }
        // Said once while it stays the same: a broker that is away for an
        // hour must not fill the log.
        if said.as_deref() != Some(e.as_str()) {
            tracing::warn!(
                "the lease of {}: {e}; trying again (the pod runs meanwhile, capped)",
                lease.said(names.borrow().as_ref())
            );
            said = Some(e);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_RETRY);
    }
}

/// One connection to the broker holding the lease; returns why it ended.
async fn session(
    socket: &Path,
    lease: &Lease,
    token: u64,
    names: &mut watch::Receiver<Option<LeaseName>>,
    resume: &mut bool,
    booked: &mut bool,
) -> String {
    let mut conn = match tokio::time::timeout(ANSWER_TIMEOUT, Conn::open(socket)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return e,
        Err(_) => {
            return format!(
                "the broker at {} did not answer within {ANSWER_TIMEOUT:?}",
                socket.display()
            );
        }
    };
    let pins: Vec<Pin> = lease
        .pins
        .iter()
        .filter_map(|(uuid, mem)| {
            Some(Pin {
                uuid: parse_uuid(uuid)?,
                mem: *mem,
            })
        })
        .collect();
    let request = |resume: u64| {
        ClientMsg::Lease(LeaseReq {
            want_gpus: 0,
            want_mem: 0,
            compute: lease.compute,
            limit: None,
            no_wait: false,
            command: names
                .borrow()
                .as_ref()
                .map_or_else(|| lease.unnamed.clone(), |n| n.label.clone()),
            priority: None,
            resume,
            token: if resume == 0 { token } else { 0 },
            pin: if resume == 0 {
                pins.clone()
            } else {
                Vec::new()
            },
        })
    };
    // The same process after a broker restart: take the lease back where
    // it was. Otherwise (or if the broker lost it), book it anew under the
    // same token.
    let mut first = if *resume { request(token) } else { request(0) };
    let mut fresh = !*resume;
    loop {
        if let Err(e) = conn.send(&first).await {
            return e;
        }
        match conn.recv().await {
            Ok(ServerMsg::Refused { reason }) if !fresh => {
                tracing::debug!("resuming the lease: {reason}; booking it anew");
                first = request(0);
                fresh = true;
            }
            Ok(ServerMsg::Refused { reason }) => return format!("the broker refused it: {reason}"),
            Ok(m) => {
                report(&m, lease);
                break;
            }
            Err(e) => return e,
        }
    }
    *resume = true;
    *booked = true;
    names.mark_changed();
    loop {
        tokio::select! {
            m = conn.recv() => match m {
                Ok(ServerMsg::Refused { reason }) => return format!("the broker refused it: {reason}"),
                Ok(m) => report(&m, lease),
                Err(e) => return e,
            },
            r = names.changed() => {
                if r.is_err() {
                    // The entry is gone; the task is being aborted.
                    return "released".into();
                }
                let name = names.borrow_and_update().clone();
                if let Some(n) = name
                    && let Err(e) = conn
                        .send(&ClientMsg::Name {
                            pod: n.pod,
                            label: n.label,
                        })
                        .await
                {
                    return e;
                }
            }
        }
    }
}

fn report(m: &ServerMsg, lease: &Lease) {
    let what = lease.said(None);
    match m {
        ServerMsg::Queued {
            position,
            waiting_for,
            ..
        } => tracing::info!(
            "{what} waits in the broker's queue at position {position} for {waiting_for}: jobs \
             outside Kubernetes hold that memory (the pod runs meanwhile, capped)"
        ),
        ServerMsg::Leased(l) => {
            tracing::info!("{what} is booked on GPUs {:?}", l.gpus)
        }
        ServerMsg::Error { message, .. } => tracing::warn!("the broker says: {message}"),
        _ => {}
    }
}

/// A broker connection speaking the wire protocol.
struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(socket: &Path) -> Result<Conn, String> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|e| format!("cannot reach the broker at {}: {e}", socket.display()))?;
        // The lease request carries its token, a secret: said only to the
        // broker itself.
        gpufrac_common::net::believe(&stream, socket).map_err(|e| e.to_string())?;
        let mut c = Conn {
            stream,
            buf: Vec::new(),
        };
        c.send(&ClientMsg::hello(std::process::id(), Role::Cli))
            .await?;
        match c.recv().await? {
            ServerMsg::HelloOk { .. } => Ok(c),
            ServerMsg::Error { message, .. } => Err(format!("the broker refused: {message}")),
            m => Err(format!("the broker answered the handshake with {m:?}")),
        }
    }

    async fn send(&mut self, m: &ClientMsg) -> Result<(), String> {
        let mut out = Vec::new();
        wire::encode_client(m, &mut out);
        self.stream
            .write_all(&out)
            .await
            .map_err(|e| format!("the broker connection broke: {e}"))
    }

    async fn recv(&mut self) -> Result<ServerMsg, String> {
        loop {
            match wire::decode_server(&self.buf) {
                Ok((m, used)) => {
                    self.buf.drain(..used);
                    return Ok(m);
                }
                Err(DecodeError::Incomplete) => {}
                Err(e) => return Err(format!("the broker sent a bad frame: {e}")),
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk).await {
                Ok(0) => return Err("the broker closed the connection".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(format!("the broker connection broke: {e}")),
            }
        }
    }
}
