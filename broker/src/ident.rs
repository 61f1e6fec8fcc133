//! Which process a pid names: a number that no later process given the
//! same pid shares, so that a job, a connection's peer and an ancestor in
//! a process's tree are told apart from whoever takes their pid next.
//!
//! Where the kernel has pidfs (Linux 6.9 and later), it is the inode
//! number of a pidfd: unique to the process for the boot, and one `fstat`
//! of the pidfd a connection already comes with. Elsewhere it is the
//! start time from `/proc/PID/stat`: an open, a read of a page the kernel
//! generates, and a close, which measured a sixth of the broker's CPU for
//! a connection's life (docs/broker.md). One kind for the broker's life,
//! found at start (`kind`): marks of two kinds never meet, and the state
//! file says which kind it holds (`jobs.rs`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// What a process's mark is on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// The inode number of a pidfd (pidfs: Linux 6.9 and later, 64-bit).
    Pidfs,
    /// The start time in clock ticks after boot (`/proc/PID/stat`).
    StartTime,
}

/// pidfs's `f_type`: the kernel's `PID_FS_MAGIC`.
const PID_FS_MAGIC: i64 = 0x5049_4446;

/// This host's kind, found once: pidfs where a pidfd of this process
/// lives on it, else start times. Before pidfs, pidfds were anonymous
/// inodes that all share one number, so the file system is what is
/// checked, never the kernel's version.
pub fn kind() -> Kind {
    static KIND: OnceLock<Kind> = OnceLock::new();
    *KIND.get_or_init(|| {
        let pidfs = pidfd_open(std::process::id()).is_some_and(|fd| on_pidfs(&fd));
        if pidfs && std::mem::size_of::<libc::ino_t>() == 8 {
            Kind::Pidfs
        } else {
            Kind::StartTime
        }
    })
}

fn on_pidfs(fd: &OwnedFd) -> bool {
    // SAFETY: fstatfs into a zeroed struct of its type.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor we own, and the struct above.
    let ok = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut s) } == 0;
    ok && s.f_type as i64 == PID_FS_MAGIC
}

/// A pidfd for `pid`, None where it has gone (or the kernel has none).
pub fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a descriptor.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: the kernel just gave us this descriptor.
    (r >= 0).then(|| unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// The inode number of a pidfd (meaningful only on pidfs).
fn inode(fd: &OwnedFd) -> Option<u64> {
    // SAFETY: fstat into a zeroed struct of its type.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a descriptor we own, and the struct above.
    (unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0).then_some(st.st_ino)
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

/// The mark of the process a pidfd holds (pid `pid`), if it is still
/// alive: on pidfs its inode; else its start time, read while the pidfd
/// holds the process and trusted only if it is still alive after the
/// read (then the pid was still its own).
pub fn of_pidfd(kind: Kind, pidfd: &OwnedFd, pid: u32) -> Option<u64> {
    let mark = match kind {
        Kind::Pidfs => inode(pidfd)?,
        Kind::StartTime => gpufrac_common::procfs::start_time(pid)?,
    };
    (!exited(pidfd)).then_some(mark)
}

/// The mark of whichever process holds `pid` now; None: none does.
pub fn of_pid(kind: Kind, pid: u32) -> Option<u64> {
    match kind {
        Kind::Pidfs => inode(&pidfd_open(pid)?),
        Kind::StartTime => gpufrac_common::procfs::start_time(pid),
    }
}

/// The parent of the process that holds `pid` and its mark, from one
/// look at it. On pidfs the parent is read from /proc while a pidfd holds
/// the process, and kept only if it has not exited since (a zombie's
/// chain ends at it: its pid may be another's by the time it is read).
pub fn parent_and_mark(kind: Kind, pid: u32) -> (Option<u32>, Option<u64>) {
    match kind {
        Kind::StartTime => gpufrac_common::procfs::parent_and_start(pid),
        Kind::Pidfs => {
            let Some(fd) = pidfd_open(pid) else {
                return (None, None);
            };
            let parent = gpufrac_common::procfs::parent(pid);
            let mark = inode(&fd);
            if exited(&fd) {
                (None, mark)
            } else {
                (parent, mark)
            }
        }
    }
}

/// A mark of kind `from` (a state file's) as one of kind `to` (this
/// broker's): the same number where the kinds agree; else the process
/// `pid` holds now, if its start time is `mark` (a file of start times
/// read on a host with pidfs). None: that process is gone, or the kinds
/// cannot be matched (pidfs marks where there is no pidfs: another
/// kernel, so another boot, and every process of the file is gone).
pub fn convert(from: Kind, to: Kind, pid: u32, mark: u64) -> Option<u64> {
    match (from, to) {
        _ if from == to => Some(mark),
        (Kind::StartTime, Kind::Pidfs) => {
            let fd = pidfd_open(pid)?;
            let same = gpufrac_common::procfs::start_time(pid) == Some(mark);
            (same && !exited(&fd)).then(|| inode(&fd)).flatten()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        std::process::id()
    }

    #[test]
    fn a_process_has_one_mark_of_each_kind_whoever_asks() {
        for kind in [kind(), Kind::StartTime] {
            let fd = pidfd_open(me()).unwrap();
            let mark = of_pidfd(kind, &fd, me()).unwrap();
            assert_eq!(of_pid(kind, me()), Some(mark), "{kind:?}");
            assert_eq!(parent_and_mark(kind, me()).1, Some(mark), "{kind:?}");
            assert_eq!(
                parent_and_mark(kind, me()).0,
                gpufrac_common::procfs::parent(me()),
                "{kind:?}"
            );
            assert_eq!(of_pid(kind, u32::MAX), None);
            assert_eq!(parent_and_mark(kind, u32::MAX), (None, None));
        }
        assert_eq!(
            of_pid(Kind::StartTime, me()),
            gpufrac_common::procfs::start_time(me())
        );
    }

    #[test]
    fn the_kind_is_pidfs_exactly_where_pidfds_live_on_pidfs() {
        let fd = pidfd_open(me()).unwrap();
        assert_eq!(kind() == Kind::Pidfs, on_pidfs(&fd));
        if kind() == Kind::Pidfs {
            // Another process, another mark; the same one, the same.
            let child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let theirs = of_pid(Kind::Pidfs, child.id()).unwrap();
            assert_ne!(theirs, of_pid(Kind::Pidfs, me()).unwrap());
            assert_eq!(of_pid(Kind::Pidfs, child.id()), Some(theirs));
            let mut child = child;
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// A process that exited has no mark through its pidfd: its pid may be
    /// the next process's.
    #[test]
    fn an_exited_process_has_no_mark() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        child.wait().unwrap();
        for kind in [kind(), Kind::StartTime] {
            assert_eq!(of_pidfd(kind, &fd, child.id()), None, "{kind:?}");
        }
    }

    #[test]
    fn a_start_time_converts_to_the_live_process_with_it_and_nothing_else() {
        let start = gpufrac_common::procfs::start_time(me()).unwrap();
        assert_eq!(convert(Kind::StartTime, Kind::StartTime, me(), 7), Some(7));
        assert_eq!(convert(Kind::Pidfs, Kind::Pidfs, me(), 7), Some(7));
        assert_eq!(convert(Kind::Pidfs, Kind::StartTime, me(), start), None);
        if kind() == Kind::Pidfs {
            assert_eq!(
                convert(Kind::StartTime, Kind::Pidfs, me(), start),
                of_pid(Kind::Pidfs, me())
            );
            // Another start time: a process that held this pid before.
            assert_eq!(convert(Kind::StartTime, Kind::Pidfs, me(), start + 1), None);
            assert_eq!(convert(Kind::StartTime, Kind::Pidfs, u32::MAX, start), None);
        }
    }
}
