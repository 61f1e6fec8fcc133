//! When the state is written: changes are counted, one write is out at a
//! time (it groups what changed meanwhile), and writes are coalesced to
//! one per `SAVE_EVERY`, except that a lease its run waits for goes as
//! soon as its user's last write for leases is that old. The writes are
//! coalesced per user, so that one user's churn (names, leases) never
//! holds another's lease back (a `Name` flood kept a victim's
//! `run --no-wait` answer waiting 101 ms).
//!
//! Changes that only the queue saw (a request that arrived and waits, or
//! left while waiting) wait up to `QUEUE_SAVE_EVERY`: what a crash then
//! forgets is a request that arrived in that last second, and its run
//! asks anew, as the newcomer it was; or one that left, which the next
//! broker drops when it finds its run gone. A queue of a thousand with
//! requests coming and going then costs a write a second, not ten.

use std::collections::HashMap;

use tracing::warn;

use super::Nanos;
use super::voices::{RateLimit, WARN_EVERY};

const MS: Nanos = 1_000_000;
/// State writes at most this often: churn costs bounded I/O.
pub const SAVE_EVERY: Nanos = 100 * MS;
/// Writes for the queue's changes alone, at most this often.
pub const QUEUE_SAVE_EVERY: Nanos = 1000 * MS;

/// The state's changes and writes.
#[derive(Debug)]
pub(super) struct Saves {
    /// Changes counted so far.
    seq: u64,
    /// The count of the last change that was not the queue's alone.
    urgent: u64,
    /// The count handed out to be written, while it is.
    writing: Option<u64>,
    /// The last count known written.
    written: u64,
    /// When the last write was handed out.
    last: Option<Nanos>,
    /// Per user, when a write was last handed out early for its leases;
    /// only those younger than `SAVE_EVERY` are kept.
    early: HashMap<u32, Nanos>,
    /// The state file could not be written: said at most every
    /// `WARN_EVERY`, apart from every user's lines.
    warning: RateLimit,
}

impl Default for Saves {
    fn default() -> Self {
        Saves {
            seq: 0,
            urgent: 0,
            writing: None,
            written: 0,
            last: None,
            early: HashMap::new(),
            warning: RateLimit::new(WARN_EVERY),
        }
    }
}

impl Saves {
    /// Something to persist changed; returns the count that books it.
    pub fn changed(&mut self) -> u64 {
        self.seq += 1;
        self.urgent = self.seq;
        self.seq
    }

    /// Only the queue changed: a request arrived and waits, or left while
    /// it waited.
    pub fn queue_changed(&mut self) {
        self.seq += 1;
    }

    /// The count of changes so far (a write of it or later books them).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// When the next write may go, given the users with leases waiting
    /// for one: None while nothing changed or one is being written.
    pub fn due(&self, waiting: impl Iterator<Item = u32>) -> Option<Nanos> {
        if self.writing.is_some() || self.seq == self.written {
            return None;
        }
        let every = if self.urgent > self.written {
            SAVE_EVERY
        } else {
            QUEUE_SAVE_EVERY
        };
        let coalesced = self.last.map_or(0, |t| t + every);
        let early = waiting
            .map(|u| self.early.get(&u).map_or(0, |t| t + SAVE_EVERY))
            .min();
        Some(early.map_or(coalesced, |e| e.min(coalesced)))
    }

    /// A write goes out now, for the users with leases waiting: the count
    /// it books.
    pub fn start(&mut self, now: Nanos, waiting: impl Iterator<Item = u32>) -> u64 {
        self.writing = Some(self.seq);
        self.last = Some(now);
        self.early.retain(|_, t| *t + SAVE_EVERY > now);
        for uid in waiting {
            self.early.insert(uid, now);
        }
        self.seq
    }

    /// Write `seq` is done, or failed (said at most every `WARN_EVERY`).
    pub fn done(&mut self, now: Nanos, seq: u64, result: Result<(), String>) {
        self.writing = None;
        match result {
            Ok(()) => self.written = self.written.max(seq),
            Err(e) => {
                if self.warning.ready(now) {
                    warn!("cannot write the state file: {e}; leases will not survive a restart");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: std::iter::Empty<u32> = std::iter::empty();

    #[test]
    fn nothing_changed_nothing_due_and_one_write_out_at_a_time() {
        let mut s = Saves::default();
        assert_eq!(s.due(NONE), None);
        assert_eq!(s.changed(), 1);
        assert_eq!(s.due(NONE), Some(0), "never written: at once");
        assert_eq!(s.start(5, NONE), 1);
        s.changed();
        assert_eq!(s.due(NONE), None, "one write out at a time");
        s.done(7, 1, Ok(()));
        assert_eq!(s.due(NONE), Some(5 + SAVE_EVERY), "coalesced");
        assert_eq!(s.start(5 + SAVE_EVERY, NONE), 2);
        s.done(6 + SAVE_EVERY, 2, Ok(()));
        assert_eq!(s.due(NONE), None, "all written");
    }

    #[test]
    fn the_queues_changes_alone_wait_longer_until_another_change_comes() {
        let mut s = Saves::default();
        s.queue_changed();
        assert_eq!(s.due(NONE), Some(0), "never written: at once");
        let seq = s.start(10, NONE);
        s.done(11, seq, Ok(()));
        s.queue_changed();
        assert_eq!(s.due(NONE), Some(10 + QUEUE_SAVE_EVERY));
        s.changed();
        assert_eq!(s.due(NONE), Some(10 + SAVE_EVERY), "a lease's change");
        let seq = s.start(10 + SAVE_EVERY, NONE);
        s.done(11 + SAVE_EVERY, seq, Ok(()));
        s.queue_changed();
        assert_eq!(s.due(NONE), Some(10 + SAVE_EVERY + QUEUE_SAVE_EVERY));
    }

    #[test]
    fn a_failed_write_is_tried_again() {
        let mut s = Saves::default();
        s.changed();
        let seq = s.start(0, NONE);
        s.done(1, seq, Err("disk full".into()));
        assert_eq!(s.due(NONE), Some(SAVE_EVERY));
    }

    #[test]
    fn a_users_lease_goes_early_unless_its_user_just_had_a_write() {
        let mut s = Saves::default();
        s.changed();
        let seq = s.start(1000, NONE);
        s.done(1001, seq, Ok(()));
        s.changed();
        // Another user's churn set the coalesced time; user 7's lease
        // goes at once.
        assert_eq!(s.due([7].into_iter()), Some(0));
        let seq = s.start(1002, [7].into_iter());
        s.done(1003, seq, Ok(()));
        s.changed();
        assert_eq!(
            s.due([7].into_iter()),
            Some(1002 + SAVE_EVERY),
            "its own writes are coalesced"
        );
        assert_eq!(s.due([8].into_iter()), Some(0), "not another user's");
    }
}
