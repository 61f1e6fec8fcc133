//! The simulated MIG API through its C ABI: models and their profiles,
//! placements, GPU and compute instances, MIG device handles and UUIDs, the
//! driver's refusals, and a process pointed at a MIG device with
//! `CUDA_VISIBLE_DEVICES=MIG-<uuid>` seeing that instance alone.

mod support;

use std::ffi::{CString, c_char, c_int, c_uint};
use std::ptr::null_mut;

use support::*;

fn handle(i: c_uint) -> nvmlDevice_t {
    let mut d = null_mut();
    unsafe { ok(nvmlDeviceGetHandleByIndex_v2(i, &mut d)) };
    d
}

fn mode(d: nvmlDevice_t) -> Result<(c_uint, c_uint), u32> {
    let (mut c, mut p) = (9, 9);
    match unsafe { nvmlDeviceGetMigMode(d, &mut c, &mut p) } {
        0 => Ok((c, p)),
        e => Err(e),
    }
}

/// (id, name, memory MiB, SMs, instances) of profile `index`.
fn profile(d: nvmlDevice_t, index: c_uint) -> (c_uint, String, u64, c_uint, c_uint) {
    let mut v = nvmlGpuInstanceProfileInfo_v2_t {
        version: GI_PROFILE_INFO_V2,
        id: 0,
        isP2pSupported: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        copyEngineCount: 0,
        decoderCount: 0,
        encoderCount: 0,
        jpegCount: 0,
        ofaCount: 0,
        memorySizeMB: 0,
        name: [0; 96],
    };
    unsafe { ok(nvmlDeviceGetGpuInstanceProfileInfoV(d, index, &mut v)) };
    let mut v1 = nvmlGpuInstanceProfileInfo_t::default();
    unsafe { ok(nvmlDeviceGetGpuInstanceProfileInfo(d, index, &mut v1)) };
    assert_eq!(
        (v1.id, v1.memorySizeMB, v1.sliceCount),
        (v.id, v.memorySizeMB, v.sliceCount)
    );
    (
        v.id,
        cstr_buf(&v.name),
        v.memorySizeMB,
        v.multiprocessorCount,
        v.instanceCount,
    )
}

fn placements(d: nvmlDevice_t, id: c_uint) -> Vec<(c_uint, c_uint)> {
    let mut n = 0;
    unsafe {
        ok(nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            d,
            id,
            null_mut(),
            &mut n,
        ))
    };
    let mut v = vec![nvmlGpuInstancePlacement_t::default(); n as usize];
    unsafe {
        ok(nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            d,
            id,
            v.as_mut_ptr(),
            &mut n,
        ))
    };
    v.iter().map(|p| (p.start, p.size)).collect()
}

fn create(
    d: nvmlDevice_t,
    id: c_uint,
    start: c_uint,
    size: c_uint,
) -> Result<nvmlGpuInstance_t, u32> {
    let mut gi = null_mut();
    let p = nvmlGpuInstancePlacement_t { start, size };
    match unsafe { nvmlDeviceCreateGpuInstanceWithPlacement(d, id, &p, &mut gi) } {
        0 => Ok(gi),
        e => Err(e),
    }
}

fn gi_info(gi: nvmlGpuInstance_t) -> nvmlGpuInstanceInfo_t {
    let mut i = nvmlGpuInstanceInfo_t {
        device: null_mut(),
        id: 0,
        profileId: 0,
        placement: Default::default(),
    };
    unsafe { ok(nvmlGpuInstanceGetInfo(gi, &mut i)) };
    i
}

fn create_ci(gi: nvmlGpuInstance_t, profile: c_uint) -> nvmlComputeInstance_t {
    let mut ci = null_mut();
    unsafe { ok(nvmlGpuInstanceCreateComputeInstance(gi, profile, &mut ci)) };
    ci
}

fn uuid_of(d: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; 96];
    unsafe { ok(nvmlDeviceGetUUID(d, buf.as_mut_ptr(), 96)) };
    cstr_buf(&buf)
}

#[test]
fn models_profiles_and_placements() {
    isolated(
        "models_profiles_and_placements",
        &[(
            "GPUFRAC_SIM_DEVICES",
            "A100-40GB:mig,A100-80GB,H100-80GB:mig,16G",
        )],
        || unsafe {
            ok(nvmlInit_v2());
            let mut n = 0;
            ok(nvmlDeviceGetCount_v2(&mut n));
            assert_eq!(n, 4);
            let (a40, a80, h100, plain) = (handle(0), handle(1), handle(2), handle(3));
            assert_eq!(mode(a40), Ok((1, 1)));
            assert_eq!(mode(a80), Ok((0, 0)));
            assert_eq!(mode(h100), Ok((1, 1)));
            assert_eq!(mode(plain), Err(NVML_ERROR_NOT_SUPPORTED));

            // nvidia-smi mig -lgip on an A100-SXM4-40GB, by NVML profile.
            let want = [
                (0, (19, "MIG 1g.5gb", 4864, 14, 7)),
                (7, (20, "MIG 1g.5gb+me", 4864, 14, 1)),
                (9, (15, "MIG 1g.10gb", 9856, 14, 4)),
                (1, (14, "MIG 2g.10gb", 9856, 28, 3)),
                (2, (9, "MIG 3g.20gb", 19968, 42, 2)),
                (3, (5, "MIG 4g.20gb", 19968, 56, 1)),
                (4, (0, "MIG 7g.40gb", 40192, 98, 1)),
            ];
            for (index, (id, name, mib, sms, count)) in want {
                assert_eq!(
                    profile(a40, index),
                    (id, name.to_owned(), mib, sms, count),
                    "profile {index}"
                );
            }
            assert_eq!(profile(a80, 0).1, "MIG 1g.10gb");
            assert_eq!(profile(a80, 9).1, "MIG 1g.20gb");
            assert_eq!(profile(a80, 4), (0, "MIG 7g.80gb".into(), 80896, 98, 1));
            assert_eq!(profile(h100, 0), (19, "MIG 1g.10gb".into(), 9984, 16, 7));
            assert_eq!(profile(h100, 2), (9, "MIG 3g.40gb".into(), 40448, 60, 2));
            let mut info = nvmlGpuInstanceProfileInfo_t::default();
            check(
                nvmlDeviceGetGpuInstanceProfileInfo(a40, 5, &mut info),
                NVML_ERROR_NOT_SUPPORTED,
            );
            check(
                nvmlDeviceGetGpuInstanceProfileInfo(a40, 17, &mut info),
                NVML_ERROR_INVALID_ARGUMENT,
            );
            check(
                nvmlDeviceGetGpuInstanceProfileInfo(plain, 0, &mut info),
                NVML_ERROR_NOT_SUPPORTED,
            );
            let mut v2 = std::mem::zeroed::<nvmlGpuInstanceProfileInfo_v2_t>();
            v2.version = 1;
            check(
                nvmlDeviceGetGpuInstanceProfileInfoV(a40, 0, &mut v2),
                NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
            );

            // nvidia-smi mig -lgipp: the same on A100 and H100.
            for d in [a40, a80, h100] {
                assert_eq!(
                    placements(d, 19),
                    (0..7).map(|s| (s, 1)).collect::<Vec<_>>()
                );
                assert_eq!(
                    placements(d, 20),
                    (0..7).map(|s| (s, 1)).collect::<Vec<_>>()
                );
                assert_eq!(placements(d, 15), vec![(0, 2), (2, 2), (4, 2), (6, 2)]);
                assert_eq!(placements(d, 14), vec![(0, 2), (2, 2), (4, 2)]);
                assert_eq!(placements(d, 9), vec![(0, 4), (4, 4)]);
                assert_eq!(placements(d, 5), vec![(0, 4)]);
                assert_eq!(placements(d, 0), vec![(0, 8)]);
            }
            let mut short = [nvmlGpuInstancePlacement_t::default(); 2];
            let mut cnt = 2;
            check(
                nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                    a40,
                    19,
                    short.as_mut_ptr(),
                    &mut cnt,
                ),
                NVML_ERROR_INSUFFICIENT_SIZE,
            );
            assert_eq!(cnt, 7);
            check(
                nvmlDeviceGetGpuInstancePossiblePlacements_v2(a40, 3, null_mut(), &mut cnt),
                NVML_ERROR_INVALID_ARGUMENT,
            );

            // The MIG-mode GPU is no CUDA device; the other two are, in
            // order, under their model names.
            ok(cuInit(0));
            let mut cn = 0;
            ok(cuDeviceGetCount(&mut cn));
            assert_eq!(cn, 2);
            let mut buf = [0 as c_char; 96];
            ok(cuDeviceGetName(buf.as_mut_ptr(), 96, 0));
            assert_eq!(cstr_buf(&buf), "gpufrac-sim A100-SXM4-80GB (GPU 1)");
            let mut total = 0;
            ok(cuDeviceTotalMem_v2(&mut total, 0));
            assert_eq!(total, 81920 * MIB);
            let mut sms = 0;
            ok(cuDeviceGetAttribute(&mut sms, 16, 0));
            assert_eq!(sms, 108);
            ok(cuDeviceTotalMem_v2(&mut total, 1));
            assert_eq!(total, 16 * GIB);
            let mut nbuf = [0 as c_char; 96];
            ok(nvmlDeviceGetName(a80, nbuf.as_mut_ptr(), 96));
            assert_eq!(cstr_buf(&nbuf), cstr_buf(&buf));
            // NVML's utilisation is not supported in MIG mode.
            let mut u = nvmlUtilization_t::default();
            check(
                nvmlDeviceGetUtilizationRates(a40, &mut u),
                NVML_ERROR_NOT_SUPPORTED,
            );
            ok(nvmlDeviceGetUtilizationRates(a80, &mut u));
        },
    );
}

#[test]
fn instances_are_created_placed_and_destroyed_as_the_driver_allows() {
    let state = scratch("mig-create");
    isolated(
        "instances_are_created_placed_and_destroyed_as_the_driver_allows",
        &[
            ("GPUFRAC_SIM_DEVICES", "A100-40GB:mig,A100-80GB,8G"),
            ("GPUFRAC_SIM_STATE", state.to_str().unwrap()),
        ],
        || unsafe {
            ok(nvmlInit_v2());
            let (d, off, plain) = (handle(0), handle(1), handle(2));
            let g1 = create(d, 19, 0, 1).unwrap();
            let i = gi_info(g1);
            assert_eq!(i.device, d);
            assert_eq!(
                (i.profileId, i.placement),
                (19, nvmlGpuInstancePlacement_t { start: 0, size: 1 })
            );
            // Overlapping, at a start the profile does not allow, of the
            // wrong size.
            assert_eq!(create(d, 14, 0, 2), Err(NVML_ERROR_INSUFFICIENT_RESOURCES));
            assert_eq!(create(d, 14, 1, 2), Err(NVML_ERROR_INVALID_ARGUMENT));
            assert_eq!(create(d, 14, 2, 4), Err(NVML_ERROR_INVALID_ARGUMENT));
            let g2 = create(d, 14, 2, 2).unwrap();
            let g3 = create(d, 9, 4, 4).unwrap();
            // Left: memory slice 1, room for one 1g.5gb and nothing else.
            let remaining = |id| {
                let mut n = 9;
                ok(nvmlDeviceGetGpuInstanceRemainingCapacity(d, id, &mut n));
                n
            };
            assert_eq!((remaining(19), remaining(15), remaining(0)), (1, 0, 0));
            assert_eq!(create(d, 0, 0, 8), Err(NVML_ERROR_INSUFFICIENT_RESOURCES));
            let mut gis = [null_mut(); 3];
            let mut n = 3;
            ok(nvmlDeviceGetGpuInstances(d, 14, gis.as_mut_ptr(), &mut n));
            assert_eq!((n, gis[0]), (1, g2));
            let mut by_id = null_mut();
            ok(nvmlDeviceGetGpuInstanceById(d, gi_info(g3).id, &mut by_id));
            assert_eq!(by_id, g3);

            // Compute instances: a 1-slice GPU instance offers one profile.
            let mut cinfo = nvmlComputeInstanceProfileInfo_t::default();
            ok(nvmlGpuInstanceGetComputeInstanceProfileInfo(
                g1, 0, 0, &mut cinfo,
            ));
            assert_eq!(
                (cinfo.id, cinfo.sliceCount, cinfo.multiprocessorCount),
                (0, 1, 14)
            );
            check(
                nvmlGpuInstanceGetComputeInstanceProfileInfo(g1, 1, 0, &mut cinfo),
                NVML_ERROR_NOT_SUPPORTED,
            );
            let mut cv2 = std::mem::zeroed::<nvmlComputeInstanceProfileInfo_v2_t>();
            cv2.version = CI_PROFILE_INFO_V2;
            ok(nvmlGpuInstanceGetComputeInstanceProfileInfoV(
                g3, 2, 0, &mut cv2,
            ));
            assert_eq!(
                (cstr_buf(&cv2.name), cv2.multiprocessorCount),
                ("MIG 3g.20gb".into(), 42)
            );
            ok(nvmlGpuInstanceGetComputeInstanceProfileInfoV(
                g3, 0, 0, &mut cv2,
            ));
            assert_eq!(
                (cstr_buf(&cv2.name), cv2.instanceCount),
                ("MIG 1c.3g.20gb".into(), 3)
            );
            let c1 = create_ci(g1, 0);
            let mut ci_info = std::mem::zeroed::<nvmlComputeInstanceInfo_t>();
            ok(nvmlComputeInstanceGetInfo_v2(c1, &mut ci_info));
            assert_eq!(
                (ci_info.gpuInstance, ci_info.id, ci_info.profileId),
                (g1, 0, 0)
            );
            let mut left = 9;
            ok(nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
                g1, 0, &mut left,
            ));
            assert_eq!(left, 0);
            let mut cis = [null_mut(); 2];
            let mut cn = 2;
            ok(nvmlGpuInstanceGetComputeInstances(
                g1,
                0,
                cis.as_mut_ptr(),
                &mut cn,
            ));
            assert_eq!((cn, cis[0]), (1, c1));

            // The compute instance is a MIG device with a UUID of its own.
            let mut max = 0;
            ok(nvmlDeviceGetMaxMigDeviceCount(d, &mut max));
            assert_eq!(max, 7);
            ok(nvmlDeviceGetMaxMigDeviceCount(plain, &mut max));
            assert_eq!(max, 0);
            let mut mig = null_mut();
            ok(nvmlDeviceGetMigDeviceHandleByIndex(d, 0, &mut mig));
            let mut other = null_mut();
            check(
                nvmlDeviceGetMigDeviceHandleByIndex(d, 1, &mut other),
                NVML_ERROR_NOT_FOUND,
            );
            let mut is = 9;
            ok(nvmlDeviceIsMigDeviceHandle(mig, &mut is));
            assert_eq!(is, 1);
            ok(nvmlDeviceIsMigDeviceHandle(d, &mut is));
            assert_eq!(is, 0);
            let uuid = uuid_of(mig);
            assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
            assert_ne!(uuid[4..], uuid_of(d)[4..]);
            let mut again = null_mut();
            let c = CString::new(uuid.clone()).unwrap();
            ok(nvmlDeviceGetHandleByUUID(c.as_ptr(), &mut again));
            assert_eq!(again, mig);
            let mut parent = null_mut();
            ok(nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
                mig,
                &mut parent,
            ));
            assert_eq!(parent, d);
            let (mut gid, mut cid) = (0, 9);
            ok(nvmlDeviceGetGpuInstanceId(mig, &mut gid));
            ok(nvmlDeviceGetComputeInstanceId(mig, &mut cid));
            assert_eq!((gid, cid), (gi_info(g1).id, 0));
            check(
                nvmlDeviceGetGpuInstanceId(d, &mut gid),
                NVML_ERROR_NOT_SUPPORTED,
            );
            let mut m = nvmlMemory_t::default();
            ok(nvmlDeviceGetMemoryInfo(mig, &mut m));
            assert_eq!((m.total, m.used), (4864 << 20, 0));
            let mut buf = [0 as c_char; 96];
            ok(nvmlDeviceGetName(mig, buf.as_mut_ptr(), 96));
            assert_eq!(cstr_buf(&buf), "gpufrac-sim A100-SXM4-40GB MIG 1g.5gb");

            // A GPU instance goes only after its compute instances.
            check(nvmlGpuInstanceDestroy(g1), NVML_ERROR_IN_USE);
            ok(nvmlComputeInstanceDestroy(c1));
            check(nvmlComputeInstanceDestroy(c1), NVML_ERROR_INVALID_ARGUMENT);
            ok(nvmlGpuInstanceDestroy(g1));
            check(nvmlGpuInstanceDestroy(g1), NVML_ERROR_INVALID_ARGUMENT);
            check(
                nvmlDeviceGetUUID(mig, buf.as_mut_ptr(), 96),
                NVML_ERROR_INVALID_ARGUMENT,
            );
            check(
                nvmlDeviceGetHandleByUUID(c.as_ptr(), &mut again),
                NVML_ERROR_NOT_FOUND,
            );

            // One media-extension instance at a time.
            create(d, 20, 0, 1).unwrap();
            assert_eq!(create(d, 20, 1, 1), Err(NVML_ERROR_INSUFFICIENT_RESOURCES));
            let mut any = null_mut();
            ok(nvmlDeviceCreateGpuInstance(d, 19, &mut any));
            assert_eq!(gi_info(any).placement.start, 1);
            // MIG mode off, or no MIG at all.
            let mut gi = null_mut();
            check(
                nvmlDeviceCreateGpuInstance(off, 19, &mut gi),
                NVML_ERROR_NOT_SUPPORTED,
            );
            check(
                nvmlDeviceCreateGpuInstance(plain, 19, &mut gi),
                NVML_ERROR_NOT_SUPPORTED,
            );
            for g in [g2, g3, any] {
                ok(nvmlGpuInstanceDestroy(g));
            }
        },
    );
    let _ = std::fs::remove_file(&state);
}

/// A process pointed at a MIG device: one CUDA device with the instance's
/// memory, its UUID, and an out-of-memory error at the instance's edge.
/// Prints the MIG UUID and waits for a line before it exits.
#[test]
fn mig_process_helper() {
    if std::env::var(CHILD_VAR).as_deref() != Ok("mig_process_helper") {
        return;
    }
    unsafe {
        ok(cuInit(0));
        let mut n = 0;
        ok(cuDeviceGetCount(&mut n));
        assert_eq!(n, 1);
        let mut total = 0;
        ok(cuDeviceTotalMem_v2(&mut total, 0));
        let (mut v2, mut v1) = (CUuuid::default(), CUuuid::default());
        ok(cuDeviceGetUuid_v2(&mut v2, 0));
        ok(cuDeviceGetUuid(&mut v1, 0));
        let mut f = [0u8; 40];
        let len = format_uuid(&v2, &mut f);
        let mig = format!("MIG-{}", std::str::from_utf8(&f[4..len]).unwrap());
        let len = format_uuid(&v1, &mut f);
        let parent = std::str::from_utf8(&f[..len]).unwrap().to_owned();
        let mut buf = [0 as c_char; 96];
        ok(cuDeviceGetName(buf.as_mut_ptr(), 96, 0));
        let mut sms: c_int = 0;
        ok(cuDeviceGetAttribute(&mut sms, 16, 0));
        init_ctx(0);
        let mut p = 0;
        ok(cuMemAlloc_v2(&mut p, 4 * GIB));
        let mut q = 0;
        check(cuMemAlloc_v2(&mut q, GIB), CUDA_ERROR_OUT_OF_MEMORY);
        let (mut free, mut t) = (0, 0);
        ok(cuMemGetInfo_v2(&mut free, &mut t));
        println!(
            "SEEN total={total} free={free} sms={sms} mig={mig} parent={parent} name={}",
            cstr_buf(&buf).replace(' ', "_")
        );
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
    }
}

#[test]
fn a_process_on_a_mig_device_sees_its_instance_alone() {
    let state = scratch("mig-process");
    let st = state.to_str().unwrap().to_owned();
    isolated(
        "a_process_on_a_mig_device_sees_its_instance_alone",
        &[
            ("GPUFRAC_SIM_DEVICES", "16G,A100-40GB:mig"),
            ("GPUFRAC_SIM_STATE", &st),
        ],
        || unsafe {
            // This closure runs in a child of the test: the state file is
            // the one its environment names.
            let st = std::env::var("GPUFRAC_SIM_STATE").unwrap();
            ok(nvmlInit_v2());
            let d = handle(1);
            let gi = create(d, 19, 3, 1).unwrap();
            let ci = create_ci(gi, 0);
            let mut mig = null_mut();
            ok(nvmlDeviceGetMigDeviceHandleByIndex(d, 0, &mut mig));
            let uuid = uuid_of(mig);
            let gpu_uuid = uuid_of(d);

            let mut h = Helper::spawn(
                "mig_process_helper",
                &[
                    ("GPUFRAC_SIM_DEVICES", "16G,A100-40GB:mig".into()),
                    ("GPUFRAC_SIM_STATE", st.clone()),
                    ("CUDA_VISIBLE_DEVICES", format!("{uuid},0")),
                ],
            );
            let seen = h.expect("SEEN");
            let kv: std::collections::HashMap<&str, &str> = seen
                .split_whitespace()
                .filter_map(|s| s.split_once('='))
                .collect();
            assert_eq!(kv["total"], (4864u64 << 20).to_string(), "{seen}");
            assert_eq!(
                kv["free"],
                ((4864u64 << 20) - (4 << 30)).to_string(),
                "{seen}"
            );
            assert_eq!(kv["sms"], "14", "{seen}");
            assert_eq!(kv["mig"], uuid, "the MIG UUID through CUDA: {seen}");
            assert_eq!(
                kv["parent"], gpu_uuid,
                "cuDeviceGetUuid gives the GPU's: {seen}"
            );
            assert_eq!(kv["name"], "gpufrac-sim_A100-SXM4-40GB_MIG_1g.5gb");

            // The driver sees the process and its memory on the instance.
            let mut m = nvmlMemory_t::default();
            ok(nvmlDeviceGetMemoryInfo(mig, &mut m));
            assert_eq!(m.used, 4 << 30);
            ok(nvmlDeviceGetMemoryInfo(d, &mut m));
            assert_eq!(m.used, 4 << 30, "the GPU counts its instances' memory");
            let mut procs = [nvmlProcessInfo_t::default(); 2];
            let mut n = 2;
            ok(nvmlDeviceGetComputeRunningProcesses_v3(
                d,
                &mut n,
                procs.as_mut_ptr(),
            ));
            assert_eq!(n, 1);
            assert_eq!(
                (
                    procs[0].pid,
                    procs[0].gpuInstanceId,
                    procs[0].computeInstanceId
                ),
                (h.child.id(), gi_info(gi).id, 0)
            );
            // Nobody destroys an instance a process runs on.
            check(nvmlComputeInstanceDestroy(ci), NVML_ERROR_IN_USE);
            h.send("done");
            assert!(h.wait().success());
            ok(nvmlComputeInstanceDestroy(ci));
            ok(nvmlGpuInstanceDestroy(gi));
            ok(nvmlDeviceGetMemoryInfo(d, &mut m));
            assert_eq!(m.used, 0, "the process's memory went with it");

            // A UUID that names no instance: no devices, as with the driver.
            let mut h = Helper::spawn(
                "mig_gone_helper",
                &[
                    ("GPUFRAC_SIM_DEVICES", "16G,A100-40GB:mig".into()),
                    ("GPUFRAC_SIM_STATE", st.clone()),
                    ("CUDA_VISIBLE_DEVICES", uuid.clone()),
                ],
            );
            assert_eq!(h.expect("INIT"), CUDA_ERROR_NO_DEVICE.to_string());
            assert!(h.wait().success());
        },
    );
    let _ = std::fs::remove_file(&state);
}

#[test]
fn mig_gone_helper() {
    if std::env::var(CHILD_VAR).as_deref() != Ok("mig_gone_helper") {
        return;
    }
    println!("INIT {}", unsafe { cuInit(0) });
}

#[test]
fn bad_mig_settings_fail_init() {
    isolated(
        "bad_mig_settings_fail_init",
        &[("GPUFRAC_SIM_DEVICES", "16G:mig")],
        || unsafe {
            check(cuInit(0), CUDA_ERROR_UNKNOWN);
            check(nvmlInit_v2(), NVML_ERROR_UNKNOWN);
        },
    );
}
