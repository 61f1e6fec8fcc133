//! Which exported driver symbol a `cuGetProcAddress(base name, cudaVersion,
//! flags)` query means, for the symbols the shim hooks. Kept as data, in the
//! manner of a generated (name, version, flags) → symbol table.

use crate::cuda::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;

/// (base name, first CUDA version, per-thread-stream variant, exported
/// symbol) for the hooked symbols. Only consulted when the driver returns a
/// pointer that is not one of its exported symbols.
pub const VERSIONS: &[(&str, i32, bool, &str)] = &[
    ("cuInit", 2000, false, "cuInit"),
    ("cuGetProcAddress", 11030, false, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, false, "cuGetProcAddress_v2"),
    ("cuMemAlloc", 3020, false, "cuMemAlloc_v2"),
    ("cuMemAllocPitch", 3020, false, "cuMemAllocPitch_v2"),
    ("cuMemAllocManaged", 6000, false, "cuMemAllocManaged"),
    ("cuMemAllocAsync", 11020, false, "cuMemAllocAsync"),
    ("cuMemAllocAsync", 11020, true, "cuMemAllocAsync_ptsz"),
    (
        "cuMemAllocFromPoolAsync",
        11020,
        false,
        "cuMemAllocFromPoolAsync",
    ),
    (
        "cuMemAllocFromPoolAsync",
        11020,
        true,
        "cuMemAllocFromPoolAsync_ptsz",
    ),
    ("cuMemFree", 3020, false, "cuMemFree_v2"),
    ("cuMemFreeAsync", 11020, false, "cuMemFreeAsync"),
    ("cuMemFreeAsync", 11020, true, "cuMemFreeAsync_ptsz"),
    ("cuMemCreate", 10020, false, "cuMemCreate"),
    ("cuMemRelease", 10020, false, "cuMemRelease"),
    ("cuArrayCreate", 3020, false, "cuArrayCreate_v2"),
    ("cuArray3DCreate", 3020, false, "cuArray3DCreate_v2"),
    ("cuArrayDestroy", 2000, false, "cuArrayDestroy"),
    (
        "cuMipmappedArrayCreate",
        5000,
        false,
        "cuMipmappedArrayCreate",
    ),
    (
        "cuMipmappedArrayDestroy",
        5000,
        false,
        "cuMipmappedArrayDestroy",
    ),
    ("cuMemPoolCreate", 11020, false, "cuMemPoolCreate"),
    ("cuMemPoolDestroy", 11020, false, "cuMemPoolDestroy"),
    (
        "cuDeviceGetDefaultMemPool",
        11020,
        false,
        "cuDeviceGetDefaultMemPool",
    ),
    ("cuMemGetInfo", 3020, false, "cuMemGetInfo_v2"),
    ("cuDeviceTotalMem", 3020, false, "cuDeviceTotalMem_v2"),
    ("cuCtxCreate", 3020, false, "cuCtxCreate_v2"),
    ("cuCtxCreate", 13000, false, "cuCtxCreate_v4"),
    ("cuCtxDestroy", 4000, false, "cuCtxDestroy_v2"),
    (
        "cuDevicePrimaryCtxRetain",
        7000,
        false,
        "cuDevicePrimaryCtxRetain",
    ),
    (
        "cuDevicePrimaryCtxRelease",
        11000,
        false,
        "cuDevicePrimaryCtxRelease_v2",
    ),
    (
        "cuDevicePrimaryCtxReset",
        11000,
        false,
        "cuDevicePrimaryCtxReset_v2",
    ),
    ("cuLaunchKernel", 4000, false, "cuLaunchKernel"),
    ("cuLaunchKernel", 7000, true, "cuLaunchKernel_ptsz"),
    ("cuLaunchKernelEx", 11060, false, "cuLaunchKernelEx"),
    ("cuLaunchKernelEx", 11060, true, "cuLaunchKernelEx_ptsz"),
    (
        "cuLaunchCooperativeKernel",
        9000,
        false,
        "cuLaunchCooperativeKernel",
    ),
    (
        "cuLaunchCooperativeKernel",
        9000,
        true,
        "cuLaunchCooperativeKernel_ptsz",
    ),
    (
        "cuLaunchCooperativeKernelMultiDevice",
        9000,
        false,
        "cuLaunchCooperativeKernelMultiDevice",
    ),
    ("cuCtxSynchronize", 2000, false, "cuCtxSynchronize"),
    ("cuCtxSynchronize", 13000, false, "cuCtxSynchronize_v2"),
    ("cuStreamSynchronize", 2000, false, "cuStreamSynchronize"),
    (
        "cuStreamSynchronize",
        7000,
        true,
        "cuStreamSynchronize_ptsz",
    ),
    ("cuEventSynchronize", 2000, false, "cuEventSynchronize"),
    ("cuGraphLaunch", 10000, false, "cuGraphLaunch"),
    ("cuGraphLaunch", 10000, true, "cuGraphLaunch_ptsz"),
];

/// The exported symbol a (base name, version, flags) query means, per the
/// table above.
pub fn versioned(base: &str, ver: i32, flags: u64) -> Option<&'static str> {
    let ptsz = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let best = |want_ptsz: bool| {
        VERSIONS
            .iter()
            .filter(|r| r.0 == base && r.1 <= ver && r.2 == want_ptsz)
            .max_by_key(|r| r.1)
            .map(|r| r.3)
    };
    if ptsz {
        best(true).or_else(|| best(false))
    } else {
        best(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_selection() {
        assert_eq!(versioned("cuCtxCreate", 12080, 0), Some("cuCtxCreate_v2"));
        assert_eq!(versioned("cuCtxCreate", 13000, 0), Some("cuCtxCreate_v4"));
        assert_eq!(versioned("cuMemAlloc", 12000, 0), Some("cuMemAlloc_v2"));
        assert_eq!(versioned("cuMemAlloc", 3000, 0), None);
        assert_eq!(
            versioned(
                "cuLaunchKernel",
                12000,
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some("cuLaunchKernel_ptsz")
        );
        // No per-thread variant: the plain one is the right answer.
        assert_eq!(
            versioned(
                "cuMemAlloc",
                12000,
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            ),
            Some("cuMemAlloc_v2")
        );
        assert_eq!(versioned("cudnnCreate", 12000, 0), None);
    }
}
