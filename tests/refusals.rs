//! A refusal by the cap is never mistaken for a full GPU: the shim counts
//! its refusals (`gpufrac_mem_refusals`) and says the first one on stderr at
//! the default log level, naming the device, the cap and what is in use
//! (or that the request alone exceeds the cap), then at most one a second.

mod support;
use std::time::Instant;
use support::*;

/// The refusal lines of a run's stderr; fails on any other line.
fn refusal_lines(o: &std::process::Output) -> Vec<String> {
    let err = stderr(o);
    let lines: Vec<String> = err.lines().map(str::to_owned).collect();
    for l in &lines {
        assert!(l.starts_with("gpufrac: device 0: refused "), "{err}");
    }
    lines
}

#[test]
fn the_first_refusal_is_said_in_one_line_and_counted() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "1G")],
        &["ctx", "refusals", "fill", "alloc", "256M", "refusals"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 4);
    assert_eq!(
        stderr(&o),
        "gpufrac: device 0: refused 256 MiB: cap 1 GiB reached (1 GiB in use)\n",
        "at the default log level"
    );
    let before = line(&o, "refusals", 0);
    assert_eq!(num(&before, "present"), 1);
    assert_eq!(num(&before, "count"), 0);
    assert_eq!(num(&line(&o, "refusals", 1), "count"), 1);
}

/// A request larger than the cap itself would be refused on an empty
/// device: the line says so instead of "cap reached (0 B in use)", and the
/// process is known to have wanted it (`gpufrac_mem_wanted`) though it
/// peaked at nothing.
#[test]
fn a_request_larger_than_the_cap_is_said_to_exceed_it() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "1G")],
        &[
            "ctx", "alloc", "alloc", "2G", "wanted", "alloc", "alloc", "256M", "alloc", "alloc",
            "1G", "wanted",
        ],
    );
    assert_eq!(num(&line(&o, "alloc", 0), "rc"), 2);
    assert_eq!(
        stderr(&o),
        "gpufrac: device 0: refused 2 GiB: the request alone exceeds the cap of 1 GiB (0 B in use)\n",
        "at the default log level"
    );
    let first = line(&o, "wanted", 0);
    assert_eq!(num(&first, "present"), 1);
    assert_eq!(num(&first, "peak"), 0);
    assert_eq!(num(&first, "wanted"), 2 << 30, "the refused request counts");
    // 256 MiB held, then 1 GiB more refused (by the cap, within a second of
    // the first line, so unsaid): 1.25 GiB wanted.
    assert_eq!(num(&line(&o, "alloc", 2), "rc"), 2);
    let second = line(&o, "wanted", 1);
    assert_eq!(num(&second, "peak"), 256 << 20);
    assert_eq!(num(&second, "wanted"), 2 << 30, "the most asked so far");
}

#[test]
fn the_driver_running_out_is_no_refusal() {
    // No cap: the simulated 256 MiB GPU itself runs out.
    let o = probe("256M", &[], &["ctx", "fill", "alloc", "64M", "refusals"]);
    assert_eq!(num(&line(&o, "fill", 0), "count"), 4);
    assert_eq!(num(&line(&o, "fill", 0), "rc"), 2);
    assert_eq!(num(&line(&o, "refusals", 0), "count"), 0);
    assert_eq!(stderr(&o), "", "the shim refused nothing, so says nothing");
}

/// Thousands of refusals in a row: every one counted, at most one line a
/// second of the run, and one again once a second has passed since.
#[test]
fn refusals_are_said_at_most_once_a_second() {
    let t = Instant::now();
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "1G")],
        &[
            "ctx", "fill", "alloc", "256M", "churn", "alloc", "512M", "1000", "refusals",
            "sleep-ms", "1100", "alloc", "alloc", "128M", "refusals",
        ],
    );
    let secs = t.elapsed().as_secs();
    assert_eq!(num(&line(&o, "churn", 0), "failures"), 1000);
    assert_eq!(num(&line(&o, "refusals", 0), "count"), 1001);
    assert_eq!(num(&line(&o, "refusals", 1), "count"), 1002);
    let lines = refusal_lines(&o);
    // The first line, at least one more after the quiet second, and never
    // more than one for each second the probe ran.
    assert!(lines.len() >= 2, "{lines:?}");
    assert!(lines.len() as u64 <= 1 + secs + 1, "{secs} s: {lines:?}");
    assert_eq!(
        lines.last().unwrap(),
        "gpufrac: device 0: refused 128 MiB: cap 1 GiB reached (1 GiB in use)"
    );
}

/// In a job (`gpufrac run --gpu-memory`), a process refused because the
/// others hold the job's cap says so, with the job's figures.
#[test]
fn a_refusal_by_the_jobs_cap_names_the_job() {
    let dir = Scratch::new("refusals");
    let d = dir.0.display();
    let p = artifacts().probe.display();
    let script = format!(
        "{p} ctx alloc alloc 768M wait-file {d}/stop > {d}/first & \
         until grep -q '^alloc' {d}/first 2>/dev/null; do sleep 0.02; done; \
         {p} ctx alloc alloc 512M refusals; touch {d}/stop; wait"
    );
    let o = run_alone("16G", &["--gpu-memory", "1G", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(num(&line(&o, "alloc", 0), "rc"), 2, "{}", stdout(&o));
    assert_eq!(num(&line(&o, "refusals", 0), "count"), 1);
    let err = stderr(&o);
    let said: Vec<&str> = err.lines().filter(|l| l.contains("refused")).collect();
    assert_eq!(
        said,
        [
            "gpufrac: device 0: refused 512 MiB: the job's cap 1 GiB reached (768 MiB in use by the job)"
        ],
        "{err}"
    );
}

/// Without a broker, `gpufrac run` says which cap still holds, and says
/// there is none when none was asked.
#[test]
fn run_without_a_broker_says_which_cap_holds() {
    let said = |args: &[&str], env: &[(&str, &str)]| {
        let o = run_alone("16G", args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    let none = said(&["--", "true"], &[]);
    assert!(
        none.contains("no cap: none was asked (--gpu-memory SIZE asks for one)")
            && !none.contains("cap only"),
        "{none}"
    );
    let job = said(&["--gpu-memory", "4G", "--", "true"], &[]);
    assert!(
        job.contains("running under the memory cap only (4.00 GiB for the whole job)"),
        "{job}"
    );
    let env = said(&["--", "true"], &[("GPU_MEM_LIMIT", "2G")]);
    assert!(
        env.contains("(GPU_MEM_LIMIT=2G for each process, from the environment)"),
        "{env}"
    );
}

/// Without a broker, a job cap larger than every GPU is refused, as the
/// broker refuses it: nothing could give the job that much, and a slip
/// (64G for 6.4G) would otherwise run as if uncapped, silently.
#[test]
fn run_without_a_broker_refuses_a_cap_larger_than_every_gpu() {
    let o = run_alone("16G,8G", &["--gpu-memory", "64G", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "gpufrac run: --gpu-memory 64.00 GiB is more than any GPU here has: the largest has \
         16.00 GiB (GPU 0); ask for at most --gpu-memory 16G\n"
    );
    // The whole of the largest is a cap like any other.
    let o = run_alone("16G,8G", &["--gpu-memory", "16G", "--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}
