//! Who may do what: the broker's one rule set. It runs as root for every
//! user of a node, and every message comes from a local user who may be
//! hostile; each rule is checked here, against the peer's credentials as
//! the kernel gives them (`SO_PEERCRED`, `SO_PEERGROUPS`), never against
//! what a message says about its sender.
//!
//! - Any user registers their own processes, asks for leases for
//!   themselves and reads status.
//! - Pinned leases and client-chosen tokens (the Kubernetes device
//!   plugin's messages, which book GPUs the kubelet already chose, ahead of
//!   the queue) only from root or a configured plugin user or group.
//! - `high` from anyone, or only from an allow-list; either way the class
//!   is bounded by its share of each window (the scheduler's rule).
//! - A process joins a job by ancestry (the job's `gpufrac run`, pid and
//!   mark, `ident.rs`) or by holding its token; by token only if it runs as the
//!   job's user or as root, or the job is a pod's, booked by the plugin
//!   (a pod's processes run as whatever user the pod says).
//! - Only the process that made a job reclaims it after a broker restart
//!   (same pid, same mark).
//!
//! Budgets (how much of the broker one user may hold) are in
//! `proto::conn` (`Budgets`); the files the broker trusts in `statefile`.

use crate::jobs::Job;
use gpufrac_common::config::Priority;

/// A connected process as the kernel describes it, fixed when the
/// connection is accepted: every later decision about the connection
/// uses this, never a fresh look at the pid (which another process may
/// hold by then).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, read only where something names a group
    /// (`Broker::reads_groups`): empty otherwise.
    pub groups: Vec<u32>,
    /// The process's mark (`ident.rs`: its pidfs inode, else its start
    /// time), taken at accept while a pidfd held the process: with the
    /// pid it names this process
    /// and no later holder of the pid. None: unknown (then nothing that
    /// needs to know which process it is, a lease or a job's membership,
    /// is granted).
    pub ident: Option<u64>,
}

/// Users and groups named by an option.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allow {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl Allow {
    pub fn admits(&self, p: &Peer) -> bool {
        self.uids.contains(&p.uid)
            || self.gids.contains(&p.gid)
            || p.groups.iter().any(|g| self.gids.contains(g))
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Besides root, who may send the device plugin's messages
    /// (`--plugin-user`, `--plugin-group`).
    pub plugin: Allow,
    /// Who may ask for `high` (`--high-allow`); None: everyone.
    pub high: Option<Allow>,
}

impl Policy {
    /// Whether it names a group (then a peer's supplementary groups are
    /// read at accept).
    pub fn names_groups(&self) -> bool {
        !self.plugin.gids.is_empty() || self.high.as_ref().is_some_and(|a| !a.gids.is_empty())
    }

    /// Root, or the device plugin's user or group.
    pub fn privileged(&self, p: &Peer) -> bool {
        p.uid == 0 || self.plugin.admits(p)
    }

    pub fn may_use_high(&self, p: &Peer) -> bool {
        p.uid == 0 || self.high.as_ref().is_none_or(|a| a.admits(p))
    }

    /// The class a process gets when it asks for `asked`: `high` becomes
    /// `normal` for a user the allow-list leaves out.
    pub fn priority(&self, p: &Peer, asked: Priority) -> Priority {
        if asked == Priority::High && !self.may_use_high(p) {
            Priority::Normal
        } else {
            asked
        }
    }

    /// Whether `p` may send this lease request; if not, why, in words the
    /// user can act on.
    pub fn lease(
        &self,
        p: &Peer,
        pinned: bool,
        chosen_token: bool,
        priority: Option<Priority>,
    ) -> Result<(), String> {
        if (pinned || chosen_token) && !self.privileged(p) {
            let what = if pinned {
                "a lease pinned to GPUs"
            } else {
                "a lease under a token of the client's choosing"
            };
            return Err(format!(
                "{what} is the Kubernetes device plugin's request, which only root or the broker's \
                 --plugin-user/--plugin-group may send (uid {} is neither); ask with \
                 gpufrac run --gpus N or --gpu-memory SIZE instead",
                p.uid
            ));
        }
        if priority == Some(Priority::High) && !self.may_use_high(p) {
            return Err(format!(
                "--priority high is allowed on this node only to the users and groups of the \
                 broker's --high-allow (uid {} is not among them); ask without it, or with \
                 --priority normal",
                p.uid
            ));
        }
        Ok(())
    }

    /// Whether `p`, holding `job`'s token, may count in that job.
    pub fn may_join(&self, p: &Peer, job: &Job) -> bool {
        job.plugin || p.uid == job.uid || p.uid == 0
    }

    /// Whether `p` may take `job` back after a broker restart: it is the
    /// very process that made it (`p`'s pid and mark, fixed at
    /// accept). A process that changed its user since (setuid) is not the
    /// job's any more.
    pub fn may_resume(&self, p: &Peer, job: &Job) -> bool {
        job.pid == p.pid && p.ident == Some(job.ident) && p.uid == job.uid
    }

    /// Whether `p` may, during a recovery, claim a lease the trusted state
    /// does not have (a token nothing can verify, on GPUs it names itself):
    /// that is a pinned lease under a token of the client's choosing, so
    /// the same rule as for those holds.
    pub fn claim_unverified(&self, p: &Peer) -> Result<(), String> {
        if self.privileged(p) {
            return Ok(());
        }
        Err(format!(
            "the broker is recovering and its trusted state has no such lease; a claim it cannot \
             verify is accepted only from root or the broker's --plugin-user/--plugin-group \
             (uid {} is neither); the command carries on unbooked, and a new gpufrac run queues anew",
            p.uid
        ))
    }

    /// Root and the plugin hold leases for others (one per pod): the
    /// per-user counts of leases and queued requests do not bound them.
    pub fn counted(&self, p: &Peer) -> bool {
        !self.privileged(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> Peer {
        Peer {
            pid: 100,
            uid,
            gid,
            groups: groups.to_vec(),
            ident: Some(5),
        }
    }

    fn job(uid: u32, plugin: bool) -> Job {
        Job {
            pid: 100,
            ident: 5,
            uid,
            plugin,
            ..crate::jobs::sample(7)
        }
    }

    #[test]
    fn pins_and_chosen_tokens_only_from_root_or_the_plugin() {
        let p = Policy {
            plugin: Allow {
                uids: vec![990],
                gids: vec![991],
            },
            high: None,
        };
        for ok in [
            peer(0, 0, &[]),
            peer(990, 5, &[]),
            peer(5, 991, &[]),
            peer(5, 5, &[991]),
        ] {
            assert!(p.lease(&ok, true, true, None).is_ok(), "{ok:?}");
        }
        let user = peer(1000, 1000, &[27]);
        let e = p.lease(&user, true, false, None).unwrap_err();
        assert!(e.contains("pinned") && e.contains("uid 1000"), "{e}");
        let e = p.lease(&user, false, true, None).unwrap_err();
        assert!(e.contains("token"), "{e}");
        assert!(p.lease(&user, false, false, Some(Priority::High)).is_ok());
        assert!(Policy::default().lease(&user, true, true, None).is_err());
        // The group is only seen where the groups are read.
        assert!(p.names_groups());
    }

    /// Supplementary groups are read at accept only where a rule names a
    /// group: a policy of users alone does not need them.
    #[test]
    fn a_policy_names_groups_only_through_a_gid() {
        let users = Allow {
            uids: vec![990],
            gids: Vec::new(),
        };
        let group = Allow {
            uids: Vec::new(),
            gids: vec![27],
        };
        assert!(!Policy::default().names_groups());
        let of = |plugin: &Allow, high: Option<&Allow>| Policy {
            plugin: plugin.clone(),
            high: high.cloned(),
        };
        assert!(!of(&users, Some(&users)).names_groups());
        assert!(of(&group, None).names_groups());
        assert!(of(&users, Some(&group)).names_groups());
    }

    #[test]
    fn high_from_everyone_or_an_allow_list() {
        let user = peer(1000, 1000, &[27]);
        assert_eq!(
            Policy::default().priority(&user, Priority::High),
            Priority::High
        );
        let p = Policy {
            plugin: Allow::default(),
            high: Some(Allow {
                uids: vec![1001],
                gids: vec![27],
            }),
        };
        assert_eq!(p.priority(&user, Priority::High), Priority::High);
        let other = peer(1002, 1002, &[]);
        assert_eq!(p.priority(&other, Priority::High), Priority::Normal);
        assert_eq!(p.priority(&other, Priority::Low), Priority::Low);
        let e = p
            .lease(&other, false, false, Some(Priority::High))
            .unwrap_err();
        assert!(e.contains("--high-allow"), "{e}");
        assert_eq!(p.priority(&peer(0, 0, &[]), Priority::High), Priority::High);
    }

    #[test]
    fn tokens_join_a_users_job_only_for_that_user_or_root() {
        let p = Policy::default();
        let alice = job(1000, false);
        assert!(p.may_join(&peer(1000, 1000, &[]), &alice));
        assert!(p.may_join(&peer(0, 0, &[]), &alice));
        assert!(!p.may_join(&peer(1001, 1000, &[1000]), &alice));
        let pod = job(0, true);
        assert!(p.may_join(&peer(1001, 1001, &[]), &pod));
        // Root's own job (gpufrac run as root) is not a pod's.
        assert!(!p.may_join(&peer(1001, 1001, &[]), &job(0, false)));
    }

    #[test]
    fn only_the_same_process_resumes() {
        let p = Policy::default();
        let j = job(1000, false);
        assert!(p.may_resume(&peer(1000, 1000, &[]), &j));
        // The same pid, reused by another process.
        let reused = Peer {
            ident: Some(6),
            ..peer(1000, 1000, &[])
        };
        assert!(!p.may_resume(&reused, &j));
        let unknown = Peer {
            ident: None,
            ..peer(1000, 1000, &[])
        };
        assert!(!p.may_resume(&unknown, &j));
        let mut other = peer(1000, 1000, &[]);
        other.pid = 101;
        assert!(!p.may_resume(&other, &j));
    }
}
