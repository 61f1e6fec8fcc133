//! `gpufrac run`: get a placement from the broker, then run the command
//! under the shim while holding the lease.
//!
//! Rooms: `args` (the command line), `env` (the child's environment),
//! `books` (the job's shared memory books), `lease` (asking, waiting,
//! holding and claiming back), `waiting` (what a queued run says, and
//! why it waits), `child` (spawning, signals, exit status),
//! `fail` (a failure's message and status). This file runs them in order.

mod args;
mod books;
mod child;
pub(crate) mod env;
mod fail;
mod lease;
mod summary;
mod waiting;

use gpufrac_common::config::{VAR_BROKER, VAR_JOB, VAR_JOB_LEDGER, VAR_MEM_LIMIT};
use gpufrac_common::size::{MemLimit, format_size};
use gpufrac_common::wire::ClientMsg;

pub use args::RunArgs;
use books::job_books;
use child::{exit_code, spawn_and_wait};
use env::{EnvFlags, Placement, child_env, mps_env};
use fail::Fail;
use lease::{keep_lease, lease, lease_request};

use crate::client::{Client, ConnectError};
use crate::inject::find_shim;

pub fn main(args: RunArgs) -> u8 {
    match run(args) {
        Ok(code) => code,
        Err(f) => {
            eprintln!("gpufrac run: {}", f.msg);
            f.code
        }
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

/// A cap of `b` bytes per GPU, when no GPU of `totals` has that much: the
/// job could never use it, and a size past every GPU is a slip (64G for
/// 6.4G) that would run uncapped in effect. The broker refuses the same
/// request the same way; without one, nothing else would.
fn fits_a_gpu(b: u64, totals: &[u64]) -> Result<(), String> {
    let Some((i, &largest)) = totals.iter().enumerate().max_by_key(|&(i, t)| (*t, !i)) else {
        return Ok(());
    };
    if b <= largest {
        return Ok(());
    }
    Err(format!(
        "--gpu-memory {} is more than any GPU here has: the largest has {} (GPU {i}); ask for \
         at most --gpu-memory {}",
        format_size(b),
        format_size(largest),
        gpufrac_common::size::format_size_arg(largest)
    ))
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
    // Before anything is asked of the broker: nothing queued, nothing booked.
    if let Some(why) = crate::container::refusal(&args.command) {
        return Err(Fail::new(2, why));
    }
    let started = std::time::Instant::now();
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
    // The lease request goes with the Hello, one round trip to the
    // broker, unless a percent of a GPU waits for the broker's GPU sizes.
    let asked = !matches!(args.gpu_memory, Some(MemLimit::Percent(_)));
    let connected = if asked {
        Client::connect_asking(&socket, &lease_request(&args, mem, 0, Vec::new()))
    } else {
        Client::connect(&socket)
    };
    let placement = match connected {
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
            if let Some(m) = args.gpu_memory {
                // The child sees the GPUs this process sees.
                let totals = gpufrac_broker::gpus::discover()
                    .map(|gpus| gpus.iter().map(|g| g.total_mem).collect::<Vec<_>>());
                if let MemLimit::Percent(_) = m {
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
                if let (Some(b), Ok(totals)) = (mem, &totals) {
                    fits_a_gpu(b, totals).map_err(|e| Fail::new(1, e))?;
                }
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
            let (client, g) = lease(client, &args, mem, &socket, asked)?;
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
        Some(at) => crate::container::wrap(&args.command, at, &env, &shim, &child_socket),
        None => args.command.clone(),
    };
    if held.is_some() {
        // Descendants that daemonise are re-parented here rather than to
        // init, so the broker still finds them under this job.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
    let token = held.as_ref().map(|h| h.1);
    if let Some((client, _, req)) = held {
        let socket = socket.clone();
        child::without_forwarded_signals(|_| {
            std::thread::Builder::new()
                .name("lease-keeper".into())
                .spawn(move || keep_lease(client, req, socket))
        })
        .map_err(|e| Fail::new(1, format!("cannot start a thread: {e}")))?;
    }
    let status = spawn_and_wait(&command, &env);
    drop(books);
    let code = exit_code(status?);
    // While the lease still holds: the broker's figures are the job's.
    summary::finish(&socket, token, args.report.as_deref(), started, code);
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::env::ChildEnv;
    use super::lease::describe_want;
    use super::*;
    use clap::Parser;
    use gpufrac_common::config::Priority;
    use std::os::unix::process::ExitStatusExt;
    use std::path::Path;

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
    fn a_cap_must_fit_the_largest_gpu() {
        assert_eq!(fits_a_gpu(16 << 30, &[8 << 30, 16 << 30]), Ok(()));
        assert_eq!(
            fits_a_gpu(64 << 30, &[]),
            Ok(()),
            "nothing known, nothing refused"
        );
        let e = fits_a_gpu((16 << 30) + 1, &[16 << 30, 8 << 30, 16 << 30]).unwrap_err();
        assert!(
            e.contains("the largest has 16.00 GiB (GPU 0); ask for at most --gpu-memory 16G"),
            "{e}"
        );
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
