//! The simulated driver's device address space: fresh, unique, aligned
//! addresses that are never dereferenced. Below both `mem` (allocations,
//! VMM) and `graphs` (allocation nodes), which each take addresses from it.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{AcqRel, Acquire};

use gpufrac_common::cuda::{CUDA_ERROR_OUT_OF_MEMORY, CUresult};

pub(crate) fn round_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x / a * a)
}

static NEXT_VA: AtomicU64 = AtomicU64::new(0);

/// A fresh fake device address range: unique in this process, non-zero,
/// aligned to `align` (at least 512), never dereferenced.
pub(crate) fn alloc_va(size: u64, align: u64) -> Result<u64, CUresult> {
    let align = align.max(512);
    let span = round_up(size.max(1), 512)
        .and_then(|s| s.checked_add(512))
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: no preconditions.
    let first = 0x7f00_0000_0000u64 + ((unsafe { libc::getpid() } as u64) << 32);
    let start = |cur: u64| round_up(if cur == 0 { first } else { cur }, align);
    let prev = NEXT_VA
        .fetch_update(AcqRel, Acquire, |cur| start(cur)?.checked_add(span))
        .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
    start(prev).ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// An address for a graph allocation node: fixed for the graph's life,
/// its memory taken from the graph pool at each launch.
pub fn graph_va(size: u64) -> Result<u64, CUresult> {
    alloc_va(size, 512)
}
