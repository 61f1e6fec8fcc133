//! Service in turns charged by work (SECURITY.md, invariant 1): what the
//! broker spends on each user (`Cost`, counted where the work is done),
//! and who is served next (`Turns`). The core runs the turns itself
//! (`Broker::turn`); the shell only says which sockets are readable and
//! reads them when asked.
//!
//! A turn goes round the users with a ready connection, and within each
//! user round its ready connections, each served at most once, until the
//! work charged to the user for the turn reaches `WORK_PER_TURN`; a
//! connection with more to do goes to the back of its user's line, and a
//! user with connections left to the back of the users. Work, not frames:
//! a frame's cost once had no bound (a `Register` escaped a 2 MiB argv, a
//! `Name` 128 KiB of control characters), so 64 frames a turn could be
//! 64 × 75 ms. Every step that grows with what a user sends is now
//! bounded at its source (`clip_counted`, the frame limit, `READ_CHUNK`),
//! and is counted here, so a user's part of a turn is bounded by
//! `WORK_PER_TURN` plus the largest single step.

use std::collections::{HashMap, HashSet, VecDeque};

use super::{ConnId, Nanos};

/// What a frame costs besides its bytes: decoding its header, dispatch, a
/// scheduler or queue step. About as much as copying 1 KiB.
pub const FRAME_WORK: u64 = 1024;
/// A read of `/proc/PID/stat` (one page at most, `procfs::stat_fields`).
pub const PROC_READ_WORK: u64 = 1024;
/// A connection looked at while building a status page.
pub const WALK_WORK: u64 = 64;
/// A user's part of a turn, in work units: about 15 small frames, or
/// 16 KiB read. A turn is every ready user's part, and what becomes ready
/// during a turn waits for its end: a holder's answer to a recall, which
/// keeps its GPU for it only 4 ms, must not wait behind long parts. (With
/// 64 frames a part, on a loaded 2-CPU machine in a debug build, a part
/// took 5 to 17 ms, and a busy process beside a user churning grants at
/// `low` on 128 connections kept half its GPU time; with 16, 75 to 84%.)
pub const WORK_PER_TURN: u64 = 16 << 10;
/// What a connection whose answer the broker awaits (a holder it revoked)
/// may spend ahead of the round: the answer is a few small frames.
pub const ANSWER_WORK: u64 = 4 * FRAME_WORK;
/// The most one read of a socket takes in: a serve reads in chunks of at
/// most this, and never more than the user's part of the turn has left
/// (but at least `MIN_READ`, so that a read makes progress).
pub const READ_CHUNK: usize = 16 << 10;
pub const MIN_READ: usize = 1 << 10;

/// Work the core has done, by kind, since it started. Each counter is
/// kept where the work is done; `units` weighs them into one figure, which
/// is what a user's turn is charged (the difference across serving one of
/// its connections).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    /// Frames handled.
    pub frames: u64,
    /// Bytes of frames decoded.
    pub decoded: u64,
    /// Bytes taken in from sockets.
    pub read: u64,
    /// Bytes of a user's text read by the escaping (`clip_counted`).
    pub escaped: u64,
    /// Files of /proc read (a stat file each).
    pub proc_reads: u64,
    /// Bytes of replies encoded.
    pub sent: u64,
    /// Connections looked at for status pages.
    pub walked: u64,
}

impl Cost {
    /// The work, in units of about a byte copied.
    pub fn units(&self) -> u64 {
        self.frames * FRAME_WORK
            + self.decoded
            + self.read
            + self.escaped
            + self.proc_reads * PROC_READ_WORK
            + self.sent
            + self.walked * WALK_WORK
    }

    /// What was done between `earlier` and `self`.
    #[cfg(test)]
    pub fn since(&self, earlier: &Cost) -> Cost {
        Cost {
            frames: self.frames - earlier.frames,
            decoded: self.decoded - earlier.decoded,
            read: self.read - earlier.read,
            escaped: self.escaped - earlier.escaped,
            proc_reads: self.proc_reads - earlier.proc_reads,
            sent: self.sent - earlier.sent,
            walked: self.walked - earlier.walked,
        }
    }
}

/// What the core asks of the shell during a turn (`Broker::turn`).
pub trait Sockets {
    /// The time now. Asked at each serve: a turn can take milliseconds,
    /// and a grant made at the turn's start time would be dated in the
    /// past (its slice cut short by the time the turn took).
    fn now(&mut self) -> Nanos;
    /// Reads what connection `id`'s socket holds into `buf`.
    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read;
}

/// What the shell's read of a socket gave (`Sockets::read`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// This many bytes, at the start of the buffer.
    Bytes(usize),
    /// This many bytes (at least one), which emptied the socket: the
    /// shell knows it (a short read of a stream socket whose peer has not
    /// hung up), and the core then reads no more until the poll says
    /// otherwise, without the read that would only say `WouldBlock`.
    Drained(usize),
    /// Nothing now: the socket is drained until the poll says otherwise.
    WouldBlock,
    /// The peer hung up, or the socket failed.
    Closed,
}

/// What serving a connection once did: the work charged, and whether it
/// has more to do.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    pub work: u64,
    pub more: bool,
}

/// Which connections get a turn next: round-robin over the users with
/// something to do, and within each user over its ready connections until
/// the user's `WORK_PER_TURN` is spent.
#[derive(Debug, Default)]
pub struct Turns {
    /// Each user's ready connections, in the order they are served.
    users: HashMap<u32, VecDeque<ConnId>>,
    /// Users with a ready connection, in the order they are served.
    order: VecDeque<u32>,
    /// The ready connections (each in its user's line once).
    queued: HashSet<ConnId>,
    /// Ready connections whose answer the broker awaits (a revoked
    /// holder's Release and Acquire, which keep its GPU for it only for a
    /// moment; a new holder's next message, most often the Release that
    /// frees the GPU): served first, once, within `ANSWER_WORK`, at the
    /// next turn. There are at most as many as the broker sent grants and
    /// revokes since their last serve.
    answers: VecDeque<(ConnId, u32)>,
}

impl Turns {
    /// `id`, a connection of `uid`, has something to do: it gets a turn
    /// (once, however often this is said before its turn comes).
    pub fn push(&mut self, id: ConnId, uid: u32) {
        if !self.queued.insert(id) {
            return;
        }
        let q = self.users.entry(uid).or_default();
        if q.is_empty() {
            self.order.push_back(uid);
        }
        q.push_back(id);
    }

    /// `id`, of `uid`, has the answer the broker awaits: it is served
    /// ahead of the round at the next turn (and, if it has more, goes to
    /// its user's line).
    pub fn push_answer(&mut self, id: ConnId, uid: u32) {
        if !self.answers.iter().any(|&(a, _)| a == id) {
            self.answers.push_back((id, uid));
        }
    }

    /// Whether a connection waits for a turn.
    pub fn busy(&self) -> bool {
        !self.order.is_empty() || !self.answers.is_empty()
    }

    /// Connections made ready while these turns ran elsewhere, in their
    /// order.
    pub fn absorb(&mut self, other: Turns) {
        let Turns {
            mut users,
            order,
            answers,
            ..
        } = other;
        for (id, uid) in answers {
            self.push_answer(id, uid);
        }
        for uid in order {
            for id in users.remove(&uid).into_iter().flatten() {
                self.push(id, uid);
            }
        }
    }

    /// One turn: each user with a ready connection, in order, has its
    /// connections served (`serve`, given what is left of the user's part
    /// of the turn), each once, from the front of its line until its
    /// work for the turn is spent or none is left. A connection with more
    /// to do goes to the back of its user's line; a user with connections
    /// left waits for the next turn, behind every other.
    pub fn run(&mut self, mut serve: impl FnMut(ConnId, u64) -> Served) {
        for (id, uid) in std::mem::take(&mut self.answers) {
            if serve(id, ANSWER_WORK).more {
                self.push(id, uid);
            }
        }
        for _ in 0..self.order.len() {
            let Some(uid) = self.order.pop_front() else {
                break;
            };
            let mut left = WORK_PER_TURN;
            // Served once a turn at most: those with more wait behind the
            // rest of their user's line.
            let mut again = Vec::new();
            while left > 0 {
                let Some(id) = self.users.get_mut(&uid).and_then(|q| q.pop_front()) else {
                    break;
                };
                self.queued.remove(&id);
                let s = serve(id, left);
                // A serve that did nothing still costs a look.
                left = left.saturating_sub(s.work.max(FRAME_WORK));
                if s.more {
                    again.push(id);
                }
            }
            for id in again {
                if self.queued.insert(id) {
                    self.users.entry(uid).or_default().push_back(id);
                }
            }
            if self.users.get(&uid).is_some_and(|q| !q.is_empty()) {
                self.order.push_back(uid);
            } else {
                self.users.remove(&uid);
            }
        }
    }
}

/// The core's service as one part: the turns, the work done so far
/// (what turns are charged), how far the connection being served may go,
/// and the one buffer every read of a turn goes through.
#[derive(Default)]
pub(super) struct Serving {
    turns: Turns,
    cost: Cost,
    /// Frames of the connection being served are handled while the work
    /// done is below this (its user's part of the turn).
    until: u64,
    readbuf: Vec<u8>,
}

impl Serving {
    /// `id`, of user `uid`, has something to do: in its user's line.
    pub fn push(&mut self, id: ConnId, uid: u32) {
        self.turns.push(id, uid);
    }

    /// `id` carries an answer the core awaits: served ahead of the round.
    pub fn push_answer(&mut self, id: ConnId, uid: u32) {
        self.turns.push_answer(id, uid);
    }

    pub fn busy(&self) -> bool {
        self.turns.busy()
    }

    /// The turns, to run one: what becomes ready meanwhile is pushed here
    /// and served after it (`end_turn`).
    pub fn start_turn(&mut self) -> Turns {
        std::mem::take(&mut self.turns)
    }

    /// The turn run: its lines again, with what became ready during it
    /// behind them.
    pub fn end_turn(&mut self, turns: Turns) {
        let later = std::mem::replace(&mut self.turns, turns);
        self.turns.absorb(later);
    }

    /// Work to charge (each counter bumped where the work is done).
    pub fn charge(&mut self) -> &mut Cost {
        &mut self.cost
    }

    pub fn cost(&self) -> Cost {
        self.cost
    }

    /// A serve begins with `left` units of its user's part: the work done
    /// so far, to charge the serve the difference.
    pub fn begin(&mut self, left: u64) -> u64 {
        let start = self.cost.units();
        self.until = start.saturating_add(left);
        start
    }

    /// The serve has spent its part: frames left wait for the next.
    pub fn spent_up(&self) -> bool {
        self.cost.units() >= self.until
    }

    /// The read buffer, `READ_CHUNK` long (give it back: its room is kept
    /// from turn to turn).
    pub fn take_buf(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.readbuf);
        buf.resize(READ_CHUNK, 0);
        buf
    }

    pub fn put_buf(&mut self, buf: Vec<u8>) {
        self.readbuf = buf;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One turn in which every connection served does `work` and has
    /// more to do as `more` says; the order they were served in.
    fn turn(
        t: &mut Turns,
        work: impl Fn(ConnId) -> u64,
        more: impl Fn(ConnId) -> bool,
    ) -> Vec<ConnId> {
        let mut served = Vec::new();
        t.run(|id, _| {
            served.push(id);
            Served {
                work: work(id),
                more: more(id),
            }
        });
        served
    }

    #[test]
    fn each_ready_connection_gets_one_turn_in_order() {
        let mut t = Turns::default();
        assert!(!t.busy());
        t.push(1, 10);
        t.push(2, 20);
        t.push(1, 10);
        assert!(t.busy());
        assert_eq!(turn(&mut t, |_| 1, |_| false), [1, 2]);
        assert!(!t.busy());
        // With more to do after its turn, it comes after those that
        // became ready meanwhile.
        t.push(1, 10);
        assert_eq!(turn(&mut t, |_| WORK_PER_TURN, |id| id == 1), [1]);
        t.push(3, 30);
        assert_eq!(turn(&mut t, |_| 1, |_| false), [1, 3]);
    }

    /// The attack this replaces frames with work for: each of the flood's
    /// connections does a turn's worth of work in one serve (a frame of
    /// 64 KiB to escape, once): one of them is served a turn, the victim
    /// every turn it is ready.
    #[test]
    fn a_user_whose_frames_are_costly_gets_one_users_part_of_a_turn() {
        let mut t = Turns::default();
        for id in 100..228 {
            t.push(id, 65534);
        }
        t.push(1, 5001);
        let costly = |id| if id >= 100 { WORK_PER_TURN * 4 } else { 1 };
        assert_eq!(turn(&mut t, costly, |id| id >= 100), [100, 1]);
        t.push(1, 5001);
        assert_eq!(turn(&mut t, costly, |id| id >= 100), [101, 1]);
        assert_eq!(turn(&mut t, costly, |id| id >= 100), [102]);
    }

    #[test]
    fn a_user_with_many_quiet_connections_is_served_as_many_a_turn_as_its_work_allows() {
        let mut t = Turns::default();
        for id in 0..200 {
            t.push(id, 0);
        }
        // A ping each: a frame and a few bytes each way.
        let first = turn(&mut t, |_| FRAME_WORK + 10, |_| false);
        let n = first.len() as u64;
        let fit = WORK_PER_TURN / (FRAME_WORK + 10);
        assert!((fit..=fit + 1).contains(&n), "{n}");
        // A serve that did nothing still costs a look.
        let second = turn(&mut t, |_| 0, |_| false);
        assert_eq!(second.len() as u64, WORK_PER_TURN / FRAME_WORK);
    }

    /// A revoked holder's answer is served first, within its small budget,
    /// and then, with more to do, in its user's line like any other.
    #[test]
    fn an_awaited_answer_is_served_ahead_of_the_round() {
        let mut t = Turns::default();
        for id in 100..110 {
            t.push(id, 65534);
        }
        t.push(2, 5001);
        t.push_answer(1, 5001);
        t.push_answer(1, 5001);
        let mut budgets = Vec::new();
        t.run(|id, left| {
            budgets.push((id, left));
            Served {
                work: WORK_PER_TURN,
                more: id == 1,
            }
        });
        assert_eq!(
            budgets,
            [(1, ANSWER_WORK), (100, WORK_PER_TURN), (2, WORK_PER_TURN)]
        );
        // With more to do, it went to the back of its user's line.
        assert_eq!(turn(&mut t, |_| WORK_PER_TURN, |_| false), [101, 1]);
    }

    #[test]
    fn connections_made_ready_elsewhere_keep_their_order() {
        let mut a = Turns::default();
        a.push(1, 10);
        let mut b = Turns::default();
        b.push(2, 20);
        b.push(3, 10);
        b.push(1, 10);
        a.absorb(b);
        assert_eq!(turn(&mut a, |_| 1, |_| false), [1, 3, 2]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// However many users hold however many connections, each doing
        /// whatever work it may per serve and having more to do or not: a
        /// connection is served once a turn at most; a user's turn is
        /// charged at most its part plus one serve's work; a user with one
        /// connection is served in every turn it is ready; and every ready
        /// connection is served within as many turns as its user has
        /// connections.
        #[test]
        fn a_connection_waits_for_its_own_users_others_only(
            users in prop::collection::vec(1..40u64, 1..6),
            load in prop::collection::vec((0..=2 * WORK_PER_TURN, any::<bool>()), 1..300),
            steps in prop::collection::vec((any::<bool>(), any::<u64>()), 1..60),
        ) {
            let mut t = Turns::default();
            // Connection ids: user u's are u * 1000 ..; the victim's 1.
            let uid_of = |id: ConnId| (id / 1000) as u32;
            let victim = 1;
            let mut waited: HashMap<ConnId, usize> = HashMap::new();
            for (u, &n) in users.iter().enumerate() {
                for k in 0..n {
                    let id = (u as u64 + 1) * 1000 + k;
                    t.push(id, uid_of(id));
                    waited.insert(id, 0);
                }
            }
            let work = |id: ConnId, salt: u64| load[((id ^ salt) as usize) % load.len()];
            let biggest = load.iter().map(|l| l.0).max().unwrap_or(0);
            for (ready, salt) in steps {
                if ready && !waited.contains_key(&victim) {
                    t.push(victim, uid_of(victim));
                    waited.insert(victim, 0);
                }
                let mut charged: HashMap<u32, u64> = HashMap::new();
                let mut served = Vec::new();
                t.run(|id, left| {
                    let (w, more) = work(id, salt);
                    *charged.entry(uid_of(id)).or_default() += w.max(FRAME_WORK);
                    served.push((id, more, left));
                    Served { work: w, more: more && id != victim }
                });
                for (&uid, &c) in &charged {
                    prop_assert!(
                        c < WORK_PER_TURN + biggest.max(FRAME_WORK),
                        "user {} charged {} in a turn", uid, c
                    );
                }
                let mut once = HashSet::new();
                prop_assert!(served.iter().all(|&(id, _, _)| once.insert(id)), "served twice in a turn");
                prop_assert!(served.iter().all(|&(_, _, left)| left > 0 && left <= WORK_PER_TURN));
                if waited.contains_key(&victim) {
                    prop_assert!(served.iter().any(|&(id, _, _)| id == victim));
                }
                for (id, more, _) in served {
                    waited.remove(&id);
                    if more && id != victim {
                        waited.insert(id, 0);
                    }
                }
                for (&id, w) in waited.iter_mut() {
                    *w += 1;
                    let line = users.get((id / 1000) as usize - 1).copied().unwrap_or(1);
                    prop_assert!(*w <= line as usize, "connection {} waited {} turns", id, w);
                }
            }
        }
    }

    #[test]
    fn a_serve_is_spent_up_at_its_part_and_charged_the_difference() {
        let mut sv = Serving::default();
        sv.charge().read += 100;
        let start = sv.begin(2 * FRAME_WORK);
        assert_eq!(start, 100);
        assert!(!sv.spent_up());
        sv.charge().frames += 1;
        assert!(!sv.spent_up());
        sv.charge().frames += 1;
        assert!(sv.spent_up(), "two frames are its part");
        assert_eq!(sv.cost().units() - start, 2 * FRAME_WORK);
        // A part as large as can be does not overflow.
        sv.begin(u64::MAX);
        assert!(!sv.spent_up());
    }

    #[test]
    fn what_becomes_ready_during_a_turn_is_served_after_it() {
        let mut sv = Serving::default();
        sv.push(1, 10);
        assert!(sv.busy());
        let mut turns = sv.start_turn();
        assert!(!sv.busy(), "the turn runs on its own lines");
        let mut order = Vec::new();
        turns.run(|id, _| {
            order.push(id);
            Served {
                work: 1,
                more: false,
            }
        });
        // Became ready while the turn ran.
        sv.push(2, 20);
        sv.end_turn(turns);
        assert!(sv.busy());
        let mut turns = sv.start_turn();
        turns.run(|id, _| {
            order.push(id);
            Served {
                work: 1,
                more: false,
            }
        });
        sv.end_turn(turns);
        assert_eq!(order, [1, 2]);
        assert!(!sv.busy());
    }

    #[test]
    fn the_read_buffer_keeps_its_room_from_turn_to_turn() {
        let mut sv = Serving::default();
        let mut buf = sv.take_buf();
        assert_eq!(buf.len(), READ_CHUNK);
        buf[0] = 7;
        let at = buf.as_ptr();
        sv.put_buf(buf);
        let buf = sv.take_buf();
        assert_eq!(
            (buf.len(), buf.as_ptr()),
            (READ_CHUNK, at),
            "not made again"
        );
    }
}
