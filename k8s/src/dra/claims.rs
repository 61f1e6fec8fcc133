//! What a ResourceClaim gives a pod on this node: from the scheduler's
//! allocation (`status.allocation.devices.results`), the results of this
//! driver, each a GPU of this node's pool with the memory and compute the
//! scheduler booked for it (`consumedCapacity`). Pure: the claim comes in,
//! the grant or the reason there is none goes out, in words a cluster
//! admin can act on.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::{Deserialize, Serialize};

use super::gpus::Gpus;
use super::quantity;
use super::slices::{COMPUTE, MEMORY, WHOLE_COMPUTE};

/// Which claim the kubelet asks about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    /// `namespace/name`.
    pub fn path(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// One allocation result of this driver, as the kubelet's answer names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResultRef {
    pub request: String,
    pub pool: String,
    pub device: String,
}

/// One GPU of a grant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GrantedGpu {
    /// Its device name in the slice.
    pub device: String,
    pub uuid: String,
    /// Memory booked on it, bytes: the cap of the claim's processes there.
    pub mem: u64,
    /// Compute booked on it, percent.
    pub compute: f64,
}

/// What a claim gives its pods on this node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Grant {
    /// By device name, each GPU once (results on one GPU add up).
    pub gpus: Vec<GrantedGpu>,
    pub results: Vec<ResultRef>,
    /// `adminAccess`: the GPUs are given for monitoring, beside whatever
    /// else runs there, without caps and without a lease.
    pub admin: bool,
    /// The pods the claim is reserved for, `namespace/name`.
    pub pods: Vec<String>,
}

impl Grant {
    /// The compute share of each of the claim's processes: the smallest of
    /// its GPUs' (a process has one `GPU_COMPUTE_SHARE`).
    pub fn share(&self) -> Option<f64> {
        if self.admin {
            return None;
        }
        self.gpus.iter().map(|g| g.compute).reduce(f64::min)
    }
}

/// Reads the grant of `claim` (fetched for `asked`) on this node: results
/// of `driver` from pool `pool`, on GPUs of `gpus`.
pub fn grant(
    claim: &ResourceClaim,
    asked: &ClaimRef,
    driver: &str,
    pool: &str,
    gpus: &Gpus,
) -> Result<Grant, String> {
    let path = asked.path();
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != asked.uid {
        return Err(format!(
            "ResourceClaim {path} has UID {uid}, not {} as the kubelet asked: the claim was \
             deleted and made again since the pod was scheduled; delete the pod so that it is \
             scheduled with the new claim",
            asked.uid
        ));
    }
    let Some(results) = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
    else {
        return Err(format!(
            "ResourceClaim {path} is not allocated (it has no status.allocation.devices.results): \
             the scheduler has not placed it yet; see `kubectl describe resourceclaim -n {} {}`",
            asked.namespace, asked.name
        ));
    };
    let ours: Vec<_> = results.iter().filter(|r| r.driver == driver).collect();
    if ours.is_empty() {
        let mut others: Vec<&str> = results.iter().map(|r| r.driver.as_str()).collect();
        others.sort_unstable();
        others.dedup();
        return Err(format!(
            "ResourceClaim {path} has no device of driver {driver} (its devices are of {}): its \
             DeviceClass must select `device.driver == \"{driver}\"`, as \
             deploy/k8s/dra/deviceclass.yaml does",
            if others.is_empty() {
                "no driver".to_string()
            } else {
                others.join(", ")
            }
        ));
    }
    let admin = ours.iter().filter(|r| r.admin_access == Some(true)).count();
    if admin != 0 && admin != ours.len() {
        return Err(format!(
            "ResourceClaim {path} asks for some devices with adminAccess and some without; \
             gpufrac enforces caps per claim, so put them in two claims"
        ));
    }
    let mut by_device: BTreeMap<String, GrantedGpu> = BTreeMap::new();
    let mut refs = Vec::new();
    for r in ours {
        if r.pool != pool {
            return Err(format!(
                "ResourceClaim {path}: request {:?} was given device {} of pool {:?}, but this \
                 node's pool is {pool:?}: the claim was allocated on another node (or before the \
                 node was renamed); delete the pod so that it is scheduled again",
                r.request, r.device, r.pool
            ));
        }
        let Some(k) = gpus.by_name(&r.device) else {
            return Err(format!(
                "ResourceClaim {path}: request {:?} was given device {:?}, which this node has \
                 never published (its GPUs are {}); delete the pod so that it is scheduled again",
                r.request,
                r.device,
                gpus.present()
                    .map(|k| k.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        };
        if !k.present {
            return Err(format!(
                "ResourceClaim {path}: request {:?} was given {} ({}), which the driver no \
                 longer lists (the GPU fell off the bus, or the driver failed): check the node \
                 with nvidia-smi; the device is withdrawn from the node's ResourceSlice",
                r.request, k.name, k.gpu.uuid
            ));
        }
        let consumed = r.consumed_capacity.as_ref();
        let read = |key: &str| consumed.and_then(|c| c.get(key)).map(|q| q.0.as_str());
        let whole_mem = k.gpu.total_mem;
        let mem = match read(MEMORY) {
            Some(q) => quantity::parse_ceil(q).map_err(|e| {
                format!(
                    "ResourceClaim {path}: consumedCapacity.memory of request {:?}: {e}",
                    r.request
                )
            })?,
            None => whole_mem,
        };
        let compute = match read(COMPUTE) {
            Some(q) => quantity::parse_f64(q).map_err(|e| {
                format!(
                    "ResourceClaim {path}: consumedCapacity.compute of request {:?}: {e}",
                    r.request
                )
            })?,
            None => WHOLE_COMPUTE as f64,
        };
        if mem == 0 || compute <= 0.0 {
            return Err(format!(
                "ResourceClaim {path}: request {:?} was given no {} of {} (consumedCapacity \
                 {}); a claim must consume some of each, as the ResourceSlice's request policy \
                 says (at least one memory step, and 1% of compute)",
                r.request,
                if mem == 0 { "memory" } else { "compute" },
                k.name,
                consumed.map_or("unset".into(), |c| format!("{c:?}"))
            ));
        }
        let g = by_device.entry(k.name.clone()).or_insert(GrantedGpu {
            device: k.name.clone(),
            uuid: k.gpu.uuid.clone(),
            mem: 0,
            compute: 0.0,
        });
        g.mem = g.mem.saturating_add(mem).min(whole_mem);
        g.compute = (g.compute + compute).min(WHOLE_COMPUTE as f64);
        refs.push(ResultRef {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
        });
    }
    let pods = claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .map(|v| {
            v.iter()
                .filter(|c| c.resource == "pods" && c.api_group.as_deref().unwrap_or("").is_empty())
                .map(|c| format!("{}/{}", asked.namespace, c.name))
                .collect()
        })
        .unwrap_or_default();
    Ok(Grant {
        gpus: by_device.into_values().collect(),
        results: refs,
        admin: admin != 0,
        pods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::Gpu;
    use serde_json::json;

    fn gpus() -> Gpus {
        Gpus::new(vec![
            Gpu {
                index: 0,
                uuid: "GPU-a".into(),
                total_mem: 16 << 30,
                name: String::new(),
            },
            Gpu {
                index: 1,
                uuid: "GPU-b".into(),
                total_mem: 8 << 30,
                name: String::new(),
            },
        ])
        .unwrap()
    }

    fn asked() -> ClaimRef {
        ClaimRef {
            namespace: "ml".into(),
            name: "infer".into(),
            uid: "u-1".into(),
        }
    }

    fn claim(results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "ml", "name": "infer", "uid": "u-1"},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": results}},
                "reservedFor": [{"resource": "pods", "name": "infer-0", "uid": "p-1"}],
            },
        }))
        .unwrap()
    }

    fn result(device: &str, consumed: serde_json::Value) -> serde_json::Value {
        json!({
            "request": "gpu", "driver": "gpufrac.dev", "pool": "node-1", "device": device,
            "consumedCapacity": consumed, "shareID": "5f2c",
        })
    }

    fn get(c: &ResourceClaim) -> Result<Grant, String> {
        grant(c, &asked(), "gpufrac.dev", "node-1", &gpus())
    }

    #[test]
    fn consumed_capacity_is_the_grant() {
        let g = get(&claim(json!([result(
            "gpu-0",
            json!({"memory": "4Gi", "compute": "30"})
        )])))
        .unwrap();
        assert_eq!(
            g.gpus,
            [GrantedGpu {
                device: "gpu-0".into(),
                uuid: "GPU-a".into(),
                mem: 4 << 30,
                compute: 30.0
            }]
        );
        assert_eq!(g.share(), Some(30.0));
        assert_eq!(g.pods, ["ml/infer-0"]);
        assert_eq!(
            g.results,
            [ResultRef {
                request: "gpu".into(),
                pool: "node-1".into(),
                device: "gpu-0".into()
            }]
        );
        // Without consumed capacity: the whole GPU.
        let g = get(&claim(json!([result("gpu-1", json!(null))]))).unwrap();
        assert_eq!((g.gpus[0].mem, g.gpus[0].compute), (8 << 30, 100.0));
        // Two results on one GPU add up; on two GPUs the share is the
        // smaller.
        let g = get(&claim(json!([
            result("gpu-0", json!({"memory": "1Gi", "compute": "10"})),
            result("gpu-0", json!({"memory": "2Gi", "compute": "20"})),
            result("gpu-1", json!({"memory": "1Gi", "compute": "5"})),
        ])))
        .unwrap();
        assert_eq!(g.gpus.len(), 2);
        assert_eq!((g.gpus[0].mem, g.gpus[0].compute), (3 << 30, 30.0));
        assert_eq!(g.share(), Some(5.0));
        assert_eq!(g.results.len(), 3);
    }

    #[test]
    fn what_cannot_be_prepared_says_what_to_do() {
        let mut other = claim(json!([result("gpu-0", json!({}))]));
        other.metadata.uid = Some("u-2".into());
        let e = get(&other).unwrap_err();
        assert!(
            e.contains("has UID u-2, not u-1") && e.contains("delete the pod"),
            "{e}"
        );

        let mut c = claim(json!([]));
        c.status.as_mut().unwrap().allocation = None;
        let e = get(&c).unwrap_err();
        assert!(
            e.contains("is not allocated") && e.contains("kubectl describe"),
            "{e}"
        );

        let mut r = result("gpu-0", json!({}));
        r["driver"] = json!("gpu.nvidia.com");
        let e = get(&claim(json!([r]))).unwrap_err();
        assert!(
            e.contains("no device of driver gpufrac.dev") && e.contains("gpu.nvidia.com"),
            "{e}"
        );

        let e = get(&claim(json!([result("gpu-7", json!({}))]))).unwrap_err();
        assert!(e.contains("\"gpu-7\"") && e.contains("gpu-0, gpu-1"), "{e}");

        let mut r = result("gpu-0", json!({}));
        r["pool"] = json!("node-2");
        let e = get(&claim(json!([r]))).unwrap_err();
        assert!(
            e.contains("\"node-2\"") && e.contains("another node"),
            "{e}"
        );

        let e = get(&claim(json!([result("gpu-0", json!({"memory": "4GB"}))]))).unwrap_err();
        assert!(
            e.contains("consumedCapacity.memory") && e.contains("4Gi"),
            "{e}"
        );

        let e = get(&claim(json!([result("gpu-0", json!({"compute": "0"}))]))).unwrap_err();
        assert!(e.contains("no compute"), "{e}");

        let mut a = result("gpu-0", json!({}));
        a["adminAccess"] = json!(true);
        let e = get(&claim(json!([a.clone(), result("gpu-1", json!({}))]))).unwrap_err();
        assert!(e.contains("two claims"), "{e}");
        let g = get(&claim(json!([a]))).unwrap();
        assert!(g.admin && g.share().is_none());

        let mut gone = gpus();
        let left = gone.by_name("gpu-1").unwrap().gpu.clone();
        gone.update(Ok(vec![left]));
        let e = grant(
            &claim(json!([result("gpu-0", json!({}))])),
            &asked(),
            "gpufrac.dev",
            "node-1",
            &gone,
        )
        .unwrap_err();
        assert!(
            e.contains("no longer lists") && e.contains("nvidia-smi"),
            "{e}"
        );
    }
}
