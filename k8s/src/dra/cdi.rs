//! The CDI spec of a prepared claim: one device, `<driver>/claim=<UID>`,
//! whose edits put every container of the claim under gpufrac — the shim
//! (LD_PRELOAD, or an /etc/ld.so.preload mount), the claim's memory cap and
//! compute share, the lease's token and the claim's shared memory books
//! (so all its containers count against one cap), its GPUs by UUID, the
//! broker socket's directory, the driver's libraries and device nodes.
//! The runtime (containerd, CRI-O, Podman) applies it when the kubelet
//! names the device. Building the spec is pure; writing it is a file.

use std::path::{Path, PathBuf};

use gpufrac_common::config::{
    VAR_COMPUTE_SHARE, VAR_JOB, VAR_JOB_LEDGER, VAR_MEM_LIMIT, VAR_MEM_LIMIT_PREFIX, VAR_SOCKET,
};
use serde_json::{Value, json};

use crate::devices::{Mounts, env_size};
use crate::leases::token_text;

/// What runtimes read: `hostPath` on device nodes is 0.5.0's.
pub const CDI_VERSION: &str = "0.5.0";
/// Where a container sees its claim's memory books (as `gpufrac run`'s
/// containers see their job's).
pub const CONTAINER_BOOKS: &str = "/run/gpufrac-job/books";

/// What every claim's containers get from this node, found at start: the
/// shim, the broker socket's directory and the driver's control nodes as
/// the device plugin mounts them (no control nodes: a node without NVIDIA
/// device nodes, the simulated driver's, whose claims get none at all),
/// and the driver's libraries and programs.
#[derive(Clone, Debug)]
pub struct Edits {
    pub mounts: Mounts,
    /// Host file → path in the container.
    pub driver: Vec<(PathBuf, String)>,
}

/// A claim's part of its spec.
#[derive(Clone, Debug)]
pub struct ClaimEdits<'a> {
    pub uid: &'a str,
    /// Each GPU: UUID, the N of its /dev/nvidiaN, the memory cap there
    /// (None: admin access, no cap).
    pub gpus: Vec<(&'a str, u32, Option<u64>)>,
    pub share: Option<f64>,
    /// The lease's token; None: no lease (admin access).
    pub token: Option<u64>,
    /// The claim's memory books on the host.
    pub books: Option<&'a Path>,
}

/// `gpufrac.dev/claim`.
pub fn kind(driver: &str) -> String {
    format!("{driver}/claim")
}

/// The device the kubelet names for the claim: `gpufrac.dev/claim=UID`.
pub fn device_id(driver: &str, uid: &str) -> String {
    format!("{}={uid}", kind(driver))
}

/// The spec's file in the CDI directory: `gpufrac.dev-claim_UID.json`.
pub fn file_name(driver: &str, uid: &str) -> String {
    format!("{driver}-claim_{uid}.json")
}

/// `30%`, `12.5%`: two decimals at most, as `GPU_COMPUTE_SHARE` reads it.
pub fn percent(p: f64) -> String {
    let s = format!("{:.2}", (p * 100.0).floor() / 100.0);
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}%")
}

/// The spec; refuses a GPU whose device node is missing on a node that has
/// the driver's nodes.
pub fn spec(driver: &str, edits: &Edits, c: &ClaimEdits) -> Result<Value, String> {
    let e = &edits.mounts;
    let mut env = Vec::new();
    if e.preload_file.is_none() {
        env.push(format!("LD_PRELOAD={}", e.container_lib));
    }
    let socket_name = e
        .socket
        .file_name()
        .map_or_else(|| "broker.sock".into(), |n| n.to_string_lossy());
    env.push(format!(
        "{VAR_SOCKET}={}/{socket_name}",
        e.container_socket_dir
    ));
    let uuids: Vec<&str> = c.gpus.iter().map(|g| g.0).collect();
    env.push(format!("CUDA_VISIBLE_DEVICES={}", uuids.join(",")));
    // The NVIDIA runtime would otherwise hand the container every GPU when
    // its image says NVIDIA_VISIBLE_DEVICES=all (CUDA images do).
    env.push("NVIDIA_VISIBLE_DEVICES=void".into());
    let caps: Vec<u64> = c.gpus.iter().filter_map(|g| g.2).collect();
    if let Some(&smallest) = caps.iter().min() {
        env.push(format!("{VAR_MEM_LIMIT}={}", env_size(smallest)));
        if caps.len() > 1 {
            for (ordinal, cap) in caps.iter().enumerate() {
                env.push(format!(
                    "{VAR_MEM_LIMIT_PREFIX}{ordinal}={}",
                    env_size(*cap)
                ));
            }
        }
    }
    if let Some(s) = c.share {
        env.push(format!("{VAR_COMPUTE_SHARE}={}", percent(s)));
    }
    if let Some(t) = c.token {
        env.push(format!("{VAR_JOB}={}", token_text(t)));
    }

    let ro = json!(["ro", "nosuid", "nodev", "bind"]);
    let mut mounts = vec![
        json!({ "hostPath": e.lib, "containerPath": e.container_lib, "options": ro }),
        // The directory rather than the socket: the mount keeps working
        // after the broker restarts and makes a new socket.
        json!({
            "hostPath": e.socket.parent().unwrap_or(Path::new("/")),
            "containerPath": e.container_socket_dir,
            "options": ["rbind", "nosuid", "nodev", "noexec"],
        }),
    ];
    if let Some(f) = &e.preload_file {
        mounts.push(json!({ "hostPath": f, "containerPath": "/etc/ld.so.preload", "options": ro }));
    }
    if let Some(b) = c.books {
        env.push(format!("{VAR_JOB_LEDGER}={CONTAINER_BOOKS}"));
        mounts.push(json!({
            "hostPath": b,
            "containerPath": CONTAINER_BOOKS,
            "options": ["rw", "nosuid", "nodev", "noexec", "bind"],
        }));
    }
    for (host, container) in &edits.driver {
        mounts.push(json!({ "hostPath": host, "containerPath": container, "options": ro }));
    }

    let node = |host: &Path, container: &str| {
        // Type and numbers are read from the host node when the container
        // starts.
        if host == Path::new(container) {
            json!({ "path": container })
        } else {
            json!({ "path": container, "hostPath": host })
        }
    };
    let mut nodes: Vec<Value> = e.control_nodes.iter().map(|(h, c)| node(h, c)).collect();
    if !e.control_nodes.is_empty() {
        for (uuid, n, _) in &c.gpus {
            let name = format!("nvidia{n}");
            let host = e.dev_dir.join(&name);
            // Runtimes take the node's numbers from the host path and
            // refuse a link.
            let real = host.canonicalize().map_err(|err| {
                format!(
                    "{}: {err}: GPU {uuid} has no device node there although the driver's \
                     control node is present; check the node (nvidia-smi creates the nodes) or \
                     point --dev-dir at the directory that holds them",
                    host.display()
                )
            })?;
            nodes.push(node(&real, &format!("/dev/{name}")));
        }
    }
    Ok(json!({
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": [{
            "name": c.uid,
            "containerEdits": {
                "env": env,
                "deviceNodes": nodes,
                "mounts": mounts,
            },
        }],
    }))
}

/// Writes a spec into the CDI directory: readable by root only (it holds
/// the lease's token), whole or not at all (a temporary name no runtime
/// reads, renamed into place).
pub fn write(dir: &Path, name: &str, spec: &Value) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "cannot create the CDI directory {}: {e}; point --cdi-dir at the directory the \
             container runtime reads (/var/run/cdi or /etc/cdi)",
            dir.display()
        )
    })?;
    let text = serde_json::to_vec_pretty(spec).expect("a JSON value always prints");
    let path = dir.join(name);
    gpufrac_common::files::write_private(&path, &text, true)
        .map_err(|e| format!("cannot write the CDI spec {}: {e}", path.display()))
}

/// Removes a claim's spec; one already gone is no error.
pub fn remove(dir: &Path, name: &str) -> Result<(), String> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!(
            "cannot remove the CDI spec {}: {e}",
            path.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits(control: Vec<(PathBuf, String)>, dev_dir: &Path) -> Edits {
        Edits {
            mounts: Mounts {
                lib: "/opt/gpufrac/lib/libgpufrac.so".into(),
                container_lib: "/usr/lib/gpufrac/libgpufrac.so".into(),
                socket: "/run/gpufrac/broker.sock".into(),
                container_socket_dir: "/run/gpufrac".into(),
                preload_file: None,
                control_nodes: control,
                dev_dir: dev_dir.into(),
            },
            driver: vec![(
                "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06".into(),
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
            )],
        }
    }

    fn env(v: &Value) -> Vec<String> {
        v["devices"][0]["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn a_claim_is_one_device_with_its_caps() {
        let books = Path::new("/var/lib/gpufrac/dra/books/u-1");
        let c = ClaimEdits {
            uid: "u-1",
            gpus: vec![("GPU-a", 0, Some(4 << 30))],
            share: Some(30.0),
            token: Some(0xab),
            books: Some(books),
        };
        let s = spec("gpufrac.dev", &edits(vec![], Path::new("/dev")), &c).unwrap();
        assert_eq!(s["kind"], "gpufrac.dev/claim");
        assert_eq!(s["devices"][0]["name"], "u-1");
        assert_eq!(
            env(&s),
            [
                "LD_PRELOAD=/usr/lib/gpufrac/libgpufrac.so",
                "GPUFRAC_SOCKET=/run/gpufrac/broker.sock",
                "CUDA_VISIBLE_DEVICES=GPU-a",
                "NVIDIA_VISIBLE_DEVICES=void",
                "GPU_MEM_LIMIT=4G",
                "GPU_COMPUTE_SHARE=30%",
                "GPUFRAC_JOB=00000000000000ab",
                "GPUFRAC_JOB_LEDGER=/run/gpufrac-job/books",
            ]
        );
        let mounts = &s["devices"][0]["containerEdits"]["mounts"];
        assert_eq!(mounts[1]["hostPath"], "/run/gpufrac");
        assert_eq!(mounts[2]["hostPath"], books.to_str().unwrap());
        assert_eq!(
            mounts[3]["containerPath"],
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
        );
        // No driver nodes on this node: none asked for.
        assert_eq!(s["devices"][0]["containerEdits"]["deviceNodes"], json!([]));
        assert_eq!(device_id("gpufrac.dev", "u-1"), "gpufrac.dev/claim=u-1");
        assert_eq!(
            file_name("gpufrac.dev", "u-1"),
            "gpufrac.dev-claim_u-1.json"
        );
    }

    #[test]
    fn device_nodes_where_the_driver_has_them() {
        let dir = std::env::temp_dir().join(format!("gpufrac-dra-cdi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(dir.join("nvidia3"));
        std::os::unix::fs::symlink("/dev/null", dir.join("nvidia3")).unwrap();
        let control = vec![(PathBuf::from("/dev/null"), "/dev/nvidiactl".to_string())];
        let c = ClaimEdits {
            uid: "u-2",
            gpus: vec![("GPU-a", 3, Some(1 << 30)), ("GPU-b", 4, Some(2 << 30))],
            share: Some(12.5),
            token: Some(1),
            books: None,
        };
        let e = spec("gpufrac.dev", &edits(control.clone(), &dir), &c).unwrap_err();
        assert!(
            e.contains("nvidia4") && e.contains("GPU-b") && e.contains("--dev-dir"),
            "{e}"
        );
        std::os::unix::fs::symlink("/dev/null", dir.join("nvidia4")).unwrap();
        let s = spec("gpufrac.dev", &edits(control, &dir), &c).unwrap();
        assert_eq!(
            s["devices"][0]["containerEdits"]["deviceNodes"],
            json!([
                {"path": "/dev/nvidiactl", "hostPath": "/dev/null"},
                {"path": "/dev/nvidia3", "hostPath": "/dev/null"},
                {"path": "/dev/nvidia4", "hostPath": "/dev/null"},
            ])
        );
        let env = env(&s);
        assert!(env.contains(&"GPU_MEM_LIMIT=1G".to_string()), "{env:?}");
        assert!(env.contains(&"GPU_MEM_LIMIT_1=2G".to_string()), "{env:?}");
        assert!(
            env.contains(&"GPU_COMPUTE_SHARE=12.5%".to_string()),
            "{env:?}"
        );
        assert!(
            env.contains(&"CUDA_VISIBLE_DEVICES=GPU-a,GPU-b".to_string()),
            "{env:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn admin_access_has_no_caps_and_no_token() {
        let mut e = edits(vec![], Path::new("/dev"));
        e.mounts.preload_file = Some("/etc/gpufrac/ld.so.preload".into());
        let c = ClaimEdits {
            uid: "u-3",
            gpus: vec![("GPU-a", 0, None)],
            share: None,
            token: None,
            books: None,
        };
        let env = env(&spec("gpufrac.dev", &e, &c).unwrap());
        assert!(
            !env.iter()
                .any(|v| v.starts_with("GPU_") || v.starts_with("GPUFRAC_JOB"))
        );
        assert!(!env.iter().any(|v| v.starts_with("LD_PRELOAD")), "{env:?}");
        assert_eq!(percent(33.333), "33.33%");
        assert_eq!(percent(100.0), "100%");
    }
}
