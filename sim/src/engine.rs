//! The execution engine: per device, a time-slicing scheduler over the
//! contexts of every process sharing the state file, in CLOCK_MONOTONIC ns.
//!
//! The model is what an H100 (driver 580) was measured to do. Each context
//! has a FIFO of work (all its streams share it). The engine runs one
//! context at a time, round-robin among those with pending work. The running
//! context keeps the engine until its work runs out or, when another context
//! is waiting, until the end of its current time slice: slices of `quantum`
//! renew back to back while it runs alone, so a newcomer waits for the
//! current one to end. Each change of running context costs `switch` ns
//! without progress; resuming the context that ran last on an idle engine
//! costs nothing.
//!
//! Work is counted in ns per context: `w` submitted, `e` executed. A kernel
//! submitted when its context had submitted `w0` is complete once
//! `e >= w0 + d`, so stream and context tails are such work targets, not
//! times. The model is lazy: whoever holds the device lock advances it to
//! "now" through its discrete events (a slice ends, a context runs dry, a
//! switch starts); every arrival advances it first, so the outcome depends
//! only on arrival times, whoever does the advancing.
//!
//! Crash safety, for a process SIGKILLed at any instruction, also while it
//! holds the lock: the lock word holds the holder's process token, and a
//! waiter that finds the holder dead (slot liveness in state.rs) takes the
//! lock over. The scheduler record is double-buffered and committed by one
//! store of `seq` after every event; everything a holder writes before that
//! store is either what recomputing the event from the previous record
//! writes again (a context's `e` at the end of a run, a run segment, pending
//! bits) or belongs to the holder's own entries, which are dropped with it.
//! A taker just recomputes from the committed record.

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

use gpufrac_common::cuda::CUresult;

use crate::objects::{Ctx, Event, Handle, Target};
use crate::state::Sim;

pub use gpufrac_common::clock::{mono_ns as now_ns, sleep_until};

/// Contexts with work per device, over all processes.
pub const MAX_CTX: usize = 256;
/// Run segments kept per context, to date event completions.
const SEGS: usize = 16;
const PEND_WORDS: usize = MAX_CTX / 64;
// The bitmap code spells out its four words.
const _: () = assert!(PEND_WORDS == 4);
/// Longest sleep of a waiter between looks at the model. Arrivals only ever
/// delay a completion, so sleeping until the projected one is safe; drops
/// (a dead process, a destroyed context) bring completions forward.
const WAIT_CAP_NS: u64 = 200_000;
/// How often some process checks whether owners of contexts have died.
const REAP_EVERY_NS: u64 = 1_000_000;
/// The code a real driver gives when it runs out of channels for a launch.
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;

/// One context of one process on one device.
#[repr(C)]
pub struct Ent {
    /// `(generation << 32) | index`; the generation counts allocations, so
    /// a binding to an earlier user of the entry is recognised as stale.
    tag: AtomicU64,
    /// Token of the owning process; 0: free.
    owner: AtomicU64,
    w: AtomicU64,
    /// Executed work; exact while the context is not the running one.
    e: AtomicU64,
    /// `w` and `e` at allocation.
    e0: AtomicU64,
    nseg: AtomicU64,
    /// Ring of run starts `(t, e)`: a run began at `t` with `e` executed.
    segs: [[AtomicU64; 2]; SEGS],
}

/// The scheduler record; see `Rec`.
#[repr(C)]
struct RecCell([AtomicU64; 7]);

#[repr(C, align(64))]
pub struct Engine {
    /// Token of the process holding the lock; 0: free.
    lock: AtomicU64,
    /// `recs[seq & 1]` is the committed record.
    seq: AtomicU64,
    next_reap: AtomicU64,
    kernels_total: AtomicU64,
    /// Entries that may have pending work (checked before use).
    pend: [AtomicU64; PEND_WORDS],
    recs: [RecCell; 2],
    ents: [Ent; MAX_CTX],
}

#[derive(Clone, Copy, Default, PartialEq, Debug)]
struct Rec {
    /// The record describes the engine at time `t`.
    t: u64,
    /// Tag of the running context (also while switching to it); 0: idle.
    cur: u64,
    /// Tag of the context that ran last.
    last: u64,
    /// When `cur` starts or started progressing: its slices count from here.
    run_from: u64,
    /// `cur`'s executed work at `run_from`.
    base_e: u64,
    /// Kernel ns executed, switches excluded.
    busy: u64,
    switches: u64,
}

impl RecCell {
    fn load(&self) -> Rec {
        let v = |i: usize| self.0[i].load(Relaxed);
        Rec {
            t: v(0),
            cur: v(1),
            last: v(2),
            run_from: v(3),
            base_e: v(4),
            busy: v(5),
            switches: v(6),
        }
    }

    fn store(&self, r: Rec) {
        let v = [r.t, r.cur, r.last, r.run_from, r.base_e, r.busy, r.switches];
        for (a, v) in self.0.iter().zip(v) {
            a.store(v, Relaxed);
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub quantum: u64,
    pub switch: u64,
}

#[inline(always)]
fn idx(tag: u64) -> usize {
    (tag & 0xffff_ffff) as usize
}

/// `e` values a projection changed, kept out of the shared entries.
#[derive(Clone, Copy, Default)]
struct Overlay {
    n: usize,
    v: [(usize, u64); 4],
    full: bool,
}

/// The scheduler state while the device lock is held.
#[derive(Clone, Copy)]
struct Model<'a> {
    eng: &'a Engine,
    p: Params,
    rec: Rec,
    pend: [u64; PEND_WORDS],
    /// Some: a projection, which writes nothing shared.
    overlay: Option<Overlay>,
    transitions: u32,
    /// Changed beyond `rec.t` since the last commit.
    dirty: bool,
}

/// The first set bit at or after `from`, wrapping around.
fn next_set(p: &[u64; PEND_WORDS], from: usize) -> Option<usize> {
    let from = from % MAX_CTX;
    let (w0, b0) = (from / 64, from % 64);
    // Word w0 from bit b0, the other words, then word w0 below bit b0.
    let mut k = 0;
    while k <= PEND_WORDS {
        let w = (w0 + k) % PEND_WORDS;
        let m = match k {
            0 => p[w] & (!0u64 << b0),
            PEND_WORDS => p[w] & !(!0u64 << b0),
            _ => p[w],
        };
        if m != 0 {
            return Some(w * 64 + m.trailing_zeros() as usize);
        }
        k += 1;
    }
    None
}

fn none_set(p: &[u64; PEND_WORDS]) -> bool {
    (p[0] | p[1] | p[2] | p[3]) == 0
}

impl<'a> Model<'a> {
    fn load(eng: &'a Engine, p: Params) -> Model<'a> {
        let seq = eng.seq.load(Acquire);
        let ld = |i: usize| eng.pend[i].load(Relaxed);
        let pend = [ld(0), ld(1), ld(2), ld(3)];
        Model {
            eng,
            p,
            rec: eng.recs[(seq & 1) as usize].load(),
            pend,
            overlay: None,
            transitions: 0,
            dirty: false,
        }
    }

    fn commit(&mut self) {
        if self.overlay.is_some() {
            return;
        }
        for (i, &v) in self.pend.iter().enumerate() {
            self.eng.pend[i].store(v, Relaxed);
        }
        let seq = self.eng.seq.load(Relaxed);
        self.eng.recs[((seq + 1) & 1) as usize].store(self.rec);
        if self.transitions > 0 {
            crash_point(CRASH_BEFORE_COMMIT);
        }
        self.eng.seq.store(seq + 1, Release);
        self.dirty = false;
    }

    /// Commits, or when only the model time moved, just moves the committed
    /// record's time: with no event due before it, the record holds then
    /// too (and a single store leaves nothing half done). Keeping `t` fresh
    /// matters: a dropped context stops at the last moment anyone looked.
    fn commit_if_changed(&mut self) {
        if self.dirty {
            self.commit();
        } else if self.overlay.is_none() {
            let seq = self.eng.seq.load(Relaxed);
            self.eng.recs[(seq & 1) as usize].0[0].store(self.rec.t, Relaxed);
        }
    }

    #[inline(always)]
    fn ent(&self, i: usize) -> &'a Ent {
        &self.eng.ents[i]
    }

    fn valid(&self, tag: u64) -> bool {
        let i = idx(tag);
        tag != 0
            && i < MAX_CTX
            && self.ent(i).tag.load(Acquire) == tag
            && self.ent(i).owner.load(Acquire) != 0
    }

    fn w(&self, i: usize) -> u64 {
        self.ent(i).w.load(Acquire)
    }

    fn e(&self, i: usize) -> u64 {
        if let Some(o) = &self.overlay
            && let Some(&(_, v)) = o.v[..o.n].iter().rev().find(|(j, _)| *j == i)
        {
            return v;
        }
        self.ent(i).e.load(Acquire)
    }

    fn set_e(&mut self, i: usize, v: u64) {
        match &mut self.overlay {
            None => self.eng.ents[i].e.store(v, Release),
            Some(o) if o.n < o.v.len() => {
                o.v[o.n] = (i, v);
                o.n += 1;
            }
            Some(o) => o.full = true,
        }
    }

    fn seg(&mut self, i: usize, t: u64, e: u64) {
        if self.overlay.is_some() {
            return;
        }
        let ent = self.ent(i);
        let n = ent.nseg.load(Relaxed);
        let slot = |k: u64| &ent.segs[(k % SEGS as u64) as usize];
        // Recomputing after a crash may push the same run again.
        if n > 0 && slot(n - 1)[0].load(Relaxed) == t && slot(n - 1)[1].load(Relaxed) == e {
            return;
        }
        slot(n)[0].store(t, Relaxed);
        slot(n)[1].store(e, Relaxed);
        ent.nseg.store(n + 1, Release);
    }

    fn set_pend(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.pend[w] & b == 0 {
            self.pend[w] |= b;
            self.dirty = true;
        }
    }

    fn clear_pend(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.pend[w] & b != 0 {
            self.pend[w] &= !b;
            self.dirty = true;
        }
    }

    fn any_pending_except(&self, i: usize) -> bool {
        let mut p = self.pend;
        p[i / 64] &= !(1 << (i % 64));
        !none_set(&p)
    }

    /// The next context with pending work in round-robin order from `from`.
    fn next_pending(&mut self, from: usize, exclude: Option<usize>) -> Option<usize> {
        loop {
            let mut p = self.pend;
            if let Some(x) = exclude {
                p[x / 64] &= !(1 << (x % 64));
            }
            let i = next_set(&p, from)?;
            if self.ent(i).owner.load(Acquire) != 0 && self.w(i) > self.e(i) {
                return Some(i);
            }
            // A freed entry, or one whose owner died between its two writes.
            self.clear_pend(i);
        }
    }

    /// When the running context stops, and whether it is because its work
    /// ran out (else its slice ended with another context waiting).
    fn run_end(&self) -> (u64, bool) {
        let r = &self.rec;
        let i = idx(r.cur);
        let w = self.w(i).max(r.base_e);
        let t_done = r.run_from.saturating_add(w - r.base_e);
        if self.any_pending_except(i) {
            // The first slice boundary at or after the moment the others
            // were known to wait (`r.t`: the pending set only changes when
            // the model is advanced).
            let q = self.p.quantum.max(1);
            let k = r.t.saturating_sub(r.run_from).div_ceil(q).max(1);
            let t_pre = r.run_from.saturating_add(k.saturating_mul(q));
            if t_pre < t_done {
                return (t_pre, false);
            }
        }
        (t_done, true)
    }

    fn start(&mut self, i: usize, tag: u64, run_from: u64) {
        let e = self.e(i);
        self.rec.cur = tag;
        self.rec.run_from = run_from;
        self.rec.base_e = e;
        self.seg(i, run_from, e);
    }

    /// Performs the next event if it happens by `now`.
    fn step(&mut self, now: u64) -> bool {
        let r = self.rec;
        if r.cur == 0 {
            if none_set(&self.pend) {
                return false;
            }
            let from = if r.last != 0 { idx(r.last) + 1 } else { 0 };
            let Some(n) = self.next_pending(from, None) else {
                return false;
            };
            let tag = self.ent(n).tag.load(Acquire);
            let run_from = if tag == r.last {
                r.t
            } else {
                self.rec.switches += 1;
                r.t.saturating_add(self.p.switch)
            };
            self.start(n, tag, run_from);
            self.transitions += 1;
            return true;
        }
        let i = idx(r.cur);
        if !self.valid(r.cur) {
            // Dropped (destroyed, or its process died) while running: it
            // stops at the last moment the model was known.
            self.rec.busy += r.t.saturating_sub(r.run_from);
            self.rec.cur = 0;
            self.rec.last = 0;
            self.transitions += 1;
            return true;
        }
        let (t_end, done) = self.run_end();
        if t_end > now {
            return false;
        }
        let e_end = r.base_e + (t_end - r.run_from);
        self.set_e(i, e_end);
        self.rec.busy += e_end - r.base_e;
        self.rec.t = r.t.max(t_end);
        self.rec.last = r.cur;
        self.transitions += 1;
        if done {
            self.clear_pend(i);
        }
        match self.next_pending(i + 1, Some(i)) {
            Some(n) => {
                let tag = self.ent(n).tag.load(Acquire);
                self.rec.switches += 1;
                self.start(n, tag, self.rec.t.saturating_add(self.p.switch));
            }
            // The one that seemed to wait was stale: a new slice, no switch.
            None if !done => self.start(i, r.cur, self.rec.t),
            None => self.rec.cur = 0,
        }
        true
    }

    fn advance(&mut self, now: u64) {
        // Every event moves time or consumes work, so this ends; the bound
        // only guards against a corrupted state file.
        for _ in 0..(1 << 24) {
            if !self.step(now) {
                break;
            }
            // One event per commit: an event reads no `e` it writes (but
            // the one it rewrites identically), so a taker recomputing an
            // uncommitted event from the record before it gets the same.
            // Several events could not be replayed: a later one's writes
            // would feed an earlier one.
            self.commit();
        }
        self.rec.t = self.rec.t.max(now);
    }

    /// Executed work of entry `i` at `rec.t`.
    fn e_now(&self, i: usize) -> u64 {
        let r = &self.rec;
        if r.cur != 0 && idx(r.cur) == i && self.valid(r.cur) {
            let w = self.w(i).max(r.base_e);
            r.base_e + r.t.saturating_sub(r.run_from).min(w - r.base_e)
        } else {
            self.e(i)
        }
    }

    fn busy_now(&self) -> u64 {
        let r = &self.rec;
        if r.cur != 0 && self.valid(r.cur) {
            r.busy + (self.e_now(idx(r.cur)) - r.base_e)
        } else {
            r.busy
        }
    }

    fn done(&self, tag: u64, x: u64) -> bool {
        !self.valid(tag) || self.e_now(idx(tag)) >= x
    }

    /// When entry `tag` reaches `x` if nothing new arrives, if that happens
    /// by `horizon` (or is decided before it).
    fn project(&self, tag: u64, x: u64, horizon: u64) -> Option<u64> {
        let mut m = Model {
            overlay: Some(Overlay::default()),
            ..*self
        };
        for _ in 0..64 {
            if m.rec.cur == tag {
                let (t_end, _) = m.run_end();
                let reach = m.rec.run_from + x.saturating_sub(m.rec.base_e);
                if reach <= t_end {
                    return Some(reach);
                }
            }
            if !m.step(horizon) || m.overlay.is_some_and(|o| o.full) {
                return None;
            }
        }
        None
    }

    /// The instant entry `tag`'s executed work reached `x` (which it has),
    /// from its run segments; 0 when it had before its first run.
    fn reach_time(&self, tag: u64, x: u64) -> Option<u64> {
        if !self.valid(tag) {
            return None;
        }
        let ent = self.ent(idx(tag));
        let n = ent.nseg.load(Acquire);
        let lo = n.saturating_sub(SEGS as u64);
        let slot = |k: u64| &ent.segs[(k % SEGS as u64) as usize];
        for k in (lo..n).rev() {
            let (t, e) = (slot(k)[0].load(Relaxed), slot(k)[1].load(Relaxed));
            if e < x {
                return Some(t + (x - e));
            }
        }
        // Older than the ring: no later than the oldest run it keeps.
        Some(if lo == 0 {
            0
        } else {
            slot(lo)[0].load(Relaxed)
        })
    }

    fn alloc(&mut self, me: u64, base: u64) -> Option<(usize, u64)> {
        let (i, ent) = self
            .eng
            .ents
            .iter()
            .enumerate()
            .find(|(_, e)| e.owner.load(Acquire) == 0)?;
        let generation = ((ent.tag.load(Relaxed) >> 32) + 1) & 0xffff_ffff;
        let tag = (generation.max(1) << 32) | i as u64;
        ent.tag.store(tag, Relaxed);
        ent.w.store(base, Relaxed);
        ent.e.store(base, Relaxed);
        ent.e0.store(base, Relaxed);
        ent.nseg.store(0, Relaxed);
        // Published last: an entry half set up by a process that died is
        // still free.
        ent.owner.store(me, Release);
        self.clear_pend(i);
        self.dirty = true;
        Some((i, tag))
    }

    fn free(&mut self, i: usize) {
        self.ent(i).owner.store(0, Release);
        self.clear_pend(i);
        self.dirty = true;
    }

    /// Queues `d` ns on the context bound through `bind`, binding it to a
    /// fresh entry (starting at `base`) first if needed. Returns the work
    /// target of the new kernel.
    fn submit(&mut self, bind: &AtomicU64, me: u64, base: u64, d: u64, now: u64) -> Option<u64> {
        let b = bind.load(Acquire);
        let i = if self.valid(b) && self.ent(idx(b)).owner.load(Acquire) == me {
            idx(b)
        } else {
            let (i, tag) = self.alloc(me, base)?;
            bind.store(tag, Release);
            i
        };
        let ent = self.ent(i);
        let w = ent.w.load(Relaxed).saturating_add(d);
        ent.w.store(w, Release);
        if d > 0 {
            self.set_pend(i);
            // Idle engine: it starts now; a running one may be due to yield.
            self.advance(now);
        }
        Some(w)
    }
}

// ---------------------------------------------------------------------------
// The device lock.

struct Guard<'a>(&'a AtomicU64);

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.0.store(0, Release);
    }
}

const SPINS: u32 = 64;
const YIELDS: u32 = 64;
/// Every this many waits past spinning, ask whether the holder is alive.
const LOOK_EVERY: u32 = 8;

fn lock<'a>(eng: &'a Engine, me: u64, alive: impl Fn(u64) -> bool) -> Guard<'a> {
    let mut n: u32 = 0;
    loop {
        let h = eng.lock.load(Relaxed);
        if h == 0 {
            if eng
                .lock
                .compare_exchange_weak(0, me, Acquire, Relaxed)
                .is_ok()
            {
                break;
            }
        } else if h != me
            && n >= SPINS
            && (n - SPINS).is_multiple_of(LOOK_EVERY)
            && !alive(h)
            && eng.lock.compare_exchange(h, me, Acquire, Relaxed).is_ok()
        {
            // Its holder was killed inside: the committed record is whole.
            break;
        }
        n = n.saturating_add(1);
        if n < SPINS {
            std::hint::spin_loop();
        } else if n < SPINS + YIELDS {
            std::thread::yield_now();
        } else {
            // The holder is descheduled (or dead): stop competing for CPU.
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
    crash_point(CRASH_HOLDING_LOCK);
    Guard(&eng.lock)
}

// ---------------------------------------------------------------------------
// Test-only fault injection: die with SIGKILL at a chosen point.

pub const CRASH_HOLDING_LOCK: u32 = 1;
pub const CRASH_BEFORE_COMMIT: u32 = 2;
static CRASH: AtomicU32 = AtomicU32::new(0);

pub fn arm_crash(at: u32) {
    CRASH.store(at, Relaxed);
}

#[inline(always)]
fn crash_point(at: u32) {
    if CRASH.load(Relaxed) == at {
        // SAFETY: plain syscalls.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

// ---------------------------------------------------------------------------
// What the driver entry points use.

/// The kernel duration convention: `kernelParams[0]` points to a u64 of
/// nanoseconds; NULL anywhere means 0.
#[inline(always)]
pub unsafe fn duration_from_params(params: *mut *mut c_void) -> u64 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: the caller's kernelParams array has at least one entry when
    // non-NULL, as the convention requires.
    let p0 = unsafe { *params };
    if p0.is_null() {
        0
    } else {
        unsafe { (p0 as *const u64).read_unaligned() }
    }
}

/// Runs `f` on the model of device `dev` advanced to `now`, under the lock.
#[inline(always)]
fn with_model<R>(sim: &Sim, dev: usize, now: u64, f: impl FnOnce(&mut Model) -> R) -> R {
    with_engine(sim, sim.engine(dev), Some(dev), now, f)
}

/// `with_model` on any engine; `dev` (the CUDA device, if the engine is
/// one of this process's) dates the events watched on it.
#[inline(always)]
fn with_engine<R>(
    sim: &Sim,
    eng: &Engine,
    dev: Option<usize>,
    now: u64,
    f: impl FnOnce(&mut Model) -> R,
) -> R {
    let _g = lock(eng, sim.token(), |t| sim.alive(t));
    let mut m = Model::load(eng, sim.params());
    m.advance(now);
    let r = f(&mut m);
    m.commit_if_changed();
    if let Some(dev) = dev
        && WATCHED.load(Relaxed) != 0
    {
        date_events(&m, dev, now);
    }
    r
}

/// This process's events recorded before their work was done, with the
/// generation of that record. They are dated as soon as any of its engine
/// calls sees them done, while the run segments that date them are fresh
/// (a process waiting for work looks every `WAIT_CAP_NS` at least).
static WATCHED: AtomicUsize = AtomicUsize::new(0);
static WATCH: Mutex<Vec<(&'static Event, u64)>> = Mutex::new(Vec::new());

pub fn watch(e: &'static Event, generation: u64) {
    let mut v = WATCH.lock().unwrap_or_else(|p| p.into_inner());
    v.push((e, generation));
    WATCHED.store(v.len(), Relaxed);
}

/// Lock order: device engine, then WATCH; an event's own lock is only
/// tried (whoever holds it dates the event itself).
fn date_events(m: &Model, dev: usize, now: u64) {
    let mut v = WATCH.lock().unwrap_or_else(|p| p.into_inner());
    v.retain(|&(e, generation)| {
        if !e.alive() {
            return false;
        }
        let Ok(mut r) = e.rec.try_lock() else {
            return true;
        };
        let Some(w) = r.work.filter(|_| r.generation == generation && r.done == 0) else {
            return false;
        };
        if w.dev != dev || !m.done(w.bind, w.x) {
            return true;
        }
        let t = m.reach_time(w.bind, w.x).unwrap_or(now);
        r.done = t.max(r.at).max(1);
        false
    });
    WATCHED.store(v.len(), Relaxed);
}

/// Drops the work of contexts whose process has died, at most once per
/// `REAP_EVERY_NS` per device over all processes (it costs a system call
/// per other process).
#[inline(always)]
fn maybe_reap(sim: &Sim, dev: usize, now: u64) {
    maybe_reap_engine(sim, sim.engine(dev), now);
}

#[inline(always)]
fn maybe_reap_engine(sim: &Sim, eng: &Engine, now: u64) {
    let due = eng.next_reap.load(Relaxed);
    if now < due || sim.private() {
        return;
    }
    if eng
        .next_reap
        .compare_exchange(due, now + REAP_EVERY_NS, Relaxed, Relaxed)
        .is_ok()
    {
        reap_engine(sim, eng, now);
    }
}

fn reap(sim: &Sim, dev: usize, now: u64) {
    reap_engine(sim, sim.engine(dev), now);
}

fn reap_engine(sim: &Sim, eng: &Engine, now: u64) {
    let me = sim.token();
    // Liveness costs a system call: ask outside the lock, once per owner.
    let mut seen = [(0u64, true); 16];
    let mut nseen = 0;
    let mut dead = [(0usize, 0u64, 0u64); 32];
    let mut ndead = 0;
    for (i, ent) in eng.ents.iter().enumerate() {
        let o = ent.owner.load(Acquire);
        if o == 0 || o == me {
            continue;
        }
        let alive = match seen[..nseen].iter().find(|s| s.0 == o) {
            Some(s) => s.1,
            None => {
                let a = sim.alive(o);
                if nseen < seen.len() {
                    seen[nseen] = (o, a);
                    nseen += 1;
                }
                a
            }
        };
        if !alive && ndead < dead.len() {
            dead[ndead] = (i, ent.tag.load(Acquire), o);
            ndead += 1;
        }
    }
    if ndead == 0 {
        return;
    }
    let _g = lock(eng, me, |t| sim.alive(t));
    let mut m = Model::load(eng, sim.params());
    // Before advancing: the dead stop where the model was last known, not
    // after running on until now.
    for &(i, tag, o) in &dead[..ndead] {
        let ent = &eng.ents[i];
        if ent.tag.load(Acquire) == tag && ent.owner.load(Acquire) == o {
            m.free(i);
        }
    }
    m.advance(now);
    m.commit();
}

/// Queues a kernel of `d` ns on `t`'s stream.
#[inline(always)]
pub fn launch(sim: &Sim, t: Target, d: u64) -> Result<(), CUresult> {
    let dev = t.ctx.device;
    let now = now_ns();
    maybe_reap(sim, dev, now);
    let me = sim.token();
    let base = t.ctx.tail.load(Acquire);
    let sub = |m: &mut Model| m.submit(&t.ctx.ent, me, base, d, now);
    let x = match with_model(sim, dev, now, sub) {
        Some(x) => x,
        None => {
            reap(sim, dev, now);
            with_model(sim, dev, now, sub).ok_or_else(|| {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Relaxed) {
                    eprintln!(
                        "gpufrac-sim: device {dev}: all {MAX_CTX} engine context entries \
                         are in use (contexts with work, over all processes)"
                    );
                }
                CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
            })?
        }
    };
    sim.engine(dev).kernels_total.fetch_add(1, Relaxed);
    fetch_max(t.tail, x);
    if !std::ptr::eq(t.tail, &t.ctx.tail) {
        fetch_max(&t.ctx.tail, x);
    }
    Ok(())
}

#[inline(always)]
fn fetch_max(a: &AtomicU64, v: u64) {
    // Skip the read-modify-write when it would change nothing (common for
    // the context tail).
    if a.load(Relaxed) < v {
        a.fetch_max(v, AcqRel);
    }
}

/// A point in one context's work: done once its executed work reaches `x`.
#[derive(Clone, Copy, Debug)]
pub struct Work {
    pub dev: usize,
    /// The context object (process-local identity).
    pub ctx: usize,
    /// Its entry binding when captured; 0: it never had work.
    bind: u64,
    x: u64,
}

impl Work {
    /// All work submitted so far to `t`'s stream.
    pub fn of(t: Target) -> Work {
        Work {
            dev: t.ctx.device,
            ctx: t.ctx.id(),
            bind: t.ctx.ent.load(Acquire),
            x: t.tail.load(Acquire),
        }
    }

    /// All work submitted so far to `c`.
    pub fn ctx(c: &'static Ctx) -> Work {
        Work {
            dev: c.device,
            ctx: c.id(),
            bind: c.ent.load(Acquire),
            x: c.tail.load(Acquire),
        }
    }

    /// Orders `t`'s later work after this point, which must be of the same
    /// context (one FIFO: raising the stream's target is all it takes).
    pub fn order_before(&self, t: Target) {
        fetch_max(t.tail, self.x);
    }
}

/// None when `w` is done, else when to look again.
fn poll(sim: &Sim, w: Work, now: u64, project: bool) -> Option<u64> {
    if w.bind == 0 {
        return None;
    }
    maybe_reap(sim, w.dev, now);
    let cap = now + WAIT_CAP_NS;
    with_model(sim, w.dev, now, |m| {
        if m.done(w.bind, w.x) {
            None
        } else if project {
            Some(m.project(w.bind, w.x, cap).map_or(cap, |t| t.min(cap)))
        } else {
            Some(cap)
        }
    })
}

pub fn is_done(sim: &Sim, w: Work) -> bool {
    poll(sim, w, now_ns(), false).is_none()
}

/// Blocks until `w` is done, sleeping (never spinning) between looks.
pub fn wait(sim: &Sim, w: Work) {
    loop {
        let now = now_ns();
        match poll(sim, w, now, true) {
            None => return,
            Some(t) => sleep_until(t.max(now + 1_000)),
        }
    }
}

/// When `w` was done, if it is: the instant its context's executed work
/// reached it (`now` if its context was dropped meanwhile).
pub fn done_at(sim: &Sim, w: Work) -> Option<u64> {
    if w.bind == 0 {
        return Some(0);
    }
    let now = now_ns();
    maybe_reap(sim, w.dev, now);
    with_model(sim, w.dev, now, |m| {
        m.done(w.bind, w.x)
            .then(|| m.reach_time(w.bind, w.x).unwrap_or(now))
    })
}

/// Drops the pending work of `c` (destroyed, or its primary context reset).
pub fn drop_ctx(sim: &Sim, c: &Ctx) {
    let b = c.ent.swap(0, AcqRel);
    if b == 0 {
        return;
    }
    let me = sim.token();
    let now = now_ns();
    with_model(sim, c.device, now, |m| {
        let i = idx(b);
        if m.valid(b) && m.ent(i).owner.load(Acquire) == me {
            sim.retire(c.device, m.e_now(i) - m.ent(i).e0.load(Acquire));
            m.free(i);
            m.advance(now);
        }
    });
}

/// Kernel ns executed so far on `dev` by this process's live contexts.
pub fn executed_by_me(sim: &Sim, dev: usize) -> u64 {
    let me = sim.token();
    let now = now_ns();
    maybe_reap(sim, dev, now);
    with_model(sim, dev, now, |m| {
        (0..MAX_CTX)
            .filter(|&i| m.ent(i).owner.load(Acquire) == me)
            .map(|i| m.e_now(i) - m.ent(i).e0.load(Acquire))
            .sum::<u64>()
    })
}

pub struct Stats {
    pub busy_ns: u64,
    pub kernels: u64,
    pub switches: u64,
    pub running: bool,
}

pub fn stats(sim: &Sim, dev: usize) -> Stats {
    stats_engine(sim, sim.engine(dev), Some(dev))
}

/// `stats` of a physical device or MIG instance (`Shared::devs` index),
/// whether or not CUDA shows it to this process (NVML asks).
pub fn stats_slot(sim: &Sim, slot: usize) -> Stats {
    stats_engine(sim, sim.slot_engine(slot), None)
}

fn stats_engine(sim: &Sim, eng: &Engine, dev: Option<usize>) -> Stats {
    let now = now_ns();
    maybe_reap_engine(sim, eng, now);
    let (busy_ns, switches, running) = with_engine(sim, eng, dev, now, |m| {
        (m.busy_now(), m.rec.switches, m.rec.cur != 0)
    });
    Stats {
        busy_ns,
        kernels: eng.kernels_total.load(Acquire),
        switches,
        running,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;
    const P: Params = Params {
        quantum: 2 * MS,
        switch: 100 * US,
    };

    fn engine() -> Box<Engine> {
        // SAFETY: all atomics; zero is the empty engine.
        unsafe { Box::<Engine>::new_zeroed().assume_init() }
    }

    /// One context of one process, driven with explicit times.
    struct C {
        bind: AtomicU64,
        tail: u64,
        me: u64,
    }

    impl C {
        fn new(me: u64) -> C {
            C {
                bind: AtomicU64::new(0),
                tail: 0,
                me,
            }
        }

        fn submit(&mut self, eng: &Engine, now: u64, d: u64) -> u64 {
            let mut m = Model::load(eng, P);
            m.advance(now);
            let x = m.submit(&self.bind, self.me, self.tail, d, now).unwrap();
            m.commit();
            self.tail = x;
            x
        }

        fn executed(&self, eng: &Engine, now: u64) -> u64 {
            let mut m = Model::load(eng, P);
            m.advance(now);
            m.commit();
            m.e_now(idx(self.bind.load(Relaxed)))
        }

        fn projected(&self, eng: &Engine, now: u64, x: u64) -> Option<u64> {
            let mut m = Model::load(eng, P);
            m.advance(now);
            m.commit();
            m.project(self.bind.load(Relaxed), x, u64::MAX)
        }

        fn reached(&self, eng: &Engine, now: u64, x: u64) -> Option<u64> {
            let mut m = Model::load(eng, P);
            m.advance(now);
            m.commit();
            m.done(self.bind.load(Relaxed), x)
                .then(|| m.reach_time(self.bind.load(Relaxed), x).unwrap())
        }
    }

    fn rec(eng: &Engine, now: u64) -> Rec {
        let mut m = Model::load(eng, P);
        m.advance(now);
        m.commit();
        m.rec
    }

    fn busy(eng: &Engine, now: u64) -> u64 {
        let mut m = Model::load(eng, P);
        m.advance(now);
        m.commit();
        m.busy_now()
    }

    #[test]
    fn alone_runs_at_full_speed_without_switches_after_the_first() {
        let eng = engine();
        let mut a = C::new(1);
        let t0 = 1_000 * MS;
        let x = a.submit(&eng, t0, 5 * MS);
        // The first context ever loaded pays one switch.
        assert_eq!(a.projected(&eng, t0, x), Some(t0 + 100 * US + 5 * MS));
        assert_eq!(a.executed(&eng, t0 + 3 * MS), 3 * MS - 100 * US);
        // Idle, then new work for the same context: no switch.
        let t1 = t0 + 20 * MS;
        let x = a.submit(&eng, t1, 5 * MS);
        assert_eq!(a.projected(&eng, t1, x), Some(t1 + 5 * MS));
        let r = rec(&eng, t1 + 30 * MS);
        assert_eq!((r.busy, r.switches, r.cur), (10 * MS, 1, 0));
    }

    #[test]
    fn two_busy_contexts_alternate_by_quantum_with_switch_cost() {
        let eng = engine();
        let (mut a, mut b) = (C::new(1), C::new(2));
        let t0 = 1_000 * MS;
        for _ in 0..100 {
            a.submit(&eng, t0, 6 * MS);
            b.submit(&eng, t0, 6 * MS);
        }
        let t1 = t0 + 1_000 * MS;
        let (ea, eb) = (a.executed(&eng, t1), b.executed(&eng, t1));
        // They take turns: 2 ms slices, each after a 0.1 ms switch.
        let slice = 2 * MS + 100 * US;
        let slices = 1_000 * MS / slice;
        assert!(ea.abs_diff(slices * MS) <= 2 * MS, "{ea}");
        assert!(eb.abs_diff(ea) <= 2 * MS, "{ea} {eb}");
        assert_eq!(busy(&eng, t1), ea + eb);
        let r = rec(&eng, t1);
        assert!(r.switches.abs_diff(slices) <= 2, "{}", r.switches);
    }

    #[test]
    fn a_newcomer_waits_for_the_current_slice_to_end() {
        let eng = engine();
        let (mut a, mut b) = (C::new(1), C::new(2));
        let t0 = 1_000 * MS;
        a.submit(&eng, t0, 600 * MS);
        let run_from = t0 + 100 * US;
        // Arriving 7.3 ms into A's run: slices end every 2 ms since it
        // started, so B gets in at 8 ms plus a switch.
        let t1 = run_from + 7_300 * US;
        let x = b.submit(&eng, t1, 500 * US);
        let done = run_from + 8 * MS + 100 * US + 500 * US;
        assert_eq!(b.projected(&eng, t1, x), Some(done));
        assert_eq!(b.reached(&eng, done - 1, x), None);
        assert_eq!(b.reached(&eng, done, x), Some(done));
        // Arriving on a boundary: it is taken right then.
        let mut c = C::new(3);
        let t2 = run_from + 8 * MS + 600 * US + 100 * US + 4 * MS;
        let x = c.submit(&eng, t2, MS);
        assert_eq!(c.reached(&eng, t2 + 1_100 * US, x), Some(t2 + 1_100 * US));
    }

    #[test]
    fn reach_times_follow_preemption() {
        let eng = engine();
        let (mut a, mut b) = (C::new(1), C::new(2));
        let t0 = 1_000 * MS;
        let x1 = a.submit(&eng, t0, 3 * MS);
        let x2 = a.submit(&eng, t0, 3 * MS);
        b.submit(&eng, t0 + 10 * US, 50 * MS);
        // A: switch, 2 ms, (B: switch, 2 ms), switch, 1 ms -> x1 at 4.5 ms
        // after t0... then 3 ms more once it is back.
        let run = t0 + 100 * US;
        let x1_at = run + 2 * MS + 100 * US + 2 * MS + 100 * US + MS;
        assert_eq!(a.reached(&eng, t0 + 100 * MS, x1), Some(x1_at));
        let x2_at = x1_at + MS + 100 * US + 2 * MS + 100 * US + 2 * MS;
        assert_eq!(a.reached(&eng, t0 + 100 * MS, x2), Some(x2_at));
        assert_eq!(a.reached(&eng, t0 + 100 * MS, 0), Some(0));
    }

    #[test]
    fn freed_entries_drop_their_work_where_the_model_was() {
        let eng = engine();
        let (mut a, mut b) = (C::new(1), C::new(2));
        let t0 = 1_000 * MS;
        a.submit(&eng, t0, 100 * MS);
        let x = b.submit(&eng, t0 + 10 * US, 10 * MS);
        let _ = rec(&eng, t0 + MS);
        // A's process dies; found 5 ms later. It stops at the last look.
        let mut m = Model::load(&eng, P);
        m.free(idx(a.bind.load(Relaxed)));
        m.advance(t0 + 6 * MS);
        m.commit();
        let from = t0 + MS + 100 * US;
        assert_eq!(b.reached(&eng, t0 + 100 * MS, x), Some(from + 10 * MS));
        let r = rec(&eng, t0 + 100 * MS);
        assert_eq!(r.busy, MS - 100 * US + 10 * MS);
        // Its entry is reused under a new generation.
        let mut c = C::new(3);
        c.submit(&eng, t0 + 200 * MS, MS);
        let (ta, tc) = (a.bind.load(Relaxed), c.bind.load(Relaxed));
        assert_eq!(idx(ta), idx(tc));
        assert_ne!(ta, tc);
    }

    /// Two engines with the same history; on one a holder dies after
    /// writing an event but before committing it, and a taker carries on.
    #[test]
    fn a_taker_recomputes_an_uncommitted_event_exactly() {
        let t0 = 1_000 * MS;
        let setup = || {
            let eng = engine();
            let (mut a, mut b, mut c) = (C::new(1), C::new(2), C::new(3));
            a.submit(&eng, t0, 30 * MS);
            b.submit(&eng, t0, 5 * MS);
            c.submit(&eng, t0 + MS, 30 * MS);
            eng
        };
        // The events: A to B at 2.1 ms, B to C at 4.2, C to A at 6.3, A to
        // B at 8.4.
        for at in [2_100, 4_200, 6_300, 8_400].map(|us| t0 + us * US) {
            let (clean, crashed) = (setup(), setup());
            let mut dead = Model::load(&crashed, P);
            dead.advance(at - 1);
            assert!(dead.step(at), "an event falls due at {at}");
            for (a, v) in crashed.pend.iter().zip(dead.pend) {
                a.store(v, Relaxed);
            }
            let seq = crashed.seq.load(Relaxed);
            crashed.recs[((seq + 1) & 1) as usize].store(dead.rec);
            let end = t0 + 80 * MS;
            let (r1, r2) = (rec(&clean, end), rec(&crashed, end));
            assert_eq!(r1, r2);
            for i in 0..3 {
                let (e1, e2) = (&clean.ents[i], &crashed.ents[i]);
                assert_eq!(e1.e.load(Relaxed), e2.e.load(Relaxed));
                let segs = |e: &Ent| {
                    let n = e.nseg.load(Relaxed);
                    (0..n.min(SEGS as u64))
                        .map(|k| e.segs[k as usize].each_ref().map(|v| v.load(Relaxed)))
                        .collect::<Vec<_>>()
                };
                assert_eq!(segs(e1), segs(e2));
            }
        }
    }

    #[test]
    fn bits_wrap_around() {
        let mut p = [0u64; PEND_WORDS];
        assert_eq!(next_set(&p, 5), None);
        p[0] = 1 << 3;
        p[3] = 1 << 63;
        assert_eq!(next_set(&p, 0), Some(3));
        assert_eq!(next_set(&p, 4), Some(255));
        assert_eq!(next_set(&p, 256), Some(3));
        p[3] = 0;
        assert_eq!(next_set(&p, 4), Some(3));
    }
}
