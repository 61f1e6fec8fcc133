//! The compute gate's release handshake, lock-free: a launch counts itself
//! in flight, then looks whether its device is open; a release closes the
//! device, then waits until nothing is counted. Each side writes, then
//! fences (SeqCst), then reads — a Dekker handshake — so either the launch
//! sees the device closed and backs out, or the release sees the launch
//! and waits for it: no launch is ever past a gate whose `Release` is on
//! the wire. The fences are what the memory model needs (SeqCst accesses
//! alone order these two locations too, but only the fence form is one
//! that loom checks: it models SeqCst accesses as acquire/release, under
//! which the handshake fails).
//!
//! Two lanes: a device's own counter, and, while every registered device
//! is held open-ended (`all_open`, a job alone on its GPU), one counter for
//! all, so such a launch need not even look up its device. The gate
//! (`gate.rs`) adds a third, per-thread slots paid for by membarrier, on
//! top of these.
//!
//! Self-contained (std atomics, or loom's under `--cfg loom`), so that the
//! handshake is model-checked with loom as it is compiled (`tests` below:
//! `RUSTFLAGS="--cfg loom" cargo test -p gpufrac-shim --lib --release
//! lanes`).

use gpufrac_common::config::MAX_DEVICES;
#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*, fence};

pub struct Lanes {
    /// Launches must consult the per-device bits.
    pub gated: AtomicBool,
    /// Devices this process may launch on now.
    pub open: AtomicU64,
    /// Every registered device is held under an open-ended, unbounded
    /// grant. Cleared first by anything that closes a device.
    pub all_open: AtomicBool,
    /// Launches that went through the all-open lane and have not returned.
    pub all_lane: AtomicU32,
    /// Per device: launches past its gate that have not returned.
    pub in_flight: [AtomicU32; MAX_DEVICES],
}

/// Which counter a launch let through holds until it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A device's counter.
    Device(usize),
    /// The all-open lane's counter.
    All,
}

macro_rules! lanes {
    ($counters:expr) => {
        Lanes {
            gated: AtomicBool::new(false),
            open: AtomicU64::new(0),
            all_open: AtomicBool::new(false),
            all_lane: AtomicU32::new(0),
            in_flight: $counters,
        }
    };
}

impl Lanes {
    #[cfg(not(loom))]
    pub const fn new() -> Lanes {
        lanes!([const { AtomicU32::new(0) }; MAX_DEVICES])
    }

    #[cfg(loom)]
    pub fn new() -> Lanes {
        lanes!(std::array::from_fn(|_| AtomicU32::new(0)))
    }

    /// The all-open lane: counted and let through, or nothing held.
    #[inline]
    pub fn enter_all(&self) -> Option<Held> {
        self.all_lane.fetch_add(1, Relaxed);
        fence(SeqCst);
        if self.all_open.load(Relaxed) {
            return Some(Held::All);
        }
        self.all_lane.fetch_sub(1, Release);
        None
    }

    /// `d`'s lane: counted and let through while `d` is open, or nothing
    /// held.
    #[inline]
    pub fn enter(&self, d: usize) -> Option<Held> {
        self.in_flight[d].fetch_add(1, Relaxed);
        fence(SeqCst);
        if self.open.load(Relaxed) & (1 << d) != 0 {
            return Some(Held::Device(d));
        }
        self.in_flight[d].fetch_sub(1, Release);
        None
    }

    /// The launch that holds `h` has returned.
    #[inline]
    pub fn leave(&self, h: Held) {
        // Release: what the launch did happens before the release that
        // sees it gone.
        match h {
            Held::Device(d) => self.in_flight[d].fetch_sub(1, Release),
            Held::All => self.all_lane.fetch_sub(1, Release),
        };
    }

    /// Opens `d`; `all_open` as the session says.
    pub fn open(&self, d: usize, all_open: bool) {
        self.open.fetch_or(1 << d, SeqCst);
        self.all_open.store(all_open, SeqCst);
    }

    /// Closes `d` and the all-open lane, and waits, calling `also_inside`
    /// (the gate's per-thread slots, fenced by `fence_all`, see gate.rs) each
    /// time round, until no launch let through on them is still in
    /// flight.
    pub fn close(&self, d: usize, fence_all: impl Fn(), also_inside: impl Fn() -> bool) {
        self.all_open.store(false, Relaxed);
        fence_all();
        self.open.fetch_and(!(1 << d), Relaxed);
        fence(SeqCst);
        while self.in_flight[d].load(Acquire) > 0
            || self.all_lane.load(Acquire) > 0
            || also_inside()
        {
            #[cfg(loom)]
            loom::thread::yield_now();
            #[cfg(not(loom))]
            std::thread::yield_now();
        }
    }

    /// Closes every device at once, waiting for nothing (the connection is
    /// new or gone: the broker holds nothing of this process's to hand
    /// back).
    pub fn close_all(&self) {
        self.all_open.store(false, SeqCst);
        self.open.store(0, SeqCst);
    }

    pub fn is_open(&self, d: usize) -> bool {
        self.open.load(SeqCst) & (1 << d) != 0
    }

    /// Launches let through on `d`'s lane still in flight.
    pub fn in_flight(&self, d: usize) -> u32 {
        self.in_flight[d].load(Relaxed)
    }

    /// A fork child has no launch in flight.
    pub fn reset(&self) {
        self.gated.store(false, SeqCst);
        self.close_all();
        self.all_lane.store(0, SeqCst);
        for c in &self.in_flight {
            c.store(0, SeqCst);
        }
    }
}

#[cfg(all(test, loom))]
mod tests {
    //! Every interleaving (loom) of launches against a release: once the
    //! release has returned (its `Release` about to go out), no launch is
    //! past the gate, whichever lane it took.

    use super::*;
    use loom::sync::Arc;

    /// A launch on `d`, as the gate makes it: the all-open lane, else the
    /// device's; counted in `past` while it is past the gate.
    fn launch(l: &Lanes, d: usize, past: &AtomicU32) {
        let held = l.enter_all().or_else(|| l.enter(d));
        if let Some(h) = held {
            past.fetch_add(1, SeqCst);
            past.fetch_sub(1, SeqCst);
            l.leave(h);
        }
    }

    fn release_while_launching(all_open: bool, launchers: usize) {
        let mut model = loom::model::Builder::new();
        // Every interleaving with up to three preemptions: the handshake's
        // races need one or two.
        model.preemption_bound = Some(3);
        model.check(move || {
            let l = Arc::new(Lanes::new());
            l.gated.store(true, SeqCst);
            l.open(0, all_open);
            let past = Arc::new(AtomicU32::new(0));
            let threads: Vec<_> = (0..launchers)
                .map(|_| {
                    let (l, past) = (l.clone(), past.clone());
                    loom::thread::spawn(move || launch(&l, 0, &past))
                })
                .collect();
            l.close(0, || {}, || false);
            assert_eq!(past.load(SeqCst), 0, "a launch past a released gate");
            // And none gets past it after.
            launch(&l, 0, &past);
            assert!(!l.is_open(0));
            for t in threads {
                t.join().unwrap();
            }
        });
    }

    #[test]
    fn no_launch_outlives_a_release_on_the_device_lane() {
        release_while_launching(false, 1);
    }

    #[test]
    fn no_launch_outlives_a_release_on_the_all_open_lane() {
        release_while_launching(true, 1);
    }

    #[test]
    fn no_launch_of_two_outlives_a_release() {
        release_while_launching(true, 2);
    }
}
