//! MIG on the simulated devices: the GPU models whose MIG profiles NVIDIA
//! documents, GPU and compute instances kept in the shared state (so every
//! process on one `GPUFRAC_SIM_STATE` sees the same instances), MIG device
//! UUIDs and handles, and the NVML entry points over them with the
//! signatures of `nvml.h`.
//!
//! Profiles, memory sizes and placements are what `nvidia-smi mig -lgip`
//! and `-lgipp` print on these GPUs (NVIDIA's MIG user guide): a GPU has 7
//! compute slices and 8 memory slices, and a profile may start only where
//! the hardware allows (`1g.5gb` at 0..6, `2g.10gb` at 0, 2, 4, `3g.20gb`
//! at 0 and 4, `4g.20gb` and `7g.40gb` at 0). Engine counts (copy engines,
//! decoders, JPEG, OFA) are approximate; nothing in gpufrac reads them.
//!
//! Like the real driver, the simulator refuses to destroy a GPU instance
//! that still has compute instances (`NVML_ERROR_IN_USE`), and a compute
//! instance that a live process runs on (one that loaded the simulator with
//! `CUDA_VISIBLE_DEVICES=MIG-<uuid>`). MIG mode itself is read-only: it
//! comes from `GPUFRAC_SIM_DEVICES` (`A100-40GB:mig`) and nothing sets it.
//!
//! Simplifications: GPU instance ids are 1..=8 and compute instance ids
//! 0..=7 in creation slots (the driver's ids depend on the placement);
//! every MIG device has its own execution engine, shared by the compute
//! instances of one GPU instance; `nvmlDeviceCreateGpuInstance` and
//! compute instance creation take the first free placement.
//!
//! Three parts: `profiles`, the models' profile tables (pure data);
//! `state`, the instances in the shared state file and the rules for
//! creating and destroying them; `nvml`, the handles and the NVML entry
//! points over them.

mod nvml;
mod profiles;
mod state;

pub use nvml::{handle_by_uuid, live_mig_device, mig_handle, write_uuid};
pub use profiles::Model;
pub use state::{Mig, MigShared};
