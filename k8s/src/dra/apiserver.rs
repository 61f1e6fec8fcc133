//! The API server, through kube-rs: the claims the kubelet asks about are
//! read, the node's ResourceSlice is written. Every call has a deadline,
//! and every failure is said with what to check (RBAC in
//! deploy/k8s/dra/rbac.yaml, the claim's name, the server's address).

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api as KubeApi, DeleteParams, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::claims::ClaimRef;
use super::slices;

/// What one call to the API server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct Api {
    client: kube::Client,
    /// For messages: where it is.
    server: String,
}

/// A slice as this process sent it, and as the API server stored it.
pub struct Written {
    pub sent: ResourceSlice,
    pub stored: ResourceSlice,
}

/// What publishing did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Published {
    Created(i64),
    Updated(i64),
    Unchanged(i64),
}

impl Api {
    /// A client from `kubeconfig`, else as kubectl finds one: $KUBECONFIG,
    /// the pod's service account, ~/.kube/config.
    pub async fn connect(kubeconfig: Option<&Path>) -> Result<Api, String> {
        let mut config = match kubeconfig {
            Some(p) => {
                let kc = Kubeconfig::read_from(p)
                    .map_err(|e| format!("--kubeconfig {}: {}", p.display(), chain(&e)))?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| format!("--kubeconfig {}: {}", p.display(), chain(&e)))?
            }
            None => kube::Config::infer().await.map_err(|e| {
                format!(
                    "no credentials for the API server: {}; in a pod, give the DaemonSet its \
                     service account (deploy/k8s/dra/daemonset.yaml); elsewhere, pass \
                     --kubeconfig or set KUBECONFIG",
                    chain(&e)
                )
            })?,
        };
        config.connect_timeout = Some(CALL_TIMEOUT);
        config.read_timeout = Some(CALL_TIMEOUT);
        config.write_timeout = Some(CALL_TIMEOUT);
        let server = config.cluster_url.to_string();
        let client = kube::Client::try_from(config)
            .map_err(|e| format!("cannot make a client for {server}: {}", chain(&e)))?;
        Ok(Api { client, server })
    }

    /// The claim the kubelet names.
    pub async fn claim(&self, c: &ClaimRef) -> Result<ResourceClaim, String> {
        let api: KubeApi<ResourceClaim> = KubeApi::namespaced(self.client.clone(), &c.namespace);
        match self.call(api.get(&c.name)).await {
            Err(Failure::Api(s)) if s.is_not_found() => Err(format!(
                "ResourceClaim {} does not exist (it was deleted); the kubelet asks again for \
                 the pod's current claims",
                c.path()
            )),
            r => r.map_err(|e| e.say(&self.server, &format!("reading ResourceClaim {}", c.path()))),
        }
    }

    /// The Node's UID, for the slice's owner reference.
    pub async fn node_uid(&self, node: &str) -> Result<String, String> {
        let api: KubeApi<Node> = KubeApi::all(self.client.clone());
        let n = self
            .call(api.get(node))
            .await
            .map_err(|e| e.say(&self.server, &format!("reading Node {node}")))?;
        n.metadata
            .uid
            .ok_or_else(|| format!("Node {node} has no UID in the API server's answer"))
    }

    /// Makes the node's slices of `driver` be `want` alone: creates it, or
    /// replaces it under the next pool generation when it says something
    /// else, and deletes any other slice of the driver for the node.
    ///
    /// `last` is what this process wrote last, and what the API server
    /// stored of it: an API server may store less than it was sent (one
    /// without consumable capacity drops the fields of sharing), so the
    /// slice is written again only when `want` differs from what was sent
    /// last, or the stored slice changed since (another writer).
    pub async fn publish(
        &self,
        mut want: ResourceSlice,
        driver: &str,
        node: &str,
        last: &mut Option<Written>,
    ) -> Result<Published, String> {
        let api: KubeApi<ResourceSlice> = KubeApi::all(self.client.clone());
        let name = want.metadata.name.clone().unwrap_or_default();
        let fields = format!("spec.nodeName={node},spec.driver={driver}");
        let listed = self
            .call(api.list(&ListParams::default().fields(&fields)))
            .await
            .map_err(|e| e.say(&self.server, "listing the node's ResourceSlices"))?;
        let mut mine = None;
        let mut generation = 0;
        for s in listed.items {
            generation = generation.max(s.spec.pool.generation);
            let other = s.metadata.name.clone().unwrap_or_default();
            if other == name {
                mine = Some(s);
                continue;
            }
            tracing::info!(
                "deleting ResourceSlice {other} of an earlier run (its devices are in {name} now)"
            );
            match self
                .call(api.delete(&other, &DeleteParams::default()))
                .await
            {
                Err(Failure::Api(s)) if s.is_not_found() => {}
                r => {
                    r.map_err(|e| e.say(&self.server, &format!("deleting ResourceSlice {other}")))?;
                }
            }
        }
        let g = generation + 1;
        want.spec.pool.generation = g;
        let (stored, published) = match mine {
            Some(s) => {
                let as_written = match last.as_ref() {
                    Some(l) => {
                        slices::same(&l.sent, &want)
                            && l.stored.metadata.resource_version == s.metadata.resource_version
                    }
                    None => slices::same(&s, &want),
                };
                if as_written {
                    return Ok(Published::Unchanged(s.spec.pool.generation));
                }
                want.metadata.resource_version = s.metadata.resource_version;
                let stored = self
                    .call(api.replace(&name, &PostParams::default(), &want))
                    .await
                    .map_err(|e| e.say(&self.server, &format!("replacing ResourceSlice {name}")))?;
                (stored, Published::Updated(g))
            }
            None => {
                let stored = self
                    .call(api.create(&PostParams::default(), &want))
                    .await
                    .map_err(|e| e.say(&self.server, &format!("creating ResourceSlice {name}")))?;
                (stored, Published::Created(g))
            }
        };
        *last = Some(Written { sent: want, stored });
        Ok(published)
    }

    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Err(_) => Err(Failure::Timeout),
            Ok(Err(kube::Error::Api(s))) => Err(Failure::Api(s)),
            Ok(Err(e)) => Err(Failure::Other(chain(&e))),
            Ok(Ok(v)) => Ok(v),
        }
    }
}

enum Failure {
    Api(Box<kube::core::Status>),
    Timeout,
    Other(String),
}

impl Failure {
    fn say(self, server: &str, doing: &str) -> String {
        match self {
            Failure::Timeout => format!(
                "{doing}: the API server at {server} did not answer within {CALL_TIMEOUT:?}"
            ),
            Failure::Other(e) => format!("{doing}: cannot reach the API server at {server}: {e}"),
            Failure::Api(s) if s.code == 403 || s.code == 401 => format!(
                "{doing}: the API server refused ({} {}): {}; the plugin's service account \
                 needs the rules of deploy/k8s/dra/rbac.yaml (resourceclaims get, \
                 resourceslices list/create/update/delete, nodes get)",
                s.code, s.reason, s.message
            ),
            Failure::Api(s) => format!(
                "{doing}: the API server answered {} {}: {}",
                s.code, s.reason, s.message
            ),
        }
    }
}

/// An error with its causes: kube's own text is often only the outer one.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
