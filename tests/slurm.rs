//! `gpufrac slurm-task-prolog`: on its own, and as the TaskProlog of a real
//! one-node Slurm cluster configured from deploy/slurm/ as docs/slurm.md
//! says, whose `srun` tasks run the probe against the simulated driver.

mod support;
use support::*;

#[path = "support/slurm.rs"]
mod slurm_support;
use slurm_support::{Cluster, config_lines};

use std::path::Path;
use std::process::{Command, Output};

const DEVICE: &str = "16G";

/// The prolog run by hand with exactly `env` from the Slurm side.
fn prolog(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(&artifacts().gpufrac);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .arg("slurm-task-prolog")
        .args(args)
        .envs(env.iter().copied());
    cmd.output().expect("running gpufrac slurm-task-prolog")
}

fn shim_path() -> String {
    artifacts()
        .shim
        .canonicalize()
        .unwrap()
        .display()
        .to_string()
}

/// A library a task may already preload (an interposer on `puts`, which
/// neither gpufrac nor the probe calls).
fn other_preload() -> String {
    artifacts()
        .fixtures
        .join("librtldnext.so")
        .display()
        .to_string()
}

#[test]
fn a_task_with_shards_gets_the_shim_a_cap_and_a_share() {
    let other = other_preload();
    let o = prolog(
        &["--shards-per-gpu", "8"],
        &[
            ("SLURM_SHARDS_ON_NODE", "2"),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("LD_PRELOAD", &other),
            ("GPU_MEM_LIMIT_0", "0"),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert_eq!(
        stdout(&o),
        format!(
            "export LD_PRELOAD={}:{other}\nexport GPU_MEM_LIMIT=25%\n\
             export GPU_COMPUTE_SHARE=25%\nunset GPU_MEM_LIMIT_0\n",
            shim_path()
        )
    );
    let o = prolog(
        &[
            "--shards-per-gpu",
            "8",
            "--socket",
            "/run/other/broker.sock",
        ],
        &[("SLURM_SHARDS_ON_NODE", "2")],
    );
    assert!(
        stdout(&o).ends_with("export GPUFRAC_SOCKET=/run/other/broker.sock\n"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn a_task_without_shards_gets_nothing() {
    for env in [
        &[][..],
        &[("CUDA_VISIBLE_DEVICES", "0"), ("SLURM_GPUS_ON_NODE", "1")][..],
        &[("SLURM_SHARDS_ON_NODE", "2"), ("CUDA_VISIBLE_DEVICES", "")][..],
    ] {
        let o = prolog(&["--shards-per-gpu", "8"], env);
        assert!(o.status.success(), "{env:?}: {}", stderr(&o));
        assert_eq!(
            (stdout(&o).as_str(), stderr(&o).as_str()),
            ("", ""),
            "{env:?}"
        );
    }
}

/// slurmstepd fails the task when its TaskProlog fails: problems at run
/// time are reported on stderr, stdout stays empty, and the task runs.
#[test]
fn run_time_problems_go_to_stderr_and_exit_zero() {
    let o = prolog(
        &["--shards-per-gpu", "8"],
        &[("SLURM_SHARDS_ON_NODE", "two")],
    );
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(stdout(&o), "");
    assert!(
        stderr(&o).contains("SLURM_SHARDS_ON_NODE=\"two\""),
        "{}",
        stderr(&o)
    );
    let o = prolog(
        &["--shards-per-gpu", "8"],
        &[
            ("SLURM_SHARDS_ON_NODE", "2"),
            ("GPUFRAC_LIB", "/nonexistent/libgpufrac.so"),
        ],
    );
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(stdout(&o), "");
    assert!(
        stderr(&o).contains("/nonexistent/libgpufrac.so")
            && stderr(&o).contains("runs without gpufrac"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn an_invalid_configuration_fails_naming_the_option() {
    for args in [
        &["--shards-per-gpu", "0"][..],
        &["--shards-per-gpu", "eight"][..],
        &[][..],
    ] {
        let o = prolog(args, &[("SLURM_SHARDS_ON_NODE", "2")]);
        assert!(!o.status.success(), "{args:?} accepted");
        assert_eq!(stdout(&o), "", "{args:?}");
        assert!(
            stderr(&o).contains("--shards-per-gpu"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    let o = prolog(&["--shards-per-gpu", "0"], &[]);
    assert!(
        stderr(&o).contains("such as --shards-per-gpu 8"),
        "{}",
        stderr(&o)
    );
}

/// docs/slurm.md shows the shipped files' lines, so what it tells an
/// administrator to write is what the cluster test runs.
#[test]
fn the_docs_show_the_tested_configuration() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/slurm.md")).unwrap();
    for name in [
        "gpufrac-task-prolog",
        "slurm.conf.example",
        "gres.conf.example",
    ] {
        let text = std::fs::read_to_string(root.join("deploy/slurm").join(name)).unwrap();
        for line in config_lines(&text)
            .into_iter()
            .skip_while(|l| l.starts_with("#!"))
        {
            assert!(
                doc.contains(line),
                "docs/slurm.md does not show this line of deploy/slurm/{name}:\n{line}"
            );
        }
    }
}

/// `key=value` pairs of the `env` lines the wrapped tasks print.
fn env_line(o: &Output, n: usize) -> std::collections::HashMap<String, String> {
    line(o, "env", n)
}

/// Runs the probe through `sh`, which first prints what the TaskProlog
/// left in the task's environment.
const SHOW_ENV: &str = "echo \"env preload=${LD_PRELOAD-} mem=${GPU_MEM_LIMIT-} \
                        share=${GPU_COMPUTE_SHARE-}\"; exec \"$@\"";

#[test]
fn srun_tasks_are_capped_by_their_shards() {
    const WHAT: &str = "srun_tasks_are_capped_by_their_shards (a one-node Slurm)";
    if !engines_wanted(WHAT) {
        return;
    }
    let tools = match slurm_support::tools() {
        Ok(t) => t,
        Err(why) => {
            cannot(WHAT, &why);
            return;
        }
    };
    let cluster = match Cluster::start(tools) {
        Ok(c) => c,
        Err(slurm_support::Unable(why)) => {
            cannot(WHAT, &why);
            return;
        }
    };
    let probe = artifacts().probe.display().to_string();
    let shim = shim_path();
    let srun = |args: &[&str]| {
        let o = cluster.srun(DEVICE, args);
        assert!(
            o.status.success(),
            "srun {args:?} failed ({}):\n{}{}\n{}",
            o.status,
            stdout(&o),
            stderr(&o),
            cluster.logs()
        );
        o
    };
    let probe_args = ["ctx", "info", "fill", "alloc", "256M", "info"];
    let wrapped = |slurm: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = slurm.iter().map(|s| s.to_string()).collect();
        v.extend(["sh", "-c", SHOW_ENV, "sh", &probe].map(String::from));
        v.extend(probe_args.map(String::from));
        v
    };
    let srun_owned = |args: Vec<String>| srun(&args.iter().map(String::as_str).collect::<Vec<_>>());

    // 2 of the GPU's 8 shards: a quarter of 16 GiB, and not a byte more.
    // The task's own LD_PRELOAD (set for the task alone, not for srun)
    // stays, behind the shim.
    let other = other_preload();
    let export = format!("--export=ALL,LD_PRELOAD={other}");
    let o = srun_owned(wrapped(&["--gres=shard:2", &export]));
    let env = env_line(&o, 0);
    assert_eq!(env["preload"], format!("{shim}:{other}"), "{}", stdout(&o));
    assert_eq!(env["mem"], "25%");
    assert_eq!(env["share"], "25%");
    let info = line(&o, "info", 0);
    assert_eq!(num(&info, "total"), 4 * GIB, "cuMemGetInfo total");
    assert_eq!(num(&info, "devtotal"), 4 * GIB, "cuDeviceTotalMem");
    let fill = line(&o, "fill", 0);
    assert_eq!(num(&fill, "count"), 16, "16 blocks of 256 MiB fill 4 GiB");
    assert_eq!(num(&fill, "rc"), 2, "then CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(num(&line(&o, "info", 1), "free"), 0);

    // No shards: the prolog stays out, the whole GPU is there.
    let o = srun_owned(wrapped(&[]));
    let env = env_line(&o, 0);
    assert_eq!(
        (
            env["preload"].as_str(),
            env["mem"].as_str(),
            env["share"].as_str()
        ),
        ("", "", ""),
        "{}",
        stdout(&o)
    );
    assert_eq!(num(&line(&o, "info", 0), "total"), 16 * GIB);
    assert_eq!(num(&line(&o, "fill", 0), "count"), 64);

    // Two tasks of one step share its 2 shards: an eighth each.
    let o = srun(&["-n2", "--gres=shard:2", &probe, "ctx", "info"]);
    for n in 0..2 {
        assert_eq!(
            num(&line(&o, "info", n), "total"),
            2 * GIB,
            "task {n}:\n{}",
            stdout(&o)
        );
    }
}
