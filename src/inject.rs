//! What gpufrac puts into a command's world, wherever it runs: the shim's
//! path on this host, where the shim and the broker's socket appear inside
//! a container, and the quoting of words in commands printed for a shell.
//! A leaf: `run`, `docker-args`, `cdi`, the device plugin and the Slurm
//! prolog all build on it, and it on none of them.

use std::path::{Path, PathBuf};

/// The shim's file name, in a build tree and in an install alike.
pub const SHIM_NAME: &str = "libgpufrac.so";

/// Names the shim when it is not where an install puts it: after a bare
/// `cargo install` (which installs the binary alone), or to try another
/// build. Read by `gpufrac run` and `docker-args`, not by the shim.
pub const VAR_LIB: &str = "GPUFRAC_LIB";

/// `$GPUFRAC_LIB` (the library, or a directory holding it), else
/// `libgpufrac.so` beside the binary (a build tree, or everything in one
/// directory), else in `../lib` (an install under a prefix).
pub fn find_shim() -> Result<PathBuf, String> {
    if let Some(v) = std::env::var_os(VAR_LIB).filter(|v| !v.is_empty()) {
        let named = PathBuf::from(&v);
        let lib = if named.is_dir() {
            named.join(SHIM_NAME)
        } else {
            named
        };
        // Absolute, because the child may run in another directory.
        return match lib.canonicalize() {
            Ok(p) if p.is_file() => Ok(p),
            _ => Err(format!(
                "{VAR_LIB}={}: there is no {SHIM_NAME} there; point it at the library or the \
                 directory that holds it, or unset it to use the installed one",
                Path::new(&v).display()
            )),
        };
    }
    let exe = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(|e| format!("cannot locate the gpufrac binary to find {SHIM_NAME}: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let lib_dir = dir.parent().unwrap_or(dir).join("lib");
    let candidates = [dir.join(SHIM_NAME), lib_dir.join(SHIM_NAME)];
    for c in &candidates {
        if c.is_file() {
            return Ok(c.canonicalize().unwrap_or_else(|_| c.clone()));
        }
    }
    Err(format!(
        "cannot find {SHIM_NAME}: looked for {} and {}. Install the library there \
         (from a source checkout: cargo xtask install --prefix PREFIX; from a release: \
         ./install.sh --prefix PREFIX in the unpacked tarball), or set {VAR_LIB} to its path",
        candidates[0].display(),
        candidates[1].display()
    ))
}

/// Where the shim appears inside the container.
pub const CONTAINER_LIB: &str = "/usr/lib/gpufrac/libgpufrac.so";
/// Where the broker's socket directory appears inside the container.
pub const CONTAINER_SOCKET_DIR: &str = "/run/gpufrac";
/// Where a container sees the MPS pipe directory of a broker run with
/// `--mps` (the broker keeps it in its private directory, which is not the
/// socket's).
pub const CONTAINER_MPS_PIPE: &str = "/run/gpufrac-mps";

/// Single quotes unless the word is plainly safe, as POSIX shells read them.
pub fn sh_quote(s: &str) -> String {
    let safe = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./-_".contains(&b));
    if safe {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
