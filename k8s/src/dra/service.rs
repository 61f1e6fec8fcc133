//! The gRPC services the kubelet calls: Registration on the registration
//! socket (what the plugin is, where it serves, and the kubelet's verdict),
//! and the DRA plugin service, v1 and v1beta1 alike, on the plugin's own
//! socket. Each claim of a call is prepared or refused on its own: one
//! claim's error is that claim's answer, never the others'.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::apiserver::Api;
use super::claims::{self, ClaimRef};
use super::gpus::Gpus;
use super::prepared::{Answer, Prepared};
use crate::dra_v1 as v1;
use crate::{dra_v1beta1, pluginregistration};

/// What the kubelet's plugin watcher is told the plugin is.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The services served on the endpoint, as registration names them.
pub const VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// What the services and the node loop share.
pub struct Shared {
    pub driver: String,
    /// The node's pool: its name.
    pub pool: String,
    pub gpus: Mutex<Gpus>,
    pub prepared: tokio::sync::Mutex<Prepared>,
    pub api: Api,
}

impl Shared {
    fn gpus(&self) -> std::sync::MutexGuard<'_, Gpus> {
        self.gpus.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Prepares one claim, or says why not.
    async fn prepare(&self, c: &ClaimRef) -> Result<Answer, String> {
        if c.uid.is_empty() || c.namespace.is_empty() || c.name.is_empty() {
            return Err(format!(
                "the kubelet asked to prepare a claim without namespace, name or UID \
                 ({c:?}); every one is needed"
            ));
        }
        if let Some(a) = self.prepared.lock().await.answer(&c.uid) {
            return a;
        }
        // Read without holding the claims: a slow API server delays this
        // claim, not the unprepares and other claims meanwhile.
        let claim = self.api.claim(c).await?;
        let (grant, nodes) = {
            let gpus = self.gpus();
            let grant = claims::grant(&claim, c, &self.driver, &self.pool, &gpus)?;
            let nodes = grant
                .gpus
                .iter()
                .map(|g| gpus.by_uuid(&g.uuid).map_or(0, |k| k.node_number()))
                .collect();
            (grant, nodes)
        };
        let mut p = self.prepared.lock().await;
        // Prepared by another call meanwhile (two pods of one claim).
        if let Some(a) = p.answer(&c.uid) {
            return a;
        }
        p.add(c.clone(), grant, nodes)
    }

    async fn prepare_all(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<Answer, String>)> {
        let mut out = Vec::new();
        for c in claims {
            let r = self.prepare(&c).await;
            if let Err(e) = &r {
                tracing::warn!("cannot prepare ResourceClaim {} ({}): {e}", c.path(), c.uid);
            }
            out.push((c.uid, r));
        }
        out
    }

    async fn unprepare_all(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<(), String>)> {
        let mut out = Vec::new();
        for c in claims {
            let r = self.prepared.lock().await.remove(&c.uid);
            if let Err(e) = &r {
                tracing::warn!(
                    "cannot unprepare ResourceClaim {} ({}): {e}",
                    c.path(),
                    c.uid
                );
            }
            out.push((c.uid, r));
        }
        out
    }
}

impl Shared {
    /// NodePrepareResources, either version: every claim answered, each
    /// with its devices or its error.
    async fn node_prepare(
        &self,
        req: v1::NodePrepareResourcesRequest,
    ) -> v1::NodePrepareResourcesResponse {
        let claims = req.claims.into_iter().map(claim_ref).collect();
        let mut out = v1::NodePrepareResourcesResponse::default();
        for (uid, r) in self.prepare_all(claims).await {
            let answer = match r {
                Ok(a) => v1::NodePrepareResourceResponse {
                    devices: a
                        .results
                        .iter()
                        .map(|r| v1::Device {
                            request_names: vec![r.request.clone()],
                            pool_name: r.pool.clone(),
                            device_name: r.device.clone(),
                            cdi_device_ids: a.cdi_ids.clone(),
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(e) => v1::NodePrepareResourceResponse {
                    devices: Vec::new(),
                    error: e,
                },
            };
            out.claims.insert(uid, answer);
        }
        out
    }

    /// NodeUnprepareResources, either version.
    async fn node_unprepare(
        &self,
        req: v1::NodeUnprepareResourcesRequest,
    ) -> v1::NodeUnprepareResourcesResponse {
        let claims = req.claims.into_iter().map(claim_ref).collect();
        let mut out = v1::NodeUnprepareResourcesResponse::default();
        for (uid, r) in self.unprepare_all(claims).await {
            out.claims.insert(
                uid,
                v1::NodeUnprepareResourceResponse {
                    error: r.err().unwrap_or_default(),
                },
            );
        }
        out
    }
}

fn claim_ref(c: v1::Claim) -> ClaimRef {
    ClaimRef {
        namespace: c.namespace,
        name: c.name,
        uid: c.uid,
    }
}

/// The DRA plugin service, v1 (kubelets of 1.34 and later).
pub struct V1(pub Arc<Shared>);

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for V1 {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.node_prepare(req.into_inner()).await))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.node_unprepare(req.into_inner()).await))
    }
}

/// The DRA plugin service, v1beta1 (kubelets of 1.32 and 1.33): v1's
/// messages under another service name.
pub struct V1beta1(pub Arc<Shared>);

#[tonic::async_trait]
impl dra_v1beta1::dra_plugin_server::DraPlugin for V1beta1 {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.node_prepare(req.into_inner()).await))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.node_unprepare(req.into_inner()).await))
    }
}

/// The registration service on the plugins_registry socket.
pub struct Registration {
    pub driver: String,
    /// The DRA service's socket, as an absolute path.
    pub endpoint: String,
    /// Told of every successful registration: the kubelet restarted or
    /// took the plugin anew, and the node's slice is published again.
    pub registered: mpsc::Sender<()>,
}

#[tonic::async_trait]
impl pluginregistration::registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _: Request<pluginregistration::InfoRequest>,
    ) -> Result<Response<pluginregistration::PluginInfo>, Status> {
        Ok(Response::new(pluginregistration::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<pluginregistration::RegistrationStatus>,
    ) -> Result<Response<pluginregistration::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            tracing::info!(
                "the kubelet registered driver {} (endpoint {})",
                self.driver,
                self.endpoint
            );
            // A full queue already holds a republish.
            let _ = self.registered.try_send(());
        } else {
            tracing::error!(
                "the kubelet refused driver {}: {}; check the kubelet's log, and that its \
                 version speaks one of {} (Kubernetes 1.32 or later)",
                self.driver,
                s.error,
                VERSIONS.join(", ")
            );
        }
        Ok(Response::new(
            pluginregistration::RegistrationStatusResponse {},
        ))
    }
}
