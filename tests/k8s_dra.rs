//! `gpufrac k8s-dra-plugin` as a real process, between two stand-ins: a
//! kubelet that speaks the kubelet's own gRPC APIs (plugin registration,
//! then DRA v1 and v1beta1, from the same generated code) over real Unix
//! sockets, as its plugin watcher and DRA manager do; and an API server, a
//! small HTTP server here that serves ResourceClaims as the scheduler left
//! them (with `consumedCapacity`) and keeps the ResourceSlices the plugin
//! writes. The GPUs are the simulated driver's; the claims' caps and
//! shares are checked end to end: processes run with a claim's CDI spec,
//! under the broker, and in Podman, which applies the spec itself.

mod support;
use support::*;
#[path = "support/engines.rs"]
mod engines;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpufrac_k8s::dra_v1;
use gpufrac_k8s::dra_v1::dra_plugin_client::DraPluginClient;
use gpufrac_k8s::dra_v1beta1::dra_plugin_client::DraPluginClient as DraPluginClientV1beta1;
use gpufrac_k8s::pluginregistration as reg;
use gpufrac_k8s::reexport::tokio;
use gpufrac_k8s::reexport::tonic::transport::Channel;
use serde_json::{Value, json};

const DEVICES: &str = "16G,8G";
const DRIVER: &str = "gpufrac.dev";
const NODE: &str = "node-1";
/// What any answer may take before the test gives up.
const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------
// The API server stand-in.

#[derive(Default)]
struct ApiState {
    /// By (namespace, name).
    claims: HashMap<(String, String), Value>,
    /// Node name → UID.
    nodes: HashMap<String, String>,
    /// ResourceSlices, by name.
    slices: BTreeMap<String, Value>,
    /// Every slice the plugin wrote (created or replaced), in order.
    written: Vec<Value>,
    resource_version: u64,
    /// Answer every request with 403, as an API server whose RBAC lacks
    /// the plugin's rules does.
    forbid: bool,
    /// Every request as RBAC sees it: (API group, resource, verb).
    calls: Vec<(String, String, String)>,
    /// Store slices as an API server without the DRAConsumableCapacity
    /// feature does: without the fields of sharing.
    drop_sharing: bool,
}

/// What an API server without consumable capacity keeps of a slice.
fn without_sharing(v: &mut Value) {
    for d in v["spec"]["devices"].as_array_mut().into_iter().flatten() {
        let d = d.as_object_mut().unwrap();
        d.remove("allowMultipleAllocations");
        for c in d
            .get_mut("capacity")
            .and_then(Value::as_object_mut)
            .into_iter()
            .flat_map(|c| c.values_mut())
        {
            c.as_object_mut().unwrap().remove("requestPolicy");
        }
    }
}

/// An HTTP/1.1 server on 127.0.0.1 with the API server's paths for the
/// objects the plugin reads and writes, and its error bodies (Status).
struct ApiServer {
    port: u16,
    state: Arc<Mutex<ApiState>>,
}

impl ApiServer {
    fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(ApiState::default()));
        state
            .lock()
            .unwrap()
            .nodes
            .insert(NODE.into(), "6b1f6c1e-0000-4000-8000-00000000node".into());
        let s = Arc::clone(&state);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let s = Arc::clone(&s);
                std::thread::spawn(move || serve_http(conn, &s));
            }
        });
        ApiServer { port, state }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ApiState> {
        self.state.lock().unwrap()
    }

    /// A kubeconfig naming this server.
    fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let p = dir.join("kubeconfig");
        std::fs::write(
            &p,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    \
                 server: http://127.0.0.1:{}\nusers:\n- name: plugin\n  user:\n    token: \
                 stand-in\ncontexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    \
                 user: plugin\ncurrent-context: stand-in\n",
                self.port
            ),
        )
        .unwrap();
        p
    }

    fn set_claim(&self, claim: Value) {
        let ns = claim["metadata"]["namespace"].as_str().unwrap().to_string();
        let name = claim["metadata"]["name"].as_str().unwrap().to_string();
        self.state().claims.insert((ns, name), claim);
    }

    /// The slice of the node, once there.
    fn slice(&self) -> Option<Value> {
        self.state().slices.values().next().cloned()
    }

    fn wait_slice(&self, plugin: &Plugin, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let t = std::time::Instant::now();
        loop {
            if let Some(s) = self.slice().filter(|s| ok(s)) {
                return s;
            }
            assert!(
                t.elapsed() < WAIT,
                "no ResourceSlice {what} within {WAIT:?}; the API server has {:?}\nthe plugin's \
                 log:\n{}",
                self.slice(),
                plugin.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    })
}

fn serve_http(conn: TcpStream, state: &Mutex<ApiState>) {
    let mut r = BufReader::new(conn.try_clone().unwrap());
    let mut w = conn;
    loop {
        let mut head = String::new();
        if r.read_line(&mut head).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = head.split_whitespace();
        let (method, target) = match (parts.next(), parts.next()) {
            (Some(m), Some(t)) => (m.to_string(), t.to_string()),
            _ => return,
        };
        let mut len = 0;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        let (code, answer) = route(state, &method, &target, &body);
        let text = answer.to_string();
        let reply = format!(
            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        if w.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// A query value, percent-decoded.
fn decode(q: &str) -> String {
    let b = q.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 3 <= b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

fn route(state: &Mutex<ApiState>, method: &str, target: &str, body: &[u8]) -> (u16, Value) {
    let mut s = state.lock().unwrap();
    if s.forbid {
        return (
            403,
            status_body(
                403,
                "Forbidden",
                "User \"system:serviceaccount:kube-system:x\" cannot",
            ),
        );
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    // What RBAC would check: the group, the resource (the last plural
    // segment) and the verb.
    let group = if segs[0] == "api" { "" } else { segs[1] };
    // api/v1/[namespaces/NS/]RESOURCE[/NAME],
    // apis/GROUP/VERSION/[namespaces/NS/]RESOURCE[/NAME].
    let named = segs.len().is_multiple_of(2) == (segs[0] == "api");
    let resource = segs[segs.len() - if named { 2 } else { 1 }];
    let verb = match (method, named) {
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("DELETE", _) => "delete",
        _ => "?",
    };
    s.calls.push((group.into(), resource.into(), verb.into()));
    const SLICES: &[&str] = &["apis", "resource.k8s.io", "v1", "resourceslices"];
    match (method, segs.as_slice()) {
        ("GET", ["api", "v1", "nodes", name]) => match s.nodes.get(*name) {
            Some(uid) => (
                200,
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}}),
            ),
            None => (
                404,
                status_body(404, "NotFound", &format!("nodes \"{name}\" not found")),
            ),
        },
        (
            "GET",
            [
                "apis",
                "resource.k8s.io",
                "v1",
                "namespaces",
                ns,
                "resourceclaims",
                name,
            ],
        ) => match s.claims.get(&(ns.to_string(), name.to_string())) {
            Some(c) => (200, c.clone()),
            None => (
                404,
                status_body(
                    404,
                    "NotFound",
                    &format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
                ),
            ),
        },
        ("GET", p) if p == SLICES => {
            let mut want: Vec<(String, String)> = Vec::new();
            for kv in query.split('&') {
                if let Some(v) = kv.strip_prefix("fieldSelector=") {
                    for f in decode(v).split(',') {
                        let (k, v) = f.split_once('=').unwrap();
                        want.push((k.into(), v.into()));
                    }
                }
            }
            let items: Vec<Value> = s
                .slices
                .values()
                .filter(|sl| {
                    want.iter().all(|(k, v)| {
                        let got = match k.as_str() {
                            "spec.nodeName" => &sl["spec"]["nodeName"],
                            "spec.driver" => &sl["spec"]["driver"],
                            other => panic!("field selector on {other}"),
                        };
                        got == v.as_str()
                    })
                })
                .cloned()
                .collect();
            (
                200,
                json!({
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": s.resource_version.to_string()},
                    "items": items,
                }),
            )
        }
        ("POST", p) if p == SLICES => {
            let mut v: Value = serde_json::from_slice(body).unwrap();
            let name = v["metadata"]["name"].as_str().unwrap().to_string();
            if s.slices.contains_key(&name) {
                return (409, status_body(409, "AlreadyExists", "already exists"));
            }
            s.resource_version += 1;
            v["metadata"]["resourceVersion"] = json!(s.resource_version.to_string());
            v["metadata"]["uid"] = json!(format!("slice-{}", s.resource_version));
            s.written.push(v.clone());
            if s.drop_sharing {
                without_sharing(&mut v);
            }
            s.slices.insert(name, v.clone());
            (201, v)
        }
        ("PUT", [_, _, _, "resourceslices", name]) => {
            let mut v: Value = serde_json::from_slice(body).unwrap();
            let Some(old) = s.slices.get(*name).cloned() else {
                return (404, status_body(404, "NotFound", "not found"));
            };
            if old["metadata"]["resourceVersion"] != v["metadata"]["resourceVersion"] {
                return (
                    409,
                    status_body(409, "Conflict", "the object has been modified"),
                );
            }
            s.resource_version += 1;
            v["metadata"]["resourceVersion"] = json!(s.resource_version.to_string());
            v["metadata"]["uid"] = old["metadata"]["uid"].clone();
            s.written.push(v.clone());
            if s.drop_sharing {
                without_sharing(&mut v);
            }
            s.slices.insert(name.to_string(), v.clone());
            (200, v)
        }
        ("DELETE", [_, _, _, "resourceslices", name]) => match s.slices.remove(*name) {
            Some(v) => (200, v),
            None => (404, status_body(404, "NotFound", "not found")),
        },
        _ => panic!("the API server stand-in has no {method} {target}"),
    }
}

/// A ResourceClaim as the scheduler leaves it: allocated on this node's
/// pool, each result `(device, memory, compute)` of request `gpu`, reserved
/// for one pod. A result without memory and compute has no
/// consumedCapacity at all.
fn claim(name: &str, uid: &str, results: &[(&str, Option<&str>, Option<&str>)]) -> Value {
    let results: Vec<Value> = results
        .iter()
        .enumerate()
        .map(|(i, (device, mem, compute))| {
            let mut r = json!({
                "request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
            });
            if mem.is_some() || compute.is_some() {
                let mut c = serde_json::Map::new();
                if let Some(m) = mem {
                    c.insert("memory".into(), json!(m));
                }
                if let Some(p) = compute {
                    c.insert("compute".into(), json!(p));
                }
                r["consumedCapacity"] = Value::Object(c);
                r["shareID"] = json!(format!("{:08x}-0000-4000-8000-00000000000{i}", uid.len()));
            }
            r
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("pod-{uid}")}],
        },
    })
}

// ---------------------------------------------------------------------
// The kubelet stand-in and the plugin.

/// The kubelet's side: its plugin watcher (registration) and its DRA
/// manager (prepare, unprepare), each over the plugin's sockets.
struct Kubelet {
    rt: tokio::runtime::Runtime,
}

impl Kubelet {
    fn new() -> Kubelet {
        Kubelet {
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    fn call<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(async {
            tokio::time::timeout(WAIT, f)
                .await
                .unwrap_or_else(|_| panic!("the plugin did not answer within {WAIT:?}"))
        })
    }

    fn channel(&self, socket: &Path) -> Channel {
        self.rt
            .block_on(gpufrac_k8s::connect_unix(socket.to_path_buf()))
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e:?}", socket.display()))
    }

    /// What the plugin watcher does when a socket appears in
    /// plugins_registry: GetInfo, then NotifyRegistrationStatus with its
    /// verdict. The info, once the socket is there.
    fn register(&self, node: &Node, plugin: &Plugin) -> reg::PluginInfo {
        let sock = node.registry.0.join(format!("{DRIVER}-reg.sock"));
        let t = std::time::Instant::now();
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(
                t.elapsed() < WAIT,
                "no registration socket {} within {WAIT:?}; the plugin's log:\n{}",
                sock.display(),
                plugin.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut c = reg::registration_client::RegistrationClient::new(self.channel(&sock));
        let info = self
            .call(c.get_info(reg::InfoRequest {}))
            .unwrap()
            .into_inner();
        self.call(c.notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .unwrap();
        info
    }

    fn v1(&self, info: &reg::PluginInfo) -> DraPluginClient<Channel> {
        DraPluginClient::new(self.channel(Path::new(&info.endpoint)))
    }

    /// The plugin started on `node` and registered: it, what it
    /// registered, and a DRA v1 client on its endpoint.
    fn running(
        &self,
        node: &Node,
        broker: Option<&Broker>,
        args: &[&str],
    ) -> (Plugin, reg::PluginInfo, DraPluginClient<Channel>) {
        let plugin = Plugin::start(node, broker, args);
        let info = self.register(node, &plugin);
        let c = self.v1(&info);
        (plugin, info, c)
    }

    fn prepare(
        &self,
        c: &mut DraPluginClient<Channel>,
        claims: &[(&str, &str)],
    ) -> HashMap<String, dra_v1::NodePrepareResourceResponse> {
        let req = dra_v1::NodePrepareResourcesRequest {
            claims: claim_refs(claims),
        };
        self.call(c.node_prepare_resources(req))
            .unwrap()
            .into_inner()
            .claims
    }

    fn unprepare(
        &self,
        c: &mut DraPluginClient<Channel>,
        claims: &[(&str, &str)],
    ) -> HashMap<String, dra_v1::NodeUnprepareResourceResponse> {
        let req = dra_v1::NodeUnprepareResourcesRequest {
            claims: claim_refs(claims),
        };
        self.call(c.node_unprepare_resources(req))
            .unwrap()
            .into_inner()
            .claims
    }
}

/// Claims of namespace ml, by (name, UID), as the kubelet names them.
fn claim_refs(claims: &[(&str, &str)]) -> Vec<dra_v1::Claim> {
    claims
        .iter()
        .map(|(name, uid)| dra_v1::Claim {
            namespace: "ml".into(),
            name: name.to_string(),
            uid: uid.to_string(),
        })
        .collect()
}

/// A node's directories: the kubelet's, the runtime's CDI directory and
/// the plugin's state, kept across plugin restarts.
struct Node {
    registry: Scratch,
    plugins: Scratch,
    cdi: PathBuf,
    state: Scratch,
    /// Stand-ins for the NVIDIA device nodes; empty: none (a node of the
    /// simulated driver).
    dev: Scratch,
    /// Its content is the simulated GPUs the plugin's GPU listing sees.
    devices_file: PathBuf,
    kubeconfig: PathBuf,
    _cdi: Option<Scratch>,
}

impl Node {
    fn new(api: &ApiServer) -> Node {
        let cdi = Scratch::new("dra-cdi");
        let mut n = Node::with_cdi_dir(api, cdi.0.clone());
        n._cdi = Some(cdi);
        n
    }

    fn with_cdi_dir(api: &ApiServer, cdi: PathBuf) -> Node {
        let state = Scratch::new("dra-state");
        let devices_file = state.0.join("devices");
        std::fs::write(&devices_file, DEVICES).unwrap();
        let kubeconfig = api.kubeconfig(&state.0);
        Node {
            registry: Scratch::new("dra-reg"),
            plugins: Scratch::new("dra-plugins"),
            cdi,
            dev: Scratch::new("dra-dev"),
            devices_file,
            kubeconfig,
            state,
            _cdi: None,
        }
    }

    /// Device nodes on this node: links to /dev/null stand in for them.
    fn with_device_nodes(self) -> Node {
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", self.dev.0.join(n)).unwrap();
        }
        self
    }

    fn spec_path(&self, uid: &str) -> PathBuf {
        self.cdi.join(format!("{DRIVER}-claim_{uid}.json"))
    }

    fn spec(&self, uid: &str) -> Value {
        let p = self.spec_path(uid);
        serde_json::from_str(
            &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
        .unwrap()
    }
}

/// `gpufrac k8s-dra-plugin` on a node.
struct Plugin {
    _child: KillOnDrop,
    log: PathBuf,
}

impl Plugin {
    fn start(node: &Node, broker: Option<&Broker>, args: &[&str]) -> Plugin {
        let log = node.state.0.join(format!("plugin-{}.log", mono_ns()));
        let socket =
            broker.map_or_else(|| node.state.0.join("no-broker.sock"), |b| b.socket.clone());
        let mut cmd = sim_command(&artifacts().gpufrac, DEVICES, false);
        cmd.arg("k8s-dra-plugin")
            .args(["--node-name", NODE])
            .arg("--registry-dir")
            .arg(&node.registry.0)
            .arg("--plugins-dir")
            .arg(&node.plugins.0)
            .arg("--cdi-dir")
            .arg(&node.cdi)
            .arg("--state-dir")
            .arg(node.state.0.join("state"))
            .arg("--kubeconfig")
            .arg(&node.kubeconfig)
            .arg("--dev-dir")
            .arg(&node.dev.0)
            .arg("--socket")
            .arg(&socket)
            .arg("--lib")
            .arg(&artifacts().shim)
            .args(args)
            .env("GPUFRAC_K8S_SIM_DEVICES_FILE", &node.devices_file)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(b) = broker {
            cmd.env("GPUFRAC_SIM_STATE", &b.state);
        }
        Plugin {
            _child: KillOnDrop(cmd.spawn().expect("starting gpufrac k8s-dra-plugin")),
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The simulated GPUs' UUIDs as the plugin's own listing prints them.
fn uuids() -> Vec<String> {
    let o = sim_command(&artifacts().gpufrac, DEVICES, false)
        .args(["k8s-dra-plugin", "--list-gpus"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
        .lines()
        .map(|l| l.split_whitespace().nth(2).unwrap().to_string())
        .collect()
}

/// A process of a claim's container: exactly the environment of the
/// claim's CDI device, each path the container would see mapped to the
/// host path mounted there (what the runtime's bind mounts do), plus the
/// simulated driver, standing in for the driver libraries.
fn claim_process(spec: &Value, broker: &Broker, args: &[&str]) -> Command {
    let edits = &spec["devices"][0]["containerEdits"];
    let mounts: Vec<(String, String)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["containerPath"].as_str().unwrap().to_string(),
                m["hostPath"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let to_host = |v: &str| -> String {
        for (container, host) in &mounts {
            // A path under the mount point, component by component.
            match v.strip_prefix(container.as_str()) {
                Some(rest) if rest.is_empty() || rest.starts_with('/') => {
                    return format!("{host}{rest}");
                }
                _ => {}
            }
        }
        v.to_string()
    };
    let mut cmd = Command::new(&artifacts().probe);
    cmd.env_clear();
    for e in edits["env"].as_array().unwrap() {
        let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
        cmd.env(k, to_host(v));
    }
    cmd.env("LD_LIBRARY_PATH", &artifacts().simdir)
        .env("GPUFRAC_SIM_DEVICES", DEVICES)
        .env("GPUFRAC_SIM_STATE", &broker.state)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn env_of(spec: &Value) -> HashMap<String, String> {
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let (k, v) = e.as_str().unwrap().split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

// ---------------------------------------------------------------------
// The tests.

#[test]
fn registers_and_publishes_the_gpus_as_consumable_capacity() {
    let u = uuids();
    let api = ApiServer::start();
    let node = Node::new(&api);
    let kubelet = Kubelet::new();
    let plugin = Plugin::start(&node, None, &["--poll-interval", "100ms"]);
    let info = kubelet.register(&node, &plugin);
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(
        PathBuf::from(&info.endpoint),
        node.plugins.0.join(DRIVER).join("dra.sock")
    );
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );

    let s = api.wait_slice(&plugin, "with both GPUs", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    });
    assert_eq!(s["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(s["metadata"]["name"], format!("{NODE}-{DRIVER}"));
    assert_eq!(s["spec"]["driver"], DRIVER);
    assert_eq!(s["spec"]["nodeName"], NODE);
    assert_eq!(s["spec"]["pool"]["name"], NODE);
    assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 1);
    let owner = &s["metadata"]["ownerReferences"][0];
    assert_eq!(
        (owner["kind"].as_str(), owner["name"].as_str()),
        (Some("Node"), Some(NODE))
    );
    assert_eq!(owner["uid"], api.state().nodes[NODE].as_str());
    let d = &s["spec"]["devices"];
    assert_eq!(d[0]["name"], "gpu-0");
    assert_eq!(d[0]["attributes"]["uuid"]["string"], u[0].as_str());
    assert_eq!(d[1]["attributes"]["uuid"]["string"], u[1].as_str());
    assert!(
        d[0]["attributes"]["productName"]["string"].is_string(),
        "{d}"
    );
    assert_eq!(d[0]["allowMultipleAllocations"], true);
    assert_eq!(d[0]["capacity"]["memory"]["value"], "16Gi");
    assert_eq!(d[1]["capacity"]["memory"]["value"], "8Gi");
    assert_eq!(
        d[0]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"],
        "256Mi"
    );
    assert_eq!(d[0]["capacity"]["compute"]["value"], "100");
    let generation = s["spec"]["pool"]["generation"].as_i64().unwrap();

    // GPU 1 goes: withdrawn, under the next generation of the pool.
    std::fs::write(&node.devices_file, "16G").unwrap();
    let s = api.wait_slice(&plugin, "without GPU 1", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 1)
    });
    assert_eq!(s["spec"]["devices"][0]["name"], "gpu-0");
    assert!(s["spec"]["pool"]["generation"].as_i64().unwrap() > generation);
    std::fs::write(&node.devices_file, DEVICES).unwrap();
    api.wait_slice(&plugin, "with GPU 1 back", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    });

    // The kubelet restarts: it removes the node's slices, and its plugin
    // watcher registers the plugin again, which publishes them again.
    api.state().slices.clear();
    let again = kubelet.register(&node, &plugin);
    assert_eq!(again, info);
    api.wait_slice(
        &plugin,
        "published again after the kubelet's restart",
        |s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == 2)
        },
    );
    assert!(
        plugin
            .log()
            .contains("the kubelet registered driver gpufrac.dev"),
        "{}",
        plugin.log()
    );
}

#[test]
fn a_claim_of_4gi_and_30_percent_runs_capped_and_booked_in_the_broker() {
    let u = uuids();
    let api = ApiServer::start();
    let node = Node::new(&api);
    let broker = Broker::start(DEVICES, &[]);
    let kubelet = Kubelet::new();
    let (plugin, _info, mut c) = kubelet.running(&node, Some(&broker), &[]);
    api.set_claim(claim(
        "infer",
        "uid-infer",
        &[("gpu-0", Some("4Gi"), Some("30"))],
    ));

    let got = kubelet.prepare(&mut c, &[("infer", "uid-infer")]);
    let r = &got["uid-infer"];
    assert_eq!(r.error, "", "{}", plugin.log());
    assert_eq!(
        r.devices,
        [dra_v1::Device {
            request_names: vec!["gpu".into()],
            pool_name: NODE.into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["gpufrac.dev/claim=uid-infer".into()],
        }]
    );
    let spec = node.spec("uid-infer");
    assert_eq!(spec["kind"], "gpufrac.dev/claim");
    assert_eq!(spec["devices"][0]["name"], "uid-infer");
    let env = env_of(&spec);
    assert_eq!(env["GPU_MEM_LIMIT"], "4G");
    assert_eq!(env["GPU_COMPUTE_SHARE"], "30%");
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], u[0]);
    assert_eq!(env["LD_PRELOAD"], "/usr/lib/gpufrac/libgpufrac.so");
    assert_eq!(env["GPUFRAC_SOCKET"], "/run/gpufrac/broker.sock");
    assert_eq!(env["GPUFRAC_JOB_LEDGER"], "/run/gpufrac-job/books");
    let token = env["GPUFRAC_JOB"].clone();
    assert!(
        token.len() == 16 && token.bytes().all(|b| b.is_ascii_hexdigit()),
        "{token}"
    );
    // A node without NVIDIA device nodes: none given.
    assert_eq!(
        spec["devices"][0]["containerEdits"]["deviceNodes"],
        json!([])
    );
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(node.spec_path("uid-infer"))
        .unwrap()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the spec holds the lease's token");

    // Booked in the broker: pinned to GPU 0 with the claim's memory and
    // compute, named after its pod.
    wait_until(20.0, "the claim's lease in the broker", || {
        broker.leases().iter().any(|l| l["pod"] == "ml/infer-pod")
    });
    let l = broker.leases();
    assert_eq!(l.len(), 1, "{l:?}");
    assert_eq!(l[0]["gpus"], json!([0]));
    assert_eq!(l[0]["mem_cap"], 4 * GIB);
    assert_eq!(l[0]["compute"], 30.0);
    assert_eq!(l[0]["command"], "claim infer");

    // The claim's process is capped at 4 GiB, and counts in the lease.
    let hold = node.state.0.join("release-a");
    let mut a = Reap(Some(
        claim_process(
            &spec,
            &broker,
            &[
                "ctx",
                "info",
                "alloc",
                "alloc",
                "3G",
                "wait-file",
                hold.to_str().unwrap(),
            ],
        )
        .spawn()
        .unwrap(),
    ));
    let pid = a.0.as_ref().unwrap().id();
    wait_until(
        20.0,
        "the claim's process in its lease, holding 3 GiB",
        || {
            broker
                .process(pid)
                .is_some_and(|p| p["pod"] == "ml/infer-pod" && p["mem_used"] == 3 * GIB)
        },
    );
    assert_eq!(broker.process(pid).unwrap()["mem_cap"], 4 * GIB);
    // A second container of the claim shares the claim's 4 GiB: 2 GiB more
    // is refused, 1 GiB fits.
    let b = claim_process(
        &spec,
        &broker,
        &["ctx", "alloc", "alloc", "2G", "alloc", "alloc", "1G"],
    )
    .output()
    .unwrap();
    assert_eq!(num(&line(&b, "alloc", 0), "rc"), 2, "{}", stderr(&b));
    assert_eq!(num(&line(&b, "alloc", 1), "rc"), 0, "{}", stderr(&b));
    std::fs::write(&hold, "").unwrap();
    let out = a.0.take().unwrap().wait_with_output().unwrap();
    assert_eq!(
        num(&line(&out, "info", 0), "total"),
        4 * GIB,
        "{}",
        stderr(&out)
    );
    assert_eq!(num(&line(&out, "alloc", 0), "rc"), 0);
    // Alone, a process of the claim gets 4 GiB and no more.
    let o = claim_process(&spec, &broker, &["ctx", "fill", "alloc", "256M"])
        .output()
        .unwrap();
    let fill = line(&o, "fill", 0);
    assert_eq!(
        num(&fill, "count"),
        16,
        "16 × 256 MiB in 4 GiB: {}",
        stderr(&o)
    );
    assert_eq!(num(&fill, "rc"), 2, "then CUDA_ERROR_OUT_OF_MEMORY");

    // Prepared again (a second pod of the claim): the same answer, one
    // lease; a spec that went missing meanwhile is written again.
    std::fs::remove_file(node.spec_path("uid-infer")).unwrap();
    let again = kubelet.prepare(&mut c, &[("infer", "uid-infer")]);
    assert_eq!(again["uid-infer"], *r);
    assert_eq!(node.spec("uid-infer"), spec);
    assert_eq!(broker.leases().len(), 1);

    // Unprepared: the lease ends, the spec and books go; and again.
    let un = kubelet.unprepare(&mut c, &[("infer", "uid-infer")]);
    assert_eq!(un["uid-infer"].error, "");
    wait_until(20.0, "the lease released", || broker.leases().is_empty());
    assert!(!node.spec_path("uid-infer").exists());
    let un = kubelet.unprepare(&mut c, &[("infer", "uid-infer")]);
    assert_eq!(un["uid-infer"].error, "");
    assert!(plugin.log().contains("unprepared"), "{}", plugin.log());
}

#[test]
fn a_bad_claim_gets_its_own_error_and_the_others_are_prepared() {
    let api = ApiServer::start();
    let node = Node::new(&api);
    let kubelet = Kubelet::new();
    let (_plugin, info, mut c) = kubelet.running(&node, None, &[]);
    api.set_claim(claim(
        "good",
        "uid-good",
        &[("gpu-1", Some("2Gi"), Some("50"))],
    ));
    api.set_claim(claim("renewed", "uid-new", &[("gpu-0", None, None)]));
    let mut nvidia = claim("theirs", "uid-theirs", &[("gpu-0", None, None)]);
    nvidia["status"]["allocation"]["devices"]["results"][0]["driver"] = json!("gpu.nvidia.com");
    api.set_claim(nvidia);
    api.set_claim(claim(
        "nowhere",
        "uid-nowhere",
        &[("gpu-9", Some("1Gi"), Some("10"))],
    ));
    let got = kubelet.prepare(
        &mut c,
        &[
            ("missing", "uid-missing"),
            ("renewed", "uid-old"),
            ("theirs", "uid-theirs"),
            ("nowhere", "uid-nowhere"),
            ("good", "uid-good"),
        ],
    );
    assert_eq!(got.len(), 5);
    let error = |uid: &str| {
        let r = &got[uid];
        assert!(r.devices.is_empty(), "{uid}: {r:?}");
        r.error.clone()
    };
    let e = error("uid-missing");
    assert!(e.contains("ResourceClaim ml/missing does not exist"), "{e}");
    let e = error("uid-old");
    assert!(
        e.contains("has UID uid-new, not uid-old") && e.contains("delete the pod"),
        "{e}"
    );
    let e = error("uid-theirs");
    assert!(
        e.contains("no device of driver gpufrac.dev") && e.contains("gpu.nvidia.com"),
        "{e}"
    );
    let e = error("uid-nowhere");
    assert!(e.contains("\"gpu-9\"") && e.contains("gpu-0, gpu-1"), "{e}");
    let good = &got["uid-good"];
    assert_eq!(good.error, "");
    assert_eq!(good.devices[0].device_name, "gpu-1");
    assert_eq!(env_of(&node.spec("uid-good"))["GPU_MEM_LIMIT"], "2G");
    // Only the good claim left a spec.
    let specs = std::fs::read_dir(&node.cdi).unwrap().count();
    assert_eq!(specs, 1);

    // A kubelet of Kubernetes 1.32 or 1.33 calls v1beta1: the same claims.
    let mut old = DraPluginClientV1beta1::new(kubelet.channel(Path::new(&info.endpoint)));
    let got = kubelet
        .call(
            old.node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: claim_refs(&[("good", "uid-good")]),
            }),
        )
        .unwrap()
        .into_inner();
    assert_eq!(
        got.claims["uid-good"].devices[0].cdi_device_ids,
        ["gpufrac.dev/claim=uid-good"]
    );

    // An API server that refuses the plugin (RBAC) is said in those words.
    api.state().forbid = true;
    api.set_claim(claim("later", "uid-later", &[("gpu-0", None, None)]));
    let got = kubelet.prepare(&mut c, &[("later", "uid-later")]);
    let e = &got["uid-later"].error;
    assert!(
        e.contains("403") && e.contains("deploy/k8s/dra/rbac.yaml"),
        "{e}"
    );
    // The prepared claim is still answered: it needs no API server.
    let got = kubelet.prepare(&mut c, &[("good", "uid-good")]);
    assert_eq!(got["uid-good"].error, "");
}

#[test]
fn prepared_claims_survive_a_plugin_restart() {
    let api = ApiServer::start();
    let node = Node::new(&api);
    let broker = Broker::start(DEVICES, &[]);
    let kubelet = Kubelet::new();
    let (plugin, _info, mut c) = kubelet.running(&node, Some(&broker), &[]);
    api.set_claim(claim(
        "train",
        "uid-train",
        &[("gpu-1", Some("6Gi"), Some("60"))],
    ));
    let got = kubelet.prepare(&mut c, &[("train", "uid-train")]);
    assert_eq!(got["uid-train"].error, "");
    let spec = node.spec("uid-train");
    let hold = node.state.0.join("release");
    let mut p = Reap(Some(
        claim_process(
            &spec,
            &broker,
            &[
                "ctx",
                "alloc",
                "alloc",
                "1G",
                "wait-file",
                hold.to_str().unwrap(),
            ],
        )
        .spawn()
        .unwrap(),
    ));
    let pid = p.0.as_ref().unwrap().id();
    wait_until(20.0, "the claim's process in its lease", || {
        broker
            .process(pid)
            .is_some_and(|p| p["pod"] == "ml/train-pod" && p["mem_used"] == GIB)
    });

    // The plugin goes (an upgrade): its connection, and so the lease, with
    // it. The spec stays for the runtime.
    drop(plugin);
    wait_until(20.0, "the lease gone with the plugin", || {
        broker.leases().is_empty()
    });
    assert!(node.spec_path("uid-train").exists());
    // A new one books the claim again from its checkpoint, under the same
    // token: the running process counts in it again.
    let plugin = Plugin::start(&node, Some(&broker), &[]);
    wait_until(20.0, "the claim booked again, its process in it", || {
        broker
            .leases()
            .iter()
            .any(|l| l["pod"] == "ml/train-pod" && l["mem_cap"] == 6 * GIB)
            && broker
                .process(pid)
                .is_some_and(|p| p["pod"] == "ml/train-pod")
    });
    // The spec is the same, token and all.
    assert_eq!(node.spec("uid-train"), spec);
    let info = kubelet.register(&node, &plugin);
    let mut c = kubelet.v1(&info);
    // Prepared: answered without the API server.
    api.state().claims.clear();
    let got = kubelet.prepare(&mut c, &[("train", "uid-train")]);
    assert_eq!(got["uid-train"].error, "", "{}", plugin.log());
    std::fs::write(&hold, "").unwrap();
    drop(p.0.take().map(|c| c.wait_with_output()));
    let un = kubelet.unprepare(&mut c, &[("train", "uid-train")]);
    assert_eq!(un["uid-train"].error, "");
    wait_until(20.0, "the lease released", || broker.leases().is_empty());
    assert!(!node.spec_path("uid-train").exists());
    assert!(plugin.log().contains("booked again"), "{}", plugin.log());
}

/// Two claims on one GPU at 70% and 30% of its compute: each claim's
/// process, run with its claim's CDI environment, gets its claim's part of
/// the GPU from the broker while both are busy. Measured as kernels
/// completed in a common window, as tests/broker.rs measures shares.
#[test]
fn two_claims_at_70_and_30_get_70_and_30_of_the_gpu() {
    const MS: u64 = 1_000_000;
    let api = ApiServer::start();
    let node = Node::new(&api);
    let broker = Broker::start(DEVICES, &["--timeslice", "20ms"]);
    let kubelet = Kubelet::new();
    let (_plugin, _info, mut c) = kubelet.running(&node, Some(&broker), &[]);
    api.set_claim(claim(
        "big",
        "uid-big",
        &[("gpu-0", Some("8Gi"), Some("70"))],
    ));
    api.set_claim(claim(
        "small",
        "uid-small",
        &[("gpu-0", Some("4Gi"), Some("30"))],
    ));
    let got = kubelet.prepare(&mut c, &[("big", "uid-big"), ("small", "uid-small")]);
    assert!(got.values().all(|r| r.error.is_empty()), "{got:?}");
    wait_until(20.0, "both claims booked", || broker.leases().len() == 2);

    // A round's busy fraction is the simulated driver's count of 1 ms
    // kernels over the window, which a debug build on a loaded or slow
    // host falls short of without the broker wasting a slice (a quiet
    // 2-CPU machine read 0.66 once, 2026-11-30, with the split exact): a
    // round short of 0.75 is taken again, up to three, each judged on its
    // split. A broker that idles the GPU falls short in every round.
    until_a_round_passes("GPU busy 0.75 of the window at most", || {
        let start = mono_ns() + 1500 * MS;
        let end = start + 3000 * MS;
        let kids: Vec<_> = ["uid-big", "uid-small"]
            .iter()
            .map(|uid| {
                let args = spin_args(start, end);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                claim_process(&node.spec(uid), &broker, &args)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let k: Vec<f64> = kids
            .into_iter()
            .map(|c| {
                let o = c.wait_with_output().unwrap();
                assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
                num(&line(&o, "spin", 0), "kernels") as f64
            })
            .collect();
        let total: f64 = k.iter().sum();
        let shares: Vec<f64> = k.iter().map(|x| x / total).collect();
        let busy = total * MS as f64 / (end - start) as f64;
        println!("two claims at 70% and 30%: {shares:.2?} of the GPU, busy {busy:.2}");
        for (got, want) in shares.iter().zip([0.7, 0.3]) {
            assert!(
                (got - want).abs() <= 0.10,
                "achieved {shares:?}, target [0.7, 0.3] (±0.10)"
            );
        }
        (format!("busy {busy:.2}"), busy > 0.75)
    });
}

/// Podman applies the claim's CDI spec itself: the container gets the shim,
/// the socket's directory, the claim's books and GPU node and caps, and
/// its process is capped at the claim's memory and counts in its lease.
#[test]
fn podman_runs_a_container_of_the_claim_capped() {
    if !engines::ensure_podman() {
        return;
    }
    let image = engines::image(engines::Engine::Podman);
    let u = uuids();
    let api = ApiServer::start();
    // Podman reads /var/run/cdi; the claim's spec goes there, under a name
    // no other test uses.
    let node = Node::with_cdi_dir(&api, PathBuf::from("/var/run/cdi")).with_device_nodes();
    let broker = Broker::start(DEVICES, &[]);
    let kubelet = Kubelet::new();
    let (plugin, _info, mut c) = kubelet.running(&node, Some(&broker), &[]);
    let uid = format!("uid-podman-{}", std::process::id());
    api.set_claim(claim("podman", &uid, &[("gpu-1", Some("1Gi"), Some("40"))]));
    let got = kubelet.prepare(&mut c, &[("podman", &uid)]);
    let r = &got[&uid];
    assert_eq!(r.error, "", "{}", plugin.log());
    struct Unprepare<'a>(&'a Node, String);
    impl Drop for Unprepare<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0.spec_path(&self.1));
        }
    }
    let _cleanup = Unprepare(&node, uid.clone());

    let mut args: Vec<String> = vec!["--device".into(), r.devices[0].cdi_device_ids[0].clone()];
    args.extend(engines::sim_driver_args());
    args.extend(engines::sim_state_args(&broker.devices, &broker.state));
    args.extend(engines::program_args());
    args.push(image.to_string());
    let script = "r=; for n in nvidia0 nvidia1 nvidiactl nvidia-uvm; do \
                    if [ -c /dev/$n ]; then r=\"$r $n=1\"; else r=\"$r $n=0\"; fi; done; \
                  echo nodes$r; \
                  echo env visible=$CUDA_VISIBLE_DEVICES cap=$GPU_MEM_LIMIT share=$GPU_COMPUTE_SHARE; \
                  exec \"$@\"";
    for a in [
        "sh",
        "-c",
        script,
        "sh",
        engines::PROBE,
        "ctx",
        "info",
        "fill",
        "alloc",
        "64M",
        "sleep-ms",
        "30000",
    ] {
        args.push(a.into());
    }
    let mut ct = engines::Container::run(engines::Engine::Podman, &args);
    let nodes = ct.wait_line("nodes", 60);
    assert_eq!(nodes["nvidia1"], "1", "the claim's GPU: {nodes:?}");
    assert_eq!(nodes["nvidia0"], "0", "not the other: {nodes:?}");
    assert_eq!(nodes["nvidiactl"], "1");
    let env = ct.wait_line("env", 10);
    assert_eq!(env["visible"], u[1]);
    assert_eq!(env["cap"], "1G");
    assert_eq!(env["share"], "40%");
    let info_line = ct.wait_line("info", 30);
    assert_eq!(num(&info_line, "total"), GIB, "{info_line:?}");
    let fill = ct.wait_line("fill", 30);
    assert_eq!(num(&fill, "count"), 16, "16 × 64 MiB in 1 GiB: {fill:?}");
    assert_eq!(num(&fill, "rc"), 2);
    let pid = ct.host_pid();
    wait_until(20.0, "the container's process in the claim's lease", || {
        broker
            .process(pid)
            .is_some_and(|p| p["pod"] == "ml/podman-pod")
    });
    drop(ct);
    let un = kubelet.unprepare(&mut c, &[("podman", &uid)]);
    assert_eq!(un[&uid].error, "");
    assert!(!node.spec_path(&uid).exists());
}

/// Every ResourceSlice the plugin writes, and every manifest of
/// deploy/k8s/dra/, is valid under Kubernetes' own OpenAPI schemas (those
/// kubernetes-validate ships, strict: no field the API does not have) for
/// the releases with resource.k8s.io/v1.
#[test]
fn the_slices_and_manifests_pass_kubernetes_openapi_schema() {
    const WHAT: &str = "the OpenAPI schema check of the DRA plugin's ResourceSlices";
    let Some(venv) = kubernetes_validate_venv(WHAT) else {
        return;
    };
    let api = ApiServer::start();
    let node = Node::new(&api);
    let kubelet = Kubelet::new();
    let plugin = Plugin::start(&node, None, &["--poll-interval", "100ms"]);
    kubelet.register(&node, &plugin);
    api.wait_slice(&plugin, "with both GPUs", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    });
    std::fs::write(&node.devices_file, "16G").unwrap();
    api.wait_slice(&plugin, "with one GPU", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 1)
    });
    let written = api.state().written.clone();
    assert!(written.len() >= 2, "{written:?}");
    let dir = Scratch::new("dra-schema");
    let mut files: Vec<PathBuf> = Vec::new();
    for (i, s) in written.iter().enumerate() {
        // What the plugin sent, as it sent it: the stand-in's own
        // resourceVersion and uid are valid metadata too.
        let p = dir.0.join(format!("slice-{i}.json"));
        std::fs::write(&p, s.to_string()).unwrap();
        files.push(p);
    }
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s/dra");
    for e in std::fs::read_dir(&deploy).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "yaml") {
            files.push(e.path());
        }
    }
    kubernetes_validate(&venv, &files);
    // The check is no formality: a slice with a field the API lacks fails.
    let mut bad = written[0].clone();
    bad["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"]["validRange"]["stride"] =
        json!("1Mi");
    let p = dir.0.join("bad.json");
    std::fs::write(&p, bad.to_string()).unwrap();
    let o = Command::new(venv.join("bin/kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", "1.34.0"])
        .arg(&p)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = format!("{}{}", stdout(&o), stderr(&o));
    assert!(!o.status.success() && said.contains("stride"), "{said}");
}

#[test]
fn bad_settings_exit_with_what_to_do() {
    let api = ApiServer::start();
    let node = Node::new(&api);
    // The node's directories unless ARGS name others.
    let run = |devices: &str, args: &[&str]| {
        let mut cmd = sim_command(&artifacts().gpufrac, devices, false);
        cmd.arg("k8s-dra-plugin")
            .args(["--node-name", NODE, "--lib"])
            .arg(&artifacts().shim);
        for (flag, dir) in [
            ("--registry-dir", &node.registry.0),
            ("--plugins-dir", &node.plugins.0),
            ("--state-dir", &node.state.0.join("state")),
            ("--kubeconfig", &node.kubeconfig),
        ] {
            if !args.contains(&flag) {
                cmd.arg(flag).arg(dir);
            }
        }
        let o = cmd.args(args).output().unwrap();
        (o.status.code(), stderr(&o))
    };
    let (code, e) = run("", &[]);
    assert_eq!(code, Some(1));
    assert!(e.contains("cannot list the GPUs"), "{e}");
    let (code, e) = run(
        DEVICES,
        &["--registry-dir", "/nonexistent/plugins_registry"],
    );
    assert_eq!(code, Some(1));
    assert!(
        e.contains("--registry-dir") && e.contains("hostPath"),
        "{e}"
    );
    let (code, e) = run(DEVICES, &["--kubeconfig", "/nonexistent/kubeconfig"]);
    assert_eq!(code, Some(1));
    assert!(e.contains("--kubeconfig /nonexistent/kubeconfig"), "{e}");
    // Without --kubeconfig, $KUBECONFIG is read.
    let o = sim_command(&artifacts().gpufrac, DEVICES, false)
        .arg("k8s-dra-plugin")
        .args(["--node-name", NODE, "--lib"])
        .arg(&artifacts().shim)
        .arg("--registry-dir")
        .arg(&node.registry.0)
        .arg("--plugins-dir")
        .arg(&node.plugins.0)
        .arg("--state-dir")
        .arg(node.state.0.join("state"))
        .env("KUBECONFIG", "/nonexistent/kubeconfig-of-the-env")
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("no credentials for the API server")
            && e.contains("/nonexistent/kubeconfig-of-the-env")
            && e.contains("--kubeconfig or set KUBECONFIG"),
        "{e}"
    );
    let (code, e) = run(DEVICES, &["--driver-name", "GPUfrac"]);
    assert_eq!(code, Some(2));
    assert!(e.contains("DNS subdomain"), "{e}");
    // Nothing was left in the kubelet's directories.
    assert_eq!(std::fs::read_dir(&node.registry.0).unwrap().count(), 0);
}

/// deploy/k8s/dra/ as docs/k8s-dra.md says to apply it: the plugin runs
/// with the DaemonSet's arguments (its host paths pointed at the test's
/// own files), every call it makes is one rbac.yaml allows, the
/// DeviceClass selects its devices, and a claim made from the "4Gi and
/// 30%" template is prepared with those caps, as pod-example.yaml's
/// comment says.
#[test]
fn the_deploy_manifests_agree_with_the_plugin() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s/dra");
    let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap();
    let ds = read("daemonset.yaml");
    assert!(
        ds.contains(r#"command: ["/usr/local/bin/gpufrac", "k8s-dra-plugin"]"#),
        "{ds}"
    );
    // The plugin's default directories are mounted from the host at the
    // same paths (they go into the CDI specs as the host's).
    for dir in [
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
        "/var/lib/gpufrac",
        "/run/gpufrac",
    ] {
        assert_eq!(
            ds.matches(&format!("path: {dir}\n")).count(),
            1,
            "a hostPath volume for {dir}"
        );
        assert!(ds.contains(&format!("mountPath: {dir}\n")), "{dir} mounted");
    }
    assert!(ds.contains("fieldPath: spec.nodeName") && ds.contains("name: NODE_NAME"));
    assert!(ds.contains("serviceAccountName: gpufrac-dra-plugin"));
    let line = ds
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("args: "))
        .expect("an `args: [...]` line in daemonset.yaml");
    let mut args: Vec<String> = serde_json::from_str(line).unwrap();
    let api = ApiServer::start();
    let node = Node::new(&api);
    let broker = Broker::start(DEVICES, &[]);
    // Host paths; Plugin::start names the test's own shim and broker.
    for flag in ["--lib", "--socket"] {
        let i = args.iter().position(|a| a == flag).unwrap();
        assert!(
            args[i + 1].starts_with('/'),
            "{flag} {}: a host path",
            args[i + 1]
        );
        args.drain(i..i + 2);
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let kubelet = Kubelet::new();
    let plugin = Plugin::start(&node, Some(&broker), &argv);
    let info = kubelet.register(&node, &plugin);

    let dc = read("deviceclass.yaml");
    assert!(
        dc.contains(&format!("expression: device.driver == \"{}\"", info.name)),
        "the DeviceClass selects the driver the plugin registers: {dc}"
    );
    assert!(dc.contains(&format!("name: {}", info.name)));
    // The first template: its capacity requests become the claim's
    // consumed capacity, as the scheduler books them.
    let templates = read("claim-templates.yaml");
    let first = templates.split("\n---\n").next().unwrap();
    let value = |key: &str| {
        first
            .lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap_or_else(|| panic!("no {key}: in the first template"))
            .trim_matches('"')
            .to_string()
    };
    let (mem, compute) = (value("memory"), value("compute"));
    assert!(first.contains(&format!("deviceClassName: {}", info.name)));
    api.set_claim(claim(
        "example",
        "uid-example",
        &[("gpu-0", Some(&mem), Some(&compute))],
    ));
    let mut c = kubelet.v1(&info);
    let got = kubelet.prepare(&mut c, &[("example", "uid-example")]);
    assert_eq!(got["uid-example"].error, "", "{}", plugin.log());
    let env = env_of(&node.spec("uid-example"));
    let pod = read("pod-example.yaml");
    assert!(pod.contains("resourceClaimTemplateName: gpufrac-4gi-30"));
    for (k, v) in [
        ("GPU_MEM_LIMIT", &env["GPU_MEM_LIMIT"]),
        ("GPU_COMPUTE_SHARE", &env["GPU_COMPUTE_SHARE"]),
    ] {
        assert!(
            pod.contains(&format!("{k}={v}")),
            "pod-example.yaml should say {k}={v}"
        );
    }
    wait_until(20.0, "the slice published", || api.slice().is_some());
    kubelet.unprepare(&mut c, &[("example", "uid-example")]);

    // Every call the plugin made is one rbac.yaml grants.
    let rbac = read("rbac.yaml");
    let rules: Vec<(String, String, Vec<String>)> = rbac
        .split("  - apiGroups: ")
        .skip(1)
        .map(|r| {
            let list = |key: &str| -> Vec<String> {
                let l = r
                    .lines()
                    .map(str::trim)
                    .find_map(|l| l.strip_prefix(&format!("{key}: ")))
                    .unwrap_or_else(|| panic!("a rule without {key}: {r}"));
                serde_json::from_str(l).unwrap()
            };
            let group: Vec<String> = serde_json::from_str(r.lines().next().unwrap()).unwrap();
            (
                group[0].clone(),
                list("resources")[0].clone(),
                list("verbs"),
            )
        })
        .collect();
    let calls = api.state().calls.clone();
    assert!(calls.len() >= 4, "{calls:?}");
    for (group, resource, verb) in calls {
        assert!(
            rules
                .iter()
                .any(|(g, r, v)| *g == group && *r == resource && v.contains(&verb)),
            "rbac.yaml does not allow {verb} on {resource} in group {group:?}: {rules:?}"
        );
    }
}

/// A client that names the socket's path as `:authority` (gRPC's C core
/// does, and kubelets have), which hyper's HTTP/2 server alone refuses, is
/// answered on both of the plugin's sockets, as the device plugin's is.
#[test]
fn a_client_naming_the_socket_path_as_authority_is_answered() {
    let api = ApiServer::start();
    let node = Node::new(&api);
    let kubelet = Kubelet::new();
    let plugin = Plugin::start(&node, None, &[]);
    let info = kubelet.register(&node, &plugin);
    let reg_socket = node.registry.0.join(format!("{DRIVER}-reg.sock"));
    for (socket, path) in [
        (
            reg_socket.as_path(),
            "/pluginregistration.Registration/GetInfo",
        ),
        (
            Path::new(&info.endpoint),
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        ),
        (
            Path::new(&info.endpoint),
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        ),
    ] {
        let name = socket.to_str().unwrap();
        for authority in ["localhost", name, &name.replace('/', "%2F")] {
            assert_eq!(
                grpc_call_with_authority(socket, authority, path),
                Ok(()),
                "{path} with :authority {authority}\n{}",
                plugin.log()
            );
        }
    }
}

/// An API server whose DRAConsumableCapacity feature is off stores the
/// slice without its sharing: the plugin says so, and does not write the
/// slice again and again to put it back (only a change of its own or of
/// the stored slice is written).
#[test]
fn an_api_server_without_consumable_capacity_is_said_and_not_fought() {
    let api = ApiServer::start();
    api.state().drop_sharing = true;
    let node = Node::new(&api);
    let kubelet = Kubelet::new();
    let plugin = Plugin::start(&node, None, &["--poll-interval", "100ms"]);
    kubelet.register(&node, &plugin);
    api.wait_slice(&plugin, "stored", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 2)
    });
    assert!(
        api.slice().unwrap()["spec"]["devices"][0]
            .get("allowMultipleAllocations")
            .is_none()
    );
    wait_until(20.0, "the plugin saying the gate is off", || {
        plugin
            .log()
            .contains("DRAConsumableCapacity feature gate is off")
    });
    assert_eq!(api.state().written.len(), 1);
    // The kubelet registers it again (a republish), then a GPU goes (a
    // change): one more write, for the change.
    kubelet.register(&node, &plugin);
    std::fs::write(&node.devices_file, "16G").unwrap();
    api.wait_slice(&plugin, "with one GPU", |s| {
        s["spec"]["devices"]
            .as_array()
            .is_some_and(|d| d.len() == 1)
    });
    let written = api.state().written.len();
    assert_eq!(written, 2, "{}", plugin.log());
}
