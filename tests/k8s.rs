//! `gpufrac k8s-device-plugin` as a real process, against a stand-in
//! kubelet that speaks the kubelet's own gRPC API (v1beta1, the same
//! generated code): a Registration server on a temporary kubelet.sock, and a
//! DevicePlugin client on the plugin's socket, as the kubelet's device
//! manager does, and a PodResourcesLister server on a pod-resources socket,
//! which lists the pods the test says. The GPUs are the simulated driver's.

mod support;
use support::*;

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufrac_k8s::api;
use gpufrac_k8s::api::device_plugin_client::DevicePluginClient;
use gpufrac_k8s::podresources as pr;
use gpufrac_k8s::reexport::tokio::sync::{mpsc, watch};
use gpufrac_k8s::reexport::tonic::transport::Channel;
use gpufrac_k8s::reexport::tonic::{self, Request, Response, Status};
use gpufrac_k8s::reexport::{tokio, tokio_stream};

const DEVICES: &str = "16G,8G";
/// What any answer from the plugin may take before the test gives up.
const WAIT: Duration = Duration::from_secs(20);

/// The kubelet's side: a Registration server that hands each request to
/// the test.
struct Registration(mpsc::UnboundedSender<api::RegisterRequest>);

#[tonic::async_trait]
impl api::registration_server::Registration for Registration {
    async fn register(
        &self,
        req: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let _ = self.0.send(req.into_inner());
        Ok(Response::new(api::Empty {}))
    }
}

/// The kubelet's pod-resources API: List answers with the pods the test
/// set.
#[derive(Clone, Default)]
struct Pods(Arc<Mutex<Vec<pr::PodResources>>>);

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for Pods {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: self.0.lock().unwrap().clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the stand-in"))
    }

    async fn get(
        &self,
        _: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the stand-in"))
    }
}

/// A stand-in kubelet on a device-plugin directory of its own.
struct Kubelet {
    dir: Scratch,
    /// Its pod-resources socket (a directory of its own, as the kubelet's
    /// is: a restart's socket clean-up does not touch it), and where the
    /// plugins it runs keep their state.
    pod_dir: Scratch,
    pods: Pods,
    rt: tokio::runtime::Runtime,
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    regs: mpsc::UnboundedReceiver<api::RegisterRequest>,
    stop: Option<watch::Sender<bool>>,
}

impl Kubelet {
    /// The directory only; `start` makes kubelet.sock.
    fn new() -> Kubelet {
        // A worker thread of its own, so the kubelet answers while the test
        // waits on something else, as a real one would.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, regs) = mpsc::unbounded_channel();
        let pod_dir = Scratch::new("kubelet-pods");
        let pods = Pods::default();
        {
            let _g = rt.enter();
            let listener = tokio::net::UnixListener::bind(pod_dir.0.join("kubelet.sock")).unwrap();
            rt.spawn(
                tonic::transport::Server::builder()
                    .add_service(
                        pr::pod_resources_lister_server::PodResourcesListerServer::new(
                            pods.clone(),
                        ),
                    )
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
            );
        }
        Kubelet {
            dir: Scratch::new("kubelet"),
            pod_dir,
            pods,
            rt,
            tx,
            regs,
            stop: None,
        }
    }

    /// What List answers from now on: (namespace, name, container, device
    /// IDs of `resource`).
    fn set_pods(&self, resource: &str, pods: &[(&str, &str, &str, Vec<String>)]) {
        *self.pods.0.lock().unwrap() = pods
            .iter()
            .map(|(ns, name, container, ids)| pr::PodResources {
                name: name.to_string(),
                namespace: ns.to_string(),
                containers: vec![pr::ContainerResources {
                    name: container.to_string(),
                    devices: vec![pr::ContainerDevices {
                        resource_name: resource.into(),
                        device_ids: ids.clone(),
                        topology: None,
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            })
            .collect();
    }

    fn started() -> Kubelet {
        let mut k = Kubelet::new();
        k.start();
        k
    }

    fn path(&self) -> &Path {
        &self.dir.0
    }

    fn start(&mut self) {
        let _g = self.rt.enter();
        let listener = tokio::net::UnixListener::bind(self.dir.0.join("kubelet.sock")).unwrap();
        let (stop, mut until) = watch::channel(false);
        let svc = api::registration_server::RegistrationServer::new(Registration(self.tx.clone()));
        self.rt.spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async move {
                        let _ = until.wait_for(|s| *s).await;
                    },
                ),
        );
        self.stop = Some(stop);
    }

    /// What a kubelet does when it restarts: its device manager removes
    /// every socket in the directory, its own and the plugins', and makes a
    /// new kubelet.sock.
    fn restart(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        for e in std::fs::read_dir(self.path()).unwrap().flatten() {
            if e.file_type().unwrap().is_socket() {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        self.start();
    }

    /// The next registration, or a panic with the plugin's log.
    fn registration(&mut self, plugin: &Plugin) -> api::RegisterRequest {
        let got = self
            .rt
            .block_on(async { tokio::time::timeout(WAIT, self.regs.recv()).await });
        match got {
            Ok(Some(r)) => r,
            _ => panic!(
                "no registration within {WAIT:?}; the plugin's log:\n{}",
                plugin.log()
            ),
        }
    }

    /// A DevicePlugin client on the plugin's socket, as the kubelet makes
    /// one after a registration.
    fn client(&self, endpoint: &str) -> DevicePluginClient<Channel> {
        let path = self.dir.0.join(endpoint);
        let ch = self
            .rt
            .block_on(gpufrac_k8s::connect_unix(path.clone()))
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e:?}", path.display()));
        DevicePluginClient::new(ch)
    }

    fn call<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(async {
            tokio::time::timeout(WAIT, f)
                .await
                .unwrap_or_else(|_| panic!("the plugin did not answer within {WAIT:?}"))
        })
    }
}

/// `gpufrac k8s-device-plugin` running against a kubelet stand-in.
struct Plugin {
    child: KillOnDrop,
    log: PathBuf,
    /// Its content is the simulated GPUs the plugin's GPU listing sees.
    devices_file: PathBuf,
    _dir: Scratch,
}

impl Plugin {
    fn start(kubelet: &Kubelet, args: &[&str]) -> Plugin {
        let dir = Scratch::new("k8s-plugin");
        let dev = dir.0.join("dev");
        std::fs::create_dir(&dev).unwrap();
        // Any character device stands in for the NVIDIA nodes.
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", dev.join(n)).unwrap();
        }
        let devices_file = dir.0.join("devices");
        std::fs::write(&devices_file, DEVICES).unwrap();
        let log = dir.0.join("plugin.log");
        let mut cmd = sim_command(&artifacts().gpufrac, DEVICES, false);
        cmd.arg("k8s-device-plugin")
            .arg("--kubelet-dir")
            .arg(kubelet.path())
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_dir.0.join("kubelet.sock"))
            .arg("--state-dir")
            .arg(kubelet.pod_dir.0.join("state"))
            .args(args)
            .env("GPUFRAC_K8S_SIM_DEVICES_FILE", &devices_file)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if !args.contains(&"--cdi") {
            cmd.arg("--dev-dir").arg(&dev);
            if !args.contains(&"--lib") {
                cmd.arg("--lib").arg(&artifacts().shim);
            }
        }
        Plugin {
            child: KillOnDrop(cmd.spawn().expect("starting gpufrac k8s-device-plugin")),
            log,
            devices_file,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Still running: it never exits on its own, whatever the kubelet does.
    fn running(&mut self) -> bool {
        matches!(self.child.0.try_wait(), Ok(None))
    }

    fn set_gpus(&self, devices: &str) {
        std::fs::write(&self.devices_file, devices).unwrap();
    }
}

/// The container's process: exactly the environment of an Allocate answer,
/// with each path the container would see mapped to the host path mounted
/// there (what the runtime's bind mounts do), plus the simulated driver,
/// standing in for the one the NVIDIA runtime gives a container.
fn pod_process(spec: &api::ContainerAllocateResponse, broker: &Broker, args: &[&str]) -> Command {
    let to_host = |v: &str| -> String {
        for m in &spec.mounts {
            if let Some(rest) = v.strip_prefix(&m.container_path) {
                return format!("{}{rest}", m.host_path);
            }
        }
        v.to_string()
    };
    let mut cmd = Command::new(&artifacts().probe);
    cmd.env_clear()
        .envs(spec.envs.iter().map(|(k, v)| (k, to_host(v))))
        .env("LD_LIBRARY_PATH", &artifacts().simdir)
        .env("GPUFRAC_SIM_DEVICES", DEVICES)
        .env("GPUFRAC_SIM_STATE", &broker.state)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The simulated GPUs' UUIDs as the plugin's own listing prints them.
fn uuids() -> Vec<String> {
    let o = sim_command(&artifacts().gpufrac, DEVICES, false)
        .args(["k8s-device-plugin", "--list-gpus"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let v: Vec<String> = out
        .lines()
        .map(|l| l.split_whitespace().nth(2).unwrap().to_string())
        .collect();
    assert_eq!(v.len(), 2, "{out}");
    let first = out.lines().next().unwrap();
    assert!(
        first.starts_with(&format!("gpu 0 {} {} ", v[0], 16 * GIB)),
        "{first}: the product name follows"
    );
    v
}

fn ids(uuid: &str, tag: &str, ns: std::ops::Range<u32>) -> Vec<String> {
    ns.map(|n| format!("{uuid}-{tag}-{n}")).collect()
}

fn health<'a>(list: &'a api::ListAndWatchResponse, prefix: &str) -> Vec<&'a str> {
    let mut v: Vec<&str> = list
        .devices
        .iter()
        .filter(|d| d.id.starts_with(prefix))
        .map(|d| d.health.as_str())
        .collect();
    v.dedup();
    v
}

#[test]
fn registers_lists_units_and_reports_a_gpu_that_goes() {
    let u = uuids();
    let mut kubelet = Kubelet::started();
    // Only this test looks at health: the others keep the default 10 s
    // and spawn no listing meanwhile.
    let plugin = Plugin::start(&kubelet, &["--poll-interval", "100ms"]);
    let r = kubelet.registration(&plugin);
    assert_eq!(r.version, "v1beta1");
    assert_eq!(r.resource_name, "gpufrac.dev/gpu-memory");
    assert_eq!(r.endpoint, "gpufrac-gpu-memory.sock");
    let opts = r.options.expect("options");
    assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);

    let mut c = kubelet.client(&r.endpoint);
    let asked = kubelet.call(c.get_device_plugin_options(api::Empty {}));
    assert_eq!(asked.unwrap().into_inner(), opts);
    let mut stream = kubelet
        .call(c.list_and_watch(api::Empty {}))
        .unwrap()
        .into_inner();
    let mut next = || {
        kubelet
            .call(stream.message())
            .unwrap()
            .expect("the ListAndWatch stream ended")
    };
    let first = next();
    let got: Vec<&str> = first.devices.iter().map(|d| d.id.as_str()).collect();
    let mut want = ids(&u[0], "mem", 0..16);
    want.extend(ids(&u[1], "mem", 0..8));
    assert_eq!(got, want, "one device per GiB of each GPU");
    assert_eq!(health(&first, "GPU-"), ["Healthy"]);

    // GPU 1 disappears from the driver's list: its units turn Unhealthy in
    // the next message, GPU 0's stay Healthy.
    plugin.set_gpus("16G");
    let gone = next();
    assert_eq!(gone.devices.len(), 24);
    assert_eq!(health(&gone, &u[0]), ["Healthy"]);
    assert_eq!(health(&gone, &u[1]), ["Unhealthy"], "{gone:?}");
    assert!(plugin.log().contains("gone from the driver's list"));
    // And back.
    plugin.set_gpus(DEVICES);
    let back = next();
    assert_eq!(health(&back, "GPU-"), ["Healthy"]);
}

#[test]
fn a_pod_asking_for_4_units_runs_capped_at_4g_under_the_broker() {
    let u = uuids();
    let broker = Broker::start(DEVICES, &[]);
    let mut kubelet = Kubelet::started();
    let socket = broker.socket.to_str().unwrap().to_owned();
    let plugin = Plugin::start(&kubelet, &["--socket", &socket]);
    let r = kubelet.registration(&plugin);
    let mut c = kubelet.client(&r.endpoint);

    // What the kubelet's device manager has free: 10 units on GPU 0 and 6
    // on GPU 1. Four fit on either: the fuller GPU, keeping GPU 0's room
    // for a larger pod. Eight fit on GPU 0 only.
    let mut available = ids(&u[0], "mem", 6..16);
    available.extend(ids(&u[1], "mem", 2..8));
    let preferred = |size: i32, must: Vec<String>| {
        let req = api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.clone(),
                must_include_device_i_ds: must,
                allocation_size: size,
            }],
        };
        let mut c = c.clone();
        kubelet
            .call(c.get_preferred_allocation(req))
            .unwrap()
            .into_inner()
            .container_responses
            .remove(0)
            .device_i_ds
    };
    assert_eq!(preferred(4, vec![]), ids(&u[1], "mem", 2..6));
    assert_eq!(preferred(8, vec![]), ids(&u[0], "mem", 6..14));
    let with_must = preferred(4, ids(&u[0], "mem", 9..10));
    assert!(
        with_must.iter().all(|i| i.starts_with(&u[0])),
        "{with_must:?}"
    );
    assert!(with_must.contains(&format!("{}-mem-9", u[0])));

    let grant = preferred(4, vec![]);
    let resp = kubelet
        .call(c.allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: grant.clone(),
            }],
        }))
        .unwrap()
        .into_inner();
    let spec = &resp.container_responses[0];
    let sock_dir = broker.socket.parent().unwrap();
    let want: HashMap<String, String> = [
        ("GPU_MEM_LIMIT", "4G"),
        ("CUDA_VISIBLE_DEVICES", u[1].as_str()),
        ("NVIDIA_VISIBLE_DEVICES", u[1].as_str()),
        ("LD_PRELOAD", "/usr/lib/gpufrac/libgpufrac.so"),
        ("GPUFRAC_SOCKET", "/run/gpufrac/broker.sock"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut envs = spec.envs.clone();
    let job = envs.remove("GPUFRAC_JOB").expect("the pod's lease token");
    assert!(
        job.len() == 16 && job.bytes().all(|b| b.is_ascii_hexdigit()),
        "{job}"
    );
    assert_eq!(envs, want);
    let shim = artifacts().shim.canonicalize().unwrap();
    assert_eq!(
        spec.mounts,
        [
            api::Mount {
                container_path: "/usr/lib/gpufrac/libgpufrac.so".into(),
                host_path: shim.to_str().unwrap().into(),
                read_only: true,
            },
            api::Mount {
                container_path: "/run/gpufrac".into(),
                host_path: sock_dir.to_str().unwrap().into(),
                read_only: false,
            },
        ]
    );
    let nodes: Vec<(&str, &str)> = spec
        .devices
        .iter()
        .map(|d| (d.container_path.as_str(), d.permissions.as_str()))
        .collect();
    assert_eq!(
        nodes,
        [
            ("/dev/nvidiactl", "rw"),
            ("/dev/nvidia-uvm", "rw"),
            ("/dev/nvidia1", "rw")
        ]
    );
    assert!(spec.devices.iter().all(|d| d.host_path == "/dev/null"));
    assert!(spec.cdi_devices.is_empty());

    // The container's process, under exactly that answer.
    let mut probe = Reap(Some(
        pod_process(
            spec,
            &broker,
            &["ctx", "info", "fill", "alloc", "256M", "sleep-ms", "60000"],
        )
        .spawn()
        .unwrap(),
    ));
    let pid = probe.0.as_ref().unwrap().id();
    // It reached the broker through the mounted socket and registered like
    // any other process, with its cap.
    let mut seen = serde_json::Value::Null;
    wait_until(20.0, "the pod's process in the broker's status", || {
        let s = broker.status();
        let found = s["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["processes"].as_array().unwrap().iter())
            .find(|p| p["pid"] == pid && p["mem_used"] == 4 * GIB)
            .cloned();
        match found {
            Some(p) => {
                seen = p;
                true
            }
            None => false,
        }
    });
    assert_eq!(seen["mem_cap"], 4 * GIB, "{seen}");
    let mut child = probe.0.take().unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let info = line(&out, "info", 0);
    assert_eq!(num(&info, "total"), 4 * GIB, "{}", stderr(&out));
    let fill = line(&out, "fill", 0);
    assert_eq!(num(&fill, "count"), 16, "16 × 256 MiB in 4 GiB");
    assert_eq!(num(&fill, "rc"), 2, "then CUDA_ERROR_OUT_OF_MEMORY");
}

#[test]
fn pods_are_leases_in_the_broker_named_after_their_pods() {
    let u = uuids();
    let broker = Broker::start(DEVICES, &[]);
    let mut kubelet = Kubelet::started();
    let socket = broker.socket.to_str().unwrap().to_owned();
    let args = ["--socket", &socket, "--poll-interval", "200ms"];
    let mut plugin = Plugin::start(&kubelet, &args);
    let r = kubelet.registration(&plugin);
    let c = kubelet.client(&r.endpoint);
    let allocate = |c: &DevicePluginClient<Channel>, ids: Vec<String>| {
        let mut c = c.clone();
        kubelet
            .call(c.allocate(api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids }],
            }))
            .unwrap()
            .into_inner()
            .container_responses
            .remove(0)
    };

    // 12 of GPU 0's 16 units: booked in the broker as a lease pinned there,
    // before the kubelet has said whose it is.
    let grant = ids(&u[0], "mem", 0..12);
    let spec = allocate(&c, grant.clone());
    wait_until(20.0, "the allocation booked in the broker", || {
        broker
            .leases()
            .iter()
            .any(|l| l["gpus"] == serde_json::json!([0]) && l["mem_cap"] == 12 * GIB)
    });
    // A 10 GiB job, which only GPU 0 could hold (its 16 GiB are free on
    // the driver), is refused: 4 GiB are left there.
    let o = broker
        .run(&["--no-wait", "--gpu-memory", "10G", "--", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("12.0 GiB of 16.0 GiB committed"),
        "{}",
        stderr(&o)
    );

    // The kubelet lists the pod: the lease takes its name, and messages
    // name it by the pod.
    let resource = "gpufrac.dev/gpu-memory";
    kubelet.set_pods(resource, &[("ml", "infer-0", "server", grant.clone())]);
    wait_until(20.0, "the lease named after its pod", || {
        broker.leases().iter().any(|l| l["pod"] == "ml/infer-0")
    });
    let l = broker.leases();
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0]["command"], "container server");
    let o = broker
        .run(&["--no-wait", "--gpu-memory", "10G", "--", "true"])
        .output()
        .unwrap();
    assert!(stderr(&o).contains("pod ml/infer-0"), "{}", stderr(&o));

    // The pod's process counts in the pod's lease.
    let mut probe = Reap(Some(
        pod_process(
            &spec,
            &broker,
            &["ctx", "alloc", "alloc", "1G", "sleep-ms", "60000"],
        )
        .spawn()
        .unwrap(),
    ));
    let pid = probe.0.as_ref().unwrap().id();
    wait_until(20.0, "the pod's process in its pod's job", || {
        broker
            .process(pid)
            .is_some_and(|p| p["pod"] == "ml/infer-0" && p["mem_used"] == GIB)
    });
    assert_eq!(broker.process(pid).unwrap()["mem_cap"], 12 * GIB);

    // The plugin restarts: the lease goes with its connection, and the new
    // plugin books the pod again under the same token (its state file), so
    // the running process counts in it again.
    drop(plugin);
    wait_until(20.0, "the lease gone with the plugin", || {
        broker.leases().is_empty()
    });
    assert!(broker.process(pid).unwrap()["pod"].is_null());
    plugin = Plugin::start(&kubelet, &args);
    wait_until(20.0, "the pod booked again, its process in it", || {
        broker.leases().iter().any(|l| l["pod"] == "ml/infer-0")
            && broker
                .process(pid)
                .is_some_and(|p| p["pod"] == "ml/infer-0")
    });
    let _ = kubelet.registration(&plugin);

    // The pod ends: its lease is released, and the job fits.
    drop(probe.0.take().map(|mut p| {
        let _ = p.kill();
        p.wait()
    }));
    kubelet.set_pods(resource, &[]);
    wait_until(20.0, "the lease released with its pod", || {
        broker.leases().is_empty()
    });
    let o = broker
        .run(&["--no-wait", "--gpu-memory", "10G", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        plugin.log().contains("no longer holds its devices"),
        "{}",
        plugin.log()
    );
}

#[test]
fn slots_with_cdi_give_a_share_and_the_spec_devices() {
    let u = uuids();
    let mut kubelet = Kubelet::started();
    let plugin = Plugin::start(
        &kubelet,
        &["--resource", "gpu", "--slots-per-gpu", "4", "--cdi"],
    );
    let r = kubelet.registration(&plugin);
    assert_eq!(r.resource_name, "gpufrac.dev/gpu");
    assert_eq!(r.endpoint, "gpufrac-gpu.sock");
    let mut c = kubelet.client(&r.endpoint);
    let mut stream = kubelet
        .call(c.list_and_watch(api::Empty {}))
        .unwrap()
        .into_inner();
    let first = kubelet.call(stream.message()).unwrap().unwrap();
    let got: Vec<&str> = first.devices.iter().map(|d| d.id.as_str()).collect();
    let mut want = ids(&u[0], "slot", 0..4);
    want.extend(ids(&u[1], "slot", 0..4));
    assert_eq!(got, want);

    let mut allocate = |ids: Vec<String>| {
        kubelet.call(c.allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids }],
        }))
    };
    let one = allocate(ids(&u[0], "slot", 3..4)).unwrap().into_inner();
    let s = &one.container_responses[0];
    assert_eq!(s.envs["GPU_MEM_LIMIT"], "4G", "16G / 4");
    assert_eq!(s.envs["GPU_COMPUTE_SHARE"], "25%");
    assert_eq!(s.envs["CUDA_VISIBLE_DEVICES"], u[0]);
    assert_eq!(
        s.envs.len(),
        4,
        "the CDI spec brings the rest, and the lease's token: {:?}",
        s.envs
    );
    assert!(s.envs.contains_key("GPUFRAC_JOB"));
    assert_eq!(s.cdi_devices[0].name, "gpufrac.dev/gpu=0");
    assert!(s.mounts.is_empty() && s.devices.is_empty());
    let two = allocate(ids(&u[1], "slot", 0..2)).unwrap().into_inner();
    let s = &two.container_responses[0];
    assert_eq!(s.envs["GPU_MEM_LIMIT"], "4G", "2 × 8G / 4");
    assert_eq!(s.envs["GPU_COMPUTE_SHARE"], "50%");
    assert_eq!(s.cdi_devices[0].name, "gpufrac.dev/gpu=1");
    // A device the plugin never advertised.
    let e = allocate(vec![format!("{}-mem-0", u[0])]).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("GPU-<uuid>-slot-<n>"), "{e:?}");
}

#[test]
fn registers_when_the_kubelet_comes_and_again_when_it_restarts() {
    // The plugin first: no kubelet.sock yet.
    let mut kubelet = Kubelet::new();
    let mut plugin = Plugin::start(&kubelet, &[]);
    let own = kubelet.path().join("gpufrac-gpu-memory.sock");
    wait_until(20.0, "the plugin's socket", || own.exists());
    kubelet.start();
    let first = kubelet.registration(&plugin);
    assert_eq!(first.endpoint, "gpufrac-gpu-memory.sock");
    let mut c = kubelet.client(&first.endpoint);
    let mut old = kubelet
        .call(c.list_and_watch(api::Empty {}))
        .unwrap()
        .into_inner();
    assert_eq!(
        kubelet.call(old.message()).unwrap().unwrap().devices.len(),
        24
    );

    kubelet.restart();
    let t = Instant::now();
    let again = kubelet.registration(&plugin);
    assert_eq!(again, first);
    // The plugin also looks every 5 s whatever the directory watch says;
    // sooner than that, the watch saw the restart (it takes milliseconds).
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "re-registered only after {:?}: the directory watch missed the restart\n{}",
        t.elapsed(),
        plugin.log()
    );
    // Served anew on a new socket: the old stream has ended, a new one
    // lists the devices.
    assert!(
        !matches!(kubelet.call(old.message()), Ok(Some(_))),
        "the old ListAndWatch stream still sends"
    );
    let mut c = kubelet.client(&again.endpoint);
    let mut s = kubelet
        .call(c.list_and_watch(api::Empty {}))
        .unwrap()
        .into_inner();
    assert_eq!(
        kubelet.call(s.message()).unwrap().unwrap().devices.len(),
        24
    );
    assert!(plugin.log().contains("serving it anew"), "{}", plugin.log());
    assert!(plugin.running());
}

#[test]
fn allocate_latency() {
    let u = uuids();
    let mut kubelet = Kubelet::started();
    let plugin = Plugin::start(&kubelet, &[]);
    let r = kubelet.registration(&plugin);
    let mut c = kubelet.client(&r.endpoint);
    let req = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: ids(&u[0], "mem", 0..4),
        }],
    };
    let mut us: Vec<f64> = (0..200)
        .map(|_| {
            let t = Instant::now();
            let resp = kubelet.call(c.allocate(req.clone())).unwrap().into_inner();
            let dt = t.elapsed().as_secs_f64() * 1e6;
            assert_eq!(resp.container_responses[0].envs["GPU_MEM_LIMIT"], "4G");
            dt
        })
        .collect();
    us.sort_by(f64::total_cmp);
    let (median, p99) = (us[100], us[197]);
    println!(
        "Allocate through the stand-in kubelet: median {median:.0} µs, p99 {p99:.0} µs (200 calls)"
    );
    // The target is 1 ms; this bound only catches an Allocate that does
    // something slow (a process, a driver call), whatever the build.
    assert!(median < 20_000.0, "median {median:.0} µs");
}

#[test]
fn bad_settings_exit_with_what_to_do() {
    let kubelet = Kubelet::new();
    let run = |devices: &str, dir: &Path, args: &[&str]| {
        let o = sim_command(&artifacts().gpufrac, devices, false)
            .arg("k8s-device-plugin")
            .arg("--kubelet-dir")
            .arg(dir)
            .args(["--cdi"])
            .args(args)
            .output()
            .unwrap();
        (o.status.code(), stderr(&o))
    };
    let (code, e) = run("", kubelet.path(), &[]);
    assert_eq!(code, Some(1));
    assert!(
        e.contains("cannot list the GPUs") && e.contains("no CUDA-capable device"),
        "{e}"
    );
    let (code, e) = run(DEVICES, &kubelet.path().join("nope"), &[]);
    assert_eq!(code, Some(1));
    assert!(e.contains("--kubelet-dir") && e.contains("hostPath"), "{e}");
    let (code, e) = run(DEVICES, kubelet.path(), &["--memory-unit", "32G"]);
    assert_eq!(code, Some(1));
    assert!(e.contains("larger than every GPU"), "{e}");
    let (code, e) = run(DEVICES, kubelet.path(), &["--slots-per-gpu", "4"]);
    assert_eq!(code, Some(2));
    assert!(e.contains("--resource gpu"), "{e}");
    // Nothing was left in the kubelet's directory.
    assert_eq!(std::fs::read_dir(kubelet.path()).unwrap().count(), 0);
}

/// The plugin's arguments in deploy/k8s/daemonset.yaml (a one-line flow
/// sequence, which is also JSON) run as given, but for the host paths,
/// which point into the test's own files: what it registers is what the
/// example pod asks for, and 4 of it are a 4 GiB cap as the pod's comment
/// says.
#[test]
fn the_deploy_manifests_agree_with_the_plugin() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s");
    let ds = std::fs::read_to_string(root.join("daemonset.yaml")).unwrap();
    let line = ds
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("args: "))
        .expect("an `args: [...]` line in daemonset.yaml");
    let mut args: Vec<String> = serde_json::from_str(line).unwrap();
    assert!(
        ds.contains(r#"command: ["/usr/local/bin/gpufrac", "k8s-device-plugin"]"#),
        "{ds}"
    );
    // The plugin's default paths for the kubelet's pod-resources socket
    // and its own state are mounted from the host.
    for dir in ["/var/lib/kubelet/pod-resources", "/var/lib/gpufrac"] {
        assert_eq!(
            ds.matches(&format!("path: {dir}\n")).count(),
            1,
            "a hostPath volume for {dir}"
        );
        assert!(ds.contains(&format!("mountPath: {dir}\n")), "{dir} mounted");
    }
    let broker_dir = Scratch::new("k8s-manifest");
    let socket = broker_dir.0.join("broker.sock");
    for (flag, here) in [
        ("--lib", artifacts().shim.clone()),
        ("--socket", socket.clone()),
    ] {
        let i = args.iter().position(|a| a == flag).unwrap() + 1;
        assert!(args[i].starts_with('/'), "{flag} {}: a host path", args[i]);
        args[i] = here.to_str().unwrap().to_owned();
    }
    let pod = std::fs::read_to_string(root.join("pod-example.yaml")).unwrap();
    let (resource, count) = pod
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("gpufrac.dev/")?.split_once(": "))
        .expect("a gpufrac.dev/ limit in pod-example.yaml");

    let mut kubelet = Kubelet::started();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let plugin = Plugin::start(&kubelet, &argv);
    let r = kubelet.registration(&plugin);
    assert_eq!(r.resource_name, format!("gpufrac.dev/{resource}"));
    let mut c = kubelet.client(&r.endpoint);
    let mut stream = kubelet
        .call(c.list_and_watch(api::Empty {}))
        .unwrap()
        .into_inner();
    let list = kubelet.call(stream.message()).unwrap().unwrap();
    let n: usize = count.parse().unwrap();
    let grant: Vec<String> = list.devices.iter().take(n).map(|d| d.id.clone()).collect();
    let resp = kubelet
        .call(c.allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: grant }],
        }))
        .unwrap()
        .into_inner();
    let cap = &resp.container_responses[0].envs["GPU_MEM_LIMIT"];
    assert!(
        pod.contains(&format!("GPU_MEM_LIMIT={cap}")),
        "the pod's comment should say GPU_MEM_LIMIT={cap}"
    );
}

/// A gRPC call made by hand over HTTP/2 on the plugin's socket, with the
/// `:authority` a client chooses: the kubelet (since 1.26) and grpc-go send
/// `localhost`; gRPC's C core (Python grpcio, and grpc-java, old grpcurl)
/// send the socket's path, plain or percent-encoded. What it got on stream
/// 1: `Ok(answered)` once the response headers and message came, or
/// `Err(code)` of a RST_STREAM.
fn call_with_authority(socket: &Path, authority: &str) -> Result<(), u32> {
    grpc_call_with_authority(
        socket,
        authority,
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
    )
}

/// Clients that name the socket's path as `:authority` (gRPC's C core:
/// Python's grpcio, grpc-java, older grpcurl), which hyper's h2 alone would
/// refuse with RST_STREAM PROTOCOL_ERROR, are answered like the kubelet,
/// which sends `localhost`; and a client whose request is broken is still
/// refused.
#[test]
fn a_client_naming_the_socket_path_as_authority_is_answered() {
    let mut kubelet = Kubelet::started();
    let plugin = Plugin::start(&kubelet, &[]);
    let r = kubelet.registration(&plugin);
    let socket = kubelet.path().join(&r.endpoint);
    let path = socket.to_str().unwrap();
    assert_eq!(call_with_authority(&socket, "localhost"), Ok(()));
    assert_eq!(
        call_with_authority(&socket, path),
        Ok(()),
        "the socket path"
    );
    // As gRPC's C core spells it since 1.57.
    let encoded = path.replace('/', "%2F");
    assert_eq!(
        call_with_authority(&socket, &encoded),
        Ok(()),
        "the percent-encoded socket path"
    );
    // h2's own checks still apply: a request without :path is refused.
    assert_eq!(
        grpc_call_with_authority(&socket, path, ""),
        Err(HTTP2_PROTOCOL_ERROR),
        "an empty :path"
    );
}

/// Python with grpcio (gRPC's C core) in a venv in the test cache,
/// installed from PyPI on first use; None (said loudly) where it cannot be
/// had or GPUFRAC_TEST_ENGINES=0.
fn grpcio_python() -> Option<PathBuf> {
    const WHAT: &str = "the grpcio client test of the device plugin";
    let python = venv("grpcio", WHAT, &["grpcio"], "about 6 MB")?.join("bin/python3");
    let works = Command::new(&python)
        .args(["-c", "import grpc"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        cannot(WHAT, "grpcio installed, but `import grpc` fails");
        return None;
    }
    Some(python)
}

/// The client the issue was about: Python's grpcio, which names the socket
/// path as `:authority`, calls the plugin with its defaults and with the
/// path set explicitly, and gets the plugin's options (field 2,
/// get_preferred_allocation_available = true: bytes 10 01).
#[test]
fn python_grpcio_calls_the_plugin() {
    let Some(python) = grpcio_python() else {
        return;
    };
    let mut kubelet = Kubelet::started();
    let plugin = Plugin::start(&kubelet, &[]);
    let r = kubelet.registration(&plugin);
    let socket = kubelet.path().join(&r.endpoint);
    let script = r#"
import sys, grpc
path = sys.argv[1]
for options in ([], [("grpc.default_authority", path)]):
    with grpc.insecure_channel("unix:" + path, options=options) as ch:
        call = ch.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")
        print("options", call(b"", timeout=20).hex())
"#;
    let o = Command::new(&python)
        .args(["-c", script])
        .arg(&socket)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "grpcio's call failed:\n{}{}\nthe plugin's log:\n{}",
        stdout(&o),
        stderr(&o),
        plugin.log()
    );
    assert_eq!(stdout(&o), "options 1001\noptions 1001\n");
}

/// Each document of a YAML file as JSON (with the venv's PyYAML, which
/// kubernetes-validate brings).
fn yaml_docs(python: &Path, file: &Path) -> Vec<serde_json::Value> {
    let o = Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}: {}", file.display(), stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Every manifest of deploy/k8s, the device plugin's and the broker's
/// (DaemonSet, Service), is valid under Kubernetes' own OpenAPI schemas
/// (kubernetes-validate, strict: no field the API lacks); the
/// ServiceMonitor, a Prometheus Operator resource Kubernetes has no schema
/// of, selects the Service and scrapes its port; the broker's DaemonSet
/// runs in the host's pid namespace, privileged, on the host's socket
/// directory, and its probes ask what a broker serves.
#[test]
fn the_manifests_pass_kubernetes_openapi_schema() {
    const WHAT: &str = "the OpenAPI schema check of deploy/k8s";
    let Some(venv) = kubernetes_validate_venv(WHAT) else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s");
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in [root.clone(), root.join("broker")] {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "yaml") && !p.ends_with("servicemonitor.yaml") {
                files.push(p);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 4, "{files:?}");
    kubernetes_validate(&venv, &files);
    // The check is no formality: a field the API lacks fails it.
    let ds_path = root.join("broker/daemonset.yaml");
    let ds_text = std::fs::read_to_string(&ds_path).unwrap();
    let dir = Scratch::new("k8s-schema");
    let bad = dir.0.join("bad.yaml");
    std::fs::write(&bad, ds_text.replace("hostPID: true", "hostPid: true")).unwrap();
    let o = Command::new(venv.join("bin/kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", "1.34.0"])
        .arg(&bad)
        .output()
        .unwrap();
    let said = format!("{}{}", stdout(&o), stderr(&o));
    assert!(!o.status.success() && said.contains("hostPid"), "{said}");

    // The broker's DaemonSet: what it must be to see and serve the node.
    let python = venv.join("bin/python");
    let ds = &yaml_docs(&python, &ds_path)[0];
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], true);
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["hostPath"]["path"] == "/run/gpufrac"),
        "{pod}"
    );
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(
        args[..3],
        ["broker", "--socket", "/run/gpufrac/broker.sock"]
    );
    let port = &c["ports"][0];
    assert_eq!(port["name"], "metrics");
    assert!(args.contains(&format!("0.0.0.0:{}", port["containerPort"]).as_str()));
    // Its probes ask paths a broker answers 200 on.
    let addr = format!("127.0.0.1:{}", free_port());
    let _b = Broker::start("16G", &["--metrics", &addr]);
    for probe in ["readinessProbe", "livenessProbe"] {
        let p = &c[probe]["httpGet"];
        assert_eq!(p["port"], "metrics", "{probe}");
        let path = p["path"].as_str().unwrap();
        wait_until(20.0, &format!("{path} answering 200"), || {
            http_code(&addr, path) == Some(200)
        });
    }

    // The Service selects the DaemonSet's pods on its port; the
    // ServiceMonitor selects the Service and scrapes that port by name.
    let svc = &yaml_docs(&python, &root.join("broker/service.yaml"))[0];
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the Service selects the broker's pods");
    }
    assert_eq!(svc["spec"]["ports"][0]["name"], "metrics");
    let sm = &yaml_docs(&python, &root.join("broker/servicemonitor.yaml"))[0];
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["kind"], "ServiceMonitor");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "it selects the Service");
    }
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"][0],
        svc["metadata"]["namespace"]
    );
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
}

/// The status code of `GET path` on `addr`, if it answered.
fn http_code(addr: &str, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).ok()?;
    reply.split(' ').nth(1)?.parse().ok()
}
