//! Containers under gpufrac with real engines: a sealed image (Debian's
//! essential packages, no gpufrac, no CUDA) under Docker with `gpufrac
//! docker-args`, and under Podman with the CDI spec of `gpufrac cdi
//! generate`. The test programs and the simulated driver are mounted in,
//! and the simulated GPUs' state is shared with the host, so the container
//! and the host's broker see the same GPUs.
//!
//! The engines and the image are set up on first use (tests/support/
//! engines.rs), saying what they install and where; where that is
//! impossible, or GPUFRAC_TEST_ENGINES=0, a test says so loudly and passes.

#[path = "support/engines.rs"]
mod engines;
mod support;

use std::path::{Path, PathBuf};

use engines::{Container, Engine, PROBE};
use support::*;

const CAP: &str = "64M";
const DEVICE: &str = "1G";
/// Probe steps: what the process sees, then 4 MiB blocks until refused.
const FILL: &[&str] = &["ctx", "info", "fill", "alloc", "4M"];

fn with_image(mut args: Vec<String>, image: &str, cmd: &[&str]) -> Vec<String> {
    args.push(image.to_owned());
    args.extend(cmd.iter().map(|s| s.to_string()));
    args
}

/// The broker's view of `pid` on GPU `gpu`, once it shows `mem_used`
/// bytes there.
fn registered_with(b: &Broker, pid: u32, gpu: usize, mem_used: u64) -> serde_json::Value {
    let find = |s: &serde_json::Value| {
        s["gpus"][gpu]["processes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["pid"].as_u64() == Some(pid.into()))
            .cloned()
    };
    // Usage reports are coalesced (~100 ms).
    wait_until(
        20.0,
        "the container's process to register and report",
        || find(&b.status()).is_some_and(|p| p["mem_used"].as_u64() == Some(mem_used)),
    );
    // Through the CLI users have.
    let s = status_cli(&b.socket);
    find(&s).unwrap_or_else(|| panic!("gpufrac status --json lacks pid {pid} on GPU {gpu}: {s:#}"))
}

#[test]
fn sealed_image_under_docker_is_capped_and_registered() {
    if !engines::ensure_docker() {
        return;
    }
    let image = engines::image(Engine::Docker);
    let b = Broker::start(DEVICE, &[]);
    let args = engines::docker_args(&["--socket", b.socket.to_str().unwrap(), "--gpu-memory", CAP]);
    // No --gpus: there is no NVIDIA runtime here; the simulated driver is
    // mounted instead.
    let mut run = args;
    run.extend(engines::sim_args(&b));
    let mut cmd: Vec<&str> = vec![PROBE];
    cmd.extend_from_slice(FILL);
    // Alive until the broker has been asked; removed when `c` drops.
    cmd.extend_from_slice(&["sleep-ms", "30000"]);
    let mut c = Container::run(Engine::Docker, &with_image(run, image, &cmd));

    let info = c.wait_line("info", 60);
    assert_eq!(num(&info, "total"), 64 * MIB, "{info:?}");
    assert_eq!(num(&info, "devtotal"), 64 * MIB, "{info:?}");
    let fill = c.wait_line("fill", 30);
    assert_eq!(num(&fill, "count"), 16, "{fill:?}");
    assert_eq!(num(&fill, "rc"), 2, "refused with CUDA_ERROR_OUT_OF_MEMORY");

    let pid = c.host_pid();
    let p = registered_with(&b, pid, 0, 64 * MIB);
    assert_eq!(p["mem_cap"].as_u64(), Some(64 * MIB), "{p}");
    assert!(p["command"].as_str().unwrap().contains("probe"), "{p}");
    assert!(p["ooms"].as_u64().unwrap() >= 1, "{p}");
}

/// The image's entrypoint clears LD_PRELOAD: with --preload-file the
/// loader still preloads the shim from /etc/ld.so.preload; without it the
/// same container escapes the cap.
#[test]
fn preload_file_survives_an_entrypoint_that_clears_ld_preload() {
    if !engines::ensure_docker() {
        return;
    }
    let image = engines::image(Engine::Docker);
    let b = Broker::start(DEVICE, &[]);
    let scratch = Scratch::new("preload");
    let preload = scratch.0.join("ld.so.preload");
    let socket = b.socket.to_str().unwrap();

    let run = |flags: Vec<String>| {
        let mut args = flags;
        args.extend(engines::sim_args(&b));
        args.extend(["--entrypoint".into(), "/usr/bin/env".into()]);
        // The "entrypoint": env -u LD_PRELOAD, then a shell that says what
        // is left of LD_PRELOAD and execs the program.
        let mut cmd = vec![
            "-u",
            "LD_PRELOAD",
            "sh",
            "-c",
            "echo env ld_preload=${LD_PRELOAD:-unset}; exec \"$@\"",
            "sh",
            PROBE,
        ];
        cmd.extend_from_slice(FILL);
        let (st, lines) = Container::run(Engine::Docker, &with_image(args, image, &cmd)).finish(60);
        assert!(st.success(), "{st}: {}", lines.join("\n"));
        assert_eq!(engines::step(&lines, "env", 0)["ld_preload"], "unset");
        (
            num(&engines::step(&lines, "info", 0), "total"),
            num(&engines::step(&lines, "fill", 0), "count"),
        )
    };

    let flags = engines::docker_args(&[
        "--socket",
        socket,
        "--gpu-memory",
        CAP,
        "--preload-file",
        preload.to_str().unwrap(),
    ]);
    assert!(
        !flags.iter().any(|a| a.starts_with("LD_PRELOAD=")),
        "{flags:?}"
    );
    assert_eq!(
        run(flags),
        (64 * MIB, 16),
        "capped through /etc/ld.so.preload"
    );

    let flags = engines::docker_args(&["--socket", socket, "--gpu-memory", CAP]);
    assert_eq!(
        run(flags),
        (GIB, GIB / (4 * MIB)),
        "without --preload-file the entrypoint escapes: the whole device"
    );
}

/// A CDI spec in /var/run/cdi (Podman 4.3 reads no other directory we
/// could point it at), removed when dropped. One at a time on the machine:
/// two specs of one kind in one directory make every device ambiguous.
struct CdiSpec {
    path: PathBuf,
    _lock: engines::MachineLock,
}

impl CdiSpec {
    fn path() -> (PathBuf, engines::MachineLock) {
        let lock = engines::MachineLock::take("cdi");
        let dir = Path::new("/var/run/cdi");
        // One left by a test that was killed, or someone's own: either
        // makes our devices unresolvable, so say which file it is.
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            assert!(
                !text.contains("\"gpufrac.dev/gpu\""),
                "{} already defines kind gpufrac.dev/gpu, which would make the test's \
                 devices ambiguous to Podman; remove it",
                e.path().display()
            );
        }
        let p = dir.join(format!("gpufrac-test-{}.json", std::process::id()));
        (p, lock)
    }
}

impl Drop for CdiSpec {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A directory of stand-ins for the NVIDIA device nodes: links to
/// /dev/null, which the generator resolves (a runtime takes a node's
/// numbers from the node itself).
fn fake_dev_dir(names: &[&str]) -> Scratch {
    let d = Scratch::new("dev");
    for n in names {
        std::os::unix::fs::symlink("/dev/null", d.0.join(n)).unwrap();
    }
    d
}

/// `gpufrac cdi generate ARGS` against `b`'s simulated GPUs.
fn cdi_generate(b: &Broker, args: &[&str]) -> std::process::Output {
    let a = artifacts();
    sim_command(&a.gpufrac, &b.devices, false)
        .env("GPUFRAC_SIM_STATE", &b.state)
        .args(["cdi", "generate"])
        .args(args)
        .output()
        .unwrap()
}

fn sim_lib(name: &str) -> String {
    artifacts().simdir.join(name).display().to_string()
}

/// The loader's own directory in Debian images, searched without an ld
/// cache entry.
fn multiarch_dir() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "/usr/lib/aarch64-linux-gnu"
    } else {
        "/usr/lib/x86_64-linux-gnu"
    }
}

#[test]
fn cdi_generate_lists_every_gpu_and_refuses_what_is_missing() {
    let b = Broker::start("2G,1G", &[]);
    let dev = fake_dev_dir(&["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"]);
    let out = Scratch::new("cdi-out");
    let spec_path = out.0.join("cdi/gpufrac.json");
    let cuda = sim_lib("libcuda.so.1");
    let o = cdi_generate(
        &b,
        &[
            "--socket",
            b.socket.to_str().unwrap(),
            "--dev-dir",
            dev.0.to_str().unwrap(),
            "--driver-lib",
            &cuda,
            "--output",
            spec_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "--output writes nothing to stdout");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    assert_eq!(s["kind"], "gpufrac.dev/gpu");
    let names: Vec<&str> = s["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["0", "1", "all"]);
    assert_eq!(
        s["devices"][1]["containerEdits"]["deviceNodes"][0]["path"],
        "/dev/nvidia1"
    );
    let mounts = s["containerEdits"]["mounts"].as_array().unwrap();
    let shim = artifacts().shim.canonicalize().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m["hostPath"] == shim.to_str().unwrap()
                && m["containerPath"] == "/usr/lib/gpufrac/libgpufrac.so"),
        "{s}"
    );
    assert!(
        mounts.iter().any(
            |m| m["hostPath"] == b.socket.parent().unwrap().to_str().unwrap()
                && m["containerPath"] == "/run/gpufrac"
        ),
        "{s}"
    );
    assert!(
        mounts
            .iter()
            .any(|m| m["containerPath"] == format!("{}/libcuda.so.1", artifacts().simdir.display())),
        "{s}"
    );

    // Without --output the spec goes to stdout, as nvidia-ctk's does.
    let o = cdi_generate(
        &b,
        &["--dev-dir", dev.0.to_str().unwrap(), "--driver-lib", &cuda],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let s2: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s2["devices"].as_array().unwrap().len(), 3);

    // GPU 1's node missing: refused, naming it, and nothing written.
    std::fs::remove_file(dev.0.join("nvidia1")).unwrap();
    let other = out.0.join("other.json");
    let o = cdi_generate(
        &b,
        &[
            "--dev-dir",
            dev.0.to_str().unwrap(),
            "--driver-lib",
            &cuda,
            "--output",
            other.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains(&format!("{}/nvidia1", dev.0.display())) && e.contains("GPU 1 (GPU-"),
        "{e}"
    );
    assert!(!other.exists());

    // A driver with no GPUs: nothing to describe.
    let o = sim_command(&artifacts().gpufrac, "", false)
        .args(["cdi", "generate", "--driver-lib", &cuda])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot list the GPUs"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn podman_with_the_cdi_spec_is_capped_and_registered() {
    if !engines::ensure_podman() {
        return;
    }
    let image = engines::image(Engine::Podman);
    let b = Broker::start("1G,1G", &[]);
    let dev = fake_dev_dir(&["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"]);
    let (path, lock) = CdiSpec::path();
    let spec = CdiSpec { path, _lock: lock };
    let o = cdi_generate(
        &b,
        &[
            "--socket",
            b.socket.to_str().unwrap(),
            "--dev-dir",
            dev.0.to_str().unwrap(),
            "--driver-lib",
            &sim_lib("libcuda.so.1"),
            "--driver-lib",
            &sim_lib("libnvidia-ml.so.1"),
            // Where the image's loader looks by itself: no LD_LIBRARY_PATH.
            "--container-lib-dir",
            multiarch_dir(),
            "--output",
            spec.path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));

    // Only the spec brings the shim, the socket and the driver: the
    // container gets the test programs and the simulated GPUs' state.
    let mut args = vec![
        "--device".to_owned(),
        "gpufrac.dev/gpu=1".to_owned(),
        "-e".to_owned(),
        format!("GPU_MEM_LIMIT={CAP}"),
    ];
    args.extend(engines::sim_state_args(&b.devices, &b.state));
    args.extend(engines::program_args());
    let script = format!(
        "r=; for n in nvidia0 nvidia1 nvidiactl nvidia-uvm; do \
           if [ -c /dev/$n ]; then r=\"$r $n=1\"; else r=\"$r $n=0\"; fi; done; \
         echo nodes$r; \
         echo env ld_preload=$LD_PRELOAD socket=$GPUFRAC_SOCKET \
           ld_library_path=${{LD_LIBRARY_PATH:-unset}}; \
         [ -f {}/libcuda.so.1 ] && echo driver mounted=1; \
         exec \"$@\"",
        multiarch_dir()
    );
    let mut cmd = vec!["sh", "-c", &script, "sh", PROBE, "--device", "1"];
    cmd.extend_from_slice(FILL);
    cmd.extend_from_slice(&["sleep-ms", "30000"]);
    let mut c = Container::run(Engine::Podman, &with_image(args, image, &cmd));

    let nodes = c.wait_line("nodes", 60);
    let want: std::collections::HashMap<String, String> = [
        ("nvidia0", "0"),
        ("nvidia1", "1"),
        ("nvidiactl", "1"),
        ("nvidia-uvm", "1"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(nodes, want, "only GPU 1's node, and the control nodes");
    let env = c.wait_line("env", 10);
    assert_eq!(env["ld_preload"], "/usr/lib/gpufrac/libgpufrac.so");
    assert_eq!(env["socket"], "/run/gpufrac/broker.sock");
    assert_eq!(env["ld_library_path"], "unset");
    assert_eq!(c.wait_line("driver", 10)["mounted"], "1");

    let info = c.wait_line("info", 30);
    assert_eq!(num(&info, "total"), 64 * MIB, "{info:?}");
    let fill = c.wait_line("fill", 30);
    assert_eq!(num(&fill, "count"), 16, "{fill:?}");
    assert_eq!(num(&fill, "rc"), 2);

    let pid = c.host_pid();
    let p = registered_with(&b, pid, 1, 64 * MIB);
    assert_eq!(p["mem_cap"].as_u64(), Some(64 * MIB), "{p}");
    assert!(p["ooms"].as_u64().unwrap() >= 1, "{p}");
    drop(c);

    // The same spec under `gpufrac run`: the CDI device brings the shim and
    // the socket, run adds the job (its cap, books and token), and the
    // container's process counts in the job.
    let name = engines::container_name();
    let mut cmd = b.run(&["--gpu-memory", "128M", "--", Engine::Podman.program()]);
    cmd.envs(Engine::Podman.env())
        .args(Engine::run_args(&name))
        .args(["--device", "gpufrac.dev/gpu=all"])
        .args(engines::sim_state_args(&b.devices, &b.state))
        .args(engines::program_args())
        .arg(image)
        .arg(PROBE)
        .args(FILL)
        .args(["sleep-ms", "30000"]);
    let mut c = Container::attach(Engine::Podman, name, cmd);
    let info = c.wait_line("info", 60);
    assert_eq!(num(&info, "total"), 128 * MIB, "{info:?}");
    assert_eq!(num(&c.wait_line("fill", 30), "count"), 32);
    // Best fit counts memory the first container's process may still hold
    // on GPU 1 while podman tears it down (under load it does): the lease
    // is looked for where the broker placed it.
    let leases = b.leases();
    let gpu = leases
        .iter()
        .find(|l| l["pid"].as_u64() == Some(c.client_pid().into()))
        .and_then(|l| l["gpus"][0].as_u64())
        .unwrap_or_else(|| panic!("no lease of pid {} on a GPU: {leases:#?}", c.client_pid()));
    let p = registered_with(&b, c.host_pid(), gpu as usize, 128 * MIB);
    assert_eq!(p["job"].as_u64(), Some(c.client_pid().into()), "{p}");
    assert_eq!(p["job_mem_used"].as_u64(), Some(128 * MIB), "{p}");
    drop(c);
    drop(spec);
}

/// `gpufrac run … -- docker run …`: the container's job queues behind a
/// job holding the GPU, gets its lease, its process (a child of the
/// container runtime, not of run) counts in the job under the job's cap,
/// and `docker kill` ends the lease.
#[test]
fn a_containerised_job_queues_holds_a_lease_and_ends_with_the_container() {
    if !engines::ensure_docker() {
        return;
    }
    let image = engines::image(Engine::Docker);
    let b = Broker::start(DEVICE, &[]);
    let mut first = KillOnDrop(
        b.run(&["--gpus", "1", "--", "sh", "-c", "cat > /dev/null"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_until(20.0, "the first job's lease", || {
        b.status()["leases"]
            .as_array()
            .is_some_and(|l| l.len() == 1)
    });

    let name = engines::container_name();
    let mut cmd = b.run(&["--gpu-memory", CAP, "--", Engine::Docker.program()]);
    cmd.envs(Engine::Docker.env())
        .args(Engine::run_args(&name))
        .args(engines::sim_args(&b));
    cmd.arg(image)
        .arg(PROBE)
        .args(FILL)
        .args(["sleep-ms", "60000"]);
    let mut c = Container::attach(Engine::Docker, name.clone(), cmd);
    let run_pid = c.client_pid();
    wait_until(20.0, "the container's job in the queue", || {
        b.status()["queue"]
            .as_array()
            .is_some_and(|q| q.iter().any(|e| e["pid"].as_u64() == Some(run_pid.into())))
    });
    // Not started while queued: docker run has not even been called.
    assert!(c.seen.is_empty(), "{:?}", c.seen);

    drop(first.0.stdin.take());
    assert!(first.0.wait().unwrap().success());
    let info = c.wait_line("info", 60);
    assert_eq!(num(&info, "total"), 64 * MIB, "{info:?}");
    let fill = c.wait_line("fill", 30);
    assert_eq!(num(&fill, "count"), 16, "{fill:?}");
    let pid = c.host_pid();
    let p = registered_with(&b, pid, 0, 64 * MIB);
    // In the job: the broker names it by the run's pid, although the
    // process descends from the container runtime.
    assert_eq!(p["job"].as_u64(), Some(run_pid.into()), "{p}");
    assert_eq!(p["job_mem_used"].as_u64(), Some(64 * MIB), "{p}");
    let leases = b.status()["leases"].clone();
    assert!(
        leases
            .as_array()
            .is_some_and(|l| l.len() == 1 && l[0]["pid"].as_u64() == Some(run_pid.into())),
        "{leases}"
    );

    engines::Engine::Docker.run_ok(&["kill", &name]);
    let (st, _) = c.finish(30);
    assert_eq!(st.code(), Some(137), "run passes on the container's end");
    wait_until(20.0, "the lease to end with the container", || {
        let s = b.status();
        s["leases"].as_array().is_some_and(Vec::is_empty)
            && s["gpus"][0]["processes"]
                .as_array()
                .is_none_or(Vec::is_empty)
    });
}

/// A detached container would leave the lease behind at once: refused,
/// before anything is asked of the broker (nothing queued, nothing booked).
#[test]
fn a_detached_container_is_refused() {
    let b = Broker::start(DEVICE, &[]);
    for engine in ["docker", "podman"] {
        let o = b
            .run(&["--gpu-memory", CAP, "--", engine, "run", "-d", "img"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("drop -d"), "{}", stderr(&o));
    }
    // Its log has every lease at info: none was asked for.
    let log = b.log();
    assert!(log.contains("broker ready"), "{log}");
    assert!(!log.contains("lease "), "{log}");
}
