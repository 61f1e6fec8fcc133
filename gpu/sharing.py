"""Section 4: compute sharing through the broker, on a real GPU.

    python3 gpu/sharing.py --bin target/release/gpufrac --shim target/release/libgpufrac.so \
        --script gpu/matmul_loop.py --workdir DIR [--sock /tmp/gpufrac-suite/broker.sock] \
        [--seconds 8] [--empty-kernel PATH]

1. one matmul_loop process alone, natively (no shim, no broker);
2. starts `gpufrac broker --socket SOCK` (falls back to GPUFRAC_SOCKET=SOCK if
   the flag is refused) and asks `gpufrac status`;
3. one process alone under the shim with the broker: it must pay nothing
   (uncontended = open-ended grant), also launch-bound with empty_kernel;
4. two processes GPU_COMPUTE_SHARE=50/50, then 70/30, then three 25/25/50,
   started together behind a barrier: each one's throughput, its fraction of
   the total against the target fraction (pass: within 0.10), and the total
   against the lone shimmed process (pass: >= 85%).
The broker and every child are stopped at the end, whatever happens.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import (  # noqa: E402
    MiB,
    cap_bytes,
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
ap.add_argument("--bin", required=True)
ap.add_argument("--shim", required=True)
ap.add_argument("--script", required=True)
ap.add_argument("--workdir", required=True)
ap.add_argument("--sock", default="/tmp/gpufrac-suite/broker.sock")
ap.add_argument("--seconds", type=float, default=8.0)
ap.add_argument("--size", type=int, default=8192)
ap.add_argument("--empty-kernel")
args = ap.parse_args()
limit = os.environ.get("SUITE_CAP", f"{cap_bytes() // MiB}M")
os.makedirs(args.workdir, exist_ok=True)
CHILDREN = []
BROKER = None


exit_on_sigterm()


def shim_env(share=None):
    extra = {"GPU_MEM_LIMIT": limit, "GPUFRAC_SOCKET": args.sock, "GPUFRAC_LOG": "info",
             "PYTHONUNBUFFERED": "1"}
    if share is not None:
        extra["GPU_COMPUTE_SHARE"] = str(share)
    return clean_env(extra, shim=args.shim)


def status(label):
    rc, out, err = run([args.bin, "status"], env=clean_env({"GPUFRAC_SOCKET": args.sock}), timeout=10)
    print(f"--- gpufrac status ({label}), rc={rc} ---")
    print(out.rstrip())
    if err.strip():
        print(err.rstrip())
    return rc, out, err


def run_group(label, shares, shim):
    """Runs len(shares) matmul loops together; returns (ips list with None for failures, errors)."""
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    bdir = tempfile.mkdtemp(dir=args.workdir, prefix=f"barrier-{slug}-")
    procs = []
    for i, share in enumerate(shares):
        tag = f"p{i + 1}"
        env = shim_env(share) if shim else clean_env({"PYTHONUNBUFFERED": "1"})
        out = open(os.path.join(args.workdir, f"{slug}-{tag}.out"), "w")
        err = open(os.path.join(args.workdir, f"{slug}-{tag}.err"), "w")
        p = subprocess.Popen([sys.executable, args.script, "--seconds", str(args.seconds), "--size", str(args.size),
                              "--barrier", bdir, "--nproc", str(len(shares)), "--tag", tag],
                             env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        out.close()
        err.close()
        CHILDREN.append(p)
        procs.append((tag, p))
    if shim and len(shares) > 1:
        # ask the broker what it sees in the middle of the measured window
        deadline = time.time() + 90
        while time.time() < deadline and sum(f.endswith(".ready") for f in os.listdir(bdir)) < len(shares):
            if any(p.poll() is not None for _, p in procs):
                break
            time.sleep(0.05)
        time.sleep(args.seconds / 2)
        status(f"during {label}")
    ips, errors = [], []
    for tag, p in procs:
        try:
            p.wait(timeout=args.seconds + 150)
        except subprocess.TimeoutExpired:
            stop(p)
        out = read(os.path.join(args.workdir, f"{slug}-{tag}.out"))
        err = read(os.path.join(args.workdir, f"{slug}-{tag}.err"))
        m = re.search(r"\bips=([0-9.]+)", out)
        if p.returncode == 0 and m:
            ips.append(float(m.group(1)))
        else:
            ips.append(None)
            errors.append(f"{tag}: rc={p.returncode} {tail(out, 2)} {tail(err, 4)}")
        gp = [l for l in err.splitlines() if l.startswith("gpufrac:")]
        if gp:
            print(f"--- {label} {tag} shim log (first/last lines) ---")
            print("\n".join(gp if len(gp) <= 10 else gp[:5] + ["..."] + gp[-5:]))
    info(f"sharing[{label}] throughput", " ".join(
        f"{t}{'' if s is None else f'(share {s})'}={'FAILED' if v is None else f'{v:.1f} it/s'}"
        for (t, _), s, v in zip(procs, shares, ips)))
    return ips, errors


def start_broker():
    global BROKER
    try:
        os.unlink(args.sock)
    except FileNotFoundError:
        pass
    log = os.path.join(args.workdir, "broker.log")
    attempts = [([args.bin, "broker", "--socket", args.sock], {}),
                ([args.bin, "broker"], {"GPUFRAC_SOCKET": args.sock})]
    for cmd, extra in attempts:
        with open(log, "a") as f:
            f.write(f"### {' '.join(cmd)} {extra}\n")
            f.flush()
            BROKER = subprocess.Popen(cmd, env=clean_env({"GPUFRAC_LOG": "info", "RUST_LOG": "info", "NO_COLOR": "1",
                                                          **extra}), stdout=f, stderr=f,
                                      stdin=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline and BROKER.poll() is None and not os.path.exists(args.sock):
            time.sleep(0.05)
        if BROKER.poll() is None and os.path.exists(args.sock):
            check("sharing: broker starts and listens", True,
                  f"{' '.join(cmd)} {extra or ''} pid={BROKER.pid} socket={args.sock}")
            return True
        stop(BROKER)
        BROKER = None
    check("sharing: broker starts and listens", False,
          f"no socket at {args.sock} within 10 s; broker log: {tail(read(log), 6)[:600]}")
    return False


def launches_with_broker():
    """Empty-kernel launch cost: native vs shim holding an uncontended grant."""
    vals = {"native": [], "shim": []}
    errs = []
    for i in range(3):
        for mode in (("native", "shim") if i % 2 == 0 else ("shim", "native")):
            env = clean_env() if mode == "native" else shim_env()
            rc, out, err = run([args.empty_kernel, "100000"], env=env, timeout=60)
            m = re.search(r"ns_per_launch=([0-9.]+)", out)
            if rc == 0 and m:
                vals[mode].append(float(m.group(1)))
            else:
                errs.append(f"{mode}: rc={rc} {tail(err, 3)}")
    if not vals["native"] or not vals["shim"]:
        check("sharing: lone process with the broker, launch-bound: runs complete", False, "; ".join(errs)[:600])
        return
    n, s = statistics.median(vals["native"]), statistics.median(vals["shim"])
    check("sharing: lone process with the broker pays nothing per launch (<= max(50 ns, 5%))",
          s - n <= max(50.0, 0.05 * n),
          f"median native={n:.1f} ns shim+broker={s:.1f} ns diff={s - n:+.1f} ns ({100 * (s - n) / n:+.2f}%)"
          + (f"; errors: {'; '.join(errs)[:300]}" if errs else ""))


def group_check(label, shares, solo):
    ips, errors = run_group(label, shares, shim=True)
    if None in ips:
        check(f"sharing[{label}]: all processes completed", False, "; ".join(errors)[:700])
        return
    total = sum(ips)
    targets = [s / sum(shares) for s in shares]
    got = [v / total for v in ips]
    worst = max(abs(g - t) for g, t in zip(got, targets))
    detail = ", ".join(f"p{i + 1} share {s}%: {v:.1f} it/s = {g:.3f} of total (target {t:.3f})"
                       for i, (s, v, g, t) in enumerate(zip(shares, ips, got, targets)))
    check(f"sharing[{label}]: each process's fraction of the throughput is within 0.10 of its share",
          worst <= 0.10, f"{detail}; worst deviation {worst:.3f}")
    if solo:
        check(f"sharing[{label}]: aggregate throughput >= 85% of one process alone", total >= 0.85 * solo,
              f"aggregate={total:.1f} it/s solo(shim+broker)={solo:.1f} it/s = {100 * total / solo:.1f}%")


def main():
    native, errs = run_group("solo native", [None], shim=False)
    solo_native = native[0]
    check("sharing: one process alone, native (no shim)", solo_native is not None,
          f"{solo_native:.1f} it/s" if solo_native else "; ".join(errs)[:600])
    have_broker = start_broker()
    if have_broker:
        rc, out, err = status("idle")
        check("sharing: `gpufrac status` answers", rc == 0, f"rc={rc} {tail(out, 3)} {tail(err, 2)}"[:500])
    else:
        info("sharing: no broker", "the runs below are unarbitrated (GPUFRAC_BROKER=optional): "
             "they show what the GPU does without gpufrac, not what gpufrac does")
    shim, errs = run_group("solo shim+broker", [None], shim=True)
    solo_shim = shim[0]
    if solo_shim is None:
        check("sharing: one process alone under the shim", False, "; ".join(errs)[:600])
    elif solo_native:
        pct = 100.0 * (solo_native - solo_shim) / solo_native
        check("sharing: one process alone under the shim (+broker) runs at native speed (<= 5% slower)",
              pct <= 5.0, f"native={solo_native:.1f} it/s shim={solo_shim:.1f} it/s slowdown={pct:+.2f}%")
    if args.empty_kernel and os.access(args.empty_kernel, os.X_OK):
        guarded("sharing: launch-bound with the broker", launches_with_broker)
    else:
        skip("sharing: lone process with the broker, launch-bound", "no empty_kernel binary")
    reference = solo_shim or solo_native
    guarded("sharing[50/50]", group_check, "50/50", [50, 50], reference)
    guarded("sharing[70/30]", group_check, "70/30", [70, 30], reference)
    guarded("sharing[25/25/50]", group_check, "25/25/50", [25, 25, 50], reference)
    if have_broker:
        alive = BROKER.poll() is None
        check("sharing: broker still running after all the runs", alive,
              f"exit status {BROKER.returncode}; log: {tail(read(os.path.join(args.workdir, 'broker.log')), 4)}"
              if not alive else f"pid={BROKER.pid}")


try:
    guarded("sharing", main)
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
done()
