//! The socket: where it may be created, created safely, and who is on the
//! other end of a connection (as the kernel says).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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

/// A directory others can write lets them replace the socket (or plant
/// their own before the broker starts): refuse one that is writable by
/// group or others (unless sticky, like /tmp, where only owners may
/// remove) or owned by someone other than root or the broker's user.
fn check_socket_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta =
        std::fs::metadata(dir).map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mode = meta.mode();
    let sticky = mode & 0o1000 != 0;
    if meta.uid() != 0 && meta.uid() != me {
        return Err(format!(
            "the socket directory {} belongs to uid {}, who could replace the socket; \
             use a directory owned by root or by this user (e.g. /run/gpufrac)",
            dir.display(),
            meta.uid()
        ));
    }
    if mode & 0o022 != 0 && !sticky {
        return Err(format!(
            "the socket directory {} is writable by {} (mode {:o}), who could replace the socket; \
             run: chmod go-w {} (or choose another --socket)",
            dir.display(),
            if mode & 0o002 != 0 {
                "everyone"
            } else {
                "its group"
            },
            mode & 0o7777,
            dir.display()
        ));
    }
    Ok(())
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

/// Listens on `path` (mode 0660, group `group` with its gid when given).
pub fn bind(path: &std::path::Path, group: Option<(&str, u32)>) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| no_permission(format!("cannot create {}", dir.display()), &e))?;
        }
        check_socket_dir(dir)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        // Only ever remove a stale socket: a typo in --socket must not
        // delete someone's file.
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; remove it yourself or choose another --socket path",
                path.display()
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "another broker is already listening on {}",
                path.display()
            ));
        }
        // A stale socket from a broker that died.
        let _ = std::fs::remove_file(path);
    }
    let l = UnixListener::bind(path)
        .map_err(|e| no_permission(format!("cannot listen on {}", path.display()), &e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    if let Some((group, gid)) = group {
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| "bad socket path")?;
        // SAFETY: chown of our own socket file; -1 keeps the owner.
        if unsafe { libc::chown(cpath.as_ptr(), u32::MAX, gid) } != 0 {
            return Err(format!(
                "chown {} to group {group}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(l)
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
/// `SO_PEERGROUPS` (Linux 4.13 and later; none where the kernel cannot
/// say), and the process's start time, read while a pidfd holds the
/// process (`SO_PEERPIDFD`, else `pidfd_open` of the pid) and trusted
/// only if the process is still alive after the read: then the pid was
/// still its own. None when the kernel gives nothing, or the process has
/// already exited (nothing it sent could be told from what the next
/// holder of its pid sends).
pub fn peer(fd: i32) -> Option<Accepted> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || cred.pid <= 0 {
        return None;
    }
    let pid = cred.pid as u32;
    let pidfd = match pidfd_of(fd, cred.pid) {
        Ok(p) => p,
        Err(()) => return None,
    };
    let start = gpufrac_common::procfs::start_time(pid)?;
    if pidfd.as_ref().is_some_and(exited) {
        return None;
    }
    Some(Accepted {
        peer: Peer {
            pid,
            uid: cred.uid,
            gid: cred.gid,
            groups: peer_groups(fd),
            start_time: Some(start),
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
    // An older kernel: the pid, which the start time read below checks.
    // SAFETY: pidfd_open takes a pid and flags and returns a descriptor.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if r >= 0 {
        // SAFETY: as above.
        return Ok(Some(unsafe { OwnedFd::from_raw_fd(r as i32) }));
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ESRCH) => Err(()),
        _ => Ok(None),
    }
}

/// Whether the process of `pidfd` has exited (it is readable then).
pub fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll of one pollfd, without waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
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

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let got = peer(a.as_raw_fd()).unwrap();
        let p = got.peer;
        assert_eq!(p.pid, std::process::id());
        // SAFETY: getuid/getgid have no preconditions.
        assert_eq!((p.uid, p.gid), unsafe { (libc::getuid(), libc::getgid()) });
        // SAFETY: getgroups with a zero size only counts.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        assert_eq!(p.groups.len(), n as usize);
        assert_eq!(
            p.start_time,
            gpufrac_common::procfs::start_time(std::process::id())
        );
        let pidfd = got.pidfd.expect("this kernel has pidfds");
        assert!(!exited(&pidfd));
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
        assert!(peer(s.as_raw_fd()).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
