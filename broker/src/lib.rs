//! The gpufrac broker (docs/design.md, "The broker"). Layers import
//! downward only:
//!
//! - pure policy in virtual time: `sched` (compute), `queue` and `mig`
//!   (placement), `authority` (who may do what), `jobs` (what a job is),
//!   `stats` (what metrics count as it happens),
//!   `history` (the ring of recent status samples);
//! - `proto`, the sans-I/O core: connections, budgets, membership,
//!   leases, recovery and status, over `procs` (the host, behind traits);
//! - I/O: `server` (the event loop), `listen` (the socket), `statefile`,
//!   `metrics`, `mps`, `mig_nvml`, `inventory`;
//! - `startup`, which puts them together.

pub mod authority;
pub mod history;
pub mod inventory;
pub mod jobs;
pub mod listen;
pub mod metrics;
pub mod mig;
pub mod mig_nvml;
pub mod mps;
pub mod procs;
pub mod proto;
pub mod queue;
pub mod sched;
pub mod server;
pub mod startup;
pub mod statefile;
pub mod stats;
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
