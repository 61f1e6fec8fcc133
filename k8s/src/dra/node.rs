//! The DRA plugin's life on the node: serve the DRA service and the
//! registration socket (serving either anew when it is removed), publish
//! the node's ResourceSlice — at start, whenever the kubelet registers the
//! plugin (a restarted kubelet removes the node's slices), whenever the
//! GPUs change, and now and then in case someone else changed it — and
//! list the GPUs every poll.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufrac_common::minors::read_minors;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::service::Routes;

use super::Config;
use super::apiserver::{Api, Published, Written};
use super::gpus::Gpus;
use super::prepared::{Prepared, Settings};
use super::service::{Registration, Shared, V1, V1beta1};
use super::slices::{self, Publisher};
use crate::sockets::{Running, file_id, serve_at};
use crate::{dra_v1, dra_v1beta1, pluginregistration};

/// Everything is checked this often: a socket removed, a slice changed by
/// someone else.
const RECHECK: Duration = Duration::from_secs(5);
/// The slice is compared with what the API server holds this often even
/// when nothing here changed.
const RESYNC: Duration = Duration::from_secs(60);
/// Publishing retries start this soon and back off to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(30);

/// A socket the plugin serves, and what it serves there.
struct Socket {
    path: PathBuf,
    what: &'static str,
    running: Option<Running>,
}

impl Socket {
    /// Serves the socket anew if it is not being served, or was removed.
    async fn keep(&mut self, routes: impl FnOnce() -> Routes) -> bool {
        let now = file_id(&self.path);
        if self.running.as_ref().map(|r| r.bound) == now && now.is_some() {
            return true;
        }
        if let Some(r) = self.running.take() {
            tracing::info!(
                "{} ({}) was removed: serving it anew",
                self.path.display(),
                self.what
            );
            r.stop().await;
        }
        match serve_at(&self.path, |_| routes()) {
            Ok(r) => {
                self.running = Some(r);
                true
            }
            Err(e) => {
                tracing::error!("{e}");
                false
            }
        }
    }

    async fn close(&mut self) {
        if let Some(r) = self.running.take() {
            let bound = r.bound;
            r.stop().await;
            // Only the socket this process made: another instance may own
            // the name after a restart race.
            if file_id(&self.path) == Some(bound) {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// When and why the slice is published next.
struct Publishing {
    /// Publish at the next look.
    due: bool,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The last failure, said once until it changes.
    said: Option<String>,
    node_uid: Option<String>,
    /// What was written last, and what the API server kept of it.
    last: Option<Written>,
    /// The API server was said to drop the sharing.
    said_dropped: bool,
}

pub async fn serve(cfg: Config) -> Result<(), String> {
    let Config {
        driver,
        node,
        registry_dir,
        plugins_dir,
        cdi_dir,
        state_dir,
        kubeconfig,
        memory_step,
        edits,
        lister,
        poll_interval,
        proc_gpus,
        socket,
    } = cfg;
    let plugin_dir = plugins_dir.join(&driver);
    for (dir, what, hint) in [
        (
            &registry_dir,
            "--registry-dir",
            "the kubelet's plugin registration directory, /var/lib/kubelet/plugins_registry",
        ),
        (
            &plugins_dir,
            "--plugins-dir",
            "the kubelet's plugins directory, /var/lib/kubelet/plugins",
        ),
    ] {
        if !dir.is_dir() {
            return Err(format!(
                "{what} {}: not a directory; it must be {hint} (the kubelet creates it), mounted \
                 into the plugin's container with a hostPath volume",
                dir.display()
            ));
        }
    }
    std::fs::create_dir_all(&plugin_dir)
        .map_err(|e| format!("cannot create {}: {e}", plugin_dir.display()))?;
    gpufrac_common::files::private_dir(&state_dir, 0o700, "--state-dir")?;

    let listed = lister.list().await.map_err(|e| {
        format!(
            "cannot list the GPUs: {e}; run the plugin on a GPU node, in a container that is \
             given every GPU (the DaemonSet's NVIDIA_VISIBLE_DEVICES=all with the NVIDIA \
             runtime, or the driver's device nodes and libraries)"
        )
    })?;
    let mut gpus = Gpus::new(listed)?;
    gpus.set_minors(&read_minors(&proc_gpus).unwrap_or_default());
    for k in gpus.present() {
        tracing::info!(
            "{}: GPU {} {} ({}{})",
            k.name,
            k.gpu.index,
            k.gpu.uuid,
            gpufrac_common::size::format_size(k.gpu.total_mem),
            if k.gpu.name.is_empty() {
                String::new()
            } else {
                format!(", {}", k.gpu.name)
            }
        );
    }
    if edits.mounts.control_nodes.is_empty() {
        tracing::warn!(
            "{}/nvidiactl does not exist: claims are prepared without NVIDIA device nodes (right \
             for the simulated driver; on a GPU node, point --dev-dir at the NVIDIA device nodes)",
            edits.mounts.dev_dir.display()
        );
    }
    let api = Api::connect(kubeconfig.as_deref()).await?;
    let mut prepared = Prepared::new(Settings {
        driver: driver.clone(),
        cdi_dir,
        state_file: state_dir.join(format!("dra-{driver}.json")),
        books_dir: state_dir.join("dra-books"),
        socket,
        edits,
    });
    prepared.load();
    let shared = Arc::new(Shared {
        driver: driver.clone(),
        pool: node.clone(),
        gpus: Mutex::new(gpus),
        prepared: tokio::sync::Mutex::new(prepared),
        api: api.clone(),
    });

    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT: {e}"))?;
    let (registered_tx, mut registered) = mpsc::channel::<()>(1);
    let (changed_tx, mut changed) = mpsc::channel::<()>(1);
    let poller = tokio::spawn(poll_gpus(
        lister,
        poll_interval,
        proc_gpus,
        Arc::clone(&shared),
        changed_tx,
    ));

    let endpoint = plugin_dir.join("dra.sock");
    let mut dra = Socket {
        path: endpoint.clone(),
        what: "the DRA service",
        running: None,
    };
    let mut reg = Socket {
        path: registry_dir.join(format!("{driver}-reg.sock")),
        what: "the registration with the kubelet",
        running: None,
    };
    let mut publishing = Publishing {
        due: true,
        retry_at: None,
        backoff: FIRST_RETRY,
        said: None,
        node_uid: None,
        last: None,
        said_dropped: false,
    };
    let mut recheck = tokio::time::interval(RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resync = tokio::time::interval(RESYNC);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resync.tick().await;
    loop {
        // The DRA service first: the kubelet calls it as soon as it has
        // the registration.
        let served = dra
            .keep(|| {
                Routes::new(dra_v1::dra_plugin_server::DraPluginServer::new(V1(
                    Arc::clone(&shared),
                )))
                .add_service(
                    dra_v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(Arc::clone(
                        &shared,
                    ))),
                )
            })
            .await;
        if served {
            reg.keep(|| {
                Routes::new(
                    pluginregistration::registration_server::RegistrationServer::new(
                        Registration {
                            driver: driver.clone(),
                            endpoint: endpoint.display().to_string(),
                            registered: registered_tx.clone(),
                        },
                    ),
                )
            })
            .await;
        }
        if publishing.due && publishing.retry_at.is_none_or(|at| Instant::now() >= at) {
            publish(&shared, &api, &driver, &node, memory_step, &mut publishing).await;
        }
        let retry = publishing.retry_at;
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            Some(()) = registered.recv() => {
                publishing.due = true;
                publishing.retry_at = None;
            }
            Some(()) = changed.recv() => publishing.due = true,
            _ = resync.tick() => publishing.due = true,
            _ = recheck.tick() => {}
            _ = sleep_until(retry) => {}
        }
    }
    tracing::info!("stopping");
    poller.abort();
    reg.close().await;
    dra.close().await;
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Publishes the slice once; on failure, says so (once per distinct
/// failure) and schedules a retry.
async fn publish(
    shared: &Shared,
    api: &Api,
    driver: &str,
    node: &str,
    memory_step: u64,
    p: &mut Publishing,
) {
    let result = async {
        let uid = match &p.node_uid {
            Some(u) => u.clone(),
            None => {
                let u = api.node_uid(node).await.map_err(|e| {
                    format!(
                        "{e}; the slice is owned by the node, so --node-name must name this \
                         node as the API server knows it (the DaemonSet sets it from \
                         spec.nodeName)"
                    )
                })?;
                p.node_uid = Some(u.clone());
                u
            }
        };
        let publisher = Publisher {
            driver: driver.into(),
            node: node.into(),
            node_uid: uid,
            memory_step,
        };
        let want = {
            let gpus = shared.gpus.lock().unwrap_or_else(|e| e.into_inner());
            slices::slice(&publisher, &gpus, 0)
        };
        let devices = want.spec.devices.as_ref().map_or(0, Vec::len);
        api.publish(want, driver, node, &mut p.last)
            .await
            .map(|r| (r, devices))
    }
    .await;
    let name = slices::slice_name(driver, node);
    match result {
        Ok((r, devices)) => {
            match r {
                Published::Created(g) => tracing::info!(
                    "published ResourceSlice {name}: {devices} GPUs (pool {node}, generation {g})"
                ),
                Published::Updated(g) => tracing::info!(
                    "updated ResourceSlice {name}: {devices} GPUs (pool {node}, generation {g})"
                ),
                Published::Unchanged(_) => {
                    tracing::debug!("ResourceSlice {name} is as it should be")
                }
            }
            if p.said.take().is_some() {
                tracing::info!("the API server takes the node's ResourceSlice again");
            }
            let dropped = p
                .last
                .as_ref()
                .is_some_and(|w| slices::sharing_dropped(&w.sent, &w.stored));
            if dropped && !p.said_dropped {
                tracing::warn!(
                    "the API server stored ResourceSlice {name} without allowMultipleAllocations \
                     and the request policies: its DRAConsumableCapacity feature gate is off, so \
                     each claim gets a whole GPU (still capped and booked); turn the gate on in \
                     the API server and the scheduler to share GPUs between claims"
                );
            }
            p.said_dropped = dropped;
            p.due = false;
            p.retry_at = None;
            p.backoff = FIRST_RETRY;
        }
        Err(e) => {
            if p.said.as_deref() != Some(e.as_str()) {
                tracing::warn!(
                    "cannot publish ResourceSlice {name}: {e}; trying again (no new claim can be \
                     scheduled onto this node's GPUs meanwhile)"
                );
                p.said = Some(e);
            }
            p.retry_at = Some(Instant::now() + p.backoff);
            p.backoff = (p.backoff * 2).min(MAX_RETRY);
        }
    }
}

/// Lists the GPUs every `every`; a change is published.
async fn poll_gpus(
    lister: crate::Lister,
    every: Duration,
    proc_gpus: PathBuf,
    shared: Arc<Shared>,
    changed: mpsc::Sender<()>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate, and the GPUs were just listed.
    tick.tick().await;
    loop {
        tick.tick().await;
        let listed = lister.list().await;
        let minors = read_minors(Path::new(&proc_gpus)).unwrap_or_default();
        let changes = {
            let mut gpus = shared.gpus.lock().unwrap_or_else(|e| e.into_inner());
            let c = gpus.update(listed);
            gpus.set_minors(&minors);
            c
        };
        if !changes.is_empty() {
            for c in changes {
                tracing::warn!("{c}");
            }
            let _ = changed.try_send(());
        }
    }
}
