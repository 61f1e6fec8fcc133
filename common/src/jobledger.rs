//! One memory ledger for a whole job: every process of a `gpufrac run
//! --gpu-memory SIZE` (and their descendants) charges the same books, so the
//! job as a whole never holds more than SIZE on a GPU, however many
//! processes it starts.
//!
//! The books live in a small file mapped shared by every process of the job
//! (`gpufrac run` creates it and names it in `GPUFRAC_JOB_LEDGER`). They are
//! kept under a process-shared *robust* mutex: a process killed while holding
//! it cannot wedge the others — the next one to lock it is told, and rebuilds
//! the totals from the per-process slots, which are the truth. Each process
//! charges its own slot; the memory of a process that has died is returned
//! the moment anyone would otherwise be refused.
//!
//! A slot's process is alive while it holds a POSIX record lock on the
//! slot's byte of the file (past the books themselves). The kernel drops the
//! lock when the process dies, execs or is killed, in any pid namespace: a
//! container's processes share the books through a bind mount, and their
//! pids mean nothing to the host's /proc or to another container's.
//!
//! No allocation on the charge path; the only system calls are the futex of
//! an uncontended lock and, when a charge would be refused, a look at
//! `/proc` for dead processes.

use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// "gpfrjob1"
const MAGIC: u64 = 0x6770_6672_6a6f_6231;
/// GPUs one job may use, and processes one job may run on the GPU at once.
pub const MAX_GPUS: usize = 8;
pub const MAX_SLOTS: usize = 256;

#[repr(C)]
struct Slot {
    /// 0: free.
    pid: u32,
    _pad: u32,
    /// The process's start time (clock ticks after boot): a recycled pid is
    /// not the same process.
    start: u64,
    used: [u64; MAX_GPUS],
}

#[repr(C)]
struct Shared {
    magic: AtomicU64,
    /// Bytes per GPU for the whole job.
    cap: u64,
    lock: libc::pthread_mutex_t,
    ngpus: u64,
    gpus: [[u8; 16]; MAX_GPUS],
    /// Σ of the live slots' `used`: a cache, rebuilt after a holder died.
    used: [u64; MAX_GPUS],
    peak: [u64; MAX_GPUS],
    slots: [Slot; MAX_SLOTS],
}

/// A process's view of a job's books.
pub struct JobLedger {
    shared: *mut Shared,
    /// Kept open: closing any descriptor of the file would drop this
    /// process's slot locks.
    fd: libc::c_int,
}

/// The byte whose lock says slot `i`'s process lives.
fn lock_byte(i: usize) -> libc::off_t {
    (std::mem::size_of::<Shared>() + i) as libc::off_t
}

fn flock_for(kind: libc::c_int, i: usize) -> libc::flock {
    // SAFETY: a plain C struct; zero is a valid value for every field.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = lock_byte(i);
    fl.l_len = 1;
    fl
}

// SAFETY: all access to the shared books goes through the process-shared
// mutex, or reads plain words (the magic, the cap) that never change after
// creation.
unsafe impl Send for JobLedger {}
unsafe impl Sync for JobLedger {}

fn start_time(pid: u32) -> u64 {
    crate::procfs::start_time(pid).unwrap_or(0)
}

/// Whether slot `i`'s process lives: ours, or someone holds its lock.
fn alive(fd: libc::c_int, i: usize, slot: &Slot) -> bool {
    let me = std::process::id();
    if slot.pid == me && slot.start == start_time(me) {
        // Our own locks never conflict with us, so F_GETLK cannot tell.
        return true;
    }
    let mut fl = flock_for(libc::F_WRLCK, i);
    // SAFETY: F_GETLK fills the struct we own.
    if unsafe { libc::fcntl(fd, libc::F_GETLK, &mut fl) } == 0 {
        return fl.l_type != libc::F_UNLCK as libc::c_short;
    }
    // No record locks on this file system: the pid is the best we have.
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(slot.pid as libc::pid_t, 0) } == 0
        || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && start_time(slot.pid) == slot.start
}

struct Locked<'a> {
    s: &'a mut Shared,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: we hold it.
        unsafe { libc::pthread_mutex_unlock(&mut self.s.lock) };
    }
}

impl JobLedger {
    /// Creates the books for a job capped at `cap` bytes per GPU (by
    /// `gpufrac run`), readable and writable by the owner only.
    pub fn create(path: &str, cap: u64) -> io::Result<JobLedger> {
        let c = CString::new(path).map_err(|_| io::Error::other("NUL in path"))?;
        // SAFETY: plain file creation; O_EXCL so nobody else's file is used.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let l = Self::map(fd, true)?;
        // SAFETY: freshly created and zeroed by ftruncate; no one else has
        // it until its name is handed to the child.
        unsafe {
            let s = &mut *l.shared;
            s.cap = cap;
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            libc::pthread_mutex_init(&mut s.lock, &attr);
            libc::pthread_mutexattr_destroy(&mut attr);
            s.magic.store(MAGIC, Ordering::Release);
        }
        Ok(l)
    }

    /// Opens the books a `gpufrac run` created.
    pub fn open(path: &str) -> io::Result<JobLedger> {
        let c = CString::new(path).map_err(|_| io::Error::other("NUL in path"))?;
        // SAFETY: plain open.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let l = Self::map(fd, false)?;
        // SAFETY: mapped, at least the header's size.
        if unsafe { &*l.shared }.magic.load(Ordering::Acquire) != MAGIC {
            return Err(io::Error::other("not a gpufrac job ledger"));
        }
        Ok(l)
    }

    fn map(fd: libc::c_int, size_it: bool) -> io::Result<JobLedger> {
        let len = std::mem::size_of::<Shared>();
        // SAFETY: fd is ours; the mapping outlives the fd.
        unsafe {
            if size_it && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = io::Error::last_os_error();
                libc::close(fd);
                return Err(e);
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 || (st.st_size as usize) < len {
                libc::close(fd);
                return Err(io::Error::other("job ledger file too short"));
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            if p == libc::MAP_FAILED {
                let e = io::Error::last_os_error();
                libc::close(fd);
                return Err(e);
            }
            Ok(JobLedger {
                shared: p.cast(),
                fd,
            })
        }
    }

    pub fn cap(&self) -> u64 {
        // SAFETY: written once before the magic was published.
        unsafe { (*self.shared).cap }
    }

    fn lock(&self) -> Locked<'_> {
        // SAFETY: the mutex lives in the shared mapping for our lifetime.
        let s = unsafe { &mut *self.shared };
        let rc = unsafe { libc::pthread_mutex_lock(&mut s.lock) };
        if rc == libc::EOWNERDEAD {
            // Its holder died mid-update: the slots are the truth.
            // SAFETY: we hold it now.
            unsafe { libc::pthread_mutex_consistent(&mut s.lock) };
            rebuild(self.fd, s);
        }
        Locked { s }
    }

    /// Takes a slot for this process; None when the job runs more processes
    /// on the GPU than the books have room for.
    pub fn attach(&self, pid: u32) -> Option<usize> {
        let start = start_time(pid);
        let g = self.lock();
        let s = &mut *g.s;
        if let Some(i) = s
            .slots
            .iter()
            .position(|x| x.pid == pid && x.start == start)
        {
            return Some(i);
        }
        let free = match s.slots.iter().position(|x| x.pid == 0) {
            Some(i) => i,
            None => {
                reclaim(self.fd, s);
                s.slots.iter().position(|x| x.pid == 0)?
            }
        };
        let fl = flock_for(libc::F_WRLCK, free);
        // SAFETY: F_SETLK reads the struct we own. A failure (a file system
        // without record locks) leaves liveness to the pid.
        unsafe { libc::fcntl(self.fd, libc::F_SETLK, &fl) };
        let slot = &mut s.slots[free];
        slot.pid = pid;
        slot.start = start;
        slot.used = [0; MAX_GPUS];
        Some(free)
    }

    /// The index of a GPU (by UUID) in the books, added if new; None when
    /// the job already uses as many GPUs as the books hold.
    pub fn gpu(&self, uuid: &[u8; 16]) -> Option<usize> {
        let g = self.lock();
        let s = &mut *g.s;
        let n = s.ngpus as usize;
        if let Some(i) = s.gpus[..n].iter().position(|u| u == uuid) {
            return Some(i);
        }
        if n == MAX_GPUS {
            return None;
        }
        s.gpus[n] = *uuid;
        s.ngpus += 1;
        Some(n)
    }

    /// Charges `size` to this process's slot on GPU `gpu`, unless the job
    /// would pass its cap there.
    pub fn reserve(&self, slot: usize, gpu: usize, size: u64) -> bool {
        let g = self.lock();
        let s = &mut *g.s;
        let cap = s.cap;
        let fits = |s: &Shared| s.used[gpu].checked_add(size).is_some_and(|n| n <= cap);
        if !fits(s) {
            // Memory of processes that died is the job's again.
            reclaim(self.fd, s);
            if !fits(s) {
                return false;
            }
        }
        s.slots[slot].used[gpu] += size;
        s.used[gpu] += size;
        s.peak[gpu] = s.peak[gpu].max(s.used[gpu]);
        true
    }

    pub fn unreserve(&self, slot: usize, gpu: usize, size: u64) {
        let g = self.lock();
        let s = &mut *g.s;
        let mine = &mut s.slots[slot].used[gpu];
        let size = size.min(*mine);
        *mine -= size;
        s.used[gpu] = s.used[gpu].saturating_sub(size);
    }

    /// What the whole job holds on GPU `gpu`.
    pub fn used(&self, gpu: usize) -> u64 {
        self.lock().s.used[gpu]
    }

    /// Gives a slot up (its process is done with CUDA, or exiting).
    pub fn detach(&self, slot: usize) {
        let g = self.lock();
        let s = &mut *g.s;
        for (i, u) in s.slots[slot].used.iter().enumerate() {
            s.used[i] = s.used[i].saturating_sub(*u);
        }
        s.slots[slot] = Slot {
            pid: 0,
            _pad: 0,
            start: 0,
            used: [0; MAX_GPUS],
        };
        let fl = flock_for(libc::F_UNLCK, slot);
        // SAFETY: as in attach.
        unsafe { libc::fcntl(self.fd, libc::F_SETLK, &fl) };
    }

    /// Returns the slots of processes that have died; what they held.
    pub fn reclaim_dead(&self) -> u64 {
        let g = self.lock();
        reclaim(self.fd, g.s)
    }

    /// Per GPU (UUID, used, peak), for status and tests.
    pub fn totals(&self) -> Vec<([u8; 16], u64, u64)> {
        let g = self.lock();
        let s = &*g.s;
        (0..s.ngpus as usize)
            .map(|i| (s.gpus[i], s.used[i], s.peak[i]))
            .collect()
    }
}

impl Drop for JobLedger {
    fn drop(&mut self) {
        // SAFETY: our own mapping and descriptor.
        unsafe {
            libc::munmap(self.shared.cast(), std::mem::size_of::<Shared>());
            libc::close(self.fd);
        }
    }
}

fn reclaim(fd: libc::c_int, s: &mut Shared) -> u64 {
    let mut freed = 0;
    for (i, slot) in s.slots.iter_mut().enumerate() {
        if slot.pid != 0 && !alive(fd, i, slot) {
            for (i, u) in slot.used.iter().enumerate() {
                s.used[i] = s.used[i].saturating_sub(*u);
                freed += *u;
            }
            *slot = Slot {
                pid: 0,
                _pad: 0,
                start: 0,
                used: [0; MAX_GPUS],
            };
        }
    }
    freed
}

fn rebuild(fd: libc::c_int, s: &mut Shared) {
    let mut used = [0u64; MAX_GPUS];
    for slot in s.slots.iter().filter(|x| x.pid != 0) {
        for (i, u) in slot.used.iter().enumerate() {
            used[i] += *u;
        }
    }
    s.used = used;
    reclaim(fd, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(name: &str) -> String {
        format!(
            "{}/gpufrac-jl-{name}-{}",
            std::env::temp_dir().display(),
            std::process::id()
        )
    }

    #[test]
    fn charges_are_shared_and_capped() {
        let p = path("cap");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let b = JobLedger::open(&p).unwrap();
        let me = std::process::id();
        let sa = a.attach(me).unwrap();
        let sb = b.attach(me).unwrap();
        assert_eq!(sa, sb, "one process, one slot");
        let g = a.gpu(&[1; 16]).unwrap();
        assert_eq!(b.gpu(&[1; 16]), Some(g));
        assert!(a.reserve(sa, g, 60));
        assert!(!b.reserve(sb, g, 41));
        assert!(b.reserve(sb, g, 40));
        assert_eq!(a.used(g), 100);
        a.unreserve(sa, g, 30);
        assert_eq!(b.used(g), 70);
        assert_eq!(a.totals(), vec![([1; 16], 70, 100)]);
        a.detach(sa);
        assert_eq!(a.used(g), 0);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn a_dead_process_gives_its_memory_back() {
        let p = path("dead");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let g = a.gpu(&[2; 16]).unwrap();
        // A child takes memory and dies holding the lock.
        // SAFETY: the child only calls into the ledger and _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let b = JobLedger::open(&p).unwrap();
            let s = b.attach(std::process::id()).unwrap();
            let ok = b.reserve(s, g, 90);
            std::mem::forget(b.lock());
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0);
        let me = a.attach(std::process::id()).unwrap();
        // The lock its holder died with is recovered, and so is its memory.
        assert!(a.reserve(me, g, 100));
        assert_eq!(a.used(g), 100);
        std::fs::remove_file(&p).unwrap();
    }

    /// A process in another pid namespace (a container) writes a pid that
    /// names some unrelated process here, or none at all: liveness must not
    /// depend on it.
    #[test]
    fn liveness_does_not_trust_the_pid() {
        let p = path("ns");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let g = a.gpu(&[3; 16]).unwrap();
        let mut fds = [0; 2];
        // SAFETY: a pipe into a local array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // Two children that each charge 40 under a pid that is not theirs:
        // one under init's (alive forever), which then exits; one under a
        // pid that does not exist, which stays until told.
        let spawn = |fake: u32, stay: bool| {
            // SAFETY: the child only uses the ledger, read and _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let b = JobLedger::open(&p).unwrap();
                let s = b.attach(fake).unwrap();
                let ok = b.reserve(s, g, 40);
                if stay {
                    let mut byte = 0u8;
                    // SAFETY: blocks until the parent closes its end (ours
                    // is closed first, or read would never see the end).
                    unsafe {
                        libc::close(fds[1]);
                        libc::read(fds[0], (&raw mut byte).cast(), 1)
                    };
                }
                unsafe { libc::_exit(if ok { 0 } else { 1 }) };
            }
            pid
        };
        let gone = spawn(1, false);
        let mut status = 0;
        // SAFETY: our own child.
        unsafe { libc::waitpid(gone, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0);
        let stays = spawn(0x7fff_fff0, true);
        let me = a.attach(std::process::id()).unwrap();
        // Wait for the second child's charge without a fixed sleep.
        let t0 = std::time::Instant::now();
        while a.totals()[0].1 < 80 && t0.elapsed().as_secs() < 10 {
            std::thread::yield_now();
        }
        // The exited child's 40 come back although init lives; the living
        // child's 40 stay although its pid names no process.
        assert!(
            a.reserve(me, g, 60),
            "the dead child's memory was not returned"
        );
        assert!(!a.reserve(me, g, 1), "the living child's memory was taken");
        // SAFETY: closing our ends lets the child's read return.
        unsafe {
            libc::close(fds[1]);
            libc::close(fds[0]);
            libc::waitpid(stays, &mut status, 0);
        }
        assert!(
            a.reserve(me, g, 40),
            "the second child's memory came back after it exited"
        );
        std::fs::remove_file(&p).unwrap();
    }
}
