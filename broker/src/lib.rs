//! The gpufrac broker: pure state machines (scheduler, queue) driven by a
//! thin socket layer.

pub mod inventory;
pub mod jobs;
pub mod mig;
pub mod mig_nvml;
pub mod mps;
pub mod queue;
pub mod sched;
pub mod server;
pub mod status;

/// A socket path this user can create, for hints when the default (root's
/// /run/gpufrac) is out of reach: `$XDG_RUNTIME_DIR/gpufrac.sock`, else a
/// directory of the user's own under /tmp.
pub fn user_socket() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => std::path::PathBuf::from(d).join("gpufrac.sock"),
        // SAFETY: geteuid has no preconditions.
        None => format!("/tmp/gpufrac-{}/broker.sock", unsafe { libc::geteuid() }).into(),
    }
}
