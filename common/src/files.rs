//! Small private state files (the broker's jobs, the device plugin's
//! leases), written whole and read back only when nobody else could have
//! written them.
//!
//! They may sit in a directory other users can write (a socket in a sticky
//! /tmp puts the broker's state beside it): every file opened here is
//! opened without following symbolic links, temporaries are created anew
//! (`O_EXCL`) under a random name, and a file is trusted on load only when
//! it is a regular file of this process's user with no access for anyone
//! else.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Replaces `path` with `bytes` through a temporary file beside it and a
/// rename, so that a crash mid-write leaves the previous file whole; mode
/// 0600 (state files hold job tokens). `sync` waits for the data to reach
/// the disk before the rename, for state that must outlive a crash of the
/// host. The temporary is made with `O_CREAT|O_EXCL|O_NOFOLLOW` under a
/// random name, so nothing planted beside the file can redirect the write.
pub fn write_private(path: &Path, bytes: &[u8], sync: bool) -> std::io::Result<()> {
    let tmp = temporary(path);
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if sync {
            f.sync_data()?;
        }
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `<path>.<random>.tmp`, beside `path`.
pub fn temporary(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{:016x}.tmp", crate::wire::random_token()));
    PathBuf::from(name)
}

/// Why a private file was not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Untrusted {
    /// There is no such file.
    Missing,
    /// It could not be opened or read (the error, said).
    Unreadable(String),
    /// Someone else could have written it, or it is not a plain file: what
    /// is wrong, said for the log.
    Foreign(String),
    /// It is larger than any file this program writes.
    TooLarge(u64),
}

impl std::fmt::Display for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Untrusted::Missing => f.write_str("no such file"),
            Untrusted::Unreadable(e) => write!(f, "cannot be read ({e})"),
            Untrusted::Foreign(why) => f.write_str(why),
            Untrusted::TooLarge(n) => write!(f, "{n} bytes, larger than any state file"),
        }
    }
}

/// The bytes of `path` if this process could have written it and nobody
/// else could have: a regular file (a symbolic link is not followed),
/// owned by this process's effective user, with no permission bits for
/// group or others, of at most `max` bytes.
pub fn read_private(path: &Path, max: u64) -> Result<Vec<u8>, Untrusted> {
    let (f, len) = open_private(path, max)?;
    let mut bytes = Vec::with_capacity(len as usize);
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Untrusted::Unreadable(e.to_string()))?;
    if bytes.len() as u64 > max {
        return Err(Untrusted::TooLarge(bytes.len() as u64));
    }
    Ok(bytes)
}

/// `path` opened, and its length, if `read_private` would read it (the
/// same checks, without reading).
pub fn open_private(path: &Path, max: u64) -> Result<(std::fs::File, u64), Untrusted> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        // A FIFO planted in its place must not block the reader.
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path);
    let f = match f {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Untrusted::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Untrusted::Foreign(
                "it is a symbolic link, which is never followed".into(),
            ));
        }
        Err(e) => return Err(Untrusted::Unreadable(e.to_string())),
    };
    let meta = f
        .metadata()
        .map_err(|e| Untrusted::Unreadable(e.to_string()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() {
        return Err(Untrusted::Foreign("it is not a regular file".into()));
    }
    if meta.uid() != me {
        return Err(Untrusted::Foreign(format!(
            "it belongs to uid {}, not to this process's user (uid {me}), so another user could have written it",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(Untrusted::Foreign(format!(
            "its mode is {:o}, not 600, so others could have read or written it",
            meta.mode() & 0o7777
        )));
    }
    if meta.len() > max {
        return Err(Untrusted::TooLarge(meta.len()));
    }
    Ok((f, meta.len()))
}

/// Moves an unusable state file to `<name>.unreadable` (kept for a person
/// to look at, never deleted) and says so: "PATH is unusable (WHY); moved
/// to ASIDE", or why it could not be moved (a file of another user in a
/// sticky directory cannot be).
pub fn set_aside(path: &Path, why: &str) -> String {
    let aside = path.with_extension("unreadable");
    match std::fs::rename(path, &aside) {
        Ok(()) => format!(
            "{} is unusable ({why}); moved to {}",
            path.display(),
            aside.display()
        ),
        Err(e) => format!(
            "{} is unusable ({why}); it could not be moved to {} ({e}) and is left where it is, unread",
            path.display(),
            aside.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpufrac-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn written_files_read_back_and_leave_no_temporaries() {
        let d = dir("rw");
        let p = d.join("state");
        write_private(&p, b"one", true).unwrap();
        write_private(&p, b"two", false).unwrap();
        assert_eq!(read_private(&p, 100).unwrap(), b"two");
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(read_private(&d.join("none"), 100), Err(Untrusted::Missing));
        assert!(matches!(read_private(&p, 2), Err(Untrusted::TooLarge(3))));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn planted_links_are_neither_followed_nor_read() {
        let d = dir("links");
        let target = d.join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let p = d.join("state");
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert!(matches!(read_private(&p, 100), Err(Untrusted::Foreign(_))));
        // Written through a fresh temporary and a rename: the link is
        // replaced, its target untouched.
        write_private(&p, b"mine", false).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        assert!(
            !std::fs::symlink_metadata(&p)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn files_others_could_write_are_refused() {
        let d = dir("modes");
        let p = d.join("state");
        write_private(&p, b"x", false).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_private(&p, 100).unwrap_err();
        assert!(e.to_string().contains("644"), "{e}");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            // Planted by another user, with the right mode.
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
            let e = read_private(&p, 100).unwrap_err();
            assert!(e.to_string().contains("uid 65534"), "{e}");
        }
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        assert!(matches!(read_private(&p, 100), Err(Untrusted::Foreign(_))));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
