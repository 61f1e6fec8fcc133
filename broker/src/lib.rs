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
//!
//! # Its interface
//!
//! The modules above are the crate's own. What the rest of the workspace
//! uses is this page:
//!
//! - [`run`] a broker with [`BrokerOptions`] (`gpufrac broker`; its
//!   defaults are the CLI's), and where it keeps its private files
//!   ([`default_state_dir`]) or where a user's own broker listens
//!   ([`user_socket`]);
//! - [`gpus`]: the GPUs the driver shows, numbered as the broker numbers
//!   them (`gpufrac run`, `gpufrac cdi`, the device plugin), and MIG
//!   instances made through NVML as the broker makes them;
//! - [`harness`]: the sans-I/O core and what it is built from, for
//!   driving a broker in virtual time (the red-team harness);
//! - [`options`]: the checks of its command-line values, for the CLI to
//!   make while it reads them (a malformed value is a usage error);
//! - [`METRICS_CONNECTIONS`].
//!
//! The status document it serves is `gpufrac_common::status`.

pub(crate) mod authority;
pub(crate) mod history;
pub(crate) mod ident;
pub(crate) mod inventory;
pub(crate) mod jobs;
pub(crate) mod listen;
pub(crate) mod metrics;
pub(crate) mod mig;
pub(crate) mod mig_nvml;
pub(crate) mod mps;
pub(crate) mod procs;
pub(crate) mod proto;
pub(crate) mod queue;
pub(crate) mod sched;
pub(crate) mod server;
pub(crate) mod startup;
pub(crate) mod statefile;
pub(crate) mod stats;
pub(crate) mod status;
pub(crate) mod weights;

pub mod gpus;
pub mod harness;

pub use startup::{BrokerOptions, MigMode, default_state_dir, run};

/// The most connections the metrics endpoint holds at once, all peers
/// together (`docs/metrics.md`): what a flood of scrapers is cut down to.
pub const METRICS_CONNECTIONS: usize = metrics::TOTAL;

/// The broker's own checks of its command-line values, as `run` makes
/// them: the CLI makes them while it reads the command line, so that a
/// malformed value exits 2 like any other usage error.
pub mod options {
    /// `--metrics ADDRESS`.
    pub fn metrics_address(s: &str) -> Result<(), String> {
        crate::metrics::address(s).map(drop)
    }

    /// One `--user-weight NAME=WEIGHT`.
    pub fn user_weight(s: &str) -> Result<(), String> {
        crate::weights::parse_weight("--user-weight", s, crate::startup::uid_of).map(drop)
    }

    /// One `--group-weight NAME=WEIGHT`.
    pub fn group_weight(s: &str) -> Result<(), String> {
        crate::weights::parse_weight("--group-weight", s, crate::startup::gid_of).map(drop)
    }
}

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
