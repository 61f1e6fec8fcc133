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
    finish_within(&mut KillOnDrop(child).0, secs, what)
}

fn finish_within(child: &mut Child, secs: u64, what: &str) -> Output {
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
    // A status connection the broker turned away (it is busy) is asked
    // again at the next poll.
    let Ok(s) = std::panic::catch_unwind(|| b.status()) else {
        return false;
    };
    s["gpus"].as_array().unwrap().iter().any(|g| {
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
    // Killed however the test ends: it would wait for its file forever.
    let mut a = KillOnDrop(cmd.spawn().unwrap());
    let pid = a.0.id();
    // It holds device 0 (and only it) when it makes the launch.
    wait_until(30.0, "the first process to hold its GPU", || {
        holding(&b, pid)
    });
    std::fs::write(&go, "").unwrap();
    let mut l = String::new();
    while !l.starts_with("coop-multi") {
        l = read_line(&mut a.0);
        assert!(
            !l.is_empty() || a.0.try_wait().unwrap().is_none(),
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
    let first = finish_within(&mut a.0, 60, "the first process, launching again");
    ok(&first);
    assert_eq!(num(&line(&first, "launch", 0), "rc"), 0);
}

// ---------------------------------------------------------------------------
// Graph memory: every way to make a graph, charged before it can run.

const G: u64 = GIB;

/// "CHARGED/HELD" as numbers.
fn pair(s: &str) -> (u64, u64) {
    let (a, b) = s
        .split_once('/')
        .unwrap_or_else(|| panic!("not a pair: {s}"));
    (a.parse().unwrap(), b.parse().unwrap())
}

fn now(o: &Output, step: &str, n: usize) -> (u64, u64) {
    pair(&line(o, step, n)["now"])
}

/// The probe under the shim with `cap`, after the lookup flags `flags`.
fn graph_probe(flags: &[&str], cap: Option<&str>, steps: &[&str]) -> Output {
    let mut cmd = sim_command(&artifacts().probe, "16G", true);
    if let Some(cap) = cap {
        cmd.env("GPU_MEM_LIMIT", cap);
    }
    cmd.args(flags).args(steps);
    let o = cmd.output().unwrap();
    ok(&o);
    o
}

/// Each way to get a graph with an allocation of 1 GiB and to make it
/// runnable: (lookup flags, the steps).
fn ways() -> Vec<(&'static str, Vec<&'static str>, Vec<&'static str>)> {
    vec![
        (
            "capture, cuGraphInstantiateWithFlags",
            vec![],
            vec!["g-capture", "1G", "g-instantiate", "flags"],
        ),
        (
            "capture on the per-thread stream (_ptsz), cuGraphInstantiateWithParams_ptsz",
            vec!["--ptsz"],
            vec!["g-capture", "1G", "g-instantiate", "params"],
        ),
        (
            "the same, found by dlsym",
            vec!["--lookup", "dlsym", "--ptsz"],
            vec!["g-capture", "1G", "g-instantiate", "params"],
        ),
        (
            "cuGraphAddMemAllocNode, cuGraphInstantiate",
            vec!["--lookup", "dlsym"],
            vec!["g-node", "1G", "g-instantiate", "v1"],
        ),
        (
            "cuGraphAddMemAllocNode, cuGraphInstantiate_v2",
            vec!["--lookup", "dlsym"],
            vec!["g-node", "1G", "g-instantiate", "v2"],
        ),
        (
            "cuGraphAddMemAllocNode, cuGraphInstantiate by name (CUDA 12: WithFlags)",
            vec![],
            vec!["g-node", "1G", "g-instantiate", "v1"],
        ),
        (
            "cuGraphClone, then an allocation node, cuGraphInstantiateWithParams",
            vec![],
            vec![
                "g-create",
                "g-clone",
                "g-node",
                "1G",
                "g-instantiate",
                "params",
            ],
        ),
    ]
}

/// However the graph was made, nothing is charged or held before it runs;
/// each launch takes 1 GiB from the graph pool, which the shim charges
/// exactly as the driver holds it (freed between launches, the pool keeps
/// it); a trim gives it back.
#[test]
fn every_way_to_make_a_graph_is_charged_as_the_driver_holds_it() {
    for (what, flags, build) in ways() {
        let mut steps = build.clone();
        steps.extend(["g-launch", "3", "free", "g-trim"]);
        let mut all = vec!["ctx"];
        all.extend(&steps);
        let o = graph_probe(&flags, Some("2G"), &all);
        let inst = line(&o, "g-instantiate", 0);
        assert_eq!(num(&inst, "rc"), 0, "{what}: {}", stdout(&o));
        assert_eq!(pair(&inst["now"]), (0, 0), "{what}: nothing runs yet");
        let l = line(&o, "g-launch", 0);
        assert_eq!(l["rcs"], "0,0,0", "{what}: {}", stdout(&o));
        for a in l["after"].split(',') {
            assert_eq!(pair(a), (G, G), "{what}: charged/held after each launch");
        }
        assert_eq!(now(&o, "g-trim", 0), (0, 0), "{what}: trimmed");
    }
}

/// The simulated driver holds graph memory as a real one does, with or
/// without the shim.
#[test]
fn the_simulated_driver_holds_graph_memory_from_the_launch_to_the_trim() {
    let o = {
        let mut cmd = sim_command(&artifacts().probe, "16G", false);
        cmd.args([
            "ctx",
            "g-node",
            "1G",
            "g-instantiate",
            "flags",
            "g-launch",
            "2",
            "free",
            "g-trim",
        ]);
        cmd.output().unwrap()
    };
    ok(&o);
    assert_eq!(now(&o, "g-instantiate", 0), (0, 0));
    assert_eq!(line(&o, "g-launch", 0)["after"], format!("0/{G},0/{G}"));
    assert_eq!(now(&o, "g-trim", 0), (0, 0));
}

/// A process with 1 GiB allocated under a 1.5 GiB cap: however the graph
/// was made, its launch fails with CUDA_ERROR_OUT_OF_MEMORY before it runs,
/// and the driver never holds more than the cap.
#[test]
fn a_graph_that_does_not_fit_never_runs_past_the_cap() {
    for (what, flags, build) in ways() {
        let mut all = vec!["ctx", "alloc", "alloc", "1G"];
        all.extend(&build);
        all.extend(["g-launch", "2", "free", "free-all", "g-launch", "1", "free"]);
        let o = graph_probe(&flags, Some("1536M"), &all);
        assert_eq!(num(&line(&o, "g-instantiate", 0), "rc"), 0, "{what}");
        let l = line(&o, "g-launch", 0);
        assert_eq!(l["rcs"], "2,2", "{what}: {}", stdout(&o));
        for a in l["after"].split(',') {
            assert_eq!(pair(a), (G, G), "{what}: the plain 1 GiB only");
        }
        // Room again: it runs.
        let l = line(&o, "g-launch", 1);
        assert_eq!(l["rcs"], "0", "{what}: {}", stdout(&o));
        assert_eq!(pair(&l["after"]), (G, G), "{what}");
    }
}

/// An instantiation that uploads the graph takes its memory then: it is
/// charged then, and refused when it does not fit; so is cuGraphUpload.
#[test]
fn an_upload_is_charged_as_a_launch_is() {
    // Room: charged at the instantiation, the launch takes nothing more.
    for flags in [&[][..], &["--ptsz"][..]] {
        let o = graph_probe(
            flags,
            Some("2G"),
            &[
                "ctx",
                "g-node",
                "1G",
                "g-instantiate",
                "params-upload",
                "g-launch",
                "1",
                "free",
            ],
        );
        let inst = line(&o, "g-instantiate", 0);
        assert_eq!(num(&inst, "rc"), 0, "{}", stdout(&o));
        assert_eq!(pair(&inst["now"]), (G, G), "uploaded: held and charged");
        assert_eq!(line(&o, "g-launch", 0)["after"], format!("{G}/{G}"));
    }
    // No room: refused, nothing taken.
    let o = graph_probe(
        &[],
        Some("1536M"),
        &[
            "ctx",
            "alloc",
            "alloc",
            "1G",
            "g-node",
            "1G",
            "g-instantiate",
            "params-upload",
        ],
    );
    let inst = line(&o, "g-instantiate", 0);
    assert_eq!(num(&inst, "rc"), 2, "{}", stdout(&o));
    assert_eq!(pair(&inst["now"]), (G, G));
    // cuGraphUpload, with and without room.
    for (cap, rc, after) in [("2G", 0, 2 * G), ("1536M", 2, G)] {
        let o = graph_probe(
            &[],
            Some(cap),
            &[
                "ctx",
                "alloc",
                "alloc",
                "1G",
                "g-node",
                "1G",
                "g-instantiate",
                "flags",
                "g-upload",
            ],
        );
        let up = line(&o, "g-upload", 0);
        assert_eq!(num(&up, "rc"), rc, "cap {cap}: {}", stdout(&o));
        assert_eq!(pair(&up["now"]), (after, after), "cap {cap}");
    }
}

/// Relaunching a graph whose allocation is still outstanding: the driver
/// refuses it (nothing more taken), unless the graph frees on relaunch.
#[test]
fn a_relaunch_with_the_allocation_outstanding() {
    for (how, rcs) in [("flags", "0,1,1"), ("auto-free", "0,0,0")] {
        let o = graph_probe(
            &[],
            Some("2G"),
            &[
                "ctx",
                "g-capture",
                "1G",
                "g-instantiate",
                how,
                "g-launch",
                "3",
                "hold",
            ],
        );
        let l = line(&o, "g-launch", 0);
        assert_eq!(l["rcs"], rcs, "{how}: {}", stdout(&o));
        for a in l["after"].split(',') {
            assert_eq!(pair(a), (G, G), "{how}");
        }
    }
}

/// cuMemFree of an allocation a graph left outstanding returns it to the
/// pool (not to the device), as cuMemFreeAsync does: the graph can run
/// again, from the memory the pool kept.
#[test]
fn a_synchronous_free_returns_graph_memory_to_the_pool() {
    let o = graph_probe(
        &[],
        Some("2G"),
        &[
            "ctx",
            "g-node",
            "1G",
            "g-instantiate",
            "flags",
            "g-launch",
            "2",
            "free-sync",
        ],
    );
    let l = line(&o, "g-launch", 0);
    assert_eq!(l["rcs"], "0,0", "{}", stdout(&o));
    assert_eq!(l["after"], format!("{G}/{G},{G}/{G}"));
}

/// A graph with memory nodes cannot be cloned (the driver says so, with or
/// without the shim); one without can, and what is added to the clone is
/// charged (see `ways`).
#[test]
fn a_graph_with_memory_nodes_cannot_be_cloned() {
    for shim in [true, false] {
        let mut cmd = sim_command(&artifacts().probe, "16G", shim);
        cmd.args(["ctx", "g-node", "1G", "g-clone", "g-create", "g-clone"]);
        let o = cmd.output().unwrap();
        ok(&o);
        assert_eq!(num(&line(&o, "g-clone", 0), "rc"), 801, "shim={shim}");
        assert_eq!(num(&line(&o, "g-clone", 1), "rc"), 0, "shim={shim}");
    }
}

/// Two threads launch graphs at once (forced to overlap by a barrier)
/// under a cap that fits one: one runs, the other is refused with
/// CUDA_ERROR_OUT_OF_MEMORY, and the driver never holds more than the cap.
#[test]
fn racing_graph_launches_never_pass_the_cap() {
    for _ in 0..5 {
        let o = graph_probe(&[], Some("1536M"), &["ctx", "g-race", "1G"]);
        let l = line(&o, "g-race", 0);
        assert_eq!(l["rcs"], "0,2", "{}", stdout(&o));
        assert_eq!(pair(&l["now"]), (G, G));
    }
}

/// An executable graph the shim did not see instantiated may allocate
/// anything: under a cap its launch is refused rather than charged after
/// it ran; without one it runs.
#[test]
fn a_graph_the_shim_did_not_see_made_is_refused_under_a_cap() {
    let o = graph_probe(&[], Some("2G"), &["ctx", "g-foreign", "1000"]);
    assert_eq!(num(&line(&o, "g-foreign", 0), "rc"), 2);
    let o = graph_probe(&[], None, &["ctx", "g-foreign", "1000"]);
    assert_eq!(num(&line(&o, "g-foreign", 0), "rc"), 0);
}

/// Destroying the executable graph and the graph gives nothing back by
/// itself (the pool keeps what it reserved, as the driver's does); the
/// trim does.
#[test]
fn destroying_a_graph_leaves_its_pool_to_the_trim() {
    let o = graph_probe(
        &[],
        Some("2G"),
        &[
            "ctx",
            "g-capture",
            "1G",
            "g-instantiate",
            "flags",
            "g-launch",
            "1",
            "free",
            "g-destroy",
            "g-trim",
        ],
    );
    assert_eq!(now(&o, "g-destroy", 0), (G, G));
    assert_eq!(now(&o, "g-trim", 0), (0, 0));
}

// ---------------------------------------------------------------------------
// Shared VMM handles.

/// A VMM allocation exported as a file descriptor and imported as a second
/// handle: releasing the handle that was charged (and unmapping it) frees
/// nothing while the imported one lives, mapped or retained; the memory
/// goes with the last reference. The shim charges exactly what the driver
/// holds at every stage, and the simulated driver holds what a real one
/// does.
#[test]
fn imported_memory_counts_while_any_handle_to_it_lives() {
    const S: u64 = 256 * MIB;
    let want = [S, S, S, S, S, 0];
    for (shim, lookup) in [(true, "cudart"), (true, "dlsym"), (false, "cudart")] {
        let mut cmd = sim_command(&artifacts().probe, "16G", shim);
        cmd.env("GPU_MEM_LIMIT", "4G")
            .args(["--lookup", lookup, "ctx", "vmm-share", "256M"]);
        let o = cmd.output().unwrap();
        ok(&o);
        let stages = line(&o, "vmm-share", 0)["stages"].clone();
        let pairs: Vec<(u64, u64)> = stages.split(',').map(pair).collect();
        let held: Vec<u64> = pairs.iter().map(|p| p.1).collect();
        assert_eq!(held, want, "driver (shim={shim}): {stages}");
        if shim {
            let charged: Vec<u64> = pairs.iter().map(|p| p.0).collect();
            assert_eq!(charged, want, "shim ({lookup}): {stages}");
        }
    }
}

/// While only the imported handle holds the memory, the cap still counts
/// it: as much again does not fit under a cap of 1.5 times it.
#[test]
fn imported_memory_holds_its_place_under_the_cap() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "384M")],
        &["ctx", "vmm-share", "256M", "alloc", "alloc", "256M"],
    );
    ok(&o);
    let l = line(&o, "vmm-share", 0);
    assert_eq!(num(&l, "alloc_meanwhile"), 2, "{}", stdout(&o));
    // Everything released at the end: room again.
    assert_eq!(num(&line(&o, "alloc", 0), "rc"), 0);
}
