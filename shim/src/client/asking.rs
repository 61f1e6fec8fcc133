//! Asking the broker for a device and waiting for its grant: an
//! application thread that finds its device's gate closed sends `Acquire`
//! (once per outstanding request) and sleeps until the client thread opens
//! the gate or arbitration ends.

use super::optimism;
use super::send::send;
use crate::devices;
use gpufrac_common::wire::ClientMsg;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Devices for which an Acquire is outstanding.
static REQUESTED: AtomicU64 = AtomicU64::new(0);
static WAIT: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Waits of 100 ms after which a waiting process repeats its Acquire.
const ASK_AGAIN_ROUNDS: u32 = 5;

/// Sends `Acquire` for `d` unless one is outstanding; true if it did. With
/// `optimistic`, the launches that follow may go out before the answer
/// (the window opens before the request leaves, so a quick grant closes it).
pub fn ask(d: usize, optimistic: bool) -> bool {
    let bit = 1u64 << d;
    if REQUESTED.fetch_or(bit, AcqRel) & bit != 0 {
        return false;
    }
    if optimistic {
        optimism::open(d);
    }
    if let Some(dev) = devices::all().get(d)
        && !send(&ClientMsg::Acquire {
            uuid: dev.uuid.bytes,
        })
    {
        // Not on the wire (no connection at this instant): asking again
        // must not be skipped as already done.
        REQUESTED.fetch_and(!bit, AcqRel);
    }
    true
}

/// Blocks while `closed()` says `d`'s gate is shut (not granted, and
/// arbitration on: no broker, or a stalled one in optional mode, opens
/// every gate; the client thread's `Watch` bounds this wait).
pub fn wait_for_grant(d: usize, closed: impl Fn() -> bool) {
    let bit = 1u64 << d;
    let mut g = WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    let mut rounds = 0u32;
    while closed() {
        rounds += 1;
        if rounds.is_multiple_of(ASK_AGAIN_ROUNDS) {
            // Asked long ago and still nothing: ask again. The broker
            // takes a repeated Acquire as the same request, and a request
            // lost in some race (a CI run once left a process waiting on a
            // broker that had it as idle) costs half a second, not forever.
            REQUESTED.fetch_and(!bit, AcqRel);
        }
        ask(d, false);
        g = WAIT
            .1
            .wait_timeout(g, Duration::from_millis(100))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Wakes every waiting thread to look at its gate again.
pub fn wake_all() {
    let _g = WAIT.0.lock().unwrap_or_else(|e| e.into_inner());
    WAIT.1.notify_all();
}

/// An Acquire for the devices in `bits` is on its way (a release that asks
/// again first).
pub fn asked(bits: u64) {
    REQUESTED.fetch_or(bits, SeqCst);
}

/// The devices in `bits` were granted: nothing is outstanding for them.
pub fn granted(bits: u64) {
    REQUESTED.fetch_and(!bits, SeqCst);
}

/// The connection is new or gone: no request is outstanding.
pub fn forget_all() {
    REQUESTED.store(0, SeqCst);
}

pub fn requested() -> u64 {
    REQUESTED.load(SeqCst)
}
