//! The `gpufrac` command: the broker daemon, `run`, `status`, `top`,
//! `docker-args`, and the integrations (CDI, Slurm, Kubernetes).

mod cdi;
mod client;
mod container;
mod docker;
mod inject;
mod k8s;
mod k8s_dra;
mod names;
mod run;
mod slurm;
mod status;
mod top;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use gpufrac_common::config::{DEFAULT_SOCKET, VAR_SOCKET};
use gpufrac_common::size::{self, DURATION_EXAMPLE};

const ABOUT: &str =
    "Share NVIDIA GPUs among processes: memory caps, compute shares and a GPU queue";

const LONG_ABOUT: &str = "\
Share NVIDIA GPUs among processes: memory caps, compute shares and a GPU queue.

libgpufrac.so, preloaded into unmodified CUDA programs, caps their GPU memory
and takes compute timeslices from the broker. `gpufrac run` does the
preloading for you and queues for whole GPUs or memory fractions.";

const EXAMPLES: &str = "\
Examples:
  gpufrac broker &                                         start the node's arbiter
  gpufrac run --gpu-memory 4G --gpu-compute 30% -- python train.py
  gpufrac run --gpus 2 -- torchrun --nproc_per_node=2 train.py
  gpufrac status
  gpufrac top                                              watch it live
  docker run $(gpufrac docker-args --gpu-memory 8G --gpus 0) IMAGE

Environment:
  GPUFRAC_SOCKET   broker socket (default /run/gpufrac/broker.sock)
  RUST_LOG         broker log filter (default info)";

#[derive(Parser, Debug)]
#[command(
    name = "gpufrac",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = EXAMPLES,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the node-local broker: compute timeslices, the GPU queue, status.
    Broker(BrokerArgs),
    /// Run a command under the shim, with a memory cap, a compute share and
    /// queued GPUs.
    Run(run::RunArgs),
    /// Show GPUs, processes, shares, the queue and leases.
    Status(status::StatusArgs),
    /// Watch GPUs, shares, processes and the queue live (read-only).
    Top(top::TopArgs),
    /// Print `docker run` flags that put a sealed image under gpufrac.
    DockerArgs(docker::DockerArgs),
    /// Container Device Interface specs for Podman and Docker ≥ 25.
    Cdi(cdi::CdiArgs),
    /// Slurm TaskProlog: a task's shards become a memory cap and a compute
    /// share (prints `export` lines).
    SlurmTaskProlog(slurm::PrologArgs),
    /// Kubernetes device plugin: advertises GPU slots or memory units to
    /// the kubelet and answers allocations with gpufrac's environment.
    K8sDevicePlugin(k8s::PluginArgs),
    /// Kubernetes DRA kubelet plugin: publishes each GPU's memory and
    /// compute as consumable capacity and enforces what claims are given.
    K8sDraPlugin(k8s_dra::DraArgs),
}

const BROKER_EXAMPLES: &str = "\
Examples:
  gpufrac broker
  sudo gpufrac broker --group gpu --metrics 127.0.0.1:9400
  gpufrac broker --socket $XDG_RUNTIME_DIR/gpufrac.sock --timeslice 20ms
  gpufrac broker --overprovision 4     # every GPU becomes 4 slots for --gpus 1
  gpufrac broker --mig dynamic         # --gpu-memory jobs get MIG instances on GPUs in MIG mode

Log detail follows RUST_LOG (default info), e.g. RUST_LOG=gpufrac_broker=debug.";

#[derive(Args, Debug)]
#[command(after_help = BROKER_EXAMPLES)]
struct BrokerArgs {
    /// Socket to listen on [default: $GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Slice of GPU time between busy processes of one priority class.
    /// (Interactive processes and higher classes do not wait for it.)
    #[arg(long, value_name = "DUR", default_value = "20ms", value_parser = positive_duration)]
    timeslice: u64,
    /// Most unfinished GPU work a process may keep queued while others share
    /// its GPU: what a process that starts launching may have to wait for,
    /// beyond the GPU's own ~2 ms time-slice. 0 turns the bound off.
    #[arg(long, value_name = "DUR", default_value = "250us", value_parser = duration)]
    inflight: u64,
    /// Group allowed to use the socket (mode 0660); default: the broker's own.
    #[arg(long, value_name = "GROUP")]
    group: Option<String>,
    /// Serve Prometheus metrics over HTTP at /metrics on ADDR: a port alone
    /// (9400) is 127.0.0.1:9400, loopback only; HOST:PORT as given
    /// (0.0.0.0:9400 serves every interface).
    #[arg(long, value_name = "ADDR", value_parser = metrics_address)]
    metrics: Option<String>,
    /// A queued request waiting this long goes ahead of all younger ones.
    #[arg(long, value_name = "DUR", default_value = "1h", value_parser = duration)]
    escalate_after: u64,
    /// Present each physical GPU as F logical GPUs (`--gpus 1` then takes one
    /// slot, capped at total/F memory).
    #[arg(long, value_name = "F", default_value = "1", value_parser = overprovision)]
    overprovision: u32,
    /// Let leased memory exceed a GPU's physical total.
    #[arg(long)]
    overcommit: bool,
    /// Place memory fractions on the emptiest GPU instead of the best fit.
    #[arg(long)]
    spread: bool,
    /// Most connections one user may hold open (each process under the shim
    /// holds one): a user cannot exhaust the broker's file descriptors.
    #[arg(long, value_name = "N", default_value_t = gpufrac_broker::BrokerOptions::default().max_conns_per_user)]
    max_connections_per_user: usize,
    /// Most requests one user may have waiting in the queue at once.
    #[arg(long, value_name = "N", default_value_t = gpufrac_broker::BrokerOptions::default().max_queued_per_user)]
    max_queued_per_user: usize,
    /// Most leases one user may hold at once (queued requests included).
    #[arg(long, value_name = "N", default_value_t = gpufrac_broker::BrokerOptions::default().max_leases_per_user)]
    max_leases_per_user: usize,
    /// User (name or uid) who, besides root, may send the Kubernetes device
    /// plugin's requests (leases pinned to GPUs, chosen job tokens).
    /// Repeatable.
    #[arg(long, value_name = "USER")]
    plugin_user: Vec<String>,
    /// Group (name or gid) whose members may send the device plugin's
    /// requests. Repeatable.
    #[arg(long, value_name = "GROUP")]
    plugin_group: Vec<String>,
    /// While lower priorities wait, the most of each second that processes
    /// of priority `high` hold the GPU together (Linux's real-time
    /// throttling, for the GPU); 100% lets `high` starve everyone else.
    #[arg(long, value_name = "PCT", default_value = "50%", value_parser = high_share)]
    high_share: f64,
    /// Only these users (or @groups) may use priority `high`; others asking
    /// for it get `normal`. Repeatable. Default: everyone.
    #[arg(long, value_name = "USER|@GROUP")]
    high_allow: Vec<String>,
    /// A user's (name or uid) weight among users with work on a GPU
    /// (default 1): `alice=2` gets twice what a user of weight 1 gets.
    /// Repeatable.
    #[arg(long, value_name = "USER=W", value_parser = user_weight)]
    user_weight: Vec<String>,
    /// The weight of a group's (name or gid) members, for users with no
    /// --user-weight of their own (the largest of their groups'). Repeatable.
    #[arg(long, value_name = "GROUP=W", value_parser = group_weight)]
    group_weight: Vec<String>,
    /// When the state file cannot be trusted at start (corrupt, truncated,
    /// another user's), new placements wait this long while running jobs
    /// claim their leases back, so that no GPU is booked twice.
    #[arg(long, value_name = "DUR", default_value = "30s", value_parser = duration)]
    recovery_grace: u64,
    /// The broker's private directory: the state file (leases and the
    /// queue, kept across a crash) and, with --mps, MPS's pipe and log
    /// directories. Made if missing (mode 0700); refused if another user
    /// owns it or group or others can write it [default: as root
    /// /run/gpufrac/state/KEY, else $XDG_RUNTIME_DIR/gpufrac/KEY or
    /// /tmp/gpufrac-UID/KEY, KEY naming the socket].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Run NVIDIA MPS for the GPUs: jobs run side by side on the SMs
    /// (`--gpu-compute` becomes an SM percentage) instead of taking turns.
    #[arg(long)]
    mps: bool,
    /// GPUs in MIG mode: `dynamic` gives each `gpufrac run --gpu-memory`
    /// job a MIG instance of the smallest profile that fits its memory and
    /// `--gpu-compute`, kept idle for the next job and destroyed only when
    /// its room is needed. MIG mode itself is never changed.
    #[arg(long, value_name = "MODE", value_enum)]
    mig: Option<MigArg>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum MigArg {
    /// Make and destroy MIG instances as jobs need them.
    Dynamic,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Broker(args) => broker(args),
        Cmd::Run(args) => run::main(args),
        Cmd::Status(args) => status::main(args),
        Cmd::Top(args) => top::main(args),
        Cmd::DockerArgs(args) => docker::main(args),
        Cmd::Cdi(args) => cdi::main(args),
        Cmd::SlurmTaskProlog(args) => slurm::main(args),
        Cmd::K8sDevicePlugin(args) => k8s::main(args),
        Cmd::K8sDraPlugin(args) => k8s_dra::main(args),
    };
    ExitCode::from(code)
}

fn broker(args: BrokerArgs) -> u8 {
    // SAFETY: first thing, before any thread or the CUDA driver starts.
    // The broker's GPU numbers are the ones `gpufrac run` hands out.
    unsafe { gpufrac_broker::gpus::use_pci_order(false) };
    init_logging();
    let opts = gpufrac_broker::BrokerOptions {
        socket: socket_path(args.socket),
        timeslice: args.timeslice,
        inflight: args.inflight,
        group: args.group,
        metrics: args.metrics,
        escalate_after: args.escalate_after,
        overprovision: args.overprovision,
        overcommit: args.overcommit,
        spread: args.spread,
        max_conns_per_user: args.max_connections_per_user,
        max_queued_per_user: args.max_queued_per_user,
        max_leases_per_user: args.max_leases_per_user,
        plugin_users: args.plugin_user,
        plugin_groups: args.plugin_group,
        high_share: args.high_share,
        high_allow: args.high_allow,
        user_weights: args.user_weight,
        group_weights: args.group_weight,
        recovery_grace: args.recovery_grace,
        state_dir: args.state_dir,
        mps: args.mps,
        mig: match args.mig {
            Some(MigArg::Dynamic) => gpufrac_broker::MigMode::Dynamic,
            None => gpufrac_broker::MigMode::Off,
        },
    };
    match gpufrac_broker::run(opts) {
        Ok(()) => 0,
        Err(msg) => {
            eprintln!("gpufrac broker: {msg}");
            1
        }
    }
}

/// The daemons' log (the broker's, the plugins'): stderr, filtered by
/// RUST_LOG (default info).
pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes would litter log files and the journal.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .init();
}

/// `--socket`, else `$GPUFRAC_SOCKET`, else the default, so that a user who
/// exports the variable once reaches the same broker from every subcommand
/// and from the shim.
pub(crate) fn socket_path(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| {
        std::env::var_os(VAR_SOCKET)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
    .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
}

/// Writes `text` to stdout. A reader that went away (`gpufrac status |
/// head`) is not an error worth a message; anything else is returned.
pub(crate) fn print_stdout(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write to stdout: {e}"))
        }
        _ => Ok(()),
    }
}

/// Nanoseconds.
pub(crate) fn duration(s: &str) -> Result<u64, String> {
    size::parse_duration(s)
}

fn positive_duration(s: &str) -> Result<u64, String> {
    match size::parse_duration(s)? {
        0 => Err(format!(
            "must be greater than zero; expected {DURATION_EXAMPLE}"
        )),
        ns => Ok(ns),
    }
}

/// A share of the window, as a fraction in (0, 1].
fn high_share(s: &str) -> Result<f64, String> {
    // parse_percent refuses anything outside (0, 100].
    size::parse_percent(s).map(|p| p / 100.0)
}

// The broker's own checks of these, made while the command line is read:
// a malformed value is a usage error (status 2) like any other, not a
// failed start (status 1). The broker reads the values again, as given.
fn metrics_address(s: &str) -> Result<String, String> {
    gpufrac_broker::options::metrics_address(s).map(|_| s.to_owned())
}

fn user_weight(s: &str) -> Result<String, String> {
    gpufrac_broker::options::user_weight(s).map(|_| s.to_owned())
}

fn group_weight(s: &str) -> Result<String, String> {
    gpufrac_broker::options::group_weight(s).map(|_| s.to_owned())
}

fn overprovision(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(0) => Err("must be at least 1 (1 = no over-provisioning)".into()),
        Ok(f) => Ok(f),
        Err(_) => Err("expected a whole number of slots per GPU such as 1, 2 or 4".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("gpufrac").chain(args.iter().copied()))
    }

    #[test]
    fn the_brokers_malformed_values_are_usage_errors() {
        for bad in [
            &["--user-weight", "alice"][..],
            &["--user-weight", "root=0"],
            &["--user-weight", "no-such-user-here=2"],
            &["--group-weight", "root"],
            &["--metrics", "99999"],
            &["--metrics", "nowhere"],
        ] {
            let args = [&["broker"][..], bad].concat();
            let e = parse(&args).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad:?}");
            assert_eq!(e.exit_code(), 2);
        }
        for ok in [
            &["--user-weight", "root=2"][..],
            &["--group-weight", "0=0.5"],
            &["--metrics", "9400"],
            &["--metrics", "127.0.0.1:9400"],
        ] {
            let args = [&["broker"][..], ok].concat();
            assert!(parse(&args).is_ok(), "{ok:?}");
        }
    }

    fn err(args: &[&str]) -> String {
        match parse(args) {
            Ok(c) => panic!("{args:?} accepted: {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn broker_defaults() {
        let Cmd::Broker(b) = parse(&["broker"]).unwrap().cmd else {
            panic!()
        };
        assert_eq!(b.timeslice, 20_000_000);
        assert_eq!(b.inflight, 250_000);
        assert_eq!(b.escalate_after, 3_600_000_000_000);
        assert_eq!(b.overprovision, 1);
        assert!(!b.overcommit && !b.spread);
        assert!(b.socket.is_none() && b.group.is_none() && b.metrics.is_none());
    }

    #[test]
    fn broker_options() {
        let Cmd::Broker(b) = parse(&[
            "broker",
            "--socket",
            "/tmp/s.sock",
            "--timeslice",
            "20ms",
            "--group",
            "gpu",
            "--metrics",
            "127.0.0.1:9400",
            "--escalate-after",
            "10m",
            "--overprovision",
            "4",
            "--overcommit",
            "--spread",
            "--state-dir",
            "/var/lib/gpufrac/b",
        ])
        .unwrap()
        .cmd
        else {
            panic!()
        };
        assert_eq!(b.timeslice, 20_000_000);
        assert_eq!(b.escalate_after, 600_000_000_000);
        assert_eq!(b.overprovision, 4);
        assert_eq!(b.group.as_deref(), Some("gpu"));
        assert_eq!(b.metrics.as_deref(), Some("127.0.0.1:9400"));
        assert_eq!(b.socket, Some(PathBuf::from("/tmp/s.sock")));
        assert!(b.overcommit && b.spread);
        assert_eq!(b.state_dir, Some(PathBuf::from("/var/lib/gpufrac/b")));
    }

    #[test]
    fn broker_bad_values_name_the_option_and_an_example() {
        let e = err(&["broker", "--timeslice", "50"]);
        assert!(e.contains("--timeslice") && e.contains("50ms"), "{e}");
        let e = err(&["broker", "--timeslice", "0ms"]);
        assert!(
            e.contains("--timeslice") && e.contains("greater than zero"),
            "{e}"
        );
        let e = err(&["broker", "--escalate-after", "soon"]);
        assert!(e.contains("--escalate-after") && e.contains("1h"), "{e}");
        let e = err(&["broker", "--overprovision", "0"]);
        assert!(
            e.contains("--overprovision") && e.contains("at least 1"),
            "{e}"
        );
        let e = err(&["broker", "--overprovision", "1.5"]);
        assert!(
            e.contains("--overprovision") && e.contains("such as 1, 2 or 4"),
            "{e}"
        );
    }

    #[test]
    fn socket_flag_wins() {
        assert_eq!(
            socket_path(Some(PathBuf::from("/x.sock"))),
            PathBuf::from("/x.sock")
        );
    }
}
