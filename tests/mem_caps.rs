//! Memory caps, end to end: real processes under LD_PRELOAD=libgpufrac.so
//! against the simulated driver, through every lookup path.

mod support;
use support::*;

const CAP: &str = "64M";
const CAP_BYTES: u64 = 64 * MIB;

/// Fills KIND blocks under a 64 MiB cap and checks the exact count and the
/// out-of-memory code, then that a free makes room for exactly one more.
fn fill_exact(lookup: &str, extra: &[&str], kind: &str, size: &str, expect: u64) {
    let mut args = vec!["--lookup", lookup];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[
        "ctx", "fill", kind, size, "free-one", "alloc", kind, size, "alloc", kind, size,
    ]);
    let o = probe("16G", &[("GPU_MEM_LIMIT", CAP)], &args);
    let fill = line(&o, "fill", 0);
    assert_eq!(
        num(&fill, "count"),
        expect,
        "{lookup} {kind}: {}",
        stdout(&o)
    );
    assert_eq!(
        num(&fill, "rc"),
        2,
        "{kind} must end with CUDA_ERROR_OUT_OF_MEMORY"
    );
    assert_eq!(num(&line(&o, "free-one", 0), "rc"), 0);
    assert_eq!(
        num(&line(&o, "alloc", 0), "rc"),
        0,
        "after a free, one more {kind} fits"
    );
    assert_eq!(num(&line(&o, "alloc", 1), "rc"), 2, "and only one");
}

#[test]
fn every_allocation_path_stops_exactly_at_the_cap() {
    for lookup in ["cudart", "dlsym"] {
        fill_exact(lookup, &[], "alloc", "4M", 16);
        fill_exact(lookup, &[], "managed", "4M", 16);
        fill_exact(lookup, &[], "async", "4M", 16);
        fill_exact(lookup, &["--ptsz"], "async", "4M", 16);
        fill_exact(lookup, &[], "pool", "4M", 16);
        fill_exact(lookup, &["--ptsz"], "pool", "4M", 16);
        fill_exact(lookup, &[], "vmm", "4M", 16);
        fill_exact(lookup, &[], "array", "4M", 16);
        fill_exact(lookup, &[], "array3d", "4M", 16); // (4M/4) x 2 x 2 bytes each
        // 2048x2048 level 0 + 1024² + 512² = 5.25 MiB per mipmapped array.
        fill_exact(lookup, &[], "mipmap", "4M", 12);
    }
}

#[test]
fn pitch_counts_the_padded_rows() {
    // Width 1 MiB + 1 byte: the driver pads each of the 4 rows to a 512-byte
    // pitch, so each allocation is 4 × (1 MiB + 512) bytes; 15 fit in 64 MiB
    // where counting the requested width would have let 15 too, but 16 × the
    // padded size would not: the count pins the padded figure.
    let per = 4 * (MIB + 512);
    let expect = CAP_BYTES / per;
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &["ctx", "fill", "pitch", "1048577", "info"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), expect);
    assert_eq!(num(&line(&o, "pitch", 0), "pitch"), MIB + 512);
    let info = line(&o, "info", 0);
    assert_eq!(
        num(&info, "free"),
        CAP_BYTES - expect * per,
        "used = pitch × height per allocation"
    );
}

#[test]
fn direct_linking_is_capped() {
    let a = artifacts();
    let app = a.fixtures.join("lcuda_app");
    assert!(
        app.exists(),
        "fixture {app:?} missing: build.rs needs a C compiler"
    );
    let o = sim_command(&app, "16G", true)
        .env("GPU_MEM_LIMIT", CAP)
        .arg((4 * MIB).to_string())
        .output()
        .unwrap();
    assert_eq!(num(&line(&o, "lcuda", 0), "count"), 16, "{}", stdout(&o));
    assert_eq!(num(&line(&o, "lcuda", 0), "rc"), 2);
    assert_eq!(num(&line(&o, "lcuda", 2), "rc"), 0, "realloc after free");
    assert_eq!(num(&line(&o, "lcuda", 3), "total"), CAP_BYTES);
    // Without the shim the same program is limited only by the device.
    let o = sim_command(&app, "256M", false)
        .arg((4 * MIB).to_string())
        .output()
        .unwrap();
    assert_eq!(num(&line(&o, "lcuda", 0), "count"), 64);
}

#[test]
fn frees_make_room_and_nothing_drifts() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &[
            "ctx",
            "fill",
            "alloc",
            "4M",
            "free-all",
            "churn",
            "alloc",
            "4K",
            "100000",
            "churn",
            "vmm",
            "2M",
            "20000",
            "fill",
            "alloc",
            "4M",
            "limit-api",
        ],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
    assert_eq!(num(&line(&o, "free-all", 0), "failures"), 0);
    assert_eq!(num(&line(&o, "churn", 0), "failures"), 0);
    assert_eq!(num(&line(&o, "churn", 1), "failures"), 0);
    assert_eq!(
        num(&line(&o, "fill", 1), "count"),
        16,
        "120 000 alloc/free pairs later the cap is intact"
    );
    let api = line(&o, "limit-api", 0);
    assert_eq!(num(&api, "limit"), CAP_BYTES);
    assert_eq!(num(&api, "used"), CAP_BYTES);
}

#[test]
fn racing_threads_never_overshoot() {
    for _ in 0..3 {
        let o = probe(
            "16G",
            &[("GPU_MEM_LIMIT", CAP)],
            &["ctx", "race", "8", "alloc", "1M", "limit-api"],
        );
        assert_eq!(
            num(&line(&o, "race", 0), "count"),
            64,
            "8 threads together get exactly cap/size"
        );
        assert_eq!(num(&line(&o, "limit-api", 0), "used"), CAP_BYTES);
    }
}

#[test]
fn views_report_the_cap() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &["ctx", "info", "alloc", "alloc", "10M", "info", "nvml"],
    );
    let before = line(&o, "info", 0);
    assert_eq!(num(&before, "total"), CAP_BYTES);
    assert_eq!(num(&before, "free"), CAP_BYTES);
    assert_eq!(num(&before, "devtotal"), CAP_BYTES);
    let after = line(&o, "info", 1);
    assert_eq!(num(&after, "free"), CAP_BYTES - 10 * MIB);
    let nvml = line(&o, "nvml", 0);
    assert_eq!(num(&nvml, "total"), CAP_BYTES);
    assert_eq!(num(&nvml, "free"), CAP_BYTES - 10 * MIB);
    assert_eq!(num(&nvml, "used"), 10 * MIB);
    assert_eq!(num(&nvml, "total2"), CAP_BYTES);
    assert_eq!(num(&nvml, "free2"), CAP_BYTES - 10 * MIB);
    assert_eq!(num(&nvml, "used2"), 10 * MIB);
}

#[test]
fn free_memory_is_never_more_than_the_device_has() {
    // A 64 MiB device under a 1 GiB cap: the device is the limit.
    let o = probe(
        "64M",
        &[("GPU_MEM_LIMIT", "1G")],
        &[
            "ctx", "alloc", "alloc", "16M", "info", "fill", "alloc", "4M",
        ],
    );
    let info = line(&o, "info", 0);
    assert_eq!(num(&info, "total"), 64 * MIB);
    assert_eq!(num(&info, "free"), 48 * MIB);
    assert_eq!(num(&line(&o, "fill", 0), "count"), 12);
}

#[test]
fn null_out_pointers_behave_as_the_driver_does() {
    let plain = sim_command(&artifacts().probe, "16G", false)
        .args(["ctx", "info-null"])
        .output()
        .unwrap();
    let capped = probe("16G", &[("GPU_MEM_LIMIT", CAP)], &["ctx", "info-null"]);
    assert_eq!(
        line(&plain, "info-null", 0)["rc"],
        line(&capped, "info-null", 0)["rc"]
    );
}

#[test]
fn uncapped_processes_see_the_physical_device() {
    let o = probe("256M", &[], &["ctx", "info", "fill", "alloc", "4M", "nvml"]);
    assert_eq!(num(&line(&o, "info", 0), "total"), 256 * MIB);
    assert_eq!(num(&line(&o, "fill", 0), "count"), 64);
    assert_eq!(num(&line(&o, "nvml", 0), "total"), 256 * MIB);
}

#[test]
fn per_device_overrides() {
    let env = [("GPU_MEM_LIMIT", CAP), ("GPU_MEM_LIMIT_1", "32M")];
    let o = probe(
        "16G,16G",
        &env,
        &["--device", "0", "ctx", "fill", "alloc", "4M", "nvml"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
    assert_eq!(num(&line(&o, "nvml", 0), "total"), CAP_BYTES);
    assert_eq!(num(&line(&o, "nvml", 1), "total"), 32 * MIB);
    let o = probe(
        "16G,16G",
        &env,
        &["--device", "1", "ctx", "fill", "alloc", "4M", "info"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 8);
    assert_eq!(num(&line(&o, "info", 0), "total"), 32 * MIB);
    // "0" lifts the cap for one device.
    let o = probe(
        "256M,256M",
        &[("GPU_MEM_LIMIT", CAP), ("GPU_MEM_LIMIT_1", "0")],
        &["--device", "1", "ctx", "fill", "alloc", "4M"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 64);
}

#[test]
fn vmm_charges_the_device_it_is_placed_on() {
    // Context on device 0, physical allocations placed on device 1 (cap 32M).
    let env = [("GPU_MEM_LIMIT_0", "64M"), ("GPU_MEM_LIMIT_1", "32M")];
    let o = probe(
        "16G,16G",
        &env,
        &["--device", "0", "ctx", "fill", "vmm@1", "4M", "info"],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 8);
    assert_eq!(
        num(&line(&o, "info", 0), "free"),
        64 * MIB,
        "device 0 untouched"
    );
}

/// The documented VMM idiom: create, map, release at once. The driver
/// keeps the memory until the unmap, so the cap must too (8 × 1 GiB once
/// passed a 2 GiB cap on an H100).
#[test]
fn vmm_memory_released_while_mapped_stays_charged() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "2G")],
        &["ctx", "fill", "vmmap", "512M", "info"],
    );
    assert_eq!(
        num(&line(&o, "fill", 0), "count"),
        4,
        "mapped-and-released handles must stay charged: {}",
        stdout(&o)
    );
    assert_eq!(num(&line(&o, "info", 0), "free"), 0);
    // Unmapping frees them: the cap is whole again.
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "2G")],
        &[
            "ctx", "fill", "vmmap", "512M", "free-all", "fill", "vmmap", "512M",
        ],
    );
    assert_eq!(num(&line(&o, "fill", 1), "count"), 4, "{}", stdout(&o));
}

/// Retained references, a second (partial) mapping, releases and unmaps:
/// the shim charges exactly what the driver holds at every stage, and the
/// simulated driver holds what a real one does (the memory goes with the
/// last of references and mappings).
#[test]
fn vmm_charge_follows_references_and_mappings() {
    const S: u64 = 256 * MIB;
    let want = [S, S, S, S, 0];
    for shim in [true, false] {
        let mut cmd = sim_command(&artifacts().probe, "16G", shim);
        cmd.env("GPU_MEM_LIMIT", "4G")
            .args(["ctx", "vmm-life", "256M"]);
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
        let stages = line(&o, "vmm-life", 0)["stages"].clone();
        let pairs: Vec<(u64, u64)> = stages
            .split(',')
            .map(|p| {
                let (a, b) = p.split_once('/').unwrap();
                (a.parse().unwrap(), b.parse().unwrap())
            })
            .collect();
        let held: Vec<u64> = pairs.iter().map(|p| p.1).collect();
        assert_eq!(held, want, "driver (shim={shim}): {stages}");
        if shim {
            let charged: Vec<u64> = pairs.iter().map(|p| p.0).collect();
            assert_eq!(charged, want, "shim: {stages}");
        }
    }
}

fn graph_mem(o: &std::process::Output) -> std::collections::HashMap<String, String> {
    assert!(o.status.success(), "{}{}", stdout(o), stderr(o));
    line(o, "graph-mem", 0)
}

/// A cuMemAllocAsync captured into a graph, launched, freed outside the
/// graph, relaunched: the driver's graph pool keeps the memory across all of
/// it (on an H100 six relaunches held 6.6 GiB that the cap counted as 0), so
/// the cap counts it until the pool is trimmed — and the simulated driver
/// holds exactly that much at every step.
#[test]
fn graph_memory_is_charged_while_the_graph_pool_holds_it() {
    let g = (1u64 << 30).to_string();
    let each = format!("{g}/{g}");
    for shim in [true, false] {
        let mut cmd = sim_command(&artifacts().probe, "16G", shim);
        cmd.env("GPU_MEM_LIMIT", "2G")
            .args(["ctx", "graph-mem", "1G", "6", "free"]);
        let o = cmd.output().unwrap();
        let m = graph_mem(&o);
        assert_eq!(m["launches"], "0,0,0,0,0,0", "{}", stdout(&o));
        let after: Vec<&str> = m["after"].split(',').collect();
        if shim {
            assert_eq!(m["captured"], "0/0", "a capture holds nothing yet");
            assert_eq!(
                after,
                vec![each.as_str(); 6],
                "charged/held after each launch"
            );
            assert_eq!(m["trimmed"], "0/0");
        } else {
            let held: Vec<&str> = after.iter().map(|p| p.split('/').nth(1).unwrap()).collect();
            assert_eq!(held, vec![g.as_str(); 6], "the driver's pool");
            assert_eq!(m["trimmed"], "0/0");
        }
    }
}

/// A graph whose launch would take the process past its cap fails with
/// CUDA_ERROR_OUT_OF_MEMORY before anything runs.
#[test]
fn a_graph_launch_past_the_cap_fails_before_it_runs() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "1536M")],
        &[
            "ctx",
            "alloc",
            "alloc",
            "1G",
            "graph-mem",
            "1G",
            "1",
            "free",
        ],
    );
    let m = graph_mem(&o);
    assert_eq!(m["launches"], "2", "{}", stdout(&o));
    let g = (1u64 << 30).to_string();
    assert_eq!(
        m["after"],
        format!("{g}/{g}"),
        "nothing more charged or held"
    );
}

#[test]
fn destroying_a_context_returns_its_memory() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &[
            "ctx-create",
            "0",
            "fill",
            "alloc",
            "4M",
            "ctx-destroy",
            "ctx-create",
            "0",
            "fill",
            "alloc",
            "4M",
        ],
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
    assert_eq!(num(&line(&o, "ctx-destroy", 0), "rc"), 0);
    assert_eq!(num(&line(&o, "fill", 1), "count"), 16);
}

#[test]
fn accepted_spellings() {
    let cases: &[(&str, &str, u64)] = &[
        ("64M", "16G", 16),
        ("64MiB", "16G", 16),
        ("64MB", "16G", 16),
        ("64m", "16G", 16),
        ("67108864", "16G", 16),
        ("0.0625G", "16G", 16),
        ("0.0625GiB", "16G", 16),
        ("65536K", "16G", 16),
        ("25%", "256M", 16),
        ("12.5%", "512M", 16),
        ("", "256M", 64),
        ("0", "256M", 64),
    ];
    for (value, devices, expect) in cases {
        let o = probe(
            devices,
            &[("GPU_MEM_LIMIT", value)],
            &["ctx", "fill", "alloc", "4M"],
        );
        assert_eq!(
            num(&line(&o, "fill", 0), "count"),
            *expect,
            "GPU_MEM_LIMIT={value:?}"
        );
        // Nothing about the value; the one refusal that ended a capped
        // fill is said (an uncapped fill ends at the driver, unsaid).
        let want = if !matches!(*value, "" | "0") {
            "gpufrac: device 0: refused 4 MiB: cap 64 MiB reached (64 MiB in use)\n"
        } else {
            ""
        };
        assert_eq!(stderr(&o), want, "GPU_MEM_LIMIT={value:?}");
    }
}

#[test]
fn malformed_values_fail_closed_with_a_clear_message() {
    let cases: &[(&str, &str)] = &[
        ("GPU_MEM_LIMIT", "4X"),
        ("GPU_MEM_LIMIT", "-1G"),
        ("GPU_MEM_LIMIT", "abc"),
        ("GPU_MEM_LIMIT", "1.2.3G"),
        ("GPU_MEM_LIMIT", "150%"),
        // Beyond any GPU: a slip of the unit, never taken as "no cap".
        ("GPU_MEM_LIMIT", "99999T"),
        ("GPU_MEM_LIMIT_1", "lots"),
        ("GPU_MEM_LIMIT_X", "4G"),
        ("GPU_COMPUTE_SHARE", "200%"),
        ("GPUFRAC_BROKER", "sometimes"),
        ("GPUFRAC_LOG", "loud"),
    ];
    for (var, value) in cases {
        let o = probe("16G", &[(var, value)], &["ctx", "alloc", "alloc", "4M"]);
        assert_eq!(
            num(&line(&o, "init", 0), "rc"),
            1,
            "{var}={value}: cuInit must return CUDA_ERROR_INVALID_VALUE"
        );
        assert!(!o.status.success());
        let err = stderr(&o);
        assert!(err.starts_with("gpufrac: "), "{err}");
        assert!(
            err.contains(var) && err.contains(value),
            "message names {var} and {value:?}: {err}"
        );
        assert!(
            err.contains("expected") || err.contains("valid"),
            "message gives a good example: {err}"
        );
    }
}

#[test]
fn hooks_keep_the_callers_version_and_stream_semantics() {
    // CUDA 13 callers get cuCtxCreate_v4 (context-params signature), 12.x
    // callers _v2; both must land on device 1 as asked.
    for (ver, variant) in [("13000", "cuCtxCreate_v4"), ("12080", "cuCtxCreate_v2")] {
        for lookup in ["cudart", "dlsym"] {
            let o = probe(
                "16G,16G",
                &[("GPU_MEM_LIMIT", CAP)],
                &["--lookup", lookup, "--cuda-version", ver, "ctx-create", "1"],
            );
            let l = line(&o, "ctx-create", 0);
            assert_eq!(num(&l, "rc"), 0);
            assert_eq!(num(&l, "device"), 1, "{lookup} {ver}");
            assert_eq!(l["variant"], variant, "{lookup} {ver}");
        }
    }
    // Per-thread default stream callers reach the _ptsz entry points.
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &[
            "--ptsz", "ctx", "alloc", "async", "1M", "launch", "3", "1000",
        ],
    );
    assert_eq!(line(&o, "alloc", 0)["variant"], "cuMemAllocAsync_ptsz");
    assert_eq!(line(&o, "launch", 0)["variant"], "cuLaunchKernel_ptsz");
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &["ctx", "alloc", "async", "1M", "launch", "3", "1000"],
    );
    assert_eq!(line(&o, "alloc", 0)["variant"], "cuMemAllocAsync");
    assert_eq!(line(&o, "launch", 0)["variant"], "cuLaunchKernel");
}

#[test]
fn unhooked_symbols_come_back_untouched() {
    for lookup in ["cudart", "dlsym"] {
        let o = probe(
            "16G",
            &[],
            &[
                "--lookup",
                lookup,
                "origin",
                "cuModuleLoadData",
                "cuModuleLoadData",
                "origin",
                "cuMemAlloc",
                "cuMemAlloc_v2",
            ],
        );
        let unhooked = line(&o, "origin", 0);
        assert_eq!(unhooked["via_lookup"], "libcuda.so.1", "{lookup}");
        assert_eq!(unhooked["via_dlsym"], "libcuda.so.1");
        let hooked = line(&o, "origin", 1);
        assert_eq!(hooked["via_lookup"], "libgpufrac.so", "{lookup}");
        assert_eq!(hooked["via_dlsym"], "libgpufrac.so");
    }
    // Exact names only: no prefix matching.
    let o = probe(
        "16G",
        &[],
        &["lookup", "cudnnCreate", "lookup", "cuMemAlloc_v2x"],
    );
    assert_eq!(num(&line(&o, "lookup", 0), "found"), 0);
    assert_eq!(num(&line(&o, "lookup", 1), "found"), 0);
}

#[test]
fn unknown_frees_pass_through() {
    let plain = sim_command(&artifacts().probe, "16G", false)
        .args(["ctx", "free-unknown"])
        .output()
        .unwrap();
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &["ctx", "free-unknown", "fill", "alloc", "4M"],
    );
    assert_eq!(
        line(&o, "free-unknown", 0)["rc"],
        line(&plain, "free-unknown", 0)["rc"]
    );
    assert_eq!(num(&line(&o, "fill", 0), "count"), 16);
}

#[test]
fn programs_that_never_touch_cuda_are_untouched() {
    let a = artifacts();
    // Even a malformed cap says nothing until CUDA is used.
    let run = |prog: &str, args: &[&str], shim: bool| {
        let mut cmd = sim_command(prog, "16G", shim);
        cmd.env("GPU_MEM_LIMIT", "bogus").args(args);
        cmd.output().unwrap()
    };
    for (prog, args) in [
        ("sh", &["-c", "echo hi; ls / >/dev/null"][..]),
        ("ls", &["/"][..]),
        (
            "python3",
            &[
                "-c",
                "import os, ctypes, json; print(len(os.listdir('/proc/self/task')), 'libcuda' in open('/proc/self/maps').read())",
            ][..],
        ),
    ] {
        let with = run(prog, args, true);
        let without = run(prog, args, false);
        assert!(
            with.status.success(),
            "{prog} failed under the shim: {}",
            stderr(&with)
        );
        assert_eq!(stdout(&with), stdout(&without), "{prog}");
        assert_eq!(stderr(&with), "", "{prog} printed on stderr under the shim");
    }
    // The python line above proves one thread and no libcuda mapping.
    let o = run(
        "python3",
        &[
            "-c",
            "import os; print(len(os.listdir('/proc/self/task')), 'libcuda' in open('/proc/self/maps').read())",
        ],
        true,
    );
    assert_eq!(stdout(&o).trim(), "1 False");
    let _ = a;
}

#[test]
fn another_preloaded_library_using_rtld_next_still_works() {
    let a = artifacts();
    let hello = a.fixtures.join("hello");
    let other = a.fixtures.join("librtldnext.so");
    assert!(
        hello.exists() && other.exists(),
        "fixtures missing: build.rs needs a C compiler"
    );
    let o = sim_command(&hello, "16G", false)
        .env(
            "LD_PRELOAD",
            format!("{} {}", a.shim.display(), other.display()),
        )
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        stderr(&o)
    );
    assert_eq!(stdout(&o), "[other] hello\n");
}

#[test]
fn cudarc_programs_are_capped() {
    let a = artifacts();
    let ex = a.dir.join("examples/cudarc_alloc");
    for mode in [&[][..], &["--safe"][..]] {
        let o = sim_command(&ex, "16G", true)
            .env("GPU_MEM_LIMIT", CAP)
            .args(["--block", "4"])
            .args(mode)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
        let l = line(&o, "cudarc", 0);
        assert_eq!(num(&l, "count"), 16, "{mode:?}: {}", stdout(&o));
        let info = line(&o, "cudarc", 1);
        assert_eq!(num(&info, "total"), CAP_BYTES);
        assert_eq!(line(&o, "cudarc", 2)["ok"], "true");
    }
}

#[test]
fn cudart_entry_points_are_swapped_even_from_a_local_cudart() {
    let a = artifacts();
    let lib = a.fixtures.join("libfakecudart.so");
    let lib = lib.to_str().unwrap();
    // The pointer comes back as our hook, and allocating through it is capped.
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", "32M")],
        &["ctx", "cudart-entry", lib, "cuMemAlloc"],
    );
    let l = line(&o, "cudart-entry", 0);
    assert_eq!(num(&l, "rc"), 0, "{}", stderr(&o));
    assert_eq!(l["origin"], "libgpufrac.so");
    assert_eq!(num(&l, "alloc48M_rc"), 2, "48 MiB past a 32 MiB cap");
    // Without the shim the same program gets the driver's own pointer.
    let o = sim_command(&a.probe, "16G", false)
        .args(["ctx", "cudart-entry", lib, "cuMemAlloc"])
        .output()
        .unwrap();
    let l = line(&o, "cudart-entry", 0);
    assert_eq!(l["origin"], "libcuda.so.1");
    assert_eq!(num(&l, "alloc48M_rc"), 0);
}

#[test]
fn the_c_header_and_query_api() {
    let app = artifacts().fixtures.join("api_app");
    let o = sim_command(&app, "16G", true)
        .env("GPU_MEM_LIMIT", "4G")
        .output()
        .unwrap();
    let l = line(&o, "api", 0);
    assert_eq!(num(&l, "present"), 1);
    assert_eq!(num(&l, "limit"), 4 * GIB);
    assert_eq!(l["version"], env!("CARGO_PKG_VERSION"));
    let o = sim_command(&app, "16G", false).output().unwrap();
    assert_eq!(num(&line(&o, "api", 0), "present"), 0);
}

#[test]
fn a_forked_child_starts_with_clean_books() {
    let o = probe(
        "16G",
        &[("GPU_MEM_LIMIT", CAP)],
        &["ctx", "alloc", "alloc", "8M", "fork-used"],
    );
    let l = line(&o, "fork-used", 0);
    assert_eq!(num(&l, "parent"), 8 * MIB);
    assert_eq!(
        num(&l, "child"),
        0,
        "CUDA state does not survive fork; neither do its charges"
    );
}

/// How many stderr lines report an internal error in `hook`.
fn internal_errors(o: &std::process::Output, hook: &str) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| l.contains(&format!("internal error in {hook} (")))
        .map(str::to_owned)
        .collect()
}

/// A panic in an entry point that hands out memory refuses the allocation
/// (it never reaches the driver uncapped), at the entry of the hook and
/// in the middle of a charge alike; the process keeps running, the other
/// entry points keep working, and stderr says why once. Debug builds of
/// the shim panic on purpose at the point `GPUFRAC_TEST_PANIC` names.
#[test]
fn a_panic_where_memory_is_handed_out_refuses_the_allocation() {
    // (where, what the books hold after the refusals)
    for (point, held) in [
        ("cuMemAlloc_v2", 0),
        // After the driver allocated and before the record: the driver
        // holds each block (its pointer is lost with the panic), and so
        // the books keep charging both.
        ("charge", 8 * MIB),
    ] {
        let o = probe(
            "16G",
            &[("GPU_MEM_LIMIT", CAP), ("GPUFRAC_TEST_PANIC", point)],
            &[
                "ctx",
                "alloc",
                "alloc",
                "4M",
                "alloc",
                "alloc",
                "4M",
                "alloc",
                "vmm",
                "4M",
                "info",
                "limit-api",
            ],
        );
        assert!(
            o.status.success(),
            "{point}: the process survives: {}",
            stderr(&o)
        );
        assert_eq!(
            num(&line(&o, "alloc", 0), "rc"),
            2,
            "{point}: CUDA_ERROR_OUT_OF_MEMORY, not the driver's allocation"
        );
        assert_eq!(num(&line(&o, "alloc", 1), "rc"), 2, "{point}");
        // Another way to allocate, through another hook: unaffected.
        assert_eq!(num(&line(&o, "alloc", 2), "rc"), 0, "{point}");
        let info = line(&o, "info", 0);
        assert_eq!(num(&info, "rc"), 0, "{point}: other hooks still work");
        assert_eq!(num(&info, "total"), CAP_BYTES, "{point}");
        assert_eq!(
            num(&info, "free"),
            CAP_BYTES - 4 * MIB - held,
            "{point}: the books hold the VMM block and what the driver kept"
        );
        assert_eq!(num(&line(&o, "limit-api", 0), "used"), 4 * MIB + held);
        let said = internal_errors(&o, "cuMemAlloc_v2");
        assert_eq!(said.len(), 1, "{point}: said once: {}", stderr(&o));
        assert!(
            said[0].contains("refused with CUDA_ERROR_OUT_OF_MEMORY")
                && said[0].contains("panic at"),
            "{point}: {}",
            said[0]
        );
    }
}

/// A panic in an entry point that hands out no memory is contained and the
/// application's call still reaches the driver.
#[test]
fn a_panic_elsewhere_is_contained_and_the_call_still_reaches_the_driver() {
    let o = probe(
        "16G",
        &[
            ("GPU_MEM_LIMIT", CAP),
            ("GPUFRAC_TEST_PANIC", "cuMemGetInfo_v2"),
        ],
        &[
            "ctx", "info", "info", "alloc", "alloc", "4M", "launch", "1", "0",
        ],
    );
    assert!(o.status.success(), "the process survives: {}", stderr(&o));
    for n in 0..2 {
        let info = line(&o, "info", n);
        assert_eq!(num(&info, "rc"), 0, "the driver answered");
        assert_eq!(
            num(&info, "total"),
            16 * GIB,
            "the driver's own figure, unchanged"
        );
        assert_eq!(num(&info, "devtotal"), CAP_BYTES, "other hooks unaffected");
    }
    assert_eq!(num(&line(&o, "alloc", 0), "rc"), 0);
    assert_eq!(num(&line(&o, "launch", 0), "rc"), 0);
    let said = internal_errors(&o, "cuMemGetInfo_v2");
    assert_eq!(said.len(), 1, "said once: {}", stderr(&o));
    assert!(
        said[0].contains("goes to the driver as the application made it"),
        "{}",
        said[0]
    );
}
