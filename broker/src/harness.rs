//! The broker's core, sans I/O, and what it is built from: for driving a
//! broker in virtual time (the red-team harness, `redteam/src/core.rs`),
//! with the host's processes, job tokens and GPUs stood in for and the
//! sockets simulated. The event loop that runs it for real is
//! `server.rs`; a harness runs the same calls in the same order
//! (`server.rs`: accepts, the core's turn, helper threads'
//! reports, timers, output, closes, state writes).

pub use crate::authority::{Allow, Peer, Policy};
pub use crate::inventory::GpuInfo;
pub use crate::mig::Planner;
pub use crate::procs::{GpuSample, Procs, Telemetry};
pub use crate::proto::{
    Broker, Config, ConnId, MigDone, Nanos, Read, SAVE_EVERY, Sockets, Tokens, Work,
};
/// Connections accepted from the listener's backlog in one pass of the
/// loop, before the core's turn.
pub use crate::server::ACCEPTS_PER_TURN;
