//! libgpufrac.so — an LD_PRELOAD shim over the CUDA driver API.
//!
//! It enforces a per-process memory cap on every device, shows the process a
//! GPU the size of its cap (CUDA and NVML alike), and gates kernel launches
//! by the timeslices the broker grants. See the README and docs/design.md.
//!
//! Layout: `table` is the single list of hooked symbols; `dlsym` and
//! `procaddr` make every lookup path reach it; `init` is the staged lazy
//! initialisation; `ledger` the exact accounting; `mem`, `info`, `nvml`,
//! `launch` the policies; `client` the broker connection.

#[macro_use]
mod log;
mod api;
mod boundary;
mod client;
mod devices;
mod dlsym;
mod graphmem;
mod inflight;
mod info;
mod init;
mod launch;
mod ledger;
mod mem;
mod nvml;
mod procaddr;
mod table;
mod vmm;
