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
pub mod process;
pub mod vmm;

use crate::charge::{self, Accounting};

/// What a memory hook does with this call (`charge::accounting`), the
/// process set up first if no entry point has yet: a memory call reached
/// before `cuInit` under a malformed configuration is refused as `cuInit`
/// would be.
#[inline(always)]
pub fn accounting() -> Accounting {
    charge::accounting(process::config)
}
