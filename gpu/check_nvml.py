"""NVML inside a capped process. Run it under the shim:

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=4G python3 gpu/check_nvml.py

nvmlDeviceGetMemoryInfo (v1) and nvmlDeviceGetMemoryInfo_v2 through ctypes on
libnvidia-ml.so.1 (always), the same through pynvml (when importable), and
`nvidia-smi --query-gpu=memory.total` started from this process (so it
inherits LD_PRELOAD and the cap) must all report the cap. The same query
without the shim is reported for comparison.
"""

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import MiB, cap_bytes, check, clean_env, done, first_line, gib, guarded, info, run, skip, tail  # noqa: E402

cap = cap_bytes()


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def via_ctypes():
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
    rc = init()
    if rc != 0:
        check("nvml[ctypes]: nvmlInit", False, f"rc={rc}")
        return
    dev = ctypes.c_void_p()
    rc = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
    if rc != 0:
        check("nvml[ctypes]: nvmlDeviceGetHandleByIndex_v2(0)", False, f"rc={rc}")
        return
    m = Memory()
    rc = lib.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(m))
    check("nvml[ctypes]: nvmlDeviceGetMemoryInfo total == cap", rc == 0 and m.total == cap,
          f"rc={rc} total={m.total} ({gib(m.total)}) free={m.free} used={m.used}")
    check("nvml[ctypes]: nvmlDeviceGetMemoryInfo free + used <= total", rc == 0 and m.free + m.used <= m.total,
          f"free={m.free} used={m.used} total={m.total}")
    if hasattr(lib, "nvmlDeviceGetMemoryInfo_v2"):
        m2 = MemoryV2()
        m2.version = ctypes.sizeof(MemoryV2) | (2 << 24)
        rc = lib.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(m2))
        check("nvml[ctypes]: nvmlDeviceGetMemoryInfo_v2 total == cap", rc == 0 and m2.total == cap,
              f"rc={rc} total={m2.total} ({gib(m2.total)}) reserved={m2.reserved} free={m2.free} used={m2.used}")
    else:
        skip("nvml[ctypes]: nvmlDeviceGetMemoryInfo_v2", "libnvidia-ml.so.1 has no nvmlDeviceGetMemoryInfo_v2")
    lib.nvmlShutdown()


def via_pynvml():
    try:
        import pynvml
    except ImportError as e:
        skip("nvml[pynvml]", f"pynvml not importable ({e}); the ctypes checks above cover NVML")
        return
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        check("nvml[pynvml]: nvmlDeviceGetMemoryInfo(h).total == cap", m.total == cap,
              f"total={m.total} ({gib(m.total)}) free={m.free} used={m.used}")
        v2 = getattr(pynvml, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=v2)
                check("nvml[pynvml]: nvmlDeviceGetMemoryInfo(h, version=v2).total == cap", m2.total == cap,
                      f"total={m2.total} free={m2.free} used={m2.used}")
            except TypeError as e:
                skip("nvml[pynvml]: v2", f"this pynvml takes no version argument ({e})")
        else:
            skip("nvml[pynvml]: v2", "this pynvml has no nvmlMemory_v2")
    finally:
        pynvml.nvmlShutdown()


def smi_total(env):
    rc, out, err = run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                       env=env, timeout=30)
    val = out.strip().splitlines()[0].strip() if out.strip() else ""
    return rc, val, err


def via_nvidia_smi():
    shim = os.environ.get("LD_PRELOAD", "")
    rc, native, err = smi_total(clean_env())
    info("nvidia-smi memory.total without the shim", f"{native} MiB (rc={rc}) {tail(err, 2)}")
    env = dict(os.environ)  # inherits LD_PRELOAD and GPU_MEM_LIMIT
    rc, capped, err = smi_total(env)
    want = cap // MiB
    check("nvidia-smi --query-gpu=memory.total under LD_PRELOAD shows the cap",
          rc == 0 and capped.isdigit() and int(capped) == want,
          f"memory.total={capped} MiB expected={want} MiB rc={rc} LD_PRELOAD={'set' if shim else 'UNSET'} "
          f"{tail(err, 2)}")


guarded("nvml[ctypes]", via_ctypes)
guarded("nvml[pynvml]", via_pynvml)
guarded("nvidia-smi", via_nvidia_smi)
done()
