//! Connecting to the broker's Unix socket within a deadline.
//!
//! `UnixStream::connect` blocks for as long as the listener's accept queue
//! is full, which is what a flood of connections that never say hello, or a
//! stopped (SIGSTOP) broker, leaves behind: a CLI command or a process in
//! `cuInit` would hang with it. Here the socket is non-blocking while it
//! connects: a full queue answers `EAGAIN` at once (Unix sockets never
//! queue the connect itself), which is retried until the deadline.
//!
//! Shared by the shim and the CLI; not on any per-CUDA-call path.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
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
}
