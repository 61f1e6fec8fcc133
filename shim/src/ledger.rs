//! Per-device memory books. A reservation is a compare-and-swap loop, taken
//! *before* the driver is called, so no interleaving of threads can take a
//! process past its cap; a failed driver call gives the reservation back.
//! Every live allocation is remembered with its size, device and context,
//! so frees return exactly what was charged and a destroyed context returns
//! everything it owned — the books never drift.
//!
//! A process of a job (`gpufrac run --gpu-memory`) also charges the job's
//! shared books (`gpufrac_common::jobledger`), which another process can
//! damage. Books that cannot be trusted refuse the charge: the reason is
//! said once on stderr, and memory is handed out again only when they can
//! be trusted again.

use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::jobledger::{BooksError, JobLedger, MAX_GPUS};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

pub use crate::view::NO_LIMIT;

/// One device's books for this process.
pub struct Ledger {
    pub used: AtomicU64,
    pub limit: AtomicU64,
    pub peak: AtomicU64,
    pub ooms: AtomicU64,
    /// Allocations refused by the shim on this device
    /// (`gpufrac_mem_refusals`): what a test runner reads around a test to
    /// know it ran out of memory by its cap.
    pub refusals: AtomicU64,
    /// The most the process asked to hold since the peak was last reset:
    /// what it held when an allocation was refused plus that allocation
    /// (`gpufrac_mem_wanted`, with the peak). A test refused at its first
    /// allocation peaks at nothing; this is what it needed.
    wanted: AtomicU64,
    /// A narrower cap the process set on itself (`set_limit`; `NO_LIMIT`:
    /// none). Kept apart from `limit`, which the environment's cap fills
    /// when CUDA is initialised, possibly after this was set: what binds
    /// is the smaller of the two, so it can never widen the cap.
    narrow: AtomicU64,
}

impl Ledger {
    /// A new peak from what is charged now; the peak before it.
    fn reset_peak(&self) -> u64 {
        let before = self
            .peak
            .swap(self.used.load(Ordering::Acquire), Ordering::Relaxed);
        // A charge between the load and the swap raised `used` past the
        // new peak; a charge after this load raises the peak itself.
        self.peak
            .fetch_max(self.used.load(Ordering::Acquire), Ordering::Relaxed);
        self.wanted.store(0, Ordering::Relaxed);
        before
    }

    const fn new() -> Self {
        Ledger {
            used: AtomicU64::new(0),
            limit: AtomicU64::new(NO_LIMIT),
            peak: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            wanted: AtomicU64::new(0),
            narrow: AtomicU64::new(NO_LIMIT),
        }
    }

    /// Takes `size` bytes if they fit under the limit; the new total.
    #[inline]
    pub fn take(&self, size: u64) -> Option<u64> {
        let limit = self.effective_limit();
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let new = cur.checked_add(size).filter(|&n| n <= limit)?;
            match self
                .used
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(new),
                Err(actual) => cur = actual,
            }
        }
    }

    /// The cap that binds: the environment's, or the narrower one the
    /// process set on itself.
    #[inline]
    pub fn effective_limit(&self) -> u64 {
        self.limit
            .load(Ordering::Acquire)
            .min(self.narrow.load(Ordering::Acquire))
    }

    #[inline]
    pub fn give(&self, size: u64) {
        self.used.fetch_sub(size, Ordering::AcqRel);
    }

    #[inline]
    fn note_peak(&self, total: u64) {
        // Read first: a new peak is rare, a locked max on every allocation
        // is not free.
        if total > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(total, Ordering::Relaxed);
        }
    }
}

pub static LEDGERS: [Ledger; MAX_DEVICES] = [const { Ledger::new() }; MAX_DEVICES];

/// Why a charge was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It would pass this process's cap.
    Process,
    /// It would pass the job's cap.
    Job,
    /// The job's books cannot take it (damaged, locked by a process that
    /// stopped, or full); said once on stderr.
    Books,
}

/// The job's shared books, when this process belongs to one: every charge
/// must fit the job's cap as well as the process's own.
struct Job {
    books: JobLedger,
    path: String,
    /// This process's slot; `NO_SLOT` until (re)attached, as after a fork.
    slot: AtomicUsize,
    /// Local ordinal -> GPU index in the books, `UNJOINED` until found.
    gpu: [AtomicU8; MAX_DEVICES],
    /// The devices' UUIDs, by local ordinal (set when they are known).
    uuids: OnceLock<Vec<[u8; 16]>>,
    /// The user has been told that the books cannot be charged.
    told: AtomicBool,
}

const NO_SLOT: usize = usize::MAX;
const UNJOINED: u8 = u8::MAX;
const _: () = assert!(MAX_GPUS < UNJOINED as usize);

static JOB: AtomicPtr<Job> = AtomicPtr::new(std::ptr::null_mut());

/// Opens the job's books at initialisation (before any charge): books that
/// cannot be used fail it.
pub fn open_job(path: &str) -> Result<(), BooksError> {
    let books = JobLedger::open(path)?;
    let job = Box::new(Job {
        books,
        path: path.to_owned(),
        slot: AtomicUsize::new(NO_SLOT),
        gpu: [const { AtomicU8::new(UNJOINED) }; MAX_DEVICES],
        uuids: OnceLock::new(),
        told: AtomicBool::new(false),
    });
    // Never freed: a process belongs to one job for its life.
    JOB.store(Box::into_raw(job), Ordering::Release);
    Ok(())
}

/// Joins the job's books with this process's devices (by UUID), once they
/// are known. What cannot be joined now is joined at the first charge, or
/// that charge is refused.
pub fn join_job(uuids: &[[u8; 16]]) {
    if let Some(j) = job() {
        let _ = j.uuids.set(uuids.to_vec());
        for dev in 0..uuids.len().min(MAX_DEVICES) {
            let _ = j.place(dev);
        }
    }
}

#[inline]
fn job() -> Option<&'static Job> {
    let p = JOB.load(Ordering::Acquire);
    // SAFETY: published once, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

impl Job {
    /// Says once why the books cannot be charged.
    #[cold]
    fn refuse(&self, why: fmt::Arguments<'_>) -> Refusal {
        if !self.told.swap(true, Ordering::Relaxed) {
            crate::log::write_line(format_args!(
                "the job's memory books at {} cannot be charged: {why}; allocations are refused with CUDA_ERROR_OUT_OF_MEMORY until they can",
                self.path
            ));
        }
        Refusal::Books
    }

    fn distrust(&self, e: BooksError) -> Refusal {
        self.refuse(format_args!("{e}"))
    }

    /// The books answered: a later failure is news again.
    #[inline]
    fn trusted(&self) {
        if self.told.load(Ordering::Relaxed) {
            self.told.store(false, Ordering::Relaxed);
        }
    }

    /// (slot, GPU index) for a charge on `dev`: the GPU joined and a slot
    /// taken (a forked child takes its own at its first charge).
    fn place(&self, dev: usize) -> Result<(usize, usize), Refusal> {
        let cell = self.gpu.get(dev).ok_or(Refusal::Books)?;
        let mut g = cell.load(Ordering::Acquire);
        if g == UNJOINED {
            let Some(uuid) = self.uuids.get().and_then(|u| u.get(dev)) else {
                return Err(self.refuse(format_args!("device {dev} is not known to it")));
            };
            match self.books.gpu(uuid) {
                Ok(Some(i)) => g = i as u8,
                Ok(None) => {
                    return Err(self.refuse(format_args!(
                        "the job uses more GPUs than its books hold ({MAX_GPUS})"
                    )));
                }
                Err(e) => return Err(self.distrust(e)),
            }
            cell.store(g, Ordering::Release);
        }
        let mut slot = self.slot.load(Ordering::Acquire);
        if slot == NO_SLOT {
            slot = match self.books.attach(std::process::id()) {
                Ok(Some(s)) => s,
                Ok(None) => {
                    return Err(self.refuse(format_args!(
                        "the job runs more processes than its books hold ({})",
                        gpufrac_common::jobledger::MAX_SLOTS
                    )));
                }
                Err(e) => return Err(self.distrust(e)),
            };
            self.slot.store(slot, Ordering::Release);
        }
        Ok((slot, g as usize))
    }

    // Kept out of line: the charge of a process outside any job (nearly
    // every allocation) must not carry the job's code.
    #[inline(never)]
    fn charge(&self, dev: usize, size: u64) -> Result<(), Refusal> {
        let (slot, g) = self.place(dev)?;
        match self.books.reserve(slot, g, size) {
            Ok(true) => {
                self.trusted();
                Ok(())
            }
            Ok(false) => {
                self.trusted();
                Err(Refusal::Job)
            }
            Err(e) => Err(self.distrust(e)),
        }
    }

    #[inline(never)]
    fn uncharge(&self, dev: usize, size: u64) {
        // Books that cannot be charged keep what they hold: the job is
        // over-charged, never under.
        if let Ok((slot, g)) = self.place(dev)
            && let Err(e) = self.books.unreserve(slot, g, size)
        {
            self.distrust(e);
        }
    }

    fn room(&self, dev: usize) -> Result<u64, Refusal> {
        let (_, g) = self.place(dev)?;
        self.books.room(g).map_err(|e| self.distrust(e))
    }
}

/// Room left under the job's cap on `dev` (`NO_LIMIT` outside a job, 0
/// when the job's books cannot be trusted).
pub fn job_room(dev: usize) -> u64 {
    job().map_or(NO_LIMIT, |j| j.room(dev).unwrap_or(0))
}

/// Charges `size` bytes to `dev`, under this process's cap and, in a job,
/// the job's.
pub fn reserve(dev: usize, size: u64) -> Result<(), Refusal> {
    let Some(l) = LEDGERS.get(dev) else {
        return Ok(());
    };
    let Some(total) = l.take(size) else {
        l.ooms.fetch_add(1, Ordering::Relaxed);
        return Err(Refusal::Process);
    };
    if let Some(j) = job()
        && let Err(r) = j.charge(dev, size)
    {
        l.give(size);
        l.ooms.fetch_add(1, Ordering::Relaxed);
        return Err(r);
    }
    l.note_peak(total);
    Ok(())
}

/// Charges memory the driver already holds (a graph pool's growth): past
/// the cap if need be, so that nothing more is allocated until it goes.
pub fn force(dev: usize, size: u64) {
    if reserve(dev, size).is_err()
        && let Some(l) = LEDGERS.get(dev)
    {
        let new = l.used.fetch_add(size, Ordering::AcqRel) + size;
        l.note_peak(new);
    }
}

pub fn unreserve(dev: usize, size: u64) {
    if let Some(l) = LEDGERS.get(dev) {
        l.give(size);
        if let Some(j) = job() {
            j.uncharge(dev, size);
        }
    }
}

pub fn used(dev: usize) -> u64 {
    LEDGERS
        .get(dev)
        .map_or(0, |l| l.used.load(Ordering::Acquire))
}

pub fn limit(dev: usize) -> u64 {
    LEDGERS.get(dev).map_or(NO_LIMIT, Ledger::effective_limit)
}

/// Narrows this process's own cap on `dev` to `bytes` (0: back to the cap
/// from the environment), never above that cap, whenever CUDA is
/// initialised: a test runner narrows a worker to one test's budget and
/// widens it again, and nothing that calls this gets more than its
/// environment gave it. The job's books, when there are any, still bind.
/// Returns the cap now in force (`NO_LIMIT`: none yet).
pub fn set_limit(dev: usize, bytes: u64) -> u64 {
    let Some(l) = LEDGERS.get(dev) else {
        return NO_LIMIT;
    };
    l.narrow
        .store(if bytes == 0 { NO_LIMIT } else { bytes }, Ordering::Release);
    l.effective_limit()
}

pub fn peak(dev: usize) -> u64 {
    LEDGERS
        .get(dev)
        .map_or(0, |l| l.peak.load(Ordering::Relaxed))
}

/// Starts a new peak on `dev` from what is charged now; returns the peak
/// before it (per-test peaks for a test runner).
pub fn reset_peak(dev: usize) -> u64 {
    LEDGERS.get(dev).map_or(0, Ledger::reset_peak)
}

/// The most the process asked to hold on `dev` since its peak was last
/// reset: the peak, or what it held at a refusal plus the refused request.
pub fn wanted(dev: usize) -> u64 {
    LEDGERS.get(dev).map_or(0, |l| {
        l.wanted
            .load(Ordering::Relaxed)
            .max(l.peak.load(Ordering::Relaxed))
    })
}

/// Allocations refused on `dev` so far (0 for a device past the books).
pub fn refusals(dev: usize) -> u64 {
    LEDGERS
        .get(dev)
        .map_or(0, |l| l.refusals.load(Ordering::Relaxed))
}

/// When the last refusal line was written (CLOCK_MONOTONIC ns + 1; 0:
/// never), process-wide.
static LAST_SAID: AtomicU64 = AtomicU64::new(0);
const SAY_EVERY_NS: u64 = 1_000_000_000;

/// Whether a refusal at `now` (ns) may be said, given when the last one
/// was: the first always, then at most one a second. One thread wins a
/// second's turn.
fn may_say(last: &AtomicU64, now: u64) -> bool {
    let stamp = now.saturating_add(1);
    let prev = last.load(Ordering::Relaxed);
    if prev != 0 && stamp < prev.saturating_add(SAY_EVERY_NS) {
        return false;
    }
    last.compare_exchange(prev, stamp, Ordering::Relaxed, Ordering::Relaxed)
        .is_ok()
}

/// Counts a refused allocation of `size` on `dev` and says so on stderr,
/// at any log level: the first refusal of the process, then at most one a
/// second, so that a cap is never taken for a full GPU. Runs only on a
/// refusal; allocates nothing.
#[cold]
pub fn refused(dev: usize, size: u64, why: Refusal) {
    use gpufrac_common::size::Short;
    if let Some(l) = LEDGERS.get(dev) {
        l.refusals.fetch_add(1, Ordering::Relaxed);
        let asked = l.used.load(Ordering::Acquire).saturating_add(size);
        l.wanted.fetch_max(asked, Ordering::Relaxed);
    }
    // The books said why, once, when they could not be charged.
    if why == Refusal::Books || !may_say(&LAST_SAID, gpufrac_common::clock::mono_ns()) {
        return;
    }
    match why {
        // A request larger than the cap would be refused on an empty
        // device too: "cap reached (0 B in use)" would send the user
        // looking for what holds the memory.
        Refusal::Process if size > limit(dev) => crate::log::write_line(format_args!(
            "device {dev}: refused {}: the request alone exceeds the cap of {} ({} in use)",
            Short(size),
            Short(limit(dev)),
            Short(used(dev))
        )),
        Refusal::Process => crate::log::write_line(format_args!(
            "device {dev}: refused {}: cap {} reached ({} in use)",
            Short(size),
            Short(limit(dev)),
            Short(used(dev))
        )),
        _ => {
            let (cap, used) = job().map_or((0, 0), |j| {
                let used = j
                    .place(dev)
                    .ok()
                    .and_then(|(_, g)| j.books.used(g).ok())
                    .unwrap_or(0);
                (j.books.cap(), used)
            });
            crate::log::write_line(format_args!(
                "device {dev}: refused {}: the job's cap {} reached ({} in use by the job)",
                Short(size),
                Short(cap),
                Short(used)
            ))
        }
    }
}

/// One live allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// The live allocations, sharded by key so that threads allocating at once
/// rarely meet on a lock.
pub struct Records {
    shards: [[Mutex<Map>; SHARDS]; 3],
}

fn lock(m: &Mutex<Map>) -> std::sync::MutexGuard<'_, Map> {
    // A poisoned shard only means a panic was contained elsewhere; the map
    // itself is still consistent (every operation is a single insert/remove).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Records {
    pub fn new() -> Box<Records> {
        Box::new(Records {
            shards: std::array::from_fn(|_| std::array::from_fn(|_| Mutex::new(Map::default()))),
        })
    }

    #[inline]
    fn shard(&self, kind: Kind, key: u64) -> &Mutex<Map> {
        // Device pointers are aligned; mix the bits so shards fill evenly.
        let h = (key ^ (key >> 17) ^ (key >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        &self.shards[kind as usize][(h >> 58) as usize % SHARDS]
    }

    /// Records a live allocation; the entry it replaces, if the key was
    /// already there (the driver reused an address we never saw freed).
    pub fn insert(&self, kind: Kind, key: u64, e: Entry) -> Option<Entry> {
        lock(self.shard(kind, key)).insert(key, e)
    }

    pub fn remove(&self, kind: Kind, key: u64) -> Option<Entry> {
        lock(self.shard(kind, key)).remove(&key)
    }

    /// Forgets every pointer and array of context `ctx`, handing each to
    /// `gone`.
    pub fn release_context(&self, ctx: usize, mut gone: impl FnMut(&Entry)) {
        for kind in [Kind::Ptr, Kind::Array] {
            for s in &self.shards[kind as usize] {
                lock(s).retain(|_, e| {
                    if e.ctx == ctx {
                        gone(e);
                        false
                    } else {
                        true
                    }
                });
            }
        }
    }

    pub fn count(&self) -> usize {
        self.shards
            .iter()
            .flat_map(|k| k.iter())
            .map(|s| lock(s).len())
            .sum()
    }
}

static RECORDS: AtomicPtr<Records> = AtomicPtr::new(std::ptr::null_mut());

fn records() -> &'static Records {
    let p = RECORDS.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published once and never freed (a fork child replaces it
        // and leaks the old one on purpose).
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Records::new());
    match RECORDS.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: just published, never freed.
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: we created `fresh` and nobody else saw it.
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { &*winner }
        }
    }
}

/// Records a live allocation. If the key was already present, the stale
/// charge is returned.
#[inline]
pub fn insert(kind: Kind, key: u64, e: Entry) {
    if let Some(old) = records().insert(kind, key, e) {
        stale(old);
    }
}

#[cold]
fn stale(old: Entry) {
    unreserve(old.dev as usize, old.size);
}

pub fn remove(kind: Kind, key: u64) -> Option<Entry> {
    records().remove(kind, key)
}

/// Returns every charge owned by a context that the driver has destroyed
/// (its memory went with it).
pub fn release_context(ctx: usize) {
    records().release_context(ctx, |e| unreserve(e.dev as usize, e.size));
}

pub fn live_count() -> usize {
    records().count()
}

pub fn reset_after_fork() {
    // A child charges a slot of its own, taken at its first charge.
    if let Some(j) = job() {
        j.slot.store(NO_SLOT, Ordering::Release);
    }
    RECORDS.store(Box::into_raw(Records::new()), Ordering::Release);
    for l in &LEDGERS {
        l.used.store(0, Ordering::Relaxed);
        l.peak.store(0, Ordering::Relaxed);
        l.ooms.store(0, Ordering::Relaxed);
        l.refusals.store(0, Ordering::Relaxed);
        l.wanted.store(0, Ordering::Relaxed);
    }
    // The child has said nothing yet.
    LAST_SAID.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capped(limit: u64) -> Ledger {
        let l = Ledger::new();
        l.limit.store(limit, Ordering::Relaxed);
        l
    }

    #[test]
    fn set_limit_narrows_and_widens_but_never_past_the_environments_cap() {
        // A device of its own, so that no other test's books move under it.
        let dev = MAX_DEVICES - 1;
        // Narrowed before CUDA is initialised, which then sets the cap
        // from the environment: the narrower one still binds.
        assert_eq!(set_limit(dev, 1 << 30), 1 << 30);
        LEDGERS[dev].limit.store(8 << 30, Ordering::Release);
        assert_eq!(limit(dev), 1 << 30);
        assert!(
            LEDGERS[dev].take(2 << 30).is_none(),
            "over the narrowed cap"
        );
        assert_eq!(set_limit(dev, 16 << 30), 8 << 30, "never past the start");
        assert_eq!(set_limit(dev, 2 << 30), 2 << 30);
        assert_eq!(set_limit(dev, 0), 8 << 30, "0 restores the start");
        assert_eq!(limit(dev), 8 << 30);
        assert_eq!(LEDGERS[dev].take(2 << 30), Some(2 << 30));
        LEDGERS[dev].give(2 << 30);
    }

    #[test]
    fn takes_up_to_the_limit_and_no_further() {
        let l = capped(100);
        assert_eq!(l.take(60), Some(60));
        assert_eq!(l.take(41), None);
        assert_eq!(l.take(40), Some(100));
        l.give(30);
        assert_eq!(l.used.load(Ordering::Relaxed), 70);
        // A size that would overflow is refused, not wrapped.
        assert_eq!(l.take(u64::MAX), None);
        assert_eq!(capped(NO_LIMIT).take(u64::MAX), Some(u64::MAX));
    }

    #[test]
    fn a_peak_reset_starts_from_what_is_charged() {
        let l = capped(100);
        let t = l.take(80).unwrap();
        l.note_peak(t);
        l.give(50);
        assert_eq!(l.reset_peak(), 80);
        assert_eq!(l.peak.load(Ordering::Relaxed), 30);
        let t = l.take(10).unwrap();
        l.note_peak(t);
        assert_eq!(l.reset_peak(), 40);
    }

    #[test]
    fn racing_threads_never_overshoot() {
        let l = capped(64);
        let barrier = std::sync::Barrier::new(8);
        let got: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        let mut n = 0;
                        while l.take(1).is_some() {
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(got, 64);
        assert_eq!(l.used.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn refusals_are_said_first_then_at_most_once_a_second() {
        const S: u64 = SAY_EVERY_NS;
        let last = AtomicU64::new(0);
        // The first, even at the clock's origin.
        assert!(may_say(&last, 0));
        assert!(!may_say(&last, 0));
        assert!(!may_say(&last, S - 1));
        assert!(may_say(&last, S));
        assert!(!may_say(&last, S + S / 2));
        // A quiet spell: the next one is said at once.
        assert!(may_say(&last, 10 * S + 7));
        assert!(!may_say(&last, 11 * S + 6));
        assert!(may_say(&last, 11 * S + 7));
        // Never more than one per second over any run of refusals.
        let last = AtomicU64::new(0);
        let said: Vec<u64> = (0..5000u64)
            .map(|i| i * 1_900_037 % (7 * S))
            .scan(0, |t, step| {
                *t += step / 13;
                Some(*t)
            })
            .filter(|&t| may_say(&last, t))
            .collect();
        assert!(said.len() > 1);
        assert!(said.windows(2).all(|w| w[1] - w[0] >= S), "{said:?}");
    }

    #[test]
    fn racing_refusals_say_one_line() {
        let last = AtomicU64::new(0);
        let barrier = std::sync::Barrier::new(8);
        let said: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        usize::from(may_say(&last, 5 * SAY_EVERY_NS))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(said, 1);
    }

    #[test]
    fn records_return_what_was_charged() {
        let r = Records::new();
        let e = |size, ctx| Entry { size, dev: 0, ctx };
        assert_eq!(r.insert(Kind::Ptr, 0x1000, e(10, 1)), None);
        // The same number names different things in different maps.
        assert_eq!(r.insert(Kind::Vmm, 0x1000, e(20, 0)), None);
        assert_eq!(r.insert(Kind::Array, 0x2000, e(30, 1)), None);
        assert_eq!(r.insert(Kind::Ptr, 0x3000, e(40, 2)), None);
        // An address reused before we saw it freed: the stale entry comes
        // back to be given back.
        assert_eq!(r.insert(Kind::Ptr, 0x3000, e(50, 2)), Some(e(40, 2)));
        assert_eq!(r.count(), 4);
        let mut freed = 0;
        r.release_context(1, |e| freed += e.size);
        assert_eq!(freed, 40, "context 1's pointer and array, not its VMM");
        assert_eq!(r.remove(Kind::Vmm, 0x1000), Some(e(20, 0)));
        assert_eq!(r.remove(Kind::Ptr, 0x1000), None);
        assert_eq!(r.count(), 1);
    }
}
