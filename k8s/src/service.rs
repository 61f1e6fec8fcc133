//! The DevicePlugin gRPC service the kubelet calls on the plugin's socket.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use gpufrac_common::config::VAR_JOB;
use tokio::sync::watch;
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::api;
use crate::devices::{Injection, Inventory};
use crate::leases::{Leases, token_text};

/// What the service and the node loop share.
pub struct Shared {
    pub inventory: Mutex<Inventory>,
    pub inject: Injection,
    /// The current device list; every ListAndWatch stream follows it.
    pub devices: watch::Sender<Vec<api::Device>>,
    /// Allocations booked with the broker. Locked after `inventory`, never
    /// before it.
    pub leases: Mutex<Leases>,
}

impl Shared {
    pub fn new(inventory: Inventory, inject: Injection, leases: Leases) -> Shared {
        let (devices, _) = watch::channel(inventory.devices());
        Shared {
            inventory: Mutex::new(inventory),
            inject,
            devices,
            leases: Mutex::new(leases),
        }
    }

    pub fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes the inventory's device list if it changed.
    pub fn publish(&self) {
        let list = self.lock().devices();
        self.devices.send_if_modified(|cur| {
            if *cur == list {
                false
            } else {
                *cur = list;
                true
            }
        });
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Inventory> {
        // A panic while holding the lock leaves the inventory as it was
        // between two whole updates; carry on with it.
        self.inventory.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One server instance: its streams end when `stop` turns true, so that a
/// restart (a new kubelet) is not held up by the old kubelet's
/// ListAndWatch, which never ends by itself.
pub struct Service {
    pub shared: Arc<Shared>,
    pub stop: watch::Receiver<bool>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for Service {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // A task per stream: it sends the list, then again at every
        // change, and ends when the kubelet hangs up or the server stops.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut devices = self.shared.devices.subscribe();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            loop {
                let list = devices.borrow_and_update().clone();
                if tx
                    .send(Ok(api::ListAndWatchResponse { devices: list }))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::select! {
                    r = devices.changed() => if r.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
            }
        });
        let stream = ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let inv = self.shared.lock();
        let mut out = api::PreferredAllocationResponse::default();
        for c in &req.get_ref().container_requests {
            let size = usize::try_from(c.allocation_size).map_err(|_| {
                Status::invalid_argument(format!(
                    "allocation_size {} is negative; expected the number of devices wanted",
                    c.allocation_size
                ))
            })?;
            let ids = inv
                .preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size)
                .map_err(Status::invalid_argument)?;
            out.container_responses
                .push(api::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(out))
    }

    async fn allocate(
        &self,
        req: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let inv = self.shared.lock();
        let mut out = api::AllocateResponse::default();
        for c in &req.get_ref().container_requests {
            let refuse = |e: String| {
                tracing::warn!("refused an allocation of {:?}: {e}", c.devices_ids);
                Status::invalid_argument(e)
            };
            let (mut r, booking) = inv
                .allocate(&c.devices_ids, &self.shared.inject)
                .map_err(refuse)?;
            // Booked in the background: the kubelet does not wait on the
            // broker, and the container's processes join the job by this
            // token whenever the booking lands.
            let token = self.shared.leases().book(booking);
            r.envs.insert(VAR_JOB.into(), token_text(token));
            tracing::info!(
                "allocated {} {} on {}: {}",
                c.devices_ids.len(),
                inv.resource().name(),
                r.envs
                    .get("CUDA_VISIBLE_DEVICES")
                    .map_or("?", String::as_str),
                caps(&r)
            );
            out.container_responses.push(r);
        }
        Ok(Response::new(out))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        // Registered with pre_start_required = false: nothing to prepare.
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// What the plugin registers with and answers GetDevicePluginOptions with.
pub fn options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// "GPU_MEM_LIMIT=4G GPU_COMPUTE_SHARE=25%", for the log.
fn caps(r: &api::ContainerAllocateResponse) -> String {
    let mut v: Vec<String> = r
        .envs
        .iter()
        .filter(|(k, _)| k.starts_with("GPU_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    v.sort();
    v.join(" ")
}
