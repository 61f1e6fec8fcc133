//! `gpufrac cdi generate`: a Container Device Interface spec that puts
//! containers started by Podman (or Docker ≥ 25) under gpufrac.
//!
//! The spec has kind `gpufrac.dev/gpu`, one device per GPU index and `all`.
//! Asking for any of them injects the shim (read-only, preloaded), the broker
//! socket's directory, the driver's control device nodes and its user-space
//! libraries; each device adds its own `/dev/nvidiaN`.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use gpufrac_broker::gpus::{self, GpuInfo};
use gpufrac_common::config::VAR_SOCKET;
use gpufrac_common::minors::{self, PROC_GPUS};
use gpufrac_common::wire::uuid_string;
use serde_json::{Value, json};

use crate::docker::{InjectArgs, absolute};
use crate::inject::{CONTAINER_LIB, CONTAINER_SOCKET_DIR};

pub const KIND: &str = "gpufrac.dev/gpu";
/// The oldest version with everything used here: device names that start
/// with a digit and `hostPath` on device nodes (both 0.5.0). Podman 4.3
/// reads up to 0.5.0; every later runtime reads it too.
const CDI_VERSION: &str = "0.5.0";

/// Driver libraries a CUDA program (and NVML, for nvidia-smi and the
/// shim's view of memory) may load, as the ld cache names them: the prefix
/// up to the soname's version. `libnvidia-gpucomp.so.<driver version>` is
/// why these are prefixes.
const DRIVER_LIBS: &[&str] = &[
    "libcuda.so.",
    "libcudadebugger.so.",
    "libnvidia-ml.so.",
    "libnvidia-ptxjitcompiler.so.",
    "libnvidia-nvvm.so.",
    "libnvidia-gpucomp.so.",
    "libnvidia-cfg.so.",
    "libnvidia-opencl.so.",
];
/// Without this one nothing in the container reaches a GPU.
const REQUIRED_LIB: &str = "libcuda.so.1";
/// Driver programs mounted where containers look for them, when the host has
/// them.
const DRIVER_BINS: &[&str] = &["nvidia-smi"];
/// Device nodes every GPU needs, besides its own `nvidiaN`.
const REQUIRED_NODES: &[&str] = &["nvidiactl"];
/// Nodes passed when the host has them: unified memory (which CUDA needs;
/// the driver creates it on first use), its tools node and modeset.
const OPTIONAL_NODES: &[&str] = &["nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

const GENERATE_EXAMPLES: &str = "\
Examples:
  gpufrac cdi generate --output /etc/cdi/gpufrac.json
  podman run --device gpufrac.dev/gpu=0 -e GPU_MEM_LIMIT=8G IMAGE
  docker run --device gpufrac.dev/gpu=all -e GPU_MEM_LIMIT=25% IMAGE   (Docker ≥ 25, CDI enabled)

Without --output the spec goes to stdout, as nvidia-ctk cdi generate does.
Runtimes read /etc/cdi and /var/run/cdi; a spec in /var/run/cdi wins over one
of the same kind in /etc/cdi. Regenerate it when GPUs, the driver or the
broker socket change.

GPUs are numbered as nvidia-smi numbers them (PCI bus order), the numbering
of `gpufrac run` and `docker run --gpus device=N`. Driver libraries are the
ones the host's ld cache lists (ldconfig -p); each is mounted read-only under
its soname in the same directory inside the container (with Debian and Ubuntu
images, a directory the loader searches anyway). --driver-lib and
--container-lib-dir override both for unusual installs.

Memory caps and shares come from the container's environment
(-e GPU_MEM_LIMIT=8G, -e GPU_COMPUTE_SHARE=30%); the spec sets LD_PRELOAD and
GPUFRAC_SOCKET itself, replacing any -e of the same name.";

#[derive(Args, Debug)]
pub struct CdiArgs {
    #[command(subcommand)]
    pub cmd: CdiCmd,
}

#[derive(Subcommand, Debug)]
pub enum CdiCmd {
    /// Write a CDI spec of kind gpufrac.dev/gpu.
    Generate(GenerateArgs),
}

#[derive(Args, Debug)]
#[command(after_help = GENERATE_EXAMPLES)]
pub struct GenerateArgs {
    /// Write the spec to PATH (a .json or .yaml name, the only ones runtimes
    /// read; the text is JSON, which YAML readers accept) [default: stdout]
    #[arg(long, short = 'o', value_name = "PATH")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub inject: InjectArgs,
    /// A driver library to inject, instead of those the host's ld cache
    /// lists; repeat for each (e.g. --driver-lib /opt/nvidia/libcuda.so.1).
    #[arg(long = "driver-lib", value_name = "PATH")]
    pub driver_libs: Vec<PathBuf>,
    /// Directory in which driver libraries appear inside containers
    /// [default: the directory they are in on the host]
    #[arg(long, value_name = "DIR")]
    pub container_lib_dir: Option<PathBuf>,
    /// Directory holding the NVIDIA device nodes (or links to them) on the
    /// host; they appear under /dev in the container.
    #[arg(long, value_name = "DIR", default_value = "/dev")]
    pub dev_dir: PathBuf,
}

pub fn main(args: CdiArgs) -> u8 {
    match args.cmd {
        CdiCmd::Generate(g) => {
            let mut warnings = Vec::new();
            let result = generate(&g, &mut warnings);
            // Said even when generation fails: they may explain why.
            for w in warnings {
                eprintln!("gpufrac cdi generate: warning: {w}");
            }
            match result {
                Ok(()) => 0,
                Err(m) => {
                    eprintln!("gpufrac cdi generate: {m}");
                    1
                }
            }
        }
    }
}

/// A bind mount: a host file or directory at a path in the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mount {
    pub(crate) host: PathBuf,
    pub(crate) container: PathBuf,
}

/// A device node: its name under /dev in the container and the node on
/// the host (links resolved: runtimes take the node's numbers from it and
/// refuse a link).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    name: String,
    host: PathBuf,
}

/// A GPU by index and its node.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GpuNode {
    index: u32,
    node: Node,
}

/// Everything the spec says, found beforehand.
#[derive(Debug)]
struct Inputs {
    gpus: Vec<GpuNode>,
    /// Nodes that every device needs.
    control_nodes: Vec<Node>,
    lib: PathBuf,
    socket: PathBuf,
    preload_file: Option<PathBuf>,
    /// Driver libraries and programs.
    driver: Vec<Mount>,
}

fn generate(args: &GenerateArgs, warnings: &mut Vec<String>) -> Result<(), String> {
    if let Some(out) = &args.output {
        check_output_name(out)?;
    }
    let gpus = list_gpus()?;
    let inputs = gather(args, &gpus, &read_minors(warnings), warnings)?;
    let text =
        serde_json::to_string_pretty(&spec(&inputs)).expect("a JSON value always prints") + "\n";
    match &args.output {
        Some(path) => write_atomically(path, &text)?,
        None => crate::print_stdout(&text)?,
    }
    Ok(())
}

/// The GPUs as the CUDA driver lists them, in PCI bus order.
fn list_gpus() -> Result<Vec<GpuInfo>, String> {
    // SAFETY: nothing else runs yet (no thread has been started), so no
    // one reads the environment while it changes. The order is the one
    // `gpufrac run` gives its children and nvidia-smi shows; a
    // CUDA_VISIBLE_DEVICES of our own would hide GPUs from the spec.
    unsafe { gpus::use_pci_order(true) };
    let gpus = gpus::discover().map_err(|e| {
        format!(
            "cannot list the GPUs: {e}; run this on the GPU host, with the NVIDIA driver loaded"
        )
    })?;
    if gpus.is_empty() {
        return Err("the CUDA driver reports no GPUs; there is nothing to write a spec for".into());
    }
    Ok(gpus)
}

/// GPU UUID (lower case) → device minor number, from the kernel module.
fn read_minors(warnings: &mut Vec<String>) -> BTreeMap<String, u32> {
    minors::read_minors(Path::new(PROC_GPUS)).unwrap_or_else(|e| {
        warnings.push(format!(
            "cannot read {PROC_GPUS} ({e}): assuming GPU N is /dev/nvidiaN"
        ));
        BTreeMap::new()
    })
}

/// Checks what the spec will name and finds the rest: nothing is written
/// unless everything is there.
fn gather(
    args: &GenerateArgs,
    gpus: &[GpuInfo],
    minors: &BTreeMap<String, u32>,
    warnings: &mut Vec<String>,
) -> Result<Inputs, String> {
    let (lib, socket) = args.inject.lib_and_socket()?;
    let socket_dir = socket.parent().unwrap_or(Path::new("/"));
    if !socket_dir.is_dir() {
        warnings.push(format!(
            "the broker socket's directory {} does not exist yet: containers that ask for a \
             gpufrac.dev/gpu device will not start until the broker has created it",
            socket_dir.display()
        ));
    }

    let dev_dir = absolute(&args.dev_dir)?;
    let mut missing_minor = Vec::new();
    let mut nodes = Vec::new();
    for g in gpus {
        let uuid = uuid_string(&g.uuid);
        let minor = match minors.get(&uuid.to_ascii_lowercase()) {
            Some(&m) => m,
            None => {
                missing_minor.push(g.index.to_string());
                g.index
            }
        };
        let name = format!("nvidia{minor}");
        let host = char_device(&dev_dir.join(&name), &format!("GPU {} ({uuid})", g.index))?;
        nodes.push(GpuNode {
            index: g.index,
            node: Node { name, host },
        });
    }
    if !missing_minor.is_empty() && !minors.is_empty() {
        warnings.push(format!(
            "{PROC_GPUS} does not list GPU {}: assuming its node is nvidia<index>",
            missing_minor.join(", ")
        ));
    }
    let mut control_nodes = Vec::new();
    for name in REQUIRED_NODES {
        let host = char_device(&dev_dir.join(name), "the NVIDIA driver")?;
        control_nodes.push(Node {
            name: name.to_string(),
            host,
        });
    }
    for name in OPTIONAL_NODES {
        let p = dev_dir.join(name);
        if p.exists() {
            let host = char_device(&p, "the NVIDIA driver")?;
            control_nodes.push(Node {
                name: name.to_string(),
                host,
            });
        } else if *name == "nvidia-uvm" {
            warnings.push(format!(
                "{} does not exist, and CUDA needs it: load the nvidia-uvm module \
                 (nvidia-modprobe -u -c=0) and generate the spec again",
                p.display()
            ));
        }
    }

    let mut driver = match args.driver_libs.as_slice() {
        [] => libs_from_ld_cache(&ld_cache()?, args.container_lib_dir.as_deref())?,
        given => libs_given(given, args.container_lib_dir.as_deref())?,
    };
    driver.extend(driver_binaries());

    // Written only once everything else checks out.
    let preload_file = args.inject.write_preload_file()?;
    let inputs = Inputs {
        gpus: nodes,
        control_nodes,
        lib,
        socket,
        preload_file,
        driver,
    };
    let mut paths = vec![&inputs.lib, &inputs.socket];
    paths.extend(inputs.gpus.iter().map(|g| &g.node.host));
    paths.extend(inputs.control_nodes.iter().map(|n| &n.host));
    paths.extend(&inputs.preload_file);
    paths.extend(inputs.driver.iter().flat_map(|m| [&m.host, &m.container]));
    if let Some(bad) = paths.iter().find(|p| p.to_str().is_none()) {
        return Err(format!(
            "{}: the path is not UTF-8, and a CDI spec is JSON text; use a path without such bytes",
            bad.display()
        ));
    }
    Ok(inputs)
}

/// The character device at `path`, links resolved.
fn char_device(path: &Path, whose: &str) -> Result<PathBuf, String> {
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_char_device() => path
            .canonicalize()
            .map_err(|e| format!("{}: {e}", path.display())),
        Ok(_) => Err(format!(
            "{} is not a character device, so it cannot be {whose}'s device node; \
             point --dev-dir at the directory holding the NVIDIA device nodes",
            path.display()
        )),
        Err(e) => Err(format!(
            "{}: {e}: {whose} has no device node there; load the NVIDIA driver (nvidia-smi \
             creates the nodes) or point --dev-dir at the directory that holds them",
            path.display()
        )),
    }
}

/// `ldconfig -p`: the host's ld cache, as the loader sees it.
pub(crate) fn ld_cache() -> Result<String, String> {
    // Non-root users often lack /sbin on PATH.
    let mut last = String::new();
    for exe in ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"] {
        match std::process::Command::new(exe).arg("-p").output() {
            Ok(o) if o.status.success() => return Ok(String::from_utf8_lossy(&o.stdout).into()),
            Ok(o) => {
                last = format!(
                    "{exe} -p failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )
            }
            Err(e) => last = format!("{exe}: {e}"),
        }
    }
    Err(format!(
        "cannot read the ld cache to find the driver libraries ({last}); name them with --driver-lib"
    ))
}

/// The native-architecture driver libraries of an `ldconfig -p` listing,
/// first entry of each name (the one the loader would take).
pub(crate) fn libs_from_ld_cache(
    listing: &str,
    container_dir: Option<&Path>,
) -> Result<Vec<Mount>, String> {
    let arch = if cfg!(target_arch = "aarch64") {
        "AArch64"
    } else {
        "x86-64"
    };
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for line in listing.lines() {
        // "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"
        let Some((left, path)) = line.trim().split_once(" => ") else {
            continue;
        };
        let Some((name, flags)) = left.split_once(' ') else {
            continue;
        };
        let native = flags
            .trim_matches(|c| c == '(' || c == ')')
            .split(',')
            .any(|f| f.trim() == arch);
        if !native || !DRIVER_LIBS.iter().any(|p| name.starts_with(p)) || !seen.insert(name) {
            continue;
        }
        out.push(lib_mount(Path::new(path), name, container_dir)?);
    }
    if !seen.contains(REQUIRED_LIB) {
        return Err(format!(
            "{REQUIRED_LIB} is not in the host's ld cache (ldconfig -p): install the NVIDIA \
             driver, run ldconfig, or name the libraries with --driver-lib"
        ));
    }
    Ok(out)
}

pub(crate) fn libs_given(
    given: &[PathBuf],
    container_dir: Option<&Path>,
) -> Result<Vec<Mount>, String> {
    let mut out: Vec<Mount> = Vec::new();
    for p in given {
        // Named as given: the link's name (libcuda.so.1) is the soname, the
        // file it points to is not.
        let p = if p.is_absolute() {
            p.clone()
        } else {
            std::env::current_dir()
                .map_err(|e| format!("cannot make {} absolute: {e}", p.display()))?
                .join(p)
        };
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("--driver-lib {}: not a file name", p.display()))?;
        let m = lib_mount(&p, name, container_dir)?;
        if out.iter().any(|o| o.container == m.container) {
            return Err(format!(
                "--driver-lib {}: another library already goes to {} in the container",
                p.display(),
                m.container.display()
            ));
        }
        out.push(m);
    }
    if !out.iter().any(|m| m.container.ends_with(REQUIRED_LIB)) {
        return Err(format!(
            "--driver-lib: none of the libraries is named {REQUIRED_LIB}, which every CUDA \
             program loads; add --driver-lib /path/to/{REQUIRED_LIB}"
        ));
    }
    Ok(out)
}

/// The library's file (symlinks followed: the host's soname is usually a
/// link) mounted under `name` in `container_dir`, else in its own directory.
fn lib_mount(path: &Path, name: &str, container_dir: Option<&Path>) -> Result<Mount, String> {
    let host = path
        .canonicalize()
        .map_err(|e| format!("driver library {}: {e}", path.display()))?;
    if !host.is_file() {
        return Err(format!("driver library {}: not a file", path.display()));
    }
    let dir = container_dir
        .or_else(|| path.parent())
        .unwrap_or(Path::new("/usr/lib"));
    Ok(Mount {
        host,
        container: dir.join(name),
    })
}

/// nvidia-smi and friends from the host's PATH, at /usr/bin in the container.
pub(crate) fn driver_binaries() -> Vec<Mount> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.push(PathBuf::from("/usr/bin"));
    DRIVER_BINS
        .iter()
        .filter_map(|name| {
            let host = dirs
                .iter()
                .map(|d| d.join(name))
                .find(|p| p.is_absolute() && p.is_file())?;
            Some(Mount {
                host: host.canonicalize().unwrap_or(host),
                container: Path::new("/usr/bin").join(name),
            })
        })
        .collect()
}

/// The spec itself.
fn spec(i: &Inputs) -> Value {
    let node = |n: &Node| {
        let path = format!("/dev/{}", n.name);
        // Left out, type, major and minor are read from the host node when
        // the container starts: nvidia-uvm's major number changes across
        // module reloads.
        if n.host == Path::new(&path) {
            json!({ "path": path })
        } else {
            json!({ "path": path, "hostPath": n.host })
        }
    };
    let mut devices: Vec<Value> = i
        .gpus
        .iter()
        .map(|g| {
            json!({
                "name": g.index.to_string(),
                "containerEdits": { "deviceNodes": [node(&g.node)] },
            })
        })
        .collect();
    devices.push(json!({
        "name": "all",
        "containerEdits": {
            "deviceNodes": i.gpus.iter().map(|g| node(&g.node)).collect::<Vec<_>>(),
        },
    }));

    let socket_dir = i.socket.parent().unwrap_or(Path::new("/"));
    let socket_name = i
        .socket
        .file_name()
        .map_or_else(|| "broker.sock".into(), |n| n.to_string_lossy());
    let mut env = vec![format!("{VAR_SOCKET}={CONTAINER_SOCKET_DIR}/{socket_name}")];
    let ro = json!(["ro", "nosuid", "nodev", "bind"]);
    let mut mounts = vec![
        json!({ "hostPath": i.lib, "containerPath": CONTAINER_LIB, "options": ro }),
        // The directory rather than the socket: the mount keeps working
        // after the broker restarts and makes a new socket.
        json!({
            "hostPath": socket_dir,
            "containerPath": CONTAINER_SOCKET_DIR,
            "options": ["rbind", "nosuid", "nodev", "noexec"],
        }),
    ];
    match &i.preload_file {
        Some(f) => mounts
            .push(json!({ "hostPath": f, "containerPath": "/etc/ld.so.preload", "options": ro })),
        None => env.insert(0, format!("LD_PRELOAD={CONTAINER_LIB}")),
    }
    for m in &i.driver {
        mounts.push(json!({ "hostPath": m.host, "containerPath": m.container, "options": ro }));
    }
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {
            "env": env,
            "deviceNodes": i.control_nodes.iter().map(node).collect::<Vec<_>>(),
            "mounts": mounts,
        },
    })
}

fn check_output_name(path: &Path) -> Result<(), String> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json" | "yaml") => Ok(()),
        _ => Err(format!(
            "--output {}: container runtimes read only spec files whose names end in .json \
             or .yaml; use e.g. /etc/cdi/gpufrac.json",
            path.display()
        )),
    }
}

/// Writes beside the target and renames, so a runtime reading the CDI
/// directory meanwhile never sees half a spec; the temporary name ends in
/// neither .json nor .yaml, so no runtime reads it either.
fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| {
        format!(
            "--output {}: cannot create {}: {e}",
            path.display(),
            dir.display()
        )
    })?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("--output {}: cannot write it: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        g: GenerateArgs,
    }

    fn parse(args: &[&str]) -> GenerateArgs {
        T::try_parse_from(std::iter::once("generate").chain(args.iter().copied()))
            .unwrap()
            .g
    }

    fn node(name: &str, dev_dir: &str) -> Node {
        Node {
            name: name.into(),
            host: Path::new(dev_dir).join(name),
        }
    }

    fn inputs(dev_dir: &str, preload: Option<&str>) -> Inputs {
        Inputs {
            gpus: vec![
                GpuNode {
                    index: 0,
                    node: node("nvidia0", dev_dir),
                },
                GpuNode {
                    index: 1,
                    node: node("nvidia3", dev_dir),
                },
            ],
            control_nodes: vec![node("nvidiactl", dev_dir), node("nvidia-uvm", dev_dir)],
            lib: "/opt/gpufrac/lib/libgpufrac.so".into(),
            socket: "/run/gpufrac/broker.sock".into(),
            preload_file: preload.map(PathBuf::from),
            driver: vec![Mount {
                host: "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06".into(),
                container: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
            }],
        }
    }

    fn strings(v: &Value) -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    }

    fn node_paths(edits: &Value) -> Vec<String> {
        edits["deviceNodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["path"].as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn spec_has_a_device_per_gpu_and_all() {
        let s = spec(&inputs("/dev", None));
        assert_eq!(s["cdiVersion"], "0.5.0");
        assert_eq!(s["kind"], "gpufrac.dev/gpu");
        let devices = s["devices"].as_array().unwrap();
        let names: Vec<&str> = devices
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["0", "1", "all"]);
        // GPU 1's node is the one its minor number names, not nvidia1.
        assert_eq!(node_paths(&devices[0]["containerEdits"]), ["/dev/nvidia0"]);
        assert_eq!(node_paths(&devices[1]["containerEdits"]), ["/dev/nvidia3"]);
        assert_eq!(
            node_paths(&devices[2]["containerEdits"]),
            ["/dev/nvidia0", "/dev/nvidia3"]
        );
        // On /dev itself no hostPath: runtimes default it to the path.
        assert!(
            devices[0]["containerEdits"]["deviceNodes"][0]
                .get("hostPath")
                .is_none()
        );
    }

    #[test]
    fn common_edits_inject_the_shim_the_socket_and_the_driver() {
        let s = spec(&inputs("/dev", None));
        let e = &s["containerEdits"];
        assert_eq!(
            strings(&e["env"]),
            [
                "LD_PRELOAD=/usr/lib/gpufrac/libgpufrac.so",
                "GPUFRAC_SOCKET=/run/gpufrac/broker.sock"
            ]
        );
        assert_eq!(node_paths(e), ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
        let mounts = e["mounts"].as_array().unwrap();
        let pairs: Vec<(&str, &str)> = mounts
            .iter()
            .map(|m| {
                (
                    m["hostPath"].as_str().unwrap(),
                    m["containerPath"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            pairs,
            [
                (
                    "/opt/gpufrac/lib/libgpufrac.so",
                    "/usr/lib/gpufrac/libgpufrac.so"
                ),
                ("/run/gpufrac", "/run/gpufrac"),
                (
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
                ),
            ]
        );
        // The shim and the driver cannot be replaced from inside; the
        // socket directory must stay writable (connect, MPS pipes).
        assert!(strings(&mounts[0]["options"]).contains(&"ro".into()));
        assert!(!strings(&mounts[1]["options"]).contains(&"ro".into()));
        assert!(strings(&mounts[2]["options"]).contains(&"ro".into()));
        // Runtimes reject a spec with fields they do not know.
        let keys: Vec<&String> = s.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["cdiVersion", "containerEdits", "devices", "kind"]);
    }

    #[test]
    fn another_device_directory_is_the_host_path() {
        let s = spec(&inputs("/tmp/nodes", None));
        let n = &s["devices"][1]["containerEdits"]["deviceNodes"][0];
        assert_eq!(n["path"], "/dev/nvidia3");
        assert_eq!(n["hostPath"], "/tmp/nodes/nvidia3");
        let c = &s["containerEdits"]["deviceNodes"][0];
        assert_eq!(c["hostPath"], "/tmp/nodes/nvidiactl");
    }

    #[test]
    fn preload_file_replaces_ld_preload() {
        let s = spec(&inputs("/dev", Some("/etc/gpufrac/ld.so.preload")));
        let e = &s["containerEdits"];
        assert_eq!(
            strings(&e["env"]),
            ["GPUFRAC_SOCKET=/run/gpufrac/broker.sock"]
        );
        assert!(
            e["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["hostPath"] == "/etc/gpufrac/ld.so.preload"
                    && m["containerPath"] == "/etc/ld.so.preload"
                    && strings(&m["options"]).contains(&"ro".into()))
        );
    }

    #[test]
    fn socket_elsewhere() {
        let mut i = inputs("/dev", None);
        i.socket = "/var/lib/gf/my.sock".into();
        let s = spec(&i);
        let e = &s["containerEdits"];
        assert!(strings(&e["env"]).contains(&"GPUFRAC_SOCKET=/run/gpufrac/my.sock".into()));
        assert_eq!(e["mounts"][1]["hostPath"], "/var/lib/gf");
    }

    const LISTING: &str = "\
1234 libs found in cache `/etc/ld.so.cache'
\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1
\tlibnvidia-ml.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libnvidia-ml.so.1
\tlibnvidia-ml.so.1 (libc6) => /lib/i386-linux-gnu/libnvidia-ml.so.1
\tlibnvidia-gpucomp.so.580.65.06 (libc6,x86-64) => /lib/x86_64-linux-gnu/libnvidia-gpucomp.so.580.65.06
\tlibcuda.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so.1 (libc6,x86-64) => /usr/local/cuda/compat/libcuda.so.1
\tlibcuda.so.1 (libc6) => /lib/i386-linux-gnu/libcuda.so.1
\tlibcuda.so (libc6,x86-64) => /lib/x86_64-linux-gnu/libcuda.so
\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
Cache generated by: ldconfig (GNU libc) stable release version 2.36
";

    /// The listing with its paths moved under `root`, where real files are.
    fn listing_under(root: &Path) -> String {
        for f in [
            "lib/x86_64-linux-gnu/libz.so.1",
            "lib/x86_64-linux-gnu/libnvidia-ml.so.580.65.06",
            "lib/x86_64-linux-gnu/libnvidia-gpucomp.so.580.65.06",
            "lib/x86_64-linux-gnu/libcuda.so.580.65.06",
            "lib/x86_64-linux-gnu/libcuda.so",
            "lib/i386-linux-gnu/libcuda.so.1",
            "lib/i386-linux-gnu/libnvidia-ml.so.1",
            "usr/local/cuda/compat/libcuda.so.1",
            "usr/local/cuda/lib64/libcudart.so.12",
        ] {
            let p = root.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"").unwrap();
        }
        let d = root.join("lib/x86_64-linux-gnu");
        std::os::unix::fs::symlink("libcuda.so.580.65.06", d.join("libcuda.so.1")).unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.580.65.06", d.join("libnvidia-ml.so.1"))
            .unwrap();
        LISTING.replace(" => /", &format!(" => {}/", root.display()))
    }

    fn scratch(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("gpufrac-cdi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn driver_libraries_from_the_ld_cache() {
        let root = scratch("ldcache");
        let listing = listing_under(&root);
        let d = root.join("lib/x86_64-linux-gnu");
        let got = libs_from_ld_cache(&listing, None).unwrap();
        assert_eq!(
            got,
            [
                Mount {
                    host: d.join("libnvidia-ml.so.580.65.06"),
                    container: d.join("libnvidia-ml.so.1"),
                },
                Mount {
                    host: d.join("libnvidia-gpucomp.so.580.65.06"),
                    container: d.join("libnvidia-gpucomp.so.580.65.06"),
                },
                // The first libcuda.so.1, as the loader would pick; not the
                // compat one, the 32-bit one or the unversioned dev link.
                Mount {
                    host: d.join("libcuda.so.580.65.06"),
                    container: d.join("libcuda.so.1"),
                },
            ]
        );
        let elsewhere = libs_from_ld_cache(&listing, Some(Path::new("/usr/lib64"))).unwrap();
        assert_eq!(elsewhere[2].container, Path::new("/usr/lib64/libcuda.so.1"));

        let no_cuda: String = listing
            .lines()
            .filter(|l| !l.contains("libcuda.so.1"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = libs_from_ld_cache(&no_cuda, None).unwrap_err();
        assert!(
            e.contains("libcuda.so.1") && e.contains("--driver-lib"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn driver_libraries_given() {
        let root = scratch("given");
        let _ = listing_under(&root);
        let d = root.join("lib/x86_64-linux-gnu");
        let got = libs_given(
            &[d.join("libcuda.so.1"), d.join("libnvidia-ml.so.1")],
            Some(Path::new("/usr/lib/x86_64-linux-gnu")),
        )
        .unwrap();
        assert_eq!(got[0].host, d.join("libcuda.so.580.65.06"));
        assert_eq!(
            got[0].container,
            Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
        );
        assert_eq!(
            got[1].container,
            Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
        );

        let e = libs_given(&[d.join("libnvidia-ml.so.1")], None).unwrap_err();
        assert!(
            e.contains("none of the libraries is named libcuda.so.1"),
            "{e}"
        );
        let e = libs_given(&[d.join("libcuda.so.7")], None).unwrap_err();
        assert!(
            e.contains("libcuda.so.7") && e.contains("No such file"),
            "{e}"
        );
        let e = libs_given(
            &[
                d.join("libcuda.so.1"),
                root.join("usr/local/cuda/compat/libcuda.so.1"),
            ],
            None,
        );
        assert!(e.is_ok(), "different directories: {e:?}");
        let e = libs_given(
            &[
                d.join("libcuda.so.1"),
                root.join("usr/local/cuda/compat/libcuda.so.1"),
            ],
            Some(Path::new("/usr/lib")),
        )
        .unwrap_err();
        assert!(e.contains("already goes to /usr/lib/libcuda.so.1"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }

    fn gpu(index: u32, b: u8) -> GpuInfo {
        GpuInfo {
            index,
            uuid: [b; 16],
            name: "Test GPU".into(),
            total_mem: 1 << 30,
        }
    }

    #[test]
    fn missing_device_nodes_are_named() {
        let dir = scratch("nodes");
        let lib = dir.join("libgpufrac.so");
        std::fs::write(&lib, b"").unwrap();
        let cuda = dir.join("libcuda.so.1");
        std::fs::write(&cuda, b"").unwrap();
        let base = [
            "--lib",
            lib.to_str().unwrap(),
            "--driver-lib",
            cuda.to_str().unwrap(),
            "--dev-dir",
            dir.to_str().unwrap(),
        ];
        let args = parse(&base);
        let mut w = Vec::new();
        let e = gather(&args, &[gpu(0, 0xab)], &BTreeMap::new(), &mut w).unwrap_err();
        assert!(
            e.contains(&format!("{}/nvidia0", dir.display()))
                && e.contains("GPU 0 (GPU-abababab-")
                && e.contains("--dev-dir"),
            "{e}"
        );
        // A regular file where the node should be.
        std::fs::write(dir.join("nvidia0"), b"").unwrap();
        let e = gather(&args, &[gpu(0, 0xab)], &BTreeMap::new(), &mut w).unwrap_err();
        assert!(e.contains("is not a character device"), "{e}");
        // The minor number decides which node is GPU 0's.
        let minors = BTreeMap::from([(uuid_string(&[0xab; 16]).to_ascii_lowercase(), 7)]);
        let e = gather(&args, &[gpu(0, 0xab)], &minors, &mut w).unwrap_err();
        assert!(e.contains(&format!("{}/nvidia7", dir.display())), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn gather_with_real_nodes() {
        // /dev/null stands in for the NVIDIA nodes: any character device
        // will do for the checks.
        let dir = scratch("gather");
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            std::os::unix::fs::symlink("/dev/null", dir.join(n)).unwrap();
        }
        let lib = dir.join("libgpufrac.so");
        std::fs::write(&lib, b"").unwrap();
        let cuda = dir.join("libcuda.so.1");
        std::fs::write(&cuda, b"").unwrap();
        let preload = dir.join("preload");
        let args = parse(&[
            "--lib",
            lib.to_str().unwrap(),
            "--driver-lib",
            cuda.to_str().unwrap(),
            "--dev-dir",
            dir.to_str().unwrap(),
            "--socket",
            dir.join("b.sock").to_str().unwrap(),
            "--preload-file",
            preload.to_str().unwrap(),
        ]);
        let mut w = Vec::new();
        let i = gather(&args, &[gpu(0, 1), gpu(1, 2)], &BTreeMap::new(), &mut w).unwrap();
        // Links are resolved: runtimes read the node's numbers from hostPath
        // and refuse a link.
        let null = |name: &str| Node {
            name: name.into(),
            host: "/dev/null".into(),
        };
        assert_eq!(
            i.gpus,
            [
                GpuNode {
                    index: 0,
                    node: null("nvidia0")
                },
                GpuNode {
                    index: 1,
                    node: null("nvidia1")
                }
            ]
        );
        assert_eq!(i.control_nodes, [null("nvidiactl"), null("nvidia-uvm")]);
        let s = spec(&i);
        assert_eq!(
            s["devices"][1]["containerEdits"]["deviceNodes"][0],
            json!({ "path": "/dev/nvidia1", "hostPath": "/dev/null" })
        );
        assert_eq!(i.socket, dir.join("b.sock"));
        assert_eq!(
            std::fs::read_to_string(&preload).unwrap(),
            "/usr/lib/gpufrac/libgpufrac.so\n"
        );
        assert!(w.is_empty(), "{w:?}");

        // Without nvidia-uvm the spec is still written, with a warning.
        std::fs::remove_file(dir.join("nvidia-uvm")).unwrap();
        let i = gather(&args, &[gpu(0, 1)], &BTreeMap::new(), &mut w).unwrap();
        assert_eq!(i.control_nodes, [null("nvidiactl")]);
        assert!(w.iter().any(|m| m.contains("nvidia-uvm")), "{w:?}");
        // Without nvidiactl nothing works: an error.
        std::fs::remove_file(dir.join("nvidiactl")).unwrap();
        let e = gather(&args, &[gpu(0, 1)], &BTreeMap::new(), &mut w).unwrap_err();
        assert!(e.contains("nvidiactl"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn output_names_and_writing() {
        assert!(check_output_name(Path::new("/etc/cdi/gpufrac.json")).is_ok());
        assert!(check_output_name(Path::new("/etc/cdi/gpufrac.yaml")).is_ok());
        let e = check_output_name(Path::new("/etc/cdi/gpufrac.yml")).unwrap_err();
        assert!(
            e.contains(".json or .yaml") && e.contains("/etc/cdi/gpufrac.json"),
            "{e}"
        );
        assert!(check_output_name(Path::new("/etc/cdi/gpufrac")).is_err());

        let dir = scratch("out");
        let path = dir.join("new/cdi/gpufrac.json");
        write_atomically(&path, "{}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}\n");
        write_atomically(&path, "{\"a\":1}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n");
        // Nothing left beside it.
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn arguments() {
        let a = parse(&[]);
        assert_eq!(a.dev_dir, Path::new("/dev"));
        assert!(a.output.is_none() && a.driver_libs.is_empty());
        let a = parse(&["-o", "x.json", "--driver-lib", "a", "--driver-lib", "b"]);
        assert_eq!(a.output.as_deref(), Some(Path::new("x.json")));
        assert_eq!(a.driver_libs, [PathBuf::from("a"), PathBuf::from("b")]);
    }
}
