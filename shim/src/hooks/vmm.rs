//! VMM lifetimes, as the driver has them: the memory of a physical
//! allocation (`cuMemCreate`) lives until no handle to it holds a reference
//! *and* its last mapping is unmapped. `cuMemCreate` makes a handle with
//! one reference, `cuMemRetainAllocationHandle` adds one to the handle that
//! maps an address, and `cuMemImportFromShareableHandle` makes another
//! handle, with a reference of its own, to the same memory. Releasing a
//! handle right after `cuMemMap`, the documented idiom, frees nothing, and
//! neither does releasing the handle that was charged while an imported
//! one lives; charging stops only when the driver really lets the memory go
//! (8 × 1 GiB once passed a 2 GiB cap on an H100 because the shim stopped
//! charging at the release).
//!
//! An import is matched to the allocation it stands for by the exported
//! file descriptor's inode, recorded at `cuMemExportToShareableHandle`: an
//! allocation exported by this process. One exported by another process
//! is charged there, for as long as that process holds it.
//!
//! One mutex over the tables, held across the driver call of each VMM
//! entry point: a handle value the driver frees and hands out again cannot
//! be recorded and forgotten out of order. VMM calls are rare (allocator
//! growth), never on a launch path.

use crate::boundary::{HookGuard, reentered};
use super::accounting;
use crate::charge::{Accounting, refuse};
use crate::driver::call;
use crate::ledger::{self, Entry, Kind};
use gpufrac_common::cuda::*;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A physical allocation the shim charged (keyed by the handle
/// `cuMemCreate` returned, the key of its charge).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Phys {
    /// References held by all of its handles.
    pub refs: u32,
    pub maps: u32,
}

#[derive(Debug, Default)]
pub struct Tables {
    pub phys: BTreeMap<CUmemGenericAllocationHandle, Phys>,
    /// Handles to charged allocations: handle -> (allocation, references).
    pub handles: BTreeMap<CUmemGenericAllocationHandle, (CUmemGenericAllocationHandle, u32)>,
    /// Mappings: start address -> (allocation, length).
    pub maps: BTreeMap<CUdeviceptr, (CUmemGenericAllocationHandle, u64)>,
    /// Exported file descriptors, by (device, inode) of the file: the
    /// allocation each stands for.
    pub exported: BTreeMap<(u64, u64), CUmemGenericAllocationHandle>,
}

impl Tables {
    /// A new allocation behind handle `h`, one reference.
    pub fn created(&mut self, h: CUmemGenericAllocationHandle) {
        self.phys.insert(h, Phys { refs: 1, maps: 0 });
        self.handles.insert(h, (h, 1));
    }

    /// One more reference through handle `h` (a retain, or a new handle
    /// `h` to `phys` by an import). False if the memory is not charged.
    pub fn referenced(
        &mut self,
        h: CUmemGenericAllocationHandle,
        phys: Option<CUmemGenericAllocationHandle>,
    ) -> bool {
        let phys = match phys {
            Some(p) => p,
            None => match self.handles.get(&h) {
                Some(&(p, _)) => p,
                None => return false,
            },
        };
        let Some(p) = self.phys.get_mut(&phys) else {
            return false;
        };
        p.refs += 1;
        self.handles.entry(h).or_insert((phys, 0)).1 += 1;
        true
    }

    /// Handle `h` released once; the allocation it frees, if any.
    pub fn released(
        &mut self,
        h: CUmemGenericAllocationHandle,
    ) -> Option<CUmemGenericAllocationHandle> {
        let (phys, refs) = self.handles.get_mut(&h)?;
        *refs = refs.saturating_sub(1);
        let phys = *phys;
        if let Some(p) = self.phys.get_mut(&phys) {
            p.refs = p.refs.saturating_sub(1);
        }
        self.settle(phys)
    }

    /// `len` bytes of handle `h` mapped at `at`.
    pub fn mapped(&mut self, at: CUdeviceptr, len: u64, h: CUmemGenericAllocationHandle) {
        let Some(&(phys, _)) = self.handles.get(&h) else {
            return;
        };
        if let Some(p) = self.phys.get_mut(&phys) {
            p.maps += 1;
            self.maps.insert(at, (phys, len));
        }
    }

    /// Every whole mapping inside `[at, at + len)` unmapped (the driver
    /// refuses to cut one); the allocations that frees.
    pub fn unmapped(&mut self, at: CUdeviceptr, len: u64) -> Vec<CUmemGenericAllocationHandle> {
        let end = at.saturating_add(len);
        let gone: Vec<(CUdeviceptr, CUmemGenericAllocationHandle)> = self
            .maps
            .range(at..end)
            .filter(|(s, (_, l))| s.saturating_add(*l) <= end)
            .map(|(s, (p, _))| (*s, *p))
            .collect();
        let mut freed = Vec::new();
        for (s, phys) in gone {
            self.maps.remove(&s);
            if let Some(p) = self.phys.get_mut(&phys) {
                p.maps = p.maps.saturating_sub(1);
            }
            freed.extend(self.settle(phys));
        }
        freed
    }

    /// Forgets `phys` once nothing holds it; it, to be uncharged.
    fn settle(
        &mut self,
        phys: CUmemGenericAllocationHandle,
    ) -> Option<CUmemGenericAllocationHandle> {
        if self.phys.get(&phys)? != &(Phys { refs: 0, maps: 0 }) {
            return None;
        }
        self.phys.remove(&phys);
        self.handles.retain(|_, (p, _)| *p != phys);
        self.exported.retain(|_, p| *p != phys);
        Some(phys)
    }
}

/// Published once and never freed; a fork child swaps in a fresh one (the
/// old lock may be held by a thread that does not exist there) and leaks
/// the old on purpose.
static TABLES: AtomicPtr<Mutex<Tables>> = AtomicPtr::new(std::ptr::null_mut());

fn fresh() -> *mut Mutex<Tables> {
    Box::into_raw(Box::new(Mutex::new(Tables::default())))
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
            Ok(_) => f,
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

/// Gives the charge of allocations nothing holds any more back.
fn uncharge(freed: impl IntoIterator<Item = CUmemGenericAllocationHandle>) {
    for phys in freed {
        if let Some(e) = ledger::remove(Kind::Vmm, phys) {
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
    t.created(h);
    CUDA_SUCCESS
}

/// Runs a VMM entry point with the tables held, unless accounting is off
/// for this call (re-entered from the driver, or not initialised).
fn with_tables(real: impl FnOnce() -> u32, after: impl FnOnce(&mut Tables)) -> u32 {
    if reentered() {
        return real();
    }
    match accounting() {
        Accounting::Pass => return real(),
        Accounting::Refuse(_) | Accounting::Account => {}
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
        |t| uncharge(t.released(h)),
    )
}

pub unsafe fn retain(out: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> u32 {
    with_tables(
        || unsafe { call::cuMemRetainAllocationHandle(out, addr) },
        |t| {
            // SAFETY: the driver wrote the handle on success.
            let h = unsafe { out.read_unaligned() };
            t.referenced(h, None);
        },
    )
}

/// The (device, inode) of an open file descriptor.
fn file_key(fd: c_int) -> Option<(u64, u64)> {
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: an out-pointer to a local.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

pub unsafe fn export(
    shareable: *mut c_void,
    h: CUmemGenericAllocationHandle,
    kind: c_uint,
    flags: u64,
) -> u32 {
    with_tables(
        || unsafe { call::cuMemExportToShareableHandle(shareable, h, kind, flags) },
        |t| {
            if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || shareable.is_null() {
                return;
            }
            // SAFETY: the driver wrote the descriptor there.
            let fd = unsafe { shareable.cast::<c_int>().read_unaligned() };
            if let (Some(key), Some(&(phys, _))) = (file_key(fd), t.handles.get(&h)) {
                t.exported.insert(key, phys);
            }
        },
    )
}

pub unsafe fn import(
    out: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    kind: c_uint,
) -> u32 {
    with_tables(
        || unsafe { call::cuMemImportFromShareableHandle(out, os_handle, kind) },
        |t| {
            if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
                return;
            }
            // SAFETY: the driver wrote the handle on success.
            let h = unsafe { out.read_unaligned() };
            let phys =
                file_key(os_handle as usize as c_int).and_then(|k| t.exported.get(&k).copied());
            if let Some(phys) = phys {
                t.referenced(h, Some(phys));
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
        |t| t.mapped(ptr, size as u64, h),
    )
}

pub unsafe fn unmap(ptr: CUdeviceptr, size: usize) -> u32 {
    with_tables(
        || unsafe { call::cuMemUnmap(ptr, size) },
        |t| uncharge(t.unmapped(ptr, size as u64)),
    )
}

/// A forked child starts with its own (empty) tables, as the ledger does
/// (`hooks::process` calls this in the child). Tables never made stay
/// unmade.
pub fn reset_after_fork() {
    if !TABLES.load(Ordering::Acquire).is_null() {
        TABLES.store(fresh(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_lives_until_the_last_reference_and_mapping_go() {
        let mut t = Tables::default();
        t.created(7);
        t.mapped(0x1000, 64, 7);
        assert!(t.referenced(7, None), "a retain through the mapping");
        assert_eq!(t.released(7), None);
        assert_eq!(t.released(7), None, "still mapped");
        assert_eq!(t.unmapped(0x1000, 64), vec![7]);
        assert!(t.phys.is_empty() && t.handles.is_empty());
        // A retain of memory the shim does not charge changes nothing.
        assert!(!t.referenced(9, None));
        assert!(t.handles.is_empty());
    }

    #[test]
    fn an_imported_handle_keeps_the_memory_after_the_charged_one_goes() {
        let mut t = Tables::default();
        t.created(7);
        t.exported.insert((1, 2), 7);
        assert!(t.referenced(8, Some(7)), "imported as handle 8");
        t.mapped(0x1000, 64, 7);
        assert_eq!(t.released(7), None, "handle 8 and the mapping hold it");
        assert_eq!(t.unmapped(0x1000, 64), vec![], "handle 8 holds it");
        t.mapped(0x2000, 64, 8);
        assert_eq!(t.released(8), None, "mapped through handle 8");
        assert_eq!(t.unmapped(0x2000, 64), vec![7], "gone with the last");
        assert!(t.phys.is_empty() && t.handles.is_empty() && t.exported.is_empty());
    }

    /// Random sequences of what a program may do with handles, against the
    /// driver's rule: an allocation is charged while any handle to it holds
    /// a reference or anything maps it, and uncharged exactly once, when
    /// the last of those goes. (A property test in the style of the
    /// broker's, on a small generator of its own: the shim takes no
    /// dependencies.)
    #[test]
    fn charges_follow_references_and_mappings_in_any_order() {
        // handle -> (allocation, references); mapping address -> allocation.
        type Model = (BTreeMap<u64, (u64, u32)>, BTreeMap<u64, u64>);
        fn alive(m: &Model, phys: u64) -> bool {
            m.0.values().any(|&(p, r)| p == phys && r > 0) || m.1.values().any(|&p| p == phys)
        }
        for seed in 1..200u64 {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut next = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let mut t = Tables::default();
            let mut m: Model = Default::default();
            let mut charged: BTreeMap<u64, ()> = BTreeMap::new();
            let (mut next_h, mut next_at) = (1u64, 0x1000u64);
            for _ in 0..60 {
                let handles: Vec<u64> = m.0.iter().filter(|e| e.1.1 > 0).map(|e| *e.0).collect();
                let pick = |i: u64, v: &[u64]| v[(i % v.len() as u64) as usize];
                match next(5) {
                    0 => {
                        t.created(next_h);
                        m.0.insert(next_h, (next_h, 1));
                        charged.insert(next_h, ());
                        next_h += 1;
                    }
                    1 if !handles.is_empty() => {
                        // An import of a live handle's allocation, or a
                        // retain through one of its handles.
                        let h = pick(next(64), &handles);
                        let phys = m.0[&h].0;
                        if next(2) == 0 {
                            assert!(t.referenced(next_h, Some(phys)));
                            m.0.insert(next_h, (phys, 1));
                            next_h += 1;
                        } else {
                            assert!(t.referenced(h, None));
                            m.0.get_mut(&h).unwrap().1 += 1;
                        }
                    }
                    2 if !handles.is_empty() => {
                        let h = pick(next(64), &handles);
                        t.mapped(next_at, 0x100, h);
                        m.1.insert(next_at, m.0[&h].0);
                        next_at += 0x100;
                    }
                    3 if !handles.is_empty() => {
                        let h = pick(next(64), &handles);
                        let phys = m.0[&h].0;
                        m.0.get_mut(&h).unwrap().1 -= 1;
                        let freed = t.released(h);
                        let gone = !alive(&m, phys);
                        assert_eq!(freed, gone.then_some(phys), "seed {seed}");
                        if gone {
                            assert!(charged.remove(&phys).is_some(), "uncharged once");
                            m.0.retain(|_, e| e.0 != phys);
                        }
                    }
                    4 if !m.1.is_empty() => {
                        let ats: Vec<u64> = m.1.keys().copied().collect();
                        let at = pick(next(64), &ats);
                        let phys = m.1.remove(&at).unwrap();
                        let freed = t.unmapped(at, 0x100);
                        let gone = !alive(&m, phys);
                        assert_eq!(freed, gone.then_some(phys).into_iter().collect::<Vec<_>>());
                        if gone {
                            assert!(charged.remove(&phys).is_some(), "uncharged once");
                            m.0.retain(|_, e| e.0 != phys);
                        }
                    }
                    _ => {}
                }
                let live: Vec<u64> = t.phys.keys().copied().collect();
                let want: Vec<u64> = charged.keys().copied().collect();
                assert_eq!(live, want, "seed {seed}: charged allocations");
            }
        }
    }

    #[test]
    fn a_range_unmaps_only_the_whole_mappings_inside_it() {
        let mut t = Tables::default();
        t.created(7);
        t.mapped(0x1000, 0x100, 7);
        t.mapped(0x1100, 0x100, 7);
        assert_eq!(t.released(7), None);
        assert_eq!(t.unmapped(0x1000, 0x180), vec![], "the second is cut: kept");
        assert_eq!(t.phys[&7], Phys { refs: 0, maps: 1 });
        assert_eq!(t.unmapped(0x1100, 0x100), vec![7]);
    }
}
