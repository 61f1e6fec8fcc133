//! Device state shared by every process on one state file, and the
//! per-process simulator singleton.
//!
//! The shared mapping holds only atomics. Its one lock, each device engine's
//! (engine/lock.rs), is taken over from a holder that died, so a process killed
//! at any instruction cannot wedge the others. Each process owns a slot that
//! mirrors its share of `used`; slots of dead processes are reaped (their
//! memory returned) the way a real driver frees a dead process's memory.
//!
//! Liveness is an open-file-description byte lock on the state file, one
//! byte per slot (past the end of the data): the kernel drops it the moment
//! the owner exits or is killed, so there is no pid reuse, zombie or pid
//! namespace ambiguity, and nothing a dead process can leave held.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};

use gpufrac_common::cuda::*;

use crate::config::{self, DevSpec, phys_name, uuid, uuid_string};
use crate::engine::{self, Engine, Params, now_ns};
use crate::mig::{Mig, MigShared};
use crate::objects::{Ctx, Pool, leak};

pub use crate::config::MAX_DEV;
pub const MAX_SLOTS: usize = 256;
/// Memory and engines of MIG GPU instances, machine-wide (a GPU has at most
/// 7): `devs[MAX_DEV + k]` backs the instance holding MIG slot k.
pub const MIG_SLOTS: usize = 64;
/// Everything with its own memory and engine: physical devices, then MIG
/// GPU instances.
pub const NSLOT: usize = MAX_DEV + MIG_SLOTS;
const MAGIC: u64 = 0x6770_7566_7273_6903; // "gpufrsi" + layout version 3
/// Slot `i` is alive while someone holds the write lock on byte LOCK_BASE + i.
const LOCK_BASE: i64 = 1 << 30;
/// The MIG tables' lock: a byte below the slot locks. An open file
/// description lock, so the kernel drops it with a process that dies
/// holding it.
const MIG_LOCK_BYTE: i64 = LOCK_BASE - 1;

#[repr(C, align(64))]
pub struct SharedDev {
    pub used: AtomicU64,
    pub engine: Engine,
}

#[repr(C)]
pub struct Slot {
    pub pid: AtomicU32,
    /// Counts claims, so a token of an earlier owner is told apart.
    pub generation: AtomicU32,
    /// Serial of the MIG compute instance the process runs on (0: none):
    /// the driver refuses to destroy an instance a live process uses.
    pub mig: AtomicU32,
    pub used: [AtomicU64; NSLOT],
}

/// Marks the token of a process with no slot (all taken): the rest is its
/// pid, checked with kill(2) (pid reuse aside, right).
const NO_SLOT: u64 = 1 << 63;
/// Slot generations in tokens keep clear of `NO_SLOT`.
const GEN_MASK: u32 = 0x7fff_ffff;

#[repr(C)]
pub struct Shared {
    magic: AtomicU64,
    pub devs: [SharedDev; NSLOT],
    pub slots: [Slot; MAX_SLOTS],
    pub mig: MigShared,
}

/// A device as CUDA numbers it in this process: a physical device not in
/// MIG mode, or the MIG device `CUDA_VISIBLE_DEVICES` names.
pub struct CudaDev {
    pub total: u64,
    /// Index into `Shared::devs`: its memory and engine.
    pub slot: usize,
    /// The physical device (for its PCI bus id).
    pub phys: usize,
    /// `cuDeviceGetUuid_v2`: the MIG device's own UUID on a MIG device.
    pub uuid: CUuuid,
    /// `cuDeviceGetUuid`: the parent GPU's on a MIG device.
    pub uuid_v1: CUuuid,
    pub name: String,
    pub sms: i32,
}

pub struct Sim {
    /// Memory of each CUDA device (by ordinal).
    pub totals: Vec<u64>,
    pub cuda_devs: Vec<CudaDev>,
    /// The physical devices, as NVML numbers them.
    pub phys: Vec<DevSpec>,
    /// The MIG compute instance this process was pointed at (0: none).
    mig_serial: u32,
    pub shared: &'static Shared,
    pub primary: Vec<&'static Ctx>,
    pub default_pools: Vec<&'static Pool>,
    /// Slot index + 1 (0: none) and the pid that claimed it (fork check).
    slot: AtomicUsize,
    slot_pid: AtomicU32,
    /// The state file (None: private anonymous state) and our descriptor
    /// on it, which carries the slot lock.
    path: Option<std::ffi::CString>,
    fd: std::sync::atomic::AtomicI32,
    /// Per physical device: (time, completed busy ns) samples for
    /// utilisation.
    util: Vec<Mutex<Vec<(u64, u64)>>>,
    params: Params,
    /// `(slot generation << 32) | (slot index + 1)`, what the engine knows
    /// this process by; 0: not known yet (or forked since).
    token: AtomicU64,
    /// Per device: kernel ns executed by contexts this process destroyed.
    retired: Vec<AtomicU64>,
}

static SIM: OnceLock<Sim> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());
static SLOT_LOCK: Mutex<()> = Mutex::new(());
/// Threads of one process share its open file description, whose lock
/// does not exclude them from each other.
static MIG_MUTEX: Mutex<()> = Mutex::new(());
static CUDA_INITED: AtomicBool = AtomicBool::new(false);

pub fn sim() -> Option<&'static Sim> {
    SIM.get()
}

/// The simulator, if `cuInit` has succeeded in this process.
#[inline(always)]
pub fn cuda() -> Result<&'static Sim, CUresult> {
    if !CUDA_INITED.load(Acquire) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    SIM.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)
}

pub fn cuda_init() -> Result<(), CUresult> {
    let s = init().map_err(|e| {
        eprintln!("gpufrac-sim: {e}");
        CUDA_ERROR_UNKNOWN
    })?;
    if s.totals.is_empty() {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    CUDA_INITED.store(true, Release);
    Ok(())
}

/// Builds the singleton on first call (from `cuInit` or `nvmlInit`).
pub fn init() -> Result<&'static Sim, String> {
    if let Some(s) = SIM.get() {
        return Ok(s);
    }
    let _g = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = SIM.get() {
        return Ok(s);
    }
    let cfg = config::load()?;
    let (shared, fd) = map_shared(cfg.state_path.as_deref())?;
    let (cuda_devs, mig_serial) = cuda_view(shared, fd, &cfg);
    let n = cuda_devs.len();
    let totals = cuda_devs.iter().map(|c| c.total).collect();
    let nphys = cfg.devices.len();
    let sim = Sim {
        path: cfg.state_path,
        fd: std::sync::atomic::AtomicI32::new(fd),
        primary: (0..n).map(|d| leak(Ctx::new(d, true))).collect(),
        default_pools: (0..n).map(|d| leak(Pool::new(d, true))).collect(),
        totals,
        cuda_devs,
        phys: cfg.devices,
        mig_serial,
        shared,
        slot: AtomicUsize::new(0),
        slot_pid: AtomicU32::new(0),
        util: (0..nphys).map(|_| Mutex::new(Vec::new())).collect(),
        params: Params {
            quantum: cfg.quantum_ns,
            switch: cfg.switch_ns,
        },
        token: AtomicU64::new(0),
        retired: (0..n).map(|_| AtomicU64::new(0)).collect(),
    };
    let _ = SIM.set(sim);
    let s = SIM.get().ok_or("init failed")?;
    s.my_slot();
    // SAFETY: registers a handler that only stores to atomics.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    Ok(s)
}

/// What CUDA shows this process: the MIG device named first in
/// `CUDA_VISIBLE_DEVICES` (none if no such instance exists, as with the
/// real driver), else the physical devices it lists, renumbered from 0 in
/// its order (`config::select_visible`), or every one not in MIG mode when
/// it is unset. (The real driver would show a MIG-mode GPU's first MIG
/// device instead; the simulator shows MIG devices only to processes
/// pointed at them.)
fn cuda_view(shared: &'static Shared, fd: i32, cfg: &config::Config) -> (Vec<CudaDev>, u32) {
    let want = match cfg.visible.as_deref() {
        Some([config::Visible::Mig(m), ..]) => m,
        visible => {
            let uuids: Vec<String> = (0..cfg.devices.len())
                .map(|i| {
                    let (b, n) = uuid_string(i);
                    String::from_utf8_lossy(&b[..n]).to_ascii_lowercase()
                })
                .collect();
            let devs = config::select_visible(&cfg.devices, &uuids, visible)
                .into_iter()
                .map(|i| {
                    let d = &cfg.devices[i];
                    CudaDev {
                        total: d.total,
                        slot: i,
                        phys: i,
                        uuid: uuid(i),
                        uuid_v1: uuid(i),
                        name: phys_name(i, d),
                        sms: d.model.map_or(132, |m| m.info().sms as i32),
                    }
                })
                .collect();
            return (devs, 0);
        }
    };
    let _g = mig_lock(fd);
    let m = Mig::new(&shared.mig, &cfg.devices);
    match m.find_uuid(want) {
        Some(ci) => {
            let p = ci.gi.phys;
            let dev = CudaDev {
                total: ci.gi.memory(),
                slot: MAX_DEV + ci.gi.slot,
                phys: p,
                uuid: ci.uuid(),
                uuid_v1: uuid(p),
                name: m.device_name(&ci),
                sms: ci.sms() as i32,
            };
            (vec![dev], ci.serial)
        }
        None => (Vec::new(), 0),
    }
}

/// Holds the MIG tables' lock: the process mutex and, with a state file,
/// the file lock that excludes other processes.
pub struct MigGuard {
    _m: std::sync::MutexGuard<'static, ()>,
    fd: i32,
}

fn mig_lock(fd: i32) -> MigGuard {
    let m = MIG_MUTEX.lock().unwrap_or_else(|e| e.into_inner());
    if fd >= 0 {
        // SAFETY: plain fcntl on our own descriptor with a valid flock;
        // F_OFD_SETLKW waits, and EINTR is retried.
        unsafe {
            let mut fl: libc::flock = std::mem::zeroed();
            fl.l_type = libc::F_WRLCK as libc::c_short;
            fl.l_whence = libc::SEEK_SET as libc::c_short;
            fl.l_start = MIG_LOCK_BYTE;
            fl.l_len = 1;
            while libc::fcntl(fd, libc::F_OFD_SETLKW, &mut fl) != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
        }
    }
    MigGuard { _m: m, fd }
}

impl Drop for MigGuard {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: as in mig_lock.
            unsafe {
                let mut fl: libc::flock = std::mem::zeroed();
                fl.l_type = libc::F_UNLCK as libc::c_short;
                fl.l_whence = libc::SEEK_SET as libc::c_short;
                fl.l_start = MIG_LOCK_BYTE;
                fl.l_len = 1;
                libc::fcntl(self.fd, libc::F_OFD_SETLK, &mut fl);
            }
        }
    }
}

/// A forked child is a new process to the engine: it claims its own slot
/// (and so token) on first use and has executed nothing yet.
extern "C" fn after_fork_in_child() {
    if let Some(s) = SIM.get() {
        s.token.store(0, Relaxed);
        for r in &s.retired {
            r.store(0, Relaxed);
        }
    }
}

/// Maps the state; returns it and the descriptor kept open for slot locks
/// (-1 for private state).
fn map_shared(path: Option<&std::ffi::CStr>) -> Result<(&'static Shared, i32), String> {
    let size = std::mem::size_of::<Shared>();
    // SAFETY: plain syscalls; the mapping is never unmapped and zero bytes
    // are a valid `Shared` (all atomics).
    unsafe {
        let mut keep_fd = -1;
        let p = match path {
            None => libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ),
            Some(path) => {
                let fd = libc::open(
                    path.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                    0o666,
                );
                if fd < 0 {
                    return Err(format!(
                        "cannot open state file {path:?}: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(fd, &mut st) != 0
                    || ((st.st_size as usize) < size
                        && libc::ftruncate(fd, size as libc::off_t) != 0)
                {
                    let e = std::io::Error::last_os_error();
                    libc::close(fd);
                    return Err(format!("cannot size state file {path:?}: {e}"));
                }
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                );
                keep_fd = fd;
                p
            }
        };
        if p == libc::MAP_FAILED {
            if keep_fd >= 0 {
                libc::close(keep_fd);
            }
            return Err(format!(
                "cannot map state: {}",
                std::io::Error::last_os_error()
            ));
        }
        let shared = &*(p as *const Shared);
        match shared.magic.compare_exchange(0, MAGIC, AcqRel, Acquire) {
            Ok(_) => {}
            Err(m) if m == MAGIC => {}
            Err(_) => return Err("state file has another layout; delete it".into()),
        }
        Ok((shared, keep_fd))
    }
}

fn getpid() -> u32 {
    // SAFETY: no preconditions.
    unsafe { libc::getpid() as u32 }
}

/// Sets (`F_WRLCK`) or drops (`F_UNLCK`) our lock on slot `idx`'s byte;
/// `false` if another open file description holds it.
fn slot_lock(fd: i32, idx: usize, typ: i32) -> bool {
    // SAFETY: plain fcntl on our own descriptor with a valid flock.
    unsafe {
        let mut fl: libc::flock = std::mem::zeroed();
        fl.l_type = typ as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + idx as i64;
        fl.l_len = 1;
        libc::fcntl(fd, libc::F_OFD_SETLK, &mut fl) == 0
    }
}

/// Whether another open file description holds slot `idx`'s byte; None if
/// the kernel would not say.
fn slot_held(fd: i32, idx: usize) -> Option<bool> {
    // SAFETY: plain fcntl on our own descriptor with a valid flock.
    unsafe {
        let mut fl: libc::flock = std::mem::zeroed();
        fl.l_type = libc::F_WRLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = LOCK_BASE + idx as i64;
        fl.l_len = 1;
        (libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) == 0)
            .then_some(fl.l_type != libc::F_UNLCK as libc::c_short)
    }
}

impl Sim {
    /// Devices CUDA shows this process.
    pub fn ndev(&self) -> usize {
        self.totals.len()
    }

    /// Physical devices (NVML's).
    pub fn nphys(&self) -> usize {
        self.phys.len()
    }

    /// The MIG tables, locked against every process on the state file.
    pub fn mig(&self) -> (MigGuard, Mig<'_>) {
        // After a fork our descriptor is the parent's open file
        // description, whose lock the parent might hold: make it our own.
        self.my_slot();
        let g = mig_lock(self.fd.load(Acquire));
        (g, Mig::new(&self.shared.mig, &self.phys))
    }

    /// Whether a live process runs on the MIG compute instance `serial`.
    pub fn mig_in_use(&self, serial: u32) -> bool {
        // Dead processes' slots are cleared here, ours never is.
        self.reap_dead();
        self.shared
            .slots
            .iter()
            .any(|s| s.pid.load(Acquire) != 0 && s.mig.load(Acquire) == serial)
    }

    pub fn dev(&self, d: CUdevice) -> Result<usize, CUresult> {
        if d >= 0 && (d as usize) < self.ndev() {
            Ok(d as usize)
        } else {
            Err(CUDA_ERROR_INVALID_DEVICE)
        }
    }

    /// The engine of CUDA device `d`.
    #[inline(always)]
    pub fn engine(&self, d: usize) -> &Engine {
        &self.shared.devs[self.cuda_devs[d].slot].engine
    }

    /// The engine of a physical device or MIG instance (`Shared::devs`).
    pub fn slot_engine(&self, slot: usize) -> &Engine {
        &self.shared.devs[slot].engine
    }

    #[inline(always)]
    pub fn params(&self) -> Params {
        self.params
    }

    /// No state file: this process is alone.
    #[inline(always)]
    pub fn private(&self) -> bool {
        self.path.is_none()
    }

    /// What the engine knows this process by.
    #[inline(always)]
    pub fn token(&self) -> u64 {
        match self.token.load(Relaxed) {
            0 => self.token_slow(),
            t => t,
        }
    }

    #[cold]
    fn token_slow(&self) -> u64 {
        let t = match self.my_slot() {
            Some(s) => {
                let i = self.slot.load(Acquire) as u64;
                (u64::from(s.generation.load(Acquire) & GEN_MASK) << 32) | i
            }
            None => NO_SLOT | u64::from(getpid()),
        };
        self.token.store(t, Relaxed);
        t
    }

    /// Whether the process behind an engine token still runs. Never false
    /// for a live process; once false, stays false (a reclaimed slot gets a
    /// new generation), which is what makes taking over its lock safe.
    pub fn alive(&self, token: u64) -> bool {
        if token == self.token() {
            return true;
        }
        let fd = self.fd.load(Acquire);
        if fd < 0 {
            return true;
        }
        if token & NO_SLOT != 0 {
            // SAFETY: signal 0 only checks for existence.
            let r = unsafe { libc::kill((token & 0xffff_ffff) as libc::pid_t, 0) };
            return r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        }
        let i = (token & 0xffff_ffff) as usize;
        if i == 0 || i > MAX_SLOTS {
            return false;
        }
        let generation = self.shared.slots[i - 1].generation.load(Acquire) & GEN_MASK;
        if generation != (token >> 32) as u32 {
            return false;
        }
        slot_held(fd, i - 1).unwrap_or(true)
    }

    pub fn retire(&self, d: usize, ns: u64) {
        self.retired[d].fetch_add(ns, Relaxed);
    }

    pub fn retired(&self, d: usize) -> u64 {
        self.retired[d].load(Relaxed)
    }

    /// Memory in use on CUDA device `d`.
    pub fn used(&self, d: usize) -> u64 {
        self.slot_used(self.cuda_devs[d].slot)
    }

    /// Memory in use on a physical device or MIG instance.
    pub fn slot_used(&self, slot: usize) -> u64 {
        self.reap_dead();
        self.shared.devs[slot].used.load(Acquire)
    }

    /// This process's slot, claiming one on first use (or after a fork).
    fn my_slot(&self) -> Option<&Slot> {
        let me = getpid();
        let idx = self.slot.load(Acquire);
        if idx != 0 && self.slot_pid.load(Acquire) == me {
            return Some(&self.shared.slots[idx - 1]);
        }
        let _g = SLOT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let idx = self.slot.load(Acquire);
        if idx != 0 && self.slot_pid.load(Acquire) == me {
            return Some(&self.shared.slots[idx - 1]);
        }
        let fd = match &self.path {
            None => -1,
            // After a fork our descriptor is shared with the parent: take a
            // fresh open file description for our own lock.
            Some(p) if idx != 0 => {
                // SAFETY: valid C string path.
                let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
                if fd < 0 {
                    return None;
                }
                self.fd.store(fd, Release);
                fd
            }
            Some(_) => self.fd.load(Acquire),
        };
        for (i, s) in self.shared.slots.iter().enumerate() {
            let mine = if fd < 0 {
                s.pid.compare_exchange(0, me, AcqRel, Acquire).is_ok()
            } else if slot_lock(fd, i, libc::F_WRLCK) {
                // Whoever had this slot before is gone: return its memory.
                self.drain_usage(s);
                s.generation.fetch_add(1, AcqRel);
                s.pid.store(me, Release);
                true
            } else {
                false
            };
            if mine {
                s.mig.store(self.mig_serial, Release);
                self.slot_pid.store(me, Release);
                self.slot.store(i + 1, Release);
                return Some(s);
            }
        }
        None
    }

    fn drain_usage(&self, s: &Slot) {
        for (d, u) in s.used.iter().enumerate() {
            let n = u.swap(0, AcqRel);
            if n != 0 {
                sub_sat(&self.shared.devs[d].used, n);
            }
        }
    }

    /// Returns the memory of processes that have exited.
    pub fn reap_dead(&self) {
        let fd = self.fd.load(Acquire);
        if fd < 0 {
            return;
        }
        let mine = self.slot.load(Acquire);
        for (i, s) in self.shared.slots.iter().enumerate() {
            if i + 1 == mine || s.pid.load(Acquire) == 0 {
                continue;
            }
            if slot_lock(fd, i, libc::F_WRLCK) {
                self.drain_usage(s);
                s.mig.store(0, Release);
                s.pid.store(0, Release);
                slot_lock(fd, i, libc::F_UNLCK);
            }
        }
    }

    fn try_reserve(&self, d: usize, size: u64) -> bool {
        let used = &self.shared.devs[self.cuda_devs[d].slot].used;
        let total = self.totals[d];
        let mut cur = used.load(Acquire);
        loop {
            let Some(new) = cur.checked_add(size).filter(|&n| n <= total) else {
                return false;
            };
            match used.compare_exchange_weak(cur, new, AcqRel, Acquire) {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
    }

    /// Charges `size` bytes of physical memory on device `d`.
    pub fn reserve(&self, d: usize, size: u64) -> Result<(), CUresult> {
        if !self.try_reserve(d, size) {
            self.reap_dead();
            if !self.try_reserve(d, size) {
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
        }
        let slot = self.cuda_devs[d].slot;
        if let Some(s) = self.my_slot() {
            s.used[slot].fetch_add(size, AcqRel);
        }
        Ok(())
    }

    pub fn release(&self, d: usize, size: u64) {
        let slot = self.cuda_devs[d].slot;
        if let Some(s) = self.my_slot() {
            sub_sat(&s.used[slot], size);
        }
        sub_sat(&self.shared.devs[slot].used, size);
    }

    /// Live processes holding memory on a physical device or MIG instance:
    /// (pid, bytes, serial of the MIG compute instance it runs on).
    pub fn slot_processes(&self, slot: usize) -> Vec<(u32, u64, u32)> {
        self.reap_dead();
        self.shared
            .slots
            .iter()
            .filter_map(|s| {
                let p = s.pid.load(Acquire);
                let u = s.used[slot].load(Acquire);
                (p != 0 && u != 0).then(|| (p, u, s.mig.load(Acquire)))
            })
            .collect()
    }

    /// The process behind an engine token, while it is the one that took
    /// that slot (None: gone).
    fn pid_of(&self, token: u64) -> Option<u32> {
        if token & NO_SLOT != 0 {
            return Some((token & 0xffff_ffff) as u32);
        }
        let s = self
            .shared
            .slots
            .get(((token & 0xffff_ffff) as usize).checked_sub(1)?)?;
        let same = s.generation.load(Acquire) & GEN_MASK == (token >> 32) as u32;
        Some(s.pid.load(Acquire)).filter(|&p| same && p != 0)
    }

    /// Per process whose kernels ran on physical device `d` after `since`
    /// (CLOCK_MONOTONIC ns): (pid, kernel ns it ran, when it last ran),
    /// its contexts together; with the instant it was read at.
    pub fn process_work(&self, d: usize, since: u64) -> (u64, Vec<(u32, u64, u64)>) {
        let (now, ran) = engine::ran_since_slot(self, d, since);
        let mut per: Vec<(u32, u64, u64)> = Vec::new();
        for (token, ns, last) in ran {
            let Some(pid) = self.pid_of(token) else {
                continue;
            };
            match per.iter_mut().find(|p| p.0 == pid) {
                Some(p) => {
                    p.1 += ns;
                    p.2 = p.2.max(last);
                }
                None => per.push((pid, ns, last)),
            }
        }
        (now, per)
    }

    /// Busy percentage of physical device `d` over roughly the last second.
    pub fn utilization(&self, d: usize) -> u32 {
        let st = engine::stats_slot(self, d);
        let (done, running) = (st.busy_ns, st.running);
        let now = now_ns();
        let mut samples = self.util[d].lock().unwrap_or_else(|e| e.into_inner());
        let window = 1_000_000_000;
        let base = samples
            .iter()
            .rev()
            .find(|(t, _)| *t + window <= now)
            .or_else(|| samples.first())
            .copied();
        let pct = match base {
            Some((t, b)) if now > t => {
                (done.saturating_sub(b) as u128 * 100 / (now - t) as u128).min(100) as u32
            }
            _ if running => 100,
            _ => 0,
        };
        // Keep the newest sample older than the window plus everything newer.
        let keep_from = samples
            .iter()
            .rposition(|(t, _)| *t + window <= now)
            .unwrap_or(0);
        samples.drain(..keep_from);
        if samples.last().is_none_or(|(t, _)| now >= t + 10_000_000) {
            samples.push((now, done));
        }
        pct
    }
}

fn sub_sat(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(AcqRel, Acquire, |v| Some(v.saturating_sub(n)));
}

impl engine::Host for Sim {
    fn engine(&self, dev: usize) -> &Engine {
        Sim::engine(self, dev)
    }
    fn slot_engine(&self, slot: usize) -> &Engine {
        Sim::slot_engine(self, slot)
    }
    fn token(&self) -> u64 {
        Sim::token(self)
    }
    fn alive(&self, token: u64) -> bool {
        Sim::alive(self, token)
    }
    fn params(&self) -> Params {
        Sim::params(self)
    }
    fn private(&self) -> bool {
        Sim::private(self)
    }
    fn retire(&self, dev: usize, ns: u64) {
        Sim::retire(self, dev, ns)
    }
}
