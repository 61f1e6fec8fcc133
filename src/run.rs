//! `gpufrac run`: get a placement from the broker, then run the command
//! under the shim while holding the lease.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use gpufrac_common::config::{
    Priority, VAR_BROKER, VAR_COMPUTE_LIMIT, VAR_COMPUTE_PRIORITY, VAR_COMPUTE_SHARE, VAR_JOB,
    VAR_JOB_LEDGER, VAR_MEM_LIMIT, VAR_MEM_LIMIT_PREFIX, VAR_SOCKET,
};
use gpufrac_common::size::{self, MEM_LIMIT_EXAMPLE, MemLimit, format_size, parse_percent};
use gpufrac_common::wire::{ClientMsg, LeaseReq, Pin};

use crate::client::{Client, ConnectError, LeaseOutcome, QueueReport};

pub const SHIM_NAME: &str = "libgpufrac.so";

const RUN_EXAMPLES: &str = "\
Examples:
  gpufrac run --gpu-memory 4G --gpu-compute 30% -- python train.py
  gpufrac run --gpus 2 -- torchrun --nproc_per_node=2 train.py
  gpufrac run --gpus 1 --timeout 10m -- ./benchmark
  gpufrac run --gpu-memory 8G --no-wait -- pytest tests/gpu
  gpufrac run --gpu-memory 8G --priority high -- python serve.py

The child gets CUDA_VISIBLE_DEVICES (with CUDA_DEVICE_ORDER=PCI_BUS_ID, so
indices match nvidia-smi; or MIG-<uuid>, the MIG instance a broker running
--mig dynamic made for a --gpu-memory job), LD_PRELOAD with libgpufrac.so first, GPU_MEM_LIMIT,
GPU_COMPUTE_SHARE, GPU_COMPUTE_LIMIT, GPU_COMPUTE_PRIORITY and GPUFRAC_SOCKET. The lease lasts as
long as this process: it ends when the command exits or gpufrac run is killed.

Without a broker the command still runs under the shim with its --gpu-memory
cap; compute shares and queueing need `gpufrac broker`, and --gpus N is
refused.

Exit status: the command's own, 128+N if a signal N killed it, 124 when
--timeout expired in the queue, 126/127 when the command could not be started,
1 for other errors (refused requests included), 2 for bad arguments.";

#[derive(Args, Debug)]
#[command(
    after_help = RUN_EXAMPLES,
    override_usage = "gpufrac run [--gpus N | --gpu-memory SIZE] [OPTIONS] [--] <CMD> [ARGS]..."
)]
pub struct RunArgs {
    /// Wait for N whole GPUs (lowest free indices first).
    #[arg(long, value_name = "N", value_parser = gpu_count, conflicts_with = "gpu_memory")]
    pub gpus: Option<u32>,
    /// Wait for a GPU with SIZE uncommitted memory and cap the command at
    /// SIZE: 4G, 512M, 1.5G, or 25% (of the node's smallest GPU).
    #[arg(long, value_name = "SIZE", value_parser = gpu_memory)]
    pub gpu_memory: Option<MemLimit>,
    /// Share of GPU time when the GPU is contended (e.g. 30%); alone, the
    /// command still gets all of it.
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    pub gpu_compute: Option<f64>,
    /// Hard ceiling on GPU time, even when the GPU is otherwise idle (e.g. 50%).
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    pub gpu_limit: Option<f64>,
    /// Priority class: `high` (interactive: a notebook, an inference server)
    /// gets the GPU as soon as it has work; `low` runs only on GPU time
    /// nobody else wants; shares apply within a class.
    #[arg(long, value_name = "CLASS", value_parser = priority)]
    pub priority: Option<Priority>,
    /// Fail at once instead of queueing when nothing is free.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up (exit 124) after waiting this long in the queue (e.g. 30s, 10m).
    #[arg(long, value_name = "DUR", value_parser = timeout)]
    pub timeout: Option<Timeout>,
    /// Broker socket [default: $GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        value_name = "CMD",
        num_args = 1..
    )]
    pub command: Vec<OsString>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Timeout {
    pub ns: u64,
    /// As typed, for the message when it expires.
    pub text: String,
}

fn gpu_count(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(0) => Err("--gpus must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err("expected a whole number of GPUs such as 1 or 2".into()),
    }
}

/// A size, or a percentage that [`resolve_gpu_memory`] turns into one once
/// the GPUs are known. Zero is refused here, unlike in `GPU_MEM_LIMIT`
/// where it means no cap: a job that asks for no memory cannot be placed.
fn gpu_memory(s: &str) -> Result<MemLimit, String> {
    let zero = || format!("--gpu-memory must be greater than 0; expected {MEM_LIMIT_EXAMPLE}");
    if !s.trim().ends_with('%') && size::parse_size(s).is_ok_and(|b| b == 0) {
        return Err(zero());
    }
    match size::parse_mem_limit(s)? {
        MemLimit::None => Err(zero()),
        m => Ok(m),
    }
}

/// `--gpu-memory` in bytes. A percentage is of the smallest of `totals`
/// (the GPUs the broker, or without one the driver, reports), so that the
/// request fits whichever GPU it is placed on; on a node of identical
/// GPUs that is exactly the share asked for. `source` says where `totals`
/// came from, for the message when there are none.
fn resolve_gpu_memory(m: MemLimit, totals: &[u64], source: &str) -> Result<u64, String> {
    let smallest = totals.iter().copied().min();
    match (m, smallest) {
        (MemLimit::Bytes(b), _) => Ok(b),
        (MemLimit::Percent(p), Some(total)) => match m.resolve(total) {
            Some(b) if b > 0 => Ok(b),
            _ => Err(format!(
                "--gpu-memory {p}% of the smallest GPU ({}) is 0 bytes; ask for more",
                format_size(total)
            )),
        },
        (MemLimit::Percent(p), None) => Err(format!(
            "--gpu-memory {p}% is a share of a GPU, and {source}; give a size such as 4G instead"
        )),
        (MemLimit::None, _) => Err("--gpu-memory must be greater than 0".into()),
    }
}

/// What a percentage is of: the GPUs the broker hands out, whole or as
/// MIG instances (a MIG instance's own entry is not a GPU of the node).
fn broker_totals(client: &mut Client) -> Result<Vec<u64>, String> {
    let status = client.status()?;
    Ok(status
        .gpus
        .iter()
        .filter(|g| g.mode != "mig-instance")
        .map(|g| g.total_mem)
        .collect())
}

fn priority(s: &str) -> Result<Priority, String> {
    Priority::parse(s).ok_or_else(|| "expected one of high, normal, low".into())
}

fn timeout(s: &str) -> Result<Timeout, String> {
    match size::parse_duration(s)? {
        // Nothing could ever be granted in no time at all.
        0 => Err("must be greater than zero; use --no-wait not to queue at all".into()),
        ns => Ok(Timeout {
            ns,
            text: s.trim().to_owned(),
        }),
    }
}

/// A failure of `run` itself: the message (printed after "gpufrac run: ")
/// and the exit status.
#[derive(Debug)]
struct Fail {
    msg: String,
    code: u8,
}

impl Fail {
    fn new(code: u8, msg: impl Into<String>) -> Fail {
        Fail {
            msg: msg.into(),
            code,
        }
    }
}

pub fn main(args: RunArgs) -> u8 {
    match run(args) {
        Ok(code) => code,
        Err(f) => {
            eprintln!("gpufrac run: {}", f.msg);
            f.code
        }
    }
}

/// Where the child runs, as far as the broker decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// No broker: the shim enforces the memory cap on its own.
    NoBroker,
    /// A broker is there but nothing was asked of the queue (neither --gpus
    /// nor --gpu-memory): the child sees every GPU and registers itself.
    Unplaced,
    Leased {
        /// nvidia-smi indices.
        gpus: Vec<u32>,
        /// Bytes per GPU; 0 = uncapped.
        mem_cap: u64,
        /// A MIG instance (`MIG-<uuid>`) of `gpus`' one GPU: the device the
        /// child is given instead of the GPU.
        mig: Option<String>,
    },
}

/// The flags that shape the child's environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EnvFlags {
    pub gpu_memory: Option<u64>,
    /// Percent.
    pub compute: Option<f64>,
    /// Percent.
    pub limit: Option<f64>,
    pub priority: Option<Priority>,
}

/// Changes to make to the child's environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChildEnv {
    pub set: Vec<(String, String)>,
    pub remove: Vec<String>,
}

#[cfg(test)]
impl ChildEnv {
    fn get(&self, name: &str) -> Option<&str> {
        self.set
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Builds the child's environment from the placement, the flags and the
/// environment `run` was started with (first occurrence wins, as for
/// `getenv`).
pub fn child_env(
    placement: &Placement,
    flags: &EnvFlags,
    shim: &Path,
    socket: &Path,
    existing: &[(String, String)],
) -> ChildEnv {
    let get = |name: &str| {
        existing
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let mut env = ChildEnv::default();
    let mut set = |k: &str, v: String| env.set.push((k.to_owned(), v));

    set("LD_PRELOAD", prepend_preload(shim, get("LD_PRELOAD")));
    set(VAR_SOCKET, socket.display().to_string());

    let cap = match placement {
        Placement::NoBroker => {
            // The shim would otherwise look for the broker again and print
            // its own warning after ours.
            set(VAR_BROKER, "off".to_owned());
            flags.gpu_memory
        }
        Placement::Unplaced => flags.gpu_memory,
        Placement::Leased {
            mig: Some(m),
            mem_cap,
            ..
        } => {
            // CUDA enumerates the one MIG device named; its UUID says
            // which, so no device order is needed.
            set("CUDA_VISIBLE_DEVICES", m.clone());
            Some(*mem_cap).filter(|&c| c > 0).or(flags.gpu_memory)
        }
        Placement::Leased {
            gpus,
            mem_cap,
            mig: None,
        } => {
            if !gpus.is_empty() {
                let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
                set("CUDA_VISIBLE_DEVICES", list.join(","));
                // The broker numbers GPUs as nvidia-smi does; CUDA's default
                // order (fastest first) can differ.
                set("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned());
            }
            Some(*mem_cap).filter(|&c| c > 0).or(flags.gpu_memory)
        }
    };
    if let Some(cap) = cap {
        set(VAR_MEM_LIMIT, cap.to_string());
    }
    // Shares mean nothing to a shim that may not reach a broker.
    if *placement != Placement::NoBroker {
        if let Some(p) = flags.compute {
            set(VAR_COMPUTE_SHARE, format!("{p}%"));
        }
        if let Some(p) = flags.limit {
            set(VAR_COMPUTE_LIMIT, format!("{p}%"));
        }
        if let Some(p) = flags.priority {
            set(VAR_COMPUTE_PRIORITY, p.as_str().to_owned());
        }
    }
    if cap.is_some() {
        // A per-device override would beat the cap gpufrac promised the
        // broker, and under a new CUDA_VISIBLE_DEVICES it would name another
        // GPU than the user meant anyway.
        for (k, _) in existing {
            if k.strip_prefix(VAR_MEM_LIMIT_PREFIX)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                && !env.remove.contains(k)
            {
                env.remove.push(k.clone());
            }
        }
    }
    env
}

/// The shim first, so its symbols win over any other preloaded library's;
/// left alone when some libgpufrac.so is already there, because two shims
/// would each count the same allocations.
fn prepend_preload(shim: &Path, existing: Option<&str>) -> String {
    let existing = existing.unwrap_or("").trim();
    let has_shim = existing
        .split([':', ' '])
        .any(|e| !e.is_empty() && Path::new(e).file_name().is_some_and(|n| n == SHIM_NAME));
    if has_shim {
        return existing.to_owned();
    }
    let shim = shim.display().to_string();
    if existing.is_empty() {
        shim
    } else {
        format!("{shim}:{existing}")
    }
}

/// Names the shim when it is not where an install puts it: after a bare
/// `cargo install` (which installs the binary alone), or to try another
/// build. Read by `gpufrac run` and `docker-args`, not by the shim.
pub const VAR_LIB: &str = "GPUFRAC_LIB";

/// `$GPUFRAC_LIB` (the library, or a directory holding it), else
/// `libgpufrac.so` beside the binary (a build tree, or everything in one
/// directory), else in `../lib` (an install under a prefix).
pub fn find_shim() -> Result<PathBuf, String> {
    if let Some(v) = std::env::var_os(VAR_LIB).filter(|v| !v.is_empty()) {
        let named = PathBuf::from(&v);
        let lib = if named.is_dir() {
            named.join(SHIM_NAME)
        } else {
            named
        };
        // Absolute, because the child may run in another directory.
        return match lib.canonicalize() {
            Ok(p) if p.is_file() => Ok(p),
            _ => Err(format!(
                "{VAR_LIB}={}: there is no {SHIM_NAME} there; point it at the library or the \
                 directory that holds it, or unset it to use the installed one",
                Path::new(&v).display()
            )),
        };
    }
    let exe = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .map_err(|e| format!("cannot locate the gpufrac binary to find {SHIM_NAME}: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let lib_dir = dir.parent().unwrap_or(dir).join("lib");
    let candidates = [dir.join(SHIM_NAME), lib_dir.join(SHIM_NAME)];
    for c in &candidates {
        if c.is_file() {
            return Ok(c.canonicalize().unwrap_or_else(|_| c.clone()));
        }
    }
    Err(format!(
        "cannot find {SHIM_NAME}: looked for {} and {}. Install the library there \
         (from a source checkout: cargo xtask install --prefix PREFIX; from a release: \
         ./install.sh --prefix PREFIX in the unpacked tarball), or set {VAR_LIB} to its path",
        candidates[0].display(),
        candidates[1].display()
    ))
}

/// "1 GPU", "2 GPUs", "4.00 GiB": what a request waits for, in the broker's
/// own words for when it has not said yet.
fn describe_want(gpus: Option<u32>, mem: Option<u64>) -> String {
    match (gpus, mem) {
        (Some(1), _) => "1 GPU".to_owned(),
        (Some(n), _) => format!("{n} GPUs"),
        (None, Some(b)) => format!("a GPU with {} free", format_size(b)),
        (None, None) => "a GPU".to_owned(),
    }
}

/// What a run without a broker still enforces: the job's `--gpu-memory`
/// cap (`mem`, in bytes once resolved), else the per-process
/// `GPU_MEM_LIMIT` the command inherits, else nothing.
fn no_broker_cap(mem: Option<u64>, env_limit: Option<&str>) -> String {
    match (mem, env_limit.map(str::trim).filter(|v| !v.is_empty() && *v != "0")) {
        (Some(b), _) => format!(
            "running under the memory cap only ({} for the whole job)",
            format_size(b)
        ),
        (None, Some(v)) => format!(
            "running under the memory cap only ({VAR_MEM_LIMIT}={v} for each process, from the environment)"
        ),
        (None, None) => {
            "running the command as it is, with the shim preloaded but no cap: none was asked (--gpu-memory SIZE asks for one)"
                .to_owned()
        }
    }
}

fn run(args: RunArgs) -> Result<u8, Fail> {
    let shim = find_shim().map_err(|m| Fail::new(1, m))?;
    let socket = crate::socket_path(args.socket.clone());
    let wants_placement = args.gpus.is_some() || args.gpu_memory.is_some();

    // Held until the child exits: the broker ends the lease when this
    // connection closes, which also happens when run is killed outright.
    let mut held: Option<(Client, u64, ClientMsg)> = None;
    let mut mps_pipe = String::new();
    let mut mem = args.gpu_memory.and_then(|m| match m {
        MemLimit::Bytes(b) => Some(b),
        _ => None,
    });
    let placement = match Client::connect(&socket) {
        Err(ConnectError::NoBroker) => {
            if std::env::var(VAR_BROKER).is_ok_and(|v| v.trim().eq_ignore_ascii_case("required")) {
                return Err(Fail::new(
                    1,
                    format!(
                        "no broker at {} and {VAR_BROKER}=required; {}",
                        socket.display(),
                        crate::client::start_hint(&socket)
                    ),
                ));
            }
            if let Some(n) = args.gpus {
                // Whole GPUs cannot be booked without the broker: running
                // anyway would hand out GPUs that another job may hold.
                return Err(Fail::new(
                    1,
                    format!(
                        "--gpus {n} needs the broker to book whole GPUs, and none answers at {} \
                         (--gpu-memory alone runs capped without it); {}",
                        socket.display(),
                        crate::client::start_hint(&socket)
                    ),
                ));
            }
            if let Some(m @ MemLimit::Percent(_)) = args.gpu_memory {
                // The child sees the GPUs this process sees.
                let totals = gpufrac_broker::inventory::discover()
                    .map(|gpus| gpus.iter().map(|g| g.total_mem).collect::<Vec<_>>());
                let source = match &totals {
                    Ok(_) => "the CUDA driver lists no GPU".to_owned(),
                    Err(e) => format!(
                        "with no broker at {} the GPUs' size is unknown ({e})",
                        socket.display()
                    ),
                };
                mem = Some(
                    resolve_gpu_memory(m, totals.as_deref().unwrap_or(&[]), &source)
                        .map_err(|e| Fail::new(1, e))?,
                );
            }
            eprintln!(
                "gpufrac run: no broker at {}; {} (compute shares and queueing need: gpufrac broker)",
                socket.display(),
                no_broker_cap(mem, std::env::var(VAR_MEM_LIMIT).ok().as_deref())
            );
            Placement::NoBroker
        }
        Err(ConnectError::Other(m)) => return Err(Fail::new(1, m)),
        // Every run with a broker is a job, placed or not: its processes
        // share one unit of fairness and the broker enforces its flags on
        // them, whatever their environment says.
        Ok(mut client) => {
            if let Some(m @ MemLimit::Percent(_)) = args.gpu_memory {
                let totals = broker_totals(&mut client).map_err(|e| Fail::new(1, e))?;
                let source = format!("the broker at {} has no GPU", socket.display());
                mem = Some(resolve_gpu_memory(m, &totals, &source).map_err(|e| Fail::new(1, e))?);
            }
            let (client, g) = lease(client, &args, mem, &socket)?;
            // Claimed back with what it holds: a broker that lost its
            // state (a corrupt file) books it again where it runs.
            let claim = lease_request(&args, mem, g.token, g.held());
            held = Some((client, g.token, claim));
            mps_pipe = g.mps_pipe;
            if wants_placement {
                Placement::Leased {
                    gpus: g.gpus,
                    mem_cap: g.mem_cap,
                    mig: Some(g.mig).filter(|m| !m.is_empty()),
                }
            } else {
                Placement::Unplaced
            }
        }
    };

    let flags = EnvFlags {
        gpu_memory: mem,
        compute: args.gpu_compute,
        limit: args.gpu_limit,
        priority: args.priority,
    };
    let existing: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    // The child may change directory before its shim connects.
    let child_socket = std::path::absolute(&socket).unwrap_or_else(|_| socket.clone());
    let mut env = child_env(&placement, &flags, &shim, &child_socket, &existing);
    env.set.extend(mps_env(&mps_pipe, &flags));
    // One set of memory books for the whole job: every process under this
    // run shares the cap, instead of each getting all of it.
    let books = job_books(&env)?;
    if let Some(b) = &books {
        env.set
            .push((VAR_JOB_LEDGER.to_owned(), b.path.display().to_string()));
    }
    if let Some((_, token, _)) = &held {
        // Processes that do not descend from this run (a container's) join
        // the job by its token.
        env.set.push((VAR_JOB.to_owned(), format!("{token:016x}")));
    }
    let command = match crate::container::run_index(&args.command) {
        Some(at) => crate::container::wrap(&args.command, at, &env, &shim, &child_socket)
            .map_err(|m| Fail::new(2, m))?,
        None => args.command.clone(),
    };
    if held.is_some() {
        // Descendants that daemonise are re-parented here rather than to
        // init, so the broker still finds them under this job.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    if let Some((client, _, req)) = held {
        std::thread::Builder::new()
            .name("lease-keeper".into())
            .spawn(move || keep_lease(client, req, socket))
            .map_err(|e| Fail::new(1, format!("cannot start a thread: {e}")))?;
    }
    let status = spawn_and_wait(&command, &env);
    drop(books);
    Ok(exit_code(status?))
}

/// The job's shared memory books: a small file the child's processes map
/// (named in `GPUFRAC_JOB_LEDGER`), removed when the job ends.
struct JobBooks {
    path: PathBuf,
    _books: gpufrac_common::jobledger::JobLedger,
}

impl Drop for JobBooks {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn job_books(env: &ChildEnv) -> Result<Option<JobBooks>, Fail> {
    let Some(cap) = env
        .set
        .iter()
        .find(|(k, _)| k == VAR_MEM_LIMIT)
        .and_then(|(_, v)| v.parse::<u64>().ok())
    else {
        return Ok(None);
    };
    // Memory-backed where there is /dev/shm: nothing touches a disk.
    let dir = Path::new("/dev/shm");
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = dir.join(format!("gpufrac-job-{}-{nanos}", std::process::id()));
    let books = gpufrac_common::jobledger::JobLedger::create(&path.display().to_string(), cap)
        .map_err(|e| {
            Fail::new(
                1,
                format!(
                    "cannot create the job's memory books at {}: {e}",
                    path.display()
                ),
            )
        })?;
    Ok(Some(JobBooks {
        path,
        _books: books,
    }))
}

fn exit_code(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        // Exit statuses are 0..=255 already; the mask only satisfies the type.
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        (None, None) => 1,
    }
}

/// Holds the lease's connection while the child runs. If the broker goes
/// away (a crash, a restart), reconnects and claims the same lease back,
/// so a restarted broker never hands this job's GPUs to another.
fn keep_lease(mut client: Client, req: ClientMsg, socket: PathBuf) {
    loop {
        let why = client.wait_closed();
        eprintln!("gpufrac run: {why}; the command carries on and the lease will be claimed back");
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let Ok(mut c) = Client::connect(&socket) else {
                continue;
            };
            if c.request_lease(&req).is_err() {
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            match c.wait_lease(Some(deadline), Duration::from_secs(1), |_| {}) {
                Ok(LeaseOutcome::Leased { .. }) => {
                    eprintln!("gpufrac run: lease claimed back from the restarted broker");
                    client = c;
                    break;
                }
                Ok(LeaseOutcome::Refused(reason)) => {
                    eprintln!(
                        "gpufrac run: the broker would not give the lease back ({reason}); the command carries on unbooked"
                    );
                    return;
                }
                _ => continue,
            }
        }
    }
}

/// What the broker granted.
struct Granted {
    gpus: Vec<u32>,
    uuids: Vec<[u8; 16]>,
    mem_cap: u64,
    token: u64,
    mps_pipe: String,
    /// `MIG-<uuid>` of a MIG lease; empty otherwise.
    mig: String,
}

impl Granted {
    /// The GPUs (or the MIG device) it holds, as a claim names them.
    fn held(&self) -> Vec<Pin> {
        let mig = gpufrac_common::wire::parse_uuid(&self.mig);
        let uuids = match mig {
            Some(m) => vec![m],
            None => self.uuids.clone(),
        };
        uuids
            .into_iter()
            .map(|uuid| Pin {
                uuid,
                mem: self.mem_cap,
            })
            .collect()
    }
}

/// A broker running MPS: the child is an MPS client of its daemon, its
/// `--gpu-compute` is the share of SMs it may use, and `--priority low`
/// is MPS's below-normal client priority (MPS has no higher one).
fn mps_env(pipe: &str, flags: &EnvFlags) -> Vec<(String, String)> {
    if pipe.is_empty() {
        return Vec::new();
    }
    let mut v = vec![("CUDA_MPS_PIPE_DIRECTORY".to_owned(), pipe.to_owned())];
    if let Some(p) = flags.compute {
        v.push((
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(),
            format!("{}", p.clamp(1.0, 100.0)),
        ));
    }
    if flags.priority == Some(Priority::Low) {
        v.push(("CUDA_MPS_CLIENT_PRIORITY".to_owned(), "1".to_owned()));
    }
    v
}

/// `mem`: `--gpu-memory` in bytes, a percentage resolved; `pin`: the GPUs
/// a lease being claimed back holds.
fn lease_request(args: &RunArgs, mem: Option<u64>, resume: u64, pin: Vec<Pin>) -> ClientMsg {
    let command = args
        .command
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    ClientMsg::Lease(LeaseReq {
        want_gpus: args.gpus.unwrap_or(0),
        want_mem: mem.unwrap_or(0),
        compute: args.gpu_compute,
        limit: args.gpu_limit,
        no_wait: args.no_wait,
        command,
        priority: args.priority,
        resume,
        token: 0,
        pin,
    })
}

/// How long a queued `run` waits for a broker that went away to come back
/// before giving up.
const BROKER_RETURN: Duration = Duration::from_secs(60);

/// Sends the lease request and waits for the answer, keeping a status line
/// on the terminal. If the broker restarts meanwhile, reconnects and asks
/// for the same place in the queue.
fn lease(
    mut client: Client,
    args: &RunArgs,
    mem: Option<u64>,
    socket: &Path,
) -> Result<(Client, Granted), Fail> {
    client
        .request_lease(&lease_request(args, mem, 0, Vec::new()))
        .map_err(|m| Fail::new(1, m))?;

    let start = Instant::now();
    let deadline = args
        .timeout
        .as_ref()
        .map(|t| start + Duration::from_nanos(t.ns));
    let tty = std::io::stderr().is_terminal();
    let mut line = StatusLine::default();
    let mut last_report: Option<QueueReport> = None;
    loop {
        let outcome = client.wait_lease(deadline, Duration::from_millis(500), |q| {
            if tty && let Some(q) = q {
                line.draw(q, start.elapsed());
            }
        });
        line.clear();
        let lost = match outcome {
            Ok(LeaseOutcome::Leased {
                gpus,
                uuids,
                mem_cap,
                token,
                mps_pipe,
                mig,
            }) => {
                return Ok((
                    client,
                    Granted {
                        gpus,
                        uuids,
                        mem_cap,
                        token,
                        mps_pipe,
                        mig,
                    },
                ));
            }
            Ok(LeaseOutcome::Refused(reason)) => {
                if last_report.is_some() {
                    // A restarted broker that lost its state: queue anew.
                    last_report = None;
                    client
                        .request_lease(&lease_request(args, mem, 0, Vec::new()))
                        .map_err(|m| Fail::new(1, m))?;
                    continue;
                }
                return Err(Fail::new(1, reason));
            }
            Ok(LeaseOutcome::TimedOut(last)) => {
                let (what, pos) = match last.or(last_report) {
                    Some(QueueReport {
                        position,
                        waiting_for,
                        ..
                    }) => (waiting_for, position.to_string()),
                    None => (describe_want(args.gpus, mem), "unknown".to_owned()),
                };
                let text = args.timeout.as_ref().map_or("", |t| t.text.as_str());
                return Err(Fail::new(
                    124,
                    format!("gave up after {text} waiting for {what} (position {pos})"),
                ));
            }
            Err(m) => m,
        };
        if let Some(r) = client.last_report() {
            last_report = Some(r);
        }
        // The broker went away while we waited: claim our place back
        // when it returns (it keeps the queue across a restart).
        let Some(token) = last_report.as_ref().map(|r| r.token) else {
            return Err(Fail::new(1, lost));
        };
        eprintln!("gpufrac run: {lost}; waiting for the broker to return");
        let back_by = Instant::now() + BROKER_RETURN;
        client = loop {
            if Instant::now() >= back_by {
                return Err(Fail::new(
                    1,
                    format!(
                        "the broker at {} did not come back within {}s",
                        socket.display(),
                        BROKER_RETURN.as_secs()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
            if let Ok(mut c) = Client::connect(socket)
                && c.request_lease(&lease_request(args, mem, token, Vec::new()))
                    .is_ok()
            {
                break c;
            }
        };
    }
}

/// The one-line queue display on a terminal.
#[derive(Default)]
struct StatusLine {
    drawn_at: Option<Instant>,
    text: String,
    last: Option<(u32, String)>,
}

impl StatusLine {
    fn draw(&mut self, q: &QueueReport, elapsed: Duration) {
        let text = format!(
            " gpufrac: waiting for {} \u{2014} position {} \u{2014} {}s",
            q.waiting_for,
            q.position,
            elapsed.as_secs()
        );
        // A new position shows at once; the clock alone redraws at most
        // twice a second, and not at all when the text would not change.
        let moved = self.last != Some((q.position, q.waiting_for.clone()));
        let due = self
            .drawn_at
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(500));
        if text == self.text || !(moved || due) {
            return;
        }
        // \x1b[K clears what a longer earlier line left behind.
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{text}\x1b[K");
        let _ = err.flush();
        self.drawn_at = Some(Instant::now());
        self.text = text;
        self.last = Some((q.position, q.waiting_for.clone()));
    }

    /// Leaves the terminal as it was, so the command's output starts on a
    /// clean line.
    fn clear(&mut self) {
        if self.drawn_at.take().is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

static CHILD: AtomicI32 = AtomicI32::new(0);

const FORWARDED: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

extern "C" fn forward_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A terminal sends ^C, ^\ and hangups to its whole foreground process
    // group, the child included; passing them on would deliver them twice.
    if matches!(sig, libc::SIGINT | libc::SIGQUIT | libc::SIGHUP)
        && !info.is_null()
        // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
        && unsafe { (*info).si_code } == libc::SI_KERNEL
    {
        return;
    }
    let pid = CHILD.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: errno is thread-local and kill is async-signal-safe; errno
        // is restored so the interrupted code never sees ours.
        unsafe {
            let errno = *libc::__errno_location();
            libc::kill(pid, sig);
            *libc::__errno_location() = errno;
        }
    }
}

fn forwarded_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Spawns the command with the forwarded signals blocked until its pid is
/// known, so none that arrives in between is lost or kills `run` alone.
fn spawn_and_wait(command: &[OsString], env: &ChildEnv) -> Result<std::process::ExitStatus, Fail> {
    let (program, rest) = command
        .split_first()
        .ok_or_else(|| Fail::new(2, "no command given"))?;
    let mut cmd = Command::new(program);
    cmd.args(rest);
    for k in &env.remove {
        cmd.env_remove(k);
    }
    for (k, v) in &env.set {
        cmd.env(k, v);
    }

    let set = forwarded_set();
    // SAFETY: plain libc calls on initialised sigsets.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
    // std passes the signal mask on to the child, which would then never
    // see the very signals we forward to it.
    // SAFETY: pthread_sigmask is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    if let Ok(child) = &spawned {
        CHILD.store(child.id() as i32, Ordering::Relaxed);
        for s in FORWARDED {
            // SAFETY: the handler only touches an atomic, errno and kill().
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = forward_signal as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(s, &sa, std::ptr::null_mut());
            }
        }
    }
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };

    let mut child = spawned.map_err(|e| {
        let name = program.to_string_lossy();
        match e.kind() {
            std::io::ErrorKind::NotFound => Fail::new(127, format!("{name}: command not found")),
            _ => Fail::new(126, format!("cannot run {name}: {e}")),
        }
    })?;
    child
        .wait()
        .map_err(|e| Fail::new(1, format!("waiting for the command failed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn without_a_broker_run_says_which_cap_holds_if_any() {
        assert_eq!(
            no_broker_cap(Some(4 << 30), Some("1G")),
            "running under the memory cap only (4.00 GiB for the whole job)"
        );
        assert_eq!(
            no_broker_cap(None, Some(" 2G ")),
            "running under the memory cap only (GPU_MEM_LIMIT=2G for each process, from the environment)"
        );
        for none in [None, Some(""), Some("0")] {
            let said = no_broker_cap(None, none);
            assert!(
                !said.contains("cap only") && said.contains("no cap"),
                "{none:?}: {said}"
            );
        }
    }

    fn parse(args: &[&str]) -> Result<RunArgs, String> {
        T::try_parse_from(std::iter::once("run").chain(args.iter().copied()))
            .map(|t| t.run)
            .map_err(|e| e.to_string())
    }

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const SHIM: &str = "/opt/gpufrac/lib/libgpufrac.so";

    fn env_of(p: &Placement, f: &EnvFlags, existing: &[(&str, &str)]) -> ChildEnv {
        child_env(
            p,
            f,
            Path::new(SHIM),
            Path::new("/run/g.sock"),
            &vars(existing),
        )
    }

    #[test]
    fn parses_a_full_request() {
        let a = parse(&[
            "--gpu-memory",
            "4G",
            "--gpu-compute",
            "30%",
            "--gpu-limit",
            "50",
            "--no-wait",
            "--timeout",
            "10m",
            "--",
            "python",
            "-c",
            "print(1)",
        ])
        .unwrap();
        assert_eq!(a.gpu_memory, Some(MemLimit::Bytes(4 << 30)));
        assert_eq!(a.gpu_compute, Some(30.0));
        assert_eq!(a.gpu_limit, Some(50.0));
        assert!(a.no_wait);
        assert_eq!(a.timeout.unwrap().ns, 600_000_000_000);
        assert_eq!(a.command, ["python", "-c", "print(1)"]);
    }

    #[test]
    fn gpu_memory_takes_a_percentage_of_the_smallest_gpu() {
        let a = parse(&["--gpu-memory", "25%", "--", "true"]).unwrap();
        assert_eq!(a.gpu_memory, Some(MemLimit::Percent(25.0)));
        let m = a.gpu_memory.unwrap();
        assert_eq!(resolve_gpu_memory(m, &[16 << 30], "-"), Ok(4 << 30));
        // Placed on either GPU, the job fits.
        assert_eq!(
            resolve_gpu_memory(m, &[80 << 30, 16 << 30], "-"),
            Ok(4 << 30)
        );
        // Rounded down, never past what was asked.
        assert_eq!(
            resolve_gpu_memory(MemLimit::Percent(33.3), &[1000], "-"),
            Ok(333)
        );
        let e = resolve_gpu_memory(m, &[], "the broker at /s has no GPU").unwrap_err();
        assert!(
            e.contains("25%") && e.contains("the broker at /s has no GPU") && e.contains("4G"),
            "{e}"
        );
        let e = resolve_gpu_memory(MemLimit::Percent(0.01), &[1000], "-").unwrap_err();
        assert!(e.contains("0 bytes"), "{e}");
        assert_eq!(
            resolve_gpu_memory(MemLimit::Bytes(7), &[], "-"),
            Ok(7),
            "a size needs no GPU"
        );
    }

    #[test]
    fn command_flags_are_not_ours() {
        let a = parse(&["--gpus", "2", "torchrun", "--gpus", "8", "-x"]).unwrap();
        assert_eq!(a.gpus, Some(2));
        assert_eq!(a.command, ["torchrun", "--gpus", "8", "-x"]);
    }

    #[test]
    fn bad_arguments() {
        let e = parse(&["--gpus", "0", "--", "true"]).unwrap_err();
        assert!(e.contains("--gpus must be at least 1"), "{e}");
        let e = parse(&["--gpus", "two", "--", "true"]).unwrap_err();
        assert!(e.contains("such as 1 or 2"), "{e}");
        let e = parse(&["--gpu-compute", "0%", "--", "true"]).unwrap_err();
        assert!(e.contains("a percentage must be greater than 0"), "{e}");
        assert!(e.contains("--gpu-compute"), "{e}");
        let e = parse(&["--priority", "urgent", "--", "true"]).unwrap_err();
        assert!(
            e.contains("--priority") && e.contains("high, normal, low"),
            "{e}"
        );
        assert_eq!(
            parse(&["--priority", "HIGH", "--", "true"])
                .unwrap()
                .priority,
            Some(Priority::High)
        );
        let e = parse(&["--gpu-limit", "150%", "--", "true"]).unwrap_err();
        assert!(e.contains("above 100%"), "{e}");
        let e = parse(&["--gpu-memory", "4X", "--", "true"]).unwrap_err();
        assert!(e.contains("unknown unit") && e.contains("4G"), "{e}");
        for zero in ["0", "0G", "0.1", "", "0%"] {
            let e = parse(&["--gpu-memory", zero, "--", "true"]).unwrap_err();
            assert!(e.contains("greater than 0"), "{zero:?}: {e}");
        }
        let e = parse(&["--gpu-memory", "120%", "--", "true"]).unwrap_err();
        assert!(e.contains("above 100%"), "{e}");
        let e = parse(&["--timeout", "0s", "--", "true"]).unwrap_err();
        assert!(e.contains("--no-wait"), "{e}");
        let e = parse(&["--timeout", "30", "--", "true"]).unwrap_err();
        assert!(e.contains("--timeout") && e.contains("30s"), "{e}");
        let e = parse(&["--gpus", "1", "--gpu-memory", "4G", "--", "true"]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = parse(&["--gpus", "1"]).unwrap_err();
        assert!(e.contains("<CMD>"), "{e}");
    }

    #[test]
    fn preload_is_prepended_once() {
        let e = env_of(&Placement::Unplaced, &EnvFlags::default(), &[]);
        assert_eq!(e.get("LD_PRELOAD"), Some(SHIM));

        let e = env_of(
            &Placement::Unplaced,
            &EnvFlags::default(),
            &[("LD_PRELOAD", "/usr/lib/libfoo.so")],
        );
        assert_eq!(
            e.get("LD_PRELOAD"),
            Some("/opt/gpufrac/lib/libgpufrac.so:/usr/lib/libfoo.so")
        );

        // Already there, under this path or another install's.
        for existing in [
            "/usr/lib/libfoo.so:/opt/gpufrac/lib/libgpufrac.so",
            "/elsewhere/libgpufrac.so /usr/lib/libfoo.so",
            "libgpufrac.so",
        ] {
            let e = env_of(
                &Placement::Unplaced,
                &EnvFlags::default(),
                &[("LD_PRELOAD", existing)],
            );
            assert_eq!(e.get("LD_PRELOAD"), Some(existing));
        }

        // Similar names are other libraries.
        let e = env_of(
            &Placement::Unplaced,
            &EnvFlags::default(),
            &[("LD_PRELOAD", "/x/libgpufrac.so.bak")],
        );
        assert_eq!(
            e.get("LD_PRELOAD"),
            Some("/opt/gpufrac/lib/libgpufrac.so:/x/libgpufrac.so.bak")
        );

        // An empty value is no value.
        let e = env_of(
            &Placement::Unplaced,
            &EnvFlags::default(),
            &[("LD_PRELOAD", " ")],
        );
        assert_eq!(e.get("LD_PRELOAD"), Some(SHIM));
    }

    #[test]
    fn lease_sets_devices_and_caps() {
        let flags = EnvFlags {
            gpu_memory: None,
            compute: Some(30.0),
            limit: Some(12.5),
            priority: Some(Priority::High),
        };
        let e = env_of(
            &Placement::Leased {
                gpus: vec![1, 3],
                mem_cap: 20 << 30,
                mig: None,
            },
            &flags,
            &[("CUDA_VISIBLE_DEVICES", "0"), ("GPU_MEM_LIMIT", "1G")],
        );
        assert_eq!(e.get("CUDA_VISIBLE_DEVICES"), Some("1,3"));
        assert_eq!(e.get("CUDA_DEVICE_ORDER"), Some("PCI_BUS_ID"));
        assert_eq!(e.get("GPU_MEM_LIMIT"), Some("21474836480"));
        assert_eq!(e.get("GPU_COMPUTE_SHARE"), Some("30%"));
        assert_eq!(e.get("GPU_COMPUTE_LIMIT"), Some("12.5%"));
        assert_eq!(e.get("GPU_COMPUTE_PRIORITY"), Some("high"));
        assert_eq!(e.get("GPUFRAC_SOCKET"), Some("/run/g.sock"));
        assert_eq!(e.get("GPUFRAC_BROKER"), None);
    }

    #[test]
    fn uncapped_lease_keeps_the_users_cap() {
        let e = env_of(
            &Placement::Leased {
                gpus: vec![0],
                mem_cap: 0,
                mig: None,
            },
            &EnvFlags::default(),
            &[("GPU_MEM_LIMIT", "1G"), ("GPU_MEM_LIMIT_0", "2G")],
        );
        assert_eq!(e.get("GPU_MEM_LIMIT"), None);
        assert!(e.remove.is_empty());
        assert_eq!(e.get("GPU_COMPUTE_SHARE"), None);
    }

    #[test]
    fn imposed_cap_drops_per_device_overrides() {
        let e = env_of(
            &Placement::Leased {
                gpus: vec![2],
                mem_cap: 4 << 30,
                mig: None,
            },
            &EnvFlags::default(),
            &[
                ("GPU_MEM_LIMIT_0", "80G"),
                ("GPU_MEM_LIMIT_12", "1G"),
                ("GPU_MEM_LIMIT_X", "1G"),
                ("GPU_MEM_LIMIT_0", "70G"),
            ],
        );
        assert_eq!(e.remove, ["GPU_MEM_LIMIT_0", "GPU_MEM_LIMIT_12"]);
    }

    #[test]
    fn a_mig_lease_names_its_mig_device() {
        let mig = "MIG-3c1e6f7a-c0de-4000-8000-000000000001";
        let e = env_of(
            &Placement::Leased {
                gpus: vec![0],
                mem_cap: 4864 << 20,
                mig: Some(mig.into()),
            },
            &EnvFlags {
                gpu_memory: Some(4 << 30),
                ..EnvFlags::default()
            },
            &[("CUDA_VISIBLE_DEVICES", "1"), ("GPU_MEM_LIMIT_0", "1G")],
        );
        assert_eq!(e.get("CUDA_VISIBLE_DEVICES"), Some(mig));
        assert_eq!(e.get("CUDA_DEVICE_ORDER"), None);
        // The job has the whole instance, not only what it asked for.
        assert_eq!(
            e.get("GPU_MEM_LIMIT"),
            Some((4864u64 << 20).to_string().as_str())
        );
        assert_eq!(e.remove, ["GPU_MEM_LIMIT_0"]);
    }

    #[test]
    fn memory_lease_falls_back_to_the_flag() {
        let flags = EnvFlags {
            gpu_memory: Some(4 << 30),
            ..EnvFlags::default()
        };
        let e = env_of(
            &Placement::Leased {
                gpus: vec![0],
                mem_cap: 0,
                mig: None,
            },
            &flags,
            &[],
        );
        assert_eq!(e.get("GPU_MEM_LIMIT"), Some("4294967296"));
    }

    #[test]
    fn no_broker_runs_under_the_cap_only() {
        let flags = EnvFlags {
            gpu_memory: Some(512 << 20),
            compute: Some(30.0),
            limit: Some(50.0),
            priority: Some(Priority::Low),
        };
        let e = env_of(
            &Placement::NoBroker,
            &flags,
            &[("CUDA_VISIBLE_DEVICES", "1"), ("GPU_MEM_LIMIT", "8G")],
        );
        assert_eq!(e.get("GPU_MEM_LIMIT"), Some("536870912"));
        assert_eq!(e.get("GPUFRAC_BROKER"), Some("off"));
        assert_eq!(e.get("CUDA_VISIBLE_DEVICES"), None);
        assert_eq!(e.get("GPU_COMPUTE_SHARE"), None);
        assert_eq!(e.get("GPU_COMPUTE_LIMIT"), None);
        assert_eq!(e.get("GPU_COMPUTE_PRIORITY"), None);
        assert_eq!(e.get("LD_PRELOAD"), Some(SHIM));

        // --gpus without a broker: no device change, the user's cap stays.
        let e = env_of(
            &Placement::NoBroker,
            &EnvFlags::default(),
            &[("GPU_MEM_LIMIT", "8G")],
        );
        assert_eq!(e.get("GPU_MEM_LIMIT"), None);
        assert_eq!(e.get("CUDA_VISIBLE_DEVICES"), None);
    }

    #[test]
    fn descriptions() {
        assert_eq!(describe_want(Some(1), None), "1 GPU");
        assert_eq!(describe_want(Some(2), None), "2 GPUs");
        assert_eq!(
            describe_want(None, Some(4 << 30)),
            "a GPU with 4.00 GiB free"
        );
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        use std::process::ExitStatus;
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM | 0x80)), 143);
    }
}
