//! Jobs: `gpufrac run`'s leases and the device plugin's, the queue they
//! wait in, their processes, what a restarted broker restores and what it
//! holds when its state could not be trusted, and MIG instances made for
//! them.

use gpufrac_common::size::format_size;
use gpufrac_common::wire::{self, Lease, LeaseReq, ServerMsg};
use tracing::{info, warn};

use super::clients::lower_caps;
use super::conn::Quoted;
use super::jobtable::Spent;
use super::{Broker, ConnId, MigDone, Nanos};
use crate::jobs::{Job, Phase};
use crate::mig;
use crate::queue::{self, Pinned, Want};
use crate::stats::Refusal;
use gpufrac_common::wire::uuid_string;

/// A pod's `namespace/name`: 63 and 253 characters at most in Kubernetes.
pub(super) const MAX_POD: usize = 320;
/// GPUs and MIG devices a lease may pin: far above any node's.
const MAX_PINS: usize = 256;

impl Broker {
    fn refuse(&mut self, id: ConnId, reason: impl Into<String>) {
        self.refuse_as(id, Refusal::Other, reason);
    }

    /// A refusal of a lease request, counted by user and `why` for
    /// metrics and said in one log line within the user's log budget
    /// (`may_log`): a warning where the rules forbade it, else at info.
    fn refuse_as(&mut self, id: ConnId, why: Refusal, reason: impl Into<String>) {
        let reason = reason.into();
        let (pid, uid) = self
            .conns
            .get(&id)
            .map_or((0, 0), |c| (c.peer.pid, c.peer.uid));
        self.stats.refused(uid, why);
        if self.may_log(uid) {
            let (label, text) = (why.as_str(), Quoted(&reason));
            if why == Refusal::NotAllowed {
                warn!(pid, uid, reason = label, why = %text, "refused a lease");
            } else {
                info!(pid, uid, reason = label, why = %text, "refused a lease");
            }
        }
        self.send(id, &ServerMsg::Refused { reason });
    }

    pub(super) fn lease(&mut self, now: Nanos, id: ConnId, a: LeaseReq) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        if c.job().is_some() {
            return self.refuse(id, "one lease per connection");
        }
        let peer = c.peer.clone();
        let pinned = !a.pin.is_empty() && a.resume == 0;
        if let Err(reason) = self
            .cfg
            .policy
            .lease(&peer, pinned, a.token != 0, a.priority)
        {
            return self.refuse_as(id, Refusal::NotAllowed, reason);
        }
        if a.resume != 0 {
            return self.resume_job(now, id, a);
        }
        if a.pin.len() > MAX_PINS {
            return self.refuse(
                id,
                format!(
                    "a lease pins at most {MAX_PINS} GPUs or MIG devices; this one named {}",
                    a.pin.len()
                ),
            );
        }
        if a.token != 0 && self.ledger.jobs().contains_key(&a.token) {
            return self.refuse(
                id,
                "the chosen token is another job's; choose another at random",
            );
        }
        if pinned && (a.want_gpus, a.want_mem) != (0, 0) {
            return self.refuse(
                id,
                "a lease either names its GPUs and the memory on each (pin) or asks for GPUs or memory, not both",
            );
        }
        let will_wait = !a.no_wait && (a.want_gpus, a.want_mem, pinned) != (0, 0, false);
        if let Err(reason) = self.within_budget(&peer, will_wait) {
            return self.refuse_as(id, Refusal::LeaseLimit, reason);
        }
        // The process as it was at accept: the pid may name another
        // process by now, whose job this must never become.
        let Some(ident) = peer.ident else {
            return self.refuse(id, "cannot identify the requesting process");
        };
        let token = match a.token {
            0 => self.ledger.new_token(self.world.tokens()),
            t => t,
        };
        let job = self.job_for(id, &a, token, ident);
        match job.request() {
            // A job without placement: a unit with its settings.
            None => {
                self.attach_job(now, id, job);
                self.send_unplaced(now, id, token);
            }
            // While a recovery holds placements, the kubelet's placements
            // are facts to book, like the leases running jobs claim back.
            Some(_) if pinned && !self.ledger.placing(now) => self.claim(now, id, job, &[]),
            Some(_) if a.no_wait && !self.ledger.placing(now) => {
                let why = self.ledger.recovering_text(now);
                self.refuse_as(
                    id,
                    Refusal::NoRoom,
                    format!("no room now: {why}; drop --no-wait to queue"),
                );
            }
            Some(req) if a.no_wait => match self.ledger.queue_mut().try_now(now, token, req) {
                Ok(lease) => {
                    let mut job = job;
                    job.phase = Phase::Running {
                        gpus: lease.gpus.clone(),
                        mig: None,
                    };
                    self.attach_job(now, id, job);
                    self.placed(now, lease, Some(id));
                }
                Err(r) => self.refuse_as(id, Refusal::NoRoom, r.reason),
            },
            Some(req) => match self.ledger.queue_mut().submit(now, token, req) {
                Ok(()) => {
                    let mut job = job;
                    job.phase = Phase::Queued { since: now };
                    if self.may_log(peer.uid) {
                        info!(
                            pid = job.pid,
                            uid = job.uid,
                            command = %Quoted(&job.label),
                            wants = ?job.want.as_ref().map(Want::words).unwrap_or_default(),
                            "lease queued"
                        );
                    }
                    self.attach_job(now, id, job);
                }
                Err(r) => self.refuse_as(id, Refusal::Unsatisfiable, r.reason),
            },
        }
    }

    /// A user may hold `budgets.leases` jobs (placed, waiting or without
    /// placement) and wait in the queue with `budgets.queued` of them; root
    /// and the device plugin are not counted (they book for others).
    fn within_budget(&self, peer: &crate::authority::Peer, will_wait: bool) -> Result<(), String> {
        if !self.cfg.policy.counted(peer) {
            return Ok(());
        }
        // Counted as they come and go: a user with a long queue of its own
        // is not walked at each request.
        let (all, queued) = (
            self.ledger.jobs().count_of(peer.uid),
            self.ledger.queue().waiting_of(peer.uid),
        );
        let b = self.cfg.budgets;
        if all >= b.leases {
            return Err(format!(
                "user {} already holds {all} leases and queued requests on this broker (its per-user limit); \
                 end some and retry",
                peer.uid
            ));
        }
        if will_wait && queued >= b.queued {
            return Err(format!(
                "user {} already has {queued} requests waiting in the queue (its per-user limit); \
                 wait for some to be placed, or use --no-wait",
                peer.uid
            ));
        }
        Ok(())
    }

    /// The job a `Lease` asks for, its values clamped and cut to size.
    fn job_for(&mut self, id: ConnId, a: &LeaseReq, token: u64, ident: u64) -> Job {
        let label = self.clip(&a.command, self.cfg.budgets.label);
        let c = self
            .conns
            .get(&id)
            .expect("a lease comes from an open connection");
        let pin: Vec<Pinned> = a
            .pin
            .iter()
            .map(|p| Pinned {
                uuid: uuid_string(&p.uuid),
                mem: p.mem,
            })
            .collect();
        let want = match (a.want_gpus, a.want_mem) {
            _ if !pin.is_empty() => Some(Want::Memory(queue::pinned_total(&pin))),
            (0, 0) => None,
            (0, b) => Some(Want::Memory(b)),
            (n, _) => Some(Want::Gpus(n)),
        };
        Job {
            token,
            pid: c.peer.pid,
            ident,
            uid: c.peer.uid,
            want,
            // Percent on the wire; clamped like a process's own.
            compute: a
                .compute
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(|s| s.min(100.0)),
            limit: a
                .limit
                .filter(|l| l.is_finite() && *l > 0.0)
                .map(|l| (l / 100.0).min(1.0)),
            priority: a.priority,
            label,
            mem_cap: None,
            phase: Phase::Unplaced,
            pin,
            pod: None,
            // Only the plugin may choose tokens (checked above).
            plugin: a.token != 0,
        }
    }

    pub(super) fn name(&mut self, id: ConnId, pod: String, label: String) {
        let Some(t) = self.conns.get(&id).and_then(|c| c.job()) else {
            return self.send(
                id,
                &ServerMsg::Error {
                    code: wire::ERR_REFUSED,
                    message: "Name names the job of this connection's lease: send Lease first"
                        .into(),
                },
            );
        };
        let label = self.clip(&label, self.cfg.budgets.label);
        let pod = Some(self.clip(&pod, MAX_POD)).filter(|p| !p.is_empty());
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.command = label.clone();
        let (pid, uid) = (c.peer.pid, c.peer.uid);
        if self.may_log(uid) {
            info!(pid, uid, label = %Quoted(&label), pod = %Quoted(pod.as_deref().unwrap_or("")), "lease named");
        }
        self.ledger.queue_mut().relabel(t, &label, pod.as_deref());
        if let Some(j) = self.ledger.jobs_mut().get_mut(&t) {
            j.label = label;
            j.pod = pod;
            self.saves.changed();
        }
    }

    /// The lease of a job without placement: no GPUs, only its token (and
    /// the MPS pipe, in MPS mode).
    fn send_unplaced(&mut self, now: Nanos, id: ConnId, token: u64) {
        // Held from now, as a placed lease is from its grant (status's HELD).
        self.ledger.jobs_mut().leased(token, now, 0);
        let msg = ServerMsg::Leased(Lease {
            token,
            mps_pipe: self.cfg.mps_pipe.clone().unwrap_or_default(),
            ..Lease::default()
        });
        self.send(id, &msg);
    }

    fn attach_job(&mut self, now: Nanos, id: ConnId, job: Job) {
        let t = job.token;
        self.job_changed(&job.phase);
        self.ledger.attach(job, id);
        if let Some(c) = self.conns.get_mut(&id).and_then(|c| c.cli_mut()) {
            c.job = Some(t);
        }
        self.rejoin(now, t);
    }

    /// A job came or went: a waiting one's change is the queue's alone
    /// (`Saves::queue_changed`, written within a second); any other's is
    /// written within `SAVE_EVERY`.
    fn job_changed(&mut self, phase: &Phase) {
        if matches!(phase, Phase::Queued { .. }) {
            self.saves.queue_changed();
        } else {
            self.saves.changed();
        }
    }

    /// Brings a job's processes up to date with it: those that sent its
    /// token before it existed join it (a pod's processes can start before
    /// the device plugin's lease reaches the broker), if the rules let
    /// them, and all of them get its memory cap once it has one.
    fn rejoin(&mut self, now: Nanos, token: u64) {
        let Some(j) = self.ledger.jobs().get(&token) else {
            return;
        };
        let mem_cap = j.mem_cap.unwrap_or(0);
        let policy = &self.cfg.policy;
        // Its members and the processes that sent its token: not every
        // connection.
        let claimed = self.ledger.claimed(token);
        let mut who: Vec<ConnId> = self.ledger.jobs().members(&token).chain(claimed).collect();
        who.sort_unstable();
        who.dedup();
        who.retain(|t| {
            self.conns.get(t).is_some_and(|c| {
                c.shim().is_some_and(|s| {
                    s.registered
                        && (s.member_of == Some(token)
                            || (s.member_of.is_none()
                                && s.claimed_job == Some(token)
                                && policy.may_join(&c.peer, j)))
                })
            })
        });
        for t in who {
            if let Some(s) = self.conns.get_mut(&t).and_then(|c| c.shim_mut()) {
                s.member_of = Some(token);
                let used = s.devices.iter().map(|d| d.used).sum();
                self.ledger.jobs_mut().join(token, t, used);
                lower_caps(&mut s.devices, mem_cap);
            }
            if mem_cap > 0 {
                self.send(t, &ServerMsg::Registered { mem_cap });
            }
            self.enforce(now, t);
        }
    }

    /// A `gpufrac run` reconnecting after a broker restart: only the same
    /// process (pid, mark and uid) may claim its job back, and only
    /// while no live connection holds it. A token the broker does not know
    /// is a claim nothing can verify: during a recovery only root or the
    /// device plugin may book one (where its pins say), within budget;
    /// anyone else's is refused, whatever GPUs it names.
    fn resume_job(&mut self, now: Nanos, id: ConnId, a: LeaseReq) {
        let token = a.resume;
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let peer = c.peer.clone();
        let start = peer.ident;
        let taken = self
            .ledger
            .jobs()
            .run(&token)
            .is_some_and(|t| self.conns.contains_key(&t));
        const NO_SUCH: &str = "this broker has no such lease to resume (it was started without the state file, or the lease ended)";
        match self.ledger.jobs().get(&token) {
            Some(j) if !taken && self.cfg.policy.may_resume(&peer, j) => {}
            Some(_) => return self.refuse(id, NO_SUCH),
            None if self.ledger.placing(now) || a.pin.is_empty() => {
                return self.refuse(id, NO_SUCH);
            }
            None => {
                // Counted before anything is booked for it.
                if let Err(reason) = self.within_budget(&peer, false) {
                    return self.refuse(id, reason);
                }
                if let Err(reason) = self.cfg.policy.claim_unverified(&peer) {
                    return self.refuse_as(
                        id,
                        Refusal::NotAllowed,
                        format!(
                            "recovery: a claim for a lease the trusted state does not have: {reason}"
                        ),
                    );
                }
                let Some(start) = start else {
                    return self.refuse(id, "cannot identify the requesting process");
                };
                let job = self.job_for(id, &a, token, start);
                // What it held, not what it pins: a job of `--gpus` or
                // `--gpu-memory`, on the GPUs it names.
                let job = Job {
                    want: match (a.want_gpus, a.want_mem) {
                        (0, b) => Some(Want::Memory(b)),
                        (n, _) => Some(Want::Gpus(n)),
                    },
                    pin: Vec::new(),
                    ..job
                };
                let held: Vec<[u8; 16]> = a.pin.iter().map(|p| p.uuid).collect();
                return self.claim(now, id, job, &held);
            }
        }
        let pid = peer.pid;
        self.ledger.rerun(token, id);
        let Some((phase, label)) = self
            .ledger
            .jobs()
            .get(&token)
            .map(|j| (j.phase.clone(), j.label.clone()))
        else {
            return;
        };
        if self.may_log(peer.uid) {
            info!(pid, uid = peer.uid, "gpufrac run reclaimed its job");
        }
        if let Some(c) = self.conns.get_mut(&id) {
            c.command = label;
            if let Some(cli) = c.cli_mut() {
                cli.job = Some(token);
            }
        }
        match phase {
            Phase::Queued { .. } => {}
            Phase::Unplaced => self.send_unplaced(now, id, token),
            Phase::Running { .. } if self.ledger.jobs().undelivered(&token) => {}
            Phase::Running { .. } => self.tell_lease(token),
        }
    }

    /// Books, during a recovery, what a running job holds: a pinned
    /// job where its pins say, a job the state file lost on the GPUs (or
    /// MIG device) named by UUID in `held`, whatever else is booked there
    /// (it runs there: overbooked, the GPU takes no newcomer, which is the
    /// safe side).
    fn claim(&mut self, now: Nanos, id: ConnId, job: Job, held: &[[u8; 16]]) {
        let Some(req) = job.request() else {
            return self.refuse(id, "a lease claimed back must say what it holds");
        };
        let restored = self.ledger.claim_back(job.token, req, held);
        match restored {
            Ok((lease, mig)) => {
                if self.may_log(job.uid) {
                    warn!(
                        pid = job.pid,
                        uid = job.uid,
                        gpus = ?lease.gpus,
                        "recovery: booked a running job's lease as it claimed it"
                    );
                }
                let mut job = job;
                job.phase = Phase::Running {
                    gpus: lease.gpus.clone(),
                    mig,
                };
                self.attach_job(now, id, job);
                self.granted(now, lease);
            }
            Err(r) => self.refuse(id, r.reason),
        }
    }

    /// The job is over (its run disconnected or died): its lease or place
    /// goes, its processes become their user's again.
    pub(super) fn end_job(&mut self, now: Nanos, token: u64) {
        let uid = self.ledger.jobs().get(&token).map(|j| j.uid);
        if let Some(a) = self.ledger.release(now, token)
            && uid.is_none_or(|u| self.may_log(u))
        {
            info!(
                gpu = a.gpu,
                gi = ?a.gi,
                profile = %a.profile_name,
                "the job's MIG instance is idle; kept for the next job until its room is needed"
            );
        }
        // What its processes still in it used of the GPUs, asked of the
        // schedulers before they leave it.
        let members: Vec<ConnId> = self.ledger.jobs().members(&token).collect();
        let gpus: Vec<usize> = members
            .iter()
            .filter_map(|id| self.conns.get(id))
            .flat_map(|c| c.devices().iter().map(|d| d.gpu))
            .collect();
        let gpu_ns = self.spent(now, &members, gpus).gpu_ns;
        if let Some(e) = self.ledger.jobs_mut().end(token) {
            let j = e.job;
            self.job_changed(&j.phase);
            for t in e.members {
                if let Some(s) = self.conns.get_mut(&t).and_then(|c| c.shim_mut()) {
                    s.member_of = None;
                }
                self.enforce(now, t);
            }
            if !self.may_log(j.uid) {
                return;
            }
            // A request that left before it was placed held nothing: its
            // line says how long it waited, not a lease's blanks.
            if let Phase::Queued { since } = j.phase {
                info!(
                    pid = j.pid,
                    uid = j.uid,
                    command = %Quoted(&j.label),
                    waited_s = %format!("{:.1}", now.saturating_sub(since) as f64 / 1e9),
                    "queued request left before it was placed"
                );
            } else {
                let held = e.leased_at.map(|t| now.saturating_sub(t));
                info!(
                    pid = j.pid,
                    uid = j.uid,
                    command = %Quoted(&j.label),
                    held_s = %held.map(|h| format!("{:.1}", h as f64 / 1e9)).unwrap_or_else(|| "-".into()),
                    gpu_s = %format!("{:.2}", (e.gpu_ns + gpu_ns) as f64 / 1e9),
                    peak = ?format_size(e.peak),
                    "lease ended"
                );
            }
        }
    }

    /// What these processes have spent on these GPUs, together: GPU time
    /// as their schedulers charged it and what they were owed, and the
    /// allocations their caps refused. Each GPU's processes walked once
    /// (when a job's process leaves it, the job ends or its run asks for
    /// its summary, never for a frame).
    pub(super) fn spent(
        &self,
        now: Nanos,
        ids: &[ConnId],
        gpus: impl IntoIterator<Item = usize>,
    ) -> Spent {
        let mut gpus: Vec<usize> = gpus.into_iter().collect();
        gpus.sort_unstable();
        gpus.dedup();
        let set: std::collections::HashSet<ConnId> = ids.iter().copied().collect();
        let mut out = gpus
            .into_iter()
            .filter_map(|g| self.gpus.get(g))
            .flat_map(|g| g.sched.status(now))
            .filter(|s| set.contains(&s.client))
            .fold(Spent::default(), |acc, s| {
                acc.add(Spent {
                    gpu_ns: s.times.gpu_time,
                    owed_ns: s.times.entitled,
                    ooms: 0,
                })
            });
        out.ooms = ids
            .iter()
            .filter_map(|id| self.conns.get(id))
            .flat_map(|c| c.devices().iter().map(|d| d.ooms))
            .sum();
        out
    }

    /// A lease the queue placed (from the queue, or `--no-wait` on
    /// `no_wait`): granted, or first its MIG instance is made.
    pub(super) fn placed(&mut self, now: Nanos, lease: queue::Lease, no_wait: Option<ConnId>) {
        if !self.ledger.make(&lease, no_wait) {
            self.granted(now, lease);
        }
    }

    /// Books a lease in its job and its processes; the run is told once
    /// the state that books it is on disk.
    fn granted(&mut self, now: Nanos, lease: queue::Lease) {
        let mig = lease.mig.as_ref().and_then(|a| a.uuid.clone());
        let mut waited = 0;
        if let Some(j) = self.ledger.jobs_mut().get_mut(&lease.id) {
            waited = match j.phase {
                Phase::Queued { since } => {
                    let waited = now.saturating_sub(since);
                    self.stats.queue_waited(j.uid, waited);
                    waited
                }
                _ => 0,
            };
            j.phase = Phase::Running {
                gpus: lease.gpus.clone(),
                mig: mig.clone(),
            };
            j.mem_cap = lease.mem_cap;
            let (pid, uid) = (j.pid, j.uid);
            if self.may_log(uid) {
                info!(
                    pid,
                    uid,
                    gpus = ?lease.gpus,
                    mem_cap = ?lease.mem_cap.map(format_size).unwrap_or_else(|| "-".into()),
                    mig = %mig.as_deref().unwrap_or("-"),
                    waited_s = %format!("{:.1}", waited as f64 / 1e9),
                    "lease placed"
                );
            }
        }
        self.saves.changed();
        self.rejoin(now, lease.id);
        self.ledger.jobs_mut().leased(lease.id, now, waited);
        self.ledger
            .jobs_mut()
            .hold_until_saved(lease.id, self.saves.seq());
    }

    /// `Leased` to the job's run.
    pub(super) fn tell_lease(&mut self, token: u64) {
        let Some((id, lease)) = self
            .ledger
            .lease_to_tell(token)
            .map(|(id, l)| (id, l.clone()))
        else {
            return;
        };
        let uuids: Vec<[u8; 16]> = lease
            .uuids
            .iter()
            .map(|u| {
                self.gpus
                    .iter()
                    .find(|g| &g.uuid_str == u)
                    .map(|g| g.uuid)
                    // A GPU in MIG mode is not among them.
                    .or_else(|| wire::parse_uuid(u))
                    .unwrap_or([0; 16])
            })
            .collect();
        let mig = lease.mig.as_ref().and_then(|a| a.uuid.clone());
        self.send(
            id,
            &ServerMsg::Leased(Lease {
                gpus: lease.gpus.clone(),
                uuids,
                mem_cap: lease.mem_cap.unwrap_or(0),
                token,
                mps_pipe: self.cfg.mps_pipe.clone().unwrap_or_default(),
                mig: mig.unwrap_or_default(),
            }),
        );
    }

    /// Tells each waiting run its place when it moved by a meaningful
    /// step (exact up to 10, within a tenth beyond): the queue says whose,
    /// so a departure costs one walk and a few messages, not one to every
    /// request behind it.
    pub(super) fn tell_positions(&mut self, now: Nanos) {
        for (id, token, position, waiting_for) in self.ledger.positions(now) {
            if self.conns.get(&id).and_then(|c| c.cli()).is_some() {
                self.send(
                    id,
                    &ServerMsg::Queued {
                        position,
                        waiting_for,
                        token,
                    },
                );
            }
        }
    }

    /// What the shell made of a MIG lease's steps.
    pub(super) fn mig_made(&mut self, now: Nanos, done: MigDone) {
        let making = self.ledger.made(done.lease);
        for &gi in &done.destroyed {
            self.ledger.queue_mut().mig_destroyed(done.gpu, gi);
            info!(
                gpu = done.gpu,
                gi, "destroyed an idle MIG instance to make room"
            );
        }
        let a = self
            .ledger
            .queue()
            .lease(done.lease)
            .and_then(|l| l.mig.clone());
        match done.result {
            Ok((gi, uuid)) => {
                let (profile, mem) = a
                    .as_ref()
                    .map_or((String::new(), 0), |a| (a.profile_name.clone(), a.mem));
                info!(gpu = done.gpu, gi, %profile, %uuid, "created a MIG instance");
                self.add_mig_unit((done.gpu, gi), &uuid, (&profile, mem));
                let lease = self.ledger.queue_mut().mig_created(done.lease, gi, uuid);
                match lease {
                    Some(_) if making.abandoned => self.ledger.queue_mut().release(now, done.lease),
                    Some(lease) => self.granted(now, lease),
                    None => {}
                }
            }
            Err((e, found)) => {
                let requeued =
                    self.ledger
                        .queue_mut()
                        .mig_failed(now, done.lease, found.as_deref());
                if let Some(a) = &a {
                    warn!(
                        gpu = a.gpu,
                        profile = %a.profile_name,
                        placement = %a.placement,
                        requeued,
                        "MIG: {e}; re-read the GPU's instances, and that placement is avoided for {} s",
                        mig::BLOCK_FOR / 1_000_000_000
                    );
                }
                if making.abandoned {
                    self.ledger.queue_mut().cancel(now, done.lease);
                } else if let Some(id) = making.no_wait {
                    // The job of a refused `--no-wait` never was (the
                    // queue holds nothing of it any more).
                    self.end_job(now, done.lease);
                    if let Some(c) = self.conns.get_mut(&id).and_then(|c| c.cli_mut()) {
                        c.job = None;
                    }
                    self.refuse_as(
                        id,
                        Refusal::NoRoom,
                        format!(
                            "no room now: the MIG instance could not be made ({e}); drop --no-wait to queue"
                        ),
                    );
                }
            }
        }
    }

    /// A MIG instance becomes a unit of arbitration (`Gpus::add_mig`),
    /// the entry of one gone that no process names reused.
    pub(super) fn add_mig_unit(&mut self, at: (u32, u32), uuid: &str, profile: (&str, u64)) {
        let live = self.ledger.live_mig_uuids();
        let conns = &self.conns;
        let in_use = |i| {
            conns
                .values()
                .any(|c| c.devices().iter().any(|d| d.gpu == i))
        };
        self.gpus.add_mig(at, uuid, profile, &live, in_use);
    }
}
