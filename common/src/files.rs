//! Small private state files (the broker's jobs, the device plugin's
//! leases), written whole and read back only when nobody else could have
//! written them.
//!
//! The broker keeps them in a directory only it can write
//! ([`private_dir`] makes or checks one); the device plugin's may sit where
//! its operator says. Either way every file opened here is opened without
//! following symbolic links, temporaries are created anew (`O_EXCL`) under
//! a random name, and a file is trusted on load only when it is a regular
//! file of this process's user with no access for anyone else.

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

/// Makes sure `path` is a directory for private files: this process's
/// user owns it and nobody else can write it (mode `mode` when it is made
/// here, parents 0755), and every directory above it is root's or this
/// user's and writable by nobody else but for sticky ones (like /tmp,
/// where others cannot rename what is not theirs). Symbolic links are
/// followed only when root or this user made them (a link planted in a
/// sticky directory is its planter's). An existing directory of another
/// owner, or one group or others can write, is refused, never reused: the
/// error names it, its owner and mode, and what is expected. `what` names
/// the directory for the message ("the state directory").
pub fn private_dir(path: &Path, mode: u32, what: &str) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    use std::path::Component;
    if !path.is_absolute() {
        return Err(format!(
            "{what} {} is not an absolute path; name it from /",
            path.display()
        ));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(format!(
            "{what} {} has a '..' in it; name it without one",
            path.display()
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let trusted = |uid: u32| uid == 0 || uid == me;
    let parts: Vec<_> = path.components().collect();
    let mut at = PathBuf::from("/");
    for (i, part) in parts.iter().enumerate().skip(1) {
        let leaf = i + 1 == parts.len();
        at.push(part);
        let meta = match std::fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Made anew: mkdir fails on anything planted meanwhile,
                // which is then checked below like any existing entry.
                let made = std::fs::DirBuilder::new()
                    .mode(if leaf { mode } else { 0o755 })
                    .create(&at);
                match made {
                    Ok(()) => {
                        // The umask must not decide who can read it.
                        use std::os::unix::fs::PermissionsExt;
                        std::fs::set_permissions(
                            &at,
                            std::fs::Permissions::from_mode(if leaf { mode } else { 0o755 }),
                        )
                        .map_err(|e| format!("cannot set the mode of {}: {e}", at.display()))?;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => {
                        return Err(format!("cannot create {what} {}: {e}", at.display()));
                    }
                }
                std::fs::symlink_metadata(&at)
                    .map_err(|e| format!("cannot inspect {}: {e}", at.display()))?
            }
            Err(e) => return Err(format!("cannot inspect {}: {e}", at.display())),
        };
        if meta.file_type().is_symlink() {
            if leaf || !trusted(meta.uid()) {
                return Err(format!(
                    "{what} {}: {} is a symbolic link (of uid {}), which is never followed \
                     there; expected a directory of uid {me} that only it can write: remove the \
                     link, or choose another directory",
                    path.display(),
                    at.display(),
                    meta.uid()
                ));
            }
            // A link of root's (/var/run -> /run): checked where it leads.
            at = std::fs::canonicalize(&at)
                .map_err(|e| format!("cannot resolve {}: {e}", at.display()))?;
        }
        let meta =
            std::fs::metadata(&at).map_err(|e| format!("cannot inspect {}: {e}", at.display()))?;
        let m = meta.mode() & 0o7777;
        let sticky = m & 0o1000 != 0;
        let expected = if leaf {
            format!("a directory of uid {me} that group and others cannot write")
        } else {
            format!(
                "directories above it of root or uid {me} that group and others cannot write \
                 (or sticky, like /tmp)"
            )
        };
        let wrong = if !meta.is_dir() {
            Some("is not a directory".to_owned())
        } else if (leaf && meta.uid() != me) || !trusted(meta.uid()) {
            Some(format!("belongs to uid {} (mode {m:o})", meta.uid()))
        } else if m & 0o022 != 0 && (leaf || !sticky) {
            Some(format!(
                "is writable by {} (mode {m:o}, owner uid {})",
                if m & 0o002 != 0 {
                    "everyone"
                } else {
                    "its group"
                },
                meta.uid()
            ))
        } else {
            None
        };
        if let Some(wrong) = wrong {
            let fix = if leaf {
                "remove it (another user could have planted what is in it), or choose another directory"
                    .to_owned()
            } else {
                "choose a directory elsewhere".to_owned()
            };
            return Err(format!(
                "{what} {}: {} {wrong}; expected {expected}: {fix}",
                path.display(),
                at.display()
            ));
        }
    }
    Ok(())
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

    #[test]
    fn private_dirs_are_made_private_and_foreign_ones_refused() {
        let d = dir("private");
        let p = d.join("a/b");
        private_dir(&p, 0o700, "the state directory").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&p), 0o700, "the umask does not decide");
        assert_eq!(mode(&d.join("a")), 0o755);
        private_dir(&p, 0o700, "the state directory").unwrap();

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&p, 0o700, "the state directory").unwrap_err();
        assert!(
            e.contains(&p.display().to_string())
                && e.contains("mode 777")
                && e.contains("writable by everyone")
                && e.contains("expected a directory of uid"),
            "{e}"
        );
        // A sticky directory is a parent others cannot rename things in,
        // but never a private directory itself.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(private_dir(&p, 0o700, "x").is_err());
        private_dir(&p.join("c"), 0o700, "x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&p.join("c"), 0o700, "x").unwrap_err();
        assert!(e.contains("directories above it"), "{e}");

        let e = private_dir(Path::new("rel/dir"), 0o700, "x").unwrap_err();
        assert!(e.contains("absolute"), "{e}");
        let e = private_dir(&d.join("a/../b"), 0o700, "x").unwrap_err();
        assert!(e.contains(".."), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn links_and_other_users_directories_are_never_used() {
        let d = dir("planted");
        let target = d.join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = d.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = private_dir(&link, 0o700, "the state directory").unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        // Through a link of this user's own, as /var/run -> /run is root's.
        private_dir(&link.join("sub"), 0o700, "x").unwrap();
        assert!(target.join("sub").is_dir());
        std::fs::write(d.join("file"), b"").unwrap();
        let e = private_dir(&d.join("file"), 0o700, "x").unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = d.join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = private_dir(&theirs, 0o700, "the state directory").unwrap_err();
            assert!(
                e.contains("belongs to uid 65534") && e.contains("mode 700"),
                "{e}"
            );
            let e = private_dir(&theirs.join("x"), 0o700, "x").unwrap_err();
            assert!(e.contains("belongs to uid 65534"), "{e}");
            // A link planted by another user is not followed.
            std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
            let e = private_dir(&link.join("sub"), 0o700, "x").unwrap_err();
            assert!(e.contains("symbolic link (of uid 65534)"), "{e}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
