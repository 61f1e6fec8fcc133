//! CLOCK_MONOTONIC, the clock the simulated engine, the shim and every
//! process of a run share (one implementation, in gpufrac-common).

pub use gpufrac_common::clock::{mono_ns, sleep_until};
