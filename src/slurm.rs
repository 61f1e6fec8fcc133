//! `gpufrac slurm-task-prolog`: a Slurm TaskProlog that turns a job's
//! `gres/shard` allocation into the shim's environment.
//!
//! slurmstepd runs a TaskProlog before every task, as the job's user and
//! with the task's environment, and applies the `export NAME=value` and
//! `unset NAME` lines it prints on stdout to the task. For a step that holds
//! k shards on this node, drawn from the m GPUs in `CUDA_VISIBLE_DEVICES`,
//! with t of its tasks on this node and every GPU split into N shards, this
//! prints:
//!
//! - `LD_PRELOAD`: libgpufrac.so in front of what the task already preloads;
//! - `GPU_MEM_LIMIT`: k/(N·m·t) of each GPU, as a percentage, so the step's
//!   tasks together stay within the memory their shards stand for;
//! - `GPU_COMPUTE_SHARE`: k/(N·m), the step's share, since the broker splits
//!   a unit's share among its processes itself;
//! - `GPUFRAC_SOCKET` when `--socket` is given;
//! - `unset GPU_MEM_LIMIT_<n>` for every per-device override the task
//!   carries, since any of them would beat the shard cap.
//!
//! A task with no shards gets nothing. Slurm fails a task whose TaskProlog
//! fails, so anything that goes wrong at run time is reported on stderr and
//! the task runs as it would without gpufrac; only invalid options (which
//! clap rejects before `main`) exit non-zero.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use clap::Args;
use gpufrac_common::config::{VAR_COMPUTE_SHARE, VAR_MEM_LIMIT, VAR_MEM_LIMIT_PREFIX, VAR_SOCKET};

use crate::inject::SHIM_NAME;

const PROLOG_EXAMPLES: &str = "\
Examples:
  gpufrac slurm-task-prolog --shards-per-gpu 8
  gpufrac slurm-task-prolog --shards-per-gpu 8 --socket /run/gpufrac/broker.sock

slurm.conf:   TaskProlog=/usr/local/libexec/gpufrac-task-prolog
              (a script that execs this command; see docs/slurm.md)
gres.conf:    Name=shard Count=8 File=/dev/nvidia0   (Count = --shards-per-gpu)

A task holding k of a GPU's N shards gets LD_PRELOAD=libgpufrac.so,
GPU_MEM_LIMIT=k/N of the GPU as a percentage (split among the step's tasks on
the node) and GPU_COMPUTE_SHARE=k/N. Tasks without shards get nothing.";

/// Enough for any real split; it keeps the percentages printable to a
/// millionth without rounding to zero.
const MAX_SHARDS_PER_GPU: u32 = 1_000_000;

/// `sun_path` holds 107 bytes and a NUL.
const MAX_SOCKET_PATH: usize = 107;

const VAR_SHARDS: &str = "SLURM_SHARDS_ON_NODE";
const VAR_VISIBLE: &str = "CUDA_VISIBLE_DEVICES";
const VAR_STEP_TASKS: &str = "SLURM_STEP_TASKS_PER_NODE";
const VAR_NODEID: &str = "SLURM_NODEID";
const VAR_PRELOAD: &str = "LD_PRELOAD";

/// Percentages are computed in millionths of a percent.
const PERCENT: u128 = 1_000_000;

#[derive(Args, Debug)]
#[command(after_help = PROLOG_EXAMPLES)]
pub struct PrologArgs {
    /// How many shards each GPU is split into: the Count of each GPU's
    /// `Name=shard` line in gres.conf.
    #[arg(long, value_name = "N", value_parser = shards_per_gpu)]
    pub shards_per_gpu: u32,
    /// Broker socket for the task's processes, exported as GPUFRAC_SOCKET
    /// [default: the task's own GPUFRAC_SOCKET, else /run/gpufrac/broker.sock]
    #[arg(long, value_name = "PATH", value_parser = socket)]
    pub socket: Option<PathBuf>,
}

fn shards_per_gpu(s: &str) -> Result<u32, String> {
    let example = "expected the Count of shards per GPU in gres.conf, such as --shards-per-gpu 8";
    match s.trim().parse::<u64>() {
        Ok(0) => Err(format!("must be at least 1; {example}")),
        Ok(n) if n > u64::from(MAX_SHARDS_PER_GPU) => {
            Err(format!("must be at most {MAX_SHARDS_PER_GPU}; {example}"))
        }
        Ok(n) => Ok(n as u32),
        Err(_) => Err(format!("not a whole number; {example}")),
    }
}

fn socket(s: &str) -> Result<PathBuf, String> {
    let example = "expected an absolute socket path such as /run/gpufrac/broker.sock";
    if !s.starts_with('/') {
        // A relative path would be resolved in each job's own directory.
        return Err(format!("must be absolute; {example}"));
    }
    if s.contains('\n') {
        return Err(format!("contains a newline; {example}"));
    }
    if s.len() > MAX_SOCKET_PATH {
        return Err(format!(
            "is {} bytes long, and Unix socket paths are limited to {MAX_SOCKET_PATH}; {example}",
            s.len()
        ));
    }
    Ok(PathBuf::from(s))
}

/// One line for slurmstepd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Line {
    Export(String, OsString),
    Unset(String),
}

/// What to print: `lines` on stdout, `notes` on stderr.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub lines: Vec<Line>,
    pub notes: Vec<String>,
}

impl Plan {
    fn note(msg: String) -> Plan {
        Plan {
            lines: Vec::new(),
            notes: vec![msg],
        }
    }

    /// The stdout text, as slurmstepd parses it: everything after `=` up to
    /// the end of the line is the value.
    pub(crate) fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for l in &self.lines {
            match l {
                Line::Export(name, value) => {
                    out.extend_from_slice(b"export ");
                    out.extend_from_slice(name.as_bytes());
                    out.push(b'=');
                    out.extend_from_slice(value.as_bytes());
                }
                Line::Unset(name) => {
                    out.extend_from_slice(b"unset ");
                    out.extend_from_slice(name.as_bytes());
                }
            }
            out.push(b'\n');
        }
        out
    }
}

/// The task's environment; the first occurrence of a name counts, as for
/// `getenv`.
pub(crate) struct TaskEnv(pub Vec<(OsString, OsString)>);

impl TaskEnv {
    fn get(&self, name: &str) -> Option<&OsStr> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_os_str())
    }

    fn get_str(&self, name: &str) -> Option<Result<&str, String>> {
        self.get(name).map(|v| {
            v.to_str()
                .ok_or_else(|| format!("{name}={v:?} is not valid UTF-8"))
        })
    }
}

/// Decides what the task gets. `shim` is only asked for when the task
/// holds shards, so jobs without them never touch the filesystem.
pub(crate) fn plan(
    shards_per_gpu: u32,
    socket: Option<&Path>,
    env: &TaskEnv,
    shim: impl FnOnce() -> Result<PathBuf, String>,
) -> Plan {
    const UNCAPPED: &str = "the task runs without gpufrac";
    let shards = match env.get_str(VAR_SHARDS) {
        None => return Plan::default(),
        Some(Err(e)) => return Plan::note(format!("{e}; {UNCAPPED}")),
        Some(Ok(s)) if s.trim().is_empty() => return Plan::default(),
        Some(Ok(s)) => match s.trim().parse::<u64>() {
            Ok(0) => return Plan::default(),
            Ok(k) => k,
            Err(_) => {
                return Plan::note(format!(
                    "{VAR_SHARDS}={s:?} is not a whole number of shards; {UNCAPPED}"
                ));
            }
        },
    };
    let gpus = match visible_gpus(env.get(VAR_VISIBLE)) {
        0 => return Plan::default(),
        m => m,
    };
    let mut notes = Vec::new();
    let tasks = tasks_on_node(env).unwrap_or_else(|e| {
        notes.push(format!("{e}; capping each task at the whole step's memory"));
        1
    });

    let per_gpu = u128::from(shards_per_gpu) * gpus as u128;
    let mut share = u128::from(shards) * 100 * PERCENT / per_gpu;
    if share > 100 * PERCENT {
        notes.push(format!(
            "{VAR_SHARDS}={shards} on {gpus} GPU{} is more than --shards-per-gpu {shards_per_gpu} \
             allows; set --shards-per-gpu to the Count of each GPU's Name=shard line in \
             gres.conf. Capping at the whole GPU",
            if gpus == 1 { "" } else { "s" }
        ));
        share = 100 * PERCENT;
    }
    // At least a millionth of a percent: a zero cap would mean "no cap".
    let mem = (share / tasks as u128).max(1);

    let preload = match shim().and_then(|s| preload(&s, env.get(VAR_PRELOAD))) {
        Ok(p) => p,
        Err(e) => {
            notes.push(format!("{e}; {UNCAPPED}"));
            return Plan {
                lines: Vec::new(),
                notes,
            };
        }
    };

    let mut lines = Vec::new();
    if let Some(p) = preload {
        lines.push(Line::Export(VAR_PRELOAD.into(), p));
    }
    lines.push(Line::Export(
        VAR_MEM_LIMIT.into(),
        format!("{}%", percent(mem)).into(),
    ));
    lines.push(Line::Export(
        VAR_COMPUTE_SHARE.into(),
        format!("{}%", percent(share)).into(),
    ));
    if let Some(s) = socket {
        lines.push(Line::Export(VAR_SOCKET.into(), s.as_os_str().into()));
    }
    for (k, _) in &env.0 {
        let Some(name) = k.to_str() else { continue };
        let is_override = name
            .strip_prefix(VAR_MEM_LIMIT_PREFIX)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        let line = Line::Unset(name.to_owned());
        if is_override && !lines.contains(&line) {
            lines.push(line);
        }
    }
    Plan { lines, notes }
}

/// How many GPUs the task sees: unset means every GPU of the node, of
/// which the shards are on one; empty or Slurm's `NoDevFiles` means none.
fn visible_gpus(v: Option<&OsStr>) -> usize {
    let Some(v) = v else { return 1 };
    let v = v.to_string_lossy();
    if v.trim() == "NoDevFiles" {
        return 0;
    }
    v.split(',').filter(|d| !d.trim().is_empty()).count()
}

/// The step's tasks on this node, from `SLURM_STEP_TASKS_PER_NODE` ("2",
/// "2(x3),1") at `SLURM_NODEID`. A batch script's step has neither: one
/// task.
fn tasks_on_node(env: &TaskEnv) -> Result<usize, String> {
    let Some(spec) = env.get_str(VAR_STEP_TASKS) else {
        return Ok(1);
    };
    let spec = spec?;
    let node = match env.get_str(VAR_NODEID) {
        Some(Ok(n)) => n
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("{VAR_NODEID}={n:?} is not a node index"))?,
        Some(Err(e)) => return Err(e),
        None => return Err(format!("{VAR_STEP_TASKS} is set but {VAR_NODEID} is not")),
    };
    let bad = || format!("{VAR_STEP_TASKS}={spec:?} is not a task count list such as 2(x3),1");
    let mut index = 0usize;
    for group in spec.split(',') {
        let group = group.trim();
        let (count, repeat) = match group.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (group, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        index = index.saturating_add(repeat);
        if node < index {
            return if count == 0 { Err(bad()) } else { Ok(count) };
        }
    }
    Err(format!(
        "{VAR_STEP_TASKS}={spec:?} has no entry for {VAR_NODEID}={node}"
    ))
}

/// The new `LD_PRELOAD`, with the shim first so that its symbols win over
/// other preloaded libraries' (as `gpufrac run` does); `None` when some
/// libgpufrac.so is already preloaded (a step inherits its batch script's
/// environment), since two shims would each count the same allocations.
fn preload(shim: &Path, existing: Option<&OsStr>) -> Result<Option<OsString>, String> {
    let shim_bytes = shim.as_os_str().as_bytes();
    if shim_bytes
        .iter()
        .any(|b| matches!(b, b':' | b' ' | b'\t' | b'\n'))
    {
        return Err(format!(
            "{} cannot go into {VAR_PRELOAD}, which splits at colons and spaces; install \
             {SHIM_NAME} under a path without them",
            shim.display()
        ));
    }
    let existing = existing.map(OsStr::as_bytes).unwrap_or_default();
    if existing.contains(&b'\n') {
        return Err(format!(
            "the task's {VAR_PRELOAD} holds a newline, which an export line cannot carry"
        ));
    }
    let entries = existing
        .split(|b| matches!(b, b':' | b' ' | b'\t'))
        .filter(|e| !e.is_empty());
    let mut has_shim = false;
    let mut rest = Vec::new();
    for e in entries {
        has_shim |= Path::new(OsStr::from_bytes(e))
            .file_name()
            .is_some_and(|n| n == SHIM_NAME);
        rest.push(e);
    }
    if has_shim {
        return Ok(None);
    }
    let mut out = shim_bytes.to_vec();
    for e in rest {
        out.push(b':');
        out.extend_from_slice(e);
    }
    Ok(Some(OsStr::from_bytes(&out).to_owned()))
}

/// Millionths of a percent as the shortest exact decimal, truncated (never
/// rounded up) to six places: 25000000 → "25", 12500000 → "12.5".
fn percent(millionths: u128) -> String {
    let whole = millionths / PERCENT;
    let frac = millionths % PERCENT;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:06}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

fn warn(msg: &str) {
    // Not eprintln!: a closed stderr must not turn into a panic and a
    // failed task.
    let _ = writeln!(std::io::stderr().lock(), "gpufrac slurm-task-prolog: {msg}");
}

pub fn main(args: PrologArgs) -> u8 {
    let env = TaskEnv(std::env::vars_os().collect());
    let decided = std::panic::catch_unwind(|| {
        plan(
            args.shards_per_gpu,
            args.socket.as_deref(),
            &env,
            crate::inject::find_shim,
        )
    });
    let plan = match decided {
        Ok(p) => p,
        Err(_) => Plan::note("internal error (see above); the task runs without gpufrac".into()),
    };
    for n in &plan.notes {
        warn(n);
    }
    let text = plan.render();
    if !text.is_empty() {
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(&text).and_then(|()| out.flush()) {
            warn(&format!("cannot write to stdout: {e}"));
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHIM: &str = "/opt/gpufrac/lib/libgpufrac.so";

    fn env(vars: &[(&str, &str)]) -> TaskEnv {
        TaskEnv(
            vars.iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)))
                .collect(),
        )
    }

    fn run(n: u32, vars: &[(&str, &str)]) -> Plan {
        plan(n, None, &env(vars), || Ok(PathBuf::from(SHIM)))
    }

    fn exports(p: &Plan) -> Vec<(String, String)> {
        p.lines
            .iter()
            .filter_map(|l| match l {
                Line::Export(k, v) => Some((k.clone(), v.to_string_lossy().into_owned())),
                Line::Unset(_) => None,
            })
            .collect()
    }

    fn var(p: &Plan, name: &str) -> Option<String> {
        exports(p)
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    #[test]
    fn two_of_eight_shards_is_a_quarter() {
        let p = run(
            8,
            &[("SLURM_SHARDS_ON_NODE", "2"), ("CUDA_VISIBLE_DEVICES", "0")],
        );
        assert_eq!(
            String::from_utf8(p.render()).unwrap(),
            format!(
                "export LD_PRELOAD={SHIM}\nexport GPU_MEM_LIMIT=25%\nexport GPU_COMPUTE_SHARE=25%\n"
            )
        );
        assert!(p.notes.is_empty(), "{:?}", p.notes);
    }

    #[test]
    fn no_shards_no_output_and_no_shim_lookup() {
        for vars in [
            &[][..],
            &[("SLURM_SHARDS_ON_NODE", "")][..],
            &[("SLURM_SHARDS_ON_NODE", "0"), ("CUDA_VISIBLE_DEVICES", "0")][..],
            // Whole GPUs, no shards.
            &[("CUDA_VISIBLE_DEVICES", "0,1"), ("SLURM_GPUS_ON_NODE", "2")][..],
        ] {
            let p = plan(8, None, &env(vars), || {
                panic!("shim looked up for {vars:?}")
            });
            assert_eq!(p, Plan::default(), "{vars:?}");
        }
    }

    #[test]
    fn shards_but_no_gpu_visible_is_silent() {
        for cvd in ["", " ", "NoDevFiles", ","] {
            let p = run(
                8,
                &[("SLURM_SHARDS_ON_NODE", "2"), ("CUDA_VISIBLE_DEVICES", cvd)],
            );
            assert_eq!(p, Plan::default(), "{cvd:?}");
        }
        // Unset: the task sees every GPU, and its shards are on one of them.
        let p = run(8, &[("SLURM_SHARDS_ON_NODE", "2")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("25%"));
    }

    #[test]
    fn fractions_are_truncated_never_rounded_up() {
        let p = run(3, &[("SLURM_SHARDS_ON_NODE", "1")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("33.333333%"));
        let p = run(3, &[("SLURM_SHARDS_ON_NODE", "2")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("66.666666%"));
        let p = run(8, &[("SLURM_SHARDS_ON_NODE", "1")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("12.5%"));
        let p = run(8, &[("SLURM_SHARDS_ON_NODE", "8")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("100%"));
        let p = run(MAX_SHARDS_PER_GPU, &[("SLURM_SHARDS_ON_NODE", "1")]);
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("0.0001%"));
        assert_eq!(percent(1), "0.000001");
        assert_eq!(percent(100 * PERCENT), "100");
    }

    #[test]
    fn every_printed_percentage_is_one_the_shim_accepts() {
        for n in [1, 3, 7, 8, 100, 1000, MAX_SHARDS_PER_GPU] {
            for k in [1u64, 2, 3, u64::from(n)]
                .into_iter()
                .filter(|&k| k <= u64::from(n))
            {
                for t in ["1", "3", "64"] {
                    let shards = k.to_string();
                    let p = run(
                        n,
                        &[
                            ("SLURM_SHARDS_ON_NODE", &shards),
                            ("SLURM_STEP_TASKS_PER_NODE", t),
                            ("SLURM_NODEID", "0"),
                        ],
                    );
                    let vars: Vec<(String, String)> = exports(&p);
                    let cfg = gpufrac_common::config::from_vars(
                        vars.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    )
                    .unwrap_or_else(|e| panic!("N={n} k={k} t={t}: {e}"));
                    let gpufrac_common::size::MemLimit::Percent(pct) = cfg.mem_limit else {
                        panic!("N={n} k={k} t={t}: {:?}", cfg.mem_limit)
                    };
                    // One correctly rounded division, as monotonic as parsing.
                    let exact = (k as f64 * 100.0) / (f64::from(n) * t.parse::<f64>().unwrap());
                    assert!(
                        pct <= exact && exact - pct < 1e-6,
                        "N={n} k={k} t={t}: {pct} for {exact}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_steps_tasks_on_the_node_split_its_memory_not_its_share() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "4"),
                ("SLURM_STEP_TASKS_PER_NODE", "4"),
                ("SLURM_NODEID", "0"),
            ],
        );
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("12.5%"));
        assert_eq!(var(&p, "GPU_COMPUTE_SHARE").as_deref(), Some("50%"));
        assert!(p.notes.is_empty());
    }

    #[test]
    fn task_counts_per_node() {
        let count = |spec: &str, node: &str| {
            tasks_on_node(&env(&[
                ("SLURM_STEP_TASKS_PER_NODE", spec),
                ("SLURM_NODEID", node),
            ]))
        };
        assert_eq!(count("2", "0"), Ok(2));
        assert_eq!(count("2(x3),1", "0"), Ok(2));
        assert_eq!(count("2(x3),1", "2"), Ok(2));
        assert_eq!(count("2(x3),1", "3"), Ok(1));
        assert_eq!(count("1,4,2", "1"), Ok(4));
        assert!(count("2(x3),1", "4").unwrap_err().contains("no entry"));
        for bad in ["", "x", "2(x", "2(x3", "2(3),1", "-1", "0"] {
            assert!(
                count(bad, "0").unwrap_err().contains("such as 2(x3),1"),
                "{bad:?}"
            );
        }
        assert!(count("2", "a").unwrap_err().contains("SLURM_NODEID"));
        assert_eq!(tasks_on_node(&env(&[])), Ok(1), "a batch step");
        assert!(
            tasks_on_node(&env(&[("SLURM_STEP_TASKS_PER_NODE", "2")]))
                .unwrap_err()
                .contains("SLURM_NODEID")
        );
    }

    #[test]
    fn an_unreadable_task_count_still_caps_with_a_note() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "2"),
                ("SLURM_STEP_TASKS_PER_NODE", "two"),
                ("SLURM_NODEID", "0"),
            ],
        );
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("25%"));
        assert_eq!(p.notes.len(), 1);
        assert!(
            p.notes[0].contains("SLURM_STEP_TASKS_PER_NODE=\"two\""),
            "{:?}",
            p.notes
        );
    }

    #[test]
    fn shards_from_several_gpus_are_spread_evenly() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "4"),
                ("CUDA_VISIBLE_DEVICES", "0,1"),
            ],
        );
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("25%"));
        assert_eq!(var(&p, "GPU_COMPUTE_SHARE").as_deref(), Some("25%"));
        // 12 shards of 8 per GPU can only come from two GPUs or more.
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "12"),
                ("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb"),
            ],
        );
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("75%"));
        assert!(p.notes.is_empty());
    }

    #[test]
    fn more_shards_than_the_gpus_hold_is_a_misconfiguration_capped_at_the_whole_gpu() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "12"),
                ("CUDA_VISIBLE_DEVICES", "0"),
            ],
        );
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("100%"));
        assert_eq!(var(&p, "GPU_COMPUTE_SHARE").as_deref(), Some("100%"));
        assert_eq!(p.notes.len(), 1);
        assert!(
            p.notes[0].contains("--shards-per-gpu 8") && p.notes[0].contains("gres.conf"),
            "{}",
            p.notes[0]
        );
    }

    #[test]
    fn malformed_shard_counts_say_so_and_change_nothing() {
        for bad in ["two", "-1", "2.5", "1e3"] {
            let p = run(8, &[("SLURM_SHARDS_ON_NODE", bad)]);
            assert!(p.lines.is_empty(), "{bad}");
            assert_eq!(p.notes.len(), 1);
            assert!(
                p.notes[0].contains("SLURM_SHARDS_ON_NODE")
                    && p.notes[0].contains("without gpufrac"),
                "{}",
                p.notes[0]
            );
        }
    }

    #[test]
    fn a_missing_shim_says_so_and_changes_nothing() {
        let p = plan(8, None, &env(&[("SLURM_SHARDS_ON_NODE", "2")]), || {
            Err("cannot find libgpufrac.so: looked in /x".into())
        });
        assert!(p.lines.is_empty());
        assert_eq!(
            p.notes,
            vec!["cannot find libgpufrac.so: looked in /x; the task runs without gpufrac"]
        );
    }

    #[test]
    fn preload_goes_in_front_once() {
        let shim = Path::new(SHIM);
        let p = |e: Option<&str>| {
            preload(shim, e.map(OsStr::new)).map(|o| o.map(|s| s.into_string().unwrap()))
        };
        assert_eq!(p(None), Ok(Some(SHIM.into())));
        assert_eq!(p(Some("")), Ok(Some(SHIM.into())));
        assert_eq!(p(Some("/a.so")), Ok(Some(format!("{SHIM}:/a.so"))));
        assert_eq!(
            p(Some("/a.so /b.so::/c.so")),
            Ok(Some(format!("{SHIM}:/a.so:/b.so:/c.so")))
        );
        // Already there, from this install or another: left as it is.
        assert_eq!(p(Some(&format!("/a.so:{SHIM}"))), Ok(None));
        assert_eq!(p(Some("/home/u/build/libgpufrac.so")), Ok(None));
        assert_eq!(
            p(Some("/x/libgpufrac.so.bak")),
            Ok(Some(format!("{SHIM}:/x/libgpufrac.so.bak")))
        );
        assert!(p(Some("/a.so\n/b.so")).unwrap_err().contains("newline"));
        let spaced = preload(Path::new("/opt/my gpufrac/libgpufrac.so"), None).unwrap_err();
        assert!(spaced.contains("colons and spaces"), "{spaced}");
    }

    #[test]
    fn an_existing_preload_is_kept_in_the_export() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "2"),
                ("LD_PRELOAD", "/usr/lib/libtcmalloc.so"),
            ],
        );
        assert_eq!(
            var(&p, "LD_PRELOAD"),
            Some(format!("{SHIM}:/usr/lib/libtcmalloc.so"))
        );
        let p = run(8, &[("SLURM_SHARDS_ON_NODE", "2"), ("LD_PRELOAD", SHIM)]);
        assert_eq!(var(&p, "LD_PRELOAD"), None, "inherited from the batch step");
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("25%"));
    }

    #[test]
    fn per_device_overrides_are_unset() {
        let p = run(
            8,
            &[
                ("SLURM_SHARDS_ON_NODE", "2"),
                ("GPU_MEM_LIMIT_0", "0"),
                ("GPU_MEM_LIMIT_12", "80G"),
                ("GPU_MEM_LIMIT_0", "1G"),
                ("GPU_MEM_LIMIT_X", "1G"),
                ("GPU_MEM_LIMIT", "100%"),
            ],
        );
        let unsets: Vec<&Line> = p
            .lines
            .iter()
            .filter(|l| matches!(l, Line::Unset(_)))
            .collect();
        assert_eq!(
            unsets,
            vec![
                &Line::Unset("GPU_MEM_LIMIT_0".into()),
                &Line::Unset("GPU_MEM_LIMIT_12".into())
            ]
        );
        // The user's own GPU_MEM_LIMIT is replaced by the export.
        assert_eq!(var(&p, "GPU_MEM_LIMIT").as_deref(), Some("25%"));
    }

    #[test]
    fn socket_is_exported_only_when_given() {
        let e = env(&[("SLURM_SHARDS_ON_NODE", "2")]);
        let p = plan(8, Some(Path::new("/run/gf/b.sock")), &e, || Ok(SHIM.into()));
        assert_eq!(var(&p, "GPUFRAC_SOCKET").as_deref(), Some("/run/gf/b.sock"));
        let p = plan(8, None, &e, || Ok(SHIM.into()));
        assert_eq!(var(&p, "GPUFRAC_SOCKET"), None);
    }

    #[test]
    fn options() {
        use clap::Parser;
        #[derive(Parser, Debug)]
        struct T {
            #[command(flatten)]
            a: PrologArgs,
        }
        let parse =
            |args: &[&str]| T::try_parse_from(std::iter::once("t").chain(args.iter().copied()));
        let t = parse(&["--shards-per-gpu", "8"]).unwrap();
        assert_eq!(t.a.shards_per_gpu, 8);
        assert!(t.a.socket.is_none());
        let t = parse(&["--shards-per-gpu", "4", "--socket", "/run/x.sock"]).unwrap();
        assert_eq!(t.a.socket, Some(PathBuf::from("/run/x.sock")));
        let err = |args: &[&str]| parse(args).unwrap_err().to_string();
        for bad in ["0", "-1", "eight", "1.5", "1000001"] {
            let e = err(&[&format!("--shards-per-gpu={bad}")]);
            assert!(
                e.contains("--shards-per-gpu") && e.contains("such as --shards-per-gpu 8"),
                "{bad}: {e}"
            );
        }
        assert!(err(&["--shards-per-gpu", "0"]).contains("at least 1"));
        assert!(err(&[]).contains("--shards-per-gpu"));
        let e = err(&["--shards-per-gpu", "8", "--socket", "broker.sock"]);
        assert!(e.contains("--socket") && e.contains("absolute"), "{e}");
        let long = format!("/{}", "s".repeat(MAX_SOCKET_PATH));
        let e = err(&["--shards-per-gpu", "8", "--socket", &long]);
        assert!(e.contains("limited to 107"), "{e}");
    }
}
