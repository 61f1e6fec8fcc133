//! The driver's view beside gpufrac's, against a real broker on the
//! simulated driver: a plain process outside the shim that holds memory
//! shows in `gpufrac status --json`, `gpufrac top --once` and the metrics,
//! and the queue does not place a job into its memory until it lets go;
//! NVML process lists that grow between the driver's count and the fill
//! are read whole.

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use support::*;

fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    s.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// The value of the first sample of `family` whose labels hold `has`.
fn sample(text: &str, family: &str, has: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(has))
        .find_map(|l| l.rsplit_once(' ')?.1.parse().ok())
}

fn top_once(socket: &Path) -> String {
    let mut cmd = Command::new(&artifacts().gpufrac);
    scrub_env(&mut cmd);
    let o = cmd
        .args(["top", "--once", "--size", "120x30", "--socket"])
        .arg(socket)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
}

/// A plain process on the broker's GPU, outside the shim, holding `mem`
/// until `stop` exists.
fn outsider(b: &Broker, mem: &str, stop: &Path) -> KillOnDrop {
    let mut c = b.outsider(&artifacts().probe);
    c.args(["ctx", "alloc", "alloc", mem, "wait-file"])
        .arg(stop)
        .stdout(Stdio::null());
    KillOnDrop(c.spawn().unwrap())
}

fn unmanaged_pids(st: &serde_json::Value) -> Vec<u64> {
    st["gpus"][0]["unmanaged"]
        .as_array()
        .map(|a| a.iter().filter_map(|o| o["pid"].as_u64()).collect())
        .unwrap_or_default()
}

#[test]
fn a_process_outside_the_shim_is_seen_and_its_memory_not_placed_into() {
    let addr = format!("127.0.0.1:{}", free_port());
    let b = Broker::start("16G", &["--metrics", &addr]);
    let dir = Scratch::new("driver-view");
    let stop: PathBuf = dir.0.join("stop");
    let other = outsider(&b, "3G", &stop);
    let pid = u64::from(other.0.id());
    const GIB: f64 = (1u64 << 30) as f64;

    // status --json: the process, its memory, the driver's figures, and
    // what is free for a lease.
    wait_until(20.0, "the process outside the shim in status", || {
        unmanaged_pids(&status_cli(&b.socket)) == [pid]
    });
    let st = status_cli(&b.socket);
    let g = &st["gpus"][0];
    assert_eq!(g["unmanaged"][0]["mem"].as_u64(), Some(3 << 30), "{g}");
    assert_eq!(g["unmanaged_processes"], 1, "{g}");
    assert_eq!(g["unmanaged_mem"].as_u64(), Some(3 << 30), "{g}");
    assert_eq!(g["driver"]["used"].as_u64(), Some(3 << 30), "{g}");
    assert_eq!(g["driver"]["free"].as_u64(), Some(13 << 30), "{g}");
    assert_eq!(g["free_mem"].as_u64(), Some(13 << 30), "{g}");
    assert!(g["processes"].as_array().unwrap().is_empty(), "{g}");

    // The metrics.
    wait_until(20.0, "the process outside the shim in the metrics", || {
        sample(
            &scrape(&addr),
            "gpufrac_gpu_processes_unmanaged",
            "gpu=\"0\"",
        ) == Some(1.0)
    });
    let m = scrape(&addr);
    for (family, want) in [
        ("gpufrac_gpu_memory_unmanaged_bytes", 3.0 * GIB),
        ("gpufrac_gpu_memory_driver_used_bytes", 3.0 * GIB),
        ("gpufrac_gpu_memory_driver_free_bytes", 13.0 * GIB),
        ("gpufrac_gpu_memory_free_bytes", 13.0 * GIB),
    ] {
        assert_eq!(sample(&m, family, "gpu=\"0\""), Some(want), "{family}");
    }

    // top: "other" in the GPU's figures, and a row of its own.
    let t = top_once(&b.socket);
    assert!(t.contains("other 3G free 13G of 16G"), "{t}");
    assert!(
        t.contains(&format!("{pid} other: not under the shim")),
        "{t}"
    );
    assert!(t.contains("3G/-"), "{t}");

    // 14 GiB would fit the books but not the GPU: it waits, saying why,
    // while 12 GiB is placed at once.
    let mut big = b.run(&["--gpu-memory", "14G", "--", "true"]);
    big.stdout(Stdio::null()).stderr(Stdio::null());
    let mut big = Reap(Some(big.spawn().unwrap()));
    wait_until(20.0, "the 14 GiB job queued", || {
        status_cli(&b.socket)["queue"]
            .as_array()
            .is_some_and(|q| q.len() == 1)
    });
    let why = status_cli(&b.socket)["queue"][0]["why"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        why.contains("3.00 GiB held by processes outside gpufrac"),
        "{why}"
    );
    let small = b
        .run(&["--gpu-memory", "12G", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(small.status.success(), "{}", stderr(&small));
    assert!(
        big.0.as_mut().unwrap().try_wait().unwrap().is_none(),
        "placed into the memory the process holds"
    );

    // It lets go: the job is placed, runs and ends.
    std::fs::write(&stop, "").unwrap();
    let mut big = big.0.take().unwrap();
    wait_until(
        30.0,
        "the 14 GiB job placed once the memory was free",
        || big.try_wait().unwrap().is_some(),
    );
    assert!(big.wait().unwrap().success());
    assert!(unmanaged_pids(&status_cli(&b.socket)).is_empty());
    drop(other);
}

/// Eight processes outside the shim while the driver's count lags the
/// list by six (processes that start between the count and the fill, as
/// a job's workers do): the list is asked for again with room enough and
/// every process shows. Before, the sample's list was dropped whole (the
/// buffer sized by the count, with nvml-wrapper's headroom of five, was
/// too small) and none did.
#[test]
fn process_lists_that_grow_between_count_and_fill_are_read_whole() {
    let b = Broker::start_env("16G", &[], &[("GPUFRAC_SIM_NVML_LATE", "6")]);
    let dir = Scratch::new("driver-view-late");
    let stop = dir.0.join("stop");
    let procs: Vec<KillOnDrop> = (0..8).map(|_| outsider(&b, "64M", &stop)).collect();
    let mut want: Vec<u64> = procs.iter().map(|p| u64::from(p.0.id())).collect();
    want.sort_unstable();
    let mut seen = Vec::new();
    let shown = wait_until_or(20.0, || {
        seen = unmanaged_pids(&status_cli(&b.socket));
        seen.sort_unstable();
        seen == want
    });
    assert!(
        shown,
        "the driver's list read whole: {seen:?}, want {want:?}"
    );
    std::fs::write(&stop, "").unwrap();
}

fn wait_until_or(secs: f64, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    cond()
}

/// The GPU's health from NVML, as the simulated driver reports it
/// (temperature, power and clock following the load, ECC on and clean, an
/// XID the driver delivers once): in status, the metrics and top.
#[test]
fn gpu_health_from_nvml_shows_in_status_metrics_and_top() {
    let addr = format!("127.0.0.1:{}", free_port());
    let b = Broker::start_env("16G", &["--metrics", &addr], &[("GPUFRAC_SIM_XID", "0:79")]);
    // A busy process: the GPU warms up and boosts its clock.
    let start = mono_ns() + 200_000_000;
    let mut busy = b.client(&artifacts().probe);
    busy.arg("ctx")
        .args(spin_args(start, start + 60_000_000_000))
        .stdout(Stdio::null());
    let _busy = KillOnDrop(busy.spawn().unwrap());
    let health = |st: &serde_json::Value| st["gpus"][0]["health"].clone();
    wait_until(30.0, "the busy GPU's boost clock and its XID", || {
        let h = health(&status_cli(&b.socket));
        h["sm_clock_mhz"] == 1980 && h["xid_errors"] == 1
    });
    let h = health(&status_cli(&b.socket));
    assert_eq!(h["last_xid"], 79, "{h}");
    assert_eq!(
        (h["ecc_corrected"].clone(), h["ecc_uncorrected"].clone()),
        (0.into(), 0.into())
    );
    assert_eq!(h["power_limit_w"].as_f64(), Some(300.0), "{h}");
    let (t, w) = (
        h["temperature_c"].as_u64().unwrap(),
        h["power_w"].as_f64().unwrap(),
    );
    assert!((34..=84).contains(&t) && w > 60.0 && w <= 300.0, "{h}");

    wait_until(20.0, "the XID in the metrics", || {
        sample(&scrape(&addr), "gpufrac_gpu_xid_errors_total", "gpu=\"0\"") == Some(1.0)
    });
    let m = scrape(&addr);
    assert_eq!(sample(&m, "gpufrac_gpu_last_xid", "gpu=\"0\""), Some(79.0));
    assert_eq!(
        sample(&m, "gpufrac_gpu_power_limit_watts", "gpu=\"0\""),
        Some(300.0)
    );
    assert_eq!(
        sample(&m, "gpufrac_gpu_ecc_errors_total", "type=\"uncorrected\""),
        Some(0.0)
    );
    assert!(sample(&m, "gpufrac_gpu_temperature_celsius", "gpu=\"0\"").is_some_and(|t| t >= 34.0));
    assert!(sample(&m, "gpufrac_gpu_sm_clock_hertz", "gpu=\"0\"").is_some_and(|c| c >= 345e6));
    assert!(sample(&m, "gpufrac_gpu_power_usage_watts", "gpu=\"0\"").is_some_and(|w| w > 0.0));

    let t = top_once(&b.socket);
    let util = t.lines().find(|l| l.contains("util")).unwrap_or_default();
    assert!(util.contains("°C") && util.contains("/300W"), "{t}");
    assert!(util.contains("XID 79×1"), "{t}");
}
