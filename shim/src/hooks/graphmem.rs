//! CUDA graph memory. An allocation node (added by hand, or a
//! `cuMemAllocAsync` captured into a graph) gets its memory from the
//! device's graph pool each time the executable graph is uploaded or
//! launched, and the pool keeps that memory — after a free, after the graph
//! is destroyed — until `cuDeviceGraphMemTrim`. Charging the capture and
//! uncharging the first free outside the graph, as plain async allocations
//! are, once let six relaunches hold 6.6 GiB past a 2 GiB cap.
//!
//! So the charge for graph memory is what the driver says its graph pool
//! holds (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), and the pool can grow
//! only through calls the shim bounds first: before an executable graph is
//! uploaded or launched (an instantiation that uploads included), what it
//! could add to each pool (its allocations, less what the pool has spare)
//! is reserved against the cap, or the call fails with
//! `CUDA_ERROR_OUT_OF_MEMORY` and nothing runs; afterwards the charge is
//! brought to what the pool holds, which gives back what was reserved and
//! not taken.
//!
//! What a graph allocates is asked of the driver when it is instantiated
//! (its allocation nodes, through child graphs), whichever way the graph
//! was made: stream capture with or without `_ptsz`, nodes added by hand,
//! `cuGraphClone`, `cuGraphAddNode`. An executable graph the shim did not
//! see instantiated, or whose graph it could not walk, may allocate
//! anything: under a cap its launch is refused rather than charged after
//! the fact.

use crate::boundary::{HookGuard, reentered};
use super::accounting;
use crate::charge::{Accounting, refuse};
use crate::devices;
use crate::driver::{call, twin};
use crate::ledger::{self, NO_LIMIT, Refusal};
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

const ATTR_USED_CURRENT: i32 = 0;
const ATTR_RESERVED_CURRENT: i32 = 2;

/// How deep child graphs are followed; deeper is no graph a program makes.
const MAX_DEPTH: u32 = 16;

/// The pool maps memory in pages of at least this much: each allocation is
/// bounded by its size rounded up to it.
const PAGE: u64 = 2 << 20;

/// What one allocation node of `bytes` can take from a pool.
pub fn page_rounded(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE).saturating_mul(PAGE)
}

/// Bytes an executable graph allocates, per device (a few entries).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Need(Vec<(usize, u64)>);

impl Need {
    fn add(&mut self, dev: usize, bytes: u64) {
        match self.0.iter_mut().find(|(d, _)| *d == dev) {
            Some((_, b)) => *b = b.saturating_add(bytes),
            None => self.0.push((dev, bytes)),
        }
    }

    fn is_empty(&self) -> bool {
        self.0.iter().all(|&(_, b)| b == 0)
    }
}

/// What an upload or a launch can add to a pool that uses `used` of the
/// `reserved` bytes it holds: every allocation of the graph at once (an
/// upper bound: frees inside the graph only lower the peak), less what the
/// pool has spare.
pub fn growth(used: u64, reserved: u64, bytes: u64) -> u64 {
    used.saturating_add(bytes).saturating_sub(reserved)
}

/// An executable graph, as the shim knows it.
#[derive(Clone, Debug)]
enum Known {
    Allocates(Need),
    /// Its graph could not be walked.
    Unknown,
}

static EXECS: LazyLock<Mutex<HashMap<usize, Known>>> = LazyLock::new(Default::default);
/// Held across every call that can change a graph pool (upload, launch,
/// trim, exec destroyed) and the charge that follows it: two launches
/// bounded from the same figures, or a charge brought to the pool's figure
/// while another thread's launch is between its reservation and its driver
/// call, would each lose a reservation.
static POOLS: Mutex<()> = Mutex::new(());
/// What is charged for each device's graph pool.
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

fn execs() -> MutexGuard<'static, HashMap<usize, Known>> {
    EXECS.lock().unwrap_or_else(|e| e.into_inner())
}

fn pools() -> MutexGuard<'static, ()> {
    POOLS.lock().unwrap_or_else(|e| e.into_inner())
}

/// True when `stream` is being captured (its allocations become graph
/// nodes, charged as graph memory). Asked of the driver, with the stream
/// semantics of the allocation (`ptsz`); a driver without capture says no.
pub fn capturing(stream: CUstream, ptsz: bool) -> bool {
    let mut status = 0i32;
    // SAFETY: an out-pointer to a local.
    let rc = unsafe {
        if ptsz {
            call::cuStreamIsCapturing_ptsz(stream, &mut status)
        } else {
            call::cuStreamIsCapturing(stream, &mut status)
        }
    };
    rc == CUDA_SUCCESS && status != 0
}

fn attr(dev: usize, which: i32) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: an out-pointer to a local u64, as the attribute is.
    let rc = unsafe {
        call::cuDeviceGetGraphMemAttribute(dev as CUdevice, which, (&mut v as *mut u64).cast())
    };
    (rc == CUDA_SUCCESS).then_some(v)
}

/// What `graph` allocates, asked of the driver; None when it cannot say.
fn walk(graph: *mut c_void, depth: u32, need: &mut Need) -> Option<()> {
    if depth > MAX_DEPTH {
        return None;
    }
    let mut n = 0usize;
    // SAFETY: out-pointers to locals; a NULL node array asks for the count.
    if unsafe { call::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) } != CUDA_SUCCESS {
        return None;
    }
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    let mut got = n;
    // SAFETY: room for `got` nodes.
    if unsafe { call::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut got) } != CUDA_SUCCESS
        || got != n
    {
        return None;
    }
    for node in nodes {
        let mut kind = -1;
        // SAFETY: an out-pointer to a local.
        if unsafe { call::cuGraphNodeGetType(node, &mut kind) } != CUDA_SUCCESS {
            return None;
        }
        match kind {
            CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
                let mut p = std::mem::MaybeUninit::<CUDA_MEM_ALLOC_NODE_PARAMS>::zeroed();
                // SAFETY: the driver fills the whole struct.
                if unsafe { call::cuGraphMemAllocNodeGetParams(node, p.as_mut_ptr()) }
                    != CUDA_SUCCESS
                {
                    return None;
                }
                // SAFETY: zeroed, then written by the driver: every field
                // is plain data.
                let p = unsafe { p.assume_init() };
                let dev = p.poolProps.location.id;
                if p.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
                    || !(0..MAX_DEVICES as i32).contains(&dev)
                {
                    // Host or NUMA memory: no device's cap.
                    continue;
                }
                need.add(dev as usize, page_rounded(p.bytesize as u64));
            }
            CU_GRAPH_NODE_TYPE_GRAPH => {
                let mut child: *mut c_void = std::ptr::null_mut();
                // SAFETY: an out-pointer to a local.
                if unsafe { call::cuGraphChildGraphNodeGetGraph(node, &mut child) } != CUDA_SUCCESS
                {
                    return None;
                }
                walk(child, depth + 1, need)?;
            }
            _ => {}
        }
    }
    Some(())
}

/// What a graph about to be instantiated allocates.
fn known(graph: *mut c_void) -> Known {
    let mut need = Need::default();
    match walk(graph, 0, &mut need) {
        Some(()) => Known::Allocates(need),
        None => Known::Unknown,
    }
}

/// Brings the charge for `dev`'s graph pool to what the driver holds; with
/// `POOLS` held. The pool grows only through calls bounded beforehand, so
/// the charge only comes down here; growth nothing bounded (memory taken
/// while the shim was not accounting) is charged if it fits, and
/// otherwise charged all the same — the driver holds it — with one line
/// on stderr, so that nothing more is allocated until it goes.
fn sync(dev: usize) {
    let Some(held) = attr(dev, ATTR_RESERVED_CURRENT) else {
        return;
    };
    let Some(c) = CHARGED.get(dev) else { return };
    let was = c.swap(held, Ordering::AcqRel);
    if held > was {
        if ledger::reserve(dev, held - was).is_err() {
            static TOLD: AtomicBool = AtomicBool::new(false);
            if !TOLD.swap(true, Ordering::Relaxed) {
                error!(
                    "device {dev}: the graph memory pool grew by {} bytes that no launch the shim saw reserved; charged past the cap",
                    held - was
                );
            }
            ledger::force(dev, held - was);
        }
    } else if was > held {
        ledger::unreserve(dev, was - held);
    }
}

/// Reserves what an upload or launch of a graph needing `need` can add to
/// its pools, all or nothing; with `POOLS` held.
fn bound(need: &Need) -> Result<(), u32> {
    let mut done: Vec<(usize, u64)> = Vec::new();
    for &(dev, bytes) in &need.0 {
        let (used, reserved) = (
            attr(dev, ATTR_USED_CURRENT).unwrap_or(0),
            attr(dev, ATTR_RESERVED_CURRENT).unwrap_or(0),
        );
        let grow = growth(used, reserved, bytes);
        if grow == 0 {
            continue;
        }
        if let Err(why) = ledger::reserve(dev, grow) {
            for (d, g) in done {
                ledger::unreserve(d, g);
                CHARGED[d].fetch_sub(g, Ordering::AcqRel);
            }
            return Err(refuse(dev, grow, why));
        }
        CHARGED[dev].fetch_add(grow, Ordering::AcqRel);
        done.push((dev, grow));
    }
    Ok(())
}

/// True when `dev` is capped, for this process or its job.
fn capped(dev: usize) -> bool {
    ledger::limit(dev) != NO_LIMIT || ledger::job_room(dev) != NO_LIMIT
}

/// Runs `real`, a call that may take graph memory for `exec` (an upload or
/// a launch): bounded first, charged what the pools hold after.
fn taking(exec: CUgraphExec, real: impl FnOnce() -> u32) -> u32 {
    let known = execs().get(&(exec as usize)).cloned();
    let need = match known {
        Some(Known::Allocates(n)) if n.is_empty() => return real(),
        Some(Known::Allocates(n)) => n,
        _ => {
            // May allocate anything on any device: the current one is
            // where a launch without a graph the shim knows would take it.
            let dev = devices::current().map_or(0, |d| d.0);
            if capped(dev) {
                static TOLD: AtomicBool = AtomicBool::new(false);
                if !TOLD.swap(true, Ordering::Relaxed) {
                    info!(
                        "device {dev}: refused a launch of a CUDA graph the shim did not see instantiated (its memory cannot be bounded under the cap)"
                    );
                }
                return refuse(dev, 0, Refusal::Books);
            }
            let _p = pools();
            let _g = HookGuard::enter();
            let rc = real();
            sync(dev);
            return rc;
        }
    };
    let _p = pools();
    let _g = HookGuard::enter();
    if let Err(code) = bound(&need) {
        return code;
    }
    let rc = real();
    // Whatever happened, the charge becomes what the pools hold.
    for &(dev, _) in &need.0 {
        sync(dev);
    }
    rc
}

/// Launches a graph (`real` passes the compute gate and calls the driver).
pub fn launch(exec: CUgraphExec, real: impl FnOnce() -> u32) -> u32 {
    if reentered() {
        return real();
    }
    match accounting() {
        Accounting::Pass => real(),
        Accounting::Refuse(code) => code,
        Accounting::Account => taking(exec, real),
    }
}

/// Instantiates `graph` into `*exec` with `real`, after learning what it
/// allocates; `upload`: the instantiation also uploads it (takes its
/// memory), so it is bounded as a launch is.
fn instantiate(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    upload: bool,
    real: impl FnOnce() -> u32,
) -> u32 {
    if reentered() {
        return real();
    }
    match accounting() {
        Accounting::Pass => return real(),
        Accounting::Refuse(code) => return code,
        Accounting::Account => {}
    }
    let known = {
        let _g = HookGuard::enter();
        known(graph)
    };
    let rc = match (&known, upload) {
        (Known::Allocates(need), true) if !need.is_empty() => {
            let _p = pools();
            let _g = HookGuard::enter();
            if let Err(code) = bound(need) {
                return code;
            }
            let rc = real();
            for &(dev, _) in &need.0 {
                sync(dev);
            }
            rc
        }
        (Known::Unknown, true) => {
            let dev = devices::current().map_or(0, |d| d.0);
            if capped(dev) {
                return refuse(dev, 0, Refusal::Books);
            }
            let _p = pools();
            let _g = HookGuard::enter();
            let rc = real();
            sync(dev);
            rc
        }
        _ => real(),
    };
    if rc == CUDA_SUCCESS && !exec.is_null() {
        // SAFETY: the driver wrote the exec there.
        let e = unsafe { exec.read_unaligned() } as usize;
        execs().insert(e, known);
    }
    rc
}

pub unsafe fn instantiate_v1(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    err_node: *mut CUgraphNode,
    log: *mut c_char,
    log_size: usize,
) -> u32 {
    instantiate(exec, graph, false, || unsafe {
        call::cuGraphInstantiate(exec, graph, err_node, log, log_size)
    })
}

pub unsafe fn instantiate_v2(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    err_node: *mut CUgraphNode,
    log: *mut c_char,
    log_size: usize,
) -> u32 {
    instantiate(exec, graph, false, || unsafe {
        call::cuGraphInstantiate_v2(exec, graph, err_node, log, log_size)
    })
}

pub unsafe fn instantiate_with_flags(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    flags: u64,
) -> u32 {
    // The driver refuses an upload here (it has no stream to upload on);
    // bounded all the same, should one ever take it.
    let upload = flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0;
    instantiate(exec, graph, upload, || unsafe {
        call::cuGraphInstantiateWithFlags(exec, graph, flags)
    })
}

/// Whether instantiation parameters ask for an upload.
fn uploads(params: *mut c_void) -> bool {
    if params.is_null() {
        return false;
    }
    // SAFETY: the application's CUDA_GRAPH_INSTANTIATE_PARAMS; its flags
    // come first.
    let flags = unsafe { params.cast::<u64>().read_unaligned() };
    flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0
}

/// `cuGraphInstantiateWithParams` and its `_ptsz` twin (`driver::twin`).
pub unsafe fn instantiate_with_params<const PTSZ: bool>(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    params: *mut c_void,
) -> u32 {
    instantiate(exec, graph, uploads(params), || unsafe {
        twin!(
            PTSZ,
            cuGraphInstantiateWithParams | cuGraphInstantiateWithParams_ptsz(exec, graph, params)
        )
    })
}

/// `cuGraphUpload`: takes the graph's memory as a launch would, without
/// running anything (no compute gate).
fn upload(exec: CUgraphExec, real: impl FnOnce() -> u32) -> u32 {
    if reentered() {
        return real();
    }
    match accounting() {
        Accounting::Pass => real(),
        Accounting::Refuse(code) => code,
        Accounting::Account => taking(exec, real),
    }
}

/// `cuGraphUpload` and its `_ptsz` twin.
pub unsafe fn graph_upload<const PTSZ: bool>(exec: CUgraphExec, stream: CUstream) -> u32 {
    upload(exec, || unsafe {
        twin!(PTSZ, cuGraphUpload | cuGraphUpload_ptsz(exec, stream))
    })
}

pub unsafe fn exec_destroy(exec: CUgraphExec) -> u32 {
    if reentered() {
        return unsafe { call::cuGraphExecDestroy(exec) };
    }
    let _p = pools();
    let rc = unsafe { call::cuGraphExecDestroy(exec) };
    if rc == CUDA_SUCCESS {
        let known = execs().remove(&(exec as usize));
        if let Some(Known::Allocates(n)) = known {
            let _g = HookGuard::enter();
            for &(dev, _) in &n.0 {
                sync(dev);
            }
        }
    }
    rc
}

pub unsafe fn trim(dev: CUdevice) -> u32 {
    if reentered() {
        return unsafe { call::cuDeviceGraphMemTrim(dev) };
    }
    let _p = pools();
    let rc = unsafe { call::cuDeviceGraphMemTrim(dev) };
    if rc == CUDA_SUCCESS && dev >= 0 {
        let _g = HookGuard::enter();
        sync(dev as usize);
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_grows_the_pool_by_what_it_lacks() {
        // An empty pool: all of it.
        assert_eq!(growth(0, 0, 1 << 30), 1 << 30);
        // Freed memory the pool kept is used first.
        assert_eq!(growth(0, 1 << 30, 1 << 30), 0);
        assert_eq!(growth(0, 1 << 29, 1 << 30), 1 << 29);
        // Outstanding allocations are not spare.
        assert_eq!(growth(1 << 30, 1 << 30, 1 << 30), 1 << 30);
        assert_eq!(growth(u64::MAX, 0, 1), u64::MAX);
    }

    #[test]
    fn an_allocation_is_bounded_by_whole_pages() {
        assert_eq!(page_rounded(0), 0);
        assert_eq!(page_rounded(1), PAGE);
        assert_eq!(page_rounded(PAGE), PAGE);
        assert_eq!(page_rounded((1 << 30) + 1), (1 << 30) + PAGE);
        assert_eq!(page_rounded(u64::MAX), u64::MAX);
    }

    #[test]
    fn needs_add_up_per_device() {
        let mut n = Need::default();
        assert!(n.is_empty());
        n.add(1, 5);
        n.add(0, 3);
        n.add(1, 7);
        assert_eq!(n, Need(vec![(1, 12), (0, 3)]));
        assert!(!n.is_empty());
        n.add(2, u64::MAX);
        n.add(2, 1);
        assert_eq!(n.0[2], (2, u64::MAX));
    }
}
