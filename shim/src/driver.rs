//! The real libraries under the shim: a slot per real function the shim
//! calls (generated from the one hook list), typed callers for them, and
//! the loading that fills the slots — libcuda.so.1 at initialisation,
//! NVML and cudart when a hook of theirs is first used. glibc's own `dlsym`
//! is found here too, for the shim's lookups and for the `dlsym` export.

use gpufrac_common::cuda::*;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// Which library a real function lives in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Family {
    /// libcuda.so.1
    Cuda,
    /// libnvidia-ml.so.1
    Nvml,
    /// libcudart (found with RTLD_NEXT: it may be linked statically or not at all)
    Cudart,
}

impl Family {
    /// What a hook answers when the library it wraps lacks the function.
    pub const fn missing(self) -> u32 {
        match self {
            Family::Cuda => CUDA_ERROR_NOT_FOUND,
            Family::Nvml => NVML_ERROR_FUNCTION_NOT_FOUND,
            Family::Cudart => 500, // cudaErrorSymbolNotFound
        }
    }
}

/// One real function: its name and where its address is kept.
pub struct Slot {
    /// NUL-terminated name.
    pub name: &'static [u8],
    pub family: Family,
    pub real: &'static AtomicUsize,
}

impl Slot {
    pub fn name_str(&self) -> &'static str {
        name_str(self.name)
    }
}

/// A NUL-terminated name from the hook list as text.
pub fn name_str(name: &'static [u8]) -> &'static str {
    // Built from stringify!, so always ASCII.
    std::str::from_utf8(name.strip_suffix(b"\0").unwrap_or(name)).unwrap_or("?")
}

macro_rules! define_slots {
    (
        fail_closed { $( $afam:ident fn $aname:ident ( $($aarg:ident : $aty:ty),* $(,)? ) => $aimp:path; )* }
        pass_through { $( $pfam:ident fn $pname:ident ( $($parg:ident : $pty:ty),* $(,)? ) => $pimp:path; )* }
        pass_through_settled { $( $sfam:ident fn $sname:ident ( $($sarg:ident : $sty:ty),* $(,)? ) => $simp:path; )* }
        internal { $( $ifam:ident fn $iname:ident ( $($iarg:ident : $ity:ty),* $(,)? ); )* }
    ) => {
        /// Slots for the real functions, filled when their library is loaded.
        #[allow(non_upper_case_globals)]
        pub mod real {
            use std::sync::atomic::AtomicUsize;
            $( pub static $aname: AtomicUsize = AtomicUsize::new(0); )*
            $( pub static $pname: AtomicUsize = AtomicUsize::new(0); )*
            $( pub static $sname: AtomicUsize = AtomicUsize::new(0); )*
            $( pub static $iname: AtomicUsize = AtomicUsize::new(0); )*
        }

        /// Typed calls of the real functions.
        #[allow(non_snake_case, clippy::too_many_arguments, dead_code)]
        pub mod call {
            use super::*;
            define_slots!(@callers $( $afam $aname ($($aarg: $aty),*) )* $( $ifam $iname ($($iarg: $ity),*) )*);
            define_slots!(@answering $( $pfam $pname ($($parg: $pty),*) )*);
            define_slots!(@settled $( $sfam $sname ($($sarg: $sty),*) )*);
        }

        /// The settled entry points' real functions, called as they are:
        /// for the boundary to forward a call the hook never made.
        #[allow(non_snake_case, clippy::too_many_arguments, dead_code)]
        pub mod forward {
            use super::*;
            define_slots!(@callers $( $sfam $sname ($($sarg: $sty),*) )*);
        }

        /// Every slot, hooked or not.
        pub static SLOTS: &[Slot] = &[
            $( Slot { name: concat!(stringify!($aname), "\0").as_bytes(), family: Family::$afam, real: &real::$aname }, )*
            $( Slot { name: concat!(stringify!($pname), "\0").as_bytes(), family: Family::$pfam, real: &real::$pname }, )*
            $( Slot { name: concat!(stringify!($sname), "\0").as_bytes(), family: Family::$sfam, real: &real::$sname }, )*
            $( Slot { name: concat!(stringify!($iname), "\0").as_bytes(), family: Family::$ifam, real: &real::$iname }, )*
        ];
    };
    // The real functions of pass-through entry points tell the boundary
    // they were called (see boundary::pass_through).
    (@answering $( $fam:ident $name:ident ($($arg:ident : $ty:ty),*) )*) => {
        $(
            #[inline(always)]
            pub unsafe fn $name($($arg: $ty),*) -> u32 {
                let p = real::$name.load(Ordering::Acquire);
                if p == 0 {
                    return Family::$fam.missing();
                }
                // SAFETY: the slot holds the address of the function of
                // this exact name and C signature (see hooklist.rs).
                let f: unsafe extern "C" fn($($ty),*) -> u32 = unsafe { std::mem::transmute(p) };
                let rc = unsafe { f($($arg),*) };
                crate::boundary::answered(&real::$name as *const AtomicUsize as usize, rc);
                rc
            }
        )*
    };
    // The real functions of settled entry points hand their answer to the
    // hook, which settles it (see boundary::Answer).
    (@settled $( $fam:ident $name:ident ($($arg:ident : $ty:ty),*) )*) => {
        $(
            #[inline(always)]
            pub unsafe fn $name($($arg: $ty),*) -> crate::boundary::Answer {
                let rc = unsafe { super::forward::$name($($arg),*) };
                crate::boundary::Answer::new(rc, stringify!($name))
            }
        )*
    };
    (@callers $( $fam:ident $name:ident ($($arg:ident : $ty:ty),*) )*) => {
        $(
            #[inline(always)]
            pub unsafe fn $name($($arg: $ty),*) -> u32 {
                let p = real::$name.load(Ordering::Acquire);
                if p == 0 {
                    return Family::$fam.missing();
                }
                // SAFETY: the slot holds the address of the function of
                // this exact name and C signature (see hooklist.rs).
                let f: unsafe extern "C" fn($($ty),*) -> u32 = unsafe { std::mem::transmute(p) };
                unsafe { f($($arg),*) }
            }
        )*
    };
}

crate::hooklist::with_hook_list!(define_slots);

/// The real function of a hook that serves both a driver entry point and
/// its per-thread-default-stream twin (`_ptsz`): the twin's when `ptsz`,
/// else the plain one. The twins share one hook, generic over
/// `const PTSZ: bool` (the hook list names it `::<false>` and `::<true>`),
/// so the branch is decided at compile time.
macro_rules! twin {
    ($ptsz:expr, $plain:ident | $per_thread:ident ( $($arg:expr),* $(,)? )) => {
        if $ptsz {
            $crate::driver::call::$per_thread($($arg),*)
        } else {
            $crate::driver::call::$plain($($arg),*)
        }
    };
}
pub(crate) use twin;

/// glibc's own dlsym, found with dlvsym so our export is never returned.
/// Not exported: the `dlsym` trampoline addresses it PC-relative.
pub static GPUFRAC_REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Finds glibc's dlsym (once) and returns its address, 0 if none.
pub fn resolve_real_dlsym() -> usize {
    let cur = GPUFRAC_REAL_DLSYM.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    // dlsym moved into libc in glibc 2.34; older systems only have the
    // 2.2.5 version. Either is the real one.
    for ver in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: dlvsym with constant strings.
        let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), ver.as_ptr()) };
        if !p.is_null() {
            GPUFRAC_REAL_DLSYM.store(p as usize, Ordering::Release);
            return p as usize;
        }
    }
    0
}

/// Calls glibc's dlsym from our own code (so `RTLD_NEXT` here means "after
/// libgpufrac", which is what the shim itself wants).
///
/// # Safety
/// `name` must be NUL-terminated; `handle` a handle dlsym accepts.
pub unsafe fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let p = resolve_real_dlsym();
    if p == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: p is glibc's dlsym.
    let f: DlsymFn = unsafe { std::mem::transmute(p) };
    unsafe { f(handle, name) }
}

/// Loads the real driver and resolves every CUDA slot from *its* handle,
/// so our own exports are never mistaken for the driver's. False when
/// libcuda.so.1 cannot be loaded.
pub fn load_cuda() -> bool {
    // SAFETY: plain dlopen of the driver by its soname.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if h.is_null() {
        return false;
    }
    resolve_family(h, Family::Cuda);
    true
}

fn resolve_family(handle: *mut c_void, fam: Family) {
    for s in SLOTS.iter().filter(|s| s.family == fam) {
        // SAFETY: name is NUL-terminated; real_dlsym is glibc's dlsym.
        let p = unsafe { real_dlsym(handle, s.name.as_ptr().cast()) };
        s.real.store(p as usize, Ordering::Release);
    }
}

const UNLOADED: u8 = 0;
const LOADING: u8 = 1;
const LOADED: u8 = 2;
static NVML_STATE: AtomicU8 = AtomicU8::new(UNLOADED);

/// Loads NVML lazily: only a process that calls an NVML hook pays for it.
pub fn ensure_nvml() {
    if NVML_STATE.load(Ordering::Acquire) == LOADED {
        return;
    }
    if NVML_STATE
        .compare_exchange(UNLOADED, LOADING, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // SAFETY: dlopen by soname; the application already loaded it.
        let h = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
        if !h.is_null() {
            resolve_family(h, Family::Nvml);
        }
        NVML_STATE.store(LOADED, Ordering::Release);
    } else {
        while NVML_STATE.load(Ordering::Acquire) != LOADED {
            std::thread::yield_now();
        }
    }
}

/// cudart may be linked statically, loaded globally, or — as frameworks do
/// — as a dependency of a library opened with RTLD_LOCAL, which RTLD_NEXT
/// cannot see although our export still interposes its callers. So after
/// RTLD_NEXT, every loaded object is asked in turn. `ours` gives the
/// address of the shim's own export of a name, which is never the real one.
pub fn ensure_cudart(ours: impl Fn(&Slot) -> usize) {
    for s in SLOTS.iter().filter(|s| s.family == Family::Cudart) {
        if s.real.load(Ordering::Acquire) != 0 {
            continue;
        }
        // SAFETY: RTLD_NEXT from our own code finds the next definition.
        let mut p = unsafe { real_dlsym(libc::RTLD_NEXT, s.name.as_ptr().cast()) } as usize;
        if p == 0 {
            p = search_loaded_objects(s.name, ours(s));
        }
        debug!("{}: real at {p:#x}", s.name_str());
        s.real.store(p, Ordering::Release);
    }
}

fn search_loaded_objects(name: &'static [u8], ours: usize) -> usize {
    struct Ctx {
        name: &'static [u8],
        ours: usize,
        found: usize,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        let ctx = unsafe { &mut *data.cast::<Ctx>() };
        let obj = unsafe { (*info).dlpi_name };
        if obj.is_null() || unsafe { *obj } == 0 {
            return 0;
        }
        // SAFETY: a path the loader gave us; NOLOAD only takes a reference.
        let h = unsafe { libc::dlopen(obj, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if h.is_null() {
            return 0;
        }
        let p = unsafe { real_dlsym(h, ctx.name.as_ptr().cast()) } as usize;
        unsafe { libc::dlclose(h) };
        if p != 0 && p != ctx.ours {
            ctx.found = p;
            return 1;
        }
        0
    }
    let mut ctx = Ctx {
        name,
        ours,
        found: 0,
    };
    // SAFETY: the callback only reads loader-provided data.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut ctx as *mut Ctx).cast()) };
    ctx.found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_is_named_once() {
        let mut names: Vec<&str> = SLOTS.iter().map(Slot::name_str).collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name listed twice");
        assert!(SLOTS.iter().all(|s| s.name.ends_with(b"\0")));
    }

    #[test]
    fn an_empty_slot_answers_not_found() {
        // Nothing is loaded in a unit test: the driver "lacks" everything.
        let mut n = 0;
        assert_eq!(
            unsafe { call::cuDeviceGetCount(&mut n) },
            CUDA_ERROR_NOT_FOUND
        );
    }
}
