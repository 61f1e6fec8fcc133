//! `gpufrac run`'s command line and the parsers of its values.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;
use gpufrac_common::config::Priority;
use gpufrac_common::size::{self, MEM_LIMIT_EXAMPLE, MemLimit, parse_percent};

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
    /// Also write the end-of-job summary to FILE, as JSON.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
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
