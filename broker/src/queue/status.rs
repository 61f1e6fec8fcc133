//! What the queue shows: waiting requests in queue order, the leases on
//! each GPU, and a lease's details; and relabelling for those views.

use gpufrac_common::wire::{EXACT_POSITIONS, position_worth_telling};

use super::{Lease, LeaseStatus, Nanos, Queue, RequestId, WaitingStatus, Want};

/// Beyond [`EXACT_POSITIONS`] a waiting request is told its place at
/// most once every [`retell_after`] its place, however fast the queue
/// moves: its place there is "about" anyway, and a run's log lines read
/// the exact one from status. At least this often.
pub const RETELL_EVERY: Nanos = 5_000_000_000;
/// And this long per place: a request's wait grows with its place, and
/// so may the age of the place it knows, as its precision does (a
/// tenth). A queue whose every place moves (requests leaving from
/// anywhere in it) then tells its far places about 18 + 20·ln(N/100)
/// times a second (64 for a thousand), not N/5 (200).
pub const RETELL_PER_PLACE: Nanos = 50_000_000;

/// How long a request beyond [`EXACT_POSITIONS`], now at `place`, goes
/// untold after it was last told.
pub fn retell_after(place: u32) -> Nanos {
    RETELL_EVERY.max(RETELL_PER_PLACE.saturating_mul(Nanos::from(place)))
}

/// A walk tells at most this many places beyond [`EXACT_POSITIONS`]; the
/// rest go at the next walks. A burst (a thousand requests that arrived
/// together fall due together) is spread, and no walk holds the broker
/// for a message to every request.
pub const FAR_PER_WALK: usize = 64;

/// Whether a request last told `told` (its place, and when) is due to be
/// told `place` at `now`: it moved by a meaningful step
/// ([`position_worth_telling`]), and beyond [`EXACT_POSITIONS`]
/// [`retell_after`] its place has passed.
pub(crate) fn due(told: Option<(u32, Nanos)>, place: u32, now: Nanos) -> bool {
    let recent = place > EXACT_POSITIONS
        && told.is_some_and(|(_, at)| now < at.saturating_add(retell_after(place)));
    !recent && position_worth_telling(told.map(|t| t.0), place)
}

impl Queue {
    /// Whether any request waits (without ordering them, as `waiting` does).
    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// How many requests wait (without ordering them).
    pub fn waiting_count(&self) -> usize {
        self.waiting.len()
    }

    pub fn waiting(&self, now: Nanos) -> Vec<WaitingStatus> {
        self.order(now)
            .into_iter()
            .enumerate()
            .map(|(pos, i)| {
                let w = &self.waiting[i];
                WaitingStatus {
                    id: w.id,
                    position: pos + 1,
                    want: w.req.want,
                    label: w.req.label.clone(),
                    since: w.since,
                    waited: now.saturating_sub(w.since),
                    escalated: self.is_escalated(now, w),
                }
            })
            .collect()
    }

    /// The waiting requests whose place moved far enough from the one
    /// they were last told to be told again
    /// ([`position_worth_telling`]: exact up to 10, within a tenth
    /// beyond), with that place (1-based) and what they want; each is
    /// taken as told. Beyond the tenth place a request is told again at
    /// most once every [`retell_after`] its place, and a walk tells at most
    /// [`FAR_PER_WALK`] of them, the nearest first: true when some were
    /// left for the next walk. One walk of the queue, nothing per request
    /// that stays put: a departure tells a few requests, not all behind
    /// it.
    pub fn positions_to_tell(&mut self, now: Nanos) -> (Vec<(RequestId, u32, Want)>, bool) {
        self.walk = false;
        let (mut out, mut far, mut left) = (Vec::new(), 0, false);
        for (place, slot) in self.order(now).into_iter().enumerate() {
            let place = u32::try_from(place + 1).unwrap_or(u32::MAX);
            let w = self.waiting.at_mut(slot);
            let beyond = place > EXACT_POSITIONS;
            if !due(w.told, place, now) {
                continue;
            }
            if beyond && far == FAR_PER_WALK {
                left = true;
                continue;
            }
            far += usize::from(beyond);
            w.told = Some((place, now));
            out.push((w.id, place, w.req.want));
        }
        (out, left)
    }

    /// Forgets the place a waiting request was told, so that the next
    /// `positions_to_tell` tells it (its `run` came back on a new
    /// connection).
    pub fn retell(&mut self, id: RequestId) {
        if let Some(w) = self.waiting.get_mut(id) {
            w.told = None;
            self.walk = true;
        }
    }

    /// New requests told their place at `submit`, without a walk, that
    /// still wait (one placed at once is told its lease instead).
    pub fn take_fresh(&mut self) -> Vec<(RequestId, u32, Want)> {
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.retain(|f| self.waiting.contains(f.0));
        fresh
    }

    /// Whether a waiting request waits for a walk to be told its place
    /// (it is new, and not a fraction, or its run came back).
    pub fn must_walk(&self) -> bool {
        self.walk && self.has_waiting()
    }

    /// How many requests `uid` has waiting.
    pub fn waiting_of(&self, uid: u32) -> usize {
        self.waiting.of_user(uid)
    }

    /// The place a waiting request was last told, and when.
    #[cfg(test)]
    pub(crate) fn told(&self, id: RequestId) -> Option<(u32, Nanos)> {
        self.waiting
            .iter()
            .find(|w| w.id == id)
            .and_then(|w| w.told)
    }

    /// 1-based queue position of a waiting request.
    #[cfg(test)]
    pub fn position(&self, now: Nanos, id: RequestId) -> Option<usize> {
        self.order(now)
            .into_iter()
            .position(|i| self.waiting[i].id == id)
            .map(|p| p + 1)
    }

    pub fn leases(&self) -> Vec<LeaseStatus> {
        self.gpus
            .iter()
            .map(|g| {
                let mut leases = g.leases.clone();
                leases.sort_unstable();
                LeaseStatus {
                    index: g.info.index,
                    uuid: g.info.uuid.clone(),
                    total_mem: g.info.total_mem,
                    slots_used: g.slots_used,
                    slots_total: self.cfg.overprovision,
                    committed_mem: g.committed,
                    leases,
                }
            })
            .collect()
    }

    /// A new label and pod for a waiting or held request (status and
    /// messages show them).
    pub fn relabel(&mut self, id: RequestId, label: &str, pod: Option<&str>) {
        let req = match self.held.get_mut(&id) {
            Some(h) => Some(&mut h.req),
            None => self.waiting.get_mut(id).map(|w| &mut w.req),
        };
        if let Some(r) = req {
            r.label = label.to_owned();
            r.pod = pod.map(str::to_owned);
        }
    }

    pub fn lease(&self, id: RequestId) -> Option<&Lease> {
        self.held.get(&id).map(|h| &h.lease)
    }

    /// The request a lease was granted for (label, compute, limit).
    #[cfg(test)]
    pub fn lease_request(&self, id: RequestId) -> Option<&super::Request> {
        self.held.get(&id).map(|h| &h.req)
    }
}
