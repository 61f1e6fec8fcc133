//! `gpufrac k8s-device-plugin`: a kubelet device plugin (API v1beta1) that
//! advertises gpufrac slots or memory units. The plugin itself is the
//! `gpufrac-k8s` crate; this is its command line and the GPU listing it
//! runs in a child process.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use gpufrac_broker::gpus;
use gpufrac_common::size::parse_size;
use gpufrac_common::wire::uuid_string;
use gpufrac_k8s::devices::MAX_UNITS_PER_GPU;
use gpufrac_k8s::leases::LeaseConfig;
use gpufrac_k8s::{Config, Gpu, Injection, Lister, Mounts, Resource};

use crate::docker::InjectArgs;
use crate::inject::{CONTAINER_LIB, CONTAINER_SOCKET_DIR};

/// Test-only: a file whose content the GPU listing takes as
/// `GPUFRAC_SIM_DEVICES`, so that a test can make a simulated GPU go and
/// come back under a running plugin (the simulated driver reads its devices
/// once per process, from the environment).
const VAR_SIM_DEVICES_FILE: &str = "GPUFRAC_K8S_SIM_DEVICES_FILE";

const DEFAULT_MEMORY_UNIT: u64 = 1 << 30;
const DEFAULT_SLOTS: u32 = 4;
/// Device nodes every GPU needs besides its own nvidiaN, and those passed
/// when the host has them.
const REQUIRED_NODES: &[&str] = &["nvidiactl"];
const OPTIONAL_NODES: &[&str] = &["nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

const EXAMPLES: &str = "\
Examples:
  gpufrac k8s-device-plugin                                # gpufrac.dev/gpu-memory, 1G units
  gpufrac k8s-device-plugin --resource gpu --slots-per-gpu 4
  gpufrac k8s-device-plugin --cdi                          # with /etc/cdi/gpufrac.json

A pod asks for `gpufrac.dev/gpu-memory: 4` (4 units: GPU_MEM_LIMIT=4G on one
GPU) or `gpufrac.dev/gpu: 1` (one slot: total/F of a GPU's memory and
GPU_COMPUTE_SHARE=100/F %). One resource per plugin process: the kubelet
would count the two independently and hand the same GPU out twice.

The plugin runs on the node (deploy/k8s/daemonset.yaml) beside the broker;
allocations mount the shim and the broker socket's directory into the pod,
and each is booked with the broker as a lease on the GPUs the kubelet chose,
named after its pod (from the kubelet's pod-resources API) and released when
the pod no longer holds the devices.
Logs go to stderr (RUST_LOG=debug for more). docs/k8s.md has the details.";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ResourceKind {
    /// gpufrac.dev/gpu-memory: one device per --memory-unit of each GPU.
    GpuMemory,
    /// gpufrac.dev/gpu: --slots-per-gpu devices per GPU.
    Gpu,
}

#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct PluginArgs {
    /// The kubelet's device-plugin directory: kubelet.sock is there, and the
    /// plugin's own socket goes there.
    #[arg(long, value_name = "DIR", default_value = gpufrac_k8s::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
    /// What each advertised device stands for.
    #[arg(long, value_enum, default_value_t = ResourceKind::GpuMemory)]
    pub resource: ResourceKind,
    /// Memory per device of gpufrac.dev/gpu-memory, e.g. 1G or 512M [default: 1G]
    #[arg(long, value_name = "SIZE", value_parser = memory_unit)]
    pub memory_unit: Option<u64>,
    /// Slots per GPU for gpufrac.dev/gpu (the over-provisioning factor: a
    /// slot is total/F of a GPU's memory and 1/F of its compute) [default: 4]
    #[arg(long, value_name = "F", value_parser = slots)]
    pub slots_per_gpu: Option<u32>,
    /// Answer allocations with CDI devices (gpufrac.dev/gpu=N, from
    /// `gpufrac cdi generate`) and the caps, instead of mounts and device
    /// nodes.
    #[arg(long)]
    pub cdi: bool,
    #[command(flatten)]
    pub inject: InjectArgs,
    /// Directory holding the NVIDIA device nodes on the host.
    #[arg(long, value_name = "DIR", default_value = "/dev")]
    pub dev_dir: PathBuf,
    /// How often the GPUs are listed again: the devices of a GPU the driver
    /// no longer lists are reported Unhealthy.
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = crate::positive_duration)]
    pub poll_interval: u64,
    /// The kubelet's pod-resources socket, asked every --poll-interval which
    /// pod holds which devices: leases are named after their pods and end
    /// when the pods do.
    #[arg(long, value_name = "PATH", default_value = gpufrac_k8s::DEFAULT_POD_RESOURCES)]
    pub pod_resources_socket: PathBuf,
    /// Where the tokens of the pods' leases are kept (root only), so that
    /// a restarted plugin books the same pods under the same tokens.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/gpufrac")]
    pub state_dir: PathBuf,
    /// Print the GPUs (`gpu INDEX UUID TOTAL_BYTES`) and exit: what the
    /// plugin runs in a child process for each look at the GPUs.
    #[arg(long, hide = true)]
    pub list_gpus: bool,
}

fn memory_unit(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        n if n < 1 << 20 => Err("a unit under 1M would make more devices than a GPU may \
                                  advertise; expected a size such as 1G or 512M"
            .into()),
        n => Ok(n),
    }
}

fn slots(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(f) if f >= 1 && u64::from(f) <= MAX_UNITS_PER_GPU => Ok(f),
        _ => Err(format!(
            "expected a whole number of slots per GPU from 1 to {MAX_UNITS_PER_GPU}, such as 2, 4 or 8"
        )),
    }
}

pub fn main(args: PluginArgs) -> u8 {
    if args.list_gpus {
        return list_gpus();
    }
    crate::init_logging();
    let resource = match resource(&args) {
        Ok(r) => r,
        Err(m) => {
            eprintln!("gpufrac k8s-device-plugin: {m}");
            return 2;
        }
    };
    let result = injection(&args).and_then(|inject| {
        let program = std::env::current_exe()
            .map_err(|e| format!("cannot locate the gpufrac binary to list the GPUs: {e}"))?;
        let poll_interval = Duration::from_nanos(args.poll_interval);
        let socket = crate::docker::absolute(&crate::socket_path(args.inject.socket.clone()))?;
        gpufrac_k8s::run(Config {
            kubelet_dir: args.kubelet_dir.clone(),
            resource,
            inject,
            poll_interval,
            leases: LeaseConfig {
                socket,
                pod_resources: Some(args.pod_resources_socket.clone()),
                state_file: state_file(&args.state_dir, resource),
                // The kubelet lists a pod's devices as soon as Allocate
                // has answered: three looks are plenty.
                grace: poll_interval * 3,
            },
            lister: Lister {
                program,
                args: vec!["k8s-device-plugin".into(), "--list-gpus".into()],
                timeout: Duration::from_secs(30),
            },
            proc_gpus: gpufrac_common::minors::PROC_GPUS.into(),
        })
    });
    match result {
        Ok(()) => 0,
        Err(m) => {
            eprintln!("gpufrac k8s-device-plugin: {m}");
            1
        }
    }
}

/// The resource and its size, refusing options that the chosen resource or
/// `--cdi` would silently ignore.
fn resource(args: &PluginArgs) -> Result<Resource, String> {
    if args.cdi {
        let i = &args.inject;
        for (given, flag) in [
            (i.lib.is_some(), "--lib"),
            (i.preload_file.is_some(), "--preload-file"),
        ] {
            if given {
                return Err(format!(
                    "{flag} has no effect with --cdi: the CDI spec decides how the shim and the \
                     socket get into containers (gpufrac cdi generate {flag} …)"
                ));
            }
        }
    }
    match args.resource {
        ResourceKind::GpuMemory => {
            if args.slots_per_gpu.is_some() {
                return Err(
                    "--slots-per-gpu sizes gpufrac.dev/gpu; with --resource gpu-memory \
                            the size of a device is --memory-unit. Use --resource gpu with it"
                        .into(),
                );
            }
            Ok(Resource::Memory {
                unit: args.memory_unit.unwrap_or(DEFAULT_MEMORY_UNIT),
            })
        }
        ResourceKind::Gpu => {
            if args.memory_unit.is_some() {
                return Err(
                    "--memory-unit sizes gpufrac.dev/gpu-memory; with --resource gpu \
                            a device is a slot, total/--slots-per-gpu of a GPU. Use --resource \
                            gpu-memory with it"
                        .into(),
                );
            }
            Ok(Resource::Slots {
                per_gpu: args.slots_per_gpu.unwrap_or(DEFAULT_SLOTS),
            })
        }
    }
}

/// The leases' state file in `dir` (made if missing), one per resource;
/// None, said, when the directory cannot be made.
fn state_file(dir: &Path, resource: Resource) -> Option<PathBuf> {
    if let Err(e) = std::fs::create_dir_all(dir) {
        tracing::warn!(
            "--state-dir {}: {e}; the pods' lease tokens are not kept, so a restarted plugin              books its pods under new tokens (their processes then count as their user's)",
            dir.display()
        );
        return None;
    }
    let stem = resource.endpoint().trim_end_matches(".sock");
    Some(dir.join(format!("k8s-{stem}.json")))
}

/// What allocations put into containers, checked now rather than at the
/// first pod.
fn injection(args: &PluginArgs) -> Result<Injection, String> {
    if args.cdi {
        return Ok(Injection::Cdi);
    }
    mounts(&args.inject, &args.dev_dir, true).map(Injection::Mounts)
}

/// The shim, the broker socket's directory and the driver's control nodes,
/// as both plugins give them to containers. Without the control node in
/// `dev_dir`, `nodes_required` refuses; otherwise there are no nodes at all
/// (a node of the simulated driver).
pub(crate) fn mounts(
    inject: &InjectArgs,
    dev_dir: &Path,
    nodes_required: bool,
) -> Result<Mounts, String> {
    let (lib, socket) = inject.lib_and_socket()?;
    let preload_file = inject.write_preload_file()?;
    if let Some(dir) = socket.parent().filter(|d| !d.is_dir()) {
        // Not an error: the broker may start later, and containers keep
        // their memory caps meanwhile.
        tracing::warn!(
            "the broker socket's directory {} does not exist (yet): until `gpufrac broker` \
             runs there, containers get their memory caps but no lease and no compute \
             arbitration, and may fail to start where the runtime will not create a missing \
             mount source",
            dir.display()
        );
    }
    let mut control_nodes = Vec::new();
    let driver_here = char_device(&dev_dir.join(REQUIRED_NODES[0])).is_ok();
    for name in REQUIRED_NODES.iter().chain(OPTIONAL_NODES) {
        if !driver_here && !nodes_required {
            break;
        }
        let path = dev_dir.join(name);
        match char_device(&path) {
            Ok(host) => control_nodes.push((host, format!("/dev/{name}"))),
            Err(e) if REQUIRED_NODES.contains(name) => {
                return Err(format!(
                    "{e}: the NVIDIA driver's control node is needed by every GPU; load the \
                     driver, point --dev-dir at the directory holding the NVIDIA device nodes, \
                     or use --cdi"
                ));
            }
            Err(_) if *name == "nvidia-uvm" => tracing::warn!(
                "{} does not exist, and CUDA needs it: load the nvidia-uvm module \
                 (nvidia-modprobe -u -c=0)",
                path.display()
            ),
            Err(_) => {}
        }
    }
    Ok(Mounts {
        lib,
        container_lib: CONTAINER_LIB.into(),
        socket,
        container_socket_dir: CONTAINER_SOCKET_DIR.into(),
        preload_file,
        control_nodes,
        dev_dir: dev_dir.to_path_buf(),
    })
}

/// The character device at `path`, links resolved (runtimes take the
/// node's numbers from the host path and refuse a link).
fn char_device(path: &Path) -> Result<PathBuf, String> {
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_char_device() => path
            .canonicalize()
            .map_err(|e| format!("{}: {e}", path.display())),
        Ok(_) => Err(format!("{} is not a character device", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// `--list-gpus`: the GPUs in PCI bus order, as `gpufrac cdi generate`
/// and `gpufrac run` number them.
pub(crate) fn list_gpus() -> u8 {
    // SAFETY (both blocks): nothing else runs yet (no thread has been
    // started), so no one reads the environment while it changes.
    if let Some(file) = std::env::var_os(VAR_SIM_DEVICES_FILE) {
        match std::fs::read_to_string(&file) {
            Ok(s) => unsafe { std::env::set_var("GPUFRAC_SIM_DEVICES", s.trim()) },
            Err(e) => {
                eprintln!("{VAR_SIM_DEVICES_FILE}={}: {e}", Path::new(&file).display());
                return 1;
            }
        }
    }
    unsafe { gpus::use_pci_order(true) };
    match gpus::discover() {
        Ok(gpus) => {
            let text: String = gpus
                .iter()
                .map(|g| {
                    gpufrac_k8s::format_gpu_line(&Gpu {
                        index: g.index,
                        uuid: uuid_string(&g.uuid),
                        total_mem: g.total_mem,
                        name: g.name.clone(),
                    })
                })
                .collect();
            match crate::print_stdout(&text) {
                Ok(()) => 0,
                Err(m) => {
                    eprintln!("{m}");
                    1
                }
            }
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        a: PluginArgs,
    }

    fn parse(args: &[&str]) -> Result<PluginArgs, String> {
        T::try_parse_from(std::iter::once("k8s-device-plugin").chain(args.iter().copied()))
            .map(|t| t.a)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.kubelet_dir, Path::new("/var/lib/kubelet/device-plugins"));
        assert_eq!(a.poll_interval, 10_000_000_000);
        // deploy/k8s/daemonset.yaml mounts both from the host.
        assert_eq!(
            a.pod_resources_socket,
            Path::new("/var/lib/kubelet/pod-resources/kubelet.sock")
        );
        assert_eq!(a.state_dir, Path::new("/var/lib/gpufrac"));
        assert_eq!(resource(&a).unwrap(), Resource::Memory { unit: 1 << 30 });
        let a = parse(&["--resource", "gpu"]).unwrap();
        assert_eq!(resource(&a).unwrap(), Resource::Slots { per_gpu: 4 });
    }

    #[test]
    fn options_of_the_other_resource_are_refused() {
        let a = parse(&["--slots-per-gpu", "8"]).unwrap();
        let e = resource(&a).unwrap_err();
        assert!(e.contains("--resource gpu with it"), "{e}");
        let a = parse(&["--resource", "gpu", "--memory-unit", "2G"]).unwrap();
        let e = resource(&a).unwrap_err();
        assert!(e.contains("--resource gpu-memory with it"), "{e}");
        let a = parse(&["--cdi", "--lib", "/x.so"]).unwrap();
        let e = resource(&a).unwrap_err();
        assert!(e.contains("--lib has no effect with --cdi"), "{e}");
        // With --cdi the socket is still where the plugin books leases.
        let a = parse(&["--cdi", "--socket", "/run/b.sock"]).unwrap();
        assert!(resource(&a).is_ok());
    }

    #[test]
    fn bad_values_say_what_would_do() {
        let e = parse(&["--memory-unit", "4X"]).unwrap_err();
        assert!(e.contains("--memory-unit") && e.contains("4G"), "{e}");
        let e = parse(&["--memory-unit", "4K"]).unwrap_err();
        assert!(e.contains("under 1M") && e.contains("1G or 512M"), "{e}");
        let e = parse(&["--slots-per-gpu", "0"]).unwrap_err();
        assert!(e.contains("from 1 to 2048"), "{e}");
        let e = parse(&["--resource", "gpus"]).unwrap_err();
        assert!(e.contains("gpu-memory"), "{e}");
        let e = parse(&["--poll-interval", "0s"]).unwrap_err();
        assert!(e.contains("greater than zero"), "{e}");
    }

    #[test]
    fn missing_control_node_is_named() {
        let dir = std::env::temp_dir().join(format!("gpufrac-k8s-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libgpufrac.so");
        std::fs::write(&lib, b"").unwrap();
        let a = parse(&[
            "--lib",
            lib.to_str().unwrap(),
            "--dev-dir",
            dir.to_str().unwrap(),
            "--socket",
            "/run/gpufrac/broker.sock",
        ])
        .unwrap();
        let e = injection(&a).unwrap_err();
        assert!(
            e.contains(&format!("{}/nvidiactl", dir.display())) && e.contains("--dev-dir"),
            "{e}"
        );
        std::os::unix::fs::symlink("/dev/null", dir.join("nvidiactl")).unwrap();
        let Injection::Mounts(m) = injection(&a).unwrap() else {
            panic!("mounts expected")
        };
        assert_eq!(
            m.control_nodes,
            [(PathBuf::from("/dev/null"), "/dev/nvidiactl".to_string())]
        );
        assert_eq!(m.lib, lib.canonicalize().unwrap());
        assert!(m.preload_file.is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
