//! The job table: each job's record (what the state file keeps) with
//! everything the core knows of it beside: the connection of its `gpufrac
//! run` (or the device plugin's), when its lease was granted, the state
//! number that must be durable before its run is told, and its member
//! processes. A job ends in one place, `end`, which takes all of it.
//!
//! A MIG instance being made for a job is not here: it outlives a job that
//! ends meanwhile (the instance is released once made), so it is kept by
//! lease in `Broker::making`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{ConnId, Nanos};
use crate::jobs::Job;

/// One job and what the core keeps of it.
#[derive(Debug)]
pub(super) struct Entry {
    pub job: Job,
    /// The connection whose lease it is (None: restored from the state
    /// file and not yet resumed).
    pub run: Option<ConnId>,
    /// Its lease was granted then (status's HELD).
    pub leased_at: Option<Nanos>,
    /// Its lease is told to its run once state number this is written.
    pub undelivered: Option<u64>,
    /// Connections of its processes (`Conn::member_of` says the same from
    /// the other side).
    pub members: BTreeSet<ConnId>,
    /// GPU time of processes that have left it, ns (those still in it are
    /// asked of the schedulers at its end), what they were owed, and the
    /// allocations their caps refused.
    pub gpu_ns: u64,
    pub owed_ns: u64,
    pub ooms: u64,
    /// How long it waited in the queue before its lease, ns.
    pub queued_ns: u64,
    /// Device memory its processes report using now, together, and its
    /// peak: the most they have reported at once, and never less than
    /// one process's own peak on one GPU (a process reports every 100 ms
    /// and at exit: between two reports it may have taken and freed it
    /// all). Its end line says the peak.
    pub used: u64,
    pub peak: u64,
    /// The job's bytes in the state file, until it changes (`get_mut`).
    encoded: Option<Box<[u8]>>,
}

/// Jobs by token, with two indexes kept beside them, so that no lookup a
/// client's message makes walks every job: by the run's process (pid and
/// mark, what a registration's ancestry is matched against) and by
/// user (what a lease's budget counts).
#[derive(Debug, Default)]
pub(super) struct Jobs {
    entries: BTreeMap<u64, Entry>,
    by_run: HashMap<(u32, u64), BTreeSet<u64>>,
    by_uid: HashMap<u32, BTreeSet<u64>>,
    /// Jobs whose `gpufrac run` has not (re)connected: restored from the
    /// state file, swept if it never does. Kept so that the loop's timer
    /// does not walk every job to learn whether there are any.
    runless: BTreeSet<u64>,
    /// Per user, its jobs whose lease waits for a state write.
    unsaved: BTreeMap<u32, usize>,
}

impl Jobs {
    /// A new job, with nothing else known of it yet.
    pub fn insert(&mut self, job: Job) {
        let token = job.token;
        if let Some(old) = self.end(token) {
            // Never reached: tokens are unique. Kept consistent all the same.
            debug_assert!(false, "job {} inserted twice", old.job.pid);
        }
        self.by_run
            .entry((job.pid, job.ident))
            .or_default()
            .insert(token);
        self.by_uid.entry(job.uid).or_default().insert(token);
        self.runless.insert(token);
        self.entries.insert(
            token,
            Entry {
                job,
                run: None,
                leased_at: None,
                undelivered: None,
                members: BTreeSet::new(),
                gpu_ns: 0,
                owed_ns: 0,
                ooms: 0,
                queued_ns: 0,
                used: 0,
                peak: 0,
                encoded: None,
            },
        );
    }

    /// How many jobs `uid` has.
    pub fn count_of(&self, uid: u32) -> usize {
        self.by_uid.get(&uid).map_or(0, BTreeSet::len)
    }

    /// The job is over: everything kept of it, gone at once.
    pub fn end(&mut self, token: u64) -> Option<Entry> {
        let e = self.entries.remove(&token)?;
        self.runless.remove(&token);
        if e.undelivered.is_some() {
            self.delivered(e.job.uid);
        }
        let run = (e.job.pid, e.job.ident);
        if let Some(t) = self.by_run.get_mut(&run) {
            t.remove(&token);
            if t.is_empty() {
                self.by_run.remove(&run);
            }
        }
        if let Some(t) = self.by_uid.get_mut(&e.job.uid) {
            t.remove(&token);
            if t.is_empty() {
                self.by_uid.remove(&e.job.uid);
            }
        }
        Some(e)
    }

    /// The job whose run is this process (the first by token, if one
    /// process runs several).
    pub fn run_by(&self, pid: u32, ident: u64) -> Option<u64> {
        self.by_run
            .get(&(pid, ident))
            .and_then(|t| t.first().copied())
    }

    /// User `uid`'s jobs.
    #[cfg(test)]
    pub fn of_user(&self, uid: u32) -> impl Iterator<Item = &Job> {
        self.by_uid
            .get(&uid)
            .into_iter()
            .flatten()
            .filter_map(|t| self.get(t))
    }

    /// The connections of the job's processes.
    pub fn members(&self, token: &u64) -> impl Iterator<Item = ConnId> + '_ {
        self.entries
            .get(token)
            .into_iter()
            .flat_map(|e| e.members.iter().copied())
    }

    /// Its processes' memory in use went from `old` to `new` bytes; the
    /// process that reported it has held at most `peak` at once.
    pub fn used(&mut self, token: u64, old: u64, new: u64, peak: u64) {
        if let Some(e) = self.entries.get_mut(&token) {
            e.used = e.used.saturating_sub(old).saturating_add(new);
            e.peak = e.peak.max(e.used).max(peak);
        }
    }

    pub fn get(&self, token: &u64) -> Option<&Job> {
        self.entries.get(token).map(|e| &e.job)
    }

    /// The job to change: its bytes in the state file are made again at
    /// the next `encode`.
    pub fn get_mut(&mut self, token: &u64) -> Option<&mut Job> {
        self.entries.get_mut(token).map(|e| {
            e.encoded = None;
            &mut e.job
        })
    }

    /// The state file's bytes for every job (`jobs::encode`'s), each job
    /// encoded again only if it changed since the last.
    pub fn encode(&mut self) -> Vec<u8> {
        for e in self.entries.values_mut() {
            if e.encoded.is_none() {
                e.encoded = Some(crate::jobs::encode_job(&e.job).into());
            }
        }
        crate::jobs::assemble(self.entries.values().filter_map(|e| e.encoded.as_deref()))
    }

    /// The record of the job, with what is kept of it.
    pub fn entry(&self, token: &u64) -> Option<&Entry> {
        self.entries.get(token)
    }

    pub fn contains_key(&self, token: &u64) -> bool {
        self.entries.contains_key(token)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every job, by token.
    pub fn iter(&self) -> impl Iterator<Item = (&u64, &Job)> {
        self.entries.iter().map(|(t, e)| (t, &e.job))
    }

    pub fn values(&self) -> impl Iterator<Item = &Job> {
        self.entries.values().map(|e| &e.job)
    }

    /// The connection of the job's run, if it has one.
    pub fn run(&self, token: &u64) -> Option<ConnId> {
        self.entries.get(token).and_then(|e| e.run)
    }

    pub fn set_run(&mut self, token: u64, id: ConnId) {
        if let Some(e) = self.entries.get_mut(&token) {
            e.run = Some(id);
            self.runless.remove(&token);
        }
    }

    /// Jobs no connection has claimed (restored, their run not back).
    pub fn without_run(&self) -> impl Iterator<Item = (&u64, &Job)> {
        self.runless
            .iter()
            .filter_map(|t| self.entries.get_key_value(t).map(|(t, e)| (t, &e.job)))
    }

    pub fn leased_at(&self, token: &u64) -> Option<Nanos> {
        self.entries.get(token).and_then(|e| e.leased_at)
    }

    /// Its lease is held from `now`, unless it already was, after waiting
    /// `queued` in the queue.
    pub fn leased(&mut self, token: u64, now: Nanos, queued: Nanos) {
        if let Some(e) = self.entries.get_mut(&token) {
            if e.leased_at.is_none() {
                e.queued_ns = queued;
            }
            e.leased_at.get_or_insert(now);
        }
    }

    /// Its lease is told once state `seq` is written.
    pub fn hold_until_saved(&mut self, token: u64, seq: u64) {
        if let Some(e) = self.entries.get_mut(&token)
            && e.undelivered.replace(seq).is_none()
        {
            *self.unsaved.entry(e.job.uid).or_default() += 1;
        }
    }

    fn delivered(&mut self, uid: u32) {
        if let Some(n) = self.unsaved.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                self.unsaved.remove(&uid);
            }
        }
    }

    /// The users with a lease that waits for a state write.
    pub fn unsaved_users(&self) -> impl Iterator<Item = u32> + '_ {
        self.unsaved.keys().copied()
    }

    pub fn undelivered(&self, token: &u64) -> bool {
        self.entries
            .get(token)
            .is_some_and(|e| e.undelivered.is_some())
    }

    /// The jobs whose leases state `seq` made durable, no longer held.
    pub fn saved(&mut self, seq: u64) -> Vec<u64> {
        let mut ready: Vec<(u64, u64)> = Vec::new();
        let mut users = Vec::new();
        for (&t, e) in &mut self.entries {
            if e.undelivered.is_some_and(|s| s <= seq) {
                ready.push((e.undelivered.take().unwrap_or(0), t));
                users.push(e.job.uid);
            }
        }
        for uid in users {
            self.delivered(uid);
        }
        ready.sort_unstable();
        ready.into_iter().map(|(_, t)| t).collect()
    }

    /// Process `id`, using `used` bytes now, joins the job.
    pub fn join(&mut self, token: u64, id: ConnId, used: u64) {
        if let Some(e) = self.entries.get_mut(&token)
            && e.members.insert(id)
        {
            e.used = e.used.saturating_add(used);
            e.peak = e.peak.max(e.used);
        }
    }

    /// Process `id` leaves the job, having spent `spent` in it and using
    /// `used` bytes now.
    pub fn leave(&mut self, token: u64, id: ConnId, spent: Spent, used: u64) {
        if let Some(e) = self.entries.get_mut(&token)
            && e.members.remove(&id)
        {
            e.gpu_ns = e.gpu_ns.saturating_add(spent.gpu_ns);
            e.owed_ns = e.owed_ns.saturating_add(spent.owed_ns);
            e.ooms = e.ooms.saturating_add(spent.ooms);
            e.used = e.used.saturating_sub(used);
        }
    }
}

/// What processes spent in a job: GPU time charged, what they were owed
/// (ns), allocations refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Spent {
    pub gpu_ns: u64,
    pub owed_ns: u64,
    pub ooms: u64,
}

impl Spent {
    pub fn add(self, o: Spent) -> Spent {
        Spent {
            gpu_ns: self.gpu_ns.saturating_add(o.gpu_ns),
            owed_ns: self.owed_ns.saturating_add(o.owed_ns),
            ooms: self.ooms.saturating_add(o.ooms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::{Phase, decode, encode, sample};

    #[test]
    fn the_saved_bytes_follow_every_change_of_a_job() {
        let mut jobs = Jobs::default();
        for t in [3, 1, 2] {
            jobs.insert(sample(t));
        }
        let whole = |j: &Jobs| encode(j.values());
        assert_eq!(jobs.encode(), whole(&jobs));
        jobs.get_mut(&2).expect("job 2").phase = Phase::Queued { since: 7 };
        jobs.end(1);
        jobs.insert(Job {
            uid: 7,
            ..sample(9)
        });
        let bytes = jobs.encode();
        assert_eq!(bytes, whole(&jobs), "a changed job is encoded again");
        let back = decode(&bytes).expect("the state file's bytes").0;
        assert_eq!(back, jobs.values().cloned().collect::<Vec<_>>());
        let two = back.iter().find(|j| j.token == 2).expect("job 2");
        assert_eq!(two.phase, Phase::Queued { since: 7 });
    }
}
