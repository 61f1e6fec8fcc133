//! The MIG-capable GPU models and their GPU instance profiles, as
//! `nvidia-smi mig -lgip` / `-lgipp` and NVIDIA's MIG user guide give them:
//! data only, no state. The simulated driver serves them through NVML; the
//! broker's MIG planner is tested against them (its `mig::models`), and
//! reads a real GPU's from NVML.

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
/// what every model here shares, in NVML's order.
type Shape = (u32, u32, u32, u32, u32, &'static [u32], u32, u32);
const SHAPE: [Shape; 7] = [
    (0, 19, 1, 1, 7, ONE, 1, 0),
    (7, 20, 1, 1, 1, ONE, 1, 1),
    (9, 15, 1, 2, 4, TWO, 1, 0),
    (1, 14, 2, 2, 3, TWO_G, 2, 0),
    (2, 9, 3, 4, 2, THREE, 3, 0),
    (3, 5, 4, 4, 1, FULL, 4, 0),
    (4, 0, 7, 8, 1, FULL, 7, 1),
];

/// (name, memory in MiB, SMs, decoders, JPEG decoders) of a profile: what
/// differs by model, in the order of [`SHAPE`].
type Sizes = (&'static str, u64, u32, u32, u32);

const fn model(name: &'static str, total_mib: u64, sms: u32, sized: [Sizes; 7]) -> ModelInfo {
    let mut profiles = [const {
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
        let (name, mem_mib, sms, dec, jpeg) = sized[i];
        profiles[i] = GiProfile {
            index,
            id,
            name,
            slices,
            size,
            mem_mib,
            sms,
            count,
            starts,
            ce,
            dec,
            jpeg,
            ofa,
        };
        i += 1;
    }
    ModelInfo {
        name,
        total_mib,
        sms,
        profiles,
    }
}

#[rustfmt::skip]
static A100_40GB: ModelInfo = model("A100-SXM4-40GB", 40960, 108, [
    ("1g.5gb", 4864, 14, 0, 0), ("1g.5gb+me", 4864, 14, 1, 1), ("1g.10gb", 9856, 14, 1, 0),
    ("2g.10gb", 9856, 28, 1, 0), ("3g.20gb", 19968, 42, 2, 0), ("4g.20gb", 19968, 56, 2, 0),
    ("7g.40gb", 40192, 98, 5, 1),
]);

#[rustfmt::skip]
static A100_80GB: ModelInfo = model("A100-SXM4-80GB", 81920, 108, [
    ("1g.10gb", 9728, 14, 0, 0), ("1g.10gb+me", 9728, 14, 1, 1), ("1g.20gb", 19968, 14, 1, 0),
    ("2g.20gb", 19968, 28, 1, 0), ("3g.40gb", 40192, 42, 2, 0), ("4g.40gb", 40192, 56, 2, 0),
    ("7g.80gb", 80896, 98, 5, 1),
]);

#[rustfmt::skip]
static H100_80GB: ModelInfo = model("H100 80GB HBM3", 81559, 132, [
    ("1g.10gb", 9984, 16, 1, 1), ("1g.10gb+me", 9984, 16, 1, 1), ("1g.20gb", 20096, 26, 1, 1),
    ("2g.20gb", 20096, 32, 2, 2), ("3g.40gb", 40448, 60, 3, 3), ("4g.40gb", 40448, 64, 4, 4),
    ("7g.80gb", 81152, 132, 7, 7),
]);

impl Model {
    pub const ALL: [Model; 3] = [Model::A100_40GB, Model::A100_80GB, Model::H100_80GB];
    pub const NAMES: [&'static str; 3] = ["A100-40GB", "A100-80GB", "H100-80GB"];

    pub fn parse(s: &str) -> Option<Model> {
        Model::NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(s.trim()))
            .map(|i| Model::ALL[i])
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
