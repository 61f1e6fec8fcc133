//! Our `dlsym`. Programs that find the driver with `dlopen` + `dlsym`
//! (cudart, cudarc, ctypes, nvidia-smi) get our hooks for the names in the
//! table; every other lookup must behave exactly as if we were not here.
//!
//! glibc resolves `RTLD_NEXT` relative to the *caller* of `dlsym`, read from
//! the return address. A Rust function that forwards the call would make
//! every library's `dlsym(RTLD_NEXT, …)` relative to us instead — another
//! preloaded interposer would then find itself and recurse. So on x86-64 the
//! export is a naked trampoline: it asks `decide` (which neither allocates
//! nor locks) and, for names we do not hook, tail-jumps into the real
//! `dlsym` with the caller's return address still on the stack.

use crate::driver::{self, GPUFRAC_REAL_DLSYM, real_dlsym};
use crate::exports;
use std::ffi::{CStr, c_char, c_void};

/// Returns the hook to hand out, or 0 to let the real dlsym answer.
extern "C" fn gpufrac_dlsym_decide(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    driver::resolve_real_dlsym();
    if name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's contract: name is a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(entry) = exports::find(bytes) else {
        return std::ptr::null_mut();
    };
    // A lookup in one specific library that does not define the name must
    // still fail the way the real dlsym fails (NULL plus dlerror).
    let special = handle.is_null() || handle == libc::RTLD_NEXT;
    if !special && unsafe { real_dlsym(handle, name) }.is_null() {
        return std::ptr::null_mut();
    }
    entry.hook as *mut c_void
}

#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "jmp qword ptr [rip + {real}]",
        "2:",
        "ret",
        decide = sym gpufrac_dlsym_decide,
        real = sym GPUFRAC_REAL_DLSYM,
    )
}

#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    // Same idea: keep x30 (the caller's return address) intact for the real
    // dlsym by branching, not calling.
    std::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "stp x0, x1, [sp, #16]",
        "bl {decide}",
        "mov x9, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "cbnz x9, 2f",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "br x16",
        "2:",
        "mov x0, x9",
        "ret",
        decide = sym gpufrac_dlsym_decide,
        real = sym GPUFRAC_REAL_DLSYM,
    )
}
