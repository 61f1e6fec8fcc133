//! `gpufrac k8s-dra-plugin`: the Kubernetes DRA kubelet plugin. The plugin
//! itself is `gpufrac_k8s::dra`; this is its command line, and what it
//! finds on the node for every claim's containers (the shim, the broker
//! socket, the driver's device nodes and libraries).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use gpufrac_common::size::parse_size;
use gpufrac_k8s::Lister;
use gpufrac_k8s::dra::{self, Config, cdi::Edits};

use crate::docker::InjectArgs;

/// Where the node's name comes from when --node-name is not given (the
/// DaemonSet sets it from the pod's spec.nodeName).
const VAR_NODE_NAME: &str = "NODE_NAME";

const EXAMPLES: &str = "\
Examples:
  gpufrac k8s-dra-plugin                                   # in the DaemonSet of deploy/k8s/dra/
  gpufrac k8s-dra-plugin --node-name gpu-7 --kubeconfig /etc/kubernetes/kubelet.conf

Every GPU of the node is published as a device of a ResourceSlice
(resource.k8s.io/v1) whose `memory` and `compute` many claims may share. A
claim asks for a part:

  requests:
  - name: gpu
    exactly:
      deviceClassName: gpufrac.dev
      capacity:
        requests: {memory: 4Gi, compute: \"30\"}

and its containers run capped at 4 GiB with a 30% compute share, booked in
the node's broker as a lease on that GPU. docs/k8s-dra.md has the details.
Logs go to stderr (RUST_LOG=debug for more).";

#[derive(Args, Debug)]
#[command(after_help = EXAMPLES)]
pub struct DraArgs {
    /// The driver's name: the ResourceSlices' driver, the DeviceClass's
    /// selector, the CDI kind (NAME/claim).
    #[arg(long, value_name = "NAME", default_value = dra::DEFAULT_DRIVER, value_parser = driver_name)]
    pub driver_name: String,
    /// This node's name as the API server knows it: the pool's name and the
    /// slice's nodeName [default: $NODE_NAME, else the host name]
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// The kubelet's plugin registration directory: the registration socket
    /// (NAME-reg.sock) goes there.
    #[arg(long, value_name = "DIR", default_value = dra::DEFAULT_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// The kubelet's plugins directory: the plugin serves NAME/dra.sock
    /// there.
    #[arg(long, value_name = "DIR", default_value = dra::DEFAULT_PLUGINS_DIR)]
    pub plugins_dir: PathBuf,
    /// Where the container runtime reads CDI specs: each prepared claim's
    /// spec goes there.
    #[arg(long, value_name = "DIR", default_value = dra::DEFAULT_CDI_DIR)]
    pub cdi_dir: PathBuf,
    /// Where the prepared claims are kept (root only), so that a restarted
    /// plugin still knows them and books their leases again.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/gpufrac")]
    pub state_dir: PathBuf,
    /// Credentials for the API server [default: $KUBECONFIG, else the pod's
    /// service account, else ~/.kube/config]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// Claims book memory in multiples of this, e.g. 256Mi or 1Gi.
    #[arg(long, value_name = "SIZE", default_value = "256Mi", value_parser = memory_step)]
    pub memory_step: u64,
    #[command(flatten)]
    pub inject: InjectArgs,
    /// Directory holding the NVIDIA device nodes on the host; without
    /// nvidiactl there, claims get no device nodes (the simulated driver).
    #[arg(long, value_name = "DIR", default_value = "/dev")]
    pub dev_dir: PathBuf,
    /// A driver library to give every claim's containers, instead of those
    /// the ld cache lists (host paths; repeat for each).
    #[arg(long = "driver-lib", value_name = "PATH")]
    pub driver_libs: Vec<PathBuf>,
    /// Directory in which driver libraries appear inside containers
    /// [default: the directory they are in on the host]
    #[arg(long, value_name = "DIR")]
    pub container_lib_dir: Option<PathBuf>,
    /// How often the GPUs are listed again: a GPU the driver no longer
    /// lists is withdrawn from the ResourceSlice.
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = crate::positive_duration)]
    pub poll_interval: u64,
    /// Print the GPUs (`gpu INDEX UUID TOTAL_BYTES NAME`) and exit: what the
    /// plugin runs in a child process for each look at the GPUs.
    #[arg(long, hide = true)]
    pub list_gpus: bool,
}

fn driver_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(
            "expected a DNS subdomain of at most 63 characters, lower case, ending in a domain \
             you own, such as gpufrac.dev or gpu.example.com"
                .into(),
        )
    }
}

fn memory_step(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        n if n < 1 << 20 => Err(
            "a step under 1Mi would make Kubernetes keep count of bytes; expected a size such as \
             256Mi or 1Gi"
                .into(),
        ),
        n => Ok(n),
    }
}

pub fn main(args: DraArgs) -> u8 {
    if args.list_gpus {
        return crate::k8s::list_gpus();
    }
    crate::init_logging();
    let result = config(&args).and_then(dra::run);
    match result {
        Ok(()) => 0,
        Err(m) => {
            eprintln!("gpufrac k8s-dra-plugin: {m}");
            1
        }
    }
}

fn config(args: &DraArgs) -> Result<Config, String> {
    let node = node_name(args.node_name.as_deref())?;
    let program = std::env::current_exe()
        .map_err(|e| format!("cannot locate the gpufrac binary to list the GPUs: {e}"))?;
    Ok(Config {
        driver: args.driver_name.clone(),
        node,
        registry_dir: args.registry_dir.clone(),
        plugins_dir: args.plugins_dir.clone(),
        cdi_dir: args.cdi_dir.clone(),
        state_dir: crate::docker::absolute(&args.state_dir)?,
        kubeconfig: args.kubeconfig.clone(),
        memory_step: args.memory_step,
        edits: edits(args)?,
        lister: Lister {
            program,
            args: vec!["k8s-dra-plugin".into(), "--list-gpus".into()],
            timeout: Duration::from_secs(30),
        },
        poll_interval: Duration::from_nanos(args.poll_interval),
        proc_gpus: gpufrac_common::minors::PROC_GPUS.into(),
        socket: crate::docker::absolute(&crate::socket_path(args.inject.socket.clone()))?,
    })
}

/// `--node-name`, else $NODE_NAME, else the host name.
fn node_name(flag: Option<&str>) -> Result<String, String> {
    let given = flag
        .map(str::to_owned)
        .or_else(|| std::env::var(VAR_NODE_NAME).ok())
        .filter(|n| !n.trim().is_empty());
    let name = match given {
        Some(n) => n.trim().to_owned(),
        None => host_name().ok_or(
            "cannot tell this node's name: pass --node-name, or set NODE_NAME (the DaemonSet \
             sets it from spec.nodeName)",
        )?,
    };
    if name.len() > 253
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    {
        return Err(format!(
            "node name {name:?} is not a Kubernetes node name (lower-case letters, digits, '-' \
             and '.'); pass --node-name as `kubectl get nodes` shows it"
        ));
    }
    Ok(name)
}

fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is ours and its length is passed.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let s = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    (!s.is_empty()).then_some(s)
}

/// What every claim's containers get from this node, checked now rather
/// than at the first claim.
fn edits(args: &DraArgs) -> Result<Edits, String> {
    let dev_dir = crate::docker::absolute(&args.dev_dir)?;
    let mounts = crate::k8s::mounts(&args.inject, &dev_dir, false)?;
    let container_dir = args.container_lib_dir.as_deref();
    let libs = match args.driver_libs.as_slice() {
        [] => crate::cdi::ld_cache()
            .and_then(|listing| crate::cdi::libs_from_ld_cache(&listing, container_dir)),
        given => crate::cdi::libs_given(given, container_dir),
    };
    let mut driver = match libs {
        Ok(m) => m,
        Err(e) if args.driver_libs.is_empty() => {
            tracing::warn!(
                "{e}: claims get no driver libraries from the plugin, so their containers must \
                 have them otherwise (right for the simulated driver; on a GPU node, run the \
                 plugin where the driver is in the ld cache, or name the libraries with \
                 --driver-lib)"
            );
            Vec::new()
        }
        Err(e) => return Err(e),
    };
    driver.extend(crate::cdi::driver_binaries());
    let driver = driver
        .into_iter()
        .map(|m| text(&m.container).map(|c| (m.host, c)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Edits { mounts, driver })
}

fn text(p: &Path) -> Result<String, String> {
    p.to_str().map(str::to_owned).ok_or_else(|| {
        format!(
            "{}: the path is not UTF-8, and a CDI spec is JSON text; use a path without such \
             bytes",
            p.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        a: DraArgs,
    }

    fn parse(args: &[&str]) -> Result<DraArgs, String> {
        T::try_parse_from(std::iter::once("k8s-dra-plugin").chain(args.iter().copied()))
            .map(|t| t.a)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.driver_name, "gpufrac.dev");
        assert_eq!(
            a.registry_dir,
            Path::new("/var/lib/kubelet/plugins_registry")
        );
        assert_eq!(a.plugins_dir, Path::new("/var/lib/kubelet/plugins"));
        assert_eq!(a.cdi_dir, Path::new("/var/run/cdi"));
        assert_eq!(a.state_dir, Path::new("/var/lib/gpufrac"));
        assert_eq!(a.memory_step, 256 << 20);
        assert_eq!(a.poll_interval, 10_000_000_000);
        assert!(a.kubeconfig.is_none() && a.node_name.is_none());
    }

    #[test]
    fn bad_values_say_what_would_do() {
        let e = parse(&["--driver-name", "GPUfrac"]).unwrap_err();
        assert!(
            e.contains("--driver-name") && e.contains("gpu.example.com"),
            "{e}"
        );
        let e = parse(&["--driver-name", "a..b"]).unwrap_err();
        assert!(e.contains("DNS subdomain"), "{e}");
        let e = parse(&["--memory-step", "4K"]).unwrap_err();
        assert!(e.contains("256Mi or 1Gi"), "{e}");
        let e = parse(&["--memory-step", "lots"]).unwrap_err();
        assert!(e.contains("--memory-step"), "{e}");
        assert_eq!(
            parse(&["--memory-step", "1Gi"]).unwrap().memory_step,
            1 << 30
        );
        let e = node_name(Some("Node_1")).unwrap_err();
        assert!(e.contains("kubectl get nodes"), "{e}");
        assert_eq!(node_name(Some("gpu-7.example")).unwrap(), "gpu-7.example");
    }
}
