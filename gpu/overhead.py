"""Section 3: what the shim costs, measured by alternating native and shimmed runs.

    python3 gpu/overhead.py --shim target/release/libgpufrac.so \
        [--empty-kernel PATH] [--runs 5] [--launches 200000] \
        [--train gpu/train_step.py] [--train-runs 3] [--steps 200]

Shimmed runs use GPU_MEM_LIMIT (the suite's cap) and GPUFRAC_BROKER=off: the
launch fast path with no arbitration. Runs alternate native/shim (and swap
which goes first each round) so drift in clocks or temperature hits both.
Pass: launch overhead <= max(50 ns, 5%) per launch; training step overhead <= 5%.
"""

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import MiB, cap_bytes, check, clean_env, done, guarded, info, run, skip, tail  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shim", required=True)
ap.add_argument("--empty-kernel")
ap.add_argument("--runs", type=int, default=5)
ap.add_argument("--launches", type=int, default=200000)
ap.add_argument("--train")
ap.add_argument("--train-runs", type=int, default=3)
ap.add_argument("--steps", type=int, default=200)
args = ap.parse_args()
limit = os.environ.get("SUITE_CAP", f"{cap_bytes() // MiB}M")
NATIVE = clean_env()
SHIM = clean_env({"GPU_MEM_LIMIT": limit, "GPUFRAC_BROKER": "off"}, shim=args.shim)


def field(out, key):
    m = re.search(rf"\b{key}=([0-9.]+)", out)
    return float(m.group(1)) if m else None


def alternate(label, cmd, key, runs, timeout):
    """Returns ({'native': [...], 'shim': [...]}, errors)."""
    vals = {"native": [], "shim": []}
    errors = []
    for i in range(runs):
        order = ("native", "shim") if i % 2 == 0 else ("shim", "native")
        for mode in order:
            rc, out, err = run(cmd, env=NATIVE if mode == "native" else SHIM, timeout=timeout)
            v = field(out, key)
            if rc != 0 or v is None:
                errors.append(f"{mode} run {i + 1}: rc={rc} {tail(out, 2)} {tail(err, 3)}")
            else:
                vals[mode].append(v)
    info(f"{label} raw", f"native={vals['native']} shim={vals['shim']}")
    return vals, errors


def launches():
    vals, errors = alternate("overhead[empty kernels]", [args.empty_kernel, str(args.launches)],
                             "ns_per_launch", args.runs, 120)
    if errors or not vals["native"] or not vals["shim"]:
        check("overhead[empty kernels]: all runs completed", False, "; ".join(errors)[:600])
        if not vals["native"] or not vals["shim"]:
            return
    n, s = statistics.median(vals["native"]), statistics.median(vals["shim"])
    diff = s - n
    pct = 100.0 * diff / n
    check(f"overhead[empty kernels]: {args.launches} launches x {args.runs} runs each, shim adds "
          f"<= max(50 ns, 5%) per launch", diff <= max(50.0, 0.05 * n),
          f"median native={n:.1f} ns/launch shim={s:.1f} ns/launch diff={diff:+.1f} ns ({pct:+.2f}%)")


def training():
    vals, errors = alternate("overhead[training]", [sys.executable, args.train, "--steps", str(args.steps)],
                             "ms_per_step", args.train_runs, 180)
    if errors or not vals["native"] or not vals["shim"]:
        check("overhead[training]: all runs completed", False, "; ".join(errors)[:600])
        if not vals["native"] or not vals["shim"]:
            return
    n, s = statistics.median(vals["native"]), statistics.median(vals["shim"])
    pct = 100.0 * (s - n) / n
    check(f"overhead[training]: convnet, {args.steps} steps x {args.train_runs} runs each, shim adds <= 5%",
          pct <= 5.0, f"median native={n:.3f} ms/step shim={s:.3f} ms/step overhead={pct:+.2f}%")


if args.empty_kernel and os.access(args.empty_kernel, os.X_OK):
    guarded("overhead[empty kernels]", launches)
else:
    skip("overhead[empty kernels]", f"no empty_kernel binary ({args.empty_kernel or 'not built'})")
if args.train:
    guarded("overhead[training]", training)
else:
    skip("overhead[training]", "no PyTorch with a usable GPU")
done()
