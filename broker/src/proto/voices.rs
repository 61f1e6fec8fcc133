//! What each user may still make the broker say and build: its log lines
//! (every line a user's connections can cause, warnings included, from
//! one budget) and its status pages; and the broker's own warnings, each
//! said at most once a period. A user's voice is kept apart from its
//! connections' budgets (`conn::Conns`, which go with the user's last
//! connection), so that connecting anew does not refill it.

use std::collections::HashMap;

use super::Nanos;
use super::conn::Bucket;

const MS: Nanos = 1_000_000;
/// Status pages built for one user: this many at once, then one per
/// `STATUS_EVERY`. A page costs a walk over every connection; a user
/// asking faster waits (its other requests too, so replies keep their
/// order), and nobody else does.
pub(super) const STATUS_BURST: u32 = 16;
pub(super) const STATUS_EVERY: Nanos = 20 * MS;
/// Log lines one user's connections can cause: this many at once, then
/// one per `LOG_EVERY`; what is held back is counted and said.
pub(super) const LOG_BURST: u32 = 64;
pub(super) const LOG_EVERY: Nanos = 100 * MS;
/// The broker's own warnings (a state file it cannot write) are said at
/// most this often, each kind with a limiter of its own: no user's lines
/// share it.
pub const WARN_EVERY: Nanos = 10_000 * MS;

/// One user's budgets of lines and pages.
#[derive(Debug)]
struct Voice {
    lines: Bucket,
    held_back: u64,
    status: Bucket,
}

impl Voice {
    fn new(now: Nanos) -> Voice {
        Voice {
            lines: Bucket::full(LOG_BURST, now),
            held_back: 0,
            status: Bucket::full(STATUS_BURST, now),
        }
    }

    /// Nothing to remember: a fresh one would be the same.
    fn idle(&self, now: Nanos) -> bool {
        self.held_back == 0
            && self.lines.is_full(now, LOG_BURST, LOG_EVERY)
            && self.status.is_full(now, STATUS_BURST, STATUS_EVERY)
    }
}

/// Every user's voice; a user with none has full budgets.
#[derive(Debug, Default)]
pub(super) struct Voices(HashMap<u32, Voice>);

impl Voices {
    fn of(&mut self, uid: u32, now: Nanos) -> &mut Voice {
        self.0.entry(uid).or_insert_with(|| Voice::new(now))
    }

    /// Whether a log line user `uid`'s connections caused may be written
    /// now: every line a client can cause takes one from its user's
    /// budget; lines held back are counted and said with the next line
    /// let through.
    pub fn may_log(&mut self, uid: u32, now: Nanos) -> bool {
        let v = self.of(uid, now);
        if !v.lines.take(now, LOG_BURST, LOG_EVERY) {
            v.held_back += 1;
            return false;
        }
        let held = std::mem::take(&mut v.held_back);
        if held > 0 {
            tracing::info!(
                uid,
                held,
                "log lines about this user's connections were left out (its log budget)"
            );
        }
        true
    }

    /// Takes one of user `uid`'s status pages (a status or summary
    /// request), if it has one.
    pub fn page(&mut self, uid: u32, now: Nanos) -> bool {
        self.of(uid, now)
            .status
            .take(now, STATUS_BURST, STATUS_EVERY)
    }

    /// Whether user `uid` has a status page to spend at `now`.
    pub fn has_page(&self, uid: u32, now: Nanos) -> bool {
        self.0
            .get(&uid)
            .is_none_or(|v| v.status.has(now, STATUS_BURST, STATUS_EVERY))
    }

    /// When user `uid` gets its next status page (None: it has them all).
    pub fn next_page(&self, uid: u32) -> Option<Nanos> {
        self.0.get(&uid).map(|v| v.status.next(STATUS_EVERY))
    }

    /// Forgets the users a fresh voice would stand for.
    pub fn forget_idle(&mut self, now: Nanos) {
        self.0.retain(|_, v| !v.idle(now));
    }

    /// Users whose voice is remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No user's voice is remembered (nothing for `forget_idle` to do).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Something said at most once per period: one of the broker's own
/// warnings, which a failing disk or driver could otherwise repeat on
/// every event.
#[derive(Debug)]
pub struct RateLimit {
    every: Nanos,
    last: Option<Nanos>,
}

impl RateLimit {
    pub const fn new(every: Nanos) -> Self {
        RateLimit { every, last: None }
    }

    /// True, once per period: say it now.
    pub fn ready(&mut self, now: Nanos) -> bool {
        let ready = self.last.is_none_or(|t| now.saturating_sub(t) > self.every);
        if ready {
            self.last = Some(now);
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_logs_its_burst_then_one_a_period_and_others_are_untouched() {
        let mut v = Voices::default();
        assert!((0..LOG_BURST).all(|_| v.may_log(7, 0)));
        assert!(!v.may_log(7, 0));
        assert!(!v.may_log(7, LOG_EVERY - 1));
        assert!(v.may_log(8, 0), "another user's own budget");
        assert!(v.may_log(7, LOG_EVERY));
        assert!(!v.may_log(7, LOG_EVERY));
    }

    #[test]
    fn status_pages_have_a_budget_of_their_own() {
        let mut v = Voices::default();
        assert!((0..LOG_BURST).all(|_| v.may_log(7, 0)));
        assert!(v.has_page(7, 0) && v.next_page(7).is_some());
        assert!((0..STATUS_BURST).all(|_| v.page(7, 0)));
        assert!(!v.page(7, 0) && !v.has_page(7, 0));
        assert_eq!(v.next_page(7), Some(STATUS_EVERY));
        assert!(v.has_page(7, STATUS_EVERY));
        assert!(
            v.has_page(9, 0) && v.next_page(9).is_none(),
            "no voice: full"
        );
    }

    #[test]
    fn a_voice_is_forgotten_once_full_again_and_not_before() {
        let mut v = Voices::default();
        assert!((0..=LOG_BURST).any(|_| !v.may_log(7, 0)), "one held back");
        v.forget_idle(1000 * LOG_EVERY);
        assert!(!v.is_empty(), "a line held back is still to be said");
        assert!(v.may_log(7, 1000 * LOG_EVERY));
        v.forget_idle(1000 * LOG_EVERY);
        assert!(!v.is_empty(), "the line just said is not back yet");
        v.forget_idle(1001 * LOG_EVERY);
        assert!(v.is_empty());
    }

    #[test]
    fn a_rate_limit_says_once_per_period() {
        let mut r = RateLimit::new(10);
        assert!(r.ready(0) && !r.ready(10) && r.ready(11) && !r.ready(12));
    }
}
