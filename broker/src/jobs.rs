//! Jobs: each `gpufrac run` is a unit of fairness (its processes split one
//! share) and holds its lease or its place in the queue. Jobs are written to
//! a small state file (`statefile.rs`), so a broker that crashes and
//! restarts books the same GPUs before it admits anyone new, and each `run`
//! can reconnect and claim its lease or its place back.
//!
//! Plain data and its encoding; the broker core decides, the state file
//! keeps.

use crate::ident;
use crate::queue::{Pinned, Request, Want};
use serde::{Deserialize, Serialize};

pub use gpufrac_common::config::Priority;

/// Format of the state file; a broker refuses (and keeps aside) a file of
/// another version rather than misreading it. Version 2 says what its
/// jobs' marks are (`idents`); version 1 held start times, and is read.
const STATE_VERSION: u32 = 2;

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
    /// The `gpufrac run` process, and its mark (`ident.rs`: its pidfs
    /// inode, else its start time), which tells a live run from a reused
    /// pid. Version 1 of the file called it `start_time` (and held start
    /// times only).
    pub pid: u32,
    #[serde(alias = "start_time")]
    pub ident: u64,
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
    /// Booked by the device plugin (root or its --plugin-user) under a
    /// token of its choosing, for a pod: any process holding the token
    /// joins it, since a pod's processes run as whatever user the pod
    /// says. Any other job takes by token only its user's processes, and
    /// root's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plugin: bool,
}

impl Job {
    pub fn request(&self) -> Option<Request> {
        Some(Request {
            want: self.want?,
            compute: self.compute,
            limit: self.limit,
            label: self.label.clone(),
            job: self.pid,
            uid: self.uid,
            pin: self.pin.clone(),
            pod: self.pod.clone(),
        })
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

#[derive(Deserialize)]
struct Saved {
    version: u32,
    /// What the jobs' marks are (version 2).
    idents: Option<ident::Kind>,
    jobs: Vec<Job>,
}

/// The state file's bytes for these jobs, whose marks are this host's.
pub fn encode<'a>(jobs: impl Iterator<Item = &'a Job>) -> Vec<u8> {
    let each: Vec<Vec<u8>> = jobs.map(encode_job).collect();
    assemble(each.iter().map(Vec::as_slice))
}

/// One job's bytes in the state file (`Jobs` keeps them until the job
/// changes: a deep queue was encoded whole ten times a second).
pub fn encode_job(job: &Job) -> Vec<u8> {
    serde_json::to_vec(job).unwrap_or_default()
}

/// The state file's bytes from its jobs' (`Saved`'s shape, as serde
/// writes it), whose marks are this host's.
pub fn assemble<'a>(jobs: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
    let idents = serde_json::to_string(&ident::kind()).unwrap_or_default();
    let mut out =
        format!("{{\"version\":{STATE_VERSION},\"idents\":{idents},\"jobs\":[").into_bytes();
    for (i, j) in jobs.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(j);
    }
    out.extend_from_slice(b"]}");
    out
}

/// The jobs in a state file's bytes and what their marks are (a version 1
/// file's are start times), or why they cannot be used.
pub fn decode(bytes: &[u8]) -> Result<(Vec<Job>, ident::Kind), String> {
    let s = serde_json::from_slice::<Saved>(bytes).map_err(|e| e.to_string())?;
    match (s.version, s.idents) {
        (1, _) => Ok((s.jobs, ident::Kind::StartTime)),
        (STATE_VERSION, Some(k)) => Ok((s.jobs, k)),
        (STATE_VERSION, None) => Err("version 2 without `idents`".into()),
        (v, _) => Err(format!(
            "version {v} (this broker reads versions 1 and {STATE_VERSION})"
        )),
    }
}

/// The broker's job tokens: ChaCha12 (`StdRng`) seeded once from the
/// kernel's random source, so that a job's arrival costs no system call;
/// as unguessable as the kernel's own (a token is a job's secret).
pub fn token_source() -> Box<dyn FnMut() -> u64> {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::from_os_rng();
    Box::new(move || rng.next_u64())
}

/// A job for tests: a running lease of one GPU, alice's, to vary with
/// `..sample(token)`.
#[cfg(test)]
pub(crate) fn sample(token: u64) -> Job {
    Job {
        token,
        pid: 4242,
        ident: 99,
        uid: 1000,
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
        plugin: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(token: u64) -> Job {
        sample(token)
    }

    #[test]
    fn jobs_round_trip_and_bad_bytes_say_why() {
        let jobs = vec![job(1), job(2)];
        assert_eq!(
            decode(&encode(jobs.iter())).unwrap(),
            (jobs.clone(), ident::kind())
        );
        let text = String::from_utf8(encode(jobs.iter())).unwrap();
        // Cut anywhere, the file is refused, never half read.
        for cut in [1, text.len() / 2, text.len() - 1] {
            assert!(decode(&text.as_bytes()[..cut]).is_err(), "cut at {cut}");
        }
        let other = text.replace("\"version\":2", "\"version\":9");
        assert!(decode(other.as_bytes()).unwrap_err().contains("version 9"));
        let kind = format!(
            "\"idents\":{},",
            serde_json::to_string(&ident::kind()).unwrap()
        );
        let unsaid = text.replace(&kind, "");
        assert!(
            decode(unsaid.as_bytes())
                .unwrap_err()
                .contains("without `idents`")
        );
        let mut tokens = token_source();
        assert_ne!(tokens(), tokens());
        let mut again = token_source();
        assert_ne!(again(), token_source()(), "each source its own seed");
    }
}
