"""Section 7: spatial sharing under `gpufrac broker --mps`, on a real GPU.

    python3 gpu/mps.py --bin target/release/gpufrac --load WORK/load --shim target/release/libgpufrac.so \
        --workdir /tmp/mps [--torch-check gpu/check_torch.py]

1. Throughput of small kernels (50 us, 16 blocks: small-batch inference) as
   1, 2 and 16 jobs of `gpufrac run --gpu-memory 1G -- load batch 50`, each
   for a few seconds, first under a time-slicing broker, then under
   `gpufrac broker --mps`. Reported: the GPU work all jobs did, over what
   one job alone did. Targets: 16 jobs under MPS >= 10x one alone; time-
   slicing near 1x (one GPU's worth).
2. Inside an MPS client, the memory cap holds and PyTorch's mem_get_info
   reports the cap as the total (check_torch.py under `gpufrac run
   --gpu-memory 4G` with an MPS broker).
3. A clean stop of the broker leaves no MPS server or control daemon.

Never changes the GPU's compute mode or any other setting.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import check, done, info, skip  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bin", required=True)
ap.add_argument("--load", required=True)
ap.add_argument("--shim", required=True)
ap.add_argument("--workdir", required=True)
ap.add_argument("--torch-check")
ap.add_argument("--seconds", type=float, default=4.0)
args = ap.parse_args()
os.makedirs(args.workdir, exist_ok=True)
SOCK = os.path.join(args.workdir, "b.sock")
SHAPE = ["--grid", "16", "--block", "128"]


def env():
    e = {k: v for k, v in os.environ.items() if not (k.startswith("GPU_") or k.startswith("GPUFRAC_")
                                                     or k.startswith("CUDA_MPS_") or k == "LD_PRELOAD")}
    return e


def start_broker(mps):
    cmd = [args.bin, "broker", "--socket", SOCK] + (["--mps"] if mps else [])
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.workdir, "broker.log"), "a"))
    deadline = time.time() + 20
    while time.time() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"broker exited: {open(os.path.join(args.workdir, 'broker.log')).read()[-400:]}")
        r = subprocess.run([args.bin, "status", "--json", "--socket", SOCK], capture_output=True, env=env())
        if r.returncode == 0:
            return p
        time.sleep(0.1)
    raise RuntimeError("broker did not come up")


def stop_broker(p):
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)


def calibrate():
    r = subprocess.run([args.load, "calibrate"] + SHAPE, capture_output=True, text=True, env=env(), timeout=60)
    m = re.search(r"cycles_per_us=([0-9.]+)", r.stdout)
    if not m:
        raise RuntimeError(f"calibrate: {r.stdout}{r.stderr}")
    return m.group(1)


def work(n, cyc):
    """GPU work (us) n concurrent jobs did in their windows."""
    procs = [subprocess.Popen([args.bin, "run", "--socket", SOCK, "--gpu-memory", "1G", "--", args.load, "batch", "50",
                               "--cycles-per-us", cyc, "--seconds", str(args.seconds)] + SHAPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for _ in range(n)]
    total = 0.0
    for p in procs:
        out, err = p.communicate(timeout=120)
        m = re.search(r"work_us=([0-9.]+)", out)
        if p.returncode != 0 or not m:
            raise RuntimeError(f"job failed: {out[-300:]}{err[-300:]}")
        total += float(m.group(1))
    return total


def throughput(mps, cyc):
    b = start_broker(mps)
    try:
        one = work(1, cyc)
        return {n: work(n, cyc) / one for n in (1, 2, 16)}
    finally:
        stop_broker(b)


def leftovers():
    r = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps"], capture_output=True, text=True)
    return r.stdout.split()


def main():
    if leftovers():
        skip("MPS section", f"an MPS daemon is already running (pids {leftovers()}); not touching it")
        done()
        return
    cyc = calibrate()
    ts = throughput(False, cyc)
    info("time-slicing: work of N jobs / one alone", str({k: round(v, 2) for k, v in ts.items()}))
    mps = throughput(True, cyc)
    info("MPS: work of N jobs / one alone", str({k: round(v, 2) for k, v in mps.items()}))
    check("MPS: 16 small-kernel jobs do >= 10x the work of one alone", mps[16] >= 10, f"{mps[16]:.2f}x")
    check("MPS: 2 jobs do more than one alone", mps[2] > 1.3, f"{mps[2]:.2f}x")
    if args.torch_check:
        b = start_broker(True)
        try:
            e = env()
            e["SUITE_CAP_BYTES"] = str(4 << 30)
            r = subprocess.run([args.bin, "run", "--socket", SOCK, "--gpu-memory", "4G", "--", sys.executable,
                                args.torch_check], capture_output=True, text=True, env=e, timeout=180)
            fails = [l for l in r.stdout.splitlines() if l.startswith("FAIL")]
            check("MPS client: PyTorch under a 4 GiB job cap (check_torch.py)", r.returncode == 0 and not fails,
                  "; ".join(fails)[:400] or r.stderr[-300:])
        finally:
            stop_broker(b)
    left = leftovers()
    check("a clean stop leaves no MPS daemon or server", not left, str(left))
    done()


main()
