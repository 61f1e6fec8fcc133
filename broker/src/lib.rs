//! The gpufrac broker: pure state machines (scheduler, queue) driven by a
//! thin socket layer.

pub mod inventory;
pub mod jobs;
pub mod mps;
pub mod queue;
pub mod sched;
pub mod server;
pub mod status;
