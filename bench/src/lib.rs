//! Shared pieces of the gpufrac benchmark: a protocol-level broker client,
//! clocks and statistics (used by both binaries), and the process harness
//! and report writer (used by `gpufrac-bench`).
//!
//! Nothing here links the shim or a CUDA binding: the timing program finds
//! the driver with dlopen + dlsym at run time, as cudart and cudarc do.

pub mod clock;
pub mod harness;
pub mod report;
pub mod stats;
pub mod wirec;
