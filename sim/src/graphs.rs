//! CUDA graph memory, as far as tests need it: stream capture of
//! `cuMemAllocAsync`/`cuMemFreeAsync` into a graph's allocation (and free)
//! nodes, instantiation, and launches that allocate from a per-device
//! graph memory pool.
//!
//! What a real driver does and this one copies: a graph allocation has a
//! fixed address for the graph's life; its memory is taken from the
//! device's graph pool when the graph is launched, and goes back to the
//! pool (not to the device) when freed, inside the graph or after it with
//! `cuMemFreeAsync`; a graph cannot be launched again while an allocation of
//! its last launch is still outstanding; the pool keeps what it reserved
//! until `cuDeviceGraphMemTrim`. `cuDeviceGetGraphMemAttribute` reports the
//! pool's used and reserved bytes (current and high-water).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{LazyLock, Mutex, MutexGuard};

use gpufrac_common::cuda::*;

use crate::objects::{self, CU_STREAM_LEGACY, GraphExec, Handle, resolve_stream};
use crate::state::{Sim, cuda};

pub const ATTR_USED_CURRENT: i32 = 0;
pub const ATTR_USED_HIGH: i32 = 1;
pub const ATTR_RESERVED_CURRENT: i32 = 2;
pub const ATTR_RESERVED_HIGH: i32 = 3;

#[derive(Clone, Copy, Debug)]
pub struct GraphAlloc {
    pub va: u64,
    pub size: u64,
    pub dev: usize,
    /// Freed by a free node of the same graph.
    pub freed_inside: bool,
}

#[derive(Default)]
struct Pool {
    used: u64,
    used_high: u64,
    reserved: u64,
    reserved_high: u64,
}

#[derive(Default)]
struct Books {
    /// Streams being captured: stream handle -> allocations so far.
    capturing: HashMap<usize, Vec<GraphAlloc>>,
    /// Graphs made by capture: graph handle -> allocations.
    graphs: HashMap<usize, Vec<GraphAlloc>>,
    /// Execs: handle -> (allocations, which are outstanding).
    execs: HashMap<usize, (Vec<GraphAlloc>, Vec<bool>)>,
    /// Outstanding graph allocations: address -> exec handle.
    live: HashMap<u64, usize>,
    pools: HashMap<usize, Pool>,
    next_graph: usize,
}

static BOOKS: LazyLock<Mutex<Books>> = LazyLock::new(|| {
    Mutex::new(Books {
        next_graph: 0x6a00_0000,
        ..Books::default()
    })
});

fn books() -> MutexGuard<'static, Books> {
    BOOKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A capture in progress on `stream`: the allocation becomes a node of the
/// graph (an address, no memory yet). None when the stream is not
/// capturing.
pub fn capture_alloc(stream: CUstream, size: u64, dev: usize, va: u64) -> Option<u64> {
    let mut g = books();
    let b = &mut *g;
    let list = b.capturing.get_mut(&(stream as usize))?;
    list.push(GraphAlloc {
        va,
        size,
        dev,
        freed_inside: false,
    });
    Some(va)
}

/// `cuMemFreeAsync` of a graph address: a free node while capturing the
/// graph that allocated it, or, after a launch, its memory back to the
/// pool. False when `va` is no graph allocation.
pub fn free(stream: CUstream, va: u64) -> Result<bool, CUresult> {
    let mut g = books();
    let b = &mut *g;
    if let Some(list) = b.capturing.get_mut(&(stream as usize))
        && let Some(a) = list.iter_mut().find(|a| a.va == va)
    {
        a.freed_inside = true;
        return Ok(true);
    }
    let Some(exec) = b.live.remove(&va) else {
        return Ok(false);
    };
    let (allocs, out) = b
        .execs
        .get_mut(&exec)
        .expect("live allocations have an exec");
    let i = allocs.iter().position(|a| a.va == va).expect("listed");
    out[i] = false;
    let (dev, size) = (allocs[i].dev, allocs[i].size);
    let p = b.pools.entry(dev).or_default();
    p.used -= size;
    Ok(true)
}

/// Takes the memory of a launch of `exec` from its devices' graph pools.
pub fn launch(s: &Sim, exec: CUgraphExec) -> Result<(), CUresult> {
    let mut g = books();
    let b = &mut *g;
    let Some((allocs, out)) = b.execs.get(&(exec as usize)).cloned() else {
        return Ok(());
    };
    if out.iter().any(|&o| o) {
        // Its previous launch's allocations have not been freed.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut now_out = out;
    for (i, a) in allocs.iter().enumerate() {
        let p = b.pools.entry(a.dev).or_default();
        let free_in_pool = p.reserved - p.used;
        if free_in_pool < a.size {
            let grow = a.size - free_in_pool;
            s.reserve(a.dev, grow)?;
            p.reserved += grow;
            p.reserved_high = p.reserved_high.max(p.reserved);
        }
        p.used += a.size;
        p.used_high = p.used_high.max(p.used);
        if a.freed_inside {
            p.used -= a.size;
        } else {
            now_out[i] = true;
            b.live.insert(a.va, exec as usize);
        }
    }
    b.execs.get_mut(&(exec as usize)).expect("listed").1 = now_out;
    Ok(())
}

cuda_exports! {
    fn cuStreamBeginCapture(stream: CUstream) {
        begin(stream)
    }

    fn cuStreamBeginCapture_v2(stream: CUstream, _mode: i32) {
        begin(stream)
    }

    fn cuStreamEndCapture(stream: CUstream, graph: *mut *mut c_void) {
        cuda()?;
        if graph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut g = books();
        let b = &mut *g;
        let allocs = b
            .capturing
            .remove(&(stream as usize))
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        b.next_graph += 0x10;
        let h = b.next_graph;
        b.graphs.insert(h, allocs);
        *graph = h as *mut c_void;
        Ok(())
    }

    fn cuStreamIsCapturing(stream: CUstream, status: *mut i32) {
        cuda()?;
        if status.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let capturing = books()
            .capturing
            .contains_key(&(stream as usize));
        *status = i32::from(capturing);
        Ok(())
    }

    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: *mut c_void, _flags: u64) {
        instantiate(exec, graph)
    }

    fn cuGraphDestroy(graph: *mut c_void) {
        cuda()?;
        books()
            .graphs
            .remove(&(graph as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    }

    fn cuGraphExecDestroy(exec: CUgraphExec) {
        cuda()?;
        // Outstanding allocations outlive the exec; they are freed with
        // cuMemFreeAsync as before.
        let mut g = books();
        let b = &mut *g;
        if b.execs.remove(&(exec as usize)).is_none() && GraphExec::from_handle(exec).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    fn cuDeviceGraphMemTrim(device: CUdevice) {
        let s = cuda()?;
        let d = s.dev(device)?;
        let mut g = books();
        let p = &mut *g.pools.entry(d).or_default();
        let spare = p.reserved - p.used;
        s.release(d, spare);
        p.reserved = p.used;
        Ok(())
    }

    fn cuDeviceGetGraphMemAttribute(device: CUdevice, attr: i32, value: *mut c_void) {
        let s = cuda()?;
        let d = s.dev(device)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut g = books();
        let p = &mut *g.pools.entry(d).or_default();
        let v = match attr {
            ATTR_USED_CURRENT => p.used,
            ATTR_USED_HIGH => p.used_high,
            ATTR_RESERVED_CURRENT => p.reserved,
            ATTR_RESERVED_HIGH => p.reserved_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        value.cast::<u64>().write_unaligned(v);
        Ok(())
    }
}

unsafe fn begin(stream: CUstream) -> Result<(), CUresult> {
    cuda()?;
    // Capture needs a stream of its own: the legacy default stream cannot
    // be captured.
    if matches!(stream as usize, 0 | CU_STREAM_LEGACY) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    unsafe { resolve_stream(stream, false) }?;
    let mut g = books();
    let b = &mut *g;
    if b.capturing.insert(stream as usize, Vec::new()).is_some() {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    Ok(())
}

unsafe fn instantiate(exec: *mut CUgraphExec, graph: *mut c_void) -> Result<(), CUresult> {
    cuda()?;
    if exec.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut g = books();
    let b = &mut *g;
    let allocs = b
        .graphs
        .get(&(graph as usize))
        .cloned()
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let h = objects::leak(GraphExec::new(0)).handle();
    let n = allocs.len();
    b.execs.insert(h as usize, (allocs, vec![false; n]));
    unsafe { *exec = h };
    Ok(())
}
