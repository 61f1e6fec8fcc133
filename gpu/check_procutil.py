"""NVML's per-process utilisation, as the broker reads it for its evidence
of work, against loads of a known duty.

    python3 gpu/check_procutil.py --load /path/to/load        # gpu/load.cu
    python3 gpu/check_procutil.py --loadgen target/release/examples/loadgen

The broker polls nvmlDeviceGetProcessUtilization every 500 ms, handing
back the newest timestamp it got as `lastSeenTimeStamp`, and takes the
mean of a process's samples since (SM or memory, the higher) as how busy
it kept the GPU; a holder whose process was busy at least a quarter of the
time it held, over the last second, is granted back at a recall while
`low` waits (docs/broker.md, "Compute arbitration"). Two things about
that are only known from a real driver, and this measures both:

- whether a busy process is reported in every poll (a miss of two polls
  in a row would defer a busy holder behind `low`): a check;
- how a process's samples relate to the share of time it ran (one per
  driver sample period? one per poll? what smUtil says of a 2% duty):
  whether the mean of a process's samples is its duty, as the broker
  reads it. Reported as INFO lines for the dated report.

Run it with nothing else on the GPU; it never changes the GPU's settings.
On the simulated driver (`--loadgen`) it runs too, as a check of the
script: that driver reports one sample per process per poll, its smUtil the
kernel time the process ran over the time since `lastSeenTimeStamp`.
"""

import argparse
import ctypes
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suitelib import check, done, exit_on_sigterm, guarded, info, skip, stop  # noqa: E402

POLL_S = 0.5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7


class Sample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


class Nvml:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        init = getattr(self.lib, "nvmlInit_v2", None) or self.lib.nvmlInit
        rc = init()
        if rc != 0:
            raise RuntimeError(f"nvmlInit: {rc}")
        self.dev = ctypes.c_void_p()
        rc = self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.dev))
        if rc != 0:
            raise RuntimeError(f"nvmlDeviceGetHandleByIndex_v2(0): {rc}")

    def process_samples(self, last_seen):
        """(rc, samples) since `last_seen`, asked for as the broker does:
        the count first, then a buffer of that size."""
        count = ctypes.c_uint(0)
        rc = self.lib.nvmlDeviceGetProcessUtilization(self.dev, None, ctypes.byref(count),
                                                      ctypes.c_ulonglong(last_seen))
        if rc == NVML_ERROR_NOT_FOUND:
            return rc, []
        if rc not in (0, NVML_ERROR_INSUFFICIENT_SIZE):
            return rc, []
        n = max(count.value, 1)
        buf = (Sample * n)()
        count = ctypes.c_uint(n)
        rc = self.lib.nvmlDeviceGetProcessUtilization(self.dev, buf, ctypes.byref(count),
                                                      ctypes.c_ulonglong(last_seen))
        if rc == NVML_ERROR_NOT_FOUND:
            return rc, []
        return rc, list(buf[:count.value]) if rc == 0 else []

    def shutdown(self):
        self.lib.nvmlShutdown()


def load_argv(args, kind, seconds):
    """The load's command line: `busy` keeps kernels queued, ("duty", K, P)
    runs one kernel of K us every P us."""
    if args.load:
        if kind == "busy":
            return [args.load, "batch", "5000", "--seconds", str(seconds)]
        _, k, p = kind
        return [args.load, "interactive", "1", str(k), str(p), "--seconds", str(seconds)]
    if kind == "busy":
        return [args.loadgen, "batch", "5000", "+0", f"+{seconds}"]
    _, k, p = kind
    return [args.loadgen, "interactive", "1", str(k), str(p), "+0", f"+{seconds}"]


def measure(nvml, args, kind, seconds):
    """Starts the load and polls as the broker does for `seconds`; a row per
    poll: (span_s, [(timestamp_us, smUtil, memUtil)] of the load's pid)."""
    p = subprocess.Popen(load_argv(args, kind, seconds), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    rows, errors = [], set()
    try:
        # The buffer of what ran before this load started is skipped.
        rc, first = nvml.process_samples(0)
        last_seen = max((s.timeStamp for s in first), default=0)
        t0 = prev = time.monotonic()
        while time.monotonic() - t0 < seconds and p.poll() is None:
            time.sleep(POLL_S)
            rc, ss = nvml.process_samples(last_seen)
            now = time.monotonic()
            if rc not in (0, NVML_ERROR_NOT_FOUND):
                errors.add(rc)
            last_seen = max([last_seen] + [s.timeStamp for s in ss])
            rows.append((now - prev, [(s.timeStamp, s.smUtil, s.memUtil) for s in ss if s.pid == p.pid]))
            prev = now
        # Its last line says what it did; it ends with its window.
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        stop(p)
    out, err = p.communicate()
    return rows, errors, (out.strip().splitlines() or [""])[-1], err


def describe(rows):
    """Figures of one load's polls, and the estimates of its duty."""
    seen = [bool(r[1]) for r in rows]
    # Steady state: the first poll overlaps the load's start-up.
    body = rows[1:] if len(rows) > 2 else rows
    per_poll = [len(r[1]) for r in body]
    sm = [u for r in body for (_, u, _) in r[1]]
    gaps = []
    for r in body:
        ts = sorted(t for (t, _, _) in r[1])
        gaps += [(b - a) / 1000.0 for a, b in zip(ts, ts[1:])]
    est_max = [max((u for (_, u, _) in r[1]), default=0) for r in body]
    est_mean = [sum(u for (_, u, _) in r[1]) / len(r[1]) if r[1] else 0 for r in body]
    # smUtil of each sample times the span since the one before it (the
    # poll's start for the first), over the poll's span: the share of the
    # poll it ran, if a sample covers the span back to its predecessor.
    est_sum = []
    for span, ss in body:
        ts = sorted(ss)
        covered, t_prev = 0.0, None
        for (t, u, _) in ts:
            width = (t - t_prev) / 1e6 if t_prev is not None else span / max(len(ts), 1)
            covered += u / 100.0 * min(width, span)
            t_prev = t
        est_sum.append(100.0 * covered / span if span > 0 else 0)

    def fmt(xs):
        if not xs:
            return "-"
        return f"{min(xs):.0f}/{sum(xs) / len(xs):.1f}/{max(xs):.0f}"
    figures = (f"polls={len(rows)} seen={sum(seen)} samples_per_poll={fmt(per_poll)} "
               f"smUtil(min/mean/max)={fmt(sm)} gap_ms={fmt(gaps)} "
               f"duty_by_max={fmt(est_max)} duty_by_mean={fmt(est_mean)} duty_by_span={fmt(est_sum)}")
    return seen, figures


def misses_in_a_row(seen):
    """The longest run of polls that did not see the load between the
    first and the last that did (before: it was starting; after: ending)."""
    if True not in seen:
        return len(seen)
    first, last = seen.index(True), len(seen) - 1 - seen[::-1].index(True)
    worst = run = 0
    for s in seen[first:last + 1]:
        run = 0 if s else run + 1
        worst = max(worst, run)
    return worst


def main():
    exit_on_sigterm()
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--load", help="gpu/load.cu built")
    g.add_argument("--loadgen", help="examples/loadgen (the simulated driver)")
    ap.add_argument("--seconds", type=int, default=4)
    args = ap.parse_args()
    try:
        nvml = Nvml()
    except (OSError, RuntimeError) as e:
        skip("procutil: NVML per-process utilisation", f"no NVML here ({e})")
        done()
        return
    loads = [("busy", "busy (kernels always queued)"),
             (("duty", 10000, 100000), "10 ms of kernels every 100 ms (10%)"),
             (("duty", 2000, 100000), "2 ms of kernels every 100 ms (2%)"),
             (("duty", 20000, 1000000), "20 ms of kernels every second (2%)")]
    try:
        for kind, what in loads:
            def one(kind=kind, what=what):
                rows, errors, last, err = measure(nvml, args, kind, args.seconds)
                if errors:
                    check(f"procutil: {what}: nvmlDeviceGetProcessUtilization", False,
                          f"returned {sorted(errors)}")
                    return
                if not rows:
                    check(f"procutil: {what}: polled", False, f"the load ended at once: {last} {err[-300:]}")
                    return
                seen, figures = describe(rows)
                info(f"procutil: {what}", f"{figures} load: {last}")
                if kind == "busy":
                    worst = misses_in_a_row(seen)
                    check("procutil: a busy process is seen within a second of polls (the broker's evidence)",
                          worst < 2, f"longest run of polls without it: {worst} of {len(rows)} ({figures})")
            guarded(f"procutil: {what}", one)
    finally:
        nvml.shutdown()
    done()


if __name__ == "__main__":
    main()
