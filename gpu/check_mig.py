"""MIG on this machine's GPUs, read only: what `gpufrac broker --mig dynamic`
would find. Run it natively (no shim needed):

    python3 gpu/check_mig.py

For every GPU: its MIG mode (current and pending), and for a MIG-capable one
its GPU-instance profiles (NVML id, name, compute slices, instances, SMs,
memory) and their possible placements; in MIG mode also the GPU and compute
instances that exist and the MIG devices' UUIDs. The same from `nvidia-smi
mig -lgip` / `-lgipp` / `-lgi` when nvidia-smi can list them. For the models
the simulated driver reproduces (A100-40GB, A100-80GB, H100-80GB) it checks
that the simulator's tables (sim/src/mig.rs) match what this GPU reports, so
the tests' MIG GPUs can be held against a real one.

It never changes anything: no MIG mode is set, no instance is created or
destroyed (the NVML functions it calls only read; nvidia-smi is only asked
to list). MIG mode needs root and a GPU reset to change; that stays the
administrator's business.
"""

import ctypes
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import check, done, guarded, info, run, skip  # noqa: E402

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
GI_PROFILE_COUNT = 17  # NVML_GPU_INSTANCE_PROFILE_COUNT in current headers

# What the simulated driver models (sim/src/mig.rs), by NVML profile id:
# (name, compute slices, memory MiB, instances, placement size, starts).
SHAPE = {19: (1, 7, 1, (0, 1, 2, 3, 4, 5, 6)), 20: (1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
         15: (1, 4, 2, (0, 2, 4, 6)), 14: (2, 3, 2, (0, 2, 4)), 9: (3, 2, 4, (0, 4)),
         5: (4, 1, 4, (0,)), 0: (7, 1, 8, (0,))}
SIM = {
    "A100-40GB": {19: ("1g.5gb", 4864), 20: ("1g.5gb+me", 4864), 15: ("1g.10gb", 9856),
                  14: ("2g.10gb", 9856), 9: ("3g.20gb", 19968), 5: ("4g.20gb", 19968), 0: ("7g.40gb", 40192)},
    "A100-80GB": {19: ("1g.10gb", 9728), 20: ("1g.10gb+me", 9728), 15: ("1g.20gb", 19968),
                  14: ("2g.20gb", 19968), 9: ("3g.40gb", 40192), 5: ("4g.40gb", 40192), 0: ("7g.80gb", 80896)},
    "H100-80GB": {19: ("1g.10gb", 9984), 20: ("1g.10gb+me", 9984), 15: ("1g.20gb", 20096),
                  14: ("2g.20gb", 20096), 9: ("3g.40gb", 40448), 5: ("4g.40gb", 40448), 0: ("7g.80gb", 81152)},
}


def sim_model(name):
    """The simulated model a GPU name corresponds to, if any."""
    n = name.upper()
    if "A100" in n and "40GB" in n:
        return "A100-40GB"
    if "A100" in n and "80GB" in n:
        return "A100-80GB"
    if "H100" in n and ("80GB" in n or "HBM3" in n) and "NVL" not in n:
        return "H100-80GB"
    return None


class ProfileInfo(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_t
    _fields_ = [(f, ctypes.c_uint) for f in (
        "id", "isP2pSupported", "sliceCount", "instanceCount", "multiprocessorCount",
        "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount")] + [
        ("memorySizeMB", ctypes.c_ulonglong)]


class ProfileInfoV2(ctypes.Structure):  # nvmlGpuInstanceProfileInfo_v2_t
    _fields_ = [(f, ctypes.c_uint) for f in (
        "version", "id", "isP2pSupported", "sliceCount", "instanceCount", "multiprocessorCount",
        "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount")] + [
        ("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96)]


class Placement(ctypes.Structure):  # nvmlGpuInstancePlacement_t
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class GiInfo(ctypes.Structure):  # nvmlGpuInstanceInfo_t
    _fields_ = [("device", ctypes.c_void_p), ("id", ctypes.c_uint), ("profileId", ctypes.c_uint),
                ("placement", Placement)]


def profiles(lib, dev, idx):
    """(id, name, slices, instances, SMs, MiB, placements) per profile."""
    out = []
    has_v = hasattr(lib, "nvmlDeviceGetGpuInstanceProfileInfoV")
    for p in range(GI_PROFILE_COUNT):
        v1 = ProfileInfo()
        rc = lib.nvmlDeviceGetGpuInstanceProfileInfo(dev, p, ctypes.byref(v1))
        if rc != NVML_SUCCESS:
            continue
        name = f"{v1.sliceCount}g.? (profile {p})"
        if has_v:
            v2 = ProfileInfoV2()
            v2.version = ctypes.sizeof(ProfileInfoV2) | (2 << 24)
            if lib.nvmlDeviceGetGpuInstanceProfileInfoV(dev, p, ctypes.byref(v2)) == NVML_SUCCESS:
                name = v2.name.decode(errors="replace").removeprefix("MIG ")
        n = ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, v1.id, None, ctypes.byref(n))
        places = []
        if rc == NVML_SUCCESS and n.value:
            arr = (Placement * n.value)()
            if lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, v1.id, arr, ctypes.byref(n)) == NVML_SUCCESS:
                places = [(arr[i].start, arr[i].size) for i in range(n.value)]
        else:
            info(f"mig[gpu {idx}]: placements of {name}", f"rc={rc}")
        out.append((v1.id, name, v1.sliceCount, v1.instanceCount, v1.multiprocessorCount,
                    v1.memorySizeMB, places))
    return out


def instances(lib, dev, idx, profs):
    """Existing GPU instances and MIG devices (reads only)."""
    for (pid, name, _s, count, _sm, _mib, _pl) in profs:
        arr = (ctypes.c_void_p * max(count, 1))()
        n = ctypes.c_uint(len(arr))
        rc = lib.nvmlDeviceGetGpuInstances(dev, pid, arr, ctypes.byref(n))
        if rc != NVML_SUCCESS:
            info(f"mig[gpu {idx}]: GPU instances of {name}", f"rc={rc}")
            continue
        for i in range(n.value):
            gi = GiInfo()
            if lib.nvmlGpuInstanceGetInfo(ctypes.c_void_p(arr[i]), ctypes.byref(gi)) == NVML_SUCCESS:
                info(f"mig[gpu {idx}]: GPU instance {gi.id}",
                     f"{name} placement {gi.placement.start}:{gi.placement.size}")
    mx = ctypes.c_uint(0)
    if lib.nvmlDeviceGetMaxMigDeviceCount(dev, ctypes.byref(mx)) != NVML_SUCCESS:
        return
    seen = 0
    for i in range(mx.value):
        mig = ctypes.c_void_p()
        if lib.nvmlDeviceGetMigDeviceHandleByIndex(dev, i, ctypes.byref(mig)) != NVML_SUCCESS:
            continue
        buf = ctypes.create_string_buffer(96)
        gid, cid = ctypes.c_uint(0), ctypes.c_uint(0)
        lib.nvmlDeviceGetUUID(mig, buf, 96)
        lib.nvmlDeviceGetGpuInstanceId(mig, ctypes.byref(gid))
        lib.nvmlDeviceGetComputeInstanceId(mig, ctypes.byref(cid))
        info(f"mig[gpu {idx}]: MIG device {i}", f"GPU instance {gid.value} compute instance {cid.value} "
             f"{buf.value.decode(errors='replace')}")
        seen += 1
    info(f"mig[gpu {idx}]: MIG devices", f"{seen} (at most {mx.value})")


def compare(idx, model, profs):
    """The simulator's tables against this GPU's own."""
    want = SIM[model]
    got = {p[0]: p for p in profs}
    bad = []
    for pid, (name, mib) in want.items():
        slices, count, size, starts = SHAPE[pid]
        g = got.get(pid)
        if g is None:
            bad.append(f"{name} (id {pid}) missing")
            continue
        _, gname, gslices, gcount, _sm, gmib, gplaces = g
        if (gname, gslices, gcount, gmib) != (name, slices, count, mib):
            bad.append(f"id {pid}: GPU says {gname} {gslices} slices x{gcount} {gmib} MiB, "
                       f"sim says {name} {slices} slices x{count} {mib} MiB")
        if gplaces and gplaces != [(s, size) for s in starts]:
            bad.append(f"{name}: GPU placements {gplaces}, sim {[(s, size) for s in starts]}")
    extra = sorted(set(got) - set(want))
    check(f"mig[gpu {idx}]: the simulator's {model} tables match this GPU", not bad,
          "; ".join(bad) or f"7 profiles agree (ids, names, slices, counts, MiB, placements)"
          + (f"; GPU has further profiles {extra}" if extra else ""))


def via_nvml():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        skip("mig[nvml]", f"cannot load libnvidia-ml.so.1: {e}")
        return
    rc = (getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit)()
    if rc != NVML_SUCCESS:
        check("mig[nvml]: nvmlInit", False, f"rc={rc}")
        return
    if not hasattr(lib, "nvmlDeviceGetMigMode"):
        skip("mig[nvml]", "this driver's NVML has no MIG API (MIG needs R450 or later)")
        return
    n = ctypes.c_uint(0)
    lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
    for idx in range(n.value):
        dev = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(idx, ctypes.byref(dev)) != NVML_SUCCESS:
            continue
        nb = ctypes.create_string_buffer(96)
        lib.nvmlDeviceGetName(dev, nb, 96)
        name = nb.value.decode(errors="replace")
        cur, pend = ctypes.c_uint(0), ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetMigMode(dev, ctypes.byref(cur), ctypes.byref(pend))
        if rc == NVML_ERROR_NOT_SUPPORTED:
            info(f"mig[gpu {idx}]: {name}", "not MIG-capable")
            continue
        if rc != NVML_SUCCESS:
            check(f"mig[gpu {idx}]: nvmlDeviceGetMigMode", False, f"rc={rc}")
            continue
        mode = {0: "disabled", 1: "enabled"}
        info(f"mig[gpu {idx}]: {name}",
             f"MIG mode {mode.get(cur.value, cur.value)} (pending {mode.get(pend.value, pend.value)})"
             + ("; gpufrac broker --mig dynamic would manage it" if cur.value == 1 else
                "; gpufrac leaves it to time-slicing (an administrator enables MIG with nvidia-smi -i N -mig 1)"))
        profs = profiles(lib, dev, idx)
        if not profs:
            info(f"mig[gpu {idx}]: profiles", "none listed (NVML may list them only in MIG mode)")
        for (pid, pname, slices, count, sms, mib, places) in profs:
            info(f"mig[gpu {idx}]: profile {pname}",
                 f"id {pid}, {slices} compute slices, {count} instances, {sms} SMs, {mib} MiB, "
                 f"placements {{{','.join(str(s) for s, _ in places)}}}:{places[0][1] if places else '?'}")
        model = sim_model(name)
        if profs and model:
            compare(idx, model, profs)
        elif profs:
            info(f"mig[gpu {idx}]: simulator", f"{name} is not a model the simulator reproduces")
        if cur.value == 1:
            instances(lib, dev, idx, profs)
    lib.nvmlShutdown()


def via_nvidia_smi():
    if not shutil.which("nvidia-smi"):
        skip("mig[nvidia-smi]", "nvidia-smi not on PATH")
        return
    # Listing only: -lgip/-lgipp/-lgi never create or destroy anything.
    for args in (["-L"], ["mig", "-lgip"], ["mig", "-lgipp"], ["mig", "-lgi"]):
        _rc, out, err = run(["nvidia-smi", *args], timeout=30)
        text = (out or "") + (err or "")
        for line in text.strip().splitlines():
            info(f"mig[nvidia-smi {' '.join(args)}]", line)


guarded("mig[nvml]", via_nvml)
guarded("mig[nvidia-smi]", via_nvidia_smi)
done()
