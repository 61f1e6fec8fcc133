//! CUDA graphs, as far as their memory goes: graphs made by stream capture
//! (`cuStreamBeginCapture`/`cuStreamEndCapture`, `_ptsz` too) or by hand
//! (`cuGraphCreate`, `cuGraphAddMemAllocNode`, `cuGraphAddMemFreeNode`,
//! `cuGraphAddEmptyNode`), cloned (`cuGraphClone`), walked
//! (`cuGraphGetNodes`, `cuGraphNodeGetType`,
//! `cuGraphMemAllocNodeGetParams`), instantiated (`cuGraphInstantiate`,
//! `_v2`, `WithFlags`, `WithParams` and its `_ptsz`), uploaded
//! (`cuGraphUpload`) and launched, allocating from a per-device graph
//! memory pool.
//!
//! What a real driver does and this one copies: a graph allocation has a
//! fixed address for the graph's life (across instantiations and
//! launches); its memory is taken from the device's graph pool when the
//! graph is uploaded or launched, and goes back to the pool (not to the
//! device) when freed, by a free node (of that graph or of another one
//! launched later) or with `cuMemFreeAsync` or `cuMemFree`; a graph cannot be launched
//! again while an allocation of its last launch is still outstanding
//! (unless instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`,
//! which frees them first); a graph with memory nodes has at most one
//! executable graph at a time and cannot be cloned
//! (`CUDA_ERROR_NOT_SUPPORTED`); the pool keeps what it reserved until
//! `cuDeviceGraphMemTrim`. `cuDeviceGetGraphMemAttribute` reports the
//! pool's used and reserved bytes (current and high-water).

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::{LazyLock, Mutex, MutexGuard};

use gpufrac_common::cuda::*;

use crate::objects::{
    self, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, GraphExec, Handle, resolve_stream,
};
use crate::state::{Sim, cuda};

pub const ATTR_USED_CURRENT: i32 = 0;
pub const ATTR_USED_HIGH: i32 = 1;
pub const ATTR_RESERVED_CURRENT: i32 = 2;
pub const ATTR_RESERVED_HIGH: i32 = 3;

/// A node, as far as memory goes.
#[derive(Clone, Copy, Debug)]
enum Node {
    Alloc {
        va: u64,
        size: u64,
        dev: usize,
    },
    Free {
        va: u64,
    },
    /// Anything else (a captured kernel, an empty node): its type.
    Other(i32),
}

impl Node {
    fn kind(&self) -> i32 {
        match self {
            Node::Alloc { .. } => CU_GRAPH_NODE_TYPE_MEM_ALLOC,
            Node::Free { .. } => CU_GRAPH_NODE_TYPE_MEM_FREE,
            Node::Other(t) => *t,
        }
    }

    fn is_memory(&self) -> bool {
        matches!(self, Node::Alloc { .. } | Node::Free { .. })
    }
}

#[derive(Clone, Default)]
struct Graph {
    /// (node handle, node), in the order they were added.
    nodes: Vec<(usize, Node)>,
}

impl Graph {
    fn has_memory_nodes(&self) -> bool {
        self.nodes.iter().any(|(_, n)| n.is_memory())
    }
}

/// One allocation of an executable graph.
#[derive(Clone, Copy, Debug)]
struct GraphAlloc {
    va: u64,
    size: u64,
    dev: usize,
    /// Freed by a free node of the same graph.
    freed_inside: bool,
}

struct Exec {
    graph: usize,
    allocs: Vec<GraphAlloc>,
    /// Free nodes of allocations made by other graphs.
    frees_outside: Vec<u64>,
    /// Which allocations of the last launch are outstanding.
    out: Vec<bool>,
    auto_free: bool,
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
    /// Captures in progress: stream (see `capture_key`) -> nodes so far.
    capturing: HashMap<usize, Vec<(usize, Node)>>,
    graphs: HashMap<usize, Graph>,
    /// Every node of a live graph, by handle.
    nodes: HashMap<usize, Node>,
    execs: HashMap<usize, Exec>,
    /// Graphs with memory nodes that have an executable graph: its handle.
    instantiated: HashMap<usize, usize>,
    /// Outstanding graph allocations: address -> exec handle.
    live: HashMap<u64, usize>,
    pools: HashMap<usize, Pool>,
    next: usize,
}

impl Books {
    /// A fresh handle for a graph or a node (never dereferenced: graphs and
    /// nodes are looked up here).
    fn handle(&mut self) -> usize {
        self.next += 0x10;
        self.next
    }
}

static BOOKS: LazyLock<Mutex<Books>> = LazyLock::new(|| {
    Mutex::new(Books {
        next: 0x6a00_0000,
        ..Books::default()
    })
});

fn books() -> MutexGuard<'static, Books> {
    BOOKS.lock().unwrap_or_else(|e| e.into_inner())
}

/// What identifies the stream a capture runs on: a stream's handle, or for
/// the per-thread default stream (NULL under `_ptsz`, or
/// `CU_STREAM_PER_THREAD`) the calling thread's stream of the current
/// context. The legacy default stream cannot be captured.
unsafe fn capture_key(stream: CUstream, ptsz: bool) -> Result<usize, CUresult> {
    match stream as usize {
        0 if !ptsz => Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        CU_STREAM_LEGACY => Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        0 | CU_STREAM_PER_THREAD => {
            let c = objects::current()?;
            Ok(objects::per_thread_stream(c) as *const objects::Stream as usize)
        }
        h => {
            unsafe { resolve_stream(stream, ptsz) }?;
            Ok(h)
        }
    }
}

/// A capture in progress on `stream`: the allocation becomes a node of the
/// graph (an address, no memory yet). None when the stream is not
/// capturing.
pub fn capture_alloc(stream: CUstream, ptsz: bool, size: u64, dev: usize, va: u64) -> Option<u64> {
    let key = unsafe { capture_key(stream, ptsz) }.ok()?;
    let mut g = books();
    let b = &mut *g;
    let h = b.handle();
    let list = b.capturing.get_mut(&key)?;
    list.push((h, Node::Alloc { va, size, dev }));
    Some(va)
}

/// `cuMemFreeAsync` of a graph address: a free node while capturing, or,
/// after a launch, its memory back to the pool. False when `va` is no
/// graph allocation.
pub fn free(stream: CUstream, ptsz: bool, va: u64) -> Result<bool, CUresult> {
    let key = unsafe { capture_key(stream, ptsz) }.ok();
    let mut g = books();
    let b = &mut *g;
    if let Some(key) = key
        && b.capturing.contains_key(&key)
    {
        let h = b.handle();
        let list = b.capturing.get_mut(&key).expect("checked");
        let ours = list
            .iter()
            .any(|(_, n)| matches!(n, Node::Alloc { va: a, .. } if *a == va));
        if ours || b.live.contains_key(&va) {
            list.push((h, Node::Free { va }));
            return Ok(true);
        }
    }
    Ok(give_back(b, va))
}

/// `cuMemFree` of an outstanding graph allocation: back to its pool. False
/// if `va` is none.
pub fn give_back_outstanding(va: u64) -> bool {
    give_back(&mut books(), va)
}

/// An outstanding graph allocation back to its pool; false if `va` is none.
fn give_back(b: &mut Books, va: u64) -> bool {
    let Some(exec) = b.live.remove(&va) else {
        return false;
    };
    let Some(e) = b.execs.get_mut(&exec) else {
        return false;
    };
    let Some(i) = e.allocs.iter().position(|a| a.va == va) else {
        return false;
    };
    e.out[i] = false;
    let (dev, size) = (e.allocs[i].dev, e.allocs[i].size);
    let p = b.pools.entry(dev).or_default();
    p.used -= size;
    true
}

/// Grows `dev`'s pool so that `size` more bytes can be used from it.
fn make_room(s: &Sim, p: &mut Pool, dev: usize, size: u64) -> Result<(), CUresult> {
    let spare = p.reserved - p.used;
    if spare < size {
        let grow = size - spare;
        s.reserve(dev, grow)?;
        p.reserved += grow;
        p.reserved_high = p.reserved_high.max(p.reserved);
    }
    Ok(())
}

/// Takes the memory of a launch of `exec` from its devices' graph pools.
pub fn launch(s: &Sim, exec: CUgraphExec) -> Result<(), CUresult> {
    let mut g = books();
    let b = &mut *g;
    let Some(e) = b.execs.get(&(exec as usize)) else {
        return Ok(());
    };
    if e.out.iter().any(|&o| o) {
        if !e.auto_free {
            // Its previous launch's allocations have not been freed.
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let vas: Vec<u64> = e
            .allocs
            .iter()
            .zip(&e.out)
            .filter(|(_, o)| **o)
            .map(|(a, _)| a.va)
            .collect();
        for va in vas {
            give_back(b, va);
        }
    }
    let e = b.execs.get(&(exec as usize)).expect("listed");
    let (allocs, frees) = (e.allocs.clone(), e.frees_outside.clone());
    let mut out = vec![false; allocs.len()];
    for (i, a) in allocs.iter().enumerate() {
        let p = b.pools.entry(a.dev).or_default();
        make_room(s, p, a.dev, a.size)?;
        p.used += a.size;
        p.used_high = p.used_high.max(p.used);
        if a.freed_inside {
            p.used -= a.size;
        } else {
            out[i] = true;
            b.live.insert(a.va, exec as usize);
        }
    }
    for va in frees {
        give_back(b, va);
    }
    b.execs.get_mut(&(exec as usize)).expect("listed").out = out;
    Ok(())
}

/// `cuGraphUpload`: the pools of `exec`'s devices made big enough for a
/// launch, so that the launch itself takes nothing from the device.
fn upload(s: &Sim, exec: CUgraphExec) -> Result<(), CUresult> {
    let mut g = books();
    let b = &mut *g;
    let e = b
        .execs
        .get(&(exec as usize))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut need: HashMap<usize, u64> = HashMap::new();
    for a in &e.allocs {
        *need.entry(a.dev).or_default() += a.size;
    }
    for (dev, size) in need {
        let p = b.pools.entry(dev).or_default();
        make_room(s, p, dev, size)?;
    }
    Ok(())
}

unsafe fn begin(stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    cuda()?;
    let key = unsafe { capture_key(stream, ptsz) }?;
    let mut g = books();
    if g.capturing.contains_key(&key) {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    g.capturing.insert(key, Vec::new());
    Ok(())
}

unsafe fn end(stream: CUstream, graph: *mut *mut c_void, ptsz: bool) -> Result<(), CUresult> {
    cuda()?;
    if graph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let key = unsafe { capture_key(stream, ptsz) }?;
    let mut g = books();
    let b = &mut *g;
    let nodes = b.capturing.remove(&key).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    let h = b.handle();
    b.nodes.extend(nodes.iter().copied());
    b.graphs.insert(h, Graph { nodes });
    unsafe { *graph = h as *mut c_void };
    Ok(())
}

unsafe fn is_capturing(stream: CUstream, status: *mut i32, ptsz: bool) -> Result<(), CUresult> {
    cuda()?;
    if status.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let capturing = match unsafe { capture_key(stream, ptsz) } {
        Ok(key) => books().capturing.contains_key(&key),
        // The legacy stream is never being captured.
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) => false,
        Err(e) => return Err(e),
    };
    unsafe { *status = i32::from(capturing) };
    Ok(())
}

/// Adds `node` to `graph`, its handle written to `out`.
unsafe fn add(out: *mut CUgraphNode, graph: CUgraph, node: Node) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut g = books();
    let b = &mut *g;
    if !b.graphs.contains_key(&(graph as usize)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if let Node::Free { va } = node {
        // Its allocation: made by this graph (not freed yet), or by
        // another one.
        let here = b.graphs[&(graph as usize)]
            .nodes
            .iter()
            .any(|(_, n)| matches!(n, Node::Alloc { va: a, .. } if *a == va));
        let freed = b.graphs[&(graph as usize)]
            .nodes
            .iter()
            .any(|(_, n)| matches!(n, Node::Free { va: a } if *a == va));
        let elsewhere = b
            .nodes
            .values()
            .any(|n| matches!(n, Node::Alloc { va: a, .. } if *a == va));
        if freed || !(here || elsewhere) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let h = b.handle();
    b.graphs
        .get_mut(&(graph as usize))
        .expect("checked")
        .nodes
        .push((h, node));
    b.nodes.insert(h, node);
    unsafe { *out = h as CUgraphNode };
    Ok(())
}

unsafe fn instantiate(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> Result<(), CUresult> {
    cuda()?;
    if exec.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut g = books();
    let b = &mut *g;
    let gr = b
        .graphs
        .get(&(graph as usize))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let memory = gr.has_memory_nodes();
    if memory && b.instantiated.contains_key(&(graph as usize)) {
        // One executable graph at a time for a graph with memory nodes.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut allocs: Vec<GraphAlloc> = Vec::new();
    let mut frees_outside = Vec::new();
    for (_, n) in &gr.nodes {
        match *n {
            Node::Alloc { va, size, dev } => allocs.push(GraphAlloc {
                va,
                size,
                dev,
                freed_inside: false,
            }),
            Node::Free { va } => match allocs.iter_mut().find(|a| a.va == va) {
                Some(a) => a.freed_inside = true,
                None => frees_outside.push(va),
            },
            Node::Other(_) => {}
        }
    }
    let h = objects::leak(GraphExec::new(0)).handle() as usize;
    let n = allocs.len();
    b.execs.insert(
        h,
        Exec {
            graph: graph as usize,
            allocs,
            frees_outside,
            out: vec![false; n],
            auto_free: flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH != 0,
        },
    );
    if memory {
        b.instantiated.insert(graph as usize, h);
    }
    unsafe { *exec = h as CUgraphExec };
    Ok(())
}

/// `cuGraphInstantiateWithParams`: flags from the parameters, an upload
/// when they ask for one, the result written back.
unsafe fn instantiate_with_params(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    ptsz: bool,
) -> Result<(), CUresult> {
    let s = cuda()?;
    if params.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = unsafe { params.read_unaligned() };
    let r = unsafe { instantiate(exec, graph, p.flags) };
    let r = r.and_then(|()| {
        if p.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD == 0 {
            return Ok(());
        }
        let e = unsafe { *exec };
        let up = unsafe { resolve_stream(p.hUploadStream, ptsz) }.and_then(|_| upload(s, e));
        if up.is_err() {
            destroy_exec(e);
        }
        up
    });
    // CUDA_GRAPH_INSTANTIATE_SUCCESS or _ERROR.
    let result = i32::from(r.is_err());
    unsafe {
        std::ptr::addr_of_mut!((*params).result_out).write_unaligned(result);
        std::ptr::addr_of_mut!((*params).hErrNode_out).write_unaligned(std::ptr::null_mut());
    }
    r
}

unsafe fn upload_on(exec: CUgraphExec, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    unsafe { resolve_stream(stream, ptsz) }?;
    if unsafe { GraphExec::from_handle(exec) }.is_none() {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    upload(s, exec)
}

/// Forgets an executable graph; outstanding allocations outlive it (they
/// are freed with `cuMemFreeAsync` as before). False if it is none.
fn destroy_exec(exec: CUgraphExec) -> bool {
    let mut g = books();
    let b = &mut *g;
    let Some(e) = b.execs.remove(&(exec as usize)) else {
        return false;
    };
    if b.instantiated.get(&e.graph) == Some(&(exec as usize)) {
        b.instantiated.remove(&e.graph);
    }
    if let Some(ge) = unsafe { GraphExec::from_handle(exec) } {
        ge.kill();
    }
    true
}

cuda_exports! {
    fn cuStreamBeginCapture(stream: CUstream) {
        begin(stream, false)
    }

    fn cuStreamBeginCapture_ptsz(stream: CUstream) {
        begin(stream, true)
    }

    fn cuStreamBeginCapture_v2(stream: CUstream, _mode: i32) {
        begin(stream, false)
    }

    fn cuStreamBeginCapture_v2_ptsz(stream: CUstream, _mode: i32) {
        begin(stream, true)
    }

    fn cuStreamEndCapture(stream: CUstream, graph: *mut *mut c_void) {
        end(stream, graph, false)
    }

    fn cuStreamEndCapture_ptsz(stream: CUstream, graph: *mut *mut c_void) {
        end(stream, graph, true)
    }

    fn cuStreamIsCapturing(stream: CUstream, status: *mut i32) {
        is_capturing(stream, status, false)
    }

    fn cuStreamIsCapturing_ptsz(stream: CUstream, status: *mut i32) {
        is_capturing(stream, status, true)
    }

    fn cuGraphCreate(graph: *mut CUgraph, _flags: c_uint) {
        cuda()?;
        if graph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut g = books();
        let h = g.handle();
        g.graphs.insert(h, Graph::default());
        *graph = h as CUgraph;
        Ok(())
    }

    fn cuGraphAddEmptyNode(node: *mut CUgraphNode, graph: CUgraph, _deps: *const CUgraphNode, _ndeps: usize) {
        cuda()?;
        add(node, graph, Node::Other(CU_GRAPH_NODE_TYPE_EMPTY))
    }

    /// The allocation's address is chosen now and written back to
    /// `params->dptr`; its memory comes from the pool at each launch.
    fn cuGraphAddMemAllocNode(
        node: *mut CUgraphNode,
        graph: CUgraph,
        _deps: *const CUgraphNode,
        _ndeps: usize,
        params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
    ) {
        let s = cuda()?;
        if params.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = params.read_unaligned();
        if p.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || p.bytesize == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = s.dev(p.poolProps.location.id)?;
        let va = crate::va::graph_va(p.bytesize as u64)?;
        add(node, graph, Node::Alloc { va, size: p.bytesize as u64, dev })?;
        std::ptr::addr_of_mut!((*params).dptr).write_unaligned(va);
        Ok(())
    }

    fn cuGraphAddMemFreeNode(
        node: *mut CUgraphNode,
        graph: CUgraph,
        _deps: *const CUgraphNode,
        _ndeps: usize,
        dptr: CUdeviceptr,
    ) {
        cuda()?;
        add(node, graph, Node::Free { va: dptr })
    }

    fn cuGraphClone(clone: *mut CUgraph, original: CUgraph) {
        cuda()?;
        if clone.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut g = books();
        let b = &mut *g;
        let orig = b.graphs.get(&(original as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if orig.has_memory_nodes() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let kinds: Vec<Node> = orig.nodes.iter().map(|(_, n)| *n).collect();
        let mut nodes = Vec::with_capacity(kinds.len());
        for n in kinds {
            let h = b.handle();
            b.nodes.insert(h, n);
            nodes.push((h, n));
        }
        let h = b.handle();
        b.graphs.insert(h, Graph { nodes });
        *clone = h as CUgraph;
        Ok(())
    }

    fn cuGraphGetNodes(graph: CUgraph, nodes: *mut CUgraphNode, num: *mut usize) {
        cuda()?;
        if num.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = books();
        let gr = g.graphs.get(&(graph as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !nodes.is_null() {
            for (i, (h, _)) in gr.nodes.iter().take(num.read_unaligned()).enumerate() {
                nodes.add(i).write_unaligned(*h as CUgraphNode);
            }
        }
        num.write_unaligned(gr.nodes.len());
        Ok(())
    }

    fn cuGraphNodeGetType(node: CUgraphNode, kind: *mut i32) {
        cuda()?;
        let n = *books().nodes.get(&(node as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        crate::out(kind, n.kind(), CUDA_ERROR_INVALID_VALUE)
    }

    fn cuGraphMemAllocNodeGetParams(node: CUgraphNode, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        cuda()?;
        let n = *books().nodes.get(&(node as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let Node::Alloc { va, size, dev } = n else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        let p = CUDA_MEM_ALLOC_NODE_PARAMS {
            poolProps: CUmemPoolProps {
                // CU_MEM_ALLOCATION_TYPE_PINNED
                allocType: 1,
                handleTypes: 0,
                location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: dev as i32 },
                win32SecurityAttributes: std::ptr::null_mut(),
                maxSize: 0,
                usage: 0,
                reserved: [0; 54],
            },
            accessDescs: std::ptr::null(),
            accessDescCount: 0,
            bytesize: size as usize,
            dptr: va,
        };
        crate::out(params, p, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuGraphInstantiate(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        _err_node: *mut CUgraphNode,
        _log: *mut c_char,
        _log_size: usize,
    ) {
        instantiate(exec, graph, 0)
    }

    fn cuGraphInstantiate_v2(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        _err_node: *mut CUgraphNode,
        _log: *mut c_char,
        _log_size: usize,
    ) {
        instantiate(exec, graph, 0)
    }

    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) {
        // Upload is for cuGraphInstantiateWithParams only.
        if flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 {
            cuda()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        instantiate(exec, graph, flags)
    }

    fn cuGraphInstantiateWithParams(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    ) {
        instantiate_with_params(exec, graph, params, false)
    }

    fn cuGraphInstantiateWithParams_ptsz(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
    ) {
        instantiate_with_params(exec, graph, params, true)
    }

    fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) {
        upload_on(exec, stream, false)
    }

    fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) {
        upload_on(exec, stream, true)
    }

    fn cuGraphDestroy(graph: CUgraph) {
        cuda()?;
        let mut g = books();
        let b = &mut *g;
        let gr = b.graphs.remove(&(graph as usize)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for (h, _) in gr.nodes {
            b.nodes.remove(&h);
        }
        Ok(())
    }

    fn cuGraphExecDestroy(exec: CUgraphExec) {
        cuda()?;
        // Execs made by gpufracSimGraphCreate have no books here.
        if !destroy_exec(exec) {
            GraphExec::from_handle(exec).ok_or(CUDA_ERROR_INVALID_VALUE)?.kill();
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
