//! The hooks: what each exported entry point does, above the gate, the
//! books and the broker session, below the export table that names them
//! (`exports.rs`, from the list in `hooklist.rs`).

pub mod ctx;
pub mod graphmem;
pub mod info;
pub mod init;
pub mod launch;
pub mod mem;
pub mod nvml;
pub mod vmm;
