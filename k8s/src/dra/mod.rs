//! `gpufrac k8s-dra-plugin`: a kubelet plugin for Kubernetes Dynamic
//! Resource Allocation (`resource.k8s.io/v1`) whose consumable capacity is
//! enforced, not only booked. The node's GPUs are published as one
//! ResourceSlice, each GPU a device whose `memory` and `compute` many
//! claims may share; when the kubelet prepares a claim, the plugin reads
//! what the scheduler booked for it (`consumedCapacity`) and makes it
//! true: a lease in the broker pinned to the GPU with that memory and
//! compute share, and a CDI device that puts every container of the claim
//! under the shim with that cap and share. `docs/k8s-dra.md` describes it
//! for cluster admins.
//!
//! Rooms, lowest first:
//! - [`quantity`]: Kubernetes quantities (`4Gi`, `30`).
//! - [`gpus`]: the node's GPUs and their stable device names.
//! - [`slices`]: the ResourceSlice to publish (pure).
//! - [`claims`]: what an allocated ResourceClaim grants on this node, or
//!   why it cannot be prepared (pure).
//! - [`cdi`]: the CDI spec of a prepared claim.
//! - `apiserver`: reading claims and writing the slice with kube-rs.
//! - `prepared`: the prepared claims, their leases, books and specs, and
//!   the checkpoint that carries them across restarts.
//! - `service`: the gRPC services the kubelet calls (registration, DRA v1
//!   and v1beta1).
//! - `node`: sockets, registration, publishing and GPU polling.

mod apiserver;
pub mod cdi;
pub mod claims;
pub mod gpus;
mod node;
mod prepared;
pub mod quantity;
mod service;
pub mod slices;

use std::path::PathBuf;
use std::time::Duration;

pub use service::{PLUGIN_TYPE, VERSIONS};

use crate::Lister;

/// The driver's name by default: the DNS name the project owns.
pub const DEFAULT_DRIVER: &str = "gpufrac.dev";
/// Where the kubelet's plugin watcher looks for registration sockets.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where kubelet plugins keep their own sockets (the plugin's goes into a
/// directory named after the driver).
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where runtimes read CDI specs made at run time.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// The step in which claims book memory by default.
pub const DEFAULT_MEMORY_STEP: u64 = 256 << 20;

pub struct Config {
    pub driver: String,
    /// The node's name as the API server knows it; also the pool's.
    pub node: String,
    pub registry_dir: PathBuf,
    pub plugins_dir: PathBuf,
    pub cdi_dir: PathBuf,
    /// The checkpoint of prepared claims and their books (root's only).
    pub state_dir: PathBuf,
    /// None: $KUBECONFIG, the service account, ~/.kube/config.
    pub kubeconfig: Option<PathBuf>,
    pub memory_step: u64,
    /// What every claim's containers get from this node.
    pub edits: cdi::Edits,
    pub lister: Lister,
    /// How often the GPUs are listed again.
    pub poll_interval: Duration,
    /// Where the kernel module lists GPUs and their minor numbers.
    pub proc_gpus: PathBuf,
    /// The broker's socket, where claims are booked.
    pub socket: PathBuf,
}

/// Runs the plugin until SIGTERM or SIGINT.
pub fn run(cfg: Config) -> Result<(), String> {
    crate::block_on(node::serve(cfg))
}
