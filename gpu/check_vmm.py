"""VMM lifetimes on the real driver, with and without the shim.

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=2G python3 gpu/check_vmm.py

Under the shim (the process is started with it): the documented idiom,
cuMemCreate → cuMemMap → cuMemRelease at once, repeated with 512 MiB
handles, must stop at the cap (2 GiB: the fifth create fails with
CUDA_ERROR_OUT_OF_MEMORY), because the driver keeps mapped memory after the
release. Then, through ctypes on the real driver in a child started without
the shim, the lifetimes the simulated driver models are checked against the
hardware: memory (cuMemGetInfo) stays in use after the release while mapped,
with a retained reference, across a second (partial) mapping, and is
returned only when the last reference and the last mapping are gone.
"""

import ctypes
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import MiB, cap_bytes, check, clean_env, done, info  # noqa: E402

SIZE = 512 * MiB
OOM = 2


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def driver():
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    prop = Prop()
    prop.type = 1  # PINNED
    prop.location.type = 1  # DEVICE
    prop.location.id = 0
    gran = ctypes.c_size_t()
    cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0)
    return cu, prop


def create(cu, prop, size):
    h = ctypes.c_ulonglong()
    rc = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    return rc, h.value


def map_at(cu, h, size, offset, length):
    va = ctypes.c_ulonglong()
    assert cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                  ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)) == 0
    rc = cu.cuMemMap(ctypes.c_ulonglong(va.value), ctypes.c_size_t(length), ctypes.c_size_t(offset),
                     ctypes.c_ulonglong(h), ctypes.c_ulonglong(0))
    assert rc == 0, f"cuMemMap rc={rc}"
    acc = Access()
    acc.location.type = 1
    acc.location.id = 0
    acc.flags = 3
    cu.cuMemSetAccess(ctypes.c_ulonglong(va.value), ctypes.c_size_t(length), ctypes.byref(acc), ctypes.c_size_t(1))
    return va.value


def used(cu):
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    return total.value - free.value


def lifetimes():
    """Without the shim: prints the driver's figure after each stage."""
    cu, prop = driver()
    base = used(cu)
    stages = []
    rc, h = create(cu, prop, SIZE)
    assert rc == 0
    stages.append(used(cu) - base)
    a = map_at(cu, h, SIZE, 0, SIZE)
    b = map_at(cu, h, SIZE // 2, SIZE // 2, SIZE // 2)
    h2 = ctypes.c_ulonglong()
    assert cu.cuMemRetainAllocationHandle(ctypes.byref(h2), ctypes.c_void_p(a + 4096)) == 0
    assert cu.cuMemRelease(ctypes.c_ulonglong(h)) == 0
    stages.append(used(cu) - base)
    assert cu.cuMemRelease(ctypes.c_ulonglong(h2.value)) == 0
    stages.append(used(cu) - base)
    assert cu.cuMemUnmap(ctypes.c_ulonglong(a), ctypes.c_size_t(SIZE)) == 0
    stages.append(used(cu) - base)
    assert cu.cuMemUnmap(ctypes.c_ulonglong(b), ctypes.c_size_t(SIZE // 2)) == 0
    stages.append(used(cu) - base)
    print(",".join(str(s) for s in stages))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--lifetimes":
        lifetimes()
        return
    cap = cap_bytes()
    cu, prop = driver()
    made = 0
    last = 0
    for _ in range(2 * (cap // SIZE) + 2):
        rc, h = create(cu, prop, SIZE)
        last = rc
        if rc != 0:
            break
        map_at(cu, h, SIZE, 0, SIZE)
        cu.cuMemRelease(ctypes.c_ulonglong(h))
        made += 1
    want = cap // SIZE
    check("map then release at once: creates stop at the cap", made == want and last == OOM,
          f"{made} × 512 MiB made under a {cap >> 20} MiB cap (want {want}), last rc={last}")
    p = subprocess.run([sys.executable, __file__, "--lifetimes"], env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        check("driver lifetimes (no shim)", False, p.stderr[-400:])
    else:
        stages = [int(x) for x in p.stdout.strip().split(",")]
        info("driver lifetimes, bytes held after create / release one / release both / unmap A / unmap B",
             str(stages))
        # Held through every stage until the last mapping goes (allowing
        # the driver's own rounding), then returned.
        held = all(s >= SIZE for s in stages[:4])
        check("driver keeps VMM memory until the last reference and mapping are gone",
              held and stages[4] < SIZE // 2, str(stages))
    done()


main()
