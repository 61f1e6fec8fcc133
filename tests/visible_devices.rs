//! `CUDA_VISIBLE_DEVICES` under the simulated driver, as a real driver reads
//! it: the listed devices, renumbered from 0 in the list's order (indices,
//! `GPU-` UUIDs), the list ending at the first entry that names no device;
//! NVML still sees every GPU. Caps follow the CUDA ordinal (`GPU_MEM_LIMIT_N`,
//! percentages of the device the ordinal names) on both the CUDA and the
//! NVML view, and a job placed on a GPU runs, and is seen, there.

mod support;
use std::collections::HashMap;
use std::process::{Output, Stdio};
use support::*;

const DEVICES: &str = "16G,8G";

/// The UUID of simulated device `i` (the simulator's deterministic ones).
fn sim_uuid(i: u8) -> String {
    format!("GPU-5a1e6f7a-c0de-4000-8000-0000000000{i:02x}")
}

/// (ordinal → (uuid, total)) of the `devices` step (totals as the shim
/// shows them: capped).
fn cuda_devices(o: &Output) -> Vec<(String, u64)> {
    let n = num(&line(o, "devices", 0), "count");
    (0..n as usize)
        .map(|k| {
            let d = line(o, "device", k);
            assert_eq!(num(&d, "ordinal"), k as u64, "{}", stdout(o));
            (d["uuid"].clone(), num(&d, "total"))
        })
        .collect()
}

fn visible(cvd: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut e = vec![("CUDA_VISIBLE_DEVICES", cvd)];
    e.extend_from_slice(env);
    probe(DEVICES, &e, args)
}

#[test]
fn one_listed_device_is_ordinal_0_and_a_percentage_is_of_it() {
    let o = visible(
        "1",
        &[("GPU_MEM_LIMIT", "25%")],
        &["devices", "ctx", "info", "fill", "alloc", "256M", "nvml"],
    );
    assert_eq!(
        cuda_devices(&o),
        vec![(sim_uuid(1), 2 * GIB)],
        "only the 8 GiB GPU, as ordinal 0, capped at 25% of it: {}",
        stdout(&o)
    );
    let info = line(&o, "info", 0);
    assert_eq!(num(&info, "total"), 2 * GIB, "25% of 8 GiB");
    assert_eq!(num(&line(&o, "fill", 0), "count"), 8, "2 GiB of 256 MiB");
    // NVML ignores CUDA_VISIBLE_DEVICES: both GPUs, each with its own view.
    let nvml0 = line(&o, "nvml", 0);
    let nvml1 = line(&o, "nvml", 1);
    assert_eq!(
        num(&nvml1, "total"),
        2 * GIB,
        "the capped GPU, through NVML"
    );
    assert_eq!(
        num(&nvml1, "used"),
        2 * GIB,
        "what this process holds there"
    );
    assert_eq!(
        num(&nvml0, "total"),
        4 * GIB,
        "a GPU CUDA does not show: what the process would be allowed there"
    );
}

#[test]
fn the_list_order_is_the_cuda_order_and_per_device_caps_follow_it() {
    // GPU_MEM_LIMIT_1 is ordinal 1 of this process: the 16 GiB GPU.
    let o = visible(
        "1,0",
        &[("GPU_MEM_LIMIT_1", "1G")],
        &[
            "--device", "1", "devices", "ctx", "info", "fill", "alloc", "256M", "nvml",
        ],
    );
    assert_eq!(
        cuda_devices(&o),
        vec![(sim_uuid(1), 8 * GIB), (sim_uuid(0), GIB)],
        "{}",
        stdout(&o)
    );
    assert_eq!(num(&line(&o, "info", 0), "total"), GIB);
    assert_eq!(num(&line(&o, "fill", 0), "count"), 4);
    // NVML index 0 is the 16 GiB GPU, matched to ordinal 1 by its UUID.
    assert_eq!(num(&line(&o, "nvml", 0), "total"), GIB);
    assert_eq!(num(&line(&o, "nvml", 0), "used"), GIB);
    assert_eq!(num(&line(&o, "nvml", 1), "total"), 8 * GIB, "uncapped");
    assert_eq!(num(&line(&o, "nvml", 1), "used"), 0);
}

#[test]
fn uuids_name_devices_and_an_entry_that_names_none_ends_the_list() {
    let cases: &[(String, Vec<(String, u64)>)] = &[
        (sim_uuid(1), vec![(sim_uuid(1), 8 * GIB)]),
        (
            format!("{},0", sim_uuid(1).to_uppercase()),
            vec![(sim_uuid(1), 8 * GIB), (sim_uuid(0), 16 * GIB)],
        ),
        // -1, an index past the last GPU, an ambiguous UUID prefix (both
        // simulated UUIDs start so), a device named twice: the list ends.
        ("0,-1,1".into(), vec![(sim_uuid(0), 16 * GIB)]),
        ("1,2,0".into(), vec![(sim_uuid(1), 8 * GIB)]),
        ("1,GPU-5a1e6f7a,0".into(), vec![(sim_uuid(1), 8 * GIB)]),
        (format!("0,{}", sim_uuid(0)), vec![(sim_uuid(0), 16 * GIB)]),
    ];
    for (cvd, want) in cases {
        let o = visible(cvd, &[], &["devices"]);
        assert_eq!(&cuda_devices(&o), want, "CUDA_VISIBLE_DEVICES={cvd}");
    }
    // Nothing valid first, or an empty list: no device at all.
    for cvd in ["", "GPU-5a1e6f7a", "2", "none"] {
        let o = visible(cvd, &[], &["devices"]);
        assert_eq!(
            num(&line(&o, "init", 0), "rc"),
            100,
            "CUDA_VISIBLE_DEVICES={cvd:?}: CUDA_ERROR_NO_DEVICE, {}",
            stderr(&o)
        );
    }
}

#[test]
fn nvml_lists_a_process_only_on_the_gpu_it_used() {
    let o = visible("1", &[], &["ctx", "alloc", "alloc", "64M", "nvml-procs"]);
    let me: HashMap<u64, String> = (0..2)
        .map(|i| {
            let l = line(&o, "nvml-procs", i);
            (num(&l, "index"), l["pids"].clone())
        })
        .collect();
    assert_eq!(me[&0], "", "nothing on GPU 0: {}", stdout(&o));
    assert_eq!(me[&1].split(',').count(), 1, "the probe on GPU 1: {me:?}");
}

/// With GPU 0 leased, a job asking for one whole GPU gets GPU 1: its
/// kernels and memory land on GPU 1, the simulated NVML lists it there
/// alone, and `gpufrac status` shows it on GPU 1.
#[test]
fn a_job_placed_on_gpu_1_runs_there() {
    let b = Broker::start(DEVICES, &[]);
    let dir = Scratch::new("visible-devices");
    // Both jobs end when told to, or when the scratch directory goes with a
    // failed test, so that none outlives it.
    let first = format!(
        "echo $CUDA_VISIBLE_DEVICES > {d}/first.tmp && mv {d}/first.tmp {d}/first.env; \
         while [ -d {d} ] && [ ! -e {d}/first.stop ]; do sleep 0.02; done",
        d = dir.0.display()
    );
    let mut first = KillOnDrop(
        b.run(&["--gpus", "1", "--", "sh", "-c", &first])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(20.0, "the first job to start", || {
        dir.0.join("first.env").exists()
    });
    let cvd = std::fs::read_to_string(dir.0.join("first.env")).unwrap();
    assert_eq!(cvd, "0\n");

    let out = dir.0.join("second.out");
    let stop = dir.0.join("second.stop");
    let script = format!(
        "echo cvd=$CUDA_VISIBLE_DEVICES > {out}; {probe} devices ctx alloc alloc 512M \
         launch 10 1000 nvml-procs wait-file {stop} >> {out}",
        out = out.display(),
        probe = artifacts().probe.display(),
        stop = stop.display(),
    );
    let mut second = KillOnDrop(
        b.run(&["--gpus", "1", "--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut text = String::new();
    wait_until(
        20.0,
        "the second job's probe to list NVML's processes",
        || {
            text = std::fs::read_to_string(&out).unwrap_or_default();
            text.contains("nvml-procs index=1")
        },
    );
    assert!(text.starts_with("cvd=1\n"), "{text}");
    let field = |prefix: &str, key: &str| -> String {
        let l = text
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {text}"));
        l.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {l}"))
            .to_owned()
    };
    assert_eq!(field("device ordinal=0", "uuid"), sim_uuid(1), "{text}");
    assert_eq!(field("alloc", "rc"), "0", "{text}");
    assert_eq!(field("launch", "rc"), "0", "{text}");
    assert_eq!(field("nvml-procs index=0", "pids"), "", "{text}");
    let pid: u64 = field("nvml-procs index=1", "pids").parse().unwrap();

    // The broker knows it by the UUID its shim registered: GPU 1's.
    let on = |s: &serde_json::Value, g: usize| -> Vec<u64> {
        s["gpus"][g]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pid"].as_u64().unwrap())
            .collect()
    };
    let mut s = serde_json::Value::Null;
    wait_until(20.0, "the job's process in status", || {
        s = b.status();
        on(&s, 1).contains(&pid)
    });
    assert_eq!(s["gpus"][1]["uuid"], sim_uuid(1));
    assert!(!on(&s, 0).contains(&pid), "status: {s}");

    std::fs::write(&stop, "").unwrap();
    assert!(second.0.wait().unwrap().success());
    std::fs::write(dir.0.join("first.stop"), "").unwrap();
    assert!(first.0.wait().unwrap().success());
}
