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

//!
//! `model.rs` is the pure model, `lock.rs` the device lock with its
//! crash handling; this file is what the driver entry points call.

mod crash;
mod lock;
mod model;

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

use gpufrac_common::cuda::CUresult;

use crate::objects::{Ctx, Event, Handle, Target, Work, fetch_max};

pub use crash::{CRASH_BEFORE_COMMIT, CRASH_HOLDING_LOCK, arm_crash};
pub use gpufrac_common::clock::{mono_ns as now_ns, sleep_until};
use lock::lock;
pub use model::{Engine, MAX_CTX, Params};
use model::{Model, idx};

/// Longest sleep of a waiter between looks at the model. Arrivals only ever
/// delay a completion, so sleeping until the projected one is safe; drops
/// (a dead process, a destroyed context) bring completions forward.
const WAIT_CAP_NS: u64 = 200_000;
/// How often some process checks whether owners of contexts have died.
const REAP_EVERY_NS: u64 = 1_000_000;
/// The code a real driver gives when it runs out of channels for a launch.
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;

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

/// What the engine needs of the machine's shared state (`state::Sim`,
/// which holds the engines): a device's engine, this process's token and
/// whether another's is alive, the timing parameters, and where to put the
/// time of retired contexts. A trait, so that the engine sits below the
/// state that holds it.
pub trait Host {
    fn engine(&self, dev: usize) -> &Engine;
    fn slot_engine(&self, slot: usize) -> &Engine;
    fn token(&self) -> u64;
    fn alive(&self, token: u64) -> bool;
    fn params(&self) -> Params;
    /// No state file: nobody else shares these engines.
    fn private(&self) -> bool;
    fn retire(&self, dev: usize, ns: u64);
}

/// Runs `f` on the model of device `dev` advanced to `now`, under the lock.
#[inline(always)]
fn with_model<H: Host + ?Sized, R>(
    sim: &H,
    dev: usize,
    now: u64,
    f: impl FnOnce(&mut Model) -> R,
) -> R {
    with_engine(sim, sim.engine(dev), Some(dev), now, f)
}

/// `with_model` on any engine; `dev` (the CUDA device, if the engine is
/// one of this process's) dates the events watched on it.
#[inline(always)]
fn with_engine<H: Host + ?Sized, R>(
    sim: &H,
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
fn maybe_reap<H: Host + ?Sized>(sim: &H, dev: usize, now: u64) {
    maybe_reap_engine(sim, sim.engine(dev), now);
}

#[inline(always)]
fn maybe_reap_engine<H: Host + ?Sized>(sim: &H, eng: &Engine, now: u64) {
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

fn reap<H: Host + ?Sized>(sim: &H, dev: usize, now: u64) {
    reap_engine(sim, sim.engine(dev), now);
}

fn reap_engine<H: Host + ?Sized>(sim: &H, eng: &Engine, now: u64) {
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
pub fn launch<H: Host + ?Sized>(sim: &H, t: Target, d: u64) -> Result<(), CUresult> {
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

/// None when `w` is done, else when to look again.
fn poll<H: Host + ?Sized>(sim: &H, w: Work, now: u64, project: bool) -> Option<u64> {
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

pub fn is_done<H: Host + ?Sized>(sim: &H, w: Work) -> bool {
    poll(sim, w, now_ns(), false).is_none()
}

/// Blocks until `w` is done, sleeping (never spinning) between looks.
pub fn wait<H: Host + ?Sized>(sim: &H, w: Work) {
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
pub fn done_at<H: Host + ?Sized>(sim: &H, w: Work) -> Option<u64> {
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
pub fn drop_ctx<H: Host + ?Sized>(sim: &H, c: &Ctx) {
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
pub fn executed_by_me<H: Host + ?Sized>(sim: &H, dev: usize) -> u64 {
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

/// What ran on a physical device or MIG instance (`Shared::devs` index)
/// after `since`: per live context that ran, its owner's token, the
/// kernel ns it ran (over its last runs: `Model::ran_since`) and when it
/// last ran; with the instant the model was read at.
pub fn ran_since_slot<H: Host + ?Sized>(
    sim: &H,
    slot: usize,
    since: u64,
) -> (u64, Vec<(u64, u64, u64)>) {
    let now = now_ns();
    let eng = sim.slot_engine(slot);
    maybe_reap_engine(sim, eng, now);
    let ran = with_engine(sim, eng, None, now, |m| {
        (0..MAX_CTX)
            .filter_map(|i| {
                let owner = m.ent(i).owner.load(Acquire);
                let (ns, last) = if owner == 0 {
                    (0, 0)
                } else {
                    m.ran_since(i, since)
                };
                (ns > 0).then_some((owner, ns, last))
            })
            .collect()
    });
    (now, ran)
}

pub struct Stats {
    pub busy_ns: u64,
    pub kernels: u64,
    pub switches: u64,
    pub running: bool,
}

pub fn stats<H: Host + ?Sized>(sim: &H, dev: usize) -> Stats {
    stats_engine(sim, sim.engine(dev), Some(dev))
}

/// `stats` of a physical device or MIG instance (`Shared::devs` index),
/// whether or not CUDA shows it to this process (NVML asks).
pub fn stats_slot<H: Host + ?Sized>(sim: &H, slot: usize) -> Stats {
    stats_engine(sim, sim.slot_engine(slot), None)
}

fn stats_engine<H: Host + ?Sized>(sim: &H, eng: &Engine, dev: Option<usize>) -> Stats {
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
