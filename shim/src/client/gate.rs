//! The compute gate: what every launch passes, and all the state the
//! application threads share with the client thread, in one object
//! (`GATE`; tests make their own).
//!
//! The client thread alone changes what the gate lets through, applying
//! the session's decisions (`open`, `close`, `arbitrate`, `unarbitrated`,
//! `arm`, `end_window`); the session (`session.rs`) is also the only one
//! that sends anything to the broker. Application threads only post what
//! they want (`wants`: a launch found its device closed; `drained`: the
//! drain thread saw a released device's work finish) and wake the client
//! thread, whose session decides what to ask and when: asking again, the
//! optimistic window and the order of an `Acquire` before a `Release` are
//! its rules, tested in virtual time.
//!
//! With no arbitration (no broker, or `GPUFRAC_BROKER=off`) a launch costs
//! one atomic load. With a broker, a launch on a device this process holds
//! is a handful of atomics and no syscall (the handshake of `lanes.rs`);
//! only a launch on a device it does not hold posts its want and waits.

use super::lanes::{Held, Lanes};
use crate::session::Gauges;
use gpufrac_common::clock::mono_ns;
use gpufrac_common::config::MAX_DEVICES;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The one gate of this process.
pub static GATE: Gate = Gate::new();

/// What a process may queue before the broker answers, in its optimistic
/// window: a request of short kernels goes out whole, a batch job that
/// wakes up queues no more than one long kernel (the broker's own burst
/// bound).
pub const OPTIMISTIC_BOUND_NS: u64 = 2_000_000;

/// What the gate needs of the world around it, which tests stand in for.
pub trait World {
    /// The device of the calling thread's current context; None when it
    /// has none (the driver will refuse the launch itself).
    fn device(&self) -> Option<usize>;
    /// Blocks until `d` has room under `bound` ns of queued work.
    fn wait_room(&self, d: usize, bound: u64);
    fn now(&self) -> u64;
}

/// What one pass of the gate holds until its launch returns, handed back
/// to `launched`. Returned, not kept in a thread-local: in a preloaded
/// library each thread-local access is a call, and a launch would pay two.
/// Two words, so that it travels in registers.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pass {
    /// A device's lane (>= 0), nothing (`NONE`), the all-open lane
    /// (`ALL_LANE`), or a slot (`SLOT_BASE - slot`).
    pending: i32,
    /// The device whose in-flight bound the launch counts against (-1:
    /// none).
    track: i32,
}

const NONE: i32 = -1;
const ALL_LANE: i32 = -2;
const SLOT_BASE: i32 = -100;

impl Pass {
    pub const FREE: Pass = Pass {
        pending: NONE,
        track: NONE,
    };

    fn held(h: Held, track: Option<usize>) -> Pass {
        Pass {
            pending: match h {
                Held::Device(d) => d as i32,
                Held::All => ALL_LANE,
            },
            track: track.map_or(NONE, |d| d as i32),
        }
    }

    /// The device whose in-flight bound this launch counts against, if
    /// any (its completion is then timed, see inflight.rs).
    #[inline(always)]
    pub fn tracked(&self) -> Option<usize> {
        usize::try_from(self.track).ok()
    }
}

pub struct Gate {
    lanes: Lanes,
    slots: Slots,
    /// Devices held under a contended (sliced) grant: idle hand-back
    /// applies.
    contended: AtomicU64,
    /// Devices held under a grant with an in-flight bound (others share
    /// the GPU): launches there are tracked, and idle hand-back applies.
    bounded: AtomicU64,
    bound_ns: [AtomicU64; MAX_DEVICES],
    /// Devices whose next launch may go out before the grant (nothing is
    /// asked for them and nothing held: the session arms them).
    armed: AtomicU64,
    /// Per device: when the optimistic window opened by a launch ends (0:
    /// none open).
    window: [AtomicU64; MAX_DEVICES],
    /// Devices an application thread waits for (or launches on, in its
    /// window): the session asks the broker for them.
    wants: AtomicU64,
    /// Devices the drain thread is to drain.
    drains: AtomicU64,
    /// Devices the drain thread has drained, for the session to report.
    drained: AtomicU64,
    /// The drain thread died: the session ends arbitration.
    drain_lost: AtomicBool,
    /// The process is exiting: the session says its figures once more.
    exiting: AtomicBool,
    /// Threads blocked in a synchronize call or waiting for room: waiting
    /// for this process's own work, which is not idleness.
    syncing: AtomicU32,
    last_launch: [AtomicU64; MAX_DEVICES],
    /// Devices registered (bounded by MAX_DEVICES).
    ndev: AtomicU32,
    /// Application threads waiting for a grant.
    waiting: (Mutex<()>, Condvar),
    /// The drain thread waiting for work.
    drain_wait: (Mutex<()>, Condvar),
    /// The first registration was answered, or could not be made.
    registered: (Mutex<bool>, Condvar),
    /// The exit's usage report is out (or cannot be made).
    exit_reported: (Mutex<bool>, Condvar),
    /// What wakes the client thread (an eventfd; -1: none yet).
    wake_fd: AtomicI32,
    /// The connection's descriptor, for a fork child to close (-1: none).
    conn_fd: AtomicI32,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate::new()
    }
}

impl Gate {
    pub const fn new() -> Gate {
        Gate {
            lanes: Lanes::new(),
            slots: Slots::new(),
            contended: AtomicU64::new(0),
            bounded: AtomicU64::new(0),
            bound_ns: [const { AtomicU64::new(0) }; MAX_DEVICES],
            armed: AtomicU64::new(0),
            window: [const { AtomicU64::new(0) }; MAX_DEVICES],
            wants: AtomicU64::new(0),
            drains: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            drain_lost: AtomicBool::new(false),
            exiting: AtomicBool::new(false),
            syncing: AtomicU32::new(0),
            last_launch: [const { AtomicU64::new(0) }; MAX_DEVICES],
            ndev: AtomicU32::new(0),
            waiting: (Mutex::new(()), Condvar::new()),
            drain_wait: (Mutex::new(()), Condvar::new()),
            registered: (Mutex::new(false), Condvar::new()),
            exit_reported: (Mutex::new(false), Condvar::new()),
            wake_fd: AtomicI32::new(-1),
            conn_fd: AtomicI32::new(-1),
        }
    }

    // --- what application threads do -----------------------------------

    /// The gate, before a launch. `Ok` means launch now, and `launched`
    /// must follow with the pass; `Err` is the code to answer instead.
    #[inline(always)]
    pub fn pass(&self, w: &impl World) -> Result<Pass, u32> {
        if !self.lanes.gated.load(Acquire) {
            return Ok(Pass::FREE);
        }
        // Waiting, it never gives up.
        self.pass_slow(w, true).unwrap_or(Ok(Pass::FREE))
    }

    /// The gate without waiting for a grant: `None` when this launch would
    /// have to (for a thread that already holds a pass, which a release of
    /// its device would wait for in turn).
    pub fn pass_now(&self, w: &impl World) -> Option<Result<Pass, u32>> {
        if !self.lanes.gated.load(Acquire) {
            return Some(Ok(Pass::FREE));
        }
        self.pass_slow(w, false)
    }

    #[cold]
    #[inline(never)]
    fn pass_slow(&self, w: &impl World, wait: bool) -> Option<Result<Pass, u32>> {
        if let Some(slot) = self.slots.enter() {
            if self.lanes.all_open.load(Relaxed) {
                return Some(Ok(Pass {
                    pending: SLOT_BASE - slot as i32,
                    track: NONE,
                }));
            }
            self.slots.leave(slot);
        }
        if let Some(h) = self.lanes.enter_all() {
            return Some(Ok(Pass::held(h, None)));
        }
        let Some(d) = w.device().filter(|&d| d < MAX_DEVICES) else {
            return Some(Ok(Pass::FREE));
        };
        let bit = 1u64 << d;
        loop {
            // Wait for room outside the gate: a release must not wait for
            // it.
            let bounded = self.bounded.load(Acquire) & bit != 0;
            let optimistic = !self.lanes.is_open(d) && w.now() < self.window[d].load(Acquire);
            if bounded {
                self.wait_room(w, d, self.bound_ns[d].load(Relaxed));
            } else if optimistic {
                self.wait_room(w, d, OPTIMISTIC_BOUND_NS);
            }
            if let Some(h) = self.lanes.enter(d) {
                if self.shared() & bit != 0 {
                    self.stamp(d, w.now());
                }
                return Some(Ok(Pass::held(h, bounded.then_some(d))));
            }
            if !self.lanes.gated.load(Acquire) {
                return Some(Ok(Pass::FREE));
            }
            if !wait {
                return None;
            }
            // Coming back from idle: a launch the session armed goes out
            // now, its want on its way to the broker meanwhile.
            if self.armed.fetch_and(!bit, AcqRel) & bit != 0 {
                self.window[d].store(w.now() + OPTIMISTIC_NS, Release);
                self.want(d);
                continue;
            }
            if optimistic && w.now() < self.window[d].load(Acquire) {
                // Not counted in flight: this process holds no grant that
                // a release would have to wait for.
                return Some(Ok(Pass {
                    pending: NONE,
                    track: d as i32,
                }));
            }
            self.want(d);
            self.wait_for_grant(d);
        }
    }

    /// After the driver call of a launch that `pass` let through. A launch
    /// that spans several streams passes once per stream and gives back
    /// every pass (one never given back is an in-flight count that a
    /// release waits for forever).
    #[inline(always)]
    pub fn launched(&self, pass: Pass) {
        let d = pass.pending;
        if d >= 0 {
            self.lanes.leave(Held::Device(d as usize));
        } else if d == ALL_LANE {
            self.lanes.leave(Held::All);
        } else if d <= SLOT_BASE {
            self.slots.leave((SLOT_BASE - d) as usize);
        }
    }

    /// Posts that a thread wants `d`, and wakes the client thread if that
    /// is news.
    fn want(&self, d: usize) {
        if self.wants.fetch_or(1 << d, AcqRel) & (1 << d) == 0 {
            self.wake_client();
        }
    }

    /// Sleeps until `d` opens or arbitration ends, or 100 ms pass (the
    /// want is posted again each round: `close_all` forgets it).
    fn wait_for_grant(&self, d: usize) {
        let g = self.waiting.0.lock().unwrap_or_else(|e| e.into_inner());
        if self.lanes.gated.load(Acquire) && !self.lanes.is_open(d) {
            drop(
                self.waiting
                    .1
                    .wait_timeout(g, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner()),
            );
        }
    }

    fn wait_room(&self, w: &impl World, d: usize, bound: u64) {
        self.syncing.fetch_add(1, SeqCst);
        w.wait_room(d, bound);
        self.syncing.fetch_sub(1, SeqCst);
        self.stamp(d, w.now());
    }

    fn stamp(&self, d: usize, t: u64) {
        self.last_launch[d].store(t, Relaxed);
    }

    /// Devices where others share the GPU (a slice, a bound, or someone
    /// waiting): launches there stamp their time, and idle hand-back
    /// applies.
    fn shared(&self) -> u64 {
        self.contended.load(Relaxed) | self.bounded.load(Relaxed)
    }

    /// Runs a synchronize call, marked, so that idle hand-back does not
    /// fire while the process waits for its own work; every device counts
    /// as just used once it returns.
    #[inline(always)]
    pub fn syncing<F: FnOnce() -> u32>(&self, f: F) -> u32 {
        if !self.lanes.gated.load(Relaxed) {
            return f();
        }
        self.syncing.fetch_add(1, SeqCst);
        let rc = f();
        self.syncing.fetch_sub(1, SeqCst);
        let now = mono_ns();
        for l in self.last_launch.iter().take(self.device_count()) {
            l.store(now, Relaxed);
        }
        rc
    }

    // --- what the client thread does, as the session decides ------------

    /// Opens `d` under a grant: `bound_ns` 0 is no in-flight bound;
    /// `stamp` gives the holder a fresh idle window from then; `all_open`:
    /// every registered device is now held open-ended and unbounded.
    pub fn open(
        &self,
        d: usize,
        contended: bool,
        bound_ns: u64,
        stamp: Option<u64>,
        all_open: bool,
    ) {
        let bit = 1u64 << d;
        self.bound_ns[d].store(bound_ns, Relaxed);
        if contended || bound_ns != 0 {
            // Launches go back through the lane that stamps their time
            // before the stamp that starts the idle window.
            self.lanes.all_open.store(false, SeqCst);
        }
        if let Some(t) = stamp {
            self.stamp(d, t);
        }
        set_bit(&self.bounded, bit, bound_ns != 0);
        set_bit(&self.contended, bit, contended);
        self.window[d].store(0, Release);
        self.wants.fetch_and(!bit, AcqRel);
        self.lanes.open(d, all_open);
        self.wake_waiters();
    }

    /// Stops launching on `d` and returns once no launch let through is
    /// still in flight: the `Release` may go out.
    pub fn close(&self, d: usize) {
        let bit = 1u64 << d;
        self.window[d].store(0, Release);
        self.lanes
            .close(d, || self.slots.fence_all(), || self.slots.any_inside());
        self.contended.fetch_and(!bit, SeqCst);
        self.bounded.fetch_and(!bit, SeqCst);
    }

    /// Every gate closed and nothing wanted (the connection is new, or
    /// gone); with `gated` launches wait for a grant, otherwise they run
    /// unarbitrated.
    pub fn close_all(&self, gated: bool) {
        self.lanes.close_all();
        self.contended.store(0, SeqCst);
        self.bounded.store(0, SeqCst);
        self.wants.store(0, SeqCst);
        self.armed.store(0, SeqCst);
        for w in &self.window {
            w.store(0, Relaxed);
        }
        self.lanes.gated.store(gated, Release);
        self.wake_waiters();
    }

    /// The devices whose next launch may go out before its grant.
    pub fn arm(&self, devices: u64) {
        self.armed.store(devices, Release);
    }

    /// Ends `d`'s optimistic window if it is still the one that ends at
    /// `until`; true if it did (what went out meanwhile is then drained).
    pub fn end_window(&self, d: usize, until: u64) -> bool {
        self.window[d]
            .compare_exchange(until, 0, AcqRel, Relaxed)
            .is_ok()
    }

    fn wake_waiters(&self) {
        let _g = self.waiting.0.lock().unwrap_or_else(|e| e.into_inner());
        self.waiting.1.notify_all();
    }

    /// What application threads and the drain thread share with the
    /// session, read for one of its ticks (the waits for own work first:
    /// a thread that stops waiting stamps its last launch after, so the
    /// stamp is seen with it or the wait is). Takes the drained devices:
    /// read once per tick, and only for it.
    pub fn gauges(&self) -> Gauges {
        let mut g = Gauges {
            syncing: self.syncing.load(SeqCst) > 0,
            wants: self.wants.load(Acquire),
            drained: self.drained.swap(0, AcqRel),
            drain_lost: self.drain_lost.load(Acquire),
            exiting: self.exiting.load(Acquire),
            ..Gauges::default()
        };
        for d in 0..self.device_count() {
            if self.lanes.in_flight(d) != 0 {
                g.in_flight |= 1 << d;
            }
            g.last_launch[d] = self.last_launch[d].load(Relaxed);
            g.optimistic_until[d] = self.window[d].load(Acquire);
        }
        g
    }

    /// Some optimistic window is open: the session needs a fine tick.
    pub fn any_window(&self) -> bool {
        self.window.iter().any(|w| w.load(Relaxed) != 0)
    }

    pub fn set_devices(&self, n: usize) {
        self.ndev.store(n.min(MAX_DEVICES) as u32, Relaxed);
    }

    pub fn device_count(&self) -> usize {
        (self.ndev.load(Relaxed) as usize).min(MAX_DEVICES)
    }

    // --- the client thread's wake-ups ----------------------------------

    /// The descriptor that wakes the client thread (an eventfd it polls).
    pub fn set_wake_fd(&self, fd: i32) {
        self.wake_fd.store(fd, Release);
    }

    fn wake_client(&self) {
        let fd = self.wake_fd.load(Acquire);
        if fd >= 0 {
            let one = 1u64;
            // SAFETY: eight bytes to our eventfd; a full counter (never,
            // at 2^64 - 1) would only make this write fail.
            unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        }
    }

    /// The connection's descriptor, for a fork child to close.
    pub fn set_conn_fd(&self, fd: i32) {
        self.conn_fd.store(fd, Release);
    }

    // --- the drain thread ---------------------------------------------

    /// Asks the drain thread to drain `d`.
    pub fn request_drain(&self, d: usize) {
        self.drains.fetch_or(1 << d, SeqCst);
        let _g = self.drain_wait.0.lock().unwrap_or_else(|e| e.into_inner());
        self.drain_wait.1.notify_one();
    }

    /// Blocks until some released device is to be drained; returns them.
    pub fn drain_requests(&self) -> u64 {
        let mut g = self.drain_wait.0.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let r = self.drains.swap(0, SeqCst);
            if r != 0 {
                return r;
            }
            g = self.drain_wait.1.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The drain thread saw `d`'s work finish: the session says so.
    pub fn drained(&self, d: usize) {
        self.drained.fetch_or(1 << d, AcqRel);
        self.wake_client();
    }

    /// The drain thread is gone (a contained panic): the session ends
    /// arbitration, handing back what it holds.
    pub fn drain_lost(&self) {
        self.drain_lost.store(true, Release);
        self.wake_client();
    }

    // --- first registration, exit, fork ------------------------------

    /// At exit (another thread's, while the client thread still runs):
    /// asks the session for its last usage report and waits for it to go
    /// out, at most `within`.
    pub fn report_at_exit(&self, within: Duration) {
        self.exiting.store(true, Release);
        self.wake_client();
        wait_flag(&self.exit_reported, within);
    }

    /// The session's report at exit is out, or cannot be made.
    pub fn exit_reported(&self) {
        set_flag(&self.exit_reported);
    }

    pub fn first_registration_done(&self) {
        set_flag(&self.registered);
    }

    /// Waits for the first registration to be answered, or to fail, at
    /// most `within`.
    pub fn wait_first_registration(&self, within: Duration) {
        wait_flag(&self.registered, within);
    }

    /// The child of a fork has no client thread, no drain thread and no
    /// connection of its own: it closes the parent's descriptors and every
    /// part of the gate goes back to the start. Only async-signal-safe
    /// calls: atomics and close(2) (the locks are not taken: no other
    /// thread exists in the child).
    pub fn reset_after_fork(&self) {
        for fd in [&self.conn_fd, &self.wake_fd] {
            let fd = fd.swap(-1, SeqCst);
            if fd >= 0 {
                // SAFETY: closing the child's copy of an inherited
                // descriptor.
                unsafe { libc::close(fd) };
            }
        }
        self.lanes.reset();
        self.slots.reset();
        for a in [
            &self.contended,
            &self.bounded,
            &self.armed,
            &self.wants,
            &self.drains,
            &self.drained,
        ] {
            a.store(0, SeqCst);
        }
        for w in &self.window {
            w.store(0, SeqCst);
        }
        self.drain_lost.store(false, SeqCst);
        self.syncing.store(0, SeqCst);
    }

    /// Registers this process for membarrier, which lets the all-open lane
    /// use per-thread slots (see `Slots`).
    pub fn register_membarrier(&self) {
        self.slots.register_membarrier();
    }
}

/// How long a window lets launches go out before the grant.
const OPTIMISTIC_NS: u64 = 1_000_000;

/// Sets a flag and wakes whoever waits for it.
fn set_flag(f: &(Mutex<bool>, Condvar)) {
    let mut done = f.0.lock().unwrap_or_else(|e| e.into_inner());
    if !*done {
        *done = true;
        f.1.notify_all();
    }
}

/// Waits for a flag, at most `within`.
fn wait_flag(f: &(Mutex<bool>, Condvar), within: Duration) {
    let deadline = Instant::now() + within;
    let mut done = f.0.lock().unwrap_or_else(|e| e.into_inner());
    while !*done {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        done = f.1.wait_timeout(done, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

fn set_bit(a: &AtomicU64, bit: u64, on: bool) {
    if on {
        a.fetch_or(bit, SeqCst);
    } else {
        a.fetch_and(!bit, SeqCst);
    }
}

/// The all-open lane's per-thread "inside a launch" flags, a cache line
/// each. With membarrier registered, a launch marks its slot with a plain
/// store and a compiler fence: the full fence that the handshake needs is
/// paid by the (rare) releaser, through membarrier, instead of by every
/// launch. Slots are never reused; threads beyond them, or a process
/// without membarrier, take the lane's counter instead.
struct Slots {
    slots: [Slot; NSLOT],
    used: AtomicU32,
    membarrier: AtomicBool,
}

#[repr(align(64))]
struct Slot(AtomicU32);
const NSLOT: usize = 256;

thread_local! {
    // This thread's slot: -1 not yet assigned, -3 none left.
    static MY_SLOT: Cell<i32> = const { Cell::new(-1) };
}

const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

impl Slots {
    const fn new() -> Slots {
        Slots {
            slots: [const { Slot(AtomicU32::new(0)) }; NSLOT],
            used: AtomicU32::new(0),
            membarrier: AtomicBool::new(false),
        }
    }

    fn register_membarrier(&self) {
        // SAFETY: membarrier takes no pointers; failure (old kernel,
        // seccomp) leaves the counter lane in use.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED,
                0,
                0,
            )
        };
        self.membarrier.store(rc == 0, SeqCst);
    }

    fn my_slot(&self) -> Option<usize> {
        MY_SLOT.with(|c| {
            let mut v = c.get();
            if v == -1 {
                let n = self.used.fetch_add(1, Relaxed) as usize;
                v = if n < NSLOT { n as i32 } else { -3 };
                c.set(v);
            }
            usize::try_from(v).ok()
        })
    }

    /// Marks this thread inside a launch: its slot, or `None` when it must
    /// take the counter.
    #[inline]
    fn enter(&self) -> Option<usize> {
        if !self.membarrier.load(Relaxed) {
            return None;
        }
        let slot = self.my_slot()?;
        self.slots[slot].0.store(1, Relaxed);
        std::sync::atomic::compiler_fence(SeqCst);
        Some(slot)
    }

    #[inline]
    fn leave(&self, slot: usize) {
        self.slots[slot].0.store(0, Release);
    }

    /// The releaser's half of the handshake: every thread of this process
    /// runs a full fence, so a launch either saw the lane closed or its
    /// slot is visible to `any_inside`.
    fn fence_all(&self) {
        if self.membarrier.load(Relaxed) {
            // SAFETY: membarrier takes no pointers.
            unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) };
        }
    }

    fn any_inside(&self) -> bool {
        let used = (self.used.load(Acquire) as usize).min(NSLOT);
        self.slots[..used].iter().any(|s| s.0.load(Acquire) != 0)
    }

    /// membarrier registration belongs to the parent's address space, and
    /// no thread of the child is inside a launch.
    fn reset(&self) {
        self.membarrier.store(false, SeqCst);
        for s in &self.slots {
            s.0.store(0, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests;
