//! Allocation hooks. Each one charges the books before the driver sees the
//! request (`charge.rs`) and never lets a thread past the cap; the driver's
//! own result code always comes back unchanged. Frees give back exactly
//! what was charged.

use crate::boundary::{HookGuard, reentered};
use super::accounting;
use crate::charge::{Accounting, charge, refuse, reserve_then, uncharge};
use crate::devices;
use crate::driver::{call, twin};
use crate::ledger::{self, Entry, Kind};
use gpufrac_common::cuda::*;
use std::ffi::{c_uint, c_void};
use std::sync::Mutex;

macro_rules! gated {
    ($pass:expr, |$dev:ident, $ctx:ident| $body:expr) => {
        match accounting() {
            Accounting::Pass => $pass,
            Accounting::Refuse(code) => code,
            Accounting::Account => {
                let _g = HookGuard::enter();
                match devices::current() {
                    None => $pass,
                    Some(($dev, $ctx)) => $body,
                }
            }
        }
    };
}

/// The common shape of a device-pointer allocation: charged to the current
/// context's device, or to `on` (a pool's device) when given.
fn alloc_ptr(
    dptr: *mut CUdeviceptr,
    size: usize,
    on: Option<usize>,
    real: impl Fn() -> u32,
) -> u32 {
    gated!(real(), |dev, ctx| charge(
        Kind::Ptr,
        on.unwrap_or(dev),
        ctx,
        size as u64,
        &real,
        || unsafe { dptr.read_unaligned() }
    ))
}

pub unsafe fn alloc(dptr: *mut CUdeviceptr, size: usize) -> u32 {
    alloc_ptr(dptr, size, None, || unsafe {
        call::cuMemAlloc_v2(dptr, size)
    })
}

pub unsafe fn alloc_managed(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) -> u32 {
    alloc_ptr(dptr, size, None, || unsafe {
        call::cuMemAllocManaged(dptr, size, flags)
    })
}

/// The driver picks the pitch, so we charge the lower bound first and the
/// padding once we know it; if the padding does not fit, the allocation is
/// undone and the caller gets an ordinary out-of-memory error.
pub unsafe fn alloc_pitch(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> u32 {
    let real = || unsafe { call::cuMemAllocPitch_v2(dptr, pitch, width, height, elem) };
    gated!(real(), |dev, ctx| {
        let lower = (width as u64).saturating_mul(height as u64);
        if lower == 0 {
            return real();
        }
        if let Err(rc) = reserve_then(dev, lower, real) {
            return rc;
        }
        let actual =
            unsafe { (pitch.read_unaligned() as u64).saturating_mul(height as u64) }.max(lower);
        if actual > lower
            && let Err(why) = ledger::reserve(dev, actual - lower)
        {
            unsafe { call::cuMemFree_v2(dptr.read_unaligned()) };
            ledger::unreserve(dev, lower);
            return refuse(dev, actual, why);
        }
        ledger::insert(
            Kind::Ptr,
            unsafe { dptr.read_unaligned() },
            Entry {
                size: actual,
                dev: dev as u32,
                ctx,
            },
        );
        CUDA_SUCCESS
    })
}

/// An asynchronous allocation on a stream being captured becomes a node of
/// the graph: it holds no memory until the graph is launched, and is
/// charged then, as graph memory (`graphmem`).
fn captured_alloc(stream: CUstream, ptsz: bool, real: impl Fn() -> u32) -> Option<u32> {
    if reentered() || !matches!(accounting(), Accounting::Account) {
        return None;
    }
    if !super::graphmem::capturing(stream, ptsz) {
        return None;
    }
    let _g = HookGuard::enter();
    Some(real())
}

/// `cuMemAllocAsync` and its `_ptsz` twin (`driver::twin`).
pub unsafe fn alloc_async<const PTSZ: bool>(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
) -> u32 {
    let real = || unsafe {
        twin!(
            PTSZ,
            cuMemAllocAsync | cuMemAllocAsync_ptsz(dptr, size, stream)
        )
    };
    if let Some(rc) = captured_alloc(stream, PTSZ, real) {
        return rc;
    }
    alloc_ptr(dptr, size, None, real)
}

/// Pools created on a device other than the current one charge that device.
static POOLS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn pool_device(pool: CUmemoryPool) -> Option<usize> {
    let g = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    g.iter().find(|(p, _)| *p == pool as usize).map(|&(_, d)| d)
}

fn remember_pool(pool: CUmemoryPool, dev: usize) {
    let mut g = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    g.retain(|(p, _)| *p != pool as usize);
    g.push((pool as usize, dev));
}

/// `cuMemAllocFromPoolAsync` and its `_ptsz` twin.
pub unsafe fn alloc_pool<const PTSZ: bool>(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> u32 {
    let real = || unsafe {
        twin!(
            PTSZ,
            cuMemAllocFromPoolAsync | cuMemAllocFromPoolAsync_ptsz(dptr, size, pool, stream)
        )
    };
    if let Some(rc) = captured_alloc(stream, PTSZ, real) {
        return rc;
    }
    alloc_ptr(dptr, size, pool_device(pool), real)
}

pub unsafe fn pool_create(pool: *mut CUmemoryPool, props: *const c_void) -> u32 {
    let rc = unsafe { call::cuMemPoolCreate(pool, props) };
    if rc == CUDA_SUCCESS && !props.is_null() && !pool.is_null() {
        // CUmemPoolProps starts like CUmemAllocationProp: the location sits
        // at offset 8 in both.
        let loc = unsafe {
            props
                .cast::<u8>()
                .add(8)
                .cast::<CUmemLocation>()
                .read_unaligned()
        };
        if loc.type_ == CU_MEM_LOCATION_TYPE_DEVICE && loc.id >= 0 {
            remember_pool(unsafe { pool.read_unaligned() }, loc.id as usize);
        }
    }
    rc
}

pub unsafe fn pool_destroy(pool: CUmemoryPool) -> u32 {
    let rc = unsafe { call::cuMemPoolDestroy(pool) };
    if rc == CUDA_SUCCESS {
        POOLS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(p, _)| *p != pool as usize);
    }
    rc
}

pub unsafe fn default_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> u32 {
    let rc = unsafe { call::cuDeviceGetDefaultMemPool(pool, dev) };
    if rc == CUDA_SUCCESS && !pool.is_null() && dev >= 0 {
        remember_pool(unsafe { pool.read_unaligned() }, dev as usize);
    }
    rc
}

pub unsafe fn free(dptr: CUdeviceptr) -> u32 {
    uncharge(Kind::Ptr, dptr, || unsafe { call::cuMemFree_v2(dptr) })
}

/// `cuMemFreeAsync` and its `_ptsz` twin.
pub unsafe fn free_async<const PTSZ: bool>(dptr: CUdeviceptr, stream: CUstream) -> u32 {
    uncharge(Kind::Ptr, dptr, || unsafe {
        twin!(PTSZ, cuMemFreeAsync | cuMemFreeAsync_ptsz(dptr, stream))
    })
}

/// VMM: the device is the one the allocation is *placed* on
/// (`prop->location.id`), whatever context is current. Host-located
/// allocations are not device memory and pass through.
pub unsafe fn create(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> u32 {
    let real = || unsafe { call::cuMemCreate(handle, size, prop, flags) };
    match accounting() {
        Accounting::Pass => real(),
        Accounting::Refuse(code) => code,
        Accounting::Account => {
            if prop.is_null() || handle.is_null() {
                return real();
            }
            // Application memory: never assume Rust's alignment.
            let loc = unsafe { std::ptr::addr_of!((*prop).location).read_unaligned() };
            if loc.type_ != CU_MEM_LOCATION_TYPE_DEVICE || loc.id < 0 {
                return real();
            }
            let _g = HookGuard::enter();
            if size == 0 {
                return real();
            }
            super::vmm::create(handle, loc.id as usize, size as u64, real)
        }
    }
}

/// Arrays: charged from the descriptor first, then corrected to what the
/// driver says the array really occupies (alignment and padding included).
fn charge_array(
    dev: usize,
    ctx: usize,
    estimate: u64,
    real: impl FnOnce() -> u32,
    handle: impl FnOnce() -> usize,
    exact: impl FnOnce(usize) -> Option<u64>,
    destroy: impl FnOnce(usize),
) -> u32 {
    if estimate == 0 {
        return real();
    }
    if let Err(rc) = reserve_then(dev, estimate, real) {
        return rc;
    }
    let h = handle();
    let mut size = estimate;
    if let Some(real_size) = exact(h).filter(|&s| s > 0) {
        if real_size > estimate {
            if let Err(why) = ledger::reserve(dev, real_size - estimate) {
                destroy(h);
                ledger::unreserve(dev, estimate);
                return refuse(dev, real_size, why);
            }
        } else {
            ledger::unreserve(dev, estimate - real_size);
        }
        size = real_size;
    }
    ledger::insert(
        Kind::Array,
        h as u64,
        Entry {
            size,
            dev: dev as u32,
            ctx,
        },
    );
    CUDA_SUCCESS
}

fn array_exact(arr: usize, dev: usize) -> Option<u64> {
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    let rc =
        unsafe { call::cuArrayGetMemoryRequirements(&mut req, arr as CUarray, dev as CUdevice) };
    (rc == CUDA_SUCCESS).then_some(req.size as u64)
}

fn mipmap_exact(arr: usize, dev: usize) -> Option<u64> {
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    let rc = unsafe {
        call::cuMipmappedArrayGetMemoryRequirements(
            &mut req,
            arr as CUmipmappedArray,
            dev as CUdevice,
        )
    };
    (rc == CUDA_SUCCESS).then_some(req.size as u64)
}

/// A plain (non-mipmapped) array of `estimate` bytes from its descriptor,
/// corrected to the driver's figure once it exists.
fn plain_array(arr: *mut CUarray, estimate: u64, real: impl Fn() -> u32) -> u32 {
    gated!(real(), |dev, ctx| charge_array(
        dev,
        ctx,
        estimate,
        &real,
        || unsafe { arr.read_unaligned() as usize },
        |h| array_exact(h, dev),
        |h| unsafe {
            call::cuArrayDestroy(h as CUarray);
        }
    ))
}

pub unsafe fn array_create(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> u32 {
    let real = || unsafe { call::cuArrayCreate_v2(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return real();
    }
    plain_array(
        arr,
        array2d_bytes(&unsafe { desc.read_unaligned() }) as u64,
        real,
    )
}

pub unsafe fn array3d_create(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> u32 {
    let real = || unsafe { call::cuArray3DCreate_v2(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return real();
    }
    plain_array(
        arr,
        array3d_bytes(&unsafe { desc.read_unaligned() }, 0) as u64,
        real,
    )
}

pub unsafe fn mipmap_create(
    arr: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> u32 {
    let real = || unsafe { call::cuMipmappedArrayCreate(arr, desc, levels) };
    if desc.is_null() || arr.is_null() {
        return real();
    }
    let d = &unsafe { desc.read_unaligned() };
    let estimate: u64 = (0..levels.min(32))
        .map(|l| array3d_bytes(d, l) as u64)
        .sum();
    gated!(real(), |dev, ctx| charge_array(
        dev,
        ctx,
        estimate,
        real,
        || unsafe { arr.read_unaligned() as usize },
        |h| mipmap_exact(h, dev),
        |h| unsafe {
            call::cuMipmappedArrayDestroy(h as CUmipmappedArray);
        }
    ))
}

pub unsafe fn array_destroy(arr: CUarray) -> u32 {
    uncharge(Kind::Array, arr as u64, || unsafe {
        call::cuArrayDestroy(arr)
    })
}

pub unsafe fn mipmap_destroy(arr: CUmipmappedArray) -> u32 {
    uncharge(Kind::Array, arr as u64, || unsafe {
        call::cuMipmappedArrayDestroy(arr)
    })
}
