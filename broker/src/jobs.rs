//! Jobs: each `gpufrac run` is a unit of fairness (its processes split one
//! share) and holds its lease or its place in the queue. Jobs are written to
//! a small state file after every change, so a broker that crashes and
//! restarts books the same GPUs before it admits anyone new, and each `run`
//! can reconnect and claim its lease or its place back.
//!
//! Everything here is plain data and file I/O; the socket layer decides.

use crate::queue::{Pinned, Request, Want};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use gpufrac_common::config::Priority;

/// Format of the state file; a broker refuses (and keeps aside) a file of
/// another version rather than misreading it.
const STATE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Phase {
    /// In the queue since this monotonic instant (ns, `CLOCK_MONOTONIC`,
    /// which a broker restart does not reset).
    Queued { since: u64 },
    /// Holding GPUs (by index); under `--mig dynamic`, perhaps a MIG
    /// instance of its one GPU, by MIG device UUID.
    Running {
        gpus: Vec<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig: Option<String>,
    },
    /// A job without placement (`run --gpu-compute` alone): a unit of
    /// fairness and enforced settings, no GPUs booked.
    Unplaced,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// Names the job on the wire (`Lease.resume`); random, so that one
    /// process cannot guess another's.
    pub token: u64,
    /// The `gpufrac run` process, and its start time (clock ticks after
    /// boot, from /proc), which tells a live run from a reused pid.
    pub pid: u32,
    pub start_time: u64,
    pub uid: u32,
    pub want: Option<Want>,
    pub compute: Option<f64>,
    /// A fraction in (0, 1].
    pub limit: Option<f64>,
    #[serde(with = "opt_priority")]
    pub priority: Option<Priority>,
    pub label: String,
    pub mem_cap: Option<u64>,
    pub phase: Phase,
    /// The GPUs and memory the request was pinned to (a pod's, chosen by
    /// the kubelet); empty for `gpufrac run`'s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pin: Vec<Pinned>,
    /// The pod the job is (`namespace/name`), from the device plugin's
    /// `Name`: status shows it in place of the asking pid, which is the
    /// plugin's for every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

impl Job {
    pub fn request(&self) -> Option<Request> {
        Some(Request {
            want: self.want?,
            compute: self.compute,
            limit: self.limit,
            label: self.label.clone(),
            job: self.pid,
            pin: self.pin.clone(),
            pod: self.pod.clone(),
        })
    }

    /// The `run` process is still the one that asked.
    pub fn alive(&self) -> bool {
        proc_start_time(self.pid) == Some(self.start_time)
    }
}

/// Priorities by name, as users spell them.
mod opt_priority {
    use super::Priority;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(p: &Option<Priority>, s: S) -> Result<S::Ok, S::Error> {
        match p {
            Some(p) => s.serialize_some(p.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Priority>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|n| {
                Priority::parse(&n)
                    .ok_or_else(|| serde::de::Error::custom(format!("unknown priority {n}")))
            })
            .transpose()
    }
}

#[derive(Serialize, Deserialize)]
struct Saved {
    version: u32,
    jobs: Vec<Job>,
}

/// The state file next to the socket (or where `--state` says).
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    pub fn new(path: PathBuf) -> Self {
        StateFile { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The jobs a previous broker left, or none. A file that cannot be read
    /// is moved aside (never deleted) with a warning returned.
    pub fn load(&self) -> (Vec<Job>, Option<String>) {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (Vec::new(), None),
            Err(e) => {
                return (
                    Vec::new(),
                    Some(format!("cannot read {}: {e}", self.path.display())),
                );
            }
        };
        match serde_json::from_str::<Saved>(&text) {
            Ok(s) if s.version == STATE_VERSION => (s.jobs, None),
            Ok(s) => (
                Vec::new(),
                Some(self.set_aside(&format!("version {}", s.version))),
            ),
            Err(e) => (Vec::new(), Some(self.set_aside(&e.to_string()))),
        }
    }

    fn set_aside(&self, why: &str) -> String {
        format!(
            "state file {}; starting without saved leases",
            gpufrac_common::files::set_aside(&self.path, why)
        )
    }

    /// Writes all jobs atomically: a crash mid-write leaves the previous
    /// file whole.
    pub fn save<'a>(&self, jobs: impl Iterator<Item = &'a Job>) -> std::io::Result<()> {
        let saved = Saved {
            version: STATE_VERSION,
            jobs: jobs.cloned().collect(),
        };
        let text = serde_json::to_vec(&saved).map_err(std::io::Error::other)?;
        gpufrac_common::files::write_private(&self.path, &text, true)
    }

    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub use gpufrac_common::procfs::{parent as proc_parent, start_time as proc_start_time};

/// `pid` and its ancestors, nearest first (at most 64: a deeper tree is
/// not a job's).
pub fn ancestry(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut p = pid;
    while p > 1 && out.len() < 64 {
        out.push(p);
        match proc_parent(p) {
            Some(pp) if pp != p => p = pp,
            _ => break,
        }
    }
    out
}

pub use gpufrac_common::wire::random_token as new_token;

#[cfg(test)]
mod tests {
    use super::*;

    fn job(token: u64) -> Job {
        Job {
            token,
            pid: std::process::id(),
            start_time: proc_start_time(std::process::id()).unwrap(),
            uid: 0,
            want: Some(Want::Gpus(1)),
            compute: Some(30.0),
            limit: None,
            priority: Some(Priority::Low),
            label: "train.py".into(),
            mem_cap: None,
            phase: Phase::Running {
                gpus: vec![0],
                mig: None,
            },
            pin: Vec::new(),
            pod: None,
        }
    }

    #[test]
    fn state_round_trips_and_bad_files_are_kept_aside() {
        let dir = std::env::temp_dir().join(format!("gpufrac-jobs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = StateFile::new(dir.join("state.json"));
        assert_eq!(f.load().0, vec![]);
        let jobs = vec![job(1), job(2)];
        f.save(jobs.iter()).unwrap();
        let (back, warn) = f.load();
        assert_eq!((back, warn), (jobs, None));
        assert!(back_alive(&f));
        std::fs::write(f.path(), b"{ not json").unwrap();
        let (back, warn) = f.load();
        assert!(back.is_empty());
        assert!(warn.unwrap().contains("unusable"));
        assert!(dir.join("state.unreadable").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn back_alive(f: &StateFile) -> bool {
        f.load().0.iter().all(Job::alive)
    }

    #[test]
    fn proc_helpers() {
        let me = std::process::id();
        assert!(proc_start_time(me).is_some());
        let chain = ancestry(me);
        assert_eq!(chain[0], me);
        assert_eq!(chain.get(1).copied(), proc_parent(me));
        assert_eq!(proc_start_time(u32::MAX), None);
        assert_ne!(new_token(), new_token());
    }
}
