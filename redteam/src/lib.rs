//! An attacker that searches (issue 32, item 8): for each of the
//! broker's invariants, an optimiser over a hostile user's strategies,
//! played against the broker's sans-I/O core in virtual time beside a
//! scripted victim user, maximising the victim's harm measured at user
//! level (docs/testing.md, "The searching attacker"). Layers, each
//! importing only those before it:
//!
//! - `work`, the work meter (allocations counted per thread), and
//!   `logs`, the broker's log captured and read back;
//! - `host`, the processes (/proc's stand-in);
//! - `core`, the one place that touches the broker: its core, built
//!   with the stand-ins, and the shell's loop around it;
//! - `node`: sockets, the GPU, the users' processes and virtual time;
//! - `victim` and `attack`: the two users;
//! - `check`: each invariant's scene, measure and threshold;
//! - `search`: the optimiser.
//!
//! A crate of its own, used by no other: it sees the broker only
//! through the API its shell uses (the compiler holds it to that), and
//! its allocator, which counts, goes into no binary but its own.

pub mod attack;
pub mod check;
pub mod core;
pub mod host;
pub mod logs;
pub mod node;
pub mod search;
pub mod victim;
pub mod work;

#[global_allocator]
static ALLOCATOR: work::Counting = work::Counting;

pub use attack::{Bounds, Cohort, Play, Recall, Space, Strategy, Want, cohort, seeds, shim};
pub use check::{Invariant, Outcome, evaluate, holds};
pub use gpufrac_common::config::Priority;
pub use host::{Argv, Text};
pub use search::{Found, Plan, search};
