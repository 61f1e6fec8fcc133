//! The job's shared memory books: every process under one `gpufrac run`
//! shares its cap.

use std::path::{Path, PathBuf};

use gpufrac_common::config::VAR_MEM_LIMIT;

use super::env::ChildEnv;
use super::fail::Fail;

/// The job's shared memory books: a small file the child's processes map
/// (named in `GPUFRAC_JOB_LEDGER`), removed when the job ends.
pub(super) struct JobBooks {
    pub(super) path: PathBuf,
    _books: gpufrac_common::jobledger::JobLedger,
}

impl Drop for JobBooks {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub(super) fn job_books(env: &ChildEnv) -> Result<Option<JobBooks>, Fail> {
    let Some(cap) = env
        .set
        .iter()
        .find(|(k, _)| k == VAR_MEM_LIMIT)
        .and_then(|(_, v)| v.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    // Memory-backed where there is /dev/shm: nothing touches a disk.
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = dir.join(format!("gpufrac-job-{}-{nanos}", std::process::id()));
    let books = gpufrac_common::jobledger::JobLedger::create(&path.display().to_string(), cap)
        .map_err(|e| {
            Fail::new(
                1,
                format!(
                    "cannot create the job's memory books at {}: {e}",
                    path.display()
                ),
            )
        })?;
    Ok(Some(JobBooks {
        path,
        _books: books,
    }))
}
