//! The plugin's life beside the kubelet: serve its socket, register, watch
//! the kubelet's directory for a restart (the kubelet then removes every
//! socket there and makes a new kubelet.sock) and register again; list the
//! GPUs now and then and report the devices of a GPU that went Unhealthy.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::api;
use crate::devices::{Inventory, Resource};
use crate::leases::{Leases, list_pods};
use crate::service::{Service, Shared, options};
use crate::sockets::{FileId, Running, chain, connect_unix, file_id, serve_at};
use crate::{API_VERSION, Config, KUBELET_SOCKET, Lister};
use gpufrac_common::minors::read_minors;

/// How long the kubelet has to answer a registration.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// Registration retries start this soon (a kubelet.sock that was just
/// created may not accept yet) and back off to `RECHECK`.
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// Everything is checked this often whatever the directory watch says: a
/// watch can miss events (a directory mounted anew, an event queue that
/// overflowed).
const RECHECK: Duration = Duration::from_secs(5);
struct Node {
    dir: PathBuf,
    resource: Resource,
    shared: Arc<Shared>,
    server: Option<Running>,
    /// The kubelet.sock the plugin last registered with.
    registered: Option<FileId>,
    /// When to try registering again after a failure.
    retry_at: Option<Instant>,
    backoff: Duration,
}

pub async fn serve(cfg: Config) -> Result<(), String> {
    let Config {
        kubelet_dir: dir,
        resource,
        inject,
        poll_interval,
        lister,
        proc_gpus,
        leases: lease_cfg,
    } = cfg;
    if !dir.is_dir() {
        return Err(format!(
            "--kubelet-dir {}: not a directory; it must be the kubelet's device-plugin directory \
             (/var/lib/kubelet/device-plugins, which the kubelet creates), mounted into the \
             plugin's container with a hostPath volume",
            dir.display()
        ));
    }
    let gpus = lister.list().await.map_err(|e| {
        format!(
            "cannot list the GPUs: {e}; run the plugin on a GPU node, in a container that \
                 is given every GPU (the DaemonSet's runtimeClassName: nvidia and \
                 NVIDIA_VISIBLE_DEVICES=all)"
        )
    })?;
    let mut inv = Inventory::new(resource, gpus)?;
    inv.set_minors(&read_minors(&proc_gpus).unwrap_or_default());
    for g in inv.present() {
        tracing::info!(
            "GPU {} {} ({}): {} devices of {}",
            g.index,
            g.uuid,
            gpufrac_common::size::format_size(g.total_mem),
            resource.units(g.total_mem),
            resource.name()
        );
    }
    let pod_resources = lease_cfg.pod_resources.clone();
    let mut leases = Leases::new(lease_cfg);
    leases.load();
    let shared = Arc::new(Shared::new(inv, inject, leases));

    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT: {e}"))?;
    let (ev_tx, mut ev_rx) = mpsc::channel::<bool>(256);
    let _watcher = watch_dir(&dir, ev_tx)?;
    let poller = tokio::spawn(poll_gpus(
        lister,
        poll_interval,
        proc_gpus,
        Arc::clone(&shared),
    ));
    let pods = pod_resources.map(|socket| {
        tokio::spawn(poll_pods(
            socket,
            resource.name(),
            poll_interval,
            Arc::clone(&shared),
        ))
    });

    let mut node = Node {
        dir,
        resource,
        shared,
        server: None,
        registered: None,
        retry_at: None,
        backoff: FIRST_RETRY,
    };
    let mut recheck = tokio::time::interval(RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        node.reconcile().await;
        let retry = node.retry_at;
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            ev = ev_rx.recv() => {
                // Take every event that is queued: one look covers them.
                let mut next = ev;
                while let Some(kubelet_gone) = next {
                    if kubelet_gone {
                        node.registered = None;
                    }
                    next = ev_rx.try_recv().ok();
                }
            }
            _ = recheck.tick() => {}
            _ = sleep_until(retry) => {}
        }
    }
    tracing::info!("stopping");
    poller.abort();
    if let Some(p) = pods {
        p.abort();
    }
    let own = node.own_socket();
    let bound = node.server.as_ref().map(|s| s.bound);
    node.stop_server().await;
    // Only the socket this process made: after a restart race another
    // instance may own the name.
    if bound.is_some() && file_id(&own) == bound {
        let _ = std::fs::remove_file(&own);
    }
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Node {
    fn own_socket(&self) -> PathBuf {
        self.dir.join(self.resource.endpoint())
    }

    /// Brings things to where they should be: the plugin's socket served,
    /// and registered with the kubelet.sock that is there now.
    async fn reconcile(&mut self) {
        let own = self.own_socket();
        let own_id = file_id(&own);
        if self.server.as_ref().map(|s| s.bound) != own_id || self.server.is_none() {
            if self.server.is_some() {
                tracing::info!(
                    "{} was removed (the kubelet restarts?): serving it anew",
                    own.display()
                );
            }
            self.stop_server().await;
            match self.start_server(&own) {
                Ok(s) => {
                    self.server = Some(s);
                    // The kubelet must learn of the new socket.
                    self.registered = None;
                }
                Err(e) => {
                    tracing::error!("{e}");
                    self.schedule_retry();
                    return;
                }
            }
        }
        let kubelet = self.dir.join(KUBELET_SOCKET);
        let Some(kid) = file_id(&kubelet) else {
            if self.registered.take().is_some() {
                tracing::info!(
                    "{} is gone: waiting for the kubelet to come back",
                    kubelet.display()
                );
            }
            self.retry_at = None;
            return;
        };
        if self.registered == Some(kid) {
            return;
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match register(&kubelet, self.resource).await {
            Ok(()) => {
                tracing::info!(
                    "registered {} ({}) with the kubelet at {}",
                    self.resource.name(),
                    own.display(),
                    kubelet.display()
                );
                self.registered = Some(kid);
                self.retry_at = None;
                self.backoff = FIRST_RETRY;
            }
            Err(e) => {
                tracing::warn!(
                    "registering with the kubelet at {} failed: {e}; trying again in {:?}",
                    kubelet.display(),
                    self.backoff
                );
                self.schedule_retry();
            }
        }
    }

    fn schedule_retry(&mut self) {
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(RECHECK);
    }

    fn start_server(&self, path: &Path) -> Result<Running, String> {
        serve_at(path, |stop| {
            tonic::service::Routes::new(api::device_plugin_server::DevicePluginServer::new(
                Service {
                    shared: Arc::clone(&self.shared),
                    stop,
                },
            ))
        })
    }

    async fn stop_server(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await;
        }
    }
}

async fn register(kubelet: &Path, resource: Resource) -> Result<(), String> {
    let attempt = async {
        let channel = connect_unix(kubelet.to_path_buf())
            .await
            .map_err(|e| format!("cannot connect: {}", chain(&e)))?;
        api::registration_client::RegistrationClient::new(channel)
            .register(api::RegisterRequest {
                version: API_VERSION.into(),
                endpoint: resource.endpoint().into(),
                resource_name: resource.name().into(),
                options: Some(options()),
            })
            .await
            .map_err(|s| format!("the kubelet refused it: {}", s.message()))
    };
    match tokio::time::timeout(REGISTER_TIMEOUT, attempt).await {
        Ok(r) => r.map(|_| ()),
        Err(_) => Err(format!("no answer within {} s", REGISTER_TIMEOUT.as_secs())),
    }
}

/// Sends an event for every change in `dir`; `true` when kubelet.sock was
/// removed (a kubelet restart, even when the new socket gets the old one's
/// inode and change time).
fn watch_dir(dir: &Path, tx: mpsc::Sender<bool>) -> Result<notify::RecommendedWatcher, String> {
    use notify::{EventKind, RecursiveMode, Watcher};
    let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        let kubelet_gone = ev.as_ref().is_ok_and(|ev| {
            matches!(ev.kind, EventKind::Remove(_))
                && ev
                    .paths
                    .iter()
                    .any(|p| p.file_name().is_some_and(|n| n == KUBELET_SOCKET))
        });
        // A full queue already holds a wake-up; a removal still counts,
        // so it waits for room.
        if kubelet_gone {
            let _ = tx.blocking_send(true);
        } else {
            let _ = tx.try_send(false);
        }
    })
    .map_err(|e| format!("cannot watch {}: {e}", dir.display()))?;
    w.watch(dir, RecursiveMode::NonRecursive)
        .map_err(|e| format!("cannot watch {}: {e}", dir.display()))?;
    Ok(w)
}

/// Lists the GPUs every `every` and publishes their devices' health.
/// Asks the kubelet which pods hold the plugin's devices, every `every`,
/// for the leases.
async fn poll_pods(socket: PathBuf, resource: &'static str, every: Duration, shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match list_pods(&socket, resource).await {
            Ok(listed) => {
                let inv = shared.lock();
                shared
                    .leases()
                    .apply_list(listed, |ids| inv.booking(ids).ok());
            }
            Err(e) => shared.leases().list_failed(e),
        }
    }
}

async fn poll_gpus(lister: Lister, every: Duration, proc_gpus: PathBuf, shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate, and the GPUs were just listed.
    tick.tick().await;
    loop {
        tick.tick().await;
        let listed = lister.list().await;
        let minors = read_minors(&proc_gpus).unwrap_or_default();
        let changes = {
            let mut inv = shared.lock();
            let c = inv.update(listed);
            inv.set_minors(&minors);
            c
        };
        for c in changes {
            tracing::warn!("{c}");
        }
        shared.publish();
    }
}
