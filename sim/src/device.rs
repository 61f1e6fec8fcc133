//! Initialisation, devices, error strings.

use std::ffi::{c_char, c_int, c_uint};

use gpufrac_common::cuda::*;

use crate::config::driver_version;
use crate::state::{CudaDev, cuda, cuda_init};
use crate::{out, write_cstr};

fn attribute(attr: c_int, dev: &CudaDev) -> c_int {
    match attr {
        1 => 1024,                         // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,                     // MAX_BLOCK_DIM_X/Y
        4 => 64,                           // MAX_BLOCK_DIM_Z
        5 => i32::MAX,                     // MAX_GRID_DIM_X
        6 | 7 => 65535,                    // MAX_GRID_DIM_Y/Z
        8 => 48 << 10,                     // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 64 << 10,                     // TOTAL_CONSTANT_MEMORY
        10 => 32,                          // WARP_SIZE
        12 => 65536,                       // MAX_REGISTERS_PER_BLOCK
        16 => dev.sms,                     // MULTIPROCESSOR_COUNT
        19 | 31 | 41 | 83 | 89 | 102 => 1, // CAN_MAP_HOST_MEMORY, CONCURRENT_KERNELS, UNIFIED_ADDRESSING, MANAGED_MEMORY, CONCURRENT_MANAGED_ACCESS, VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        33 => dev.phys as c_int + 1,       // PCI_BUS_ID
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
        CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 1,
        _ => 0,
    }
}

/// (code, name, description) as the real driver reports them.
const ERRORS: &[(CUresult, &std::ffi::CStr, &std::ffi::CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (
        46,
        c"CUDA_ERROR_DEVICE_UNAVAILABLE",
        c"CUDA-capable device(s) is/are busy or unavailable",
    ),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (
        200,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        201,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        202,
        c"CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        c"context already current",
    ),
    (
        400,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        401,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (
        700,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        701,
        c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        c"too many resources requested for launch",
    ),
    (
        702,
        c"CUDA_ERROR_LAUNCH_TIMEOUT",
        c"the launch timed out and was terminated",
    ),
    (
        709,
        c"CUDA_ERROR_CONTEXT_IS_DESTROYED",
        c"context is destroyed",
    ),
    (
        719,
        c"CUDA_ERROR_LAUNCH_FAILED",
        c"unspecified launch failure",
    ),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    // What the shim answers when GPUFRAC_BROKER=required finds no broker.
    (
        802,
        c"CUDA_ERROR_SYSTEM_NOT_READY",
        c"system not yet initialized",
    ),
    (
        803,
        c"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        c"system has unsupported display driver / cuda driver combination",
    ),
    (
        900,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

fn error_entry(
    e: CUresult,
) -> Result<&'static (CUresult, &'static std::ffi::CStr, &'static std::ffi::CStr), CUresult> {
    ERRORS
        .iter()
        .find(|(c, _, _)| *c == e)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

cuda_exports! {
    fn cuInit(flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        cuda_init()
    }

    fn cuDriverGetVersion(version: *mut c_int) {
        out(version, driver_version(), CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        let s = cuda()?;
        let d = s.dev(ordinal)?;
        out(device, d as CUdevice, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceGetCount(count: *mut c_int) {
        let s = cuda()?;
        out(count, s.ndev() as c_int, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceGetName(buf: *mut c_char, len: c_int, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        if buf.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let n = &s.cuda_devs[d].name;
        let take = n.len().min(len as usize - 1);
        write_cstr(buf, len as usize, &n.as_bytes()[..take]);
        Ok(())
    }

    /// On a MIG device, the parent GPU's UUID (what CUDA reported before
    /// `_v2` existed).
    fn cuDeviceGetUuid(u: *mut CUuuid, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(u, s.cuda_devs[d].uuid_v1, CUDA_ERROR_INVALID_VALUE)
    }

    /// On a MIG device, the MIG device's own UUID.
    fn cuDeviceGetUuid_v2(u: *mut CUuuid, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(u, s.cuda_devs[d].uuid, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(bytes, s.totals[d] as usize, CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        out(pi, attribute(attrib, &s.cuda_devs[d]), CUDA_ERROR_INVALID_VALUE)
    }

    fn cuDeviceGetPCIBusId(buf: *mut c_char, len: c_int, dev: CUdevice) {
        let s = cuda()?;
        let d = s.dev(dev)?;
        if buf.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = format!("0000:{:02X}:00.0", s.cuda_devs[d].phys + 1);
        let take = id.len().min(len as usize - 1);
        write_cstr(buf, len as usize, &id.as_bytes()[..take]);
        Ok(())
    }

    fn cuGetErrorString(error: CUresult, pstr: *mut *const c_char) {
        if pstr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match error_entry(error) {
            Ok(e) => out(pstr, e.2.as_ptr(), CUDA_ERROR_INVALID_VALUE),
            Err(e) => {
                *pstr = std::ptr::null();
                Err(e)
            }
        }
    }

    fn cuGetErrorName(error: CUresult, pstr: *mut *const c_char) {
        if pstr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match error_entry(error) {
            Ok(e) => out(pstr, e.1.as_ptr(), CUDA_ERROR_INVALID_VALUE),
            Err(e) => {
                *pstr = std::ptr::null();
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code the simulator's sources return, and what the shim
    /// returns of its own (802), has a name and a description, as with the
    /// real driver: `cuGetErrorName` never fails on them.
    #[test]
    fn every_code_the_simulator_returns_has_a_name() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut names = std::collections::BTreeSet::new();
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    for (i, _) in text.match_indices("CUDA_ERROR_") {
                        let name: String = text[i..]
                            .chars()
                            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                            .collect();
                        if !name.ends_with('_') {
                            names.insert(name);
                        }
                    }
                }
            }
        }
        names.insert("CUDA_ERROR_SYSTEM_NOT_READY".into());
        assert!(names.len() > 10, "{names:?}");
        for n in &names {
            assert!(
                ERRORS
                    .iter()
                    .any(|(_, name, _)| name.to_str() == Ok(n.as_str())),
                "{n} has no entry in ERRORS"
            );
        }
        assert_eq!(
            error_entry(CUDA_ERROR_SYSTEM_NOT_READY).map(|e| e.1),
            Ok(c"CUDA_ERROR_SYSTEM_NOT_READY")
        );
        // The table agrees with the constants the shim and simulator use.
        for (code, name) in [
            (CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE"),
            (CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
            (
                CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            ),
            (CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
        ] {
            assert_eq!(error_entry(code).map(|e| e.1.to_str().unwrap()), Ok(name));
        }
    }
}
