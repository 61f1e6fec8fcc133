//! gpufrac's two kubelet plugins, each a process of its own with a tokio
//! runtime; nothing here is linked into the shim.
//!
//! `gpufrac k8s-device-plugin` is a kubelet device plugin (API v1beta1)
//! that advertises each GPU as gpufrac slots (`gpufrac.dev/gpu`) or memory
//! units (`gpufrac.dev/gpu-memory`), and answers an allocation with what
//! puts the container under the shim: its memory cap and compute share,
//! the GPU, the shim and the broker's socket. `docs/k8s.md` describes it
//! for operators.
//!
//! `gpufrac k8s-dra-plugin` ([`dra`]) is a DRA kubelet plugin: each GPU's
//! memory and compute are capacity that claims share, and what a claim is
//! given is enforced. `docs/k8s-dra.md` describes it.
//!
//! - [`api`]: the kubelet's device-plugin protocol, generated at build time
//!   from the vendored `proto/api.proto`; [`dra_v1`], [`dra_v1beta1`] and
//!   [`pluginregistration`], the DRA plugin's.
//! - [`devices`]: what is advertised and how allocations are answered
//!   (pure, tested without a kubelet).
//! - [`leases`]: books every allocation with the broker as a lease pinned
//!   to its GPUs, named after its pod from the kubelet's pod-resources API.
//! - `holder`: one lease held with the broker, for both plugins.
//! - `sockets`: the plugins' Unix sockets and gRPC servers.
//! - [`run`]: serves the device plugin's socket, registers with the kubelet
//!   and registers again whenever the kubelet restarts, and polls the GPUs
//!   and the pods.

pub mod api {
    //! The kubelet device-plugin API, v1beta1, as prost and tonic generate
    //! it from `proto/api.proto`.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}
pub mod podresources {
    //! The kubelet's pod-resources API, v1, as prost and tonic generate it
    //! from `proto/podresources.proto`: which pod holds which devices.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}
pub mod dra_v1 {
    //! The kubelet's DRA plugin API, v1 (Kubernetes 1.34 and later), as
    //! prost and tonic generate it from `proto/dra_v1.proto`.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}
pub mod dra_v1beta1 {
    //! The kubelet's DRA plugin API, v1beta1 (Kubernetes 1.32 and 1.33),
    //! from `proto/dra_v1beta1.proto`: its service, whose messages are
    //! [`dra_v1`](crate::dra_v1)'s.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}
pub mod pluginregistration {
    //! The kubelet's plugin registration API, from
    //! `proto/pluginregistration.proto`.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pluginregistration");
}
mod authority;
pub mod devices;
pub mod dra;
mod holder;
pub mod leases;
mod node;
mod service;
mod sockets;

/// The crates the API is spoken with, for the root crate's tests: their
/// stand-in kubelet uses the same types without a dependency line of its
/// own for each.
pub mod reexport {
    pub use tokio;
    pub use tokio_stream;
    pub use tonic;
}

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

pub use devices::{Gpu, Injection, Mounts, Resource};
pub use sockets::connect_unix;

/// The API version this plugin speaks, as it registers.
pub const API_VERSION: &str = "v1beta1";
/// The kubelet's registration socket, in its device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Where the kubelet keeps its device-plugin sockets.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
/// The kubelet's pod-resources socket.
pub const DEFAULT_POD_RESOURCES: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

pub struct Config {
    /// The kubelet's device-plugin directory: kubelet.sock is there, and
    /// the plugin's own socket goes there.
    pub kubelet_dir: PathBuf,
    pub resource: Resource,
    pub inject: Injection,
    /// How often the GPUs are listed again (health).
    pub poll_interval: Duration,
    /// The program that lists the GPUs.
    pub lister: Lister,
    /// Where the kernel module lists GPUs and their minor numbers
    /// (/proc/driver/nvidia/gpus).
    pub proc_gpus: PathBuf,
    /// Booking allocations with the broker; the pod-resources API is
    /// asked every `poll_interval`.
    pub leases: leases::LeaseConfig,
}

/// A program that prints the GPUs, one line each: `gpu INDEX UUID
/// TOTAL_BYTES NAME` (the product name, which may hold spaces, last and
/// optional). Run anew for every look, because the CUDA driver
/// enumerates GPUs once per process: a long-running process would never
/// see one go or come back.
pub struct Lister {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// A lister that hangs (a wedged driver) is killed after this long and
    /// counts as a failure.
    pub timeout: Duration,
}

impl Lister {
    /// Runs the program once.
    pub async fn list(&self) -> Result<Vec<Gpu>, String> {
        use tokio::io::AsyncReadExt;
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.args(&self.args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // A process group of its own: a lister that hangs is ended with
            // everything it started (a shell's children, which also hold
            // its pipes open), not just itself.
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            format!(
                "cannot run {} to list the GPUs: {e}",
                self.program.display()
            )
        })?;
        // Declared after the child, so dropped before it: the group is
        // killed while its leader is not yet reaped, so its number cannot
        // have gone to another group meanwhile.
        let mut group = Group(child.id());
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let collect = async {
            let (o, e, status) = tokio::join!(
                stdout.read_to_end(&mut out),
                stderr.read_to_end(&mut err),
                child.wait()
            );
            o.and(e).and(status)
        };
        let status = tokio::time::timeout(self.timeout, collect)
            .await
            .map_err(|_| {
                format!(
                    "listing the GPUs ({}) did not finish within {:?}",
                    self.program.display(),
                    self.timeout
                )
            })?
            .map_err(|e| format!("reading what {} printed: {e}", self.program.display()))?;
        // Done, its pipes closed: whatever is left of the group is no
        // lister's business.
        group.0 = None;
        if !status.success() {
            return Err(format!(
                "listing the GPUs failed ({status}): {}",
                String::from_utf8_lossy(&err).trim()
            ));
        }
        parse_gpu_lines(&String::from_utf8_lossy(&out))
    }
}

/// The process group of a lister still running: killed, all of it, when
/// the look ends without it (a timeout, or the look itself dropped).
struct Group(Option<u32>);

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pgid) = self.0.and_then(|p| libc::pid_t::try_from(p).ok()) {
            // SAFETY: a plain system call; the group is the lister's own
            // (process_group(0) made its leader's pid the group's id).
            unsafe { libc::killpg(pgid, libc::SIGKILL) };
        }
    }
}

/// One `gpu INDEX UUID TOTAL_BYTES NAME` line per GPU.
pub fn format_gpu_line(g: &Gpu) -> String {
    // A line break in a name would end the line.
    let name: String = g.name.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("gpu {} {} {} {name}\n", g.index, g.uuid, g.total_mem).replace(" \n", "\n")
}

pub fn parse_gpu_lines(text: &str) -> Result<Vec<Gpu>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            parse_gpu_line(l).ok_or_else(|| {
                format!("the GPU lister printed {l:?}; expected `gpu INDEX UUID TOTAL_BYTES NAME`")
            })
        })
        .collect()
}

fn parse_gpu_line(l: &str) -> Option<Gpu> {
    match l.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["gpu", index, uuid, total, name @ ..] => Some(Gpu {
            index: index.parse().ok()?,
            uuid: uuid.to_string(),
            total_mem: total.parse().ok()?,
            name: name.join(" "),
        }),
        _ => None,
    }
}

/// Runs the plugin until SIGTERM or SIGINT.
pub fn run(cfg: Config) -> Result<(), String> {
    block_on(node::serve(cfg))
}

/// Runs a plugin on one thread. That is plenty: the kubelet calls rarely,
/// every answer is computed in microseconds, and the API server, the
/// broker and the GPU lister (a child process) are awaited.
fn block_on(plugin: impl Future<Output = Result<(), String>>) -> Result<(), String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?
        .block_on(plugin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_lines_round_trip() {
        let mut g = Gpu {
            index: 1,
            uuid: "GPU-5a1e6f7a-c0de-4000-8000-000000000001".into(),
            total_mem: 8 << 30,
            name: "NVIDIA H100 80GB HBM3".into(),
        };
        assert_eq!(parse_gpu_lines(&format_gpu_line(&g)).unwrap(), [g.clone()]);
        // A lister of an earlier release printed no name.
        g.name.clear();
        assert_eq!(
            format_gpu_line(&g),
            format!("gpu 1 {} {}\n", g.uuid, 8u64 << 30)
        );
        assert_eq!(parse_gpu_lines(&format_gpu_line(&g)).unwrap(), [g]);
        assert_eq!(parse_gpu_lines("").unwrap(), []);
        let e = parse_gpu_lines("gpu x y\n").unwrap_err();
        assert!(
            e.contains("\"gpu x y\"") && e.contains("gpu INDEX UUID TOTAL_BYTES NAME"),
            "{e}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn lister_failures_say_what_happened() {
        let sh = |script: &str| Lister {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            timeout: Duration::from_secs(5),
        };
        let gpus = sh("echo gpu 0 GPU-a 1024").list().await.unwrap();
        assert_eq!(gpus[0].uuid, "GPU-a");
        let e = sh("echo no driver >&2; exit 3").list().await.unwrap_err();
        assert!(
            e.contains("no driver") && e.contains("exit status: 3"),
            "{e}"
        );
        let mut slow = sh("sleep 30");
        slow.timeout = Duration::from_millis(50);
        let e = slow.list().await.unwrap_err();
        assert!(e.contains("did not finish within"), "{e}");
    }

    /// A lister that hangs in a child of its own (a shell waiting on a
    /// wedged driver call) is ended with that child, not only itself.
    #[tokio::test(flavor = "current_thread")]
    async fn a_lister_that_hangs_is_ended_with_its_children() {
        let dir = std::env::temp_dir().join(format!("gpufrac-lister-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("pid");
        let script = format!("sleep 30 & echo $! > {}; wait", pidfile.display());
        let lister = Lister {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            // Long enough for the shell to start and say its child's pid on a
            // loaded machine.
            timeout: Duration::from_secs(2),
        };
        let e = lister.list().await.unwrap_err();
        assert!(e.contains("did not finish within"), "{e}");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed, it is reaped by whoever adopted it; a zombie that is
        // not reaped yet is dead too.
        let gone = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !gone() {
            assert!(
                std::time::Instant::now() < deadline,
                "the lister's child {pid} (sleep 30) outlived the lister"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
