//! CUDA driver and NVML ABI types, kept in one module so the shim and the
//! simulated driver agree on every layout.
//!
//! Return codes are plain integers on purpose: a newer driver returns codes
//! that no enum of ours knows, and they must pass through unchanged.
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_SYSTEM_NOT_READY: CUresult = 802;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CUdriverProcAddressQueryResult`
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: c_int = 2;

/// `cuGetProcAddress` flags.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1 << 0;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// `CUmemLocationType`
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;

/// `CUdevice_attribute` values the simulated driver answers.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: c_int = 115;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemLocation {
    pub type_: c_uint,
    pub id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemAllocationPropFlags {
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: c_uint,
    pub requestedHandleTypes: c_uint,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: CUmemAllocationPropFlags,
}

/// `CUmemPoolProps` (88 bytes; `maxSize` and `usage` were reserved bytes
/// before CUDA 12.2).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemPoolProps {
    pub allocType: c_uint,
    pub handleTypes: c_uint,
    pub location: CUmemLocation,
    pub win32SecurityAttributes: *mut c_void,
    pub maxSize: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1: what `cuGraphAddMemAllocNode` takes and
/// `cuGraphMemAllocNodeGetParams` fills).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub poolProps: CUmemPoolProps,
    pub accessDescs: *const c_void,
    pub accessDescCount: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS`
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_GRAPH_INSTANTIATE_PARAMS {
    pub flags: u64,
    pub hUploadStream: CUstream,
    pub hErrNode_out: CUgraphNode,
    pub result_out: c_int,
}

/// `CUgraphInstantiate_flags`
pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;
/// `CUgraphNodeType` values the shim and the simulated driver tell apart.
pub const CU_GRAPH_NODE_TYPE_KERNEL: c_int = 0;
pub const CU_GRAPH_NODE_TYPE_GRAPH: c_int = 4;
pub const CU_GRAPH_NODE_TYPE_EMPTY: c_int = 5;
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;
/// `CUmemAllocationHandleType`
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: c_uint,
    pub NumChannels: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: c_uint,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [c_uint; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub attrs: *mut c_void,
    pub numAttrs: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_LAUNCH_PARAMS {
    pub function: CUfunction,
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    pub kernelParams: *mut *mut c_void,
}

/// Bytes per channel of a `CUarray_format`, for the formats whose element
/// size is fixed. Unknown and block-compressed formats return `None`; callers
/// then rely on `cuArrayGetMemoryRequirements`.
pub fn array_format_bytes(format: c_uint) -> Option<usize> {
    Some(match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        0xc0 | 0xc6 => 1,        // UNORM_INT8X1, SNORM_INT8X1
        0xc1 | 0xc7 => 2,        // UNORM_INT8X2, SNORM_INT8X2
        0xc2 | 0xc8 => 4,        // UNORM_INT8X4, SNORM_INT8X4
        0xc3 | 0xc9 => 2,        // UNORM_INT16X1, SNORM_INT16X1
        0xc4 | 0xca => 4,        // UNORM_INT16X2, SNORM_INT16X2
        0xc5 | 0xcb => 8,        // UNORM_INT16X4, SNORM_INT16X4
        _ => return None,
    })
}

/// Host-side size of one mip level (or a plain array when `level == 0`).
pub fn array3d_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR, level: u32) -> usize {
    let dim = |v: usize| if v == 0 { 1 } else { (v >> level).max(1) };
    let elem = array_format_bytes(d.Format).unwrap_or(4) * (d.NumChannels.max(1) as usize);
    dim(d.Width)
        .saturating_mul(dim(d.Height))
        .saturating_mul(dim(d.Depth))
        .saturating_mul(elem)
}

pub fn array2d_bytes(d: &CUDA_ARRAY_DESCRIPTOR) -> usize {
    array3d_bytes(
        &CUDA_ARRAY3D_DESCRIPTOR {
            Width: d.Width,
            Height: d.Height,
            Depth: 0,
            Format: d.Format,
            NumChannels: d.NumChannels,
            Flags: 0,
        },
        0,
    )
}

/// Formats a CUDA UUID the way NVML and `nvidia-smi -L` print it:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`. Writes into a fixed buffer so
/// the shim can call it without allocating.
pub fn format_uuid(u: &CUuuid, out: &mut [u8; 40]) -> usize {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out[..4].copy_from_slice(b"GPU-");
    let mut n = 4;
    for (i, b) in u.bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out[n] = b'-';
            n += 1;
        }
        out[n] = HEX[(b >> 4) as usize];
        out[n + 1] = HEX[(b & 15) as usize];
        n += 2;
    }
    n
}

// NVML
pub type nvmlReturn_t = c_uint;
pub type nvmlDevice_t = *mut c_void;
pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: nvmlReturn_t = 13;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`, named as in nvml.h.
#[allow(non_upper_case_globals)]
pub const nvmlMemory_v2: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() as c_uint) | (2 << 24);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct nvmlUtilization_t {
    pub gpu: c_uint,
    pub memory: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub usedGpuMemory: u64,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

pub type nvmlEventSet_t = *mut c_void;
/// `nvmlEventTypeXidCriticalError`.
pub const NVML_EVENT_TYPE_XID_CRITICAL_ERROR: u64 = 0x8;
/// `NVML_TEMPERATURE_GPU`, `NVML_CLOCK_SM`, `NVML_MEMORY_ERROR_TYPE_*`,
/// `NVML_VOLATILE_ECC`.
pub const NVML_TEMPERATURE_GPU: c_uint = 0;
pub const NVML_CLOCK_SM: c_uint = 1;
pub const NVML_MEMORY_ERROR_TYPE_CORRECTED: c_uint = 0;
pub const NVML_MEMORY_ERROR_TYPE_UNCORRECTED: c_uint = 1;
pub const NVML_VOLATILE_ECC: c_uint = 0;

/// What `nvmlEventSetWait_v2` delivers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlEventData_t {
    pub device: nvmlDevice_t,
    pub eventType: u64,
    /// For an XID event, the XID.
    pub eventData: u64,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

/// One process's sample of `nvmlDeviceGetProcessUtilization`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct nvmlProcessUtilizationSample_t {
    pub pid: c_uint,
    /// The CPU timestamp of the sample, in µs.
    pub timeStamp: u64,
    pub smUtil: c_uint,
    pub memUtil: c_uint,
    pub encUtil: c_uint,
    pub decUtil: c_uint,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(std::mem::size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(std::mem::offset_of!(CUmemAllocationProp, location), 8);
        assert_eq!(std::mem::size_of::<CUDA_ARRAY_DESCRIPTOR>(), 24);
        assert_eq!(std::mem::size_of::<CUDA_ARRAY3D_DESCRIPTOR>(), 40);
        assert_eq!(std::mem::offset_of!(CUlaunchConfig, hStream), 32);
        assert_eq!(std::mem::size_of::<CUlaunchConfig>(), 56);
        assert_eq!(std::mem::size_of::<nvmlProcessUtilizationSample_t>(), 32);
        assert_eq!(
            std::mem::offset_of!(nvmlProcessUtilizationSample_t, smUtil),
            16
        );
        assert_eq!(std::mem::offset_of!(CUDA_LAUNCH_PARAMS, hStream), 40);
        assert_eq!(std::mem::size_of::<nvmlMemory_v2_t>(), 40);
        assert_eq!(std::mem::size_of::<nvmlEventData_t>(), 32);
        assert_eq!(std::mem::size_of::<CUmemPoolProps>(), 88);
        assert_eq!(
            std::mem::offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize),
            104
        );
        assert_eq!(std::mem::size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>(), 120);
        assert_eq!(
            std::mem::offset_of!(CUDA_GRAPH_INSTANTIATE_PARAMS, result_out),
            24
        );
        assert_eq!(std::mem::size_of::<CUDA_GRAPH_INSTANTIATE_PARAMS>(), 32);
        assert_eq!(nvmlMemory_v2, 0x0200_0028);
    }

    #[test]
    fn uuid_formats_like_nvml() {
        let u = CUuuid { bytes: [0xab; 16] };
        let mut buf = [0u8; 40];
        let n = format_uuid(&u, &mut buf);
        assert_eq!(
            std::str::from_utf8(&buf[..n]).unwrap(),
            "GPU-abababab-abab-abab-abab-abababababab"
        );
    }

    #[test]
    fn array_sizes() {
        let d = CUDA_ARRAY3D_DESCRIPTOR {
            Width: 100,
            Height: 10,
            Depth: 0,
            Format: 0x20,
            NumChannels: 4,
            Flags: 0,
        };
        assert_eq!(array3d_bytes(&d, 0), 100 * 10 * 16);
        assert_eq!(array3d_bytes(&d, 1), 50 * 5 * 16);
        assert_eq!(array3d_bytes(&d, 10), 16);
    }
}

// --- NVML's MIG API, as nvml.h lays it out ---------------------------------

pub const NVML_ERROR_IN_USE: nvmlReturn_t = 19;
pub const NVML_ERROR_INSUFFICIENT_RESOURCES: nvmlReturn_t = 23;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;

pub type nvmlGpuInstance_t = *mut c_void;
pub type nvmlComputeInstance_t = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct nvmlGpuInstancePlacement_t {
    pub start: c_uint,
    pub size: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct nvmlGpuInstanceProfileInfo_t {
    pub id: c_uint,
    pub isP2pSupported: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlGpuInstanceProfileInfo_v2_t {
    pub version: c_uint,
    pub id: c_uint,
    pub isP2pSupported: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: u64,
    pub name: [c_char; 96],
}

/// v3 drops `isP2pSupported` and adds `capabilities`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlGpuInstanceProfileInfo_v3_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub copyEngineCount: c_uint,
    pub decoderCount: c_uint,
    pub encoderCount: c_uint,
    pub jpegCount: c_uint,
    pub ofaCount: c_uint,
    pub memorySizeMB: u64,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlGpuInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub id: c_uint,
    pub profileId: c_uint,
    pub placement: nvmlGpuInstancePlacement_t,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct nvmlComputeInstanceProfileInfo_t {
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlComputeInstanceProfileInfo_v2_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub name: [c_char; 96],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlComputeInstanceProfileInfo_v3_t {
    pub version: c_uint,
    pub id: c_uint,
    pub sliceCount: c_uint,
    pub instanceCount: c_uint,
    pub multiprocessorCount: c_uint,
    pub sharedCopyEngineCount: c_uint,
    pub sharedDecoderCount: c_uint,
    pub sharedEncoderCount: c_uint,
    pub sharedJpegCount: c_uint,
    pub sharedOfaCount: c_uint,
    pub name: [c_char; 96],
    pub capabilities: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvmlComputeInstanceInfo_t {
    pub device: nvmlDevice_t,
    pub gpuInstance: nvmlGpuInstance_t,
    pub id: c_uint,
    pub profileId: c_uint,
    pub placement: nvmlGpuInstancePlacement_t,
}

/// `NVML_STRUCT_VERSION(data, ver)`: the struct's size with the version in
/// the top byte.
const fn struct_version<T>(ver: u32) -> u32 {
    std::mem::size_of::<T>() as u32 | (ver << 24)
}

pub const GI_PROFILE_INFO_V2: u32 = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
pub const GI_PROFILE_INFO_V3: u32 = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
pub const CI_PROFILE_INFO_V2: u32 = struct_version::<nvmlComputeInstanceProfileInfo_v2_t>(2);
pub const CI_PROFILE_INFO_V3: u32 = struct_version::<nvmlComputeInstanceProfileInfo_v3_t>(3);
