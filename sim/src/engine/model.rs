//! The engine's model, pure: the scheduler record and the per-context
//! entries in the shared state, and how time advances them (slices,
//! switches, runs dry, projections). It knows nothing of processes or
//! locks: whoever holds the device lock (`lock.rs`) loads it, advances it
//! to "now" and commits it, which is what the unit tests below do with
//! explicit times.

use std::sync::atomic::{AtomicU64, Ordering::*};

use super::crash::{CRASH_BEFORE_COMMIT, crash_point};

/// Contexts with work per device, over all processes.
pub const MAX_CTX: usize = 256;
/// Run segments kept per context, to date event completions.
pub(super) const SEGS: usize = 16;
pub(super) const PEND_WORDS: usize = MAX_CTX / 64;
// The bitmap code spells out its four words.
const _: () = assert!(PEND_WORDS == 4);

/// One context of one process on one device.
#[repr(C)]
pub struct Ent {
    /// `(generation << 32) | index`; the generation counts allocations, so
    /// a binding to an earlier user of the entry is recognised as stale.
    pub(super) tag: AtomicU64,
    /// Token of the owning process; 0: free.
    pub(super) owner: AtomicU64,
    pub(super) w: AtomicU64,
    /// Executed work; exact while the context is not the running one.
    pub(super) e: AtomicU64,
    /// `w` and `e` at allocation.
    pub(super) e0: AtomicU64,
    pub(super) nseg: AtomicU64,
    /// Ring of run starts `(t, e)`: a run began at `t` with `e` executed.
    pub(super) segs: [[AtomicU64; 2]; SEGS],
}

/// The scheduler record; see `Rec`.
#[repr(C)]
pub(super) struct RecCell(pub(super) [AtomicU64; 7]);

#[repr(C, align(64))]
pub struct Engine {
    /// Token of the process holding the lock; 0: free.
    pub(super) lock: AtomicU64,
    /// `recs[seq & 1]` is the committed record.
    pub(super) seq: AtomicU64,
    pub(super) next_reap: AtomicU64,
    pub(super) kernels_total: AtomicU64,
    /// Entries that may have pending work (checked before use).
    pub(super) pend: [AtomicU64; PEND_WORDS],
    pub(super) recs: [RecCell; 2],
    pub(super) ents: [Ent; MAX_CTX],
}

#[derive(Clone, Copy, Default, PartialEq, Debug)]
pub(super) struct Rec {
    /// The record describes the engine at time `t`.
    pub(super) t: u64,
    /// Tag of the running context (also while switching to it); 0: idle.
    pub(super) cur: u64,
    /// Tag of the context that ran last.
    pub(super) last: u64,
    /// When `cur` starts or started progressing: its slices count from here.
    pub(super) run_from: u64,
    /// `cur`'s executed work at `run_from`.
    pub(super) base_e: u64,
    /// Kernel ns executed, switches excluded.
    pub(super) busy: u64,
    pub(super) switches: u64,
}

impl RecCell {
    pub(super) fn load(&self) -> Rec {
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

    pub(super) fn store(&self, r: Rec) {
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
pub(super) fn idx(tag: u64) -> usize {
    (tag & 0xffff_ffff) as usize
}

/// `e` values a projection changed, kept out of the shared entries.
#[derive(Clone, Copy, Default)]
pub(super) struct Overlay {
    pub(super) n: usize,
    pub(super) v: [(usize, u64); 4],
    pub(super) full: bool,
}

/// The scheduler state while the device lock is held.
#[derive(Clone, Copy)]
pub(super) struct Model<'a> {
    pub(super) eng: &'a Engine,
    pub(super) p: Params,
    pub(super) rec: Rec,
    pub(super) pend: [u64; PEND_WORDS],
    /// Some: a projection, which writes nothing shared.
    pub(super) overlay: Option<Overlay>,
    pub(super) transitions: u32,
    /// Changed beyond `rec.t` since the last commit.
    pub(super) dirty: bool,
}

/// The first set bit at or after `from`, wrapping around.
pub(super) fn next_set(p: &[u64; PEND_WORDS], from: usize) -> Option<usize> {
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

pub(super) fn none_set(p: &[u64; PEND_WORDS]) -> bool {
    (p[0] | p[1] | p[2] | p[3]) == 0
}

impl<'a> Model<'a> {
    pub(super) fn load(eng: &'a Engine, p: Params) -> Model<'a> {
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

    pub(super) fn commit(&mut self) {
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
    pub(super) fn commit_if_changed(&mut self) {
        if self.dirty {
            self.commit();
        } else if self.overlay.is_none() {
            let seq = self.eng.seq.load(Relaxed);
            self.eng.recs[(seq & 1) as usize].0[0].store(self.rec.t, Relaxed);
        }
    }

    #[inline(always)]
    pub(super) fn ent(&self, i: usize) -> &'a Ent {
        &self.eng.ents[i]
    }

    pub(super) fn valid(&self, tag: u64) -> bool {
        let i = idx(tag);
        tag != 0
            && i < MAX_CTX
            && self.ent(i).tag.load(Acquire) == tag
            && self.ent(i).owner.load(Acquire) != 0
    }

    pub(super) fn w(&self, i: usize) -> u64 {
        self.ent(i).w.load(Acquire)
    }

    pub(super) fn e(&self, i: usize) -> u64 {
        if let Some(o) = &self.overlay
            && let Some(&(_, v)) = o.v[..o.n].iter().rev().find(|(j, _)| *j == i)
        {
            return v;
        }
        self.ent(i).e.load(Acquire)
    }

    pub(super) fn set_e(&mut self, i: usize, v: u64) {
        match &mut self.overlay {
            None => self.eng.ents[i].e.store(v, Release),
            Some(o) if o.n < o.v.len() => {
                o.v[o.n] = (i, v);
                o.n += 1;
            }
            Some(o) => o.full = true,
        }
    }

    pub(super) fn seg(&mut self, i: usize, t: u64, e: u64) {
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

    pub(super) fn set_pend(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.pend[w] & b == 0 {
            self.pend[w] |= b;
            self.dirty = true;
        }
    }

    pub(super) fn clear_pend(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.pend[w] & b != 0 {
            self.pend[w] &= !b;
            self.dirty = true;
        }
    }

    pub(super) fn any_pending_except(&self, i: usize) -> bool {
        let mut p = self.pend;
        p[i / 64] &= !(1 << (i % 64));
        !none_set(&p)
    }

    /// The next context with pending work in round-robin order from `from`.
    pub(super) fn next_pending(&mut self, from: usize, exclude: Option<usize>) -> Option<usize> {
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
    pub(super) fn run_end(&self) -> (u64, bool) {
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

    pub(super) fn start(&mut self, i: usize, tag: u64, run_from: u64) {
        let e = self.e(i);
        self.rec.cur = tag;
        self.rec.run_from = run_from;
        self.rec.base_e = e;
        self.seg(i, run_from, e);
    }

    /// Performs the next event if it happens by `now`.
    pub(super) fn step(&mut self, now: u64) -> bool {
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

    pub(super) fn advance(&mut self, now: u64) {
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
    pub(super) fn e_now(&self, i: usize) -> u64 {
        let r = &self.rec;
        if r.cur != 0 && idx(r.cur) == i && self.valid(r.cur) {
            let w = self.w(i).max(r.base_e);
            r.base_e + r.t.saturating_sub(r.run_from).min(w - r.base_e)
        } else {
            self.e(i)
        }
    }

    pub(super) fn busy_now(&self) -> u64 {
        let r = &self.rec;
        if r.cur != 0 && self.valid(r.cur) {
            r.busy + (self.e_now(idx(r.cur)) - r.base_e)
        } else {
            r.busy
        }
    }

    pub(super) fn done(&self, tag: u64, x: u64) -> bool {
        !self.valid(tag) || self.e_now(idx(tag)) >= x
    }

    /// When entry `tag` reaches `x` if nothing new arrives, if that happens
    /// by `horizon` (or is decided before it).
    pub(super) fn project(&self, tag: u64, x: u64, horizon: u64) -> Option<u64> {
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
    pub(super) fn reach_time(&self, tag: u64, x: u64) -> Option<u64> {
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

    /// Kernel ns entry `i` executed after `since`, and when it last
    /// executed (0: not after `since`), at `rec.t`: from its ring of runs
    /// (the instant of its last run is always exact). A run goes on
    /// without a break from its start, so it ends where the next one's
    /// executed work begins. Where the ring's `SEGS` runs do not reach
    /// back to `since` (a busy context time-sliced with others, or
    /// synchronising often, runs in short pieces), the time before its
    /// oldest run is taken at the duty of the runs it keeps: the driver
    /// reports how busy a process kept the GPU, and counting its last
    /// runs only made a busy process look a few percent busy.
    pub(super) fn ran_since(&self, i: usize, since: u64) -> (u64, u64) {
        let ent = self.ent(i);
        let n = ent.nseg.load(Acquire);
        let lo = n.saturating_sub(SEGS as u64);
        let slot = |k: u64| &ent.segs[(k % SEGS as u64) as usize];
        let (mut busy, mut last) = (0, 0);
        let mut end_e = self.e_now(i);
        let mut reached = lo == 0;
        let mut oldest = None;
        for k in (lo..n).rev() {
            let (t, e) = (slot(k)[0].load(Relaxed), slot(k)[1].load(Relaxed));
            let end = t.saturating_add(end_e.saturating_sub(e));
            if end > t {
                if end <= since {
                    reached = true;
                    break;
                }
                last = last.max(end);
                busy += end - t.max(since);
                oldest = Some(t);
                reached |= t <= since;
            }
            end_e = e;
        }
        if let (false, Some(t0), Some(newest)) = (reached, oldest, Some(last).filter(|&l| l > 0)) {
            let kept = newest.saturating_sub(t0).max(1);
            let before = t0.saturating_sub(since);
            busy += (u128::from(busy) * u128::from(before) / u128::from(kept)) as u64;
        }
        (busy, last)
    }

    pub(super) fn alloc(&mut self, me: u64, base: u64) -> Option<(usize, u64)> {
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

    pub(super) fn free(&mut self, i: usize) {
        self.ent(i).owner.store(0, Release);
        self.clear_pend(i);
        self.dirty = true;
    }

    /// Queues `d` ns on the context bound through `bind`, binding it to a
    /// fresh entry (starting at `base`) first if needed. Returns the work
    /// target of the new kernel.
    pub(super) fn submit(
        &mut self,
        bind: &AtomicU64,
        me: u64,
        base: u64,
        d: u64,
        now: u64,
    ) -> Option<u64> {
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

    /// What NVML's per-process utilisation reads: the work each context
    /// ran after an instant, and when it last ran.
    #[test]
    fn work_since_an_instant_and_when_it_last_ran() {
        let eng = engine();
        let (mut a, mut b) = (C::new(1), C::new(2));
        let t0 = 1_000 * MS;
        a.submit(&eng, t0, 5 * MS);
        b.submit(&eng, t0 + 10 * US, 3 * MS);
        // A: switch, 2 ms; B: switch, 2 ms; A: switch, 2 ms; B: switch,
        // 1 ms (done); A: switch, 1 ms, done.
        let run = t0 + 100 * US;
        let b_end = run + 6 * MS + 300 * US + MS;
        let a_end = b_end + 100 * US + MS;
        let at = |c: &C, now: u64, since: u64| {
            let mut m = Model::load(&eng, P);
            m.advance(now);
            m.commit();
            m.ran_since(idx(c.bind.load(Relaxed)), since)
        };
        assert_eq!(at(&a, t0 + 100 * MS, 0), (5 * MS, a_end));
        assert_eq!(at(&b, t0 + 100 * MS, 0), (3 * MS, b_end));
        // Since B's last run began: its last millisecond only.
        assert_eq!(at(&b, t0 + 100 * MS, b_end - MS), (MS, b_end));
        assert_eq!(at(&a, t0 + 100 * MS, b_end - MS), (MS, a_end));
        // Nothing after it last ran.
        assert_eq!(at(&a, t0 + 100 * MS, a_end), (0, 0));
        // While running: up to now.
        let mut c = C::new(3);
        let t1 = t0 + 200 * MS;
        c.submit(&eng, t1, 50 * MS);
        let now = t1 + 100 * US + 7 * MS;
        assert_eq!(at(&c, now, t1), (7 * MS, now));
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
