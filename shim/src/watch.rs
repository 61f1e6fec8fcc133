//! The grant watch: how long this process may wait on a broker that has
//! stopped answering before it treats the broker as gone. Pure logic on
//! clock readings, so that its rules are tested without a broker.

/// A broker that says nothing for this long while this process waits on it
/// is deemed stalled. Far above any legitimate silence: a timeslice is tens
/// of ms, a waiter's turn comes within a few slices, and a process parked
/// by GPU_COMPUTE_LIMIT waits at most its window (1 s) plus a slice. Other
/// waits can be longer (a `low` process behind busy `normal` ones), which
/// is why silence is broken by a probe (`PROBE_NS`) that a live broker
/// answers whatever its scheduler decides.
pub const STALL_NS: u64 = 3_000_000_000;
/// After this much silence while waiting, ask the broker for its status: a
/// request it answers at once if it is alive, so that only a broker that
/// answers nothing for `STALL_NS` is deemed stalled.
pub const PROBE_NS: u64 = 1_000_000_000;

/// How the client thread bounds this process's waits on a broker that has
/// stopped answering (SIGSTOP, wedged) while the connection stays open —
/// unlike a dead broker, which closes it and is noticed at once.
///
/// The process waits on the broker while it has asked for a device and
/// holds no grant there (launches blocked in `wait_for_grant`), and while
/// it holds a timesliced grant: the broker must end that slice, and until
/// it does everyone else waits on this process. Silence is measured from
/// the later of the last message received and the start of that wait, so
/// a long quiet spell before the process asked does not count. After
/// `PROBE_NS` of silence the thread asks for a status; only a broker that
/// answers nothing at all is deemed stalled, after `STALL_NS` (waiting for
/// a grant) or the slice plus `STALL_NS` (holding one: the holder enforces
/// its own slice end, with the same margin).
///
/// A stalled broker is then treated as gone: in optional mode the session
/// ends and the gates open, so launches go ahead unarbitrated, as they
/// would on a GPU without gpufrac; the existing reconnect loop registers
/// afresh once the broker answers again, which restores arbitration with
/// the broker's own state (it sees this connection close and frees its
/// grant). Keeping the session instead would leave grants and requests on
/// both sides to reconcile. With GPUFRAC_BROKER=required the user asked to
/// wait for the broker: launches keep waiting, and the user is told once.
pub struct Watch {
    last_heard: u64,
    /// Start of the current wait on the broker (0: none).
    since: u64,
    probed: bool,
    /// The user has been told that the broker stalls (said once per
    /// silence).
    pub told: bool,
}

/// What to do about the broker's silence.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Fine,
    Probe,
    Stalled,
}

/// How long the broker may stay silent now: `waiting` when this process
/// asked for a device it does not hold; `held_slice` the longest slice of
/// the contended grants it holds, if any. None when nothing here waits on
/// the broker.
pub fn allowance(waiting: bool, held_slice: Option<u64>) -> Option<u64> {
    if waiting {
        return Some(STALL_NS);
    }
    held_slice.map(|slice| STALL_NS.saturating_add(slice))
}

impl Watch {
    pub fn new(now: u64) -> Watch {
        Watch {
            last_heard: now,
            since: 0,
            probed: false,
            told: false,
        }
    }

    /// Something arrived from the broker at `now`.
    pub fn heard(&mut self, now: u64) {
        self.last_heard = now;
        self.probed = false;
        self.told = false;
    }

    pub fn check(&mut self, now: u64, allowance: Option<u64>) -> Verdict {
        let Some(allow) = allowance else {
            self.since = 0;
            return Verdict::Fine;
        };
        if self.since == 0 {
            self.since = now;
        }
        let quiet = now.saturating_sub(self.last_heard.max(self.since));
        if quiet >= allow {
            Verdict::Stalled
        } else if quiet >= PROBE_NS && !self.probed {
            self.probed = true;
            Verdict::Probe
        } else {
            Verdict::Fine
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn silence_counts_only_while_waiting() {
        let mut w = Watch::new(10 * S);
        // A long quiet spell with nothing asked is fine.
        assert_eq!(w.check(100 * S, None), Verdict::Fine);
        // The wait starts now, not at the last message.
        let allow = allowance(true, None);
        assert_eq!(allow, Some(STALL_NS));
        assert_eq!(w.check(100 * S, allow), Verdict::Fine);
        assert_eq!(w.check(100 * S + PROBE_NS, allow), Verdict::Probe);
        // Probed once per silence.
        assert_eq!(w.check(100 * S + PROBE_NS + 1, allow), Verdict::Fine);
        assert_eq!(w.check(100 * S + STALL_NS, allow), Verdict::Stalled);
    }

    #[test]
    fn an_answer_restarts_the_count() {
        let mut w = Watch::new(0);
        let allow = allowance(true, None);
        assert_eq!(w.check(S, allow), Verdict::Fine);
        assert_eq!(w.check(S + PROBE_NS, allow), Verdict::Probe);
        w.told = true;
        w.heard(S + PROBE_NS + 1);
        assert!(!w.told);
        let t = S + PROBE_NS + 1;
        assert_eq!(w.check(t + PROBE_NS - 1, allow), Verdict::Fine);
        assert_eq!(w.check(t + PROBE_NS, allow), Verdict::Probe);
        assert_eq!(w.check(t + STALL_NS, allow), Verdict::Stalled);
    }

    #[test]
    fn a_holder_of_a_slice_allows_the_slice_too() {
        assert_eq!(allowance(false, None), None);
        let slice = 50_000_000;
        let allow = allowance(false, Some(slice));
        assert_eq!(allow, Some(STALL_NS + slice));
        let mut w = Watch::new(0);
        assert_eq!(w.check(1, allow), Verdict::Fine);
        assert_ne!(w.check(1 + STALL_NS, allow), Verdict::Stalled);
        assert_eq!(w.check(1 + STALL_NS + slice, allow), Verdict::Stalled);
        // Waiting for a grant does not get the slice.
        assert_eq!(allowance(true, Some(slice)), Some(STALL_NS));
    }
}
