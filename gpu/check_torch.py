"""PyTorch under the memory cap. Run it under the shim:

    LD_PRELOAD=target/release/libgpufrac.so GPU_MEM_LIMIT=4G python3 gpu/check_torch.py
    # and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the VMM path:
    # cuMemCreate / cuMemMap instead of cudaMalloc)

Checks: the cap is what torch sees (mem_get_info, device properties); one
tensor larger than the cap raises torch.OutOfMemoryError; filling the cap in
256 MiB tensors stops at the cap; after del + empty_cache the same amount
can be allocated again (no drift); real compute still works.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import GiB, MiB, cap_bytes, check, done, first_line, gib, guarded, info  # noqa: E402

conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
TAG = "torch[expandable_segments]" if "expandable_segments:True" in conf else "torch[default]"
CHUNK = 256 * MiB

import torch  # noqa: E402

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
cap = cap_bytes()
info(f"{TAG} versions", f"torch={torch.__version__} cuda={torch.version.cuda} "
     f"PYTORCH_CUDA_ALLOC_CONF={conf or '(unset)'}")


def seen_cap():
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    check(f"{TAG}: torch.cuda.mem_get_info() total == cap", total == cap,
          f"total={total} ({gib(total)}) free={free} ({gib(free)}) cap={cap}")
    check(f"{TAG}: mem_get_info free <= total", 0 < free <= total, f"free={free} total={total}")
    props = torch.cuda.get_device_properties(0)
    check(f"{TAG}: get_device_properties(0).total_memory == cap", props.total_memory == cap,
          f"total_memory={props.total_memory} ({gib(props.total_memory)}) name={props.name}")


def too_big():
    try:
        x = torch.empty(cap + GiB, dtype=torch.uint8, device="cuda")
        del x
        check(f"{TAG}: one tensor of cap+1GiB raises OutOfMemoryError", False,
              f"allocation of {gib(cap + GiB)} succeeded")
    except OOM as e:
        check(f"{TAG}: one tensor of cap+1GiB raises OutOfMemoryError", True, first_line(e)[:300])


def fill(label):
    """Allocates CHUNK tensors until OOM; returns the bytes held at the OOM."""
    held, err = [], None
    for _ in range(cap // CHUNK + 8):
        try:
            held.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
        except OOM as e:
            err = e
            break
    n = len(held) * CHUNK
    reserved = torch.cuda.memory_reserved()
    ok = err is not None and cap - 2 * CHUNK <= n <= cap
    check(f"{TAG}: {label}: 256 MiB tensors stop at the cap with OutOfMemoryError", ok,
          f"held={len(held)} x 256 MiB = {gib(n)} reserved={gib(reserved)} cap={gib(cap)} "
          f"stop={'none' if err is None else first_line(err)[:160]}")
    check(f"{TAG}: {label}: memory_reserved <= cap", reserved <= cap,
          f"reserved={reserved} cap={cap}")
    del held
    return n


def free_and_refill(first):
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    check(f"{TAG}: after del + empty_cache, mem_get_info free is back near the cap",
          free >= cap - 2 * CHUNK, f"free={free} ({gib(free)}) total={total}")
    try:
        x = torch.empty(cap // 2, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        del x
        check(f"{TAG}: after del + empty_cache, a cap/2 tensor allocates", True, gib(cap // 2))
    except OOM as e:
        check(f"{TAG}: after del + empty_cache, a cap/2 tensor allocates", False, first_line(e)[:200])
    torch.cuda.empty_cache()
    second = fill("refill")
    check(f"{TAG}: refill holds the same amount as the first fill (no drift)", second == first,
          f"first={gib(first)} second={gib(second)}")
    torch.cuda.empty_cache()


def compute():
    a = torch.randn(2048, 2048, device="cuda")
    s = (a @ a).sum().item()
    torch.cuda.synchronize()
    check(f"{TAG}: matmul under the cap computes", s == s, f"sum={s:.3e}")


guarded(f"{TAG}: cap seen", seen_cap)
guarded(f"{TAG}: too big", too_big)
first = guarded(f"{TAG}: fill", fill, "first fill")
if first is not None:
    guarded(f"{TAG}: free and refill", free_and_refill, first)
guarded(f"{TAG}: compute", compute)
done()
