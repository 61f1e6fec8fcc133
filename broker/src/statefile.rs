//! The state file: where leases and the queue outlive a broker's crash,
//! restart or upgrade.
//!
//! It lives in the broker's private directory (`--state-dir`, checked at
//! start by `common::files::private_dir`), and is still written through a
//! fresh temporary and a rename, and read back only if this user wrote it
//! and nobody else could have (`common::files`). Each write keeps the copy it replaces as
//! `<path>.prev`, the last good copy should the newest one ever be found
//! corrupt. Whatever cannot be trusted is set aside, never deleted, and
//! the broker is told that what it loaded may be less than what ran
//! (`Loaded::suspect`): it then holds new placements until running jobs
//! have had their grace to claim their leases back.

use std::path::{Path, PathBuf};

use gpufrac_common::files::{self, Untrusted};

use crate::ident;
use crate::jobs::{self, Job};

/// Larger than any state file the broker writes (its size is bounded by
/// the per-user budgets of leases, queued requests and label length).
const MAX_STATE: u64 = 64 << 20;

pub struct StateFile {
    path: PathBuf,
}

/// What a previous broker left.
#[derive(Debug, Default)]
pub struct Loaded {
    pub jobs: Vec<Job>,
    /// What was wrong, for the log and status.
    pub problem: Option<String>,
    /// The newest copy could not be used: jobs that ran may be missing.
    pub suspect: bool,
}

impl StateFile {
    pub fn new(path: PathBuf) -> Self {
        StateFile { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn previous(&self) -> PathBuf {
        let mut p = self.path.as_os_str().to_owned();
        p.push(".prev");
        PathBuf::from(p)
    }

    /// The jobs a previous broker left: the newest copy if it can be
    /// trusted and read, else the last good one (suspect), else none.
    pub fn load(&self) -> Loaded {
        self.remove_torn_writes();
        let newest = match read(&self.path) {
            Ok(jobs) => {
                return Loaded {
                    jobs,
                    problem: None,
                    suspect: false,
                };
            }
            Err(Untrusted::Missing) if !self.previous().exists() => return Loaded::default(),
            Err(Untrusted::Missing) => format!("{} is missing", self.path.display()),
            Err(why) => files::set_aside(&self.path, &why.to_string()),
        };
        let prev = self.previous();
        match read(&prev) {
            Ok(jobs) => Loaded {
                jobs,
                problem: Some(format!(
                    "{newest}; loaded the last good copy, {}, which may miss the newest leases",
                    prev.display()
                )),
                suspect: true,
            },
            Err(Untrusted::Missing) => Loaded {
                jobs: Vec::new(),
                problem: Some(format!("{newest}; there is no earlier copy")),
                suspect: true,
            },
            Err(why) => Loaded {
                jobs: Vec::new(),
                problem: Some(format!(
                    "{newest}; {}",
                    files::set_aside(&prev, &why.to_string())
                )),
                suspect: true,
            },
        }
    }

    /// Removes the temporaries of writes a killed broker never renamed
    /// (`<path>.<16 hex>.tmp`, `<path>.prev.<16 hex>.tmp`): nothing reads
    /// them, and left there they would keep a clean stop from removing the
    /// private directory. Only this broker writes in that directory (it is
    /// checked private at start), so such a name is its own.
    fn remove_torn_writes(&self) {
        let (Some(dir), Some(base)) = (self.path.parent(), self.path.file_name()) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let base = base.to_string_lossy();
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let Some(rest) = name.strip_prefix(&*base) else {
                continue;
            };
            let rest = rest.strip_prefix(".prev").unwrap_or(rest);
            let torn = rest
                .strip_prefix('.')
                .and_then(|r| r.strip_suffix(".tmp"))
                .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
            if torn && e.file_type().is_ok_and(|t| t.is_file()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Writes the state (`jobs::encode`'s bytes) whole, keeping the copy
    /// it replaces as the last good one.
    pub fn save(&self, bytes: &[u8]) -> std::io::Result<()> {
        self.keep_previous();
        files::write_private(&self.path, bytes, true)
    }

    /// Links the current file as `<path>.prev` (through a fresh name and a
    /// rename, like every write here), only when it is this user's own.
    fn keep_previous(&self) {
        // Checked, not read: the state is written every 100 ms at most.
        if files::open_private(&self.path, MAX_STATE).is_err() {
            return;
        }
        let tmp = files::temporary(&self.previous());
        if std::fs::hard_link(&self.path, &tmp).is_ok()
            && std::fs::rename(&tmp, self.previous()).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// A clean stop with no job alive: nothing is left for a next broker.
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(self.previous());
    }
}

fn read(path: &Path) -> Result<Vec<Job>, Untrusted> {
    let bytes = files::read_private(path, MAX_STATE)?;
    let (jobs, kind) = jobs::decode(&bytes)
        .map_err(|e| Untrusted::Foreign(format!("it cannot be read as state: {e}")))?;
    Ok(as_this_hosts(jobs, kind))
}

/// Jobs whose marks are of kind `from`, with this host's marks
/// (`ident::convert`): a job whose run is gone gets mark 0, which no
/// process has, and ends as a run that never came back.
fn as_this_hosts(jobs: Vec<Job>, from: ident::Kind) -> Vec<Job> {
    let to = ident::kind();
    jobs.into_iter()
        .map(|j| Job {
            ident: ident::convert(from, to, j.pid, j.ident).unwrap_or(0),
            ..j
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::encode;

    fn job(token: u64) -> Job {
        crate::jobs::sample(token)
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpufrac-state-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_killed_writers_temporaries_are_removed_at_load_and_nothing_else() {
        let d = dir("torn");
        let f = StateFile::new(d.join("state"));
        f.save(&encode([job(1)].iter())).unwrap();
        let torn = [files::temporary(f.path()), files::temporary(&f.previous())];
        let kept = [
            d.join("state.notes.tmp"),
            d.join("other.0123456789abcdef.tmp"),
        ];
        for p in torn.iter().chain(&kept) {
            std::fs::write(p, b"half a write").unwrap();
        }
        let l = f.load();
        assert_eq!(l.jobs, vec![job(1)]);
        for p in &torn {
            assert!(!p.exists(), "{} left", p.display());
        }
        for p in &kept {
            assert!(p.exists(), "{} removed", p.display());
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_corrupt_newest_copy_falls_back_to_the_last_good_one_and_says_so() {
        let d = dir("fallback");
        let f = StateFile::new(d.join("b.sock.state"));
        let l = f.load();
        assert!(l.jobs.is_empty() && !l.suspect && l.problem.is_none());
        f.save(&encode([job(1)].iter())).unwrap();
        f.save(&encode([job(1), job(2)].iter())).unwrap();
        let l = f.load();
        assert_eq!((l.jobs.len(), l.suspect), (2, false));
        // Truncated, as a disk that lost the end of a write leaves it.
        let bytes = std::fs::read(f.path()).unwrap();
        std::fs::write(f.path(), &bytes[..bytes.len() / 2]).unwrap();
        let l = f.load();
        assert_eq!(l.jobs, vec![job(1)], "the copy before the last write");
        assert!(l.suspect);
        let p = l.problem.unwrap();
        assert!(p.contains("unusable") && p.contains(".prev"), "{p}");
        assert!(d.join("b.sock.unreadable").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn nothing_trustworthy_is_suspect_and_empty() {
        let d = dir("none");
        let f = StateFile::new(d.join("s"));
        std::fs::write(f.path(), b"{ not json").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        let l = f.load();
        assert!(l.jobs.is_empty() && l.suspect);
        assert!(l.problem.unwrap().contains("no earlier copy"));
        // A clean stop with no job alive leaves nothing.
        f.save(&encode([job(3)].iter())).unwrap();
        f.save(&encode([job(3)].iter())).unwrap();
        f.remove();
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "s.unreadable")
            .collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A file someone else could have written puts the broker in recovery
    /// but grants nothing: its jobs are never read, and it is set aside.
    #[test]
    fn a_suspect_file_is_never_read_whatever_it_holds() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir("suspect");
        let f = StateFile::new(d.join("state"));
        std::fs::write(f.path(), encode([job(7)].iter())).unwrap();
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
        let l = f.load();
        assert!(l.jobs.is_empty() && l.suspect, "{l:?}");
        assert!(l.problem.unwrap().contains("644"));
        assert!(d.join("state.unreadable").exists());
        assert!(!f.path().exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A file the broker before version 2 wrote: start times, read as this
    /// host's marks. The run that is still the process it was keeps its
    /// job; one whose pid another process holds now has mark 0 (no
    /// process's), and so is gone.
    #[test]
    fn a_version_1_file_of_start_times_is_read_as_this_hosts_marks() {
        let me = std::process::id();
        let start = gpufrac_common::procfs::start_time(me).unwrap();
        let v1 = |start: u64| {
            let j = Job {
                pid: me,
                ident: start,
                ..job(1)
            };
            let body = serde_json::to_string(&j)
                .unwrap()
                .replace("\"ident\"", "\"start_time\"");
            format!("{{\"version\":1,\"jobs\":[{body}]}}")
        };
        let (jobs, kind) = jobs::decode(v1(start).as_bytes()).unwrap();
        assert_eq!(kind, ident::Kind::StartTime);
        let jobs = as_this_hosts(jobs, kind);
        assert_eq!(jobs[0].ident, ident::of_pid(ident::kind(), me).unwrap());
        assert_eq!(
            Job {
                ident: 0,
                ..jobs[0].clone()
            },
            Job {
                pid: me,
                ident: 0,
                ..job(1)
            }
        );
        let (before, kind) = jobs::decode(v1(start + 1).as_bytes()).unwrap();
        let before = as_this_hosts(before, kind);
        let expected = if ident::kind() == ident::Kind::StartTime {
            start + 1
        } else {
            0
        };
        assert_eq!(before[0].ident, expected);
    }
}
