//! The MIG-capable GPU models and their GPU and compute instance profiles,
//! as `nvidia-smi mig -lgip` / `-lgipp` and NVIDIA's MIG user guide give
//! them: data only, no state.

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of current headers: profile numbers
/// at or past it are invalid arguments, below it merely unsupported.
pub(super) const GI_PROFILE_COUNT: u32 = 17;
pub(super) const CI_PROFILE_COUNT: u32 = 8;
pub(super) const CI_ENGINE_PROFILE_SHARED: u32 = 0;
/// GPU instances per GPU (the hardware has at most 7) and compute
/// instances per GPU instance.
pub const MAX_GI: usize = 8;
pub const MAX_CI: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    A100_40GB,
    A100_80GB,
    H100_80GB,
}

/// A GPU instance profile as NVML describes it.
#[derive(Debug)]
pub struct GiProfile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`: what `nvmlDeviceGetGpuInstanceProfileInfo`
    /// takes.
    pub index: u32,
    /// `nvmlGpuInstanceProfileInfo_t.id` (nvidia-smi's profile ID): what
    /// placement queries and creation take.
    pub id: u32,
    pub name: &'static str,
    /// Compute slices (of 7).
    pub slices: u32,
    /// Memory slices a placement occupies (of 8).
    pub size: u32,
    pub mem_mib: u64,
    pub sms: u32,
    /// Most instances of this profile at once.
    pub count: u32,
    /// Where a placement may start.
    pub starts: &'static [u32],
    pub ce: u32,
    pub dec: u32,
    pub jpeg: u32,
    pub ofa: u32,
}

pub struct ModelInfo {
    /// As NVML and CUDA name the GPU, less "NVIDIA ".
    pub name: &'static str,
    /// What nvidia-smi reports as the GPU's total memory.
    pub total_mib: u64,
    pub sms: u32,
    pub profiles: [GiProfile; 7],
}

const ONE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO: &[u32] = &[0, 2, 4, 6];
const TWO_G: &[u32] = &[0, 2, 4];
const THREE: &[u32] = &[0, 4];
const FULL: &[u32] = &[0];

/// (index, id, slices, size, count, starts, copy engines, OFA) of a profile:
/// what every model here shares.
type Shape = (u32, u32, u32, u32, u32, &'static [u32], u32, u32);

/// The seven profiles in NVML's order; sizes and SMs differ by model.
#[allow(clippy::too_many_arguments)]
const fn profiles(
    names: [&'static str; 7],
    mib: [u64; 7],
    sms: [u32; 7],
    dec: [u32; 7],
    jpeg: [u32; 7],
) -> [GiProfile; 7] {
    const SHAPE: [Shape; 7] = [
        (0, 19, 1, 1, 7, ONE, 1, 0),
        (7, 20, 1, 1, 1, ONE, 1, 1),
        (9, 15, 1, 2, 4, TWO, 1, 0),
        (1, 14, 2, 2, 3, TWO_G, 2, 0),
        (2, 9, 3, 4, 2, THREE, 3, 0),
        (3, 5, 4, 4, 1, FULL, 4, 0),
        (4, 0, 7, 8, 1, FULL, 7, 1),
    ];
    let mut out = [const {
        GiProfile {
            index: 0,
            id: 0,
            name: "",
            slices: 0,
            size: 0,
            mem_mib: 0,
            sms: 0,
            count: 0,
            starts: &[],
            ce: 0,
            dec: 0,
            jpeg: 0,
            ofa: 0,
        }
    }; 7];
    let mut i = 0;
    while i < 7 {
        let (index, id, slices, size, count, starts, ce, ofa) = SHAPE[i];
        out[i] = GiProfile {
            index,
            id,
            name: names[i],
            slices,
            size,
            mem_mib: mib[i],
            sms: sms[i],
            count,
            starts,
            ce,
            dec: dec[i],
            jpeg: jpeg[i],
            ofa,
        };
        i += 1;
    }
    out
}

static A100_40GB: ModelInfo = ModelInfo {
    name: "A100-SXM4-40GB",
    total_mib: 40960,
    sms: 108,
    profiles: profiles(
        [
            "1g.5gb",
            "1g.5gb+me",
            "1g.10gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
        ],
        [4864, 4864, 9856, 9856, 19968, 19968, 40192],
        [14, 14, 14, 28, 42, 56, 98],
        [0, 1, 1, 1, 2, 2, 5],
        [0, 1, 0, 0, 0, 0, 1],
    ),
};

static A100_80GB: ModelInfo = ModelInfo {
    name: "A100-SXM4-80GB",
    total_mib: 81920,
    sms: 108,
    profiles: profiles(
        [
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
        ],
        [9728, 9728, 19968, 19968, 40192, 40192, 80896],
        [14, 14, 14, 28, 42, 56, 98],
        [0, 1, 1, 1, 2, 2, 5],
        [0, 1, 0, 0, 0, 0, 1],
    ),
};

static H100_80GB: ModelInfo = ModelInfo {
    name: "H100 80GB HBM3",
    total_mib: 81559,
    sms: 132,
    profiles: profiles(
        [
            "1g.10gb",
            "1g.10gb+me",
            "1g.20gb",
            "2g.20gb",
            "3g.40gb",
            "4g.40gb",
            "7g.80gb",
        ],
        [9984, 9984, 20096, 20096, 40448, 40448, 81152],
        [16, 16, 26, 32, 60, 64, 132],
        [1, 1, 1, 2, 3, 4, 7],
        [1, 1, 1, 2, 3, 4, 7],
    ),
};

impl Model {
    pub const NAMES: [&'static str; 3] = ["A100-40GB", "A100-80GB", "H100-80GB"];

    pub fn parse(s: &str) -> Option<Model> {
        let all = [Model::A100_40GB, Model::A100_80GB, Model::H100_80GB];
        Model::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(s.trim()))
            .map(|i| all[i])
    }

    pub fn info(self) -> &'static ModelInfo {
        match self {
            Model::A100_40GB => &A100_40GB,
            Model::A100_80GB => &A100_80GB,
            Model::H100_80GB => &H100_80GB,
        }
    }
}

impl ModelInfo {
    pub fn by_index(&'static self, index: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.index == index)
    }

    pub fn by_id(&'static self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }
}

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
