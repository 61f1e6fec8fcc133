//! Connecting to the broker's Unix socket within a deadline.
//!
//! `UnixStream::connect` blocks for as long as the listener's accept queue
//! is full, which is what a flood of connections that never say hello, or a
//! stopped (SIGSTOP) broker, leaves behind: a CLI command or a process in
//! `cuInit` would hang with it. Here the socket is non-blocking while it
//! connects: a full queue answers `EAGAIN` at once (Unix sockets never
//! queue the connect itself), which is retried until the deadline.
//!
//! And believing what listens there: before a client sends anything or
//! believes an answer, [`believe`] checks who the listener is (root, or
//! the user who owns the socket's directory); a socket path someone else
//! took in the gap of a restart is refused, not spoken to.
//!
//! Shared by the shim, the CLI and the Kubernetes plugins; not on any
//! per-CUDA-call path.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Connects to the Unix socket at `path`, giving up at `deadline` with an
/// error of kind `TimedOut`. Other failures (no such file, nobody listening,
/// permission denied) come back at once, as from `UnixStream::connect`. The
/// stream returned is in blocking mode.
pub fn connect_unix(path: &Path, deadline: Instant) -> io::Result<UnixStream> {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path must be 1 to {} bytes without NUL: {}",
                addr.sun_path.len() - 1,
                path.display()
            ),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    // SAFETY: plain syscall; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor we just created and nobody else holds.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Back-off between tries while the accept queue is full: short at first
    // (a busy broker drains its queue within milliseconds), then no more
    // than 20 tries a second.
    let mut pause = Duration::from_millis(2);
    loop {
        // SAFETY: addr is a valid sockaddr_un of `len` bytes.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if rc == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The listener's queue is full: nothing to wait on but time.
            Some(libc::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(timed_out());
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            // Not what Linux does for Unix sockets, but what the API allows.
            Some(libc::EINPROGRESS) => {
                wait_for(&fd, libc::POLLOUT, deadline)?;
                let mut err: libc::c_int = 0;
                let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: valid out-pointers of the sizes given.
                let rc = unsafe {
                    libc::getsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&mut err as *mut libc::c_int).cast(),
                        &mut l,
                    )
                };
                if rc < 0 {
                    return Err(io::Error::last_os_error());
                }
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                break;
            }
            _ => return Err(e),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Waits until `fd` is ready for `events`, or fails with `TimedOut` at
/// `deadline`. Hang-up and errors count as ready: the read or write that
/// follows reports them.
pub fn wait_for(fd: &impl AsRawFd, events: libc::c_short, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        // Rounded up so that a wait never ends just short of the deadline.
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one pollfd on the stack.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n > 0 {
            return Ok(());
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
}

/// The peer of a connected Unix socket as the kernel recorded it
/// (`SO_PEERCRED`): for a client, the listener's process and user when it
/// started listening; for the broker, the client's when it connected.
/// None where the kernel says nothing.
pub fn peer_cred(sock: &impl AsRawFd) -> Option<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && len as usize == std::mem::size_of::<libc::ucred>()).then_some(cred)
}

/// Why the listener on a broker's socket path is not believed: it is not
/// root, nor the user who owns the socket's directory (or that ownership
/// proves nothing). Built only when refusing, so the check itself never
/// allocates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotTheBroker {
    pub path: PathBuf,
    /// The listener's (pid, uid); None when the kernel would not say.
    pub found: Option<(i32, u32)>,
    /// The owner of the socket's directory, the one uid besides root a
    /// broker there may run as; None where it could not be read or is root.
    pub owner: Option<u32>,
    /// When the directory belongs to the listener but that proves nothing:
    /// a directory above it (path, owner, mode) where others could have
    /// made it.
    pub doubt: Option<(PathBuf, u32, u32)>,
}

impl std::fmt::Display for NotTheBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.path.display();
        let Some((pid, uid)) = self.found else {
            return write!(
                f,
                "the listener on {path} is not believed to be the gpufrac broker: the kernel \
                 does not say who it is; nothing was sent to it"
            );
        };
        write!(
            f,
            "the listener on {path} is not the gpufrac broker: it runs as uid {uid} (pid {pid}), \
             and a broker there must run as root (uid 0)"
        )?;
        let dir = dir_of(&self.path);
        match (&self.doubt, self.owner) {
            (Some((above, a_uid, a_mode)), Some(o)) => write!(
                f,
                "; {} belongs to uid {o}, but {} (owner uid {a_uid}, mode {a_mode:o}) lets others \
                 make entries, so anyone could have made it",
                dir.display(),
                above.display()
            )?,
            (None, Some(o)) => write!(f, " or as uid {o}, the owner of {}", dir.display())?,
            _ => {}
        }
        write!(
            f,
            "; nothing was sent to it and nothing it says is believed (another user may have \
             taken the socket's path: ask the node's administrator)"
        )
    }
}

impl std::error::Error for NotTheBroker {}

/// The directory a socket path is in, as the check names it.
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Whether the listener at the other end of `sock`, connected to `path`,
/// may be believed to be the gpufrac broker, before anything is sent to
/// it or read from it: root, or the user who owns the socket's directory
/// (a user's own broker in a directory of its own). The owner counts only
/// when it is the caller, or when no directory above the socket's lets
/// another user make entries (a directory in /tmp is whoever's made it
/// first, so its owner proves nothing to a third user). Every client
/// (the shim, `gpufrac run`/`status`/`top`, the device and DRA plugins)
/// asks this one function.
///
/// No allocation unless it refuses: the shim calls it from cuInit.
pub fn believe(sock: &impl AsRawFd, path: &Path) -> Result<(), NotTheBroker> {
    let refuse = |found, owner: Option<u32>, doubt| NotTheBroker {
        path: path.to_path_buf(),
        found,
        owner: owner.filter(|&o| o != 0),
        doubt,
    };
    let Some(libc::ucred { pid, uid, .. }) = peer_cred(sock) else {
        return Err(refuse(None, None, None));
    };
    if uid == 0 {
        return Ok(());
    }
    let mut dir = CPath::new();
    let owner = if dir.set_dir_of(path) {
        dir.stat().map(|(o, _)| o)
    } else {
        None
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    verdict(uid, me, owner, |o| dir.open_ancestor(o))
        .map_err(|(owner, doubt)| refuse(Some((pid, uid)), owner, doubt))
}

/// `believe`'s rule apart from the system calls: the listener `uid`, the
/// caller `me`, the owner of the socket's directory (None: unknown), and
/// the first directory above it that does not vouch for that owner
/// (asked only when it matters). Refused with the owner to name and the
/// doubt, if any.
fn verdict<D>(
    uid: u32,
    me: u32,
    owner: Option<u32>,
    first_open_above: impl FnOnce(u32) -> Option<D>,
) -> Result<(), (Option<u32>, Option<D>)> {
    if uid == 0 {
        return Ok(());
    }
    let Some(owner) = owner else {
        return Err((None, None));
    };
    if uid != owner {
        return Err((Some(owner), None));
    }
    if owner == me {
        return Ok(());
    }
    match first_open_above(owner) {
        Some(doubt) => Err((Some(owner), Some(doubt))),
        None => Ok(()),
    }
}

/// Whether a directory above the socket's (owner `uid`, mode `mode`)
/// leaves the socket directory's ownership to `owner` alone: nobody but
/// root or that owner could have made or replaced what is in it.
fn vouches(owner: u32, uid: u32, mode: u32) -> bool {
    (uid == 0 || uid == owner) && mode & 0o022 == 0
}

/// An absolute, NUL-terminated path on the stack.
struct CPath {
    buf: [u8; libc::PATH_MAX as usize + 1],
    len: usize,
}

impl CPath {
    fn new() -> CPath {
        CPath {
            buf: [0; libc::PATH_MAX as usize + 1],
            len: 0,
        }
    }

    /// The directory of `path`, made absolute from the working directory
    /// if it is relative; false if it does not fit.
    fn set_dir_of(&mut self, path: &Path) -> bool {
        let bytes = path.as_os_str().as_bytes();
        let dir = match bytes.iter().rposition(|&b| b == b'/') {
            Some(0) => &b"/"[..],
            Some(i) => &bytes[..i],
            None => &b""[..],
        };
        self.len = 0;
        if dir.first() != Some(&b'/') {
            // SAFETY: getcwd writes at most the size given, NUL included.
            let p = unsafe { libc::getcwd(self.buf.as_mut_ptr().cast(), self.buf.len()) };
            if p.is_null() {
                return false;
            }
            self.len = self.buf.iter().position(|&b| b == 0).unwrap_or(0);
            if !dir.is_empty() {
                if self.len + 1 >= self.buf.len() {
                    return false;
                }
                self.buf[self.len] = b'/';
                self.len += 1;
            }
        }
        if self.len + dir.len() >= self.buf.len() || dir.contains(&0) {
            return false;
        }
        self.buf[self.len..self.len + dir.len()].copy_from_slice(dir);
        self.len += dir.len();
        self.buf[self.len] = 0;
        true
    }

    /// Owner and mode of the first `len` bytes as a path (links followed).
    fn stat_prefix(&mut self, len: usize) -> Option<(u32, u32)> {
        let keep = self.buf[len];
        self.buf[len] = 0;
        // SAFETY: libc::stat is plain data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: stat of a NUL-terminated path into a local struct.
        let rc = unsafe { libc::stat(self.buf.as_ptr().cast(), &mut st) };
        self.buf[len] = keep;
        (rc == 0).then_some((st.st_uid, st.st_mode))
    }

    fn stat(&mut self) -> Option<(u32, u32)> {
        self.stat_prefix(self.len)
    }

    /// The first directory above this one, nearest first, that does not
    /// belong to root or `owner`, or that group or others may write
    /// (sticky or not: in /tmp anyone may make a name nobody has taken),
    /// as (path, owner, mode); one that cannot be read counts too.
    fn open_ancestor(&mut self, owner: u32) -> Option<(PathBuf, u32, u32)> {
        let mut end = self.len;
        while end > 1 {
            // Back over trailing slashes, then over the last component.
            while end > 1 && self.buf[end - 1] == b'/' {
                end -= 1;
            }
            while end > 0 && self.buf[end - 1] != b'/' {
                end -= 1;
            }
            // `end` is just past a slash: the parent is what comes before
            // it, or "/" itself.
            let parent = if end <= 1 { 1 } else { end - 1 };
            let st = self.stat_prefix(parent);
            let ok = st.is_some_and(|(u, m)| vouches(owner, u, m));
            if !ok {
                let (u, m) = st.unwrap_or((u32::MAX, 0));
                let p = PathBuf::from(std::ffi::OsStr::from_bytes(&self.buf[..parent]));
                return Some((p, u, m & 0o7777));
            }
            end = parent;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::path::PathBuf;

    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!(
                "gpufrac-net-{tag}-{}-{}",
                std::process::id(),
                crate::clock::mono_ns()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A listener that never accepts, with its accept queue (backlog 0:
    /// one connection) already full, as a flood leaves it.
    fn jammed(path: &Path) -> (OwnedFd, Vec<UnixStream>) {
        let l = std::os::unix::net::UnixListener::bind(path).unwrap();
        // SAFETY: shrinking the backlog of our own listening socket.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 0) }, 0);
        let mut fillers = Vec::new();
        loop {
            match connect_unix(path, Instant::now()) {
                Ok(s) => fillers.push(s),
                Err(e) if e.kind() == io::ErrorKind::TimedOut => break,
                Err(e) => panic!("{e}"),
            }
            assert!(fillers.len() < 64, "the accept queue never filled");
        }
        (OwnedFd::from(l), fillers)
    }

    #[test]
    fn a_full_accept_queue_times_out_at_the_deadline() {
        let d = Dir::new("jam");
        let path = d.0.join("s.sock");
        let _held = jammed(&path);
        let t = Instant::now();
        let e = connect_unix(&path, t + Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }

    #[test]
    fn missing_and_refused_fail_at_once() {
        let d = Dir::new("missing");
        let far = Instant::now() + Duration::from_secs(60);
        let e = connect_unix(&d.0.join("none.sock"), far).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let stale = d.0.join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let e = connect_unix(&stale, far).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED));
        let long = d.0.join("x".repeat(200));
        let e = connect_unix(&long, far).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn connects_and_is_blocking() {
        let d = Dir::new("ok");
        let path = d.0.join("s.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mut s = connect_unix(&path, Instant::now() + Duration::from_secs(5)).unwrap();
        let (mut a, _) = l.accept().unwrap();
        a.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        // A non-blocking stream could fail here with WouldBlock.
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
    }

    #[test]
    fn wait_for_times_out_on_silence() {
        let (a, _b) = UnixStream::pair().unwrap();
        let t = Instant::now();
        let e = wait_for(&a, libc::POLLIN, t + Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn this_users_own_listener_is_believed() {
        let d = Dir::new("own");
        let path = d.0.join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let s = connect_unix(&path, Instant::now() + Duration::from_secs(5)).unwrap();
        let libc::ucred { pid, uid, .. } = peer_cred(&s).unwrap();
        assert_eq!(pid as u32, std::process::id());
        // SAFETY: geteuid has no preconditions.
        assert_eq!(uid, unsafe { libc::geteuid() });
        assert_eq!(believe(&s, &path), Ok(()));
    }

    #[test]
    fn a_relative_path_is_taken_from_the_working_directory() {
        let mut c = CPath::new();
        assert!(c.set_dir_of(Path::new("b.sock")));
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(&c.buf[..c.len], cwd.as_os_str().as_bytes());
        assert!(c.set_dir_of(Path::new("sub/b.sock")));
        assert_eq!(&c.buf[..c.len], cwd.join("sub").as_os_str().as_bytes());
        assert!(c.set_dir_of(Path::new("/b.sock")));
        assert_eq!(&c.buf[..c.len], b"/");
        assert!(c.set_dir_of(Path::new("/run/gpufrac/broker.sock")));
        assert_eq!(&c.buf[..c.len], b"/run/gpufrac");
    }

    /// A directory in a sticky shared one (as /tmp/gpufrac-UID is) proves
    /// nothing about who should listen in it: anyone could have made it.
    #[test]
    fn a_directory_under_one_others_can_write_is_doubted() {
        use std::os::unix::fs::MetadataExt;
        let d = Dir::new("doubt");
        let open = d.0.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        let inner = open.join("x");
        std::fs::create_dir(&inner).unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let mut c = CPath::new();
        assert!(c.set_dir_of(&inner.join("b.sock")));
        assert_eq!(
            c.open_ancestor(me),
            Some((open.clone(), me, 0o1777)),
            "the nearest directory others can write is named"
        );
        // Without it, only what is above the scratch directory decides,
        // as the same rule says of it.
        let mut c = CPath::new();
        assert!(c.set_dir_of(&d.0.join("b.sock")));
        let above: Vec<_> = d.0.ancestors().skip(1).collect();
        let expect = above.iter().find_map(|a| {
            let m = std::fs::metadata(a).unwrap();
            let ok = (m.uid() == 0 || m.uid() == me) && m.mode() & 0o022 == 0;
            (!ok).then(|| (a.to_path_buf(), m.uid(), m.mode() & 0o7777))
        });
        assert_eq!(c.open_ancestor(me), expect);
    }

    #[test]
    fn a_refusal_names_the_uid_found_and_the_uid_expected() {
        let plain = NotTheBroker {
            path: PathBuf::from("/run/gpufrac/broker.sock"),
            found: Some((4242, 65534)),
            owner: None,
            doubt: None,
        }
        .to_string();
        assert!(
            plain.starts_with(
                "the listener on /run/gpufrac/broker.sock is not the gpufrac broker: it runs as \
                 uid 65534 (pid 4242), and a broker there must run as root (uid 0); nothing was \
                 sent to it"
            ),
            "{plain}"
        );
        let owned = NotTheBroker {
            path: PathBuf::from("/home/a/g/b.sock"),
            found: Some((7, 65534)),
            owner: Some(1000),
            doubt: None,
        }
        .to_string();
        assert!(
            owned.contains("must run as root (uid 0) or as uid 1000, the owner of /home/a/g;"),
            "{owned}"
        );
        let doubted = NotTheBroker {
            path: PathBuf::from("/tmp/gpufrac-1000/broker.sock"),
            found: Some((7, 65534)),
            owner: Some(65534),
            doubt: Some((PathBuf::from("/tmp"), 0, 0o1777)),
        }
        .to_string();
        assert!(
            doubted.contains(
                "must run as root (uid 0); /tmp/gpufrac-1000 belongs to uid 65534, but /tmp \
                 (owner uid 0, mode 1777) lets others make entries, so anyone could have made it"
            ),
            "{doubted}"
        );
    }

    proptest::proptest! {
        /// The rule as an invariant, whatever the uids and the
        /// directories above: a listener is believed only if it is root,
        /// or the owner of the socket's directory and that owner is the
        /// caller or owns, with root, every directory above it, none of
        /// which group or others can write.
        #[test]
        fn only_root_or_a_vouched_owner_is_believed(
            listener in 0u32..4,
            me in 0u32..4,
            owner in proptest::option::of(0u32..4),
            above in proptest::collection::vec((0u32..4, 0u32..0o2000), 0..6),
        ) {
            let mut asked = false;
            let got = verdict(listener, me, owner, |o| {
                asked = true;
                above.iter().position(|&(u, m)| !vouches(o, u, m))
            });
            let owns = owner == Some(listener);
            let third = |u: u32| u != 0 && Some(u) != owner;
            let open = above.iter().any(|&(u, m)| third(u) || m & 0o022 != 0);
            let want = listener == 0 || (owns && (listener == me || !open));
            proptest::prop_assert_eq!(got.is_ok(), want, "{:?}", got);
            // The directories above are looked at only for an owner who
            // is not the caller.
            proptest::prop_assert!(!asked || (owns && listener != 0 && listener != me));
            if let Err((named, doubt)) = got {
                proptest::prop_assert_eq!(named, owner);
                proptest::prop_assert_eq!(doubt.is_some(), owns && open);
            }
        }
    }
}
