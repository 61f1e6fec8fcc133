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
//! The file is writable by the job's own user, so its content is input, not
//! state: every operation checks, under the lock and before it uses them,
//! the fields it reads — the magic number, the cap (which no job changes),
//! the GPU count, every total against the cap and against the sum of the
//! slots that make it up — and answers [`BooksError`] for books that are
//! damaged, garbage, or locked by someone who never lets go. The shim
//! refuses to hand out memory on that answer. What no check can catch is a
//! rewrite that is damaged *consistently* (every slot and total lowered
//! together): a process can always lie about its own job, as it can unset
//! `LD_PRELOAD`; that is the threat model (SECURITY.md), not a defect.
//!
//! No allocation on the charge path; the only system calls are an `fstat`
//! (is the file still whole?), the futex of a contended lock and, when a
//! charge would be refused, a look at `/proc` for dead processes.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// "gpfrjob1"
const MAGIC: u64 = 0x6770_6672_6a6f_6231;
/// GPUs one job may use, and processes one job may run on the GPU at once.
pub const MAX_GPUS: usize = 8;
pub const MAX_SLOTS: usize = 256;
/// The largest cap the books take: 1 PiB per GPU, far above any GPU made.
/// A larger figure in the file is damage, not a job.
pub const MAX_CAP: u64 = 1 << 50;
/// How long an operation waits for the books' lock. Holders keep it for
/// microseconds (a reclaim that reads /proc, for milliseconds): a lock held
/// longer belongs to a process that stopped or hung while holding it, or to
/// books that were overwritten, and the operation gives up.
const LOCK_WAIT: Duration = if cfg!(test) {
    Duration::from_millis(300)
} else {
    Duration::from_secs(2)
};

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

/// Where each field of the books sits in the file, for tools that inspect
/// them and for the tests that damage them on purpose (to check that the
/// shim refuses to charge against books it cannot trust).
pub mod layout {
    use super::{MAX_GPUS, Shared, Slot};
    use std::mem::{offset_of, size_of};

    /// Length of the books (the file is exactly this long).
    pub const LEN: usize = size_of::<Shared>();
    /// u64: the job's cap in bytes per GPU.
    pub const CAP: usize = offset_of!(Shared, cap);
    /// The process-shared mutex.
    pub const LOCK: usize = offset_of!(Shared, lock);
    /// u64: how many GPUs the books have.
    pub const NGPUS: usize = offset_of!(Shared, ngpus);

    /// u64: the books' magic number, at the start.
    pub const MAGIC: u64 = super::MAGIC;

    /// u64: the most the whole job held at once on GPU `gpu` (the pytest
    /// plugin reads the run's peak here; python/gpufrac/pytest_plugin.py
    /// has these offsets as `BOOKS_*`).
    pub const fn peak(gpu: usize) -> usize {
        assert!(gpu < MAX_GPUS);
        offset_of!(Shared, peak) + 8 * gpu
    }

    /// u64: what the whole job holds on GPU `gpu`.
    pub const fn used(gpu: usize) -> usize {
        assert!(gpu < MAX_GPUS);
        offset_of!(Shared, used) + 8 * gpu
    }

    /// u32: the pid of slot `slot` (0: free).
    pub const fn slot_pid(slot: usize) -> usize {
        offset_of!(Shared, slots) + slot * size_of::<Slot>() + offset_of!(Slot, pid)
    }

    /// u64: what slot `slot`'s process holds on GPU `gpu`.
    pub const fn slot_used(slot: usize, gpu: usize) -> usize {
        assert!(gpu < MAX_GPUS);
        offset_of!(Shared, slots) + slot * size_of::<Slot>() + offset_of!(Slot, used) + 8 * gpu
    }
}

/// Why the books cannot be used. Every variant names what was found, so
/// that the one line the shim prints says what is wrong with them.
#[derive(Debug)]
pub enum BooksError {
    /// The file could not be opened or mapped.
    Io(io::Error),
    /// The file is shorter than the books.
    Short { len: u64 },
    /// The file does not start with the books' magic number.
    NotBooks,
    /// A field holds a value no books can hold.
    Field {
        what: &'static str,
        value: u64,
        most: u64,
    },
    /// A GPU's total is not the sum of what its processes hold.
    Sum { gpu: usize, total: u64, slots: u64 },
    /// The cap is not the one the books had when this process opened them
    /// (no job's cap ever changes).
    CapChanged { was: u64, now: u64 },
    /// Something this process holds in the books has gone from them: its
    /// slot was freed, or its GPU dropped.
    Lost(&'static str),
    /// The lock's type word has been overwritten: it is no lock any more.
    LockDamaged,
    /// Nobody let go of the lock within the wait allowed (2 s).
    LockTimeout,
    /// Locking failed with this error number.
    Lock(i32),
}

impl fmt::Display for BooksError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BooksError::Io(e) => write!(f, "{e}"),
            BooksError::Short { len } => write!(
                f,
                "the file is {len} bytes long, the books take {}",
                layout::LEN
            ),
            BooksError::NotBooks => write!(f, "the file does not hold gpufrac job books"),
            BooksError::Field { what, value, most } => {
                write!(f, "{what} is {value}, at most {most} is possible")
            }
            BooksError::Sum { gpu, total, slots } => write!(
                f,
                "GPU {gpu}'s total is {total} bytes but its processes hold {slots}"
            ),
            BooksError::CapChanged { was, now } => write!(
                f,
                "the job's cap changed from {was} to {now} bytes, which no job does"
            ),
            BooksError::Lost(what) => write!(f, "{what} has gone from the books"),
            BooksError::LockDamaged => write!(f, "their lock has been overwritten"),
            BooksError::LockTimeout => write!(
                f,
                "their lock stayed taken for more than {} ms (a process of the job stopped or hung while holding it)",
                LOCK_WAIT.as_millis()
            ),
            BooksError::Lock(rc) => write!(
                f,
                "locking them failed: {}",
                io::Error::from_raw_os_error(*rc)
            ),
        }
    }
}

impl std::error::Error for BooksError {}

impl From<io::Error> for BooksError {
    fn from(e: io::Error) -> Self {
        BooksError::Io(e)
    }
}

/// A process's view of a job's books.
pub struct JobLedger {
    shared: *mut Shared,
    /// Kept open: closing any descriptor of the file would drop this
    /// process's slot locks.
    fd: libc::c_int,
    /// The cap the books had when they were opened: no job's cap changes,
    /// so a different one in the file is damage.
    cap: u64,
    /// The type word of a mutex made as the books' is, where this C library
    /// lets it be read (see `lock_kind`).
    kind: Option<i32>,
}

/// The byte whose lock says slot `i`'s process lives.
fn lock_byte(i: usize) -> libc::off_t {
    (layout::LEN + i) as libc::off_t
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
// mutex, or reads the magic word atomically.
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
    // No record locks on this file system: the pid is the best we have
    // (checked to be a positive pid_t before any lookup reaches here).
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(slot.pid as libc::pid_t, 0) } == 0
        || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && start_time(slot.pid) == slot.start
}

/// glibc keeps a mutex's type (robust, process-shared, ...) in a word of the
/// mutex itself and trusts it: a lock whose type word was overwritten would
/// send `pthread_mutex_lock` down another type's path (a priority-inheritance
/// futex on a garbage owner, say), where it may hang or abort. So the word
/// is compared with that of a mutex made the same way before every lock.
/// The word sits at offset 16 in glibc's 64-bit layout; elsewhere nothing
/// is compared and the timed lock is the only guard.
fn lock_kind(m: *const libc::pthread_mutex_t) -> Option<i32> {
    #[cfg(all(target_env = "gnu", target_pointer_width = "64"))]
    {
        // The two lock-elision flags may be set by glibc at run time.
        const ELISION: i32 = 256 | 512;
        // SAFETY: a pthread_mutex_t is 40 bytes here; the word is inside it.
        let word = unsafe { m.cast::<u8>().add(16).cast::<i32>().read_volatile() };
        Some(word & !ELISION)
    }
    #[cfg(not(all(target_env = "gnu", target_pointer_width = "64")))]
    {
        let _ = m;
        None
    }
}

/// Initialises `m` as the books' lock: process-shared and robust.
///
/// # Safety
/// `m` must point to writable memory for a mutex that nobody uses.
unsafe fn init_lock(m: *mut libc::pthread_mutex_t) {
    // SAFETY: as the caller promises; the attribute object is ours.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        libc::pthread_mutex_init(m, &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
    }
}

/// The type word of a mutex made as the books' is.
fn reference_kind() -> Option<i32> {
    // SAFETY: a local mutex, initialised, read, destroyed.
    unsafe {
        let mut m: libc::pthread_mutex_t = std::mem::zeroed();
        init_lock(&mut m);
        let k = lock_kind(&m);
        libc::pthread_mutex_destroy(&mut m);
        k
    }
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

impl Shared {
    /// The fields every operation reads: magic, cap, GPU count, and each
    /// GPU's total and peak against the cap.
    fn check_header(&self, cap: u64) -> Result<(), BooksError> {
        if self.magic.load(Ordering::Acquire) != MAGIC {
            return Err(BooksError::NotBooks);
        }
        if self.cap != cap {
            return Err(BooksError::CapChanged {
                was: cap,
                now: self.cap,
            });
        }
        if self.ngpus > MAX_GPUS as u64 {
            return Err(BooksError::Field {
                what: "the GPU count",
                value: self.ngpus,
                most: MAX_GPUS as u64,
            });
        }
        for g in 0..MAX_GPUS {
            // A GPU the books do not have holds nothing.
            let most = if (g as u64) < self.ngpus { cap } else { 0 };
            if self.used[g] > most {
                return Err(BooksError::Field {
                    what: "a GPU's total",
                    value: self.used[g],
                    most,
                });
            }
            if self.peak[g] > most {
                return Err(BooksError::Field {
                    what: "a GPU's peak",
                    value: self.peak[g],
                    most,
                });
            }
        }
        Ok(())
    }

    /// GPU `gpu`'s total against the slots that make it up.
    fn check_gpu(&self, gpu: usize) -> Result<(), BooksError> {
        let mut sum = 0u64;
        for slot in &self.slots {
            let u = slot.used[gpu];
            if slot.pid == 0 && u != 0 {
                return Err(BooksError::Field {
                    what: "the charge of a free slot",
                    value: u,
                    most: 0,
                });
            }
            sum = sum.saturating_add(u);
        }
        if sum != self.used[gpu] {
            return Err(BooksError::Sum {
                gpu,
                total: self.used[gpu],
                slots: sum,
            });
        }
        Ok(())
    }

    /// Every slot and total: what operations that walk all slots (attach,
    /// reclaim, totals) read. The header is checked by `lock`, before.
    fn check_slots(&self) -> Result<(), BooksError> {
        for g in 0..MAX_GPUS {
            self.check_gpu(g)?;
        }
        for slot in &self.slots {
            // Signalled (with 0) when record locks are missing: must be a
            // positive pid_t, never a process group.
            if slot.pid > i32::MAX as u32 {
                return Err(BooksError::Field {
                    what: "a process id",
                    value: slot.pid.into(),
                    most: i32::MAX as u64,
                });
            }
        }
        Ok(())
    }

    /// This process's slot and GPU, checked before a charge moves them.
    fn check_mine(&self, slot: usize, gpu: usize) -> Result<(), BooksError> {
        if slot >= MAX_SLOTS || self.slots[slot].pid == 0 {
            return Err(BooksError::Lost("this process's slot"));
        }
        if gpu >= MAX_GPUS || gpu as u64 >= self.ngpus {
            return Err(BooksError::Lost("this process's GPU"));
        }
        self.check_gpu(gpu)
    }
}

impl JobLedger {
    /// Creates the books for a job capped at `cap` bytes per GPU (by
    /// `gpufrac run`), readable and writable by the owner only.
    pub fn create(path: &str, cap: u64) -> io::Result<JobLedger> {
        if cap == 0 || cap > MAX_CAP {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a job's cap must be 1 byte to {MAX_CAP} bytes (1 PiB), not {cap}"),
            ));
        }
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
        let l = Self::map(fd, true, cap).map_err(|e| match e {
            BooksError::Io(e) => e,
            other => io::Error::other(other.to_string()),
        })?;
        // SAFETY: freshly created and zeroed by ftruncate; no one else has
        // it until its name is handed to the child.
        unsafe {
            let s = &mut *l.shared;
            s.cap = cap;
            init_lock(&mut s.lock);
            s.magic.store(MAGIC, Ordering::Release);
        }
        Ok(l)
    }

    /// Opens the books a `gpufrac run` created, and checks all of them.
    pub fn open(path: &str) -> Result<JobLedger, BooksError> {
        let c = CString::new(path).map_err(|_| io::Error::other("NUL in path"))?;
        // SAFETY: plain open.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // The cap is learned here, and must then never change.
        let mut l = Self::map(fd, false, 0)?;
        // SAFETY: mapped, at least the books' size.
        let s = unsafe { &*l.shared };
        if s.magic.load(Ordering::Acquire) != MAGIC {
            return Err(BooksError::NotBooks);
        }
        if s.cap == 0 || s.cap > MAX_CAP {
            return Err(BooksError::Field {
                what: "the job's cap",
                value: s.cap,
                most: MAX_CAP,
            });
        }
        l.cap = s.cap;
        {
            let g = l.lock()?;
            g.s.check_slots()?;
        }
        Ok(l)
    }

    fn map(fd: libc::c_int, size_it: bool, cap: u64) -> Result<JobLedger, BooksError> {
        let len = layout::LEN;
        // SAFETY: fd is ours; the mapping outlives the fd.
        unsafe {
            if size_it && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = io::Error::last_os_error();
                libc::close(fd);
                return Err(e.into());
            }
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                let e = io::Error::last_os_error();
                libc::close(fd);
                return Err(e.into());
            }
            if (st.st_size as u64) < len as u64 {
                libc::close(fd);
                return Err(BooksError::Short {
                    len: st.st_size as u64,
                });
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
                return Err(e.into());
            }
            Ok(JobLedger {
                shared: p.cast(),
                fd,
                cap,
                kind: reference_kind(),
            })
        }
    }

    /// The job's cap, bytes per GPU, as the books had it when opened.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Takes the lock (waiting at most [`LOCK_WAIT`]) and checks the
    /// header; the caller checks what else it reads.
    fn lock(&self) -> Result<Locked<'_>, BooksError> {
        // A file cut short under the mapping would fault (SIGBUS) where the
        // books are read past its end: its length is checked first, for the
        // price of one fstat per operation (the charge of a job's process,
        // not a launch). A cut made between this check and the reads still
        // faults, stopping that process: it gets no memory either way.
        // SAFETY: a stat of ours, our descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(self.fd, &mut st) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        if (st.st_size as u64) < layout::LEN as u64 {
            return Err(BooksError::Short {
                len: st.st_size as u64,
            });
        }
        let p = self.shared;
        // SAFETY: the mapping lives as long as self; the magic is atomic.
        if unsafe { &(*p).magic }.load(Ordering::Acquire) != MAGIC {
            return Err(BooksError::NotBooks);
        }
        // SAFETY: the lock lives in the mapping.
        let m = unsafe { std::ptr::addr_of_mut!((*p).lock) };
        if self.kind.is_some() && lock_kind(m) != self.kind {
            return Err(BooksError::LockDamaged);
        }
        // SAFETY: a mutex of the books' type (just checked), in our mapping.
        let mut rc = unsafe { libc::pthread_mutex_trylock(m) };
        if rc == libc::EBUSY {
            let deadline = realtime_after(LOCK_WAIT);
            // SAFETY: as above; the deadline is ours.
            rc = unsafe { libc::pthread_mutex_timedlock(m, &deadline) };
        }
        let owner_died = match rc {
            0 => false,
            libc::EOWNERDEAD => true,
            libc::ETIMEDOUT => return Err(BooksError::LockTimeout),
            other => return Err(BooksError::Lock(other)),
        };
        // SAFETY: we hold the lock now; every writer of the books does.
        let g = Locked {
            s: unsafe { &mut *p },
        };
        if owner_died {
            // Its holder died mid-update: the slots are the truth.
            // SAFETY: we hold it.
            unsafe { libc::pthread_mutex_consistent(&mut g.s.lock) };
            rebuild(self.fd, g.s, self.cap)?;
        }
        g.s.check_header(self.cap)?;
        Ok(g)
    }

    /// Takes a slot for this process; `None` when the job runs more
    /// processes on the GPU than the books have room for.
    pub fn attach(&self, pid: u32) -> Result<Option<usize>, BooksError> {
        let start = start_time(pid);
        let g = self.lock()?;
        let s = &mut *g.s;
        s.check_slots()?;
        if let Some(i) = s
            .slots
            .iter()
            .position(|x| x.pid == pid && x.start == start)
        {
            return Ok(Some(i));
        }
        let free = match s.slots.iter().position(|x| x.pid == 0) {
            Some(i) => i,
            None => {
                reclaim(self.fd, s);
                match s.slots.iter().position(|x| x.pid == 0) {
                    Some(i) => i,
                    None => return Ok(None),
                }
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
        Ok(Some(free))
    }

    /// The index of a GPU (by UUID) in the books, added if new; `None`
    /// when the job already uses as many GPUs as the books hold.
    pub fn gpu(&self, uuid: &[u8; 16]) -> Result<Option<usize>, BooksError> {
        let g = self.lock()?;
        let s = &mut *g.s;
        // At most MAX_GPUS: checked with the header.
        let n = s.ngpus as usize;
        if let Some(i) = s.gpus[..n].iter().position(|u| u == uuid) {
            return Ok(Some(i));
        }
        if n == MAX_GPUS {
            return Ok(None);
        }
        s.gpus[n] = *uuid;
        s.ngpus += 1;
        Ok(Some(n))
    }

    /// Charges `size` to this process's slot on GPU `gpu`, unless the job
    /// would pass its cap there (`Ok(false)`).
    pub fn reserve(&self, slot: usize, gpu: usize, size: u64) -> Result<bool, BooksError> {
        let g = self.lock()?;
        let s = &mut *g.s;
        s.check_mine(slot, gpu)?;
        let cap = self.cap;
        let fits = |s: &Shared| s.used[gpu].checked_add(size).is_some_and(|n| n <= cap);
        if !fits(s) {
            // Memory of processes that died is the job's again.
            s.check_slots()?;
            reclaim(self.fd, s);
            if !fits(s) {
                return Ok(false);
            }
        }
        // Both stay within the cap: the total was checked to be the sum of
        // the slots, and the new total fits.
        s.slots[slot].used[gpu] += size;
        s.used[gpu] += size;
        s.peak[gpu] = s.peak[gpu].max(s.used[gpu]);
        Ok(true)
    }

    /// Gives back up to `size` of what this process's slot holds on `gpu`.
    pub fn unreserve(&self, slot: usize, gpu: usize, size: u64) -> Result<(), BooksError> {
        let g = self.lock()?;
        let s = &mut *g.s;
        s.check_mine(slot, gpu)?;
        let mine = &mut s.slots[slot].used[gpu];
        let size = size.min(*mine);
        *mine -= size;
        s.used[gpu] -= size;
        Ok(())
    }

    /// What the whole job holds on GPU `gpu`.
    pub fn used(&self, gpu: usize) -> Result<u64, BooksError> {
        let g = self.lock()?;
        if gpu >= MAX_GPUS || gpu as u64 >= g.s.ngpus {
            return Err(BooksError::Lost("this process's GPU"));
        }
        g.s.check_gpu(gpu)?;
        Ok(g.s.used[gpu])
    }

    /// Gives a slot up (its process is done with CUDA, or exiting).
    pub fn detach(&self, slot: usize) -> Result<(), BooksError> {
        let g = self.lock()?;
        let s = &mut *g.s;
        s.check_slots()?;
        let Some(mine) = s.slots.get_mut(slot) else {
            return Err(BooksError::Lost("this process's slot"));
        };
        free_slot(&mut s.used, mine);
        let fl = flock_for(libc::F_UNLCK, slot);
        // SAFETY: as in attach.
        unsafe { libc::fcntl(self.fd, libc::F_SETLK, &fl) };
        Ok(())
    }

    /// Room left under the cap on GPU `gpu`, once the slots of processes
    /// that died are the job's again (a process that exited without
    /// freeing must not understate what is free), in one hold of the lock.
    pub fn room(&self, gpu: usize) -> Result<u64, BooksError> {
        let g = self.lock()?;
        g.s.check_slots()?;
        reclaim(self.fd, g.s);
        if gpu >= MAX_GPUS || gpu as u64 >= g.s.ngpus {
            return Err(BooksError::Lost("this process's GPU"));
        }
        Ok(self.cap.saturating_sub(g.s.used[gpu]))
    }

    /// Per GPU (UUID, used, peak), for status and tests.
    pub fn totals(&self) -> Result<Vec<([u8; 16], u64, u64)>, BooksError> {
        let g = self.lock()?;
        let s = &*g.s;
        s.check_slots()?;
        Ok((0..s.ngpus as usize)
            .map(|i| (s.gpus[i], s.used[i], s.peak[i]))
            .collect())
    }
}

impl Drop for JobLedger {
    fn drop(&mut self) {
        // SAFETY: our own mapping and descriptor.
        unsafe {
            libc::munmap(self.shared.cast(), layout::LEN);
            libc::close(self.fd);
        }
    }
}

/// CLOCK_REALTIME `d` from now, as `pthread_mutex_timedlock` wants it.
fn realtime_after(d: Duration) -> libc::timespec {
    // SAFETY: a timespec of ours.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    let ns = ts.tv_nsec as u64 + d.subsec_nanos() as u64;
    ts.tv_sec += d.as_secs() as libc::time_t + (ns / 1_000_000_000) as libc::time_t;
    ts.tv_nsec = (ns % 1_000_000_000) as libc::c_long;
    ts
}

/// Frees the slots of dead processes. Runs after `check_slots`: the totals
/// are the sums of the slots, so nothing here can underflow.
fn reclaim(fd: libc::c_int, s: &mut Shared) -> u64 {
    let mut freed = 0u64;
    for (i, slot) in s.slots.iter_mut().enumerate() {
        if slot.pid != 0 && !alive(fd, i, slot) {
            freed = freed.saturating_add(free_slot(&mut s.used, slot));
        }
    }
    freed
}

/// Empties `slot`, taking what it held off the job's `totals` (which, after
/// `check_slots`, include it); what it held, in all.
fn free_slot(totals: &mut [u64; MAX_GPUS], slot: &mut Slot) -> u64 {
    let mut held = 0u64;
    for (total, u) in totals.iter_mut().zip(slot.used) {
        *total -= u;
        held = held.saturating_add(u);
    }
    *slot = Slot {
        pid: 0,
        _pad: 0,
        start: 0,
        used: [0; MAX_GPUS],
    };
    held
}

/// Recomputes the totals from the slots after a holder died mid-update,
/// then frees the slots of the dead.
fn rebuild(fd: libc::c_int, s: &mut Shared, cap: u64) -> Result<(), BooksError> {
    let mut used = [0u64; MAX_GPUS];
    for slot in s.slots.iter().filter(|x| x.pid != 0) {
        for (i, u) in slot.used.iter().enumerate() {
            used[i] = used[i].saturating_add(*u);
        }
    }
    s.used = used;
    s.check_header(cap)?;
    s.check_slots()?;
    reclaim(fd, s);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pytest plugin reads the run's peak from the books without this
    /// crate: its copy of the layout must be this one.
    #[test]
    fn the_pytest_plugins_copy_of_the_layout_is_this_one() {
        let plugin = include_str!("../../python/gpufrac/pytest_plugin.py");
        let constant = |name: &str| -> u64 {
            let line = plugin
                .lines()
                .find(|l| l.starts_with(&format!("{name} = ")))
                .unwrap_or_else(|| panic!("no {name} in pytest_plugin.py"));
            let v = line.split_once(" = ").unwrap().1.replace('_', "");
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
                None => v.parse().unwrap(),
            }
        };
        assert_eq!(constant("BOOKS_MAGIC"), layout::MAGIC);
        assert_eq!(constant("BOOKS_NGPUS"), layout::NGPUS as u64);
        assert_eq!(constant("BOOKS_PEAK"), layout::peak(0) as u64);
        assert_eq!(constant("BOOKS_MAX_GPUS"), MAX_GPUS as u64);
        assert_eq!(layout::peak(1), layout::peak(0) + 8, "one u64 per GPU");
    }

    fn path(name: &str) -> String {
        format!(
            "{}/gpufrac-jl-{name}-{}",
            std::env::temp_dir().display(),
            std::process::id()
        )
    }

    /// Writes `bytes` at `offset` of the file, as a process of the job can.
    fn poke(p: &str, offset: usize, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.write_all_at(bytes, offset as u64).unwrap();
    }

    #[test]
    fn charges_are_shared_and_capped() {
        let p = path("cap");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let b = JobLedger::open(&p).unwrap();
        let me = std::process::id();
        let sa = a.attach(me).unwrap().unwrap();
        let sb = b.attach(me).unwrap().unwrap();
        assert_eq!(sa, sb, "one process, one slot");
        let g = a.gpu(&[1; 16]).unwrap().unwrap();
        assert_eq!(b.gpu(&[1; 16]).unwrap(), Some(g));
        assert!(a.reserve(sa, g, 60).unwrap());
        assert!(!b.reserve(sb, g, 41).unwrap());
        assert!(b.reserve(sb, g, 40).unwrap());
        assert_eq!(a.used(g).unwrap(), 100);
        a.unreserve(sa, g, 30).unwrap();
        assert_eq!(b.used(g).unwrap(), 70);
        assert_eq!(a.totals().unwrap(), vec![([1; 16], 70, 100)]);
        a.detach(sa).unwrap();
        assert_eq!(a.used(g).unwrap(), 0);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn a_dead_process_gives_its_memory_back() {
        let p = path("dead");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let g = a.gpu(&[2; 16]).unwrap().unwrap();
        // A child takes memory and dies holding the lock.
        // SAFETY: the child only calls into the ledger and _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let b = JobLedger::open(&p).unwrap();
            let s = b.attach(std::process::id()).unwrap().unwrap();
            let ok = b.reserve(s, g, 90).unwrap();
            std::mem::forget(b.lock().unwrap());
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0);
        let me = a.attach(std::process::id()).unwrap().unwrap();
        // The lock its holder died with is recovered, and so is its memory.
        assert!(a.reserve(me, g, 100).unwrap());
        assert_eq!(a.used(g).unwrap(), 100);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn room_counts_what_the_dead_held_as_free() {
        let p = path("room");
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let g = a.gpu(&[3; 16]).unwrap().unwrap();
        // A child takes memory and exits without giving it back.
        // SAFETY: the child only calls into the ledger and _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let b = JobLedger::open(&p).unwrap();
            let s = b.attach(std::process::id()).unwrap().unwrap();
            let ok = b.reserve(s, g, 90).unwrap();
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0);
        assert_eq!(a.used(g).unwrap(), 90, "still booked to the dead child");
        assert_eq!(a.room(g).unwrap(), 100);
        assert_eq!(a.used(g).unwrap(), 0, "reclaimed by room");
        assert!(matches!(a.room(MAX_GPUS), Err(BooksError::Lost(_))));
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
        let g = a.gpu(&[3; 16]).unwrap().unwrap();
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
                let s = b.attach(fake).unwrap().unwrap();
                let ok = b.reserve(s, g, 40).unwrap();
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
        let me = a.attach(std::process::id()).unwrap().unwrap();
        // Wait for the second child's charge without a fixed sleep.
        let t0 = std::time::Instant::now();
        while a.totals().unwrap()[0].1 < 80 && t0.elapsed().as_secs() < 10 {
            std::thread::yield_now();
        }
        // The exited child's 40 come back although init lives; the living
        // child's 40 stay although its pid names no process.
        assert!(
            a.reserve(me, g, 60).unwrap(),
            "the dead child's memory was not returned"
        );
        assert!(
            !a.reserve(me, g, 1).unwrap(),
            "the living child's memory was taken"
        );
        // SAFETY: closing our ends lets the child's read return.
        unsafe {
            libc::close(fds[1]);
            libc::close(fds[0]);
            libc::waitpid(stays, &mut status, 0);
        }
        assert!(
            a.reserve(me, g, 40).unwrap(),
            "the second child's memory came back after it exited"
        );
        std::fs::remove_file(&p).unwrap();
    }

    /// Books holding 30 on one GPU for this process, for the damage tests.
    fn charged(name: &str) -> (String, JobLedger, usize, usize) {
        let p = path(name);
        let _ = std::fs::remove_file(&p);
        let a = JobLedger::create(&p, 100).unwrap();
        let s = a.attach(std::process::id()).unwrap().unwrap();
        let g = a.gpu(&[4; 16]).unwrap().unwrap();
        assert!(a.reserve(s, g, 30).unwrap());
        (p, a, s, g)
    }

    /// Each field a process of the job could damage, set out of range or
    /// out of step with the rest: every operation refuses, and so does
    /// opening the books, saying what was found.
    #[test]
    fn damaged_fields_are_refused_before_use() {
        let u64le = |v: u64| v.to_le_bytes().to_vec();
        // (name, where, what is written, what a charge says, what opening says)
        let cases: Vec<(&str, usize, Vec<u8>, &str, &str)> = vec![
            (
                "ngpus",
                layout::NGPUS,
                u64le(1000),
                "the GPU count is 1000",
                "the GPU count is 1000",
            ),
            (
                "capmax",
                layout::CAP,
                u64le(u64::MAX),
                "cap changed",
                "the job's cap is 18446744073709551615",
            ),
            (
                "caplow",
                layout::CAP,
                u64le(1),
                "cap changed",
                "a GPU's total is 30, at most 1",
            ),
            (
                "total",
                layout::used(0),
                u64le(500),
                "a GPU's total is 500, at most 100",
                "a GPU's total is 500",
            ),
            (
                "sum",
                layout::used(0),
                u64le(0),
                "its processes hold 30",
                "its processes hold 30",
            ),
            (
                "slot",
                layout::slot_used(0, 0),
                u64le(u64::MAX),
                "processes hold 18446744073709551615",
                "processes hold 18446744073709551615",
            ),
            (
                "free",
                layout::slot_used(7, 0),
                u64le(5),
                "the charge of a free slot is 5",
                "the charge of a free slot is 5",
            ),
            (
                "gone",
                layout::slot_pid(0),
                0u32.to_le_bytes().to_vec(),
                "this process's slot has gone",
                "the charge of a free slot is 30",
            ),
            (
                "magic",
                0,
                u64le(0),
                "does not hold gpufrac job books",
                "does not hold gpufrac job books",
            ),
        ];
        for (name, offset, bytes, charge_says, open_says) in cases {
            let (p, a, s, g) = charged(name);
            poke(&p, offset, &bytes);
            let e = a.reserve(s, g, 1).expect_err(name).to_string();
            assert!(e.contains(charge_says), "{name}: {e}");
            assert!(a.unreserve(s, g, 1).is_err(), "{name}");
            assert!(a.used(g).is_err(), "{name}");
            assert!(a.totals().is_err(), "{name}");
            let e = JobLedger::open(&p).err().expect(name).to_string();
            assert!(e.contains(open_says), "{name}: {e}");
            std::fs::remove_file(&p).unwrap();
        }
    }

    #[test]
    fn short_and_garbage_files_are_not_opened() {
        let (p, a, s, g) = charged("short");
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(100).unwrap();
        let e = JobLedger::open(&p).err().unwrap().to_string();
        assert!(e.contains("100 bytes long"), "{e}");
        // Mapped before it was cut: refused, not faulting.
        let e = a.reserve(s, g, 1).unwrap_err().to_string();
        assert!(e.contains("100 bytes long"), "{e}");
        std::fs::remove_file(&p).unwrap();

        let (p, a, s, g) = charged("garbage");
        // Garbage that keeps the length: a fixed pseudo-random pattern.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let junk: Vec<u8> = (0..layout::LEN)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        poke(&p, 0, &junk);
        assert!(a.reserve(s, g, 1).is_err());
        assert!(JobLedger::open(&p).is_err());
        // Garbage that keeps the magic number but not the lock's type.
        poke(&p, 0, &MAGIC.to_le_bytes());
        let e = a.reserve(s, g, 1).unwrap_err();
        if cfg!(all(target_env = "gnu", target_pointer_width = "64")) {
            assert!(matches!(e, BooksError::LockDamaged), "{e}");
        }
        std::fs::remove_file(&p).unwrap();
    }

    /// A process of the job stopped while it holds the lock: the others
    /// give up after a bounded wait instead of hanging with it.
    #[test]
    fn a_lock_nobody_releases_is_given_up() {
        let (p, a, s, g) = charged("held");
        let mut fds = [0; 2];
        // SAFETY: a pipe into a local array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child takes the lock, says so, and waits to be killed.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let b = JobLedger::open(&p).unwrap();
            std::mem::forget(b.lock().unwrap());
            unsafe {
                libc::write(fds[1], b"x".as_ptr().cast(), 1);
                libc::pause();
                libc::_exit(0);
            }
        }
        let mut byte = 0u8;
        // SAFETY: reads one byte into a local.
        assert_eq!(unsafe { libc::read(fds[0], (&raw mut byte).cast(), 1) }, 1);
        let e = a.reserve(s, g, 1).unwrap_err();
        assert!(matches!(e, BooksError::LockTimeout), "{e}");
        // SAFETY: our own child; killing it hands the lock on (robust).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert!(
            a.reserve(s, g, 1).unwrap(),
            "recovered after its holder died"
        );
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn an_implausible_cap_is_not_created() {
        let p = path("bigcap");
        let _ = std::fs::remove_file(&p);
        assert!(JobLedger::create(&p, MAX_CAP + 1).is_err());
        assert!(JobLedger::create(&p, 0).is_err());
        assert!(!std::path::Path::new(&p).exists());
    }
}
