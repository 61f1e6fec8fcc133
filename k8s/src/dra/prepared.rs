//! The claims prepared on this node, and what each holds: its CDI spec, its
//! memory books (one cap for all its containers), and its lease in the
//! broker, pinned to its GPUs with the memory and compute the scheduler
//! booked, under the token its containers carry. Kept in a checkpoint, so
//! that a restarted plugin still knows them: it books their leases again
//! under the same tokens (their running processes count in them again),
//! writes back a spec that went missing, and unprepares them when the
//! kubelet says.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gpufrac_common::jobledger::JobLedger;
use gpufrac_common::wire;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::cdi::{self, ClaimEdits, Edits};
use super::claims::{ClaimRef, Grant, ResultRef};
use crate::holder::{self, Lease, LeaseName, describe_pins};
use crate::leases::token_text;

/// Format of the checkpoint; another version is set aside, not misread.
const STATE_VERSION: u32 = 1;
/// The largest checkpoint read back: far more claims than a node has.
const MAX_STATE: u64 = 16 << 20;
/// The longest lease label sent to the broker (it bounds labels too).
const MAX_LABEL: usize = 200;

/// Where things go.
#[derive(Clone, Debug)]
pub struct Settings {
    pub driver: String,
    pub cdi_dir: PathBuf,
    /// The checkpoint.
    pub state_file: PathBuf,
    /// The claims' memory books, one file each (root's, mode 0700).
    pub books_dir: PathBuf,
    /// The broker's socket.
    pub socket: PathBuf,
    pub edits: Edits,
}

/// A prepared claim, as the checkpoint keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Saved {
    pub claim: ClaimRef,
    pub grant: Grant,
    /// 16 hex digits, as `GPUFRAC_JOB` carries it; empty for admin access.
    pub token: String,
    /// The N of each GPU's /dev/nvidiaN, in the grant's order.
    pub nodes: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct Checkpoint {
    version: u32,
    claims: Vec<Saved>,
}

/// What the kubelet is told for a prepared claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub results: Vec<ResultRef>,
    pub cdi_ids: Vec<String>,
}

struct Entry {
    saved: Saved,
    /// Holds the lease while it runs, and the name it gives it (the holder
    /// takes a closed channel for its end); None for admin access.
    task: Option<(JoinHandle<()>, watch::Sender<Option<LeaseName>>)>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        // The task owns the connection: the broker ends the lease when it
        // closes.
        if let Some((t, _)) = &self.task {
            t.abort();
        }
    }
}

pub struct Prepared {
    s: Settings,
    entries: BTreeMap<String, Entry>,
}

impl Saved {
    fn token(&self) -> Option<u64> {
        u64::from_str_radix(&self.token, 16)
            .ok()
            .filter(|&t| t != 0)
    }

    fn books(&self, dir: &Path) -> Option<PathBuf> {
        (!self.grant.admin).then(|| dir.join(&self.claim.uid))
    }

    fn spec(&self, s: &Settings, books: Option<&Path>) -> Result<serde_json::Value, String> {
        let admin = self.grant.admin;
        let c = ClaimEdits {
            uid: &self.claim.uid,
            gpus: self
                .grant
                .gpus
                .iter()
                .zip(&self.nodes)
                .map(|(g, n)| (g.uuid.as_str(), *n, (!admin).then_some(g.mem)))
                .collect(),
            share: self.grant.share(),
            token: self.token(),
            books,
        };
        cdi::spec(&s.driver, &s.edits, &c)
    }

    fn answer(&self, driver: &str) -> Answer {
        Answer {
            results: self.grant.results.clone(),
            cdi_ids: vec![cdi::device_id(driver, &self.claim.uid)],
        }
    }

    /// "claim ml/infer (4.00 GiB on GPU-…)", for the log.
    fn describe(&self) -> String {
        let pins: Vec<(String, u64)> = self
            .grant
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.mem))
            .collect();
        format!("claim {} ({})", self.claim.path(), describe_pins(&pins))
    }

    /// The lease's name in the broker's status: the claim's first pod, and
    /// the claim.
    fn lease_name(&self) -> LeaseName {
        let mut label = format!("claim {}", self.claim.name);
        if self.grant.pods.len() > 1 {
            label.push_str(&format!(" (pods {})", self.grant.pods.join(", ")));
        }
        if label.len() > MAX_LABEL {
            let mut cut = MAX_LABEL;
            while !label.is_char_boundary(cut) {
                cut -= 1;
            }
            label.truncate(cut);
            label.push('…');
        }
        LeaseName {
            pod: self
                .grant
                .pods
                .first()
                .cloned()
                .unwrap_or_else(|| self.claim.path()),
            label,
        }
    }
}

impl Prepared {
    pub fn new(s: Settings) -> Prepared {
        Prepared {
            s,
            entries: BTreeMap::new(),
        }
    }

    /// What to answer for a claim prepared already; its spec is written
    /// again if it went missing (the runtime needs it for every container
    /// that starts).
    pub fn answer(&self, uid: &str) -> Option<Result<Answer, String>> {
        let saved = &self.entries.get(uid)?.saved;
        let name = cdi::file_name(&self.s.driver, uid);
        if !self.s.cdi_dir.join(&name).exists() {
            let books = saved.books(&self.s.books_dir);
            let written = saved
                .spec(&self.s, books.as_deref())
                .and_then(|v| cdi::write(&self.s.cdi_dir, &name, &v));
            if let Err(e) = written {
                return Some(Err(e));
            }
            tracing::warn!("{}: its CDI spec was gone; written again", saved.describe());
        }
        Some(Ok(saved.answer(&self.s.driver)))
    }

    /// The claims prepared now.
    pub fn claims(&self) -> impl Iterator<Item = &Saved> {
        self.entries.values().map(|e| &e.saved)
    }

    /// Takes back what the checkpoint holds: a previous run's claims, with
    /// their leases booked again under their tokens and their specs and
    /// books where they were. Must run inside the runtime.
    pub fn load(&mut self) {
        let path = self.s.state_file.clone();
        let bytes = match gpufrac_common::files::read_private(&path, MAX_STATE) {
            Ok(b) => b,
            Err(gpufrac_common::files::Untrusted::Missing) => return,
            Err(e) => {
                let said = gpufrac_common::files::set_aside(&path, &e.to_string());
                tracing::warn!(
                    "{said}; starting without it: claims prepared before are not known, and \
                     their leases are not booked until the kubelet prepares them again"
                );
                return;
            }
        };
        let saved = match serde_json::from_slice::<Checkpoint>(&bytes) {
            Ok(c) if c.version == STATE_VERSION => c.claims,
            other => {
                let why = match other {
                    Ok(c) => format!("version {}", c.version),
                    Err(e) => e.to_string(),
                };
                let said = gpufrac_common::files::set_aside(&path, &why);
                tracing::warn!("{said}; starting without it");
                return;
            }
        };
        for c in saved {
            let books = c.books(&self.s.books_dir);
            if let Some(b) = &books
                && !b.exists()
            {
                // Its containers may hold the old books (gone with the
                // state directory): new ones start from nothing.
                tracing::warn!(
                    "{}: its memory books {} are gone; new books are made, and its running \
                     containers keep counting in the old ones",
                    c.describe(),
                    b.display()
                );
                if let Err(e) = self.make_books(b, &c.grant) {
                    tracing::warn!("{}: {e}", c.describe());
                }
            }
            let spec_name = cdi::file_name(&self.s.driver, &c.claim.uid);
            if !self.s.cdi_dir.join(&spec_name).exists() {
                let written = c
                    .spec(&self.s, books.as_deref())
                    .and_then(|v| cdi::write(&self.s.cdi_dir, &spec_name, &v));
                match written {
                    Ok(()) => tracing::info!("{}: its CDI spec written again", c.describe()),
                    Err(e) => tracing::warn!("{}: {e}", c.describe()),
                }
            }
            tracing::info!("{}: prepared before this start, booked again", c.describe());
            let task = self.hold(&c, true);
            self.entries
                .insert(c.claim.uid.clone(), Entry { saved: c, task });
        }
    }

    /// Prepares a claim: books, spec, lease, checkpoint. `nodes` are the
    /// N of each granted GPU's /dev/nvidiaN.
    pub fn add(
        &mut self,
        claim: ClaimRef,
        grant: Grant,
        nodes: Vec<u32>,
    ) -> Result<Answer, String> {
        let token = if grant.admin {
            String::new()
        } else {
            token_text(wire::random_token())
        };
        let saved = Saved {
            claim,
            grant,
            token,
            nodes,
        };
        let books = saved.books(&self.s.books_dir);
        if let Some(b) = &books {
            self.make_books(b, &saved.grant)?;
        }
        let spec_name = cdi::file_name(&self.s.driver, &saved.claim.uid);
        let written = saved
            .spec(&self.s, books.as_deref())
            .and_then(|v| cdi::write(&self.s.cdi_dir, &spec_name, &v));
        if let Err(e) = written {
            if let Some(b) = &books {
                let _ = std::fs::remove_file(b);
            }
            return Err(e);
        }
        let task = self.hold(&saved, false);
        let uid = saved.claim.uid.clone();
        let answer = saved.answer(&self.s.driver);
        let what = saved.describe();
        self.entries.insert(uid.clone(), Entry { saved, task });
        if let Err(e) = self.save() {
            // Not kept, so not prepared: a restart would forget it.
            self.forget(&uid);
            return Err(e);
        }
        tracing::info!("{what}: prepared ({})", answer.cdi_ids.join(", "));
        Ok(answer)
    }

    /// Unprepares a claim: its lease ends, its spec and books go. A claim
    /// not prepared here (any more) is done already.
    pub fn remove(&mut self, uid: &str) -> Result<(), String> {
        if let Some(what) = self.entries.get(uid).map(|e| e.saved.describe()) {
            self.forget(uid);
            tracing::info!("{what}: unprepared, its lease released");
        }
        // Saved whether or not it was known: a save that failed before is
        // tried again with it.
        self.save()
    }

    fn forget(&mut self, uid: &str) {
        if let Some(e) = self.entries.remove(uid) {
            let name = cdi::file_name(&self.s.driver, uid);
            if let Err(err) = cdi::remove(&self.s.cdi_dir, &name) {
                tracing::warn!("{err}");
            }
            if let Some(b) = e.saved.books(&self.s.books_dir) {
                let _ = std::fs::remove_file(b);
            }
        }
    }

    /// The claim's memory books: the largest cap of its GPUs for all its
    /// processes together (each also has its own per GPU). Readable and
    /// writable by the containers' users, whoever they are, through the
    /// mount: the directory holding it is root's alone.
    fn make_books(&self, path: &Path, grant: &Grant) -> Result<(), String> {
        gpufrac_common::files::private_dir(
            &self.s.books_dir,
            0o700,
            "the claims' books directory",
        )?;
        let cap = grant.gpus.iter().map(|g| g.mem).max().unwrap_or(0);
        let _ = std::fs::remove_file(path);
        let p = path.to_str().ok_or_else(|| {
            format!(
                "{}: not UTF-8; choose a --state-dir without such bytes",
                path.display()
            )
        })?;
        JobLedger::create(p, cap).map_err(|e| {
            format!(
                "cannot make the claim's memory books {}: {e}",
                path.display()
            )
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(|e| {
            format!(
                "cannot open the claim's memory books {} to its containers: {e}",
                path.display()
            )
        })
    }

    fn hold(
        &self,
        saved: &Saved,
        resume: bool,
    ) -> Option<(JoinHandle<()>, watch::Sender<Option<LeaseName>>)> {
        let token = saved.token()?;
        let (names, rx) = watch::channel(Some(saved.lease_name()));
        let lease = Lease {
            pins: saved
                .grant
                .gpus
                .iter()
                .map(|g| (g.uuid.clone(), g.mem))
                .collect(),
            compute: saved.grant.share(),
            unnamed: format!("claim {}", saved.claim.path()),
            what: saved.describe(),
        };
        let task = tokio::spawn(holder::hold(
            self.s.socket.clone(),
            lease,
            token,
            rx,
            resume,
        ));
        Some((task, names))
    }

    fn save(&self) -> Result<(), String> {
        let c = Checkpoint {
            version: STATE_VERSION,
            claims: self.claims().cloned().collect(),
        };
        let bytes = serde_json::to_vec(&c).expect("claims always serialise");
        gpufrac_common::files::write_private(&self.s.state_file, &bytes, true).map_err(|e| {
            format!(
                "cannot write the plugin's checkpoint {}: {e}; check --state-dir",
                self.s.state_file.display()
            )
        })
    }
}
