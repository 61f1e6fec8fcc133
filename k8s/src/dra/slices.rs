//! The node's ResourceSlice (`resource.k8s.io/v1`): one pool named after
//! the node, one device per GPU, each with consumable `memory` (bytes) and
//! `compute` (percent of the GPU's time) that many claims may share
//! (`allowMultipleAllocations`). Pure: what to publish, not how.
//!
//! The request policies say what the scheduler books for a claim:
//! memory in whole steps (`--memory-step`) up to the GPU's memory, compute
//! in whole percent up to 100, and, for what a claim does not ask, all of
//! it: a claim that names neither gets the whole GPU, one that names only
//! memory gets the GPU's compute to itself. That is the safe reading of a
//! claim that said nothing, and it is what the plugin enforces.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::gpus::{Gpus, Known};
use super::quantity::format_bytes;

/// The capacities, as claims name them (`capacity.requests.memory`) and
/// CEL reads them (`device.capacity["gpufrac.dev"].memory`).
pub const MEMORY: &str = "memory";
pub const COMPUTE: &str = "compute";
/// A whole GPU's compute, percent.
pub const WHOLE_COMPUTE: u64 = 100;
/// The label on every slice the plugin writes: its driver.
pub const LABEL_DRIVER: &str = "gpufrac.dev/driver";

/// Who publishes, for whom.
#[derive(Clone, Debug)]
pub struct Publisher {
    pub driver: String,
    pub node: String,
    /// The Node's UID, for the owner reference that makes Kubernetes
    /// remove the slice with the node.
    pub node_uid: String,
    /// Memory is booked in multiples of this.
    pub memory_step: u64,
}

/// The slice's name: the node's and the driver's, each a DNS subdomain, so
/// the name is one too when it is not too long (cut to fit otherwise).
pub fn slice_name(driver: &str, node: &str) -> String {
    const MAX: usize = 253;
    let tail = format!("-{driver}");
    let keep = MAX.saturating_sub(tail.len()).min(node.len());
    let mut head = node[..keep].to_string();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    format!("{head}{tail}")
}

/// Memory a claim may be given on a GPU of `total` bytes: whole steps.
pub fn bookable(total: u64, step: u64) -> u64 {
    total / step.max(1) * step.max(1)
}

fn quantity(s: String) -> Quantity {
    Quantity(s)
}

/// The device for one GPU.
pub fn device(k: &Known, step: u64) -> Device {
    let max = bookable(k.gpu.total_mem, step);
    let mut attributes = BTreeMap::from([
        (
            "uuid".to_string(),
            DeviceAttribute {
                string: Some(k.gpu.uuid.clone()),
                ..Default::default()
            },
        ),
        (
            "index".to_string(),
            DeviceAttribute {
                int: Some(i64::from(k.gpu.index)),
                ..Default::default()
            },
        ),
        (
            "memory".to_string(),
            DeviceAttribute {
                int: i64::try_from(k.gpu.total_mem).ok(),
                ..Default::default()
            },
        ),
    ]);
    if !k.gpu.name.is_empty() {
        attributes.insert(
            "productName".into(),
            DeviceAttribute {
                // The API takes at most 64 characters.
                string: Some(k.gpu.name.chars().take(64).collect()),
                ..Default::default()
            },
        );
    }
    let capacity = BTreeMap::from([
        (
            MEMORY.to_string(),
            DeviceCapacity {
                value: quantity(format_bytes(k.gpu.total_mem)),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(quantity(format_bytes(max))),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: quantity(format_bytes(step)),
                        max: Some(quantity(format_bytes(max))),
                        step: Some(quantity(format_bytes(step))),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            COMPUTE.to_string(),
            DeviceCapacity {
                value: quantity(WHOLE_COMPUTE.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(quantity(WHOLE_COMPUTE.to_string())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: quantity("1".into()),
                        max: Some(quantity(WHOLE_COMPUTE.to_string())),
                        step: Some(quantity("1".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ]);
    Device {
        name: k.name.clone(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    }
}

/// The whole slice, at pool generation `generation`.
pub fn slice(p: &Publisher, gpus: &Gpus, generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(&p.driver, &p.node)),
            labels: Some(BTreeMap::from([(
                LABEL_DRIVER.to_string(),
                p.driver.clone(),
            )])),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: p.node.clone(),
                uid: p.node_uid.clone(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: p.driver.clone(),
            node_name: Some(p.node.clone()),
            pool: ResourcePool {
                name: p.node.clone(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(gpus.present().map(|k| device(k, p.memory_step)).collect()),
            ..Default::default()
        },
    }
}

/// Whether a published slice already says what `want` says (the pool's
/// generation aside): then nothing needs writing.
pub fn same(published: &ResourceSlice, want: &ResourceSlice) -> bool {
    let strip = |s: &ResourceSlice| {
        let mut spec = s.spec.clone();
        spec.pool.generation = 0;
        // The API server drops an empty list.
        if spec.devices.as_ref().is_some_and(Vec::is_empty) {
            spec.devices = None;
        }
        spec
    };
    strip(published) == strip(want)
        && published.metadata.owner_references == want.metadata.owner_references
        && published.metadata.labels == want.metadata.labels
}

/// Whether the API server stored a slice without the sharing it was sent
/// (`allowMultipleAllocations`, request policies): one whose
/// DRAConsumableCapacity feature is off drops them, and every claim then
/// gets a whole GPU.
pub fn sharing_dropped(sent: &ResourceSlice, stored: &ResourceSlice) -> bool {
    let shares = |s: &ResourceSlice| {
        s.spec
            .devices
            .iter()
            .flatten()
            .filter(|d| d.allow_multiple_allocations == Some(true))
            .count()
    };
    shares(stored) < shares(sent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::Gpu;

    fn gpus() -> Gpus {
        Gpus::new(vec![
            Gpu {
                index: 0,
                uuid: "GPU-a".into(),
                total_mem: 16 << 30,
                name: "NVIDIA H100 80GB HBM3".into(),
            },
            Gpu {
                index: 1,
                uuid: "GPU-b".into(),
                // Not a whole number of steps (real GPUs seldom are).
                total_mem: (8 << 30) + 12345,
                name: String::new(),
            },
        ])
        .unwrap()
    }

    fn publisher() -> Publisher {
        Publisher {
            driver: "gpufrac.dev".into(),
            node: "node-1".into(),
            node_uid: "0000-1111".into(),
            memory_step: 256 << 20,
        }
    }

    #[test]
    fn one_device_per_gpu_with_consumable_memory_and_compute() {
        let s = slice(&publisher(), &gpus(), 3);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(v["kind"], "ResourceSlice");
        assert_eq!(v["metadata"]["name"], "node-1-gpufrac.dev");
        assert_eq!(v["metadata"]["ownerReferences"][0]["kind"], "Node");
        assert_eq!(v["spec"]["nodeName"], "node-1");
        assert_eq!(
            v["spec"]["pool"],
            serde_json::json!({"name": "node-1", "generation": 3, "resourceSliceCount": 1})
        );
        let d0 = &v["spec"]["devices"][0];
        assert_eq!(d0["name"], "gpu-0");
        assert_eq!(d0["allowMultipleAllocations"], true);
        assert_eq!(d0["attributes"]["uuid"]["string"], "GPU-a");
        assert_eq!(d0["attributes"]["index"]["int"], 0);
        assert_eq!(
            d0["attributes"]["productName"]["string"],
            "NVIDIA H100 80GB HBM3"
        );
        assert_eq!(
            d0["capacity"]["memory"],
            serde_json::json!({
                "value": "16Gi",
                "requestPolicy": {
                    "default": "16Gi",
                    "validRange": {"min": "256Mi", "max": "16Gi", "step": "256Mi"},
                }
            })
        );
        assert_eq!(
            d0["capacity"]["compute"],
            serde_json::json!({
                "value": "100",
                "requestPolicy": {
                    "default": "100",
                    "validRange": {"min": "1", "max": "100", "step": "1"},
                }
            })
        );
        let d1 = &v["spec"]["devices"][1];
        assert_eq!(
            d1["capacity"]["memory"]["value"],
            ((8u64 << 30) + 12345).to_string()
        );
        assert_eq!(
            d1["capacity"]["memory"]["requestPolicy"]["validRange"]["max"], "8Gi",
            "whole steps only"
        );
        assert!(d1["attributes"].get("productName").is_none());
    }

    #[test]
    fn a_republished_slice_is_the_same_but_for_its_generation() {
        let p = publisher();
        let mut g = gpus();
        let a = slice(&p, &g, 1);
        assert!(same(&a, &slice(&p, &g, 7)));
        let first = g.present().next().unwrap().gpu.clone();
        g.update(Ok(vec![first]));
        assert!(!same(&a, &slice(&p, &g, 1)));
    }

    #[test]
    fn names_fit() {
        assert_eq!(slice_name("gpufrac.dev", "n1"), "n1-gpufrac.dev");
        let long = "a".repeat(300);
        let n = slice_name("gpufrac.dev", &long);
        assert_eq!(n.len(), 253);
        assert!(n.ends_with("-gpufrac.dev"));
    }
}
