"""PyTorch load for section 6: a training step beside small-batch inference.

    python3 gpu/torch_load.py train [--size 8192] [--depth 4]  (--sync DIR --tag T | --seconds S)
    python3 gpu/torch_load.py infer [--layers 8] [--width 4096] [--batch 4] [--period-ms 20]  (...)

With --sync, the process initialises and warms up, creates DIR/<tag>.ready,
then waits for DIR/go holding "START_NS END_NS" (CLOCK_MONOTONIC, the clock
of time.monotonic_ns on Linux), as gpu/load.cu does.

train: fp16 size x size matmuls back to back, DEPTH queued (an event after
each; before queueing the next it waits for the oldest), from START to END:
    RESULT mode=batch unit=matmul done=N work=W window_s=S rate=R late_us=L
N: matmuls completed inside the window; W: matmuls done inside it, those
straddling START or END counted in part (each spread evenly over the time
it was on the GPU, by its event); R = W / S, matmuls per second.

infer: every PERIOD a batch-B request through an L-layer fp16 MLP
(Linear + ReLU), then a synchronize; a request's latency runs from its first
launch to the synchronize's return:
    RESULT mode=interactive requests=N p50_us=.. p99_us=.. max_us=.. missed=M late_us=L
M: requests longer than the period.
"""

import argparse
import math
import os
import sys
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["train", "infer"])
ap.add_argument("--size", type=int, default=8192)
ap.add_argument("--depth", type=int, default=4)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--width", type=int, default=4096)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--period-ms", type=float, default=20.0)
ap.add_argument("--sync")
ap.add_argument("--tag", default="torch")
ap.add_argument("--seconds", type=float)
args = ap.parse_args()


def window():
    """(start_ns, end_ns, late_ns) of the measurement window."""
    if args.sync:
        open(os.path.join(args.sync, f"{args.tag}.ready"), "w").close()
        go = os.path.join(args.sync, "go")
        give_up = time.monotonic() + 300
        while True:
            try:
                with open(go) as f:
                    parts = f.read().split()
                if len(parts) == 2 and int(parts[1]) > int(parts[0]):
                    start, end = int(parts[0]), int(parts[1])
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > give_up:
                sys.exit(f"torch_load: no usable {go} within 300 s")
            time.sleep(0.001)
    else:
        if not args.seconds:
            sys.exit("torch_load: --sync DIR or --seconds S")
        start = time.monotonic_ns() + 50_000_000
        end = start + int(args.seconds * 1e9)
    return start, end, max(0, time.monotonic_ns() - start)


def sleep_until(t_ns):
    d = t_ns - time.monotonic_ns()
    if d > 0:
        time.sleep(d / 1e9)


def train():
    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    # Maps GPU timestamps onto time.monotonic_ns: read right after the
    # synchronize sees the event complete.
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    ref.synchronize()
    ref_ns = time.monotonic_ns()
    depth = max(1, args.depth)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(depth)]
    submitted = [0] * depth
    start, end, late = window()
    sleep_until(start)
    st = {"done": 0, "work": 0.0, "prev": None}

    def account(slot):
        done = ref_ns + int(ref.elapsed_time(events[slot]) * 1e6)
        began = submitted[slot] if st["prev"] is None else max(st["prev"], submitted[slot])
        done = max(done, began)
        lo, hi = max(began, start), min(done, end)
        if done > began:
            if hi > lo:
                st["work"] += (hi - lo) / (done - began)
        elif start <= done <= end:
            st["work"] += 1.0
        if start <= done <= end:
            st["done"] += 1
        st["prev"] = done

    launched = 0
    while time.monotonic_ns() < end:
        slot = launched % depth
        if launched >= depth:
            events[slot].synchronize()
            account(slot)
        torch.matmul(a, b, out=c)
        # After the call returns (the shim may have held the launch at its
        # gate): the matmul cannot have started earlier.
        submitted[slot] = time.monotonic_ns()
        events[slot].record()
        launched += 1
    for k in range(max(0, launched - depth), launched):
        slot = k % depth
        events[slot].synchronize()
        account(slot)
    secs = (end - start) / 1e9
    print(f"RESULT mode=batch unit=matmul done={st['done']} work={st['work']:.3f} window_s={secs:.3f} "
          f"rate={st['work'] / secs:.3f} late_us={late / 1000:.0f}", flush=True)


def infer():
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    mlp = torch.nn.Sequential(*layers).to(device="cuda", dtype=torch.float16).eval()
    x = torch.randn(args.batch, args.width, device="cuda", dtype=torch.float16)
    period = int(args.period_ms * 1e6)
    lat = []
    with torch.inference_mode():
        for _ in range(20):
            mlp(x)
        torch.cuda.synchronize()
        start, end, late = window()
        nxt = start
        while nxt < end:
            sleep_until(nxt)
            t0 = time.monotonic_ns()
            mlp(x)
            torch.cuda.synchronize()
            t1 = time.monotonic_ns()
            lat.append(t1 - t0)
            nxt += period
            while nxt + period < t1:
                nxt += period
    lat.sort()

    def pct(p):
        if not lat:
            return 0.0
        rank = min(max(math.ceil(p * len(lat)), 1), len(lat))
        return lat[rank - 1] / 1000

    missed = sum(1 for v in lat if v > period)
    print(f"RESULT mode=interactive requests={len(lat)} p50_us={pct(0.50):.0f} p99_us={pct(0.99):.0f} "
          f"max_us={(lat[-1] / 1000 if lat else 0):.0f} missed={missed} late_us={late / 1000:.0f}", flush=True)


print(f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name(0)}",
      file=sys.stderr, flush=True)
if args.mode == "train":
    train()
else:
    infer()
