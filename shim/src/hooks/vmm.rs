//! VMM lifetimes, as the driver has them: the memory of a physical
//! allocation (`cuMemCreate`) lives until its last reference is released
//! (`cuMemCreate` holds one, `cuMemRetainAllocationHandle` adds one) *and*
//! its last mapping is unmapped. Releasing a handle right after `cuMemMap`,
//! the documented idiom, frees nothing; charging stops only when the driver
//! really lets the memory go (8 × 1 GiB once passed a 2 GiB cap on an H100
//! because the shim stopped charging at the release).
//!
//! One mutex over the handle and mapping tables, held across the driver call
//! of each VMM entry point: a handle value the driver frees and hands out
//! again cannot be recorded and forgotten out of order. VMM calls are rare
//! (allocator growth), never on a launch path.

use crate::boundary::{HookGuard, reentered};
use crate::driver::call;
use crate::gate::{Gate, gate, refuse};
use crate::ledger::{self, Entry, Kind};
use gpufrac_common::cuda::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard};

struct Handle {
    refs: u32,
    maps: u32,
}

struct Tables {
    /// Physical allocations the shim charged, by handle.
    handles: BTreeMap<CUmemGenericAllocationHandle, Handle>,
    /// Mappings: start address -> (handle, length).
    maps: BTreeMap<CUdeviceptr, (CUmemGenericAllocationHandle, u64)>,
}

/// Published once and never freed; a fork child swaps in a fresh one (the
/// old lock may be held by a thread that does not exist there) and leaks
/// the old on purpose.
static TABLES: AtomicPtr<Mutex<Tables>> = AtomicPtr::new(std::ptr::null_mut());

fn fresh() -> *mut Mutex<Tables> {
    Box::into_raw(Box::new(Mutex::new(Tables {
        handles: BTreeMap::new(),
        maps: BTreeMap::new(),
    })))
}

fn tables() -> MutexGuard<'static, Tables> {
    let mut p = TABLES.load(Ordering::Acquire);
    if p.is_null() {
        let f = fresh();
        p = match TABLES.compare_exchange(
            std::ptr::null_mut(),
            f,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // SAFETY: registering a plain extern "C" callback, once.
                unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
                f
            }
            Err(winner) => {
                // SAFETY: ours, never published.
                drop(unsafe { Box::from_raw(f) });
                winner
            }
        };
    }
    // SAFETY: never freed once published.
    unsafe { &*p }.lock().unwrap_or_else(|e| e.into_inner())
}

/// Gives a handle's charge back once nothing holds it.
fn settle(t: &mut Tables, h: CUmemGenericAllocationHandle) {
    if t.handles
        .get(&h)
        .is_some_and(|x| x.refs == 0 && x.maps == 0)
    {
        t.handles.remove(&h);
        if let Some(e) = ledger::remove(Kind::Vmm, h) {
            ledger::unreserve(e.dev as usize, e.size);
        }
    }
}

/// `cuMemCreate` on a device: reserve, create, record one reference.
pub fn create(
    handle: *mut CUmemGenericAllocationHandle,
    dev: usize,
    size: u64,
    real: impl FnOnce() -> u32,
) -> u32 {
    let mut t = tables();
    if let Err(why) = ledger::reserve(dev, size) {
        return refuse(dev, size, why);
    }
    let rc = real();
    if rc != CUDA_SUCCESS {
        ledger::unreserve(dev, size);
        return rc;
    }
    // SAFETY: the driver just wrote the handle there.
    let h = unsafe { handle.read_unaligned() };
    ledger::insert(
        Kind::Vmm,
        h,
        Entry {
            size,
            dev: dev as u32,
            ctx: 0,
        },
    );
    t.handles.insert(h, Handle { refs: 1, maps: 0 });
    CUDA_SUCCESS
}

/// Runs a VMM entry point with the tables held, unless accounting is off
/// for this call (re-entered from the driver, or not initialised).
fn with_tables(real: impl FnOnce() -> u32, after: impl FnOnce(&mut Tables)) -> u32 {
    if reentered() {
        return real();
    }
    match gate() {
        Gate::Pass => return real(),
        Gate::Refuse(_) | Gate::Account => {}
    }
    let _g = HookGuard::enter();
    let mut t = tables();
    let rc = real();
    if rc == CUDA_SUCCESS {
        after(&mut t);
    }
    rc
}

pub unsafe fn release(h: CUmemGenericAllocationHandle) -> u32 {
    with_tables(
        || unsafe { call::cuMemRelease(h) },
        |t| {
            if let Some(x) = t.handles.get_mut(&h) {
                x.refs = x.refs.saturating_sub(1);
                settle(t, h);
            }
        },
    )
}

pub unsafe fn retain(out: *mut CUmemGenericAllocationHandle, addr: *mut std::ffi::c_void) -> u32 {
    with_tables(
        || unsafe { call::cuMemRetainAllocationHandle(out, addr) },
        |t| {
            // SAFETY: the driver wrote the handle on success.
            let h = unsafe { out.read_unaligned() };
            if let Some(x) = t.handles.get_mut(&h) {
                x.refs += 1;
            }
        },
    )
}

pub unsafe fn map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    h: CUmemGenericAllocationHandle,
    flags: u64,
) -> u32 {
    with_tables(
        || unsafe { call::cuMemMap(ptr, size, offset, h, flags) },
        |t| {
            if let Some(x) = t.handles.get_mut(&h) {
                x.maps += 1;
                t.maps.insert(ptr, (h, size as u64));
            }
        },
    )
}

/// Unmaps every whole mapping inside the range (the driver refuses to cut
/// one), and frees handles nothing holds any more.
pub unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> u32 {
    with_tables(
        || unsafe { call::cuMemUnmap(ptr, size) },
        |t| {
            let end = ptr.saturating_add(size as u64);
            let gone: Vec<(CUdeviceptr, CUmemGenericAllocationHandle)> = t
                .maps
                .range(ptr..end)
                .filter(|(s, (_, len))| s.saturating_add(*len) <= end)
                .map(|(s, (h, _))| (*s, *h))
                .collect();
            for (s, h) in gone {
                t.maps.remove(&s);
                if let Some(x) = t.handles.get_mut(&h) {
                    x.maps = x.maps.saturating_sub(1);
                    settle(t, h);
                }
            }
        },
    )
}

/// A forked child starts with its own (empty) books, as the ledger does.
extern "C" fn after_fork_child() {
    TABLES.store(fresh(), Ordering::Release);
}
