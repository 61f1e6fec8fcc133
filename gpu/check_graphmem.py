"""CUDA graph memory under the cap, on the real driver.

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=2G python3 gpu/check_graphmem.py

A cuMemAllocAsync of 1 GiB is captured into a graph, which is launched,
its allocation freed outside the graph, and relaunched, eight times (the
pattern of PyTorch CUDA graphs with the cudaMallocAsync backend). Without
the shim an H100 (driver 580) grew its graph pool by about a GiB per
relaunch. Under the shim every launch must either succeed within the cap or
fail with CUDA_ERROR_OUT_OF_MEMORY before it runs; the driver's own figure
for the graph pool (cuDeviceGetGraphMemAttribute, reserved bytes) must never
pass the cap, and the shim's charge (gpufrac_mem_used) must equal it after
each launch. The same sequence without the shim is run in a child for
comparison (its figures are reported, not judged).
"""

import ctypes
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import GiB, cap_bytes, check, clean_env, done, info  # noqa: E402

SIZE = 1 * GiB
LAUNCHES = 8
RESERVED_CURRENT = 2


def sequence():
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    stream = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(stream), 1) == 0
    assert cu.cuStreamBeginCapture_v2(stream, 0) == 0
    p = ctypes.c_ulonglong()
    assert cu.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(SIZE), stream) == 0
    graph = ctypes.c_void_p()
    assert cu.cuStreamEndCapture(stream, ctypes.byref(graph)) == 0
    exe = ctypes.c_void_p()
    assert cu.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)) == 0
    used_fn = None
    try:
        used_fn = ctypes.CDLL(None).gpufrac_mem_used
        used_fn.restype = ctypes.c_ulonglong
    except AttributeError:
        pass
    rows = []
    for _ in range(LAUNCHES):
        rc = cu.cuGraphLaunch(exe, stream)
        cu.cuStreamSynchronize(stream)
        reserved = ctypes.c_ulonglong()
        cu.cuDeviceGetGraphMemAttribute(dev, RESERVED_CURRENT, ctypes.byref(reserved))
        charged = used_fn(0) if used_fn else -1
        rows.append((rc, reserved.value, charged))
        if rc == 0:
            cu.cuMemFreeAsync(p, stream)
            cu.cuStreamSynchronize(stream)
    cu.cuDeviceGraphMemTrim(dev)
    reserved = ctypes.c_ulonglong()
    cu.cuDeviceGetGraphMemAttribute(dev, RESERVED_CURRENT, ctypes.byref(reserved))
    rows.append(("trim", reserved.value, used_fn(0) if used_fn else -1))
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        print(repr(sequence()))
        return
    cap = cap_bytes()
    rows = sequence()
    info("under the shim: (launch rc, driver's graph pool, shim's charge)", str(rows))
    launches = rows[:-1]
    check("every launch succeeds or fails with out-of-memory", all(r[0] in (0, 2) for r in launches), str(rows))
    check("the driver's graph pool never passes the cap", all(r[1] <= cap for r in rows), str(rows))
    check("the shim charges what the graph pool holds (no other allocations here)",
          all(r[2] >= r[1] for r in rows if r[2] >= 0), str(rows))
    check("trimming returns the charge", rows[-1][1] == 0 and rows[-1][2] == 0, str(rows[-1]))
    p = subprocess.run([sys.executable, __file__, "--plain"], env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    info("without the shim: (launch rc, driver's graph pool, -)", (p.stdout or p.stderr).strip()[-400:])
    done()


main()
