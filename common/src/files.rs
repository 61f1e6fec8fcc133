//! Small state files written whole.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Replaces `path` with `bytes` through a `.tmp` file beside it and a
/// rename, so that a crash mid-write leaves the previous file whole; mode
/// 0600 (state files hold job tokens). `sync` waits for the data to reach
/// the disk before the rename, for state that must outlive a crash of the
/// host.
pub fn write_private(path: &Path, bytes: &[u8], sync: bool) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if sync {
            f.sync_data()?;
        }
    }
    std::fs::rename(&tmp, path)
}

/// Moves an unusable state file to `<name>.unreadable` (kept for a person
/// to look at, never deleted) and says so: "PATH is unusable (WHY); moved
/// to ASIDE".
pub fn set_aside(path: &Path, why: &str) -> String {
    let aside = path.with_extension("unreadable");
    let _ = std::fs::rename(path, &aside);
    format!(
        "{} is unusable ({why}); moved to {}",
        path.display(),
        aside.display()
    )
}
