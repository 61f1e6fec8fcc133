//! One memory cap for a whole job: `gpufrac run --gpu-memory SIZE` caps all
//! of its processes together (with a broker and without one), memory of a
//! process that dies returns to the job at once, and plain `GPU_MEM_LIMIT`
//! stays per process.

mod support;
use std::process::{Command, Output, Stdio};
use support::*;

/// `gpufrac run` with no broker to talk to.
fn run_alone(args: &[&str]) -> Command {
    let mut cmd = sim_command(&artifacts().gpufrac, "16G", false);
    cmd.env_remove("GPUFRAC_BROKER")
        .args(["run", "--socket", "/nonexistent/gpufrac.sock"])
        .args(args);
    cmd
}

/// Kernel counts of every `fill` line in the output.
fn fills(o: &Output) -> Vec<u64> {
    stdout(o)
        .lines()
        .filter(|l| l.starts_with("fill "))
        .map(|l| {
            l.split_whitespace()
                .find_map(|kv| kv.strip_prefix("count="))
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// Three processes of one job, each filling the GPU with 64 MiB blocks and
/// holding them while the others try.
fn three_fill(probe: &std::path::Path) -> String {
    let p = probe.display();
    format!("for i in 1 2 3; do {p} ctx fill alloc 64M sleep-ms 1500 & done; wait")
}

#[test]
fn a_job_without_a_broker_is_capped_as_a_whole() {
    let o = run_alone(&["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(three_fill(&artifacts().probe))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let f = fills(&o);
    assert_eq!(f.len(), 3, "{}", stdout(&o));
    // Each process alone would have got 16 (1 GiB / 64 MiB): together too.
    assert_eq!(f.iter().sum::<u64>(), 16, "{f:?}");
}

#[test]
fn a_job_with_a_broker_is_capped_as_a_whole_and_status_shows_its_total() {
    let b = Broker::start("16G", &[]);
    let p = artifacts().probe.display().to_string();
    let script = format!("for i in 1 2; do {p} ctx fill alloc 64M sleep-ms 3000 & done; wait");
    let child = b
        .run(&["--gpu-memory", "1G", "--", "sh", "-c"])
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both processes registered under the job, together at the job's cap.
    wait_until(20.0, "the job's total in status", || {
        let s = b.status();
        let procs = s["gpus"][0]["processes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        procs.len() == 2
            && procs
                .iter()
                .all(|p| p["job_mem_used"].as_u64() == Some(GIB) && p["job"].is_u64())
    });
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o).iter().sum::<u64>(), 16, "{}", stdout(&o));
}

#[test]
fn memory_of_a_killed_process_returns_to_the_job_at_once() {
    let dir = Scratch::new("jobkill");
    let p = artifacts().probe.display().to_string();
    let first = dir.0.join("first.out");
    // The first process fills the cap and hangs on; once it has, it is
    // killed with SIGKILL (its shim has no chance to say anything) and a
    // second process must get the whole cap again.
    let script = format!(
        "{p} ctx fill alloc 64M sleep-ms 60000 > {f} & P=$!; \
         until grep -q '^fill' {f} 2>/dev/null; do sleep 0.01; done; \
         kill -9 $P; wait $P; cat {f}; {p} ctx fill alloc 64M",
        f = first.display()
    );
    let o = run_alone(&["--gpu-memory", "1G", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16, 16], "{}", stdout(&o));
}

#[test]
fn plain_gpu_mem_limit_stays_per_process() {
    let a = artifacts();
    let o = sim_command("sh", "16G", true)
        .env("GPU_MEM_LIMIT", "1G")
        .args(["-c", &three_fill(&a.probe)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16, 16, 16], "{}", stdout(&o));
}

#[test]
fn the_jobs_books_are_removed_when_it_ends() {
    let o = run_alone(&[
        "--gpu-memory",
        "1G",
        "--",
        "sh",
        "-c",
        "echo $GPUFRAC_JOB_LEDGER",
    ])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let path = stdout(&o).trim().to_string();
    assert!(path.contains("gpufrac-job-"), "{path}");
    assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
}

/// A process that does not descend from the job's `run` (a container's,
/// whose parent is the container runtime) joins the job by the token run
/// puts in the environment, and shares its memory cap; a wrong token makes
/// it its user's, uncapped.
#[test]
fn a_process_outside_the_run_joins_the_job_by_its_token() {
    use std::io::{BufRead, BufReader};
    let b = Broker::start("16G", &[]);
    let mut run = KillOnDrop(
        b.run(&["--gpu-memory", "1G", "--", "sh", "-c"])
            .arg("echo \"$GPUFRAC_JOB $GPUFRAC_JOB_LEDGER\"; cat > /dev/null")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let run_pid = run.0.id();
    let mut line = String::new();
    BufReader::new(run.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let (token, books) = line.trim().split_once(' ').expect("token and books");
    assert_eq!(token.len(), 16, "{line}");
    let outsider = |token: &str| {
        b.client(&artifacts().probe)
            .env("GPUFRAC_JOB", token)
            .env("GPUFRAC_JOB_LEDGER", books)
            .args(["ctx", "fill", "alloc", "64M", "sleep-ms", "1500"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let joined = outsider(token);
    let pid = joined.id();
    wait_until(20.0, "the outsider in the job", || {
        b.status()["gpus"][0]["processes"]
            .as_array()
            .is_some_and(|ps| {
                ps.iter().any(|p| {
                    p["pid"].as_u64() == Some(u64::from(pid))
                        && p["job"].as_u64() == Some(u64::from(run_pid))
                })
            })
    });
    let o = joined.wait_with_output().unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![16], "{}", stdout(&o));

    // Another job's token: not this job's (a token no job holds counts for
    // nothing), so the process is its user's, under no cap.
    let wrong = if token == "0000000000000001" {
        "0000000000000002"
    } else {
        "0000000000000001"
    };
    let o = b
        .client(&artifacts().probe)
        .env("GPUFRAC_JOB", wrong)
        .args(["ctx", "fill", "alloc", "64M"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(fills(&o), vec![256], "{}", stdout(&o));
    drop(run.0.stdin.take());
    assert!(run.0.wait().unwrap().success());
}
