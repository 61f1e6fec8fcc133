//! The socket: where it may be created, created safely, and who is on the
//! other end of a connection (as the kernel says).

use std::os::fd::{FromRawFd, OwnedFd};

use mio::net::UnixListener;

use crate::authority::Peer;

/// `what: e`, and for a permission error where to put the socket instead.
pub fn no_permission(what: String, e: &std::io::Error) -> String {
    if e.kind() != std::io::ErrorKind::PermissionDenied {
        return format!("{what}: {e}");
    }
    let p = crate::user_socket();
    format!(
        "{what}: {e}; run the broker as root, or give it a socket in a directory you can write, \
         for gpufrac run, gpufrac status and the programs you start too:\n    \
         gpufrac broker --socket {p} &\n    export GPUFRAC_SOCKET={p}",
        p = p.display()
    )
}

/// A directory another user can write lets them take the socket's path:
/// bind their own listener there while the broker restarts (or before it
/// first starts) and answer its clients. Sticky or not: the sticky bit
/// only stops them removing a socket that is there, and a restart leaves
/// a moment when there is none to remove. So the socket's directory must
/// be root's or this user's and writable by nobody else, and every
/// directory above it root's or this user's, writable by nobody else
/// unless sticky (in /tmp others cannot rename a directory that is not
/// theirs). The refusal names the directory, its owner and mode, and what
/// would be right; the accepted one is logged at start.
fn check_socket_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let abs = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let meta =
        std::fs::metadata(&abs).map_err(|e| format!("cannot inspect {}: {e}", abs.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mode = meta.mode() & 0o7777;
    let right = right_dir(me);
    if meta.uid() != 0 && meta.uid() != me {
        return Err(format!(
            "the socket's directory {} belongs to uid {} (mode {mode:o}), who could take the \
             socket's path and answer this broker's clients; expected a directory of root's or of \
             uid {me} that nobody else can write: {right}",
            abs.display(),
            meta.uid()
        ));
    }
    if mode & 0o022 != 0 {
        let sticky = mode & 0o1000 != 0;
        // A shared directory like /tmp is for everyone: not to be closed.
        let fix = if sticky {
            right
        } else {
            format!("run `chmod go-w {}`, or use {right}", abs.display())
        };
        return Err(format!(
            "the socket's directory {} (owner uid {}, mode {mode:o}) is writable by {}{}, who \
             could take the socket's path while this broker restarts and answer its clients; \
             expected a directory that only uid {} can write: {fix}",
            abs.display(),
            meta.uid(),
            if mode & 0o002 != 0 {
                "everyone"
            } else {
                "its group"
            },
            if sticky { " (sticky or not)" } else { "" },
            meta.uid()
        ));
    }
    for above in abs.ancestors().skip(1) {
        let Ok(m) = std::fs::metadata(above) else {
            continue;
        };
        let am = m.mode() & 0o7777;
        if (m.uid() != 0 && m.uid() != me) || (am & 0o022 != 0 && am & 0o1000 == 0) {
            return Err(format!(
                "the socket's directory {} is inside {} (owner uid {}, mode {am:o}), whose owner \
                 or other users could move it away and put their own in its place; expected \
                 directories above it of root's or of uid {me}, writable by nobody else unless \
                 sticky: {right}",
                abs.display(),
                above.display(),
                m.uid()
            ));
        }
    }
    tracing::info!(
        "socket directory {} (owner uid {}, mode {mode:o}): only root and its owner may listen \
         there, and clients believe no one else",
        abs.display(),
        meta.uid()
    );
    Ok(())
}

/// What a refused socket directory should have been instead.
fn right_dir(me: u32) -> String {
    if me == 0 {
        "the default, /run/gpufrac/broker.sock, or --socket in a directory made with \
         `install -d -m 755 DIR`"
            .into()
    } else {
        format!(
            "--socket {} (a directory of your own), or one made with `install -d -m 700 DIR`",
            crate::user_socket().display()
        )
    }
}

/// Raises the soft file limit to the hard one: every client is a socket.
pub fn raise_nofile() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: get/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) != 0 {
            return 0;
        }
        if rl.rlim_cur < rl.rlim_max {
            let want = libc::rlimit {
                rlim_cur: rl.rlim_max,
                rlim_max: rl.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return want.rlim_cur;
            }
        }
    }
    rl.rlim_cur
}

/// Listens on `path` (mode 0660, group `group` with its gid when given),
/// without ever leaving the path free for another user to take: the
/// listener is bound under a temporary name in the same private
/// directory, given its mode and group, and renamed over the path, which
/// replaces a stale socket in one step. A clean stop leaves the socket in
/// place too (see `server`), so from the first start on the path is
/// always this broker's, live or stale.
pub fn bind(path: &std::path::Path, group: Option<(&str, u32)>) -> Result<UnixListener, String> {
    let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d.to_path_buf(),
        None => std::path::PathBuf::from("."),
    };
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&dir)
            .map_err(|e| no_permission(format!("cannot create {}", dir.display()), &e))?;
    }
    check_socket_dir(&dir)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only ever replace a stale socket: a typo in --socket must not
        // delete someone's file.
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; remove it yourself or choose another --socket path",
                path.display()
            ));
        }
        if let Ok(s) = std::os::unix::net::UnixStream::connect(path) {
            let who = match gpufrac_common::net::peer_cred(&s) {
                Some(c) => format!(" (uid {}, pid {})", c.uid, c.pid),
                None => String::new(),
            };
            return Err(format!(
                "another broker{who} is already listening on {}; stop it first, or choose \
                 another --socket path",
                path.display()
            ));
        }
    }
    let staged = staging_name(path);
    let at = staged.as_deref().unwrap_or(path);
    if let Ok(meta) = std::fs::symlink_metadata(at) {
        use std::os::unix::fs::FileTypeExt;
        // Left by a start that died between bind and rename, or (bound
        // in place) the stale socket itself; nobody else can write this
        // directory.
        if meta.file_type().is_socket() {
            let _ = std::fs::remove_file(at);
        }
    }
    let l = UnixListener::bind(at)
        .map_err(|e| no_permission(format!("cannot listen on {}", path.display()), &e))?;
    let ready = (|| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(at, std::fs::Permissions::from_mode(0o660))
            .map_err(|e| format!("chmod {}: {e}", at.display()))?;
        if let Some((group, gid)) = group {
            let cpath = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
                .map_err(|_| "bad socket path")?;
            // SAFETY: chown of our own socket file; -1 keeps the owner.
            if unsafe { libc::chown(cpath.as_ptr(), u32::MAX, gid) } != 0 {
                return Err(format!(
                    "chown {} to group {group}: {}",
                    at.display(),
                    std::io::Error::last_os_error()
                ));
            }
        }
        if staged.is_some() {
            std::fs::rename(at, path).map_err(|e| {
                format!(
                    "cannot move the new socket {} over {}: {e}",
                    at.display(),
                    path.display()
                )
            })?;
        }
        Ok::<(), String>(())
    })();
    if let Err(e) = ready {
        let _ = std::fs::remove_file(at);
        return Err(e);
    }
    Ok(l)
}

/// A name beside `path` for the listener before it is renamed over it:
/// `.NAME.PID`, or `.PID` where that would not fit in a socket address
/// (107 bytes). None where neither fits: then the listener is bound at
/// `path` itself, which a stale socket must first leave (no other user
/// can write the directory, so the moment between is nobody's to use).
fn staging_name(path: &std::path::Path) -> Option<std::path::PathBuf> {
    const MAX: usize = 107;
    let pid = std::process::id();
    let name = path.file_name()?.to_string_lossy();
    [format!(".{name}.{pid}"), format!(".{pid}")]
        .into_iter()
        .map(|n| path.with_file_name(n))
        .find(|p| p.as_os_str().len() <= MAX)
}

/// A connection's peer as found at accept, and a pidfd that says when its
/// process exits (None on a kernel without pidfds).
pub struct Accepted {
    pub peer: Peer,
    pub pidfd: Option<OwnedFd>,
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd for the process that connected,
/// taken by the kernel at connect, so no pid reuse can come between.
const SO_PEERPIDFD: libc::c_int = 77;

/// The peer of a connection, fixed now for the connection's life: pid,
/// uid and gid from `SO_PEERCRED`, supplementary groups from
/// `SO_PEERGROUPS` when `groups` asks for them (Linux 4.13 and later;
/// none where the kernel cannot say), and the process's mark
/// (`ident`: its pidfs inode, else its start time), taken from a pidfd
/// that holds the process (`SO_PEERPIDFD`, else `pidfd_open` of the pid)
/// and trusted only if the process is still alive after it: then the pid
/// was still its own. None when the kernel gives
/// nothing, or the process has already exited (nothing it sent could be
/// told from what the next holder of its pid sends).
pub fn peer(fd: i32, groups: bool) -> Option<Accepted> {
    // SAFETY: the caller's descriptor, borrowed for this call only.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let cred = gpufrac_common::net::peer_cred(&borrowed)?;
    if cred.pid <= 0 {
        return None;
    }
    let pid = cred.pid as u32;
    let pidfd = match pidfd_of(fd, cred.pid) {
        Ok(p) => p,
        Err(()) => return None,
    };
    let ident = match &pidfd {
        Some(fd) => crate::ident::of_pidfd(crate::ident::kind(), fd, pid)?,
        // No pidfds at all (before Linux 5.3): no pidfs either.
        None => gpufrac_common::procfs::start_time(pid)?,
    };
    Some(Accepted {
        peer: Peer {
            pid,
            uid: cred.uid,
            gid: cred.gid,
            groups: if groups { peer_groups(fd) } else { Vec::new() },
            ident: Some(ident),
        },
        pidfd,
    })
}

/// A pidfd for the peer of `fd` (pid `pid`): Ok(None) where the kernel
/// has none to give, Err when the process is gone.
fn pidfd_of(fd: i32, pid: libc::pid_t) -> Result<Option<OwnedFd>, ()> {
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int of its size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc == 0 && pidfd >= 0 {
        // SAFETY: the kernel just gave us this descriptor.
        return Ok(Some(unsafe { OwnedFd::from_raw_fd(pidfd) }));
    }
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return Err(());
    }
    // An older kernel: a pidfd of the pid, which the mark's read checks.
    match crate::ident::pidfd_open(pid as u32) {
        Some(fd) => Ok(Some(fd)),
        None if std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) => Err(()),
        None => Ok(None),
    }
}

fn peer_groups(fd: i32) -> Vec<u32> {
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<u32>()) as libc::socklen_t;
        // SAFETY: getsockopt into a buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<u32>();
        if rc == 0 {
            groups.truncate(n);
            return groups;
        }
        let e = std::io::Error::last_os_error().raw_os_error();
        if e == Some(libc::ERANGE) && n > groups.len() && n <= 1 << 16 {
            groups.resize(n, 0);
            continue;
        }
        return Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gpufrac-listen-{tag}-{}-{}",
            std::process::id(),
            gpufrac_common::clock::mono_ns()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// /tmp's kind: anyone may bind a name there while the broker is
    /// away, so the broker does not listen there at all.
    #[test]
    fn a_directory_others_can_write_is_refused_sticky_or_not() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("open");
        for (mode, who) in [(0o1777, "everyone (sticky or not)"), (0o775, "its group")] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = bind(&d.join("b.sock"), None).map(|_| ()).unwrap_err();
            assert!(
                e.contains(&format!("the socket's directory {}", d.display()))
                    && e.contains(&format!("mode {mode:o}"))
                    && e.contains(&format!("is writable by {who}"))
                    && e.contains("expected a directory that only uid"),
                "{e}"
            );
            assert!(!d.join("b.sock").exists());
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_stale_socket_is_replaced_in_one_step_and_a_live_one_is_not() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("stale");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = d.join("b.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let old = std::fs::metadata(&path).unwrap();
        let l = bind(&path, None).unwrap();
        use std::os::unix::fs::MetadataExt;
        let new = std::fs::metadata(&path).unwrap();
        assert_ne!(old.ino(), new.ino(), "the stale socket was replaced");
        assert_eq!(new.mode() & 0o777, 0o660);
        // The new listener answers at the path, and nothing else is left.
        let _c = std::os::unix::net::UnixStream::connect(&path).unwrap();
        assert!(l.accept().is_ok());
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from("b.sock")]);
        let e = bind(&path, None).map(|_| ()).unwrap_err();
        assert!(
            e.contains(&format!("(uid {}, pid {})", new.uid(), std::process::id()))
                && e.contains("is already listening on"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let got = peer(a.as_raw_fd(), true).unwrap();
        let p = got.peer;
        assert_eq!(p.pid, std::process::id());
        // SAFETY: getuid/getgid have no preconditions.
        assert_eq!((p.uid, p.gid), unsafe { (libc::getuid(), libc::getgid()) });
        // SAFETY: getgroups with a zero size only counts.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        assert_eq!(p.groups.len(), n as usize);
        // Not asked for: not read (the same process, the same groups).
        let unasked = peer(a.as_raw_fd(), false).unwrap().peer;
        assert_eq!(unasked.groups, Vec::<u32>::new());
        assert_eq!(
            unasked,
            Peer {
                groups: Vec::new(),
                ..p.clone()
            }
        );
        assert_eq!(
            p.ident,
            crate::ident::of_pid(crate::ident::kind(), std::process::id())
        );
        let pidfd = got.pidfd.expect("this kernel has pidfds");
        assert!(!crate::ident::exited(&pidfd));
    }

    /// The attack this stops: a process connects, dies, and its pid goes
    /// to a victim before the broker looks; the connection must not be
    /// taken for the victim's.
    #[test]
    fn a_connection_whose_process_has_exited_is_refused_at_accept() {
        let dir = std::env::temp_dir().join(format!("gpufrac-listen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(c.as_bytes()) {
            *d = *s as libc::c_char;
        }
        // SAFETY: the child makes only async-signal-safe calls (socket,
        // connect, _exit) before it exits.
        let child = unsafe { libc::fork() };
        if child == 0 {
            unsafe {
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                libc::connect(
                    s,
                    (&addr as *const libc::sockaddr_un).cast(),
                    std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
                );
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        let (s, _) = l.accept().unwrap();
        assert!(peer(s.as_raw_fd(), true).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
