//! CUDA graph memory. A `cuMemAllocAsync` captured into a graph, or an
//! allocation node, gets its memory from the device's graph pool each time
//! the graph is launched, and the pool keeps that memory — after a free,
//! after the graph is destroyed — until `cuDeviceGraphMemTrim`. Charging the
//! capture and uncharging the first free outside the graph, as plain async
//! allocations are, once let six relaunches hold 6.6 GiB past a 2 GiB cap.
//!
//! So the charge for graph memory is what the driver says its graph pool
//! holds (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), brought up to date
//! after every launch of a graph that allocates, every trim and every exec
//! destroyed. Captured allocations are not charged as allocations. Before a
//! graph that allocates is launched, what its launch would add to the pool
//! (its allocations, less what the pool has spare) must fit the cap, or the
//! launch fails with `CUDA_ERROR_OUT_OF_MEMORY` and nothing runs. A graph's
//! allocations are learned from the capture that made it and carried
//! through `cuStreamEndCapture` and its instantiation.

use crate::boundary::{HookGuard, reentered};
use crate::devices;
use crate::driver::call;
use crate::gate::{Gate, gate, refuse};
use crate::ledger;
use gpufrac_common::config::MAX_DEVICES;
use gpufrac_common::cuda::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

const ATTR_USED_CURRENT: i32 = 0;
const ATTR_RESERVED_CURRENT: i32 = 2;

/// Bytes a graph (or capture, or exec) allocates, on one device.
#[derive(Clone, Copy, Default)]
struct Need {
    dev: usize,
    bytes: u64,
}

#[derive(Default)]
struct Books {
    capturing: HashMap<usize, Need>,
    graphs: HashMap<usize, Need>,
    execs: HashMap<usize, Need>,
}

static BOOKS: LazyLock<Mutex<Books>> = LazyLock::new(|| Mutex::new(Books::default()));
/// What is charged for each device's graph pool.
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];

fn books() -> MutexGuard<'static, Books> {
    BOOKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// True when `stream` is being captured (its allocations become graph
/// nodes). Asked of the driver; a driver without capture says no.
pub fn capturing(stream: CUstream) -> bool {
    let mut status = 0i32;
    // SAFETY: an out-pointer to a local.
    let rc = unsafe { call::cuStreamIsCapturing(stream, &mut status) };
    rc == CUDA_SUCCESS && status != 0
}

/// A captured allocation: remembered for the graph, not charged.
pub fn captured(stream: CUstream, dev: usize, size: u64) {
    let mut g = books();
    let n = g
        .capturing
        .entry(stream as usize)
        .or_insert(Need { dev, bytes: 0 });
    n.bytes = n.bytes.saturating_add(size);
}

fn attr(dev: usize, which: i32) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: an out-pointer to a local u64, as the attribute is.
    let rc = unsafe {
        call::cuDeviceGetGraphMemAttribute(dev as CUdevice, which, (&mut v as *mut u64).cast())
    };
    (rc == CUDA_SUCCESS).then_some(v)
}

/// Brings the charge for `dev`'s graph pool to what the driver holds. The
/// memory is held whatever the cap says; past the cap, it is charged all
/// the same, so that nothing more is allocated until it goes.
fn sync(dev: usize) {
    let Some(held) = attr(dev, ATTR_RESERVED_CURRENT) else {
        return;
    };
    let Some(c) = CHARGED.get(dev) else { return };
    let was = c.swap(held, Ordering::AcqRel);
    if held > was {
        ledger::force(dev, held - was);
    } else if was > held {
        ledger::unreserve(dev, was - held);
    }
}

pub unsafe fn end_capture(stream: CUstream, graph: *mut *mut c_void) -> u32 {
    let rc = unsafe { call::cuStreamEndCapture(stream, graph) };
    if reentered() {
        return rc;
    }
    let mut g = books();
    let b = &mut *g;
    let need = b.capturing.remove(&(stream as usize));
    if rc == CUDA_SUCCESS
        && !graph.is_null()
        && let Some(n) = need
    {
        // SAFETY: the driver wrote the graph there.
        let h = unsafe { graph.read_unaligned() } as usize;
        b.graphs.insert(h, n);
    }
    rc
}

fn instantiated(rc: u32, exec: *mut CUgraphExec, graph: *mut c_void) -> u32 {
    if rc != CUDA_SUCCESS || exec.is_null() || reentered() {
        return rc;
    }
    let mut g = books();
    let b = &mut *g;
    if let Some(n) = b.graphs.get(&(graph as usize)).copied() {
        // SAFETY: the driver wrote the exec there.
        let e = unsafe { exec.read_unaligned() } as usize;
        b.execs.insert(e, n);
    }
    rc
}

pub unsafe fn instantiate_with_flags(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    flags: u64,
) -> u32 {
    let rc = unsafe { call::cuGraphInstantiateWithFlags(exec, graph, flags) };
    instantiated(rc, exec, graph)
}

pub unsafe fn instantiate_with_params(
    exec: *mut CUgraphExec,
    graph: *mut c_void,
    params: *mut c_void,
) -> u32 {
    let rc = unsafe { call::cuGraphInstantiateWithParams(exec, graph, params) };
    instantiated(rc, exec, graph)
}

pub unsafe fn graph_destroy(graph: *mut c_void) -> u32 {
    let rc = unsafe { call::cuGraphDestroy(graph) };
    if rc == CUDA_SUCCESS && !reentered() {
        books().graphs.remove(&(graph as usize));
    }
    rc
}

pub unsafe fn exec_destroy(exec: CUgraphExec) -> u32 {
    let rc = unsafe { call::cuGraphExecDestroy(exec) };
    if rc == CUDA_SUCCESS && !reentered() {
        let n = books().execs.remove(&(exec as usize));
        if let Some(n) = n {
            sync(n.dev);
        }
    }
    rc
}

pub unsafe fn trim(dev: CUdevice) -> u32 {
    let rc = unsafe { call::cuDeviceGraphMemTrim(dev) };
    if rc == CUDA_SUCCESS && !reentered() && dev >= 0 {
        sync(dev as usize);
    }
    rc
}

/// Launches a graph; one that allocates must fit its pool growth under the
/// cap first, and is charged what the pool holds afterwards.
pub fn launch(exec: CUgraphExec, real: impl FnOnce() -> u32) -> u32 {
    if reentered() {
        return real();
    }
    let need = books().execs.get(&(exec as usize)).copied();
    match gate() {
        Gate::Pass => return real(),
        Gate::Refuse(code) => return code,
        Gate::Account => {}
    }
    let Some(n) = need.filter(|n| n.bytes > 0) else {
        // A graph not made by a capture the shim saw (allocation nodes
        // added by hand): charged after it runs, for what the pool holds.
        let rc = real();
        if rc == CUDA_SUCCESS
            && let Some((dev, _)) = devices::current()
        {
            let _g = HookGuard::enter();
            sync(dev);
        }
        return rc;
    };
    let _g = HookGuard::enter();
    let (used, reserved) = (
        attr(n.dev, ATTR_USED_CURRENT).unwrap_or(0),
        attr(n.dev, ATTR_RESERVED_CURRENT).unwrap_or(0),
    );
    let grow = used.saturating_add(n.bytes).saturating_sub(reserved);
    if grow > 0 {
        if let Err(why) = ledger::reserve(n.dev, grow) {
            return refuse(n.dev, grow, why);
        }
        CHARGED[n.dev.min(MAX_DEVICES - 1)].fetch_add(grow, Ordering::AcqRel);
    }
    let rc = real();
    // Whatever happened, the charge becomes what the pool holds.
    sync(n.dev);
    rc
}
