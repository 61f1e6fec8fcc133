"""cupy under the memory cap. Run it under the shim:

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=4G python3 gpu/check_cupy.py

For three allocators: the default MemoryPool (cudaMalloc),
MemoryPool(cupy.cuda.memory.malloc_async) (cudaMallocAsync, stream-ordered)
and cupy.cuda.MemoryAsyncPool (the CUDA mempool directly): memGetInfo shows
the cap; an array larger than the cap raises cupy.cuda.memory.OutOfMemoryError;
256 MiB arrays stop at the cap; after free_all_blocks the same amount can be
allocated again.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import GiB, MiB, cap_bytes, check, done, first_line, gib, guarded, info, skip  # noqa: E402

import cupy as cp  # noqa: E402
from cupy.cuda.memory import OutOfMemoryError  # noqa: E402

CHUNK = 256 * MiB
cap = cap_bytes()
info("cupy versions", f"cupy={cp.__version__} runtime={cp.cuda.runtime.runtimeGetVersion()} "
     f"driver={cp.cuda.runtime.driverGetVersion()}")


def seen_cap():
    free, total = cp.cuda.runtime.memGetInfo()
    check("cupy: cuda.runtime.memGetInfo() total == cap", total == cap,
          f"total={total} ({gib(total)}) free={free} ({gib(free)}) cap={cap}")
    dev_total = cp.cuda.Device(0).mem_info[1]
    check("cupy: Device(0).mem_info total == cap", dev_total == cap, f"total={dev_total}")
    props_total = cp.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"]
    check("cupy: getDeviceProperties(0)['totalGlobalMem'] == cap", props_total == cap,
          f"totalGlobalMem={props_total}")


def oom_type_ok(e):
    return isinstance(e, OutOfMemoryError)


def exercise(tag, pool):
    cp.cuda.set_allocator(pool.malloc)
    try:
        try:
            x = cp.empty(cap + GiB, dtype=cp.uint8)
            del x
            check(f"cupy[{tag}]: one array of cap+1GiB raises OutOfMemoryError", False,
                  f"allocation of {gib(cap + GiB)} succeeded")
        except Exception as e:  # noqa: BLE001
            check(f"cupy[{tag}]: one array of cap+1GiB raises OutOfMemoryError", oom_type_ok(e),
                  first_line(e)[:200])
        counts = []
        for round_ in ("first fill", "refill"):
            held, err = [], None
            for _ in range(cap // CHUNK + 8):
                try:
                    held.append(cp.empty(CHUNK, dtype=cp.uint8))
                except Exception as e:  # noqa: BLE001
                    err = e
                    break
            n = len(held) * CHUNK
            used = pool.used_bytes() if hasattr(pool, "used_bytes") else -1
            ok = err is not None and oom_type_ok(err) and cap - 2 * CHUNK <= n <= cap
            check(f"cupy[{tag}]: {round_}: 256 MiB arrays stop at the cap with OutOfMemoryError", ok,
                  f"held={len(held)} x 256 MiB = {gib(n)} pool.used={gib(used)} "
                  f"stop={'none' if err is None else first_line(err)[:160]}")
            counts.append(n)
            del held
            pool.free_all_blocks()
            cp.cuda.Device().synchronize()
            free, total = cp.cuda.runtime.memGetInfo()
            check(f"cupy[{tag}]: {round_}: after free_all_blocks, memGetInfo free is back near the cap",
                  free >= cap - 2 * CHUNK, f"free={free} ({gib(free)}) total={total}")
        check(f"cupy[{tag}]: refill holds the same amount as the first fill (no drift)",
              counts[0] == counts[1], f"first={gib(counts[0])} second={gib(counts[1])}")
        a = cp.arange(1 << 20, dtype=cp.float64)
        s = float((a * 2).sum())
        want = float((1 << 20) * ((1 << 20) - 1))
        check(f"cupy[{tag}]: a kernel runs under the cap", abs(s - want) <= 1e-9 * want,
              f"sum={s:.6e} expected={want:.6e}")
        del a
        pool.free_all_blocks()
    finally:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


guarded("cupy: cap seen", seen_cap)
guarded("cupy[default MemoryPool]", exercise, "default MemoryPool", cp.get_default_memory_pool())
if hasattr(cp.cuda.memory, "malloc_async"):
    guarded("cupy[MemoryPool(malloc_async)]", lambda: exercise(
        "MemoryPool(malloc_async)", cp.cuda.MemoryPool(cp.cuda.memory.malloc_async)))
else:
    skip("cupy[MemoryPool(malloc_async)]", "this cupy has no cupy.cuda.memory.malloc_async")
if hasattr(cp.cuda, "MemoryAsyncPool"):
    guarded("cupy[MemoryAsyncPool]", lambda: exercise("MemoryAsyncPool", cp.cuda.MemoryAsyncPool()))
else:
    skip("cupy[MemoryAsyncPool]", "this cupy has no cupy.cuda.MemoryAsyncPool")
done()
