//! CUDA graph memory, shared VMM handles and the launch paths that span
//! several devices, end to end: the probe under LD_PRELOAD=libgpufrac.so
//! against the simulated driver.

mod support;
use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use support::*;

/// Runs `cmd` to its end, or kills it after `secs` and fails: a hang must
/// fail the test, not block the suite. The bound is generous; nothing is
/// measured by it.
fn output_within(cmd: &mut Command, secs: u64, what: &str) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning");
    finish_within(child, secs, what)
}

fn finish_within(mut child: Child, secs: u64, what: &str) -> Output {
    // Drained meanwhile: a full pipe must not pass for a hang.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed().as_secs() >= secs {
            let _ = child.kill();
            let _ = child.wait();
            let (o, e) = (o.join().unwrap(), e.join().unwrap());
            panic!(
                "{what}: still running after {secs}s (hung)\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&o),
                String::from_utf8_lossy(&e)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    Output {
        status,
        stdout: o.join().unwrap(),
        stderr: e.join().unwrap(),
    }
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}{}", stdout(o), stderr(o));
}

// ---------------------------------------------------------------------------
// The boundary: a panic after the driver call.

/// A hook that panics after its driver call returned: the application gets
/// the driver's answer to that call, and the call is not made a second
/// time (a second free of the same pointer is refused by the driver, a
/// second launch would run the kernel twice).
#[test]
fn a_panic_after_the_driver_call_does_not_call_it_twice() {
    let o = probe(
        "16G",
        &[
            ("GPU_MEM_LIMIT", "64M"),
            ("GPUFRAC_TEST_PANIC", "after:cuMemFree_v2"),
        ],
        &[
            "ctx",
            "alloc",
            "alloc",
            "4M",
            "alloc",
            "alloc",
            "4M",
            "free-all",
            "limit-api",
        ],
    );
    ok(&o);
    assert_eq!(
        num(&line(&o, "free-all", 0), "failures"),
        0,
        "each free answered as the driver answered it, once: {}",
        stderr(&o)
    );
    assert_eq!(num(&line(&o, "limit-api", 0), "used"), 0, "books balance");
    let err = stderr(&o);
    let said: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("internal error in cuMemFree_v2"))
        .map(|l| l.trim())
        .collect();
    assert_eq!(said.len(), 1, "said once: {err}");
    assert!(said[0].contains("not made twice"), "{}", said[0]);
}

/// The same for a launch: the kernel runs once per call, as the engine's
/// count of kernels shows.
#[test]
fn a_panic_after_a_launch_does_not_launch_twice() {
    let o = probe(
        "16G",
        &[("GPUFRAC_TEST_PANIC", "after:cuLaunchKernel")],
        &["ctx", "launch", "3", "1000", "kernels"],
    );
    ok(&o);
    assert_eq!(num(&line(&o, "launch", 0), "rc"), 0);
    assert_eq!(num(&line(&o, "kernels", 0), "count"), 3, "{}", stdout(&o));
}

// ---------------------------------------------------------------------------
// A cooperative launch over several devices, then a hand-back.

fn holding(b: &Broker, pid: u32) -> bool {
    b.status()["gpus"].as_array().unwrap().iter().any(|g| {
        g["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid && p["state"] == "holding")
    })
}

/// A process that made a cooperative launch over two devices while holding
/// one of them hands that device back when another process wants it, and
/// launches again afterwards: every pass of the gate the launch took was
/// given back (one left behind had its release wait forever, holding the
/// lock every later launch needs).
#[test]
fn a_multi_device_cooperative_launch_then_a_hand_back_does_not_hang() {
    let b = Broker::start("16G,16G", &[]);
    let dir = Scratch::new("coop");
    let (go, again) = (dir.0.join("go"), dir.0.join("again"));
    let mut cmd = b.client(&artifacts().probe);
    cmd.args(["ctx", "launch", "1", "1000", "await-file"])
        .arg(&go)
        .args(["coop-multi", "1000", "await-file"])
        .arg(&again)
        .args(["launch", "1", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut a = cmd.spawn().unwrap();
    let pid = a.id();
    // It holds device 0 (and only it) when it makes the launch.
    wait_until(30.0, "the first process to hold its GPU", || {
        holding(&b, pid)
    });
    std::fs::write(&go, "").unwrap();
    let mut l = String::new();
    while !l.starts_with("coop-multi") {
        l = read_line(&mut a);
        assert!(
            !l.is_empty() || a.try_wait().unwrap().is_none(),
            "the first process ended early"
        );
    }
    assert!(l.contains("rc=0 sync_rc=0"), "{l}");
    // Another process wants device 0: the first must hand it back. (Its
    // lines so far were read above; what it prints from here is in
    // `first` below.)
    let other = output_within(
        b.client(&artifacts().probe)
            .args(["ctx", "launch", "1", "1000"]),
        60,
        "the second process, waiting for device 0",
    );
    ok(&other);
    assert_eq!(num(&line(&other, "launch", 0), "rc"), 0);
    std::fs::write(&again, "").unwrap();
    let first = finish_within(a, 60, "the first process, launching again");
    ok(&first);
    assert_eq!(num(&line(&first, "launch", 0), "rc"), 0);
}
