"""A malformed cap fails closed: GPU_MEM_LIMIT=4X must make the first CUDA
use fail, with stderr naming GPU_MEM_LIMIT, and the program must never get
to allocate (a user who asked for a cap must never run uncapped).

    python3 gpu/check_malformed.py --shim target/release/libgpufrac.so \
        [--cudarc target/release/examples/cudarc_alloc] [--torch] [--cupy]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import check, clean_env, done, guarded, run, tail  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shim", required=True)
ap.add_argument("--cudarc")
ap.add_argument("--torch", action="store_true")
ap.add_argument("--cupy", action="store_true")
args = ap.parse_args()
BAD = "4X"
env = clean_env({"GPU_MEM_LIMIT": BAD, "GPUFRAC_BROKER": "off", "PYTHONUNBUFFERED": "1"}, shim=args.shim)

TORCH = r"""
import torch
try:
    torch.cuda.init()
    print("INIT ok")
except Exception as e:
    print("INIT failed:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
try:
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    print("ALLOC ok")
except Exception as e:
    print("ALLOC failed:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""

CUPY = r"""
import cupy
try:
    x = cupy.ones(1 << 20)
    cupy.cuda.Device().synchronize()
    print("ALLOC ok")
except Exception as e:
    print("ALLOC failed:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""


def python_case(name, code):
    rc, out, err = run([sys.executable, "-c", code], env=env, timeout=120)
    named = "GPU_MEM_LIMIT" in err
    allocated = "ALLOC ok" in out
    check(f"malformed[{name}]: GPU_MEM_LIMIT={BAD} -> CUDA unusable (never runs uncapped)", not allocated,
          f"rc={rc} {tail(out, 3)}")
    check(f"malformed[{name}]: stderr names GPU_MEM_LIMIT", named,
          f"stderr: {tail(err, 3)[:400]}")


def cudarc_case():
    rc, out, err = run([args.cudarc, "--block", "256", "--max", "2"], env=env, timeout=60)
    check(f"malformed[cudarc]: GPU_MEM_LIMIT={BAD} -> cuInit fails, nothing allocated, exit != 0",
          rc not in (0, 124) and "count=" not in out, f"rc={rc} {tail(out, 2)}")
    check("malformed[cudarc]: stderr names GPU_MEM_LIMIT", "GPU_MEM_LIMIT" in err, f"stderr: {tail(err, 3)[:400]}")


if args.torch:
    guarded("malformed[torch]", python_case, "torch", TORCH)
if args.cupy:
    guarded("malformed[cupy]", python_case, "cupy", CUPY)
if args.cudarc:
    guarded("malformed[cudarc]", cudarc_case)
done()
