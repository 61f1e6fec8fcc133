//! Code shared by the shim, the broker, the CLI and the simulated driver.
//! Nothing here may allocate on a path the shim calls per CUDA call.

pub mod clock;
pub mod config;
pub mod cuda;
pub mod files;
pub mod jobledger;
pub mod mig;
pub mod minors;
pub mod net;
pub mod procfs;
pub mod size;
#[cfg(feature = "status")]
pub mod status;
pub mod text;
pub mod versions;
pub mod wire;
