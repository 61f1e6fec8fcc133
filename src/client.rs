//! Blocking client for the broker protocol, as `gpufrac run` and
//! `gpufrac status` speak it.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufrac_common::net;
use gpufrac_common::status::Status;
use gpufrac_common::wire::{self, ClientMsg, DecodeError, Lease, LeaseReq, Role, ServerMsg};

/// A live broker answers at once; this only bounds how long a wedged one can
/// hang `status` or the start of `run`.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connecting and the handshake together: a broker whose accept queue is
/// full (a flood of idle connections) or that is stopped (SIGSTOP) gets this
/// long, then the command fails saying so instead of hanging.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub enum ConnectError {
    /// Nothing listens on the socket: the file is missing or stale. Callers
    /// treat this as "run without a broker", unlike every other failure.
    NoBroker,
    Other(String),
}

/// What a lease request came to.
#[derive(Debug, Clone, PartialEq)]
pub enum LeaseOutcome {
    Leased(Lease),
    Refused(String),
    /// The deadline passed first; the last queue report, if any came.
    TimedOut(Option<QueueReport>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct QueueReport {
    pub position: u32,
    pub waiting_for: String,
    /// Names the request for a resume after a broker restart.
    pub token: u64,
}

pub struct Client {
    stream: UnixStream,
    socket: PathBuf,
    /// Bytes read but not yet decoded; frames may arrive split or several at
    /// once.
    buf: Vec<u8>,
    /// The latest queue report, kept across a lost connection.
    last: Option<QueueReport>,
}

impl Client {
    /// Connects and completes the handshake within [`CONNECT_TIMEOUT`].
    pub fn connect(socket: &Path) -> Result<Client, ConnectError> {
        Client::connect_within(socket, CONNECT_TIMEOUT)
    }

    /// Connects and completes the handshake, or fails once `timeout` has
    /// passed without the broker answering.
    pub fn connect_within(socket: &Path, timeout: Duration) -> Result<Client, ConnectError> {
        Client::open(socket, timeout, None)
    }

    /// Connects with `first` (a request) sent in the same write as the
    /// Hello, and completes the handshake: the broker reads both at once
    /// and answers both at once, one round trip and one wake of a busy
    /// broker instead of two. Its answer is read next (`wait_lease`,
    /// `status_reply`). A broker that refuses the Hello closes the
    /// connection without reading `first`; one whose version this client
    /// refuses may have taken it, and closing the connection here ends
    /// what it began (a lease request's job ends with its connection).
    pub fn connect_asking(socket: &Path, first: &ClientMsg) -> Result<Client, ConnectError> {
        Client::open(socket, CONNECT_TIMEOUT, Some(first))
    }

    /// The broker's whole status, asked at connect (`connect_asking`).
    pub fn ask_status(socket: &Path) -> Result<Status, ConnectError> {
        Client::connect_asking(socket, &ClientMsg::Status { from: 0 })?
            .status_asked()
            .map_err(ConnectError::Other)
    }

    fn open(
        socket: &Path,
        timeout: Duration,
        first: Option<&ClientMsg>,
    ) -> Result<Client, ConnectError> {
        let deadline = Instant::now() + timeout;
        let silent = || {
            ConnectError::Other(format!(
                "the broker at {} did not answer within {} (it may be overloaded or stopped)",
                socket.display(),
                seconds(timeout)
            ))
        };
        let stream = net::connect_unix(socket, deadline).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ECONNREFUSED) => ConnectError::NoBroker,
            _ if e.kind() == io::ErrorKind::TimedOut => silent(),
            _ => ConnectError::Other(connect_problem(socket, &e)),
        })?;
        // Before a word is sent: a lease request carries the job's token,
        // and the answer decides the job's GPUs, cap and MPS pipe.
        net::believe(&stream, socket).map_err(|e| ConnectError::Other(e.to_string()))?;
        // A stalled broker stops reading too: no write may block for long.
        stream
            .set_write_timeout(Some(REPLY_TIMEOUT))
            .map_err(|e| ConnectError::Other(format!("socket error: {e}")))?;
        let mut client = Client {
            stream,
            socket: socket.to_owned(),
            buf: Vec::new(),
            last: None,
        };
        let mut out = Vec::new();
        wire::encode_client(&ClientMsg::hello(std::process::id(), Role::Cli), &mut out);
        if let Some(m) = first {
            wire::encode_client(m, &mut out);
        }
        client.write(&out).map_err(ConnectError::Other)?;
        match client.recv(Some(deadline)).map_err(ConnectError::Other)? {
            Some(ServerMsg::HelloOk { version }) => match wire::accept_version(version) {
                Ok(_) => Ok(client),
                Err(why) => Err(ConnectError::Other(format!(
                    "the broker at {}: {why}",
                    socket.display()
                ))),
            },
            Some(ServerMsg::Error { message, .. }) => Err(ConnectError::Other(format!(
                "the broker at {} refused the connection: {message}",
                socket.display()
            ))),
            Some(other) => Err(ConnectError::Other(format!(
                "the broker at {} answered the handshake with {}",
                socket.display(),
                other.name()
            ))),
            None => Err(silent()),
        }
    }

    /// The whole status, page by page (a busy node's process list spans
    /// several replies).
    pub fn status(&mut self) -> Result<Status, String> {
        let first = self.status_page(0)?;
        self.rest_of_status(first)
    }

    /// The whole status from a broker asked at connect
    /// (`connect_asking` with `Status { from: 0 }`), one round trip fewer.
    pub fn status_asked(&mut self) -> Result<Status, String> {
        let first = self.status_reply()?;
        self.rest_of_status(first)
    }

    fn rest_of_status(&mut self, first: Status) -> Result<Status, String> {
        let mut whole = first;
        let mut pages = 1;
        while let Some(from) = whole.next.take() {
            let mut page = self.status_page(from)?;
            for g in page.gpus.drain(..) {
                match whole.gpus.iter_mut().find(|w| w.uuid == g.uuid) {
                    Some(w) => w.processes.extend(g.processes),
                    None => whole.gpus.push(g),
                }
            }
            whole.next = page.next;
            pages += 1;
            if pages > 10_000 {
                return Err("the broker's status did not end".into());
            }
        }
        Ok(whole)
    }

    fn status_page(&mut self, from: u32) -> Result<Status, String> {
        self.send(&ClientMsg::Status { from })?;
        self.status_reply()
    }

    /// The answer to a `Status` request already sent (its first page, by
    /// `connect_asking`).
    fn status_reply(&mut self) -> Result<Status, String> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            match self.recv(Some(deadline))? {
                Some(ServerMsg::StatusReply { json }) => {
                    return serde_json::from_str(&json).map_err(|e| {
                        format!("the broker sent a status this gpufrac cannot read: {e}")
                    });
                }
                Some(ServerMsg::Error { message, .. }) => return Err(message),
                // Nothing else is addressed to a CLI connection; a newer
                // broker's extras are not worth failing over.
                Some(_) => continue,
                None => {
                    return Err(format!(
                        "the broker at {} did not answer within {} (it may be overloaded or stopped)",
                        self.socket.display(),
                        seconds(REPLY_TIMEOUT)
                    ));
                }
            }
        }
    }

    /// What the job with this token has had so far (its run's end-of-job
    /// line).
    pub fn summary(&mut self, token: u64) -> Result<gpufrac_common::status::JobSummary, String> {
        self.send(&ClientMsg::Summary { job: token })?;
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            match self.recv(Some(deadline))? {
                Some(ServerMsg::SummaryReply { json }) => {
                    return serde_json::from_str(&json).map_err(|e| {
                        format!("the broker sent a summary this gpufrac cannot read: {e}")
                    });
                }
                Some(ServerMsg::Refused { reason }) => return Err(reason),
                Some(ServerMsg::Error { message, .. }) => return Err(message),
                Some(_) => continue,
                None => return Err("the broker did not answer".into()),
            }
        }
    }

    /// The latest queue report received on this connection.
    pub fn last_report(&self) -> Option<QueueReport> {
        self.last.clone()
    }

    /// Blocks until the broker closes the connection (or it breaks);
    /// returns why.
    pub fn wait_closed(&mut self) -> String {
        loop {
            if let Err(e) = self.recv(None) {
                return e;
            }
        }
    }

    /// Sends a `Lease` request; follow with [`Client::wait_lease`].
    pub fn request_lease(&mut self, lease: &ClientMsg) -> Result<(), String> {
        debug_assert!(matches!(lease, ClientMsg::Lease(LeaseReq { .. })));
        self.send(lease)
    }

    /// Reads queue updates until the lease is granted or refused, or
    /// `deadline` passes. `progress` is called with the latest queue report
    /// whenever one arrives and at least every `tick` in between, so a
    /// caller can keep an elapsed-time display current.
    pub fn wait_lease(
        &mut self,
        deadline: Option<Instant>,
        tick: Duration,
        mut progress: impl FnMut(Option<&QueueReport>),
    ) -> Result<LeaseOutcome, String> {
        let mut last: Option<QueueReport> = None;
        loop {
            let next_tick = Instant::now() + tick;
            let wake = deadline.map_or(next_tick, |d| d.min(next_tick));
            match self.recv(Some(wake))? {
                Some(ServerMsg::Queued {
                    position,
                    waiting_for,
                    token,
                }) => {
                    last = Some(QueueReport {
                        position,
                        waiting_for,
                        token,
                    });
                    self.last.clone_from(&last);
                    progress(last.as_ref());
                }
                Some(ServerMsg::Leased(lease)) => return Ok(LeaseOutcome::Leased(lease)),
                Some(ServerMsg::Refused { reason }) => return Ok(LeaseOutcome::Refused(reason)),
                Some(ServerMsg::Error { message, .. }) => return Err(message),
                Some(_) => {}
                None if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Ok(LeaseOutcome::TimedOut(last));
                }
                None => progress(last.as_ref()),
            }
        }
    }

    fn send(&mut self, msg: &ClientMsg) -> Result<(), String> {
        let mut out = Vec::new();
        wire::encode_client(msg, &mut out);
        self.write(&out)
    }

    fn write(&mut self, out: &[u8]) -> Result<(), String> {
        self.stream.write_all(out).map_err(|e| {
            format!(
                "lost the connection to the broker at {}: {e}",
                self.socket.display()
            )
        })
    }

    /// The next message, or `None` once `deadline` passes without one.
    fn recv(&mut self, deadline: Option<Instant>) -> Result<Option<ServerMsg>, String> {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            match wire::decode_server(&self.buf) {
                Ok((msg, used)) => {
                    self.buf.drain(..used);
                    return Ok(Some(msg));
                }
                Err(DecodeError::Incomplete) => {}
                Err(e) => {
                    return Err(format!(
                        "the broker at {} sent a bad message ({e}); are gpufrac and the broker the same version?",
                        self.socket.display()
                    ));
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // Out of time, what has already arrived still counts: a lease
            // granted at the deadline is better used than thrown away.
            let last_look = left.is_some_and(|l| l.is_zero());
            let set = if last_look {
                self.stream.set_nonblocking(true)
            } else {
                self.stream.set_read_timeout(left)
            };
            set.map_err(|e| format!("socket error: {e}"))?;
            let got = self.stream.read(&mut chunk);
            if last_look {
                self.stream
                    .set_nonblocking(false)
                    .map_err(|e| format!("socket error: {e}"))?;
            }
            match got {
                Ok(0) => {
                    return Err(format!(
                        "the broker at {} closed the connection",
                        self.socket.display()
                    ));
                }
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if last_look && wire::decode_server(&self.buf) == Err(DecodeError::Incomplete) {
                        return Ok(None);
                    }
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(format!(
                        "lost the connection to the broker at {}: {e}",
                        self.socket.display()
                    ));
                }
            }
        }
    }
}

/// "5 s", "300 ms".
fn seconds(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

fn connect_problem(socket: &Path, e: &io::Error) -> String {
    let hint = if e.kind() == io::ErrorKind::PermissionDenied {
        format!(
            "; the socket is open only to the broker's --group: ask to be added to it, or use \
             sudo. On a machine of your own, start a broker you can reach instead:\n{}",
            own_broker_lines()
        )
    } else {
        String::new()
    };
    format!(
        "cannot connect to the broker at {}: {e}{hint}",
        socket.display()
    )
}

/// Indentation of a command in a hint: each such line pastes into a shell
/// as it is.
const CMD_INDENT: &str = "    ";

/// This program as a hint should name it: the path it was started by
/// when that has a directory (`target/release/gpufrac` right after a
/// build, which `gpufrac` alone would not find), else `gpufrac`.
pub fn self_command() -> String {
    match std::env::args_os().next() {
        Some(a) if a.to_string_lossy().contains('/') => {
            crate::inject::sh_quote(&a.to_string_lossy())
        }
        _ => "gpufrac".into(),
    }
}

/// The two lines that start a broker on a socket of this user's own and
/// point every later command at it.
fn own_broker_lines() -> String {
    let own = gpufrac_broker::user_socket();
    let own = crate::inject::sh_quote(&own.display().to_string());
    format!(
        "{CMD_INDENT}{} broker --socket {own} &\n{CMD_INDENT}export GPUFRAC_SOCKET={own}",
        self_command()
    )
}

/// How to start the broker a command looked for at `socket` and did not
/// find, as commands on lines of their own. The default socket is in
/// root's /run, so a user without root is pointed at a path of their own.
pub fn start_hint(socket: &Path) -> String {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let me = self_command();
    if socket != Path::new(gpufrac_common::config::DEFAULT_SOCKET) {
        format!(
            "start one with:\n{CMD_INDENT}{me} broker --socket {}",
            crate::inject::sh_quote(&socket.display().to_string())
        )
    } else if root {
        format!("start one with:\n{CMD_INDENT}{me} broker")
    } else {
        format!(
            "start one of your own with:\n{}\nor, as root, one for every user of the node \
             (here, those of your group):\n{CMD_INDENT}sudo {me} broker --group \"$(id -gn)\"",
            own_broker_lines()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::thread;

    fn server_frames(msgs: &[ServerMsg]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in msgs {
            wire::encode_server(m, &mut out);
        }
        out
    }

    /// A one-connection fake broker: reads the hello and any request, then
    /// writes `bytes` one byte at a time so that frames arrive split.
    fn fake_broker(bytes: Vec<u8>) -> (tempdir::Dir, thread::JoinHandle<Vec<u8>>) {
        let dir = tempdir::Dir::new();
        let path = dir.path.join("b.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let h = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            let mut chunk = [0u8; 256];
            // Hello (15 bytes) and at least the start of what follows.
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..n]);
                if got.len() >= 15 {
                    break;
                }
            }
            for b in bytes {
                if s.write_all(&[b]).is_err() {
                    break;
                }
            }
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..n]);
            }
            got
        });
        (dir, h)
    }

    mod tempdir {
        use std::path::PathBuf;

        pub struct Dir {
            pub path: PathBuf,
        }

        impl Dir {
            pub fn new() -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let path = std::env::temp_dir().join(format!(
                    "gpufrac-client-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&path).unwrap();
                Dir { path }
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    /// The lines of a hint that are commands to paste.
    fn commands(hint: &str) -> Vec<&str> {
        hint.lines()
            .filter_map(|l| l.strip_prefix(CMD_INDENT))
            .collect()
    }

    #[test]
    fn no_permission_suggests_a_socket_of_ones_own() {
        let m = connect_problem(
            Path::new("/run/gpufrac/broker.sock"),
            &io::Error::from_raw_os_error(libc::EACCES),
        );
        let own = gpufrac_broker::user_socket();
        assert!(m.contains("--group"), "{m}");
        assert_eq!(
            commands(&m),
            [
                format!("{} broker --socket {} &", self_command(), own.display()),
                format!("export GPUFRAC_SOCKET={}", own.display())
            ],
            "{m}"
        );
        let m = connect_problem(
            Path::new("/x.sock"),
            &io::Error::from_raw_os_error(libc::ECONNRESET),
        );
        assert!(!m.contains("GPUFRAC_SOCKET"), "{m}");
    }

    #[test]
    fn start_hint_names_the_socket_looked_at() {
        let me = self_command();
        // The test binary is started by its path.
        assert!(me.contains('/'), "{me}");
        assert_eq!(
            start_hint(Path::new("/tmp/b.sock")),
            format!("start one with:\n    {me} broker --socket /tmp/b.sock")
        );
        assert_eq!(
            commands(&start_hint(Path::new("/tmp/a b.sock"))),
            [format!("{me} broker --socket '/tmp/a b.sock'")]
        );
        let h = start_hint(Path::new(gpufrac_common::config::DEFAULT_SOCKET));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert_eq!(commands(&h), [format!("{me} broker")]);
        } else {
            let own = gpufrac_broker::user_socket();
            assert_eq!(
                commands(&h),
                [
                    format!("{me} broker --socket {} &", own.display()),
                    format!("export GPUFRAC_SOCKET={}", own.display()),
                    format!("sudo {me} broker --group \"$(id -gn)\""),
                ],
                "{h}"
            );
        }
    }

    #[test]
    fn missing_socket_is_no_broker() {
        let dir = tempdir::Dir::new();
        assert!(matches!(
            Client::connect(&dir.path.join("nothing.sock")),
            Err(ConnectError::NoBroker)
        ));
    }

    #[test]
    fn stale_socket_is_no_broker() {
        let dir = tempdir::Dir::new();
        let path = dir.path.join("stale.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(matches!(
            Client::connect(&path),
            Err(ConnectError::NoBroker)
        ));
    }

    /// A listener that accepts nothing; with `jam`, its accept queue is
    /// full too (backlog 0 holds one connection), as a flood leaves it.
    fn silent_listener(path: &Path, jam: bool) -> (UnixListener, Vec<UnixStream>) {
        use std::os::fd::AsRawFd;
        let l = UnixListener::bind(path).unwrap();
        // SAFETY: shrinking the backlog of our own listening socket.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let mut fillers = Vec::new();
        if jam {
            loop {
                match net::connect_unix(path, Instant::now()) {
                    Ok(s) => fillers.push(s),
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => break,
                    Err(e) => panic!("{e}"),
                }
                assert!(fillers.len() < 64, "the accept queue never filled");
            }
        }
        (l, fillers)
    }

    #[test]
    fn a_broker_that_never_answers_fails_within_the_deadline() {
        for jam in [false, true] {
            let dir = tempdir::Dir::new();
            let path = dir.path.join("b.sock");
            let _held = silent_listener(&path, jam);
            let t = Instant::now();
            let r = Client::connect_within(&path, Duration::from_millis(300));
            let took = t.elapsed();
            let Err(ConnectError::Other(msg)) = r else {
                panic!("jam={jam}: expected a timeout")
            };
            assert!(
                msg.contains(&format!(
                    "the broker at {} did not answer within 300 ms",
                    path.display()
                )) && msg.contains("overloaded or stopped"),
                "jam={jam}: {msg}"
            );
            assert!(
                took >= Duration::from_millis(300) && took < Duration::from_secs(3),
                "jam={jam}: {took:?}"
            );
        }
    }

    #[test]
    fn handshake_error_is_reported() {
        let (dir, h) = fake_broker(server_frames(&[ServerMsg::Error {
            code: wire::ERR_VERSION,
            message: "protocol version 1 not supported; this broker speaks 2".into(),
        }]));
        let Err(ConnectError::Other(msg)) = Client::connect(&dir.path.join("b.sock")) else {
            panic!("connected")
        };
        assert!(msg.contains("this broker speaks 2"), "{msg}");
        h.join().unwrap();
    }

    #[test]
    fn status_round_trip() {
        let status = Status {
            version: "0.1.0".into(),
            socket: "/x".into(),
            timeslice_ms: 50.0,
            overprovision: 1,
            ..Status::default()
        };
        let json = serde_json::to_string(&status).unwrap();
        let (dir, h) = fake_broker(server_frames(&[
            ServerMsg::HelloOk {
                version: wire::PROTOCOL_VERSION,
            },
            ServerMsg::StatusReply { json },
        ]));
        let mut c = Client::connect(&dir.path.join("b.sock")).unwrap();
        assert_eq!(c.status().unwrap(), status);
        drop(c);
        let sent = h.join().unwrap();
        let (hello, used) = wire::decode_client(&sent).unwrap();
        assert!(matches!(
            hello,
            ClientMsg::Hello {
                role: Role::Cli,
                ..
            }
        ));
        assert_eq!(
            wire::decode_client(&sent[used..]).unwrap().0,
            ClientMsg::Status { from: 0 }
        );
    }

    fn granted() -> Lease {
        Lease {
            gpus: vec![3],
            uuids: vec![[7; 16]],
            mem_cap: 0,
            token: 9,
            mps_pipe: String::new(),
            mig: "MIG-x".into(),
        }
    }

    /// A one-connection fake broker that answers nothing until `n` whole
    /// frames have come (or 2 s passed), then writes `bytes`: what it read
    /// and how many frames came before its first answer.
    fn fake_broker_after(
        n: usize,
        bytes: Vec<u8>,
    ) -> (tempdir::Dir, thread::JoinHandle<(Vec<u8>, usize)>) {
        let dir = tempdir::Dir::new();
        let listener = UnixListener::bind(dir.path.join("b.sock")).unwrap();
        let h = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let (mut got, mut chunk) = (Vec::new(), [0u8; 256]);
            let frames = |got: &[u8]| {
                let (mut k, mut at) = (0, 0);
                while let Ok((_, used)) = wire::decode_client(&got[at..]) {
                    (k, at) = (k + 1, at + used);
                }
                k
            };
            while frames(&got) < n {
                match s.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => got.extend_from_slice(&chunk[..k]),
                }
            }
            let before = frames(&got);
            s.write_all(&bytes).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            while let Ok(k) = s.read(&mut chunk) {
                if k == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..k]);
            }
            (got, before)
        });
        (dir, h)
    }

    fn lease_req() -> ClientMsg {
        ClientMsg::Lease(LeaseReq {
            want_gpus: 1,
            want_mem: 0,
            compute: None,
            limit: None,
            no_wait: false,
            command: "sleep 1".into(),
            priority: None,
            resume: 0,
            token: 0,
            pin: Vec::new(),
        })
    }

    /// One round trip to a busy broker, not two: the request is in the
    /// broker's hands before it has said a word, and the answers to both
    /// are read after.
    #[test]
    fn a_request_asked_at_connect_goes_with_the_hello() {
        let (dir, h) = fake_broker_after(
            2,
            server_frames(&[
                ServerMsg::HelloOk {
                    version: wire::PROTOCOL_VERSION,
                },
                ServerMsg::Leased(granted()),
            ]),
        );
        let mut c = Client::connect_asking(&dir.path.join("b.sock"), &lease_req()).unwrap();
        let out = c
            .wait_lease(None, Duration::from_millis(50), |_| {})
            .unwrap();
        assert_eq!(out, LeaseOutcome::Leased(granted()));
        drop(c);
        let (sent, before) = h.join().unwrap();
        assert_eq!(before, 2, "frames the broker had before it answered");
        let (hello, used) = wire::decode_client(&sent).unwrap();
        assert!(matches!(
            hello,
            ClientMsg::Hello {
                role: Role::Cli,
                ..
            }
        ));
        assert_eq!(wire::decode_client(&sent[used..]).unwrap().0, lease_req());

        let status = Status {
            version: "0.1.0".into(),
            ..Status::default()
        };
        let (dir, h) = fake_broker_after(
            2,
            server_frames(&[
                ServerMsg::HelloOk {
                    version: wire::PROTOCOL_VERSION,
                },
                ServerMsg::StatusReply {
                    json: serde_json::to_string(&status).unwrap(),
                },
            ]),
        );
        assert_eq!(
            Client::ask_status(&dir.path.join("b.sock")).unwrap(),
            status
        );
        assert_eq!(h.join().unwrap().1, 2);
    }

    /// A broker that refuses the Hello is heard as before, the request
    /// beside it unanswered.
    #[test]
    fn a_refused_hello_with_a_request_is_a_connect_error() {
        let (dir, h) = fake_broker_after(
            2,
            server_frames(&[ServerMsg::Error {
                code: wire::ERR_VERSION,
                message: "protocol version 1 not supported; this broker speaks 2".into(),
            }]),
        );
        let Err(ConnectError::Other(msg)) =
            Client::connect_asking(&dir.path.join("b.sock"), &lease_req())
        else {
            panic!("connected")
        };
        assert!(
            msg.contains("refused the connection") && msg.contains("this broker speaks 2"),
            "{msg}"
        );
        h.join().unwrap();
    }

    #[test]
    fn lease_reports_queue_then_grant() {
        let (dir, h) = fake_broker(server_frames(&[
            ServerMsg::HelloOk {
                version: wire::PROTOCOL_VERSION,
            },
            ServerMsg::Queued {
                position: 2,
                waiting_for: "1 GPU".into(),
                token: 9,
            },
            ServerMsg::Queued {
                position: 1,
                waiting_for: "1 GPU".into(),
                token: 9,
            },
            ServerMsg::Leased(granted()),
        ]));
        let mut c = Client::connect(&dir.path.join("b.sock")).unwrap();
        c.request_lease(&lease_req()).unwrap();
        let mut seen = Vec::new();
        let out = c
            .wait_lease(None, Duration::from_millis(50), |q| {
                if let Some(q) = q {
                    seen.push(q.position);
                }
            })
            .unwrap();
        assert_eq!(out, LeaseOutcome::Leased(granted()));
        assert!(seen.starts_with(&[2]) && seen.ends_with(&[1]), "{seen:?}");
        drop(c);
        h.join().unwrap();
    }

    #[test]
    fn lease_times_out_with_last_position() {
        let (dir, h) = fake_broker(server_frames(&[
            ServerMsg::HelloOk {
                version: wire::PROTOCOL_VERSION,
            },
            ServerMsg::Queued {
                position: 4,
                waiting_for: "2 GPUs".into(),
                token: 9,
            },
        ]));
        let mut c = Client::connect(&dir.path.join("b.sock")).unwrap();
        let start = Instant::now();
        let out = c
            .wait_lease(
                Some(start + Duration::from_millis(300)),
                Duration::from_millis(50),
                |_| {},
            )
            .unwrap();
        assert_eq!(
            out,
            LeaseOutcome::TimedOut(Some(QueueReport {
                position: 4,
                waiting_for: "2 GPUs".into(),
                token: 9,
            }))
        );
        assert!(start.elapsed() >= Duration::from_millis(300));
        drop(c);
        h.join().unwrap();
    }

    #[test]
    fn lease_already_granted_beats_an_expired_deadline() {
        let leased = ServerMsg::Leased(Lease {
            mem_cap: 5,
            ..granted()
        });
        let (dir, h) = fake_broker(server_frames(&[
            ServerMsg::HelloOk {
                version: wire::PROTOCOL_VERSION,
            },
            ServerMsg::Queued {
                position: 1,
                waiting_for: "1 GPU".into(),
                token: 9,
            },
            leased,
        ]));
        let mut c = Client::connect(&dir.path.join("b.sock")).unwrap();
        thread::sleep(Duration::from_millis(200));
        let out = c
            .wait_lease(Some(Instant::now()), Duration::from_millis(50), |_| {})
            .unwrap();
        assert!(
            matches!(out, LeaseOutcome::Leased(Lease { mem_cap: 5, .. })),
            "{out:?}"
        );
        drop(c);
        h.join().unwrap();
    }

    #[test]
    fn closed_connection_is_an_error() {
        let (dir, h) = fake_broker(server_frames(&[ServerMsg::HelloOk {
            version: wire::PROTOCOL_VERSION,
        }]));
        let mut c = Client::connect(&dir.path.join("b.sock")).unwrap();
        // The fake broker only closes after we stop writing; shutting our
        // side down makes it finish.
        c.stream.shutdown(std::net::Shutdown::Write).unwrap();
        h.join().unwrap();
        let err = c
            .wait_lease(None, Duration::from_millis(50), |_| {})
            .unwrap_err();
        assert!(err.contains("closed the connection"), "{err}");
    }
}
