"""Helpers shared by the gpu/ check scripts.

Every check prints one line that run_suite.sh turns into the report:

    PASS <name> :: <measured figures>
    FAIL <name> :: <measured figures / error>
    SKIP <name> :: <reason>
    INFO <name> :: <figures worth keeping>

and a script that ran to its end prints DONE, so a crash or a hang is
reported as such rather than as a silent lack of results.
"""

import os
import re
import signal
import subprocess
import sys
import traceback

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def emit(kind, name, detail=""):
    detail = " ".join(str(detail).split())  # one line
    print(f"{kind} {name} :: {detail}", flush=True)


def check(name, ok, detail=""):
    emit("PASS" if ok else "FAIL", name, detail)
    return bool(ok)


def skip(name, reason):
    emit("SKIP", name, reason)


def info(name, detail):
    emit("INFO", name, detail)


def done():
    print("DONE", flush=True)


def cap_bytes():
    """The cap the suite runs checks under (run_suite.sh exports it)."""
    return int(os.environ.get("SUITE_CAP_BYTES", str(4 * GiB)))


def gib(n):
    return f"{n / GiB:.3f} GiB"


def first_line(e):
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"


def guarded(name, fn, *args, **kwargs):
    """Runs one check; an unexpected exception is a FAIL of that check only."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report, never abort the script
        emit("FAIL", name, f"unexpected {first_line(e)}")
        traceback.print_exc(file=sys.stderr)
        return None


def clean_env(extra=None, shim=None):
    """A copy of os.environ without anything gpufrac reads, plus `extra`.

    With `shim`, LD_PRELOAD is set to it (replacing any inherited value)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("GPU_MEM_LIMIT") or k.startswith("GPU_COMPUTE_")
                or k.startswith("GPUFRAC_") or k == "LD_PRELOAD")
    }
    if shim:
        env["LD_PRELOAD"] = shim
    env.update(extra or {})
    return env


def run(cmd, env=None, timeout=60):
    """subprocess.run capturing text output; a timeout becomes rc 124."""
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return 124, out, err + f"\n[timed out after {timeout}s]"


def tail(text, n=6):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])


def exit_on_sigterm():
    """A runner's timeout sends SIGTERM: exit through `finally` blocks, so
    children and brokers are stopped."""

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def read(path):
    """The file's text without ANSI colour codes ("" if unreadable)."""
    try:
        with open(path, errors="replace") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    except OSError:
        return ""


def stop(p, grace=5.0):
    """Terminates a child, then kills it if it does not go within `grace`."""
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=grace)
