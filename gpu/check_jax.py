"""JAX under the memory cap. Run it under the shim with JAX_PLATFORMS=cuda (so
a broken CUDA backend is an error, not a silent fall-back to the CPU):

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=4G JAX_PLATFORMS=cuda \
        python3 gpu/check_jax.py            # default: preallocation on, fraction .75
    ... XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
        python3 gpu/check_jax.py            # every buffer is a cuMemAlloc

Preallocation: XLA sizes its BFC arena from cuMemGetInfo, so it must take
~75% of the cap (bytes_limit <= cap), not 75% of the physical GPU; nvidia-smi
(run outside the shim) must show the process holding about that much, not
tens of GiB. Platform allocator: allocations past the cap fail with
RESOURCE_EXHAUSTED and succeed again after the arrays are freed.
"""

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import GiB, MiB, cap_bytes, check, clean_env, done, first_line, gib, guarded, info, run  # noqa: E402

platform_alloc = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform"
TAG = "jax[platform allocator]" if platform_alloc else "jax[preallocate]"
cap = cap_bytes()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

info(f"{TAG} versions", f"jax={jax.__version__} "
     f"PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '(default)')} "
     f"MEM_FRACTION={os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', os.environ.get('XLA_CLIENT_MEM_FRACTION', '(default .75)'))}")


def zeros(nbytes):
    """An int8 array of nbytes (2-D, so no dimension exceeds 2**31)."""
    return jnp.zeros((nbytes // MiB, MiB), jnp.int8).block_until_ready()


def is_oom(e):
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower()


def proc_used_bytes():
    """This process's memory as the real driver sees it (nvidia-smi outside the shim)."""
    rc, out, _ = run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                      "--format=csv,noheader,nounits"], env=clean_env(), timeout=30)
    if rc != 0:
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            return int(parts[1]) * MiB
    return None


def backend():
    dev = jax.devices()[0]
    check(f"{TAG}: JAX runs on the GPU under the shim", dev.platform == "gpu",
          f"device={dev} platform={dev.platform} kind={getattr(dev, 'device_kind', '?')}")
    x = jnp.ones((1024, 1024), jnp.float32)
    s = float((x @ x).sum().block_until_ready())
    check(f"{TAG}: a matmul computes", s == 1024.0 ** 3, f"sum={s:.6e}")
    return dev


def prealloc(dev):
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        check(f"{TAG}: memory_stats() has bytes_limit", False, f"stats keys={sorted(stats)}")
    else:
        check(f"{TAG}: bytes_limit <= cap (arena sized from the cap, not the physical GPU)",
              limit <= cap, f"bytes_limit={limit} ({gib(limit)}) = {limit / cap:.3f} x cap")
        check(f"{TAG}: bytes_limit is ~75% of the cap (0.65..0.80)", 0.65 * cap <= limit <= 0.80 * cap,
              f"bytes_limit/cap={limit / cap:.3f}")
    used = proc_used_bytes()
    if used is None:
        info(f"{TAG}: nvidia-smi per-process memory", "this pid is not listed (pid namespace?)")
    else:
        # context + cuBLAS/cuDNN handles add a few hundred MiB outside the cap
        check(f"{TAG}: nvidia-smi shows the process holding <= cap + 1 GiB",
              used <= cap + GiB, f"used={used // MiB} MiB ({gib(used)}) cap={gib(cap)}")
    try:
        y = zeros(cap + GiB)
        del y
        check(f"{TAG}: an array of cap+1GiB fails with RESOURCE_EXHAUSTED", False, "it allocated")
    except Exception as e:  # noqa: BLE001
        check(f"{TAG}: an array of cap+1GiB fails with RESOURCE_EXHAUSTED", is_oom(e), first_line(e)[:240])


def platform():
    big = cap - GiB
    a = zeros(big)
    check(f"{TAG}: an array of cap-1GiB allocates", True, gib(big))
    try:
        b = zeros(2 * GiB)
        del b
        check(f"{TAG}: a further 2 GiB array fails with RESOURCE_EXHAUSTED", False, "it allocated")
    except Exception as e:  # noqa: BLE001
        check(f"{TAG}: a further 2 GiB array fails with RESOURCE_EXHAUSTED", is_oom(e), first_line(e)[:240])
    del a
    gc.collect()
    c = zeros(2 * GiB)
    check(f"{TAG}: after freeing, a 2 GiB array allocates again", c.nbytes == 2 * GiB, gib(c.nbytes))
    del c
    used = proc_used_bytes()
    if used is not None:
        info(f"{TAG}: nvidia-smi per-process memory at the end", f"{used // MiB} MiB")


dev = guarded(f"{TAG}: backend", backend)
if dev is not None:
    if platform_alloc:
        guarded(f"{TAG}: platform allocator", platform)
    else:
        guarded(f"{TAG}: preallocation", prealloc, dev)
done()
