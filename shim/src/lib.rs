//! libgpufrac.so — an LD_PRELOAD shim over the CUDA driver API.
//!
//! It enforces a per-process (and per-job) memory cap on every device,
//! shows the process a GPU the size of its cap (CUDA and NVML alike), and
//! gates kernel launches by the timeslices the broker grants. See the
//! README and docs/design.md.
//!
//! # Layers
//!
//! Each module uses only modules of its own layer or of the layers below
//! it, and the graph of which module uses which has no circle (a unit test
//! below reads the sources and checks both):
//!
//! 0. **Base**: `log` (allocation-free stderr lines), `boundary` (the FFI
//!    boundary: fail closed where memory is handed out, pass through
//!    elsewhere), `hooklist` (the one list of hooked symbols, an X-macro),
//!    `driver` (the real functions' slots, filled from that list, and the
//!    loading of libcuda, NVML and cudart).
//! 1. **Pure logic**, no driver and no global state: `view` (the virtual
//!    memory view), `estimate` (the in-flight estimate), `watch` (when a
//!    silent broker counts as gone), `session` (the broker session's
//!    decisions, a state machine in virtual time).
//! 2. **Process state**: `config` (staged initialisation), `ledger` (the
//!    books, the process's and the job's), `devices` (sizes, UUIDs, caps),
//!    `contexts`.
//! 3. **Gates**: `charge` (the memory charge: whether a memory hook
//!    accounts, and reserve-call-record), `inflight` (the in-flight
//!    bound's driver events), `client` (the client thread: the broker
//!    connection, applying the session's decisions), `client::gate` (the
//!    compute gate that launches pass: one object, everything application
//!    threads share with the client thread), `client::lanes` (its release
//!    handshake, model-checked with loom), and beside them
//!    `client::compute`, `drain`, `connect`, `registration`, `notes`.
//! 4. **Hooks**: `hooks::*`, what each exported entry point does.
//! 5. **Exports**: `exports` (the list expanded into exported symbols, the
//!    table that lookups hand out, and `cuGetProcAddress`'s hooks, which
//!    read that table), `dlsym` (the `dlsym` export), `api` (the C query
//!    API of include/gpufrac.h).
//!
//! The exports are compiled into the cdylib only. `cargo test -p
//! gpufrac-shim` builds this crate again as a test binary without layer 5
//! and runs the unit tests of the layers below; were the exports in it,
//! its own `dlsym` and `cu*` calls would resolve to the shim's hooks. The
//! whole library is tested through real processes by the workspace's
//! `tests/` (`tests/mem_caps.rs`, `tests/jobs.rs`, ...).

// In the unit-test build the exports are absent, so what only they reach
// is unused there.
#![cfg_attr(test, allow(dead_code))]

// Under loom (`--cfg loom`) only the gate's release handshake is built,
// with loom's atomics, and model-checked (client/lanes.rs).
#[cfg(loom)]
#[path = "client/lanes.rs"]
mod lanes;

/// The library's modules, all left out under loom.
macro_rules! library {
    ($($(#[$m:meta])* mod $name:ident;)*) => {
        $( #[cfg(not(loom))] $(#[$m])* mod $name; )*
    };
}

library! {
    #[macro_use]
    mod log;
    mod boundary;
    mod driver;
    mod hooklist;

    mod estimate;
    mod session;
    mod view;
    mod watch;

    mod config;
    mod contexts;
    mod devices;
    mod ledger;

    mod charge;
    mod client;
    mod inflight;

    mod hooks;

    #[cfg(not(test))]
    mod api;
    #[cfg(not(test))]
    mod dlsym;
    #[cfg(not(test))]
    mod exports;

    #[cfg(test)]
    mod layering;
}
