"""The cudarc example (examples/cudarc_alloc.rs) on the real driver.

    python3 gpu/check_cudarc.py --exe target/release/examples/cudarc_alloc \
        --shim target/release/libgpufrac.so

Runs natively (no cap: 20 blocks of 256 MiB must all allocate, so the GPU
itself is not what stops the capped runs), then under the shim with
GPU_MEM_LIMIT (default 4G): `--block 256` must stop at exactly cap/256 MiB
blocks with CUDA_ERROR_OUT_OF_MEMORY, report total == cap, reallocate after a
free and free everything; the same with `--safe` (CudaContext +
alloc_zeros, i.e. cuMemAllocAsync on a pool-capable GPU).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import MiB, cap_bytes, check, clean_env, done, guarded, run, tail  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--exe", required=True)
ap.add_argument("--shim", required=True)
args = ap.parse_args()
cap = cap_bytes()
limit = os.environ.get("SUITE_CAP", f"{cap // MiB}M")


def parse(out):
    """{'mode': {...}, 'info': {...}, 'realloc': {...}, 'freed': {...}} from the example's lines."""
    res = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != "cudarc":
            continue
        kv = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        key = "mode" if parts[1].startswith("mode=") else parts[1]
        res[key] = kv
    return res


def native():
    rc, out, err = run([args.exe, "--block", "256", "--max", "20"], env=clean_env(), timeout=60)
    r = parse(out)
    m = r.get("mode", {})
    check("cudarc[native]: 20 x 256 MiB allocate without the shim", rc == 0 and m.get("count") == "20"
          and m.get("err") == "none", f"rc={rc} {tail(out, 4)} {tail(err, 2)}")


def capped(safe):
    tag = "safe" if safe else "result"
    cmd = [args.exe, "--block", "256"] + (["--safe"] if safe else [])
    env = clean_env({"GPU_MEM_LIMIT": limit, "GPUFRAC_BROKER": "off"}, shim=args.shim)
    rc, out, err = run(cmd, env=env, timeout=120)
    r = parse(out)
    m, inf, re_, fr = (r.get(k, {}) for k in ("mode", "info", "realloc", "freed"))
    want = cap // (256 * MiB)
    check(f"cudarc[{tag}]: --block 256 under a {limit} cap stops at {want} blocks with CUDA_ERROR_OUT_OF_MEMORY",
          m.get("count") == str(want) and m.get("err") == "CUDA_ERROR_OUT_OF_MEMORY",
          f"count={m.get('count')} err={m.get('err')} rc={rc} {tail(err, 2)}")
    check(f"cudarc[{tag}]: mem_get_info total == cap", inf.get("total") == str(cap),
          f"free={inf.get('free')} total={inf.get('total')} cap={cap}")
    check(f"cudarc[{tag}]: free one + allocate one works (realloc ok=true)", re_.get("ok") == "true",
          f"realloc={re_}")
    check(f"cudarc[{tag}]: everything frees (freed ok=true) and exit status 0",
          fr.get("ok") == "true" and rc == 0, f"freed={fr} rc={rc}")


guarded("cudarc[native]", native)
guarded("cudarc[result]", capped, False)
guarded("cudarc[safe]", capped, True)
done()
