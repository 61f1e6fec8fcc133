//! Dynamic MIG planner (`gpufrac broker --mig dynamic`; docs/mig.md).
//!
//! A pure state machine, like `queue/`: no I/O, no clock. Time is a `u64`
//! of nanoseconds passed in. It knows each MIG-mode GPU's GPU-instance
//! profiles (memory, compute slices, the placements the hardware allows)
//! and its instances (in use by a lease, idle since when, or foreign), and
//! decides where a request goes:
//!
//! 1. The profile: the smallest (memory, then compute slices) with memory
//!    ≥ the request and compute slices / 7 ≥ `--gpu-compute`. Profiles with
//!    media extensions (`+me`) are left for those who ask for them by hand.
//! 2. On a GPU with that profile: an idle instance of it (reused: the most
//!    recently idle, so the oldest stay first in line for destruction);
//!    else a free placement (the one that blocks the fewest placements of
//!    other profiles, so big profiles stay possible); else a placement
//!    freed by destroying idle instances lazily: the fewest that free one,
//!    the longest idle first. An instance in use, or one the broker does
//!    not manage, is never touched.
//! 3. A larger fitting profile, or another GPU, only when the smallest
//!    cannot be had at all.
//!
//! Decisions come out as steps (destroy these GPU instances, create one
//! with this profile at this placement) that the I/O layer carries out
//! through NVML and reports back: `created`, or `failed`, after which the
//! GPU's instances are re-read (`sync`) and the memory slices of the
//! failed placement are avoided, by every profile, for `BLOCK_FOR`: what
//! the driver refused there it would likely refuse again.

use serde::{Deserialize, Serialize};

pub type Nanos = u64;
pub type RequestId = u64;

/// A placement that failed is not tried again for this long.
pub const BLOCK_FOR: Nanos = 30 * 1_000_000_000;

/// Memory slices a placement covers, as NVML's `nvmlGpuInstancePlacement_t`
/// (and nvidia-smi's `start:size`) say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Range {
    pub start: u32,
    pub size: u32,
}

impl Range {
    pub fn end(&self) -> u32 {
        self.start + self.size
    }

    pub fn overlaps(&self, o: &Range) -> bool {
        self.start < o.end() && o.start < self.end()
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.start, self.size)
    }
}

/// A GPU-instance profile as NVML describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// `nvmlGpuInstanceProfileInfo_t.id` (nvidia-smi's profile ID): what
    /// creation takes.
    pub id: u32,
    /// `1g.5gb`
    pub name: String,
    /// Compute slices.
    pub slices: u32,
    /// Bytes.
    pub mem: u64,
    /// Most instances at once.
    pub max: u32,
    /// Where an instance may go.
    pub placements: Vec<Range>,
}

impl Profile {
    fn media(&self) -> bool {
        self.name.contains("+me")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigGpu {
    /// nvidia-smi index.
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_mem: u64,
    /// Compute slices of the whole GPU (7 on A100 and H100).
    pub slices: u32,
    pub profiles: Vec<Profile>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Use {
    /// Held by this lease.
    Lease(RequestId),
    /// Nobody's since then: reusable, and destroyable when space is needed.
    Idle { since: Nanos },
    /// Not the broker's to use or destroy (a GPU instance with several
    /// compute instances, made by hand); it only takes up room.
    Foreign,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// GPU instance id; None while being created.
    pub gi: Option<u32>,
    /// Profile id.
    pub profile: u32,
    pub placement: Range,
    /// The MIG device (`MIG-<uuid>`); None while being created, or for a
    /// GPU instance without a compute instance (destroyable, not usable).
    pub uuid: Option<String>,
    pub use_: Use,
}

/// A GPU instance as the driver reports it: (GPU instance id, profile id,
/// placement, the UUIDs of its MIG devices).
pub type FoundInstance = (u32, u32, Range, Vec<String>);

/// What the I/O layer does for a decision, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    /// Destroy this GPU instance (its compute instance first).
    Destroy { gi: u32 },
    /// Create a GPU instance of this profile here, and a compute instance
    /// spanning it.
    Create { profile: u32, placement: Range },
}

/// A decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Position among the planner's GPUs.
    pub gpu: usize,
    pub profile: u32,
    pub how: How,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum How {
    Reuse {
        gi: u32,
    },
    /// `destroy`: idle GPU instances in the way (empty when the placement
    /// was free).
    Create {
        placement: Range,
        destroy: Vec<u32>,
    },
}

/// What a request holds once decided: the instance and how to make it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// nvidia-smi index of the GPU.
    pub gpu: u32,
    pub gpu_uuid: String,
    pub profile: u32,
    pub profile_name: String,
    pub mem: u64,
    pub placement: Range,
    pub gi: Option<u32>,
    pub uuid: Option<String>,
    /// For the I/O layer; empty for a reused instance.
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone)]
struct GpuState {
    info: MigGpu,
    instances: Vec<Instance>,
    /// (memory slices, until): creation failed there lately.
    blocked: Vec<(Range, Nanos)>,
    created: u64,
    destroyed: u64,
    failures: u64,
}

/// One instance as status shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceStatus {
    pub gi: Option<u32>,
    pub profile: String,
    pub placement: Range,
    pub mem: u64,
    pub uuid: Option<String>,
    pub use_: Use,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub gpu: MigGpu,
    pub instances: Vec<InstanceStatus>,
    /// Instances created and destroyed by this broker, and steps that
    /// failed.
    pub created: u64,
    pub destroyed: u64,
    pub failures: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Planner {
    gpus: Vec<GpuState>,
}

/// How good a choice is, smaller first: profile memory and slices, then
/// the way (reuse, free placement, after destroying), instances destroyed,
/// the newest idle time among them, GPU position, placement start.
type Rank = (u64, u32, u8, usize, u64, usize, u32);

/// Whether `p` gives `compute` percent: its slices of the GPU's, with a
/// hair of slack so that 100/7 % asks for exactly one slice.
fn gives(p: &Profile, slices: u32, compute: Option<f64>) -> bool {
    match compute {
        Some(c) => f64::from(p.slices) * 100.0 >= c * f64::from(slices) - 1e-6,
        None => true,
    }
}

impl Planner {
    pub fn new(gpus: Vec<MigGpu>) -> Planner {
        let mut gpus: Vec<GpuState> = gpus
            .into_iter()
            .map(|info| GpuState {
                info,
                instances: Vec::new(),
                blocked: Vec::new(),
                created: 0,
                destroyed: 0,
                failures: 0,
            })
            .collect();
        gpus.sort_by_key(|g| g.info.index);
        Planner { gpus }
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    pub fn gpus(&self) -> impl Iterator<Item = &MigGpu> {
        self.gpus.iter().map(|g| &g.info)
    }

    /// Position of the GPU with nvidia-smi index `index`.
    #[cfg(test)]
    pub fn position(&self, index: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.info.index == index)
    }

    /// The largest profile any GPU has: (GPU index, profile), for messages.
    pub fn largest(&self) -> Option<(u32, &Profile)> {
        self.gpus
            .iter()
            .flat_map(|g| g.info.profiles.iter().map(move |p| (g.info.index, p)))
            .filter(|(_, p)| !p.media())
            .max_by_key(|(i, p)| (p.mem, p.slices, std::cmp::Reverse(*i)))
    }

    /// Whether some profile could ever hold `mem` bytes and `compute` %.
    pub fn could_fit(&self, mem: u64, compute: Option<f64>) -> bool {
        self.gpus.iter().any(|g| {
            g.info
                .profiles
                .iter()
                .any(|p| !p.media() && p.mem >= mem && gives(p, g.info.slices, compute))
        })
    }

    /// Replaces what the planner believes of GPU `index` by what the driver
    /// reports: (GPU instance id, profile id, placement, MIG device UUIDs).
    /// An instance keeps its lease or idle time when its GPU instance id
    /// and UUID still match; one seen for the first time is idle since
    /// `now`; one with several compute instances is foreign.
    pub fn sync(&mut self, now: Nanos, index: u32, found: &[FoundInstance]) {
        let Some(g) = self.gpus.iter_mut().find(|g| g.info.index == index) else {
            return;
        };
        let old = std::mem::take(&mut g.instances);
        g.instances = found
            .iter()
            .map(|(gi, profile, placement, uuids)| {
                let uuid = match uuids.as_slice() {
                    [] => None,
                    [one] => Some(one.clone()),
                    _ => {
                        return Instance {
                            gi: Some(*gi),
                            profile: *profile,
                            placement: *placement,
                            uuid: uuids.first().cloned(),
                            use_: Use::Foreign,
                        };
                    }
                };
                let use_ = old
                    .iter()
                    .find(|o| o.gi == Some(*gi) && o.uuid == uuid && o.use_ != Use::Foreign)
                    .map_or(Use::Idle { since: now }, |o| o.use_);
                Instance {
                    gi: Some(*gi),
                    profile: *profile,
                    placement: *placement,
                    uuid,
                    use_,
                }
            })
            .collect();
    }

    /// Where a request for `mem` bytes and `compute` percent would go now,
    /// or None if it must wait (or no profile fits: see `could_fit`).
    pub fn plan(&self, now: Nanos, mem: u64, compute: Option<f64>) -> Option<Choice> {
        let mut best: Option<(Rank, Choice)> = None;
        for (gi_pos, g) in self.gpus.iter().enumerate() {
            for p in &g.info.profiles {
                if p.media() || p.mem < mem || !gives(p, g.info.slices, compute) {
                    continue;
                }
                // A larger profile cannot beat what is found already.
                if best
                    .as_ref()
                    .is_some_and(|(k, _)| (p.mem, p.slices) > (k.0, k.1))
                {
                    continue;
                }
                let Some((kind, destroyed, age, start, how)) = self.best_on(now, g, p) else {
                    continue;
                };
                let key = (p.mem, p.slices, kind, destroyed, age, gi_pos, start);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((
                        key,
                        Choice {
                            gpu: gi_pos,
                            profile: p.id,
                            how,
                        },
                    ));
                }
            }
        }
        best.map(|(_, c)| c)
    }

    /// The best way to get profile `p` on `g`: (kind: 0 reuse, 1 free
    /// placement, 2 after destroying; instances destroyed; the newest idle
    /// time among them, so older sets come first; placement start).
    fn best_on(&self, now: Nanos, g: &GpuState, p: &Profile) -> Option<(u8, usize, u64, u32, How)> {
        // Reuse: the most recently idle instance of the profile.
        let reuse = g
            .instances
            .iter()
            .filter(|i| i.profile == p.id && i.uuid.is_some())
            .filter_map(|i| match (i.use_, i.gi) {
                (Use::Idle { since }, Some(gi)) => Some((since, gi)),
                _ => None,
            })
            .max();
        if let Some((_, gi)) = reuse {
            return Some((0, 0, 0, 0, How::Reuse { gi }));
        }
        let blocked = |r: &Range| {
            g.blocked
                .iter()
                .any(|(b, until)| b.overlaps(r) && *until > now)
        };
        let same = |keep: &dyn Fn(&Instance) -> bool| {
            g.instances
                .iter()
                .filter(|i| i.profile == p.id && keep(i))
                .count() as u32
        };
        // Free placements, the least damaging first.
        if same(&|_| true) < p.max {
            let free = p
                .placements
                .iter()
                .filter(|r| !blocked(r))
                .filter(|r| !g.instances.iter().any(|i| i.placement.overlaps(r)))
                .min_by_key(|r| (self.damage(g, r), std::cmp::Reverse(r.start)));
            if let Some(r) = free {
                return Some((
                    1,
                    0,
                    0,
                    r.start,
                    How::Create {
                        placement: *r,
                        destroy: Vec::new(),
                    },
                ));
            }
        }
        // Lazily: destroy the fewest idle instances that free a placement,
        // those idle longest first.
        let mut best: Option<(usize, u64, u32, Range, Vec<u32>)> = None;
        for r in p.placements.iter().filter(|r| !blocked(r)) {
            let mut victims = Vec::new();
            let mut newest = 0;
            let mut ok = true;
            for i in g.instances.iter().filter(|i| i.placement.overlaps(r)) {
                match (i.use_, i.gi) {
                    (Use::Idle { since }, Some(gi)) => {
                        victims.push(gi);
                        newest = newest.max(since);
                    }
                    _ => {
                        ok = false;
                        break;
                    }
                }
            }
            if !ok {
                continue;
            }
            let left = same(&|i| !i.gi.is_some_and(|gi| victims.contains(&gi)));
            if left >= p.max {
                continue;
            }
            victims.sort_unstable();
            let key = (victims.len(), newest, r.start);
            if best
                .as_ref()
                .is_none_or(|(n, t, s, _, _)| key < (*n, *t, *s))
            {
                best = Some((victims.len(), newest, r.start, *r, victims));
            }
        }
        best.map(|(n, newest, start, placement, destroy)| {
            (2, n, newest, start, How::Create { placement, destroy })
        })
    }

    /// How many currently free placements of other profiles `r` would
    /// take away.
    fn damage(&self, g: &GpuState, r: &Range) -> usize {
        g.info
            .profiles
            .iter()
            .flat_map(|p| p.placements.iter())
            .filter(|o| o.overlaps(r))
            .filter(|o| !g.instances.iter().any(|i| i.placement.overlaps(o)))
            .count()
    }

    /// Takes `choice` for request `id`: a reused instance is held at once;
    /// for a new one the destroyed instances go and a placeholder holds
    /// the placement until `created` or `failed`.
    pub fn assign(&mut self, id: RequestId, choice: &Choice) -> Assignment {
        let g = &mut self.gpus[choice.gpu];
        let p = g
            .info
            .profiles
            .iter()
            .find(|p| p.id == choice.profile)
            .cloned()
            .expect("a choice names a profile of its GPU");
        match &choice.how {
            How::Reuse { gi } => {
                let i = g
                    .instances
                    .iter_mut()
                    .find(|i| i.gi == Some(*gi))
                    .expect("a choice names a live instance");
                i.use_ = Use::Lease(id);
                Assignment {
                    gpu: g.info.index,
                    gpu_uuid: g.info.uuid.clone(),
                    profile: p.id,
                    profile_name: p.name,
                    mem: p.mem,
                    placement: i.placement,
                    gi: i.gi,
                    uuid: i.uuid.clone(),
                    steps: Vec::new(),
                }
            }
            How::Create { placement, destroy } => {
                g.instances
                    .retain(|i| !i.gi.is_some_and(|gi| destroy.contains(&gi)));
                g.instances.push(Instance {
                    gi: None,
                    profile: p.id,
                    placement: *placement,
                    uuid: None,
                    use_: Use::Lease(id),
                });
                let mut steps: Vec<Step> = destroy.iter().map(|&gi| Step::Destroy { gi }).collect();
                steps.push(Step::Create {
                    profile: p.id,
                    placement: *placement,
                });
                Assignment {
                    gpu: g.info.index,
                    gpu_uuid: g.info.uuid.clone(),
                    profile: p.id,
                    profile_name: p.name,
                    mem: p.mem,
                    placement: *placement,
                    gi: None,
                    uuid: None,
                    steps,
                }
            }
        }
    }

    /// The I/O layer destroyed GPU instance `gi` of GPU `index`.
    pub fn destroyed(&mut self, index: u32, gi: u32) {
        if let Some(g) = self.gpus.iter_mut().find(|g| g.info.index == index) {
            g.instances.retain(|i| i.gi != Some(gi));
            g.destroyed += 1;
        }
    }

    /// The I/O layer created the instance request `id` waited for.
    pub fn created(&mut self, id: RequestId, index: u32, gi: u32, uuid: String) {
        if let Some(g) = self.gpus.iter_mut().find(|g| g.info.index == index)
            && let Some(i) = g
                .instances
                .iter_mut()
                .find(|i| i.use_ == Use::Lease(id) && i.gi.is_none())
        {
            i.gi = Some(gi);
            i.uuid = Some(uuid);
            g.created += 1;
        }
    }

    /// Carrying out request `id`'s steps failed at `placement`: its
    /// placeholder goes, and those memory slices are avoided for
    /// `BLOCK_FOR`. The caller then re-reads the GPU (`sync`).
    pub fn failed(&mut self, now: Nanos, id: RequestId, index: u32, placement: Range) {
        if let Some(g) = self.gpus.iter_mut().find(|g| g.info.index == index) {
            g.instances
                .retain(|i| !(i.use_ == Use::Lease(id) && i.gi.is_none()));
            g.blocked.retain(|(_, until)| *until > now);
            g.blocked.push((placement, now + BLOCK_FOR));
            g.failures += 1;
        }
    }

    /// Whether some failed placement is still being avoided.
    #[cfg(test)]
    pub fn avoiding(&self, now: Nanos) -> bool {
        self.gpus
            .iter()
            .any(|g| g.blocked.iter().any(|(_, until)| *until > now))
    }

    /// A lease ended: its instance stays, idle from `now`.
    pub fn release(&mut self, now: Nanos, id: RequestId) {
        for g in &mut self.gpus {
            // A placeholder whose creation never finished holds nothing.
            g.instances
                .retain(|i| !(i.use_ == Use::Lease(id) && i.gi.is_none()));
            for i in &mut g.instances {
                if i.use_ == Use::Lease(id) {
                    i.use_ = Use::Idle { since: now };
                }
            }
        }
    }

    /// A lease from before a restart on the instance with MIG device
    /// `uuid` of GPU `index`: held again, whatever it was.
    pub fn restore(&mut self, id: RequestId, index: u32, uuid: &str) -> Option<Assignment> {
        let g = self.gpus.iter_mut().find(|g| g.info.index == index)?;
        let i = g
            .instances
            .iter_mut()
            .find(|i| i.uuid.as_deref() == Some(uuid) && i.use_ != Use::Foreign)?;
        i.use_ = Use::Lease(id);
        let p = g.info.profiles.iter().find(|p| p.id == i.profile)?;
        Some(Assignment {
            gpu: g.info.index,
            gpu_uuid: g.info.uuid.clone(),
            profile: p.id,
            profile_name: p.name.clone(),
            mem: p.mem,
            placement: i.placement,
            gi: i.gi,
            uuid: i.uuid.clone(),
            steps: Vec::new(),
        })
    }

    pub fn status(&self) -> Vec<GpuStatus> {
        self.gpus
            .iter()
            .map(|g| GpuStatus {
                gpu: g.info.clone(),
                instances: g
                    .instances
                    .iter()
                    .map(|i| {
                        let p = g.info.profiles.iter().find(|p| p.id == i.profile);
                        InstanceStatus {
                            gi: i.gi,
                            profile: p.map_or_else(
                                || format!("profile {}", i.profile),
                                |p| p.name.clone(),
                            ),
                            placement: i.placement,
                            mem: p.map_or(0, |p| p.mem),
                            uuid: i.uuid.clone(),
                            use_: i.use_,
                        }
                    })
                    .collect(),
                created: g.created,
                destroyed: g.destroyed,
                failures: g.failures,
            })
            .collect()
    }

    /// Memory of GPU `index`'s instances held by leases.
    pub fn committed(&self, index: u32) -> u64 {
        self.gpus
            .iter()
            .filter(|g| g.info.index == index)
            .flat_map(|g| {
                g.instances
                    .iter()
                    .filter(|i| matches!(i.use_, Use::Lease(_)))
                    .filter_map(|i| g.info.profiles.iter().find(|p| p.id == i.profile))
                    .map(|p| p.mem)
            })
            .sum()
    }

    /// A one-line summary of why nothing fits now, for `--no-wait`.
    pub fn busy_summary(&self) -> String {
        let parts: Vec<String> = self
            .gpus
            .iter()
            .map(|g| {
                let used = g
                    .instances
                    .iter()
                    .filter(|i| matches!(i.use_, Use::Lease(_)))
                    .count();
                let foreign = g
                    .instances
                    .iter()
                    .filter(|i| i.use_ == Use::Foreign)
                    .count();
                let mut s = format!("GPU {} (MIG): {used} instances in use", g.info.index);
                if foreign > 0 {
                    s.push_str(&format!(", {foreign} not managed by gpufrac"));
                }
                s
            })
            .collect();
        parts.join("; ")
    }
}

/// The profiles of the models NVIDIA documents, as NVML reports them (for
/// tests and the figures in docs/mig.md; the broker reads the real ones):
/// `gpufrac_common::mig`'s, which the simulated driver serves too.
#[cfg(test)]
pub mod models {
    use super::{MigGpu, Profile, Range};
    use gpufrac_common::mig::Model;

    const MIB: u64 = 1 << 20;

    /// GPU `index`, of `model`, with its UUID made from its index.
    pub fn gpu(index: u32, model: Model) -> MigGpu {
        let info = model.info();
        MigGpu {
            index,
            uuid: format!("GPU-{index:08x}-0000-4000-8000-000000000000"),
            name: info.name.into(),
            total_mem: info.total_mib * MIB,
            slices: 7,
            profiles: info
                .profiles
                .iter()
                .map(|p| Profile {
                    id: p.id,
                    name: p.name.into(),
                    slices: p.slices,
                    mem: p.mem_mib * MIB,
                    max: p.count,
                    placements: p
                        .starts
                        .iter()
                        .map(|&start| Range {
                            start,
                            size: p.size,
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    pub fn a100_40gb(index: u32) -> MigGpu {
        gpu(index, Model::A100_40GB)
    }

    pub fn a100_80gb(index: u32) -> MigGpu {
        gpu(index, Model::A100_80GB)
    }

    pub fn h100_80gb(index: u32) -> MigGpu {
        gpu(index, Model::H100_80GB)
    }
}

#[cfg(test)]
mod tests;
