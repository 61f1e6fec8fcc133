//! The waiting requests, and their order kept as they come and go: each
//! request is filed on arrival under its class (pinned, whole GPUs by
//! count, fraction) and its age, so reading the order is a walk, never a
//! sort of the queue (only the escalated ones, usually few, are sorted).
//!
//! Among requests neither escalated nor pinned, the order is by the part
//! of a GPU each takes. Whole-GPU requests go fewest GPUs first, FIFO
//! among equals. A memory request takes part of one GPU, so it goes
//! before whole-GPU requests, but never before one that came earlier: a
//! fraction backfills only where it delays no earlier whole-GPU request,
//! and the GPUs such a request waits for are held back from everyone
//! behind it (`reserve`). So the order needs no threshold on a fraction's
//! size: `--gpu-memory` of a GPU's whole memory less a byte waits behind
//! an earlier `--gpus 1` exactly as one of the whole memory does, and a
//! stream of small fractions arriving after a `--gpus 2` cannot take the
//! GPUs it waits for.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Index;

use super::{Nanos, RequestId, Waiter, Want};

/// A waiting request's place in `Line::slots`: what the order yields.
pub(super) type Slot = usize;

/// The waiting requests, with the indexes their order is read from.
#[derive(Debug, Clone, Default)]
pub(super) struct Line {
    slots: Vec<Option<Waiter>>,
    free: Vec<Slot>,
    slot_of: HashMap<RequestId, Slot>,
    /// (since, seq, slot) of every request: the escalated ones are a
    /// prefix.
    by_since: BTreeSet<(Nanos, u64, Slot)>,
    /// Each class's requests by seq (whole-GPU ones by GPUs, then seq),
    /// with their `since` and slot.
    pinned: BTreeMap<u64, (Nanos, Slot)>,
    whole: BTreeMap<(u32, u64), (Nanos, Slot)>,
    fractions: BTreeMap<u64, (Nanos, Slot)>,
    /// How many fractions ask for each size, and waiting requests each
    /// user has: what the smallest request needs, and a user's count,
    /// without a walk.
    sizes: BTreeMap<u64, usize>,
    per_user: BTreeMap<u32, usize>,
}

impl Line {
    pub fn push(&mut self, w: Waiter) {
        let slot = self.free.pop().unwrap_or(self.slots.len());
        let (seq, since) = (w.seq, w.since);
        self.slot_of.insert(w.id, slot);
        self.by_since.insert((since, seq, slot));
        match w.req.want {
            _ if !w.req.pin.is_empty() => {
                self.pinned.insert(seq, (since, slot));
            }
            Want::Gpus(n) => {
                self.whole.insert((n, seq), (since, slot));
            }
            Want::Memory(b) => {
                self.fractions.insert(seq, (since, slot));
                *self.sizes.entry(b).or_default() += 1;
            }
        }
        *self.per_user.entry(w.req.uid).or_default() += 1;
        if slot == self.slots.len() {
            self.slots.push(Some(w));
        } else {
            self.slots[slot] = Some(w);
        }
    }

    pub fn remove(&mut self, id: RequestId) -> Option<Waiter> {
        let slot = self.slot_of.remove(&id)?;
        let w = self.slots[slot].take()?;
        self.free.push(slot);
        let seq = w.seq;
        self.by_since.remove(&(w.since, seq, slot));
        match w.req.want {
            _ if !w.req.pin.is_empty() => {
                self.pinned.remove(&seq);
            }
            Want::Gpus(n) => {
                self.whole.remove(&(n, seq));
            }
            Want::Memory(b) => {
                self.fractions.remove(&seq);
                uncount(&mut self.sizes, b);
            }
        }
        uncount(&mut self.per_user, w.req.uid);
        Some(w)
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.slot_of.contains_key(&id)
    }

    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut Waiter> {
        let slot = *self.slot_of.get(&id)?;
        self.slots[slot].as_mut()
    }

    pub fn at_mut(&mut self, slot: Slot) -> &mut Waiter {
        self.slots[slot].as_mut().expect("a waiting request's slot")
    }

    pub fn len(&self) -> usize {
        self.slot_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    /// In no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.slots.iter().flatten()
    }

    /// Whether a pinned request waits.
    pub fn any_pinned(&self) -> bool {
        !self.pinned.is_empty()
    }

    /// The fewest GPUs a waiting whole-GPU request asks for.
    pub fn fewest_gpus(&self) -> Option<u32> {
        self.whole.keys().next().map(|&(n, _)| n)
    }

    /// The least memory a waiting fraction asks for.
    pub fn least_memory(&self) -> Option<u64> {
        self.sizes.keys().next().copied()
    }

    /// How many requests `uid` has waiting.
    pub fn of_user(&self, uid: u32) -> usize {
        self.per_user.get(&uid).copied().unwrap_or(0)
    }

    /// Each waiting request's slot in queue order: escalated first (those
    /// waiting `escalate_after` or longer, FIFO), then pinned (FIFO),
    /// then whole-GPU requests fewest GPUs first, FIFO among equals, each
    /// fraction right after the last whole-GPU request that came before
    /// it.
    pub fn order(&self, now: Nanos, escalate_after: Nanos) -> Vec<Slot> {
        let mut out = Vec::with_capacity(self.len());
        // saturating_sub(since) >= escalate_after, everyone when the
        // limit is zero: the oldest `since` first.
        let escalated =
            |since: Nanos| escalate_after == 0 || now.saturating_sub(since) >= escalate_after;
        let mut first: Vec<(u64, Slot)> = self
            .by_since
            .iter()
            .take_while(|&&(since, _, _)| escalated(since))
            .map(|&(_, seq, slot)| (seq, slot))
            .collect();
        first.sort_unstable();
        out.extend(first.iter().map(|&(_, slot)| slot));
        let waiting = |(seq, &(since, slot)): (u64, &(Nanos, Slot))| {
            (!escalated(since)).then_some((seq, slot))
        };
        out.extend(
            self.pinned
                .iter()
                .filter_map(|(&seq, v)| waiting((seq, v)))
                .map(|(_, slot)| slot),
        );
        let whole: Vec<(u64, Slot)> = self
            .whole
            .iter()
            .filter_map(|(&(_, seq), v)| waiting((seq, v)))
            .collect();
        // earliest[i]: the earliest arrival among whole[i..]. A fraction
        // goes before whole[i] when every whole-GPU request from there on
        // came after it.
        let mut earliest = vec![u64::MAX; whole.len() + 1];
        for i in (0..whole.len()).rev() {
            earliest[i] = earliest[i + 1].min(whole[i].0);
        }
        let mut fractions = self
            .fractions
            .iter()
            .filter_map(|(&seq, v)| waiting((seq, v)))
            .peekable();
        for (i, &(_, slot)) in whole.iter().enumerate() {
            while let Some((_, f)) = fractions.next_if(|&(seq, _)| seq < earliest[i]) {
                out.push(f);
            }
            out.push(slot);
        }
        out.extend(fractions.map(|(_, slot)| slot));
        out
    }
}

impl Index<Slot> for Line {
    type Output = Waiter;

    fn index(&self, slot: Slot) -> &Waiter {
        self.slots[slot].as_ref().expect("a waiting request's slot")
    }
}

/// One fewer of `k`, forgotten at none.
fn uncount<K: Ord>(counts: &mut BTreeMap<K, usize>, k: K) {
    if let Some(n) = counts.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            counts.remove(&k);
        }
    }
}
