//! `gpufrac broker --mig dynamic` end to end: a real broker on simulated
//! MIG GPUs (the simulated NVML's MIG API, shared by every process through
//! the state file), real `gpufrac run` jobs under the shim, and what they
//! see through `CUDA_VISIBLE_DEVICES=MIG-<uuid>`.

mod support;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use support::*;

use gpufrac_broker::gpus::{MigDriver, NvmlMig, Range};

/// An A100-40GB in MIG mode and a 16 GiB GPU outside it.
const NODE: &str = "A100-40GB:mig,16G";
const MIG: &[&str] = &["--mig", "dynamic"];

fn scratch(name: &str) -> (Scratch, PathBuf) {
    let s = Scratch::new(name);
    let p = s.0.clone();
    (s, p)
}

/// A job that records its `CUDA_VISIBLE_DEVICES` and `GPU_MEM_LIMIT`, runs
/// the probe on its device (a context and `alloc` bytes, so it registers
/// with the broker and holds memory there), and holds its lease until
/// `release(dir, name)`.
fn job(b: &Broker, dir: &Path, name: &str, alloc: &str, args: &[&str]) -> Child {
    let probe = format!(
        "{} ctx alloc alloc {alloc} sleep-ms 120000 > {}/{name}.probe",
        artifacts().probe.display(),
        dir.display()
    );
    let script = job_script_with(dir, name, &probe);
    let mut cmd = b.run(args);
    cmd.args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd.spawn().unwrap()
}

/// The MIG GPU's status entry.
fn mig_gpu(b: &Broker) -> serde_json::Value {
    let s = b.status();
    s["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["mode"] == "mig")
        .cloned()
        .unwrap_or_else(|| panic!("no GPU in MIG mode in {s}"))
}

/// (profile, placement, state, MIG device) of each instance.
fn instances(b: &Broker) -> Vec<(String, String, String, String)> {
    let g = mig_gpu(b);
    g["mig"]["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["profile"].as_str().unwrap().to_owned(),
                i["placement"].as_str().unwrap().to_owned(),
                i["state"].as_str().unwrap().to_owned(),
                i["uuid"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn queued(b: &Broker) -> usize {
    b.status()["queue"].as_array().unwrap().len()
}

/// Runs a job to its end and returns (its output, its stderr, exit code).
fn run_once(b: &Broker, args: &[&str], script: &str) -> (String, String, Option<i32>) {
    let o = b
        .run(args)
        .args(["--", "sh", "-c", script])
        .output()
        .unwrap();
    (stdout(&o), stderr(&o), o.status.code())
}

#[test]
fn a_small_job_gets_a_1g_5gb_instance_and_sees_only_it() {
    let b = Broker::start(NODE, MIG);
    let script = format!(
        "echo \"cvd=$CUDA_VISIBLE_DEVICES limit=$GPU_MEM_LIMIT\"; {} ctx fill alloc 256M info",
        artifacts().probe.display()
    );
    // One compute slice is 1/7 of the SMs, 14.3%: 14% needs one.
    let (out, err, code) = run_once(&b, &["--gpu-memory", "4G", "--gpu-compute", "14%"], &script);
    assert_eq!(code, Some(0), "{err}");
    let cvd = out
        .lines()
        .find_map(|l| l.strip_prefix("cvd="))
        .unwrap_or_else(|| panic!("{out}"));
    let (cvd, limit) = cvd.split_once(" limit=").unwrap();
    assert!(cvd.starts_with("MIG-") && cvd.len() == 40, "{cvd}");
    // The job has the whole instance, 4864 MiB: 19 blocks of 256 MiB, and
    // CUDA reports that as the device.
    let one_g = 4864 * MIB;
    assert_eq!(limit, one_g.to_string());
    let fill = out.lines().find(|l| l.starts_with("fill ")).unwrap();
    assert!(fill.contains("count=19 "), "{out}");
    let info = out.lines().find(|l| l.starts_with("info ")).unwrap();
    assert!(info.contains(&format!(" total={one_g} ")), "{out}");
    assert!(info.contains(&format!(" devtotal={one_g}")), "{out}");
    assert_eq!(
        instances(&b),
        vec![("1g.5gb".into(), "6:1".into(), "idle".into(), cvd.to_owned())]
    );

    // 20% is more than one slice: a 2g.10gb.
    let (out, err, code) = run_once(
        &b,
        &["--gpu-memory", "4G", "--gpu-compute", "20%"],
        "echo \"$CUDA_VISIBLE_DEVICES $GPU_MEM_LIMIT\"",
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(out.ends_with(&format!(" {}\n", 9856 * MIB)), "{out}");
    let profiles: Vec<String> = instances(&b).into_iter().map(|i| i.0).collect();
    assert_eq!(profiles, ["1g.5gb", "2g.10gb"]);
}

#[test]
fn a_second_job_reuses_the_idle_instance_and_status_shows_who_holds_it() {
    let b = Broker::start(NODE, MIG);
    let (_s, d) = scratch("mig-reuse");
    let a = job(&b, &d, "a", "1G", &["--gpu-memory", "4G"]);
    let (cvd, _) = wait_started(&d, "a");
    // The probe registers on the instance, a device of its own.
    let mut row = serde_json::Value::Null;
    wait_until(20.0, "the job's process on its MIG instance", || {
        let s = b.status();
        row = s["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["uuid"] == cvd.as_str())
            .cloned()
            .unwrap_or_default();
        row["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["mem_used"] == GIB))
    });
    assert_eq!(row["mode"], "mig-instance");
    assert_eq!(row["index"], 0);
    assert_eq!(row["total_mem"], 4864 * MIB);
    let p = &row["processes"][0];
    assert_eq!(p["mem_cap"], 4864 * MIB, "{row}");
    let g = mig_gpu(&b);
    let i = &g["mig"]["instances"][0];
    assert_eq!(
        (i["state"].as_str(), i["job"].as_u64()),
        (Some("in-use"), Some(a.id() as u64)),
        "{g}"
    );
    assert_eq!(g["committed_mem"], 4864 * MIB);
    assert!(i["idle_s"].is_null());
    release(&d, "a", a);
    wait_until(10.0, "the instance to be idle", || {
        mig_gpu(&b)["mig"]["instances"][0]["state"] == "idle"
    });
    assert!(
        mig_gpu(&b)["mig"]["instances"][0]["idle_s"]
            .as_f64()
            .unwrap()
            >= 0.0
    );

    // The table view says the same.
    let o = sim_command(&artifacts().gpufrac, NODE, false)
        .args(["status", "--socket"])
        .arg(&b.socket)
        .output()
        .unwrap();
    let t = stdout(&o);
    assert!(t.contains("MIG mode: 1 instances, 0 in use"), "{t}");
    assert!(
        t.contains("  1   1g.5gb   6:1        4.75 GiB  idle "),
        "{t}"
    );

    let c = job(&b, &d, "c", "1G", &["--gpu-memory", "3G"]);
    let (cvd_c, _) = wait_started(&d, "c");
    assert_eq!(cvd_c, cvd, "the idle instance is reused");
    let g = mig_gpu(&b);
    assert_eq!(g["mig"]["created"], 1);
    assert_eq!(g["mig"]["instances"][0]["job"], c.id());
    release(&d, "c", c);
}

#[test]
fn a_big_request_destroys_idle_instances_lazily_and_never_one_in_use() {
    let b = Broker::start(NODE, MIG);
    let (_s, d) = scratch("mig-lazy");
    let a = job(&b, &d, "a", "64M", &["--gpu-memory", "4G"]);
    let x = job(&b, &d, "x", "64M", &["--gpu-memory", "4G"]);
    let (cvd_a, _) = wait_started(&d, "a");
    let (cvd_x, _) = wait_started(&d, "x");
    assert_ne!(cvd_a, cvd_x);
    release(&d, "a", a);
    // 30 GiB needs the 7g.40gb, the whole GPU: the idle instance could go,
    // the one in use cannot, so the job waits.
    let big = job(&b, &d, "big", "1G", &["--gpu-memory", "30G"]);
    wait_until(10.0, "the big job to queue", || queued(&b) == 1);
    assert!(started(&d, "big").is_none());
    assert_eq!(instances(&b).len(), 2, "nothing destroyed yet");
    release(&d, "x", x);
    let (cvd_big, limit) = wait_started(&d, "big");
    assert_eq!(limit, (40192 * MIB).to_string());
    let g = mig_gpu(&b);
    assert_eq!(
        (g["mig"]["destroyed"].as_u64(), g["mig"]["created"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(
        instances(&b),
        vec![("7g.40gb".into(), "0:8".into(), "in-use".into(), cvd_big)]
    );
    release(&d, "big", big);
}

#[test]
fn what_no_profile_holds_goes_to_a_gpu_outside_mig_or_is_refused() {
    let b = Broker::start("A100-40GB:mig,64G", MIG);
    let (out, err, code) = run_once(
        &b,
        &["--gpu-memory", "45G"],
        "echo \"$CUDA_VISIBLE_DEVICES $GPU_MEM_LIMIT\"",
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, format!("1 {}\n", 45 * GIB), "a fraction of GPU 1");
    assert!(instances(&b).is_empty());
    // Whole GPUs are those outside MIG mode.
    let (out, _, _) = run_once(&b, &["--gpus", "1"], "echo $CUDA_VISIBLE_DEVICES");
    assert_eq!(out, "1\n");
    drop(b);

    let b = Broker::start("A100-40GB:mig", MIG);
    for (args, words) in [
        (
            &["--gpu-memory", "45G"][..],
            "no MIG profile holds it: the largest is 7g.40gb (39.2 GiB, GPU 0)",
        ),
        (
            &["--gpus", "1"][..],
            "every GPU of this node is in MIG mode (GPU 0)",
        ),
    ] {
        let (_, err, code) = run_once(&b, args, "true");
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(
            err.starts_with("gpufrac run: ") && err.contains(words),
            "{err}"
        );
    }
}

#[test]
fn a_mig_lease_survives_a_broker_crash_and_instances_outlive_a_clean_stop() {
    let mut b = Broker::start(NODE, MIG);
    let (_s, d) = scratch("mig-crash");
    let a = job(&b, &d, "a", "64M", &["--gpu-memory", "8G"]);
    let (cvd, _) = wait_started(&d, "a");
    b.kill();
    b.restart();
    // The run reconnects and claims its lease on the same instance; the
    // instance, found at start, is booked for it before anyone else.
    wait_until(20.0, "the lease back on its instance", || {
        instances(&b) == vec![("1g.10gb".into(), "6:2".into(), "in-use".into(), cvd.clone())]
            && b.status()["leases"][0]["connected"] == true
    });
    let x = job(&b, &d, "x", "64M", &["--gpu-memory", "8G"]);
    let (cvd_x, _) = wait_started(&d, "x");
    assert_ne!(cvd_x, cvd, "not handed out twice");
    release(&d, "a", a);
    release(&d, "x", x);
    // A clean stop leaves the idle instances (lazily: the next broker
    // adopts them).
    let mut before = instances(&b);
    before.sort();
    assert_eq!(before.len(), 2);
    unsafe { libc::kill(b.child.id() as i32, libc::SIGTERM) };
    let _ = b.child.wait();
    b.restart();
    let mut after = instances(&b);
    after.sort();
    assert_eq!(after, before, "adopted as they were");
    assert!(after.iter().all(|i| i.2 == "idle"));
}

#[test]
fn metrics_show_instances() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let b = Broker::start(NODE, &["--mig", "dynamic", "--metrics", &addr]);
    let (_s, d) = scratch("mig-metrics");
    let a = job(&b, &d, "a", "64M", &["--gpu-memory", "4G"]);
    let (cvd, _) = wait_started(&d, "a");
    let get = || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    };
    let want = format!(
        "mig_uuid=\"{cvd}\",gi=\"1\",profile=\"1g.5gb\",placement=\"6:1\",state=\"in-use\",job_id=\"{}\"}} 1",
        a.id()
    );
    wait_until(10.0, "the instance in /metrics", || get().contains(&want));
    let m = get();
    assert!(
        m.contains("gpufrac_mig_instances_created_total{gpu=\"0\",uuid=\"GPU-"),
        "{m}"
    );
    release(&d, "a", a);
    wait_until(10.0, "the idle instance in /metrics", || {
        get().lines().any(|l| {
            l.starts_with("gpufrac_mig_instance_idle_start_time_seconds{")
                && l.contains(&format!("mig_uuid=\"{cvd}\""))
        })
    });
}

/// What an administrator might do by hand, out of the broker's sight: a
/// helper process (this test binary, `nvml_helper`) loads the simulated
/// NVML with the broker's devices and state and makes instances through
/// the same NVML calls. Returns its `made` lines.
fn by_hand(b: &Broker, action: &str) -> Vec<String> {
    let o = sim_command(std::env::current_exe().unwrap(), &b.devices, false)
        .args(["nvml_helper", "--exact", "--nocapture", "--test-threads=1"])
        .env("GPUFRAC_SIM_STATE", &b.state)
        .env(HELPER, action)
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        o.status.success() && out.contains("1 passed"),
        "{out}{}",
        stderr(&o)
    );
    out.lines()
        .filter_map(|l| l.split("made ").nth(1))
        .map(str::to_owned)
        .collect()
}

const HELPER: &str = "GPUFRAC_TEST_NVML_HELPER";

/// Not a test of its own: the helper `by_hand` starts (it does nothing
/// unless that environment variable names what to do).
#[test]
fn nvml_helper() {
    let Ok(action) = std::env::var(HELPER) else {
        return;
    };
    let mut d = NvmlMig::open().unwrap();
    match action.as_str() {
        // A 1g.5gb at 6:1, as the broker would have placed it.
        "one" => {
            let (gi, uuid) = d.create(0, 19, Range { start: 6, size: 1 }).unwrap();
            println!("made {gi} {uuid}");
        }
        // A 3g.20gb at 0:4 split into three compute instances: not the
        // broker's to use or destroy. NVML's C API makes the extra ones.
        "split" => {
            let (gi, uuid) = d.create(0, 9, Range { start: 0, size: 4 }).unwrap();
            println!("made {gi} {uuid}");
            split(gi);
        }
        other => panic!("unknown action {other}"),
    }
}

/// Replaces GPU instance `gi`'s compute instance by three 1-slice ones,
/// through NVML's C API (what the broker never does).
fn split(gi: u32) {
    use std::ffi::c_void;
    type H = *mut c_void;
    // SAFETY: the simulated NVML, found as the dynamic loader finds the
    // driver's, called with its documented signatures.
    unsafe {
        let lib = libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW);
        assert!(!lib.is_null());
        let sym = |n: &std::ffi::CStr| {
            let p = libc::dlsym(lib, n.as_ptr());
            assert!(!p.is_null(), "{n:?}");
            p
        };
        let init: extern "C" fn() -> u32 = std::mem::transmute(sym(c"nvmlInit_v2"));
        let dev_at: extern "C" fn(u32, *mut H) -> u32 =
            std::mem::transmute(sym(c"nvmlDeviceGetHandleByIndex_v2"));
        let gi_by_id: extern "C" fn(H, u32, *mut H) -> u32 =
            std::mem::transmute(sym(c"nvmlDeviceGetGpuInstanceById"));
        let list: extern "C" fn(H, u32, *mut H, *mut u32) -> u32 =
            std::mem::transmute(sym(c"nvmlGpuInstanceGetComputeInstances"));
        let destroy: extern "C" fn(H) -> u32 =
            std::mem::transmute(sym(c"nvmlComputeInstanceDestroy"));
        let create: extern "C" fn(H, u32, *mut H) -> u32 =
            std::mem::transmute(sym(c"nvmlGpuInstanceCreateComputeInstance"));
        assert_eq!(init(), 0);
        let (mut dev, mut g) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(dev_at(0, &mut dev), 0);
        assert_eq!(gi_by_id(dev, gi, &mut g), 0);
        // The compute instance spanning a 3-slice GPU instance has
        // NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE (2); the small ones 1_SLICE (0).
        let mut cis = [std::ptr::null_mut(); 1];
        let mut n = 1;
        assert_eq!(list(g, 2, cis.as_mut_ptr(), &mut n), 0);
        assert_eq!(destroy(cis[0]), 0);
        for _ in 0..3 {
            let mut ci = std::ptr::null_mut();
            assert_eq!(create(g, 0, &mut ci), 0);
        }
    }
}

#[test]
fn a_failed_creation_is_retried_with_what_the_driver_reports() {
    let b = Broker::start(NODE, MIG);
    // Made behind the broker's back, exactly where it will try to put the
    // next 1g.5gb.
    let made = by_hand(&b, "one");
    let uuid = made[0].split(' ').nth(1).unwrap().to_owned();
    let (out, err, code) = run_once(&b, &["--gpu-memory", "4G"], "echo $CUDA_VISIBLE_DEVICES");
    assert_eq!(code, Some(0), "{err}");
    // Creation failed, the broker re-read the GPU, found the instance idle
    // and gave it to the job.
    assert_eq!(out.trim(), uuid);
    let g = mig_gpu(&b);
    assert_eq!(
        (g["mig"]["failures"].as_u64(), g["mig"]["created"].as_u64()),
        (Some(1), Some(0)),
        "{g}"
    );
}

#[test]
fn instances_made_by_hand_are_adopted_or_left_alone() {
    let mut b = Broker::start(NODE, MIG);
    by_hand(&b, "one");
    let made = by_hand(&b, "split");
    let split_gi: u64 = made[0].split(' ').next().unwrap().parse().unwrap();
    // A broker started after them (same node: the simulator's state)
    // finds both: the 1g.5gb idle (its own to use), the split one foreign.
    b.kill();
    b.restart();
    let g = mig_gpu(&b);
    let states: Vec<(u64, String)> = g["mig"]["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["gi"].as_u64().unwrap(),
                i["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(states.contains(&(split_gi, "foreign".into())), "{g}");
    assert!(states.iter().any(|s| s.1 == "idle"), "{g}");
    // 30 GiB needs the whole GPU, which the foreign instance blocks for
    // good: --no-wait says so; nothing is destroyed.
    let (_, err, code) = run_once(&b, &["--gpu-memory", "30G", "--no-wait"], "true");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no room now") && err.contains("1 not managed by gpufrac"),
        "{err}"
    );
    assert_eq!(mig_gpu(&b)["mig"]["instances"].as_array().unwrap().len(), 2);
}

#[test]
fn without_mig_mode_gpus_dynamic_mig_changes_nothing() {
    let b = Broker::start("16G", MIG);
    let (out, err, code) = run_once(
        &b,
        &["--gpu-memory", "4G"],
        "echo \"$CUDA_VISIBLE_DEVICES $GPU_MEM_LIMIT\"",
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, format!("0 {}\n", 4 * GIB));
    let s = b.status();
    assert!(
        s["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["mode"] == "time-slicing"),
        "{s}"
    );
}

#[test]
fn dynamic_mig_and_mps_are_refused_together() {
    let (_s, d) = scratch("mig-mps");
    let sock = d.join("b.sock");
    let o = sim_command(&artifacts().gpufrac, NODE, false)
        .args(["broker", "--mig", "dynamic", "--mps", "--socket"])
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--mig dynamic and --mps cannot be combined"),
        "{}",
        stderr(&o)
    );
    assert!(!sock.exists(), "a refused start leaves nothing behind");
    let o = sim_command(&artifacts().gpufrac, NODE, false)
        .args(["broker", "--mig", "static", "--socket"])
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("possible values: dynamic"),
        "{}",
        stderr(&o)
    );
}
