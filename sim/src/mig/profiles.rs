//! The MIG-capable GPU models (their GPU instance profiles are
//! `gpufrac_common::mig`'s, which the broker's planner is tested against
//! too) and the compute instance profiles, as `nvidia-smi mig -lgip` /
//! `-lgipp` and NVIDIA's MIG user guide give them: data only, no state.

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of current headers: profile numbers
/// at or past it are invalid arguments, below it merely unsupported.
pub(super) const GI_PROFILE_COUNT: u32 = 17;
pub(super) const CI_PROFILE_COUNT: u32 = 8;
pub(super) const CI_ENGINE_PROFILE_SHARED: u32 = 0;
/// GPU instances per GPU (the hardware has at most 7) and compute
/// instances per GPU instance.
pub const MAX_GI: usize = 8;
pub const MAX_CI: usize = 8;

pub use gpufrac_common::mig::{GiProfile, Model, ModelInfo};

/// Compute instance profiles a GPU instance of `slices` compute slices
/// offers (`NVML_COMPUTE_INSTANCE_PROFILE_*` numbers and their slices).
pub(super) fn ci_profiles(slices: u32) -> &'static [(u32, u32)] {
    match slices {
        1 => &[(0, 1)],
        2 => &[(0, 1), (1, 2)],
        3 => &[(0, 1), (1, 2), (2, 3)],
        4 => &[(0, 1), (1, 2), (3, 4)],
        7 => &[(0, 1), (1, 2), (2, 3), (4, 7)],
        _ => &[],
    }
}

/// Where a compute instance of `c` slices may start in a GPU instance of
/// `s` slices.
pub(super) fn ci_starts(s: u32, c: u32) -> Vec<u32> {
    if (s, c) == (7, 3) {
        return vec![0, 4];
    }
    (0..s).step_by(c as usize).filter(|x| x + c <= s).collect()
}
