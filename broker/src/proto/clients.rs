//! Processes: the handshake, registration and the job each belongs to,
//! usage reports, and the compute arbitration their messages drive.

use gpufrac_common::wire::{self, ClientMsg, ServerMsg};
use tracing::{debug, info};

use super::conn::{ClientDev, Conn, Quoted, RoleState};
use super::roles;
use super::{Broker, ConnId, Nanos};
use crate::procs::ancestry;

/// Devices taken from one registration: far above any node's GPU count.
const MAX_DEVICES: usize = 64;

impl Broker {
    pub(super) fn handle(&mut self, now: Nanos, id: ConnId, msg: ClientMsg) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(role) = c.role() else {
            return self.hello(id, msg);
        };
        // A message outside the connection's role is a protocol error, as
        // one before Hello is: the client is told which role sends it,
        // and closed.
        let wrong = match &msg {
            ClientMsg::Hello { role: asked, .. } if *asked != role => {
                Some(roles::second_hello(*asked, role))
            }
            m => m
                .sender()
                .filter(|&r| r != role)
                .map(|r| roles::refusal(m, r, role)),
        };
        if let Some(message) = wrong {
            let (pid, uid) = (c.peer.pid, c.peer.uid);
            self.warn_uid(
                uid,
                format_args!("closing the connection of pid {pid} (uid {uid}): {message}"),
            );
            self.send(
                id,
                &ServerMsg::Error {
                    code: wire::ERR_BAD_FRAME,
                    message,
                },
            );
            return self.kill(id);
        }
        match msg {
            ClientMsg::Hello { .. } => {}
            ClientMsg::Ping => self.send(id, &ServerMsg::Pong),
            ClientMsg::Status { from } => self.ask_status(now, id, from),
            ClientMsg::Name { pod, label } => self.name(id, pod, label),
            ClientMsg::Summary { job } => self.summary(now, id, job),
            ClientMsg::Lease(ask) => self.lease(now, id, ask),
            m => self.shim_message(now, id, m),
        }
    }

    /// The first message: `Hello` fixes the connection's role; anything
    /// else, or a version in common with none, closes it.
    fn hello(&mut self, id: ConnId, msg: ClientMsg) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let (reply, refused) = match msg {
            ClientMsg::Hello {
                magic,
                version,
                role,
                max_version,
                ..
            } => {
                let reply = wire::hello_reply(magic, version, max_version);
                let ok = matches!(reply, ServerMsg::HelloOk { .. });
                if ok {
                    c.role = RoleState::new(role);
                } else {
                    let (pid, uid) = (c.peer.pid, c.peer.uid);
                    if self.may_log(uid) {
                        tracing::warn!(
                            pid,
                            uid,
                            version,
                            "refusing client with another protocol version"
                        );
                    }
                }
                (reply, !ok)
            }
            _ => (
                ServerMsg::Error {
                    code: wire::ERR_BAD_FRAME,
                    message: "expected Hello first".into(),
                },
                true,
            ),
        };
        // Said even to a connection that is then closed.
        self.send(id, &reply);
        if refused {
            self.kill(id);
        }
    }

    /// A message of a shim's (checked by `handle`).
    fn shim_message(&mut self, now: Nanos, id: ConnId, msg: ClientMsg) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let pid = c.peer.pid;
        let Some(s) = c.shim_mut() else {
            return;
        };
        match msg {
            ClientMsg::Register {
                command,
                devices,
                share,
                limit,
                priority,
            } => self.register(now, id, command, devices, share, limit, priority),
            ClientMsg::Usage {
                uuid,
                used,
                peak,
                ooms,
            } => {
                let gpus = &self.gpus;
                let member_of = s.member_of;
                if let Some(d) = s.devices.iter_mut().find(|d| gpus[d.gpu].uuid == uuid) {
                    // Reports are the client's word: never more than the
                    // GPU holds (a claim of 4 EiB used would skew status
                    // and every sum made from it).
                    let total = gpus[d.gpu].total_mem;
                    let cap = if total > 0 { total } else { u64::MAX };
                    let before = d.used;
                    d.used = used.min(cap);
                    d.peak = peak.min(cap).max(d.used);
                    d.ooms = ooms;
                    if let Some(t) = member_of {
                        let (after, peak) = (d.used, d.peak);
                        self.ledger.jobs_mut().used(t, before, after, peak);
                    }
                }
            }
            ClientMsg::Acquire { uuid } => {
                debug!(pid, "acquire");
                let class = s.priority;
                let Some(g) = self.device_of(id, &uuid) else {
                    return;
                };
                self.stats.acquired(now, id, g, class);
                if self.cfg.mps_pipe.is_none() {
                    return self.gpus[g].sched.acquire(now, id);
                }
                self.stats.granted(now, id, g);
                // MPS runs every client's kernels side by side: nothing to
                // take turns at. The grant is open-ended and never revoked.
                self.send(
                    id,
                    &ServerMsg::Grant {
                        uuid,
                        grant: 1,
                        slice_ns: 0,
                        bound_ns: 0,
                        waiters: false,
                    },
                );
            }
            ClientMsg::Release { uuid, held_ns } => {
                debug!(pid, held_us = held_ns / 1000, "release");
                if let Some(g) = self.device_of(id, &uuid) {
                    self.stats.released(id, g);
                    self.gpus[g].sched.release(now, id);
                }
            }
            ClientMsg::Drained { uuid } => {
                debug!(pid, "drained");
                if let Some(g) = self.device_of(id, &uuid) {
                    self.gpus[g].sched.drained(now, id);
                }
            }
            ClientMsg::Join { job } => {
                // Settled at Register; a token no job holds is ignored
                // there (the process is its user's), not refused: a
                // container can outlive its run.
                if let Some(old) = s.claimed_job.replace(job) {
                    self.ledger.unclaim_token(old, id);
                }
                self.ledger.claim_token(job, id);
            }
            _ => {}
        }
    }

    /// The GPU (position in `gpus`) a process registered with this UUID.
    fn device_of(&self, id: ConnId, uuid: &[u8; 16]) -> Option<usize> {
        self.conns
            .get(&id)?
            .devices()
            .iter()
            .find(|d| &self.gpus[d.gpu].uuid == uuid)
            .map(|d| d.gpu)
    }

    #[allow(clippy::too_many_arguments)]
    fn register(
        &mut self,
        now: Nanos,
        id: ConnId,
        command: String,
        devices: Vec<wire::DeviceReg>,
        share: Option<f64>,
        limit: Option<f64>,
        priority: crate::sched::Priority,
    ) {
        // A weight is a percentage: (0, 100]. Anything larger would let one
        // client declare itself the whole GPU (1e300 once left a neighbour
        // 52 kernels in 2924).
        let share = share
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| s.min(100.0));
        let limit = limit
            .filter(|l| l.is_finite() && *l > 0.0)
            .map(|l| (l / 100.0).min(1.0));
        if let Err(message) = self.may_name(id, &devices) {
            let Some(c) = self.conns.get(&id) else {
                return;
            };
            let (pid, uid) = (c.peer.pid, c.peer.uid);
            self.warn_uid(
                uid,
                format_args!("refusing a registration from pid {pid} (uid {uid}): {message}"),
            );
            self.stats.refused(uid, crate::stats::Refusal::UnknownGpu);
            self.send(
                id,
                &ServerMsg::Error {
                    code: wire::ERR_REFUSED,
                    message,
                },
            );
            self.kill(id);
            return;
        }
        // The command is the process's own word, as its argv is (a process
        // writes its /proc/PID/cmdline as it likes): the broker reads
        // nothing for it. Reading /proc/PID/cmdline reads the process's
        // memory, which a hostile process can make block for as long as it
        // likes (a FUSE-backed mapping over its argv, CVE-2018-1120), and
        // cost the loop 75 ms per registration for a 2 MiB argv. What the
        // broker decides by (uid, pid, job) is its own view.
        let label = self.cfg.budgets.label;
        let command = self.clip(&command, label);
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let priority = self.cfg.policy.priority(&c.peer, priority);
        let (job, looked_at) = self.job_of(c);
        self.serving.charge().proc_reads += looked_at as u64;
        let c = self.conns.get_mut(&id).expect("looked up above");
        c.command = command;
        let uid = c.peer.uid;
        let Some(s) = c.shim_mut() else {
            return;
        };
        s.share = share;
        s.limit = limit;
        s.priority = priority;
        let old = std::mem::replace(&mut s.member_of, job);
        let old_used: u64 = s.devices.iter().map(|d| d.used).sum();
        let old_devs: Vec<usize> = s.devices.drain(..).map(|d| d.gpu).collect();
        if old != job {
            if let Some(o) = old {
                self.ledger
                    .jobs_mut()
                    .leave(o, id, super::jobtable::Spent::default(), old_used);
            }
            if let Some(n) = job {
                self.ledger.jobs_mut().join(n, id, 0);
            }
        } else if let Some(t) = job {
            // Registered again: its devices start from nothing.
            self.ledger.jobs_mut().used(t, old_used, 0, 0);
        }
        for g in old_devs {
            self.gpus[g].sched.remove_client(now, id);
            self.gpus.unname(g, uid);
        }
        let mut devs: Vec<ClientDev> = Vec::new();
        for d in devices.iter().take(MAX_DEVICES) {
            let g = self.gpus.by_uuid(&d.uuid, d.mem_total);
            if devs.iter().any(|x| x.gpu == g) {
                continue;
            }
            self.gpus.name(g, uid);
            // Put in the GPU's scheduler by `enforce` below, with its
            // unit's settings.
            devs.push(ClientDev {
                gpu: g,
                ordinal: d.ordinal,
                cap: d.mem_cap,
                used: 0,
                peak: 0,
                ooms: 0,
            });
        }
        let j = job.and_then(|t| self.ledger.jobs().get(&t));
        let mem_cap = j.and_then(|j| j.mem_cap).unwrap_or(0);
        let job_pid = j.map(|j| j.pid);
        lower_caps(&mut devs, mem_cap);
        let log = self.may_log(uid);
        let c = self.conns.get_mut(&id).expect("looked up above");
        // A job is named by its run's pid: the token is a secret. The
        // command is escaped (`clip`) and quoted: it can forge neither a
        // line nor a field.
        if log {
            info!(pid = c.peer.pid, uid = c.peer.uid, command = %Quoted(&c.command), devices = devs.len(), ?share, ?limit, %priority, job = ?job_pid, "registered");
        }
        if let Some(s) = c.shim_mut() {
            s.devices = devs;
            s.registered = true;
        }
        self.send(id, &ServerMsg::Registered { mem_cap });
        self.enforce(now, id);
    }

    /// The job a process belongs to: the nearest `gpufrac run` among its
    /// ancestors, by pid and mark (run is a subreaper, so a
    /// daemonised child stays below it; a pid reused by another process
    /// is not the run), whatever its environment says; else the job whose
    /// token it holds, if the rules let it join by token.
    /// Also says how many processes' /proc entries it read (at most 64:
    /// `ancestry`), each looked up among the jobs by its pid and start
    /// time at once.
    fn job_of(&self, c: &Conn) -> (Option<u64>, usize) {
        let chain = ancestry(self.world.procs(), c.peer.pid);
        let looked_at = chain.len();
        // The pid's ancestry is the connection's only while the pid still
        // names the process accepted: after it died, the pid (and so the
        // ancestry) may be a victim's, whose job this is not.
        let same = c.peer.ident.is_some() && chain.first().map(|&(_, s)| s) == Some(c.peer.ident);
        let by_ancestry = chain
            .into_iter()
            .filter(|_| same)
            .find_map(|(p, start)| self.ledger.jobs().run_by(p, start?));
        // The token is random and only in the job's environment, so
        // holding it is the proof; the rules say whose processes may use
        // it (a leaked token does not hand another user's job to anyone).
        let job = by_ancestry.or_else(|| {
            c.shim().and_then(|s| s.claimed_job).filter(|t| {
                self.ledger
                    .jobs()
                    .get(t)
                    .is_some_and(|j| self.cfg.policy.may_join(&c.peer, j))
            })
        });
        (job, looked_at)
    }

    /// Whether `id`'s process may name these GPUs (`Gpus::may_name`);
    /// else why not.
    fn may_name(&self, id: ConnId, devices: &[wire::DeviceReg]) -> Result<(), String> {
        let Some(c) = self.conns.get(&id) else {
            return Ok(());
        };
        let mine: Vec<usize> = c.devices().iter().map(|d| d.gpu).collect();
        let mut asked: Vec<[u8; 16]> = Vec::new();
        for d in devices.iter().take(MAX_DEVICES) {
            if !asked.contains(&d.uuid) {
                asked.push(d.uuid);
            }
        }
        self.gpus.may_name(c.peer.uid, &mine, &asked)
    }

    /// A closed connection: its process leaves every scheduler, and a
    /// run's job ends.
    pub(super) fn forget_client(&mut self, now: Nanos, id: ConnId, c: Conn) {
        for d in c.devices() {
            self.gpus[d.gpu].sched.remove_client(now, id);
            self.gpus.unname(d.gpu, c.peer.uid);
        }
        if let Some(t) = c.shim().and_then(|s| s.claimed_job) {
            self.ledger.unclaim_token(t, id);
        }
        if let Some(t) = c.job()
            && self.ledger.jobs().run(&t) == Some(id)
        {
            self.end_job(now, t);
        }
        if (!c.devices().is_empty() || c.job().is_some()) && self.may_log(c.peer.uid) {
            info!(pid = c.peer.pid, uid = c.peer.uid, command = %Quoted(&c.command), "client gone");
        }
    }
}

/// A job's memory cap (0: none) over a process's own on each device: the
/// lower of the two holds, as the shim applies it on `Registered`.
pub(super) fn lower_caps(devs: &mut [ClientDev], mem_cap: u64) {
    for d in devs.iter_mut() {
        if mem_cap > 0 && (d.cap == 0 || d.cap > mem_cap) {
            d.cap = mem_cap;
        }
    }
}
