"""GPU-bound load for the sharing checks: fp16 matmuls for N seconds.

    python3 gpu/matmul_loop.py --seconds 8 [--size 8192] [--barrier DIR --nproc N] [--tag NAME]

With --barrier, each process initialises CUDA and warms up, then drops
DIR/<tag>.ready and waits until N such files exist, so concurrent processes
measure the same window. It counts completed matmuls (synchronising every
--sync-every launches) and prints
    RESULT tag=NAME iters=I seconds=S ips=I/S
"""

import argparse
import os
import sys
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--seconds", type=float, default=8.0)
ap.add_argument("--size", type=int, default=8192)
ap.add_argument("--sync-every", type=int, default=4)
ap.add_argument("--barrier")
ap.add_argument("--nproc", type=int, default=1)
ap.add_argument("--tag", default=str(os.getpid()))
args = ap.parse_args()

a = torch.randn(args.size, args.size, device="cuda", dtype=torch.float16)
b = torch.randn(args.size, args.size, device="cuda", dtype=torch.float16)
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()

if args.barrier:
    open(os.path.join(args.barrier, f"{args.tag}.ready"), "w").close()
    deadline = time.time() + 120
    while sum(f.endswith(".ready") for f in os.listdir(args.barrier)) < args.nproc:
        if time.time() > deadline:
            print(f"WARN tag={args.tag} barrier timed out", file=sys.stderr, flush=True)
            break
        time.sleep(0.005)

iters = 0
t0 = time.perf_counter()
while True:
    for _ in range(args.sync_every):
        c = a @ b
    torch.cuda.synchronize()
    iters += args.sync_every
    elapsed = time.perf_counter() - t0
    if elapsed >= args.seconds:
        break
print(f"RESULT tag={args.tag} iters={iters} seconds={elapsed:.3f} ips={iters / elapsed:.2f}", flush=True)
