//! Memory: bookkeeping only. Physical use is charged to the shared state;
//! this process remembers what each pointer/handle charged.

use crate::va::{alloc_va, round_up};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use gpufrac_common::cuda::*;

use crate::engine;
use crate::objects::Work;
use crate::objects::{self, Handle, Pool, resolve_stream};
use crate::out;
use crate::state::{Sim, cuda};

pub const ARRAY_ALIGN: u64 = 512;
pub const PITCH_ALIGN: u64 = 512;
pub const GRANULARITY: u64 = 2 << 20;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Kind {
    Dev,
    Vmm,
    Array,
    Mipmap,
}

#[derive(Clone, Copy, Debug)]
pub struct Alloc {
    pub dev: usize,
    pub size: u64,
    /// Owning context (freed with it), 0 for none.
    pub ctx: usize,
}

struct Registry {
    allocs: BTreeMap<(Kind, u64), Alloc>,
    /// VMM address reservations: start -> size.
    reserved: BTreeMap<u64, u64>,
    /// VMM mappings: start -> (handle, size).
    mapped: BTreeMap<u64, (u64, u64)>,
    /// VMM physical allocations, by the handle `cuMemCreate` returned (the
    /// key of their charge). The memory lives until no handle to it holds
    /// a reference and nothing maps it, as on a real driver: releasing a
    /// mapped handle frees nothing, nor does releasing one handle while
    /// another (imported) one lives.
    vmm: BTreeMap<u64, Phys>,
    /// Allocation handles: handle -> (its physical allocation, references
    /// it holds). `cuMemCreate` and `cuMemImportFromShareableHandle` make
    /// one, `cuMemRetainAllocationHandle` adds a reference.
    handles: BTreeMap<u64, (u64, u32)>,
    /// File descriptors exported (`cuMemExportToShareableHandle`), by inode:
    /// the physical allocation each one stands for, in this process.
    exported: BTreeMap<u64, u64>,
    host: BTreeSet<usize>,
}

#[derive(Clone, Copy, Debug)]
struct Phys {
    /// References held by all of its handles.
    refs: u32,
    maps: u32,
    /// `CUmemAllocationHandleType`s it may be exported as.
    types: u32,
}

impl Registry {
    /// Frees `phys` if nothing holds it any more: its handles and exports
    /// are forgotten, and true tells the caller to uncharge it.
    fn settle(&mut self, phys: u64) -> bool {
        match self.vmm.get(&phys) {
            Some(p) if p.refs == 0 && p.maps == 0 => {}
            _ => return false,
        }
        self.vmm.remove(&phys);
        self.handles.retain(|_, (p, _)| *p != phys);
        self.exported.retain(|_, p| *p != phys);
        true
    }
}

static REG: Mutex<Registry> = Mutex::new(Registry {
    allocs: BTreeMap::new(),
    reserved: BTreeMap::new(),
    mapped: BTreeMap::new(),
    vmm: BTreeMap::new(),
    handles: BTreeMap::new(),
    exported: BTreeMap::new(),
    host: BTreeSet::new(),
});

fn reg() -> MutexGuard<'static, Registry> {
    REG.lock().unwrap_or_else(|e| e.into_inner())
}

/// The inode of an open file descriptor.
fn inode(fd: c_int) -> Option<u64> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: an out-pointer to a local.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Charges `size` on `dev` and registers a fresh address/handle for it.
fn charge(s: &Sim, kind: Kind, dev: usize, size: u64, ctx: usize) -> Result<u64, CUresult> {
    s.reserve(dev, size)?;
    let align = if kind == Kind::Vmm { GRANULARITY } else { 512 };
    let va = match alloc_va(size, align) {
        Ok(v) => v,
        Err(e) => {
            s.release(dev, size);
            return Err(e);
        }
    };
    reg().allocs.insert((kind, va), Alloc { dev, size, ctx });
    Ok(va)
}

fn uncharge(s: &Sim, kind: Kind, key: u64, err: CUresult) -> Result<(), CUresult> {
    let a = reg().allocs.remove(&(kind, key)).ok_or(err)?;
    s.release(a.dev, a.size);
    Ok(())
}

/// Frees everything a destroyed (or released/reset primary) context owned.
pub fn free_ctx_allocs(s: &Sim, ctx: usize) {
    let gone: Vec<Alloc> = {
        let mut r = reg();
        let keys: Vec<_> = r
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| r.allocs.remove(k)).collect()
    };
    for a in gone {
        s.release(a.dev, a.size);
    }
}

fn lookup(kind: Kind, key: u64) -> Option<Alloc> {
    reg().allocs.get(&(kind, key)).copied()
}

unsafe fn alloc_dev(dptr: *mut CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let s = cuda()?;
    let c = objects::current()?;
    if dptr.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = charge(s, Kind::Dev, c.device, size as u64, c.id())?;
    unsafe { *dptr = p };
    Ok(())
}

unsafe fn alloc_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    ptsz: bool,
) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(stream, ptsz) }?;
    let dev = match pool {
        None => t.ctx.device,
        Some(p) => {
            unsafe { Pool::from_handle(p) }
                .ok_or(CUDA_ERROR_INVALID_VALUE)?
                .device
        }
    };
    if dptr.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Captured into a graph: an address now, memory at each launch.
    let va = alloc_va(size as u64, 512)?;
    if let Some(va) = crate::graphs::capture_alloc(stream, ptsz, size as u64, dev, va) {
        unsafe { *dptr = va };
        return Ok(());
    }
    // Pool memory belongs to the device, not to a context.
    let p = charge(s, Kind::Dev, dev, size as u64, 0)?;
    unsafe { *dptr = p };
    Ok(())
}

unsafe fn free_async(dptr: CUdeviceptr, stream: CUstream, ptsz: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    unsafe { resolve_stream(stream, ptsz) }?;
    if crate::graphs::free(stream, ptsz, dptr)? {
        return Ok(());
    }
    uncharge(s, Kind::Dev, dptr, CUDA_ERROR_INVALID_VALUE)
}

fn array_charge(kind: Kind, out_handle: *mut *mut c_void, bytes: usize) -> Result<(), CUresult> {
    let s = cuda()?;
    let c = objects::current()?;
    if out_handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let size = round_up(bytes as u64, ARRAY_ALIGN).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    let h = charge(s, kind, c.device, size, c.id())?;
    // SAFETY: checked non-NULL.
    unsafe { *out_handle = h as *mut c_void };
    Ok(())
}

fn requirements(
    req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
    kind: Kind,
    h: *mut c_void,
    dev: CUdevice,
) -> Result<(), CUresult> {
    let s = cuda()?;
    s.dev(dev)?;
    let a = lookup(kind, h as u64).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let r = CUDA_ARRAY_MEMORY_REQUIREMENTS {
        size: a.size as usize,
        alignment: ARRAY_ALIGN as usize,
        reserved: [0; 4],
    };
    unsafe { out(req, r, CUDA_ERROR_INVALID_VALUE) }
}

/// Synchronous copies wait for prior work on the stream they are ordered on.
unsafe fn sync_copy(ptsz: bool, ok: bool) -> Result<(), CUresult> {
    let s = cuda()?;
    let t = unsafe { resolve_stream(std::ptr::null_mut(), ptsz) }?;
    if !ok {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    engine::wait(s, Work::of(t));
    Ok(())
}

unsafe fn async_op(stream: CUstream, ptsz: bool, ok: bool) -> Result<(), CUresult> {
    cuda()?;
    unsafe { resolve_stream(stream, ptsz) }?;
    if ok {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

unsafe fn host_alloc(pp: *mut *mut c_void, size: usize) -> Result<(), CUresult> {
    cuda()?;
    objects::current()?;
    if pp.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut p = std::ptr::null_mut();
    // SAFETY: valid out-pointer; page alignment like pinned memory.
    if unsafe { libc::posix_memalign(&mut p, 4096, size) } != 0 || p.is_null() {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, size) };
    reg().host.insert(p as usize);
    unsafe { *pp = p };
    Ok(())
}

cuda_exports! {
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) {
        alloc_dev(dptr, size)
    }

    fn cuMemFree_v2(dptr: CUdeviceptr) {
        let s = cuda()?;
        // A graph allocation left outstanding goes back to its graph pool.
        if crate::graphs::give_back_outstanding(dptr) {
            return Ok(());
        }
        uncharge(s, Kind::Dev, dptr, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuMemAllocPitch_v2(
        dptr: *mut CUdeviceptr,
        pitch: *mut usize,
        width: usize,
        height: usize,
        elem: c_uint,
    ) {
        let s = cuda()?;
        let c = objects::current()?;
        if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || !matches!(elem, 4 | 8 | 16) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = round_up(width as u64, PITCH_ALIGN).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let size = p.checked_mul(height as u64).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let v = charge(s, Kind::Dev, c.device, size, c.id())?;
        *dptr = v;
        *pitch = p as usize;
        Ok(())
    }

    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if !matches!(flags, 1 | 2) {
            // CU_MEM_ATTACH_GLOBAL or CU_MEM_ATTACH_HOST
            cuda()?;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        alloc_dev(dptr, size)
    }

    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) {
        alloc_async(dptr, size, None, stream, false)
    }

    fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) {
        alloc_async(dptr, size, None, stream, true)
    }

    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) {
        alloc_async(dptr, size, Some(pool), stream, false)
    }

    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) {
        alloc_async(dptr, size, Some(pool), stream, true)
    }

    fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) {
        free_async(dptr, stream, false)
    }

    fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) {
        free_async(dptr, stream, true)
    }

    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(pool, s.default_pools[d].handle(), CUDA_ERROR_INVALID_VALUE)
    }

    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const c_void) {
        let s = cuda()?;
        if pool.is_null() || props.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // CUmemPoolProps: allocType, handleTypes, then a CUmemLocation.
        let loc = (props as *const u8).add(8).cast::<CUmemLocation>().read_unaligned();
        if loc.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = s.dev(loc.id)?;
        *pool = objects::leak(Pool::new(d, false)).handle();
        Ok(())
    }

    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        cuda()?;
        let p = Pool::from_handle(pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if p.is_default {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        p.kill();
        Ok(())
    }

    fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        _flags: u64,
    ) {
        let s = cuda()?;
        if handle.is_null() || prop.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = prop.read_unaligned();
        let loc = p.location;
        if loc.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = s.dev(loc.id)?;
        let h = charge(s, Kind::Vmm, d, size as u64, 0)?;
        let mut r = reg();
        r.vmm.insert(h, Phys { refs: 1, maps: 0, types: p.requestedHandleTypes });
        r.handles.insert(h, (h, 1));
        *handle = h;
        Ok(())
    }

    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        let s = cuda()?;
        let (phys, free) = {
            let mut r = reg();
            let (phys, refs) = r
                .handles
                .get_mut(&handle)
                .filter(|e| e.1 > 0)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            *refs -= 1;
            let phys = *phys;
            if let Some(p) = r.vmm.get_mut(&phys) {
                p.refs -= 1;
            }
            (phys, r.settle(phys))
        };
        if free {
            uncharge(s, Kind::Vmm, phys, CUDA_ERROR_INVALID_VALUE)?;
        }
        Ok(())
    }

    /// The handle that maps `addr`, with one more reference.
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        cuda()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let a = addr as u64;
        let mut r = reg();
        let h = r
            .mapped
            .range(..=a)
            .next_back()
            .filter(|(start, (_, len))| a < *start + *len)
            .map(|(_, (h, _))| *h)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (phys, refs) = r.handles.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        *refs += 1;
        let phys = *phys;
        r.vmm.get_mut(&phys).ok_or(CUDA_ERROR_INVALID_VALUE)?.refs += 1;
        *handle = h;
        Ok(())
    }

    /// A file descriptor for the allocation (only
    /// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, and only if `cuMemCreate`
    /// asked for it). It holds no reference of its own.
    fn cuMemExportToShareableHandle(
        shareable: *mut c_void,
        handle: CUmemGenericAllocationHandle,
        kind: c_uint,
        _flags: u64,
    ) {
        cuda()?;
        if shareable.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut r = reg();
        let phys = r
            .handles
            .get(&handle)
            .filter(|e| e.1 > 0)
            .map(|e| e.0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let types = r.vmm.get(&phys).ok_or(CUDA_ERROR_INVALID_VALUE)?.types;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || types & kind == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let fd = libc::memfd_create(c"gpufrac-sim-vmm".as_ptr(), libc::MFD_CLOEXEC);
        if fd < 0 {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let Some(ino) = inode(fd) else {
            libc::close(fd);
            return Err(CUDA_ERROR_UNKNOWN);
        };
        r.exported.insert(ino, phys);
        shareable.cast::<c_int>().write_unaligned(fd);
        Ok(())
    }

    /// A new handle, with one reference, to the allocation an exported file
    /// descriptor stands for (exported by this process: another process's
    /// allocations are not modelled).
    fn cuMemImportFromShareableHandle(
        handle: *mut CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        kind: c_uint,
    ) {
        cuda()?;
        if handle.is_null() || kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ino = inode(os_handle as usize as c_int).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let h = alloc_va(1, 512)?;
        let mut r = reg();
        let phys = *r.exported.get(&ino).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        r.vmm.get_mut(&phys).ok_or(CUDA_ERROR_INVALID_VALUE)?.refs += 1;
        r.handles.insert(h, (phys, 1));
        *handle = h;
        Ok(())
    }

    fn cuMemAddressReserve(
        ptr: *mut CUdeviceptr,
        size: usize,
        align: usize,
        _addr: CUdeviceptr,
        _flags: u64,
    ) {
        cuda()?;
        if ptr.is_null() || size == 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = alloc_va(size as u64, (align as u64).max(GRANULARITY))?;
        reg().reserved.insert(va, size as u64);
        *ptr = va;
        Ok(())
    }

    fn cuMemAddressFree(ptr: CUdeviceptr, _size: usize) {
        cuda()?;
        reg().reserved.remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(())
    }

    fn cuMemMap(ptr: CUdeviceptr, size: usize, _offset: usize, handle: CUmemGenericAllocationHandle, _flags: u64) {
        cuda()?;
        let mut r = reg();
        // A released handle cannot be mapped again, even while its memory
        // lives on in another mapping.
        let Some(&(phys, refs)) = r.handles.get(&handle) else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        if refs == 0 || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inside = r
            .reserved
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&start, &len)| ptr.checked_add(size as u64).is_some_and(|e| e <= start + len));
        if !inside || r.mapped.contains_key(&ptr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        r.mapped.insert(ptr, (handle, size as u64));
        r.vmm.get_mut(&phys).ok_or(CUDA_ERROR_INVALID_VALUE)?.maps += 1;
        Ok(())
    }

    /// Unmaps the whole mappings in the range (it must start at one and may
    /// span several; cutting one is refused, as the driver does). A handle
    /// released earlier is freed with its last mapping.
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        let s = cuda()?;
        let end = ptr.checked_add(size as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let freed: Vec<u64> = {
            let mut r = reg();
            if size == 0 || !r.mapped.contains_key(&ptr) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let inside: Vec<(u64, u64)> = r
                .mapped
                .range(ptr..end)
                .map(|(&st, &(_, len))| (st, st + len))
                .collect();
            if inside.iter().any(|&(_, e)| e > end) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let mut freed = Vec::new();
            for (st, _) in inside {
                let (h, _) = r.mapped.remove(&st).expect("listed above");
                let Some(&(phys, _)) = r.handles.get(&h) else {
                    continue;
                };
                if let Some(p) = r.vmm.get_mut(&phys) {
                    p.maps -= 1;
                }
                if r.settle(phys) {
                    freed.push(phys);
                }
            }
            freed
        };
        for h in freed {
            uncharge(s, Kind::Vmm, h, CUDA_ERROR_INVALID_VALUE)?;
        }
        Ok(())
    }

    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const c_void, count: usize) {
        cuda()?;
        if ptr == 0 || size == 0 || desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    fn cuMemGetAllocationGranularity(gran: *mut usize, prop: *const CUmemAllocationProp, _option: c_int) {
        cuda()?;
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(gran, GRANULARITY as usize, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuArrayCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        cuda()?;
        if desc.is_null() || (*desc).Width == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        array_charge(Kind::Array, arr, array2d_bytes(&*desc))
    }

    fn cuArray3DCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        cuda()?;
        if desc.is_null() || (*desc).Width == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        array_charge(Kind::Array, arr, array3d_bytes(&*desc, 0))
    }

    fn cuArrayDestroy(arr: CUarray) {
        uncharge(cuda()?, Kind::Array, arr as u64, CUDA_ERROR_INVALID_HANDLE)
    }

    fn cuMipmappedArrayCreate(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) {
        cuda()?;
        if desc.is_null() || (*desc).Width == 0 || levels == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = &*desc;
        let bytes = (0..levels.min(64)).fold(0usize, |acc, l| acc.saturating_add(array3d_bytes(d, l)));
        array_charge(Kind::Mipmap, arr, bytes)
    }

    fn cuMipmappedArrayDestroy(arr: CUmipmappedArray) {
        uncharge(cuda()?, Kind::Mipmap, arr as u64, CUDA_ERROR_INVALID_HANDLE)
    }

    fn cuArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, arr: CUarray, dev: CUdevice) {
        requirements(req, Kind::Array, arr, dev)
    }

    fn cuMipmappedArrayGetMemoryRequirements(
        req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS,
        arr: CUmipmappedArray,
        dev: CUdevice,
    ) {
        requirements(req, Kind::Mipmap, arr, dev)
    }

    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let s = cuda()?;
        let c = objects::current()?;
        if free.is_null() || total.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let t = s.totals[c.device];
        *total = t as usize;
        *free = t.saturating_sub(s.used(c.device)) as usize;
        Ok(())
    }

    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) {
        sync_copy(false, n == 0 || (dst != 0 && !src.is_null()))
    }

    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) {
        sync_copy(false, n == 0 || (!dst.is_null() && src != 0))
    }

    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        async_op(std::ptr::null_mut(), false, n == 0 || (dst != 0 && src != 0))
    }

    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) {
        sync_copy(true, n == 0 || (dst != 0 && !src.is_null()))
    }

    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) {
        sync_copy(true, n == 0 || (!dst.is_null() && src != 0))
    }

    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        async_op(std::ptr::null_mut(), true, n == 0 || (dst != 0 && src != 0))
    }

    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
        async_op(stream, false, n == 0 || (dst != 0 && !src.is_null()))
    }

    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
        async_op(stream, false, n == 0 || (!dst.is_null() && src != 0))
    }

    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
        async_op(stream, true, n == 0 || (dst != 0 && !src.is_null()))
    }

    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
        async_op(stream, true, n == 0 || (!dst.is_null() && src != 0))
    }

    fn cuMemsetD8_v2(dst: CUdeviceptr, _value: u8, n: usize) {
        async_op(std::ptr::null_mut(), false, n == 0 || dst != 0)
    }

    fn cuMemsetD32_v2(dst: CUdeviceptr, _value: c_uint, n: usize) {
        async_op(std::ptr::null_mut(), false, n == 0 || dst != 0)
    }

    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        async_op(stream, false, n == 0 || (dst != 0 && src != 0))
    }

    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        async_op(stream, true, n == 0 || (dst != 0 && src != 0))
    }

    fn cuMemsetD8Async(dst: CUdeviceptr, _value: u8, n: usize, stream: CUstream) {
        async_op(stream, false, n == 0 || dst != 0)
    }

    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, _value: u8, n: usize, stream: CUstream) {
        async_op(stream, true, n == 0 || dst != 0)
    }

    fn cuMemsetD32Async(dst: CUdeviceptr, _value: c_uint, n: usize, stream: CUstream) {
        async_op(stream, false, n == 0 || dst != 0)
    }

    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, _value: c_uint, n: usize, stream: CUstream) {
        async_op(stream, true, n == 0 || dst != 0)
    }

    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(pool, s.default_pools[d].handle(), CUDA_ERROR_INVALID_VALUE)
    }

    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, _value: u8, n: usize) {
        async_op(std::ptr::null_mut(), true, n == 0 || dst != 0)
    }

    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, _value: c_uint, n: usize) {
        async_op(std::ptr::null_mut(), true, n == 0 || dst != 0)
    }

    fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, _flags: c_uint) {
        host_alloc(pp, size)
    }

    fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) {
        host_alloc(pp, size)
    }

    fn cuMemFreeHost(p: *mut c_void) {
        cuda()?;
        if !reg().host.remove(&(p as usize)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        libc::free(p);
        Ok(())
    }
}
