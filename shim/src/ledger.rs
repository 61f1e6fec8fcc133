//! Per-device memory books. `reserve` is a compare-and-swap loop, taken
//! *before* the driver is called, so no interleaving of threads can take a
//! process past its cap; a failed driver call gives the reservation back.
//! Every live allocation is remembered with its size, device and context,
//! so frees return exactly what was charged and a destroyed context returns
//! everything it owned — the books never drift.

use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::jobledger::JobLedger;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering};

pub const NO_LIMIT: u64 = u64::MAX;

pub struct Ledger {
    pub used: AtomicU64,
    pub limit: AtomicU64,
    pub peak: AtomicU64,
    pub ooms: AtomicU64,
}

impl Ledger {
    const fn new() -> Self {
        Ledger {
            used: AtomicU64::new(0),
            limit: AtomicU64::new(NO_LIMIT),
            peak: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
        }
    }
}

pub static LEDGERS: [Ledger; MAX_DEVICES] = [const { Ledger::new() }; MAX_DEVICES];

/// The job's shared books (`gpufrac run --gpu-memory`), when this process
/// belongs to one: every charge must fit the job's cap as well as the
/// process's own.
struct Job {
    books: JobLedger,
    /// This process's slot; `NO_SLOT` until (re)attached, as after a fork.
    slot: AtomicUsize,
    /// Local ordinal -> GPU index in the books (`NO_GPU`: not in the job).
    gpu: [AtomicU8; MAX_DEVICES],
}

const NO_SLOT: usize = usize::MAX;
const NO_GPU: u8 = u8::MAX;

static JOB: AtomicPtr<Job> = AtomicPtr::new(std::ptr::null_mut());

/// Joins the job's books with this process's devices (by UUID). Called
/// once the devices are known.
pub fn join_job(books: JobLedger, uuids: &[[u8; 16]]) -> Result<(), &'static str> {
    let slot = books
        .attach(std::process::id())
        .ok_or("the job runs more processes than its books hold (256)")?;
    let job = Box::new(Job {
        books,
        slot: AtomicUsize::new(slot),
        gpu: [const { AtomicU8::new(NO_GPU) }; MAX_DEVICES],
    });
    for (i, u) in uuids.iter().enumerate().take(MAX_DEVICES) {
        if let Some(g) = job.books.gpu(u) {
            job.gpu[i].store(g as u8, Ordering::Relaxed);
        }
    }
    // Never freed: a process belongs to one job for its life.
    JOB.store(Box::into_raw(job), Ordering::Release);
    Ok(())
}

#[inline]
fn job() -> Option<&'static Job> {
    let p = JOB.load(Ordering::Acquire);
    // SAFETY: published once, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

impl Job {
    /// (slot, gpu index) for a charge on `dev`, attaching a forked child
    /// on its first charge.
    fn place(&self, dev: usize) -> Option<(usize, usize)> {
        let g = self.gpu.get(dev)?.load(Ordering::Relaxed);
        if g == NO_GPU {
            return None;
        }
        let mut slot = self.slot.load(Ordering::Acquire);
        if slot == NO_SLOT {
            slot = self.books.attach(std::process::id())?;
            self.slot.store(slot, Ordering::Release);
        }
        Some((slot, g as usize))
    }
}

/// Room left under the job's cap on `dev` (`NO_LIMIT` outside a job).
pub fn job_room(dev: usize) -> u64 {
    job()
        .and_then(|j| {
            let g = j.gpu.get(dev)?.load(Ordering::Relaxed);
            // A process of the job that exited without freeing still has
            // its slot: free memory must not be understated on its account.
            (g != NO_GPU).then(|| {
                j.books.reclaim_dead();
                j.books.cap().saturating_sub(j.books.used(g as usize))
            })
        })
        .unwrap_or(NO_LIMIT)
}

/// Charges `size` bytes to `dev`. Returns false (and counts an OOM) when
/// that would exceed the device's cap.
pub fn reserve(dev: usize, size: u64) -> bool {
    let Some(l) = LEDGERS.get(dev) else {
        return true;
    };
    let limit = l.limit.load(Ordering::Relaxed);
    let mut cur = l.used.load(Ordering::Relaxed);
    loop {
        let Some(new) = cur.checked_add(size).filter(|&n| n <= limit) else {
            l.ooms.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        match l
            .used
            .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => {
                if let Some(j) = job()
                    && let Some((slot, g)) = j.place(dev)
                    && !j.books.reserve(slot, g, size)
                {
                    l.used.fetch_sub(size, Ordering::AcqRel);
                    l.ooms.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                // Read first: a new peak is rare, a locked max on every
                // allocation is not free.
                if new > l.peak.load(Ordering::Relaxed) {
                    l.peak.fetch_max(new, Ordering::Relaxed);
                }
                return true;
            }
            Err(actual) => cur = actual,
        }
    }
}

/// Charges memory the driver already holds (a graph pool's growth): past
/// the cap if need be, so that nothing more is allocated until it goes.
pub fn force(dev: usize, size: u64) {
    if !reserve(dev, size)
        && let Some(l) = LEDGERS.get(dev)
    {
        let new = l.used.fetch_add(size, Ordering::AcqRel) + size;
        l.peak.fetch_max(new, Ordering::Relaxed);
    }
}

pub fn unreserve(dev: usize, size: u64) {
    if let Some(l) = LEDGERS.get(dev) {
        l.used.fetch_sub(size, Ordering::AcqRel);
        if let Some(j) = job()
            && let Some((slot, g)) = j.place(dev)
        {
            j.books.unreserve(slot, g, size);
        }
    }
}

pub fn used(dev: usize) -> u64 {
    LEDGERS
        .get(dev)
        .map_or(0, |l| l.used.load(Ordering::Acquire))
}

pub fn limit(dev: usize) -> u64 {
    LEDGERS
        .get(dev)
        .map_or(NO_LIMIT, |l| l.limit.load(Ordering::Acquire))
}

/// One live allocation.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub size: u64,
    pub dev: u32,
    /// Owning context (0 for allocations that outlive contexts, such as VMM
    /// handles).
    pub ctx: usize,
}

/// What a key names. Kept in separate maps because a VMM handle, an array
/// handle and a device pointer may share a numeric value.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Ptr = 0,
    Vmm = 1,
    Array = 2,
}

const SHARDS: usize = 64;

/// Keys are device addresses and driver handles, not attacker-chosen
/// strings: a multiplicative hash is enough and costs a few cycles where
/// SipHash costs tens of nanoseconds on every allocation and free.
#[derive(Default, Clone, Copy)]
struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // Fold the high half in so aligned addresses spread over buckets.
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (v >> 32);
    }
}

type Map = HashMap<u64, Entry, std::hash::BuildHasherDefault<AddrHasher>>;

struct Maps {
    shards: [[Mutex<Map>; SHARDS]; 3],
}

impl Maps {
    fn new() -> Box<Maps> {
        Box::new(Maps {
            shards: std::array::from_fn(|_| std::array::from_fn(|_| Mutex::new(Map::default()))),
        })
    }
}

static MAPS: AtomicPtr<Maps> = AtomicPtr::new(std::ptr::null_mut());

fn maps() -> &'static Maps {
    let p = MAPS.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published once and never freed (a fork child replaces it
        // and leaks the old one on purpose).
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Maps::new());
    match MAPS.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: we created `fresh` and nobody else saw it.
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { &*winner }
        }
    }
}

#[inline]
fn shard(kind: Kind, key: u64) -> &'static Mutex<Map> {
    // Device pointers are aligned; mix the bits so shards fill evenly.
    let h = (key ^ (key >> 17) ^ (key >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    &maps().shards[kind as usize][(h >> 58) as usize % SHARDS]
}

fn lock(m: &Mutex<Map>) -> std::sync::MutexGuard<'_, Map> {
    // A poisoned shard only means a panic was contained elsewhere; the map
    // itself is still consistent (every operation is a single insert/remove).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records a live allocation. If the key was already present (the driver
/// reused an address we never saw freed), the stale charge is returned.
pub fn insert(kind: Kind, key: u64, e: Entry) {
    let old = lock(shard(kind, key)).insert(key, e);
    if let Some(old) = old {
        unreserve(old.dev as usize, old.size);
    }
}

pub fn remove(kind: Kind, key: u64) -> Option<Entry> {
    lock(shard(kind, key)).remove(&key)
}

/// Returns every charge owned by a context that the driver has destroyed
/// (its memory went with it).
pub fn release_context(ctx: usize) -> u64 {
    let mut freed = 0;
    for kind in [Kind::Ptr, Kind::Array] {
        for s in &maps().shards[kind as usize] {
            let mut g = lock(s);
            g.retain(|_, e| {
                if e.ctx == ctx {
                    unreserve(e.dev as usize, e.size);
                    freed += e.size;
                    false
                } else {
                    true
                }
            });
        }
    }
    freed
}

pub fn live_count() -> usize {
    maps()
        .shards
        .iter()
        .flat_map(|k| k.iter())
        .map(|s| lock(s).len())
        .sum()
}

pub fn reset_after_fork() {
    // A child charges a slot of its own, taken at its first charge.
    if let Some(j) = job() {
        j.slot.store(NO_SLOT, Ordering::Release);
    }
    MAPS.store(Box::into_raw(Maps::new()), Ordering::Release);
    for l in &LEDGERS {
        l.used.store(0, Ordering::Relaxed);
        l.peak.store(0, Ordering::Relaxed);
        l.ooms.store(0, Ordering::Relaxed);
    }
}
