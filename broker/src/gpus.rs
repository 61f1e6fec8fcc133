//! The GPUs the driver shows, as the broker finds them: for the commands
//! that must number GPUs as the broker does (`gpufrac run`, `gpufrac
//! cdi`, the device plugin), and MIG instances made through NVML as the
//! broker makes them (for tests that set up what a broker would find).

pub use crate::inventory::{GpuInfo, discover, use_pci_order};
pub use crate::mig::Range;
pub use crate::mig_nvml::{MigDriver, NvmlMig};
