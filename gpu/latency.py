"""Section 6: latency beside batch work, and shares with short and long kernels.

    python3 gpu/latency.py --part cuda|shares|torch --bin target/release/gpufrac \
        --shim target/release/libgpufrac.so --load WORKDIR/load --workdir DIR \
        [--torch-script gpu/torch_load.py] [--sock /tmp/gpufrac-suite/broker.sock] \
        [--seconds 5] [--share-seconds 4] [--deadline-s 150] [--quantum-ms 2] [--inflight-us 250]

Every scenario starts its processes together behind a file barrier (each
initialises, then waits for DIR/.../go to name a common CLOCK_MONOTONIC
window). Settings: *alone* (the interactive process by itself, no shim);
*native* (no shim, no broker: the GPU's own time-slicing); *default* (both
processes under the shim, clients of `gpufrac broker` at its defaults);
*high* (the same, the interactive process with GPU_COMPUTE_PRIORITY=high).

--part cuda: gpu/load.cu, an interactive process (10 x 50 us kernels every
  20 ms) beside a batch job of 50 us, 6 ms or 120 ms kernels.
--part shares: gpu/load.cu, two batch jobs at GPU_COMPUTE_SHARE 70% / 30%
  with 50 us, 6 ms and 120 ms kernels, against one job alone.
--part torch: gpu/torch_load.py, small-batch inference (an 8-layer fp16 MLP,
  batch 4 every 20 ms) beside a training loop (8192^2 fp16 matmuls); then two
  training loops at 70% / 30% against one alone.

Targets: default p99 <= native p99; high p99 <= 1.5 x alone beside kernels
no longer than the broker's in-flight bound (--inflight-us), and <= alone +
one hardware quantum (--quantum-ms) beside longer ones; the batch job keeps
>= 80% beside high; 70/30 within 2 pp; a pair keeps the GPU >= 99% as busy as
one job alone. Scenarios that would not end before --deadline-s are SKIPPED.
The broker and every child are stopped at the end, whatever happens.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import (  # noqa: E402
    check,
    clean_env,
    done,
    exit_on_sigterm,
    guarded,
    info,
    read,
    run,
    skip,
    stop,
    tail,
)

ap = argparse.ArgumentParser()
ap.add_argument("--part", required=True, choices=["cuda", "shares", "torch"])
ap.add_argument("--bin", required=True)
ap.add_argument("--shim", required=True)
ap.add_argument("--load")
ap.add_argument("--torch-script")
ap.add_argument("--workdir", required=True)
ap.add_argument("--sock", default="/tmp/gpufrac-suite/broker.sock")
ap.add_argument("--seconds", type=float, default=5.0, help="latency windows (>= 4 s for 200 requests)")
ap.add_argument("--share-seconds", type=float, default=4.0, help="70/30 windows (twice this for 120 ms kernels)")
ap.add_argument("--deadline-s", type=float, default=150.0)
ap.add_argument("--quantum-ms", type=float, default=2.0)
ap.add_argument("--inflight-us", type=float, default=250.0)
args = ap.parse_args()
os.makedirs(args.workdir, exist_ok=True)
T0 = time.monotonic()
CHILDREN = []
BROKER = None
MODES = ["native", "default", "high"]
NEIGHBOURS_US = [50, 6000, 120000]
INTERACTIVE = (10, 50, 20000)  # kernels per request, kernel us, period us
KEPT_TARGET = 0.80
SPLIT_TARGET_PP = 2.0
BUSY_TARGET = 0.99
# Time to start a process and reach the barrier.
INIT_S = {"load": 4.0, "torch": 20.0}


exit_on_sigterm()


def left():
    return args.deadline_s - (time.monotonic() - T0)


def fits(label, need):
    if left() >= need:
        return True
    skip(label, f"time budget: {max(0.0, left()):.0f} s left of this step's {args.deadline_s:.0f} s, "
                f"it needs about {need:.0f} s")
    return False


def kernel_label(us):
    return f"{us / 1000:g} ms" if us >= 1000 else f"{us:g} us"


def env_for(mode, extra=None):
    """The environment of a process in `mode` (native: no shim, no broker)."""
    if mode == "native":
        return clean_env({"PYTHONUNBUFFERED": "1"})
    e = {"GPUFRAC_SOCKET": args.sock, "GPUFRAC_BROKER": "required", "GPUFRAC_LOG": "warn",
         "PYTHONUNBUFFERED": "1"}
    if mode == "high":
        e["GPU_COMPUTE_PRIORITY"] = "high"
    e.update(extra or {})
    return clean_env(e, shim=args.shim)


def fields(out):
    """The key=value pairs of the RESULT line of `out`, numbers as floats."""
    for line in out.splitlines():
        if line.startswith("RESULT "):
            kv = {}
            for item in line.split()[1:]:
                if "=" in item:
                    k, v = item.split("=", 1)
                    try:
                        kv[k] = float(v)
                    except ValueError:
                        kv[k] = v
            return kv
    return None


class ScenarioError(Exception):
    pass


def scenario(label, procs, seconds, init_s):
    """Starts procs [(tag, argv, env)] behind a barrier, opens a common window
    of `seconds`, and returns {tag: RESULT fields}."""
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:60]
    sync = tempfile.mkdtemp(dir=args.workdir, prefix=f"{slug}-")
    running = []
    try:
        for tag, argv, env in procs:
            out = open(os.path.join(sync, f"{tag}.out"), "w")
            err = open(os.path.join(sync, f"{tag}.err"), "w")
            p = subprocess.Popen(argv + ["--sync", sync, "--tag", tag], env=env, stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL)
            out.close()
            err.close()
            CHILDREN.append(p)
            running.append((tag, p))

        def logs(tag):
            return (f"{tag}: {tail(read(os.path.join(sync, f'{tag}.out')), 2)} "
                    f"{tail(read(os.path.join(sync, f'{tag}.err')), 4)}")

        t_wait = time.monotonic()
        give_up = t_wait + max(60.0, 6 * init_s)
        while not all(os.path.exists(os.path.join(sync, f"{t}.ready")) for t, _ in running):
            dead = [(t, p) for t, p in running if p.poll() is not None]
            if dead:
                raise ScenarioError(f"{label}: exited before the window: "
                                    + "; ".join(f"rc={p.returncode} {logs(t)}" for t, p in dead))
            if time.monotonic() > give_up:
                raise ScenarioError(f"{label}: not ready after {time.monotonic() - t_wait:.0f} s: "
                                    + "; ".join(logs(t) for t, _ in running))
            time.sleep(0.02)
        start = time.monotonic_ns() + 300_000_000
        end = start + int(seconds * 1e9)
        tmp = os.path.join(sync, "go.tmp")
        with open(tmp, "w") as f:
            f.write(f"{start} {end}\n")
        os.replace(tmp, os.path.join(sync, "go"))
        results = {}
        for tag, p in running:
            try:
                # A 120 ms kernel or a matmul shared with a neighbour may end
                # after the window; nothing legitimate takes a minute.
                p.wait(timeout=max(0.0, (end - time.monotonic_ns()) / 1e9) + 60)
            except subprocess.TimeoutExpired:
                stop(p)
                raise ScenarioError(f"{label}: {tag} did not finish within 60 s of the window's end: {logs(tag)}")
            r = fields(read(os.path.join(sync, f"{tag}.out")))
            if p.returncode != 0 or r is None:
                raise ScenarioError(f"{label}: {tag} rc={p.returncode} {logs(tag)}")
            results[tag] = r
        late = [f"{t} {r['late_us'] / 1000:.0f} ms" for t, r in results.items() if r.get("late_us", 0) > 100_000]
        if late:
            info(f"{label}: late for the window", ", ".join(late))
        print(f"--- {label}: " + "; ".join(f"{t}: {r}" for t, r in results.items()), flush=True)
        return results
    finally:
        for _, p in running:
            stop(p)


def attempt(label, *a):
    """scenario(label, ...), or None after a FAIL line saying why."""
    try:
        return scenario(label, *a)
    except ScenarioError as e:
        check(label, False, str(e)[:900])
        return None


def start_broker():
    global BROKER
    try:
        os.unlink(args.sock)
    except FileNotFoundError:
        pass
    log = os.path.join(args.workdir, "broker.log")
    with open(log, "a") as f:
        BROKER = subprocess.Popen([args.bin, "broker", "--socket", args.sock],
                                  env=clean_env({"RUST_LOG": "info", "NO_COLOR": "1"}), stdout=f, stderr=f,
                                  stdin=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline and BROKER.poll() is None and not os.path.exists(args.sock):
        time.sleep(0.05)
    ok = BROKER.poll() is None and os.path.exists(args.sock)
    rc, out, err = run([args.bin, "status"], env=clean_env({"GPUFRAC_SOCKET": args.sock}), timeout=10) \
        if ok else (None, "", "")
    check(f"latency[{args.part}]: broker starts and answers `gpufrac status`", ok and rc == 0,
          f"pid={BROKER.pid} socket={args.sock}: {tail(out, 3)}" if ok and rc == 0
          else f"rc={rc} {tail(err, 2)}; broker log: {tail(read(log), 6)[:600]}")
    return ok and rc == 0


# ---------------------------------------------------------------- judging

def judge_latency(name, alone, res, short, kept, kept_what):
    """alone: the interactive process's RESULT alone; res: {mode: {"inter", "batch"}}."""
    ap99 = alone["p99_us"]
    rows = [f"alone: p50 {alone['p50_us']:.0f} us, p99 {ap99:.0f} us, max {alone['max_us']:.0f} us, "
            f"{alone['requests']:.0f} requests"]
    for mode in MODES:
        if mode in res:
            i = res[mode]["inter"]
            rows.append(f"{mode}: p50 {i['p50_us']:.0f} us, p99 {i['p99_us']:.0f} us ({i['p99_us'] / ap99:.2f}x alone), "
                        f"max {i['max_us']:.0f} us, missed {i['missed']:.0f}/{i['requests']:.0f}, "
                        f"neighbour kept {kept(res[mode]) * 100:.1f}% {kept_what}")
    info(f"{name}: latency", "; ".join(rows))
    if "native" in res and "default" in res:
        n, d = res["native"]["inter"]["p99_us"], res["default"]["inter"]["p99_us"]
        check(f"{name}: default p99 <= native p99", d <= n,
              f"default {d:.0f} us, native {n:.0f} us ({d / n:.2f}x)")
    else:
        skip(f"{name}: default p99 <= native p99", "a scenario did not run")
    if "high" not in res:
        skip(f"{name}: high p99 and the neighbour's share", "the scenario did not run")
        return
    h = res["high"]["inter"]["p99_us"]
    if short:
        target, what = 1.5 * ap99, "1.5x alone"
    else:
        target, what = ap99 + args.quantum_ms * 1000, f"alone + one quantum ({args.quantum_ms:g} ms)"
    check(f"{name}: high p99 <= {what}", h <= target,
          f"high {h:.0f} us, alone {ap99:.0f} us, target {target:.0f} us ({h / ap99:.2f}x alone"
          + (f", native {res['native']['inter']['p99_us']:.0f} us)" if "native" in res else ")"))
    k = kept(res["high"])
    check(f"{name}: the neighbour keeps >= {KEPT_TARGET * 100:.0f}% beside high", k >= KEPT_TARGET,
          f"{k * 100:.1f}% {kept_what}")


def judge_shares(name, a, b, pair, alone, unit):
    """a, b: work of the 70% and the 30% job; pair, alone: work per second."""
    first = a / (a + b) if a + b > 0 else 0.0
    err = abs(first - 0.70) * 100
    check(f"{name}: 70/30 split within {SPLIT_TARGET_PP:g} pp", err <= SPLIT_TARGET_PP,
          f"70% job {first * 100:.2f}%, 30% job {(1 - first) * 100:.2f}% of the pair's work, error {err:.2f} pp")
    ratio = pair / alone if alone > 0 else 0.0
    check(f"{name}: the pair keeps the GPU >= {BUSY_TARGET * 100:.0f}% as busy as one job alone",
          ratio >= BUSY_TARGET, f"pair {pair:.4g} {unit}, one alone {alone:.4g} {unit}, {ratio * 100:.2f}%")


# ---------------------------------------------------------------- gpu/load.cu

def calibrate():
    rc, out, err = run([args.load, "calibrate"], env=env_for("native"), timeout=120)
    r = fields(out)
    if rc != 0 or not r or not r.get("cycles_per_us"):
        check("load.cu calibrates", False, f"rc={rc} {tail(out, 2)} {tail(err, 4)}")
        return None
    errs = {k: abs(r[f"k{k}_us"] / k - 1) for k in NEIGHBOURS_US}
    # Within 5%, or 5 us for short kernels (launch and event overhead).
    ok = all(abs(r[f"k{k}_us"] - k) <= max(0.05 * k, 5.0) for k in NEIGHBOURS_US)
    check("load.cu calibrates: kernels alone last what they were asked (5%, or 5 us)", ok,
          f"{r['cycles_per_us']:.1f} cycles/us on {r['grid']:.0f} blocks x {r['block']:.0f} threads; "
          + ", ".join(f"{kernel_label(k)} -> {r[f'k{k}_us']:.1f} us ({errs[k] * 100:.1f}%)" for k in NEIGHBOURS_US))
    return r["cycles_per_us"]


def load_argv(rate, *a):
    return [args.load, *map(str, a), "--cycles-per-us", f"{rate:.4f}"]


def part_cuda():
    rate = calibrate()
    if rate is None:
        return
    inter = load_argv(rate, "interactive", *INTERACTIVE)
    need = INIT_S["load"] + args.seconds + 3
    if not fits("latency[load.cu]: interactive alone", need):
        return
    a = attempt("latency[load.cu]: interactive alone", [("inter", inter, env_for("native"))], args.seconds,
                INIT_S["load"])
    if a is None:
        return
    alone = a["inter"]
    for i, n in enumerate(NEIGHBOURS_US):
        name = f"latency[load.cu beside {kernel_label(n)} kernels]"
        res = {}
        # The settings take turns going first.
        for mode in MODES[i % 3:] + MODES[:i % 3]:
            label = f"{name}, {mode}"
            if not fits(label, need):
                continue
            inter_env = env_for(mode)
            batch_env = env_for("default" if mode == "high" else mode)
            r = attempt(label, [("batch", load_argv(rate, "batch", n), batch_env), ("inter", inter, inter_env)],
                        args.seconds, INIT_S["load"])
            if r:
                res[mode] = r
        judge_latency(name, alone, res, n <= args.inflight_us, lambda r: r["batch"]["busy"], "of the window")


def part_shares():
    rate = calibrate()
    if rate is None:
        return
    for i, k in enumerate(NEIGHBOURS_US):
        name = f"shares[load.cu, {kernel_label(k)} kernels]"
        # One 120 ms kernel is a large part of a short window.
        secs = args.share_seconds * (2 if k > 20000 else 1)
        if not fits(name, 2 * (INIT_S["load"] + secs + 3)):
            continue
        batch = load_argv(rate, "batch", k)
        got = {}
        for what in (["alone", "pair"] if i % 2 == 0 else ["pair", "alone"]):
            if what == "alone":
                r = attempt(f"{name}: one job alone", [("solo", batch, env_for("native"))], secs, INIT_S["load"])
                if r:
                    got["alone"] = r["solo"]["busy"]
            else:
                r = attempt(f"{name}: 70/30 pair", [
                    ("p70", batch, env_for("default", {"GPU_COMPUTE_SHARE": "70%"})),
                    ("p30", batch, env_for("default", {"GPU_COMPUTE_SHARE": "30%"}))], secs, INIT_S["load"])
                if r:
                    got["pair"] = (r["p70"]["work_us"], r["p30"]["work_us"], r["p70"]["busy"] + r["p30"]["busy"])
        if "pair" in got and "alone" in got:
            a, b, busy = got["pair"]
            judge_shares(name, a, b, busy, got["alone"], "of the window busy")


# ---------------------------------------------------------------- PyTorch

def part_torch():
    ts = [sys.executable, args.torch_script]
    infer, train = ts + ["infer"], ts + ["train"]
    need = INIT_S["torch"] + args.seconds + 3
    name = "latency[PyTorch inference beside training]"
    if not fits(f"{name}: inference alone", 2 * need):
        return
    ia = attempt(f"{name}: inference alone", [("inter", infer, env_for("native"))], args.seconds, INIT_S["torch"])
    ta = attempt(f"{name}: training alone", [("batch", train, env_for("native"))], args.seconds, INIT_S["torch"])
    if ia is None or ta is None:
        return
    train_rate = ta["batch"]["rate"]
    matmul_us = 1e6 / train_rate if train_rate > 0 else float("inf")
    info(f"{name}: alone", f"inference p50 {ia['inter']['p50_us']:.0f} us, p99 {ia['inter']['p99_us']:.0f} us; "
                           f"training {train_rate:.1f} matmuls/s ({matmul_us:.0f} us each)")
    res = {}
    for mode in MODES:
        label = f"{name}, {mode}"
        if not fits(label, need):
            continue
        r = attempt(label, [("batch", train, env_for("default" if mode == "high" else mode)),
                            ("inter", infer, env_for(mode))], args.seconds, INIT_S["torch"])
        if r:
            res[mode] = r
    judge_latency(name, ia["inter"], res, matmul_us <= args.inflight_us,
                  lambda r: r["batch"]["rate"] / train_rate, "of its throughput alone")
    sname = "shares[PyTorch training]"
    if not fits(sname, need):
        return
    r = attempt(f"{sname}: 70/30 pair", [
        ("p70", train, env_for("default", {"GPU_COMPUTE_SHARE": "70%"})),
        ("p30", train, env_for("default", {"GPU_COMPUTE_SHARE": "30%"}))], args.seconds, INIT_S["torch"])
    if r:
        judge_shares(sname, r["p70"]["work"], r["p30"]["work"], r["p70"]["rate"] + r["p30"]["rate"], train_rate,
                     "matmuls/s")


def main():
    tool = args.load if args.part in ("cuda", "shares") else args.torch_script
    if not tool or not os.path.exists(tool):
        skip(f"latency[{args.part}]", f"missing {tool or 'load generator'}")
        return
    if not start_broker():
        skip(f"latency[{args.part}] scenarios", "no broker: nothing to compare")
        return
    {"cuda": part_cuda, "shares": part_shares, "torch": part_torch}[args.part]()
    alive = BROKER.poll() is None
    check(f"latency[{args.part}]: broker still running after all the runs", alive,
          f"pid={BROKER.pid}" if alive else
          f"exit status {BROKER.returncode}; log: {tail(read(os.path.join(args.workdir, 'broker.log')), 4)}")


try:
    guarded(f"latency[{args.part}]", main)
finally:
    for p in CHILDREN:
        stop(p)
    stop(BROKER)
    try:
        os.unlink(args.sock)
    except OSError:
        pass
    log = read(os.path.join(args.workdir, "broker.log"))
    if log.strip():
        print("--- broker log (last lines) ---")
        print("\n".join(log.strip().splitlines()[-25:]))
    print(f"--- latency[{args.part}] took {time.monotonic() - T0:.0f} s", flush=True)
done()
