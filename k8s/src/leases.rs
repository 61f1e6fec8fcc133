//! Pods booked with the broker: every container allocation is a lease in
//! the broker's queue, pinned to the GPUs the kubelet chose, so that
//! `gpufrac run` jobs on the node are not placed into memory the kubelet
//! already gave a pod, and status names the pod.
//!
//! The Allocate call never names the pod, and the kubelet must not wait on
//! the broker, so the plugin picks the lease's token itself, hands it to
//! the container in `GPUFRAC_JOB` at once, and books the lease under that
//! token in the background (a connection per lease, held while the lease
//! lives, as `gpufrac run` holds its own). The container's processes join
//! the job with the token whenever the booking reaches the broker, before
//! or after they start. The kubelet's pod-resources API (`List`) then tells
//! which pod holds which devices: the lease is named after the pod, and
//! dropped when the pod no longer holds the devices. Tokens are kept in a
//! state file, so that a restarted plugin books the same pods under the
//! same tokens and their running processes join again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpufrac_common::wire;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::devices::Booking;
use crate::holder::{self, ANSWER_TIMEOUT, Lease, LeaseName, describe_pins};
use crate::podresources;
/// Format of the state file; another version is set aside, not misread.
const STATE_VERSION: u32 = 1;

pub struct LeaseConfig {
    /// The broker's socket.
    pub socket: PathBuf,
    /// The kubelet's pod-resources socket; None: never asked (leases then
    /// end only when their devices are allocated again).
    pub pod_resources: Option<PathBuf>,
    /// Where the tokens are kept across restarts; None: not kept.
    pub state_file: Option<PathBuf>,
    /// How long an allocation may go unlisted by the kubelet before its
    /// lease is dropped (the kubelet lists a pod's devices as soon as
    /// Allocate has answered; this covers a pod refused after it).
    pub grace: Duration,
}

/// The container an allocation is, as the kubelet lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    /// Its container (several, comma-separated, when they share the
    /// devices: an init container's are reused by the next).
    pub container: String,
}

impl PodRef {
    /// `namespace/name`, as status shows it.
    pub fn pod(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn label(&self) -> String {
        format!("container {}", self.container)
    }

    fn lease_name(&self) -> LeaseName {
        LeaseName {
            pod: self.pod(),
            label: self.label(),
        }
    }
}

struct Entry {
    booking: Booking,
    token: u64,
    /// Booked (or loaded from the state file) at.
    since: Instant,
    /// The pod it is, once the kubelet has said.
    pod: Option<PodRef>,
    /// Its name in the broker's status; the holder follows it.
    names: watch::Sender<Option<LeaseName>>,
    task: JoinHandle<()>,
}

impl Entry {
    fn pod(&self) -> Option<PodRef> {
        self.pod.clone()
    }

    fn name(&mut self, pod: PodRef) {
        self.names.send_replace(Some(pod.lease_name()));
        self.pod = Some(pod);
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        // The task owns the connection: the broker ends the job when it
        // closes.
        self.task.abort();
    }
}

/// The plugin's leases, by sorted device IDs.
pub struct Leases {
    cfg: LeaseConfig,
    entries: BTreeMap<Vec<String>, Entry>,
    /// The latest state for the writer task, which writes it off the
    /// Allocate path (a write costs more than the rest of Allocate).
    to_save: Option<watch::Sender<Option<Saved>>>,
    /// The last pod-resources failure, said once until it works again.
    podres_error: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Saved {
    version: u32,
    leases: Vec<SavedLease>,
}

#[derive(Serialize, Deserialize)]
struct SavedLease {
    #[serde(flatten)]
    booking: Booking,
    /// 16 hex digits, as `GPUFRAC_JOB` carries it.
    token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod: Option<PodRef>,
}

/// `GPUFRAC_JOB`'s form of a token.
pub fn token_text(token: u64) -> String {
    format!("{token:016x}")
}

impl Leases {
    /// Must run inside the runtime (it starts the state file's writer).
    pub fn new(cfg: LeaseConfig) -> Leases {
        let to_save = cfg.state_file.clone().map(|path| {
            let (tx, mut rx) = watch::channel(None::<Saved>);
            tokio::spawn(async move {
                // Every change is written, the latest last; changes that
                // come while one is written are written together.
                while rx.changed().await.is_ok() {
                    let Some(text) = rx
                        .borrow_and_update()
                        .as_ref()
                        .and_then(|s| serde_json::to_vec(s).ok())
                    else {
                        continue;
                    };
                    let (p, t) = (path.clone(), text);
                    let r = tokio::task::spawn_blocking(move || {
                        // Not synced: a crash of the host that loses the
                        // last write ends the pods too.
                        gpufrac_common::files::write_private(&p, &t, false)
                    })
                    .await;
                    if let Ok(Err(e)) = r {
                        tracing::warn!(
                            "cannot write {}: {e}; a restarted plugin would book its pods under \
                             new tokens",
                            path.display()
                        );
                    }
                }
            });
            tx
        });
        Leases {
            cfg,
            entries: BTreeMap::new(),
            to_save,
            podres_error: None,
        }
    }

    /// Books again what the state file holds: the pods of a previous run
    /// of the plugin, under their tokens. Must run inside the runtime.
    pub fn load(&mut self) {
        let Some(path) = self.cfg.state_file.clone() else {
            return;
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!("cannot read {}: {e}; starting without it", path.display());
                return;
            }
        };
        let saved = match serde_json::from_str::<Saved>(&text) {
            Ok(s) if s.version == STATE_VERSION => s,
            other => {
                let why = match other {
                    Ok(s) => format!("version {}", s.version),
                    Err(e) => e.to_string(),
                };
                // Outside the macro: tracing skips its arguments when the
                // level is off, and the file must move regardless.
                let said = gpufrac_common::files::set_aside(&path, &why);
                tracing::warn!("{said}; starting without it");
                return;
            }
        };
        for l in saved.leases {
            let Ok(token) = u64::from_str_radix(&l.token, 16) else {
                tracing::warn!(
                    "{}: skipping a lease with token {:?}",
                    path.display(),
                    l.token
                );
                continue;
            };
            tracing::info!(
                "booking again {} (from {})",
                describe(&l.booking, l.pod.as_ref()),
                path.display()
            );
            self.insert(l.booking, token, l.pod, true);
        }
    }

    /// Books an allocation the kubelet just made; its token, for the
    /// container's `GPUFRAC_JOB`.
    pub fn book(&mut self, booking: Booking) -> u64 {
        // The kubelet gives a device to one container at a time: whoever
        // held any of these devices before is gone.
        let stale: Vec<Vec<String>> = self
            .entries
            .keys()
            .filter(|k| k.iter().any(|id| booking.ids.binary_search(id).is_ok()))
            .cloned()
            .collect();
        for k in stale {
            if let Some(e) = self.entries.remove(&k) {
                tracing::info!(
                    "{} ends: its devices were allocated again",
                    describe(&e.booking, e.pod().as_ref())
                );
            }
        }
        let token = wire::random_token();
        tracing::info!("booking {} with the broker", describe(&booking, None));
        self.insert(booking, token, None, false);
        self.save();
        token
    }

    fn insert(&mut self, booking: Booking, token: u64, pod: Option<PodRef>, resume: bool) {
        let (names, rx) = watch::channel(pod.as_ref().map(PodRef::lease_name));
        let lease = Lease {
            pins: booking.pins.clone(),
            compute: booking.compute,
            unnamed: "pod (not listed by the kubelet yet)".into(),
            what: describe(&booking, None),
        };
        let task = tokio::spawn(holder::hold(
            self.cfg.socket.clone(),
            lease,
            token,
            rx,
            resume,
        ));
        self.entries.insert(
            booking.ids.clone(),
            Entry {
                booking,
                token,
                since: Instant::now(),
                pod,
                names,
                task,
            },
        );
    }

    /// Applies what the kubelet lists: names leases after their pods,
    /// books pods it holds devices for that have no lease (the plugin
    /// restarted without its state file), and drops leases of allocations
    /// no pod holds any more.
    /// `rebuild` reads a booking from device IDs alone (the inventory's
    /// reading of them).
    pub fn apply_list(
        &mut self,
        listed: Vec<(PodRef, Vec<String>)>,
        rebuild: impl Fn(&[String]) -> Option<Booking>,
    ) {
        if self.podres_error.take().is_some() {
            tracing::info!("the kubelet's pod-resources API answers again");
        }
        let mut by_ids: BTreeMap<Vec<String>, PodRef> = BTreeMap::new();
        for (pod, mut ids) in listed {
            ids.sort();
            match by_ids.get_mut(&ids) {
                Some(p) if p.namespace == pod.namespace && p.name == pod.name => {
                    p.container = format!("{},{}", p.container, pod.container);
                }
                Some(_) => {}
                None => {
                    by_ids.insert(ids, pod);
                }
            }
        }
        let mut changed = false;
        for (ids, pod) in &by_ids {
            match self.entries.get_mut(ids) {
                Some(e) if e.pod.as_ref() == Some(pod) => {}
                Some(e) => {
                    tracing::info!(
                        "{} is pod {} ({})",
                        describe(&e.booking, None),
                        pod.pod(),
                        pod.label()
                    );
                    e.name(pod.clone());
                    changed = true;
                }
                None => {
                    // Devices the plugin did not book, from its own IDs:
                    // book them (they would otherwise be invisible to the
                    // broker). The pod's processes hold a token this plugin
                    // no longer knows, so they stay their user's.
                    let Some(booking) = rebuild(ids) else {
                        continue;
                    };
                    tracing::warn!(
                        "pod {} holds {} without a lease here (the plugin's state file was \
                         lost?): booked now; its processes hold a token the broker does not \
                         know, so they are capped but not counted in the pod's lease until \
                         they restart",
                        pod.pod(),
                        describe(&booking, None)
                    );
                    self.insert(booking, wire::random_token(), Some(pod.clone()), false);
                    changed = true;
                }
            }
        }
        let grace = self.cfg.grace;
        let gone: Vec<Vec<String>> = self
            .entries
            .iter()
            .filter(|(k, e)| !by_ids.contains_key(*k) && e.since.elapsed() >= grace)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            if let Some(e) = self.entries.remove(&k) {
                match &e.pod() {
                    Some(p) => tracing::info!(
                        "pod {} ({}) no longer holds its devices: its lease is released",
                        p.pod(),
                        p.label()
                    ),
                    None => tracing::info!(
                        "{} was never listed by the kubelet within {:?} (the pod was refused or \
                         deleted at once): its lease is released",
                        describe(&e.booking, None),
                        grace
                    ),
                }
                changed = true;
            }
        }
        if changed {
            self.save();
        }
    }

    /// The pod-resources API failed: said once, leases kept.
    pub fn list_failed(&mut self, e: String) {
        if self.podres_error.as_deref() != Some(e.as_str()) {
            tracing::warn!(
                "cannot learn from the kubelet which pods hold which devices: {e}; leases are \
                 not named after their pods, and end only when their devices are allocated \
                 again. Mount /var/lib/kubelet/pod-resources into the plugin (the DaemonSet \
                 does) or point --pod-resources-socket at the kubelet's socket"
            );
            self.podres_error = Some(e);
        }
    }

    /// Writes every lease's token, atomically and readable by root only
    /// (a token is what lets a process count as the pod's).
    fn save(&self) {
        let Some(tx) = &self.to_save else {
            return;
        };
        let saved = Saved {
            version: STATE_VERSION,
            leases: self
                .entries
                .values()
                .map(|e| SavedLease {
                    booking: e.booking.clone(),
                    token: token_text(e.token),
                    pod: e.pod(),
                })
                .collect(),
        };
        tx.send_replace(Some(saved));
    }
}

/// "4.0 GiB on GPU-…" (and the pod, when known), for the log.
fn describe(b: &Booking, pod: Option<&PodRef>) -> String {
    let mut s = format!(
        "the allocation of {} devices ({})",
        b.ids.len(),
        describe_pins(&b.pins)
    );
    if let Some(p) = pod {
        s.push_str(&format!(" of pod {} ({})", p.pod(), p.label()));
    }
    s
}

/// Asks the kubelet which container holds which of `resource`'s devices.
pub async fn list_pods(
    socket: &Path,
    resource: &str,
) -> Result<Vec<(PodRef, Vec<String>)>, String> {
    let call = async {
        let ch = crate::connect_unix(socket.to_path_buf())
            .await
            .map_err(|e| format!("{}: {e}", socket.display()))?;
        let mut c = podresources::pod_resources_lister_client::PodResourcesListerClient::new(ch);
        c.list(podresources::ListPodResourcesRequest {})
            .await
            .map_err(|e| format!("List on {}: {}", socket.display(), e.message()))
    };
    let resp = tokio::time::timeout(ANSWER_TIMEOUT, call)
        .await
        .map_err(|_| {
            format!(
                "{} did not answer within {ANSWER_TIMEOUT:?}",
                socket.display()
            )
        })??
        .into_inner();
    let mut out = Vec::new();
    for p in resp.pod_resources {
        for c in p.containers {
            for d in c
                .devices
                .into_iter()
                .filter(|d| d.resource_name == resource)
            {
                out.push((
                    PodRef {
                        namespace: p.namespace.clone(),
                        name: p.name.clone(),
                        container: c.name.clone(),
                    },
                    d.device_ids,
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booking(ids: &[&str]) -> Booking {
        let mut ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        ids.sort();
        Booking {
            ids,
            pins: vec![("GPU-00000000-0000-0000-0000-000000000001".into(), 1 << 30)],
            compute: None,
        }
    }

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: name.into(),
            container: "main".into(),
        }
    }

    /// Waits until the state file holds just this lease (the writer may
    /// still be on an earlier state): its first device ID, token and pod.
    async fn saved_is(path: &Path, id: &str, token: u64, pod: Option<PodRef>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let ok = serde_json::from_str::<Saved>(&text).is_ok_and(|s| {
                matches!(s.leases.as_slice(), [l] if l.booking.ids[0] == id
                    && l.token == token_text(token)
                    && l.pod == pod)
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "{}: {text}", path.display());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // No broker listens on the socket: the holders only retry, which is
    // what a plugin does while the broker is away.
    #[tokio::test(flavor = "current_thread")]
    async fn leases_follow_allocations_and_the_kubelets_list() {
        let dir = std::env::temp_dir().join(format!("gpufrac-leases-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("k8s.json");
        let cfg = || LeaseConfig {
            socket: dir.join("no-broker.sock"),
            pod_resources: None,
            state_file: Some(state.clone()),
            grace: Duration::from_secs(3600),
        };
        let mut l = Leases::new(cfg());
        let t1 = l.book(booking(&["a", "b"]));
        // Device b allocated again: whoever held it is gone.
        let t2 = l.book(booking(&["c", "b"]));
        assert_ne!(t1, t2);
        let keys: Vec<&Vec<String>> = l.entries.keys().collect();
        assert_eq!(keys, [&vec!["b".to_string(), "c".to_string()]]);
        assert_eq!(token_text(t2).len(), 16);

        // Listed (in any order): named after the pod, and saved so.
        l.apply_list(vec![(pod("infer-0"), vec!["c".into(), "b".into()])], |_| {
            None
        });
        let e = &l.entries[&vec!["b".to_string(), "c".to_string()]];
        assert_eq!(e.pod(), Some(pod("infer-0")));
        saved_is(&state, "b", t2, Some(pod("infer-0"))).await;

        // Unlisted: kept within the grace, released after it.
        l.apply_list(vec![], |_| None);
        assert_eq!(l.entries.len(), 1);
        l.cfg.grace = Duration::ZERO;
        l.apply_list(vec![], |_| None);
        assert!(l.entries.is_empty());

        // Devices a pod holds without a lease here are booked from their
        // IDs.
        l.apply_list(vec![(pod("train-1"), vec!["x".into()])], |ids| {
            Some(booking(&ids.iter().map(String::as_str).collect::<Vec<_>>()))
        });
        let t3 = l.entries[&vec!["x".to_string()]].token;
        saved_is(&state, "x", t3, Some(pod("train-1"))).await;

        // A restarted plugin books them again under the same token.
        drop(l);
        let mut again = Leases::new(cfg());
        again.load();
        let e = &again.entries[&vec!["x".to_string()]];
        assert_eq!((e.token, e.pod()), (t3, Some(pod("train-1"))));

        // A state file it cannot read is set aside, not misread.
        std::fs::write(&state, b"{ not json").unwrap();
        let mut fresh = Leases::new(cfg());
        fresh.load();
        assert!(fresh.entries.is_empty());
        assert!(state.with_extension("unreadable").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
