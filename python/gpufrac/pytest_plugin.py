"""pytest plugin: a GPU memory budget for a test run, shared among
pytest-xdist workers test by test, and the peak GPU memory of every test.

    pytest -n 4 --gpufrac-memory 8G            # each test reserves its budget
    pytest -n 4 --gpufrac-memory 8G --gpufrac-learn   # ... and learns it
    pytest -n 4 --gpufrac-memory 8G --gpufrac-split worker   # 2 GiB per worker
    pytest -n 4 --gpufrac-memory 8G --gpufrac-split shared   # one 8 GiB pool
    pytest --gpufrac-report --gpufrac-report-json gpu-mem.json
    pytest -n 4 --gpufrac-memory 8G --gpufrac-report-md gpu-mem.md   # CI step summary

Under ``--gpufrac-split test`` (the default) every test has a budget: its
``@pytest.mark.gpu_memory("5G")`` (function, class or module), else the
figure ``--gpufrac-learn`` measured in an earlier run (pytest's cache), else
``--gpufrac-default-memory``, else the whole run's budget. Before its setup
the worker reserves that budget in the run's books (a file under the run's
temporary directory, locked with fcntl) and waits, in arrival order across
workers, until the reservations in force leave room for it; the test then
runs with the worker's own cap narrowed to its reservation plus what the
worker already held (``gpufrac_mem_limit_set``), and the reservation is
released after its teardown. A test refused under its learned figure (it
grew) runs again at once, alone, with the whole budget, and what it needs
then is what is reported and learned. Entries are keyed by the worker's pid and
start time: those of a worker that died are dropped by the next worker
that reads the books.

How it works: the session starts itself again as one ``gpufrac run`` job
(``gpufrac run --gpu-memory SIZE -- <this pytest command>``), so the whole run
is under the shim with one set of memory books of SIZE, and, when a gpufrac
broker runs on the node, waits in its queue for SIZE like any other job. In
that job the controller sets each xdist worker's ``GPU_MEM_LIMIT`` to SIZE/N
before the workers start: the shim charges every allocation both to the
worker's own cap and to the job's books, so no worker takes more than its
share and the run never more than SIZE. An allocation past a cap fails in
that test only (CUDA_ERROR_OUT_OF_MEMORY; cupy and PyTorch raise their
out-of-memory errors), and the plugin adds to its failure which cap it hit,
in which worker. It knows from the shim's count of refusals
(``gpufrac_mem_refusals``) read around each test, never from the failure's
text.

Per-test peaks come from the shim's query API (``gpufrac_mem_peak_reset``):
what the test's process held at most while the test ran, setup and teardown
included. Caching allocators (cupy's pool, PyTorch's) keep freed blocks, so
a test's peak includes what the pool kept from earlier tests: that is what
counts against the cap.
"""

import contextlib
import fcntl
import gc
import json
import math
import os
import secrets
import shutil
import struct
import sys
import tempfile
import time

import pytest

import gpufrac

# The run's settings, from the first pytest process to the one gpufrac run
# starts and on to its xdist workers (JSON).
SETTINGS = "GPUFRAC_PYTEST"


def pytest_addoption(parser):
    g = parser.getgroup("gpufrac", "GPU memory budget and report (gpufrac)")
    g.addoption(
        "--gpufrac-memory",
        metavar="SIZE",
        help="run the session under a GPU memory budget of SIZE (4G, 512M, 1.5G), "
        "as one gpufrac job that queues for it when a gpufrac broker runs; with "
        "pytest-xdist each of N workers is capped at SIZE/N (see --gpufrac-split)",
    )
    g.addoption(
        "--gpufrac-compute",
        metavar="PCT",
        help="the run's share of GPU time when the GPU is contended (e.g. 30%%); "
        "needs the broker",
    )
    g.addoption(
        "--gpufrac-split",
        choices=("test", "worker", "shared"),
        default="test",
        help="test (default): each test reserves its budget (@pytest.mark.gpu_memory, "
        "learned, --gpufrac-default-memory, else all of SIZE) and waits for room; "
        "worker: each xdist worker gets SIZE/N as its own cap; "
        "shared: the workers draw on one budget of SIZE",
    )
    g.addoption(
        "--gpufrac-default-memory",
        metavar="SIZE",
        help="the budget of a test with neither a gpu_memory mark nor a learned "
        "figure (default: the whole run's budget, so it runs alone); also the "
        "gpufrac_default_memory ini option",
    )
    g.addoption(
        "--gpufrac-learn",
        action="store_true",
        help="record each test's peak, plus 25%% headroom, in pytest's cache as its "
        "budget for later runs (tests without a gpu_memory mark)",
    )
    g.addoption(
        "--gpufrac-keep-pools",
        action="store_true",
        help="leave cupy's and PyTorch's memory pools alone between tests (by "
        "default they are emptied, so that one test's pool is not charged to the next)",
    )
    g.addoption(
        "--gpufrac-timeout",
        metavar="DUR",
        help="give up (exit status 124) after waiting this long in the broker's "
        "queue (e.g. 10m)",
    )
    g.addoption(
        "--gpufrac-report",
        action="store_true",
        help="list the tests with the highest peak GPU memory and each worker's "
        "peak at the end",
    )
    g.addoption(
        "--gpufrac-report-top",
        type=int,
        default=10,
        metavar="N",
        help="how many tests --gpufrac-report lists (default 10; 0: all)",
    )
    g.addoption(
        "--gpufrac-report-md",
        metavar="PATH",
        help="write the report as Markdown to PATH, for a CI step summary "
        "(e.g. $GITHUB_STEP_SUMMARY): tests by peak with their budgets, waits and "
        "refusals, the run's peak, which tests ran together",
    )
    g.addoption(
        "--gpufrac-report-json",
        metavar="PATH",
        help="write every test's peak GPU memory and each worker's peak to PATH "
        "as JSON",
    )
    parser.addini(
        "gpufrac_default_memory",
        "the budget of a test with neither a gpu_memory mark nor a learned figure "
        "(as --gpufrac-default-memory)",
        default=None,
    )


def _opt(config, name):
    return config.getoption(name, default=None)


def _wanted(config):
    """The run's settings from the command line; UsageError on bad input."""
    memory = _opt(config, "gpufrac_memory")
    budget = 0
    if memory is not None:
        try:
            kind, value = gpufrac.parse_budget(memory)
        except ValueError as e:
            raise pytest.UsageError("--gpufrac-memory %s" % e)
        if kind == "bytes" and value == 0:
            raise pytest.UsageError(
                "--gpufrac-memory must be greater than 0; expected %s" % gpufrac.BUDGET_EXAMPLE
            )
        # A percentage is of the GPU gpufrac run places the job on: it
        # resolves it, and the job's cap (GPU_MEM_LIMIT) is the budget.
        budget = value if kind == "bytes" else 0
    default = _opt(config, "gpufrac_default_memory")
    where = "--gpufrac-default-memory"
    if default is None:
        default = config.getini("gpufrac_default_memory") or None
        where = "the gpufrac_default_memory ini option"
    if default is not None:
        try:
            kind, value = gpufrac.parse_budget(default)
        except ValueError as e:
            raise pytest.UsageError("%s %s" % (where, e))
        if kind == "bytes" and value == 0:
            raise pytest.UsageError(
                "%s must be greater than 0; expected %s" % (where, gpufrac.BUDGET_EXAMPLE))
    compute = _opt(config, "gpufrac_compute")
    if compute is not None:
        c = compute.strip().rstrip("%").strip()
        try:
            ok = 0 < float(c) <= 100
        except ValueError:
            ok = False
        if not ok:
            raise pytest.UsageError(
                "--gpufrac-compute %r: expected a percentage such as 30%%, 12.5%% or 100%%"
                % compute
            )
    top = _opt(config, "gpufrac_report_top")
    if top is not None and top < 0:
        raise pytest.UsageError("--gpufrac-report-top %d: expected 0 (all) or more" % top)
    return {
        "memory": memory,
        "budget": budget,
        "compute": compute,
        "split": _opt(config, "gpufrac_split") or "worker",
        "timeout": _opt(config, "gpufrac_timeout"),
        "report": bool(_opt(config, "gpufrac_report") or _opt(config, "gpufrac_report_json")
                       or _opt(config, "gpufrac_report_md")),
        "default": default,
        "learn": bool(_opt(config, "gpufrac_learn")),
        "keep_pools": bool(_opt(config, "gpufrac_keep_pools")),
    }


def _active(w):
    return bool(w["memory"] or w["compute"] or w["report"] or w["learn"])


def _in_job():
    """Already in a gpufrac run job: starting another would ask the broker
    for a second budget while this one holds the first."""
    return bool(os.environ.get("GPUFRAC_JOB_LEDGER") or os.environ.get("GPUFRAC_JOB"))


def _own_command(config):
    """This pytest command, to run again under gpufrac run."""
    args = list(config.invocation_params.args)
    if args == sys.argv[1:]:
        orig = getattr(sys, "orig_argv", None)  # Python >= 3.10
        if orig:
            return [sys.executable] + list(orig[1:])
        if sys.argv[0].endswith("__main__.py"):
            return [sys.executable, "-m", "pytest"] + args
        return [sys.executable, sys.argv[0]] + args
    # pytest.main(args) from another program: run pytest itself with them.
    return [sys.executable, "-m", "pytest"] + args


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if hasattr(config, "workerinput") or os.environ.get(SETTINGS):
        return None
    w = _wanted(config)
    o = config.option
    if not _active(w) or _in_job() or o.help or getattr(o, "version", 0) or o.collectonly:
        return None
    try:
        exe = gpufrac.binary()
    except FileNotFoundError as e:
        raise pytest.UsageError(str(e))
    cmd = [exe, "run"]
    if w["budget"]:
        cmd += ["--gpu-memory", str(w["budget"])]
    elif w["memory"]:
        cmd += ["--gpu-memory", w["memory"].strip()]
    if w["compute"]:
        cmd += ["--gpu-compute", w["compute"]]
    if w["timeout"]:
        cmd += ["--timeout", w["timeout"]]
    cmd += ["--"] + _own_command(config)
    env = dict(os.environ)
    env[SETTINGS] = json.dumps(w)
    socket = os.environ.get("GPUFRAC_SOCKET") or "/run/gpufrac/broker.sock"
    if os.path.exists(socket):
        what = "%s of GPU memory" % (
            gpufrac.format_size(w["budget"]) if w["budget"] else w["memory"].strip()
        ) if w["memory"] else "a GPU"
        sys.stderr.write(
            "gpufrac: this run is a gpufrac job: it waits in the broker's queue at %s for %s "
            "when the GPUs are busy (`gpufrac status` shows the queue)\n" % (socket, what)
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(str(config.invocation_params.dir))
    try:
        os.execve(exe, cmd, env)
    except OSError as e:
        raise pytest.UsageError("cannot run %s: %s" % (exe, e))


def _learned_on_disk(config):
    """What --gpufrac-learn kept, read before pytest's cache plugin is
    configured (xdist decides -n auto first)."""
    try:
        path = os.path.join(str(config.rootpath), config.getini("cache_dir"),
                            "v", *LEARNED_KEY.split("/"))
        with open(path) as f:
            return json.load(f) or {}
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """-n auto under budgets: no more workers than the run's budget holds
    tests of the median learned budget at once, and never more than xdist's
    own auto (one per CPU)."""
    if hasattr(config, "workerinput"):
        return None
    settings = json.loads(os.environ.get(SETTINGS) or "null")
    if not settings or settings.get("split", "test") != "test":
        return None
    budget = settings["budget"]
    job = _job_cap()
    if job and (not budget or job < budget):
        budget = job
    try:
        from xdist import plugin as xdist_plugin

        auto = xdist_plugin.pytest_xdist_auto_num_workers(config)
    except (ImportError, AttributeError):
        return None
    learned = sorted(v["budget"] for v in _learned_on_disk(config).values() if v.get("budget"))
    if not budget or not learned or not auto:
        config._gpufrac_auto = (auto, auto, None)
        return None
    typical = learned[len(learned) // 2]
    n = max(1, min(auto, budget // typical))
    config._gpufrac_auto = (n, auto, typical)
    return n


def _xdist_workers(config):
    """How many xdist workers this session starts (0: none). Read after
    xdist's own pytest_cmdline_main has turned -n N / auto into --tx specs."""
    o = config.option
    if getattr(o, "dist", "no") == "no" or getattr(o, "collectonly", False):
        return 0
    n = 0
    for spec in getattr(o, "tx", None) or []:
        head, star, _ = spec.partition("*")
        n += int(head) if star and head.isdigit() else 1
    return n


def _job_cap():
    """The cap gpufrac run gave this job, in bytes (0: none)."""
    v = os.environ.get("GPU_MEM_LIMIT", "").strip()
    return int(v) if v.isdigit() else 0


# The job's books (common/src/jobledger.rs, `layout`): their magic number,
# where the GPU count and the per-GPU peaks lie, and how many GPUs they
# hold at most. tests/wheel.rs checks the run's peak read through them.
BOOKS_MAGIC = 0x6770_6672_6a6f_6231
BOOKS_NGPUS = 56
BOOKS_PEAK = 256
BOOKS_MAX_GPUS = 8

LEARNED_KEY = "gpufrac/learned"
# What --gpufrac-learn adds to a measured peak: a test's use varies a little
# from run to run (allocator rounding, data), and a budget that is exactly
# last run's peak would fail the next run that needs one block more.
HEADROOM = 0.25


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu_memory(size): the GPU memory this test needs (4G, 512M, 25%% of the run's "
        "budget); under --gpufrac-memory it waits until the run has that much room "
        "and runs capped at it",
    )
    if hasattr(config, "workerinput"):
        # Taken, not left for a pytest that a test runs in a subprocess.
        settings = json.loads(os.environ.pop(SETTINGS, None) or "null")
        if settings:
            name = config.workerinput.get("workerid", "worker")
            config.pluginmanager.register(_Recorder(config, settings, name), "gpufrac-recorder")
        return
    settings = json.loads(os.environ.get(SETTINGS) or "null")
    if settings is None:
        w = _wanted(config)
        if not _active(w):
            return
        settings = w
    if not gpufrac.shim_loaded() and settings["memory"] and not config.option.collectonly:
        # In a job whose environment lost LD_PRELOAD: said, since nothing
        # would cap this run.
        sys.stderr.write(
            "gpufrac: libgpufrac.so is not loaded in this pytest process (LD_PRELOAD "
            "does not name it), so nothing caps the run's GPU memory\n"
        )
    budget = settings["budget"]
    job = _job_cap()
    if job and (not budget or job < budget):
        budget = job
    workers = _xdist_workers(config)
    cap = budget
    if workers and budget and settings["split"] == "worker":
        cap = budget // workers
        # Whole MiB reads better in every report; a share under 1 MiB would
        # round to no cap at all, so it stays exact (docs/ci.md says so).
        if cap >= 1 << 20:
            cap = cap >> 20 << 20
        # Inherited by the workers xdist starts after this hook.
        os.environ["GPU_MEM_LIMIT"] = str(cap)
    cache = getattr(config, "cache", None)
    if settings["learn"] and cache is None:
        raise pytest.UsageError(
            "--gpufrac-learn keeps what it learns in pytest's cache, which is off "
            "(-p no:cacheprovider); enable it or drop --gpufrac-learn"
        )
    learned = (cache.get(LEARNED_KEY, {}) if cache is not None else {}) or {}
    books = None
    if budget and settings["split"] == "test":
        books = tempfile.mkdtemp(prefix="gpufrac-pytest-")
        with open(os.path.join(books, "learned.json"), "w") as f:
            json.dump(learned, f)
    settings = dict(settings, budget=budget, cap=cap, workers=workers, books=books)
    if workers:
        # For the workers, which take it.
        os.environ[SETTINGS] = json.dumps(settings)
    else:
        os.environ.pop(SETTINGS, None)
    auto = getattr(config, "_gpufrac_auto", None)
    if auto is not None and workers:
        n, cpus, typical = auto
        if typical is None:
            settings["auto"] = "-n auto: %d workers, one per CPU (nothing learned yet to " \
                "size them by)" % cpus
        else:
            settings["auto"] = (
                "-n auto: %d workers: the budget holds %d tests of the median learned "
                "budget (%s) at once, and the CPUs allow %d" % (
                    n, budget // typical, gpufrac.format_size(typical), cpus))
    summary = _Summary(config, settings, learned)
    config.pluginmanager.register(summary, "gpufrac-summary")
    if not workers:
        summary.local = _Recorder(config, settings, "main")
        config.pluginmanager.register(summary.local, "gpufrac-recorder")


def _proc_start(pid):
    """The start time of process ``pid`` (clock ticks since boot), or None
    when it is gone or a zombie: with the pid, what names one process
    even after the pid is reused."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


class _Books:
    """The run's reservations, shared by its workers: ``books.json`` in the
    run's temporary directory, read and written under an fcntl lock. Each
    entry is one test's reservation, keyed by its worker's pid and start
    time, with a ticket: a test is granted its reservation when every
    earlier ticket has been and the granted ones leave room for it, so
    tests are served in the order they asked, across workers, and a big one
    is never passed over by a stream of small ones."""

    def __init__(self, directory, budget):
        self.path = os.path.join(directory, "books.json")
        self.budget = budget
        self.me = (os.getpid(), _proc_start(os.getpid()))

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            text = b""
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                text += chunk
            books = json.loads(text) if text else {"next": 0, "entries": []}
            # Whoever reads the books reclaims what dead workers held.
            books["entries"] = [
                e for e in books["entries"] if _proc_start(e["pid"]) == e["start"]
            ]
            yield books
            data = json.dumps(books).encode()
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, data)
        finally:
            os.close(fd)

    def reserve(self, nbytes, test, worker):
        """Blocks until ``nbytes`` are granted; returns the ticket."""
        with self._locked() as b:
            ticket = b["next"]
            b["next"] += 1
            b["entries"].append({
                "ticket": ticket, "pid": self.me[0], "start": self.me[1],
                "bytes": nbytes, "granted": False, "test": test, "worker": worker,
            })
        pause = 0.002
        try:
            while True:
                with self._locked() as b:
                    mine = [e for e in b["entries"] if e["ticket"] == ticket]
                    if not mine:
                        # Only a reader that took this process for dead
                        # drops its entries: its start time moved.
                        raise RuntimeError("gpufrac: this worker's reservation left the books")
                    waiting = min(
                        (e for e in b["entries"] if not e["granted"]),
                        key=lambda e: e["ticket"],
                    )
                    held = sum(e["bytes"] for e in b["entries"] if e["granted"])
                    if waiting is mine[0] and held + nbytes <= self.budget:
                        mine[0]["granted"] = True
                        return ticket
                # Polled, the lock released in between: a worker that dies
                # holding it gives it up with its file descriptors.
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        except BaseException:
            self.release(ticket)
            raise

    def release(self, ticket):
        with self._locked() as b:
            b["entries"] = [e for e in b["entries"] if e["ticket"] != ticket]


def _release_pools():
    """Empties the pools of the caching allocators this process imported,
    so that what one test kept is not charged to the next."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with contextlib.suppress(Exception):
            cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def _write(config, path, text):
    """Writes a report file whole (a reader never sees half of it), relative
    to the directory pytest was started in. The text goes to a new file of a
    random name beside it, made by this call alone (O_EXCL) and never
    through a symbolic link (O_NOFOLLOW), then renamed over the path: where
    others may write the directory, a name planted there in advance (a
    link to a file of this user's) is never written through."""
    path = os.path.join(str(config.invocation_params.dir), path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = "%s.%s.tmp" % (path, secrets.token_hex(8))
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError("gpufrac: no free temporary name beside %s" % path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _learned_budget(asked, run):
    """A test's budget for later runs: what it asked for (its peak, or what
    it held when the cap refused it plus the refused request) and the
    headroom; never more than the run's budget ``run`` (0: no limit). A
    test that outgrew its learned budget was run again with the whole
    budget (``_Recorder.pytest_runtest_protocol``), so what it asked for
    then is what it needs: nothing is guessed, and nothing doubles from
    one red run to the next."""
    budget = _with_headroom(asked)
    if run:
        budget = min(budget, run)
    return budget


def _with_headroom(peak):
    """A learned budget: the peak and its headroom, in whole MiB (at least 1)."""
    return max(1, math.ceil(peak * (1 + HEADROOM) / (1 << 20))) << 20


def _short_size(n):
    """A size in three or four figures (768 MiB, 1.25 GiB): what fits
    beside a test's id in a line a CI log cuts at 80 columns."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            text = "%d" % round(v) if v >= 100 else ("%.2f" % v).rstrip("0").rstrip(".")
            return "%s %s" % (text, unit)
    return "%d B" % n


def _mark_text(n):
    """The gpu_memory mark that covers ``n`` bytes, in whole MiB up."""
    mib = max(1, -(-n // (1 << 20)))
    return "%dG" % (mib >> 10) if mib % 1024 == 0 else "%dM" % mib


def _describe(settings, broker):
    """One line: the budget and how it is divided."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    where = "a gpufrac job with the broker" if broker else "a gpufrac job without a broker"
    if not b:
        return "gpufrac: no memory budget (measuring only), %s" % where
    if n and settings["split"] == "worker":
        how = "%d workers capped at %s each" % (n, gpufrac.format_size(cap))
    elif n and settings["split"] == "test":
        how = "reserved test by test by %d workers (its gpu_memory mark, else its " \
              "learned figure, else %s)" % (n, _default_phrase(settings))
    elif n:
        how = "shared by %d workers" % n
    else:
        how = "one process"
    return "gpufrac: GPU memory budget %s, %s; %s" % (gpufrac.format_size(b), how, where)


def _default_phrase(settings):
    d = settings.get("default")
    return "%s" % d.strip() if d else "the whole budget"


def _cap_phrase(settings, worker, current=None):
    """Which cap a worker's allocation ran into, in words."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    if current is not None:
        phrase = "its reservation of %s (%s)" % (
            gpufrac.format_size(current["budget"]), _source_phrase(current))
        if current["start"]:
            phrase += " and the %s its worker %s held before it started" % (
                gpufrac.format_size(current["start"]), worker)
        return phrase + ", in the run's budget of %s" % gpufrac.format_size(b)
    typed = settings.get("memory") or gpufrac.format_size(b)
    if n and settings["split"] == "worker":
        return "worker %s's cap of %s (--gpufrac-memory %s split %d ways)" % (
            worker, gpufrac.format_size(cap), typed, n)
    if n:
        return "the run's budget of %s, shared by %d workers (--gpufrac-split shared); " \
               "this was worker %s" % (gpufrac.format_size(b), n, worker)
    return "the run's cap of %s (--gpufrac-memory %s)" % (gpufrac.format_size(b), typed)


def _source_phrase(current):
    src = current["source"]
    if src == "retry":
        return "the run's whole budget, run again after its learned budget of %s refused " \
            "it (it asked for %s)" % (gpufrac.format_size(current["retried_from"]["budget"]),
                                     gpufrac.format_size(current["retried_from"]["wanted"]))
    if src == "declared":
        return "declared: gpu_memory(%r)" % current["declared_text"]
    if src == "learned":
        return "learned: its peak of %s in an earlier run and %d%% headroom" % (
            gpufrac.format_size(current["learned_peak"]), int(HEADROOM * 100)) \
            if not current.get("learned_refused") else \
            "learned: %s asked for in an earlier run, where the cap refused it, and %d%% " \
            "headroom" % (gpufrac.format_size(current["learned_peak"]), int(HEADROOM * 100))
    if src == "default":
        return "the default for unmarked tests, %s" % current["declared_text"]
    return "the whole budget: it has neither a gpu_memory mark nor a learned figure"


def _cap_short(settings, worker, current=None):
    """The limit a failure ran into, in a few words, for the one-line
    summary of a failure: ``marked 512M``, ``learned 1.25 GiB``, ``gw1 cap
    1 GiB``."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    if current is not None:
        src = current["source"]
        if src in ("declared", "default"):
            return "%s %s" % ("marked" if src == "declared" else "default",
                              str(current["declared_text"]).strip())
        if src == "learned":
            return "learned %s" % _short_size(current["budget"])
        return "run budget %s" % _short_size(current["budget"])
    if n and settings["split"] == "worker":
        return "%s cap %s" % (worker, _short_size(cap))
    if n:
        return "shared %s spent" % _short_size(b)
    return "cap %s" % _short_size(b)


class _Recorder:
    """In a process that runs tests (an xdist worker, or the one process):
    per-test peaks, and the note on a test that ran out of memory."""

    def __init__(self, config, settings, name):
        self.config = config
        self.settings = settings
        self.name = name
        self.run_peak = {}
        self.start = {}
        self.ooms = 0
        self.tests = 0
        self.measures = gpufrac.shim_loaded() and gpufrac.mem_peak_reset(0) is not None
        # Whether a test ran out of memory by its cap is the shim's count of
        # refusals, read around the test; never the failure's text, which a
        # test that merely mentions memory would match and an application
        # that words its error otherwise would not.
        self.counts_refusals = gpufrac.shim_loaded() and gpufrac.mem_refusals(0) is not None
        self.refusals = {}
        # Under --gpufrac-split test: the run's books, what was learned, and
        # the reservation of the test running now.
        self.books = None
        self.learned = {}
        if settings.get("books"):
            self.books = _Books(settings["books"], settings["budget"])
            with open(os.path.join(settings["books"], "learned.json")) as f:
                self.learned = json.load(f)
        self.current = None
        # The first run of a test running again (_outgrown), while it does.
        self.retry = None
        self.refused = 0
        # When the test running now started (its reservation granted):
        # CLOCK_MONOTONIC, the same clock in every worker, so the
        # controller can tell which tests ran at the same time.
        self.began = None
        # Asked only under budgets: the call initialises CUDA in the worker.
        self.caps = self.books is not None and gpufrac.mem_limit_set(0, 0) is not None

    def _reset(self):
        """Starts new peaks on every device; folds the old ones into the
        run's."""
        for d in range(gpufrac.MAX_DEVICES):
            before = gpufrac.mem_peak_reset(d)
            if before:
                self.run_peak[d] = max(self.run_peak.get(d, 0), before)

    def _refusals_now(self):
        return {d: gpufrac.mem_refusals(d) for d in range(gpufrac.MAX_DEVICES)}

    def _refused_since(self):
        """How many allocations the shim refused since the last look, which
        it then becomes."""
        now = self._refusals_now()
        refused = sum(max(0, n - self.refusals.get(d, 0)) for d, n in now.items())
        self.refusals = now
        return refused

    def _begin(self):
        """A test starts (again): new peaks and refusal counts."""
        self.refused = 0
        self.began = time.monotonic()
        if self.books is not None and not self.settings.get("keep_pools"):
            _release_pools()
        if self.counts_refusals:
            self.refusals = self._refusals_now()
        if self.measures:
            self._reset()
            self.start = {d: gpufrac.mem_used(d) for d in range(gpufrac.MAX_DEVICES)}

    def pytest_runtest_logstart(self, nodeid, location):
        self._begin()

    def _budget_of(self, item):
        """(bytes, how it was set) for ``item``: its closest gpu_memory
        mark, else its learned figure, else the default, else the whole
        budget; the whole budget when it runs again after outgrowing its
        learned figure."""
        run = self.settings["budget"]
        how = {"declared_text": None, "learned_peak": None, "retried_from": None}
        if self.retry is not None:
            how.update(source="retry", learned_peak=self.retry["learned_peak"],
                       retried_from=self.retry)
            return run, how
        mark = item.get_closest_marker("gpu_memory")
        text = None
        if mark is not None:
            text = mark.args[0] if mark.args else mark.kwargs.get("size")
            how.update(source="declared", declared_text=text)
        learned = self.learned.get(item.nodeid)
        if text is None and learned:
            how.update(source="learned", learned_peak=learned["peak"],
                       learned_refused=bool(learned.get("refused")))
            return learned["budget"], how
        if text is None and self.settings.get("default"):
            text = self.settings["default"]
            how.update(source="default", declared_text=text)
        if text is None:
            how.update(source="whole")
            return run, how
        try:
            parsed = gpufrac.parse_budget(text)
        except ValueError as e:
            where = "--gpufrac-default-memory" if how["source"] == "default" else \
                "@pytest.mark.gpu_memory"
            pytest.fail("%s: %s" % (where, e), pytrace=False)
        # A percentage in a mark is of the run's budget, which is what the
        # test shares.
        return gpufrac.resolve_budget(parsed, run), how

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        if self.books is None:
            return
        nbytes, how = self._budget_of(item)
        run = self.settings["budget"]
        if nbytes > run:
            pytest.skip(
                "gpufrac: this test needs %s of GPU memory (%s), more than the run's "
                "budget of %s (--gpufrac-memory)" % (
                    gpufrac.format_size(nbytes),
                    _source_phrase(dict(how, budget=nbytes)), gpufrac.format_size(run)))
        start = max(gpufrac.mem_used(d) for d in range(gpufrac.MAX_DEVICES))
        t0 = time.monotonic()
        ticket = self.books.reserve(nbytes, item.nodeid, self.name)
        self.began = time.monotonic()
        waited = self.began - t0
        # What the worker holds already (a pool kept with --gpufrac-keep-pools,
        # a module's fixture) is not this test's to give back: it is charged
        # on top, and the worker's own cap from the run still bounds both.
        cap = nbytes + start
        if self.caps:
            caps = [gpufrac.mem_limit_set(d, max(cap, 1)) for d in range(gpufrac.MAX_DEVICES)]
            cap = caps[0] or cap
        self.current = dict(how, ticket=ticket, budget=nbytes, start=start, cap=cap,
                            waited=waited, nodeid=item.nodeid)

    def _end(self):
        """The test's reservation, and the cap narrowed to it, given back."""
        if self.current is None:
            return
        current, self.current = self.current, None
        if self.caps:
            for d in range(gpufrac.MAX_DEVICES):
                gpufrac.mem_limit_set(d, 0)
        self.books.release(current["ticket"])

    def pytest_runtest_logfinish(self, nodeid, location):
        self._end()

    def _retriable(self):
        """Whether the test running now, refused, runs again: it reserved
        its learned budget, and the run has more to give it."""
        c = self.current
        return (self.retry is None and c is not None and c["source"] == "learned"
                and c["budget"] < self.settings["budget"])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """Under budgets per test: a test refused under its learned budget
        (it grew since it was measured) runs again at once, alone, with the
        run's whole budget, so that what it needs now is measured and
        learned rather than guessed; only the second run's reports are
        logged, marked as a run again (``retried_from``)."""
        if self.books is None:
            return None
        from _pytest.runner import runtestprotocol

        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        retriable = self._retriable
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        first = self._outgrown(reports) if retriable() else None
        if first is not None:
            self._end()
            # What its failure keeps alive (pytest keeps the last
            # traceback, and with it the test's frames and what they
            # hold) goes before it runs again.
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                if hasattr(sys, name):
                    setattr(sys, name, None)
            gc.collect()
            self._begin()
            # Its first run's output is not its second's.
            if isinstance(getattr(item, "_report_sections", None), list):
                del item._report_sections[:]
            self.retry = first
            try:
                reports = runtestprotocol(item, nextitem=nextitem, log=False)
            finally:
                self.retry = None
        for r in reports:
            item.ihook.pytest_runtest_logreport(report=r)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _outgrown(self, reports):
        """What the first run of a test that outgrew its learned budget
        asked for, or None when it did not (it passed, or failed without
        a refusal)."""
        if not any(r.failed and r.when in ("setup", "call") for r in reports):
            return None
        g = next((getattr(r, "gpufrac", None) for r in reports if r.when == "teardown"), None)
        if not g or not g.get("refused"):
            return None
        return {"budget": self.current["budget"], "wanted": g["wanted"], "peak": g["peak"],
                "learned_peak": self.current["learned_peak"]}

    # A wrapper of the report's making, not a logreport hook: it runs for
    # every phase even when the reports are logged only later (a test run
    # again), and the figures are on the report before xdist sends it.
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        self._phase(outcome.get_result())

    def _phase(self, report):
        if report.when in ("setup", "call", "teardown") and self.counts_refusals:
            refused = self._refused_since()
            self.refused += refused
            if (report.when != "teardown" and report.failed and refused
                    and self.settings["budget"] and not self._retriable()):
                self.ooms += 1
                self._annotate(report)
        if report.when != "teardown" or not self.measures:
            return
        self.tests += 1
        peaks = {}
        for d in range(gpufrac.MAX_DEVICES):
            p = gpufrac.mem_peak(d)
            if p:
                peaks[d] = p
        dev = max(peaks, key=peaks.get) if peaks else 0
        report.gpufrac = {
            "worker": self.name,
            "peak": peaks.get(dev, 0),
            "wanted": max(self._wanted(), peaks.get(dev, 0)),
            "device": dev,
            "start": self.start.get(dev, 0),
            "end": gpufrac.mem_used(dev),
            "devices": {str(d): p for d, p in peaks.items()},
            "refused": self.refused,
            "began": self.began,
            "ended": time.monotonic(),
            "retried_from": None,
        }
        c = self.current
        if c is not None:
            report.gpufrac.update(
                budget=c["budget"], source=c["source"], cap=c["cap"], waited=c["waited"],
                declared=c["budget"] if c["source"] in ("declared", "default") else None,
                learned=(self.learned.get(report.nodeid) or {}).get("budget"),
                learned_peak=c["learned_peak"], retried_from=c["retried_from"])
        else:
            learned = self.learned.get(report.nodeid) or {}
            report.gpufrac.update(budget=None, source=None, cap=None, waited=0.0, declared=None,
                                  learned=learned.get("budget"), learned_peak=learned.get("peak"))
        _junit_properties(report)

    @staticmethod
    def _wanted(held=0):
        """What the test asked for: a test refused at its first allocation
        peaks at 0, and it is what it asked that a budget is learned from."""
        return max([gpufrac.mem_wanted(d) for d in range(gpufrac.MAX_DEVICES)] + [held, 0])

    def _annotate(self, report):
        cap = _cap_phrase(self.settings, self.name, self.current)
        peaks = [gpufrac.mem_peak(d) for d in range(gpufrac.MAX_DEVICES)] if self.measures else []
        held = max(peaks) if peaks else 0
        wanted = self._wanted(held) if self.measures else 0
        note = "This test ran out of GPU memory under %s." % cap
        if held:
            note += "\nThe worker held at most %s during the test before that." % (
                gpufrac.format_size(held))
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            # First, and short: pytest's short summary shows the message's
            # first line cut to the terminal's width (80 columns in a CI
            # log), after the test's id.
            crash.message = "gpufrac: %s, %s; %s" % (
                "needs ~%s" % _short_size(wanted) if wanted else "out of memory",
                _cap_short(self.settings, self.name, self.current), crash.message)
        if self.current is not None:
            advice = self._advice(wanted)
            advice += "; --gpufrac-report shows what each test needs."
        else:
            advice = ("The other tests and workers carry on. Raise --gpufrac-memory, "
                      "run fewer workers (-n), or use --gpufrac-split shared to let one worker "
                      "take more than its share; --gpufrac-report shows what each test needs.")
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("gpufrac", note + "\n" + advice)

    def _advice(self, wanted):
        """What to do about a test refused under its reservation, which
        asked for ``wanted`` bytes."""
        source = self.current["source"]
        run = self.settings["budget"]
        need = _with_headroom(wanted)
        if source == "declared":
            if need > run:
                return ("It asked for %s; with %d%% headroom that is more than the run's "
                        "budget of %s: raise --gpufrac-memory" % (
                            gpufrac.format_size(wanted), int(HEADROOM * 100),
                            gpufrac.format_size(run)))
            return ("It asked for %s (what it held when the cap refused it, and the refused "
                    "allocation): mark it @pytest.mark.gpu_memory(\"%s\"), that and %d%% "
                    "headroom, or more if past the refused allocation it asks for more" % (
                        gpufrac.format_size(wanted), _mark_text(need), int(HEADROOM * 100)))
        if source == "retry":
            return ("Run again alone with the run's whole budget, it asked for %s: raise "
                    "--gpufrac-memory" % gpufrac.format_size(wanted))
        if self.settings.get("learn"):
            # This run learns: say what it learns, not to learn.
            budget = _learned_budget(wanted, 0)
            if budget > run:
                return ("It asked for %s; with headroom that is more than the run's budget of "
                        "%s: raise --gpufrac-memory" % (
                            gpufrac.format_size(wanted), gpufrac.format_size(run)))
            return ("It asked for %s: --gpufrac-learn keeps %s as its budget, which the "
                    "next run reserves for it" % (
                        gpufrac.format_size(wanted), gpufrac.format_size(budget)))
        return {
            "default": "Mark it with gpu_memory, raise --gpufrac-default-memory, or run with "
                       "--gpufrac-learn, which learns what it asks for",
            # Refused under a learned budget it runs again with the whole
            # budget, unless that is what it had.
            "learned": "Its learned budget is the run's whole budget: raise --gpufrac-memory",
            "whole": "Raise --gpufrac-memory",
        }[source]

    def result(self):
        if self.measures:
            self._reset()
        return {
            "worker": self.name,
            "cap": self.settings["cap"],
            "peak": max(self.run_peak.values()) if self.run_peak else 0,
            "devices": {str(d): p for d, p in self.run_peak.items()},
            "tests": self.tests,
            "out_of_memory": self.ooms,
            "measured": bool(self.measures),
        }

    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workeroutput"):
            self.config.workeroutput["gpufrac"] = self.result()


def _junit_properties(report):
    """A test's figures as JUnit XML properties (``--junitxml``), which CI
    systems show beside each test: its peak, its budget and where that came
    from, how long it waited for room, and the cap's refusals."""
    g = report.gpufrac
    props = [("gpufrac_peak_bytes", g["peak"])]
    if g["wanted"] > g["peak"]:
        props.append(("gpufrac_wanted_bytes", g["wanted"]))
    if g.get("budget") is not None:
        props += [
            ("gpufrac_budget_bytes", g["budget"]),
            ("gpufrac_budget_source", g["source"]),
            ("gpufrac_waited_s", "%.3f" % g["waited"]),
        ]
    if g.get("retried_from"):
        props.append(("gpufrac_retried_from_bytes", g["retried_from"]["budget"]))
    props += [("gpufrac_refusals", g["refused"]), ("gpufrac_worker", g["worker"])]
    report.user_properties.extend(props)


def _packing(tests):
    """Which tests ran at the same time, from each one's CLOCK_MONOTONIC
    interval (its reservation granted, or its start, to its teardown):
    ``(together, groups)``, ``together`` mapping each nodeid to the tests it
    overlapped, ``groups`` the largest sets that ran at once (each a sorted
    list, largest first, then by time)."""
    spans = [t for t in tests if t.get("began") is not None and t.get("ended") is not None]
    together = {t["nodeid"]: set() for t in tests}
    events = []
    for t in spans:
        events.append((t["began"], 1, t["nodeid"]))
        events.append((t["ended"], 0, t["nodeid"]))
    # Ends before starts at the same instant: touching is not overlapping.
    events.sort()
    active, groups, grew = set(), [], False
    for when, is_start, nodeid in events:
        if is_start:
            for other in active:
                together[other].add(nodeid)
                together[nodeid].add(other)
            active.add(nodeid)
            grew = True
        else:
            if grew and len(active) > 1:
                groups.append((when, sorted(active)))
            grew = False
            active.discard(nodeid)
    groups.sort(key=lambda g: (-len(g[1]), g[0]))
    return together, [g for _, g in groups]


def _alone_why(t, settings, budgets):
    """Why test ``t`` ran beside no other, and whether its budget made it
    (rather than the timing of the tests around it)."""
    run = settings["budget"]
    if t.get("source") == "retry":
        return ("it ran again with the whole budget of %s after outgrowing its learned budget "
                "of %s" % (gpufrac.format_size(run),
                           gpufrac.format_size(t["retried_from"]["budget"])), True)
    if t.get("source") == "whole":
        return ("it reserved the whole budget of %s: it has neither a gpu_memory mark nor a "
                "learned figure (mark it with @pytest.mark.gpu_memory, run once with "
                "--gpufrac-learn, or set --gpufrac-default-memory)" % gpufrac.format_size(run),
                True)
    b = t.get("budget")
    smallest = min(budgets) if budgets else 0
    if b is not None and run and b + smallest > run:
        return ("its reservation of %s (%s) left no room in the run's %s for another test" % (
            gpufrac.format_size(b), t.get("source"), gpufrac.format_size(run)), True)
    return "no other test ran while it did (there was room beside it)", False


def _job_books_peak():
    """The most the whole run held at once on any GPU, from the job's books
    (``gpufrac run --gpu-memory`` made them; every worker charges them), or
    None without books. Read at the end, when the figure no longer moves:
    the layout is common/src/jobledger.rs's ``layout``."""
    path = os.environ.get("GPUFRAC_JOB_LEDGER")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(BOOKS_PEAK + 8 * BOOKS_MAX_GPUS)
    except OSError:
        return None
    if len(data) < BOOKS_PEAK + 8 * BOOKS_MAX_GPUS:
        return None
    magic, = struct.unpack_from("<Q", data, 0)
    ngpus, = struct.unpack_from("<Q", data, BOOKS_NGPUS)
    if magic != BOOKS_MAGIC or not 0 < ngpus <= BOOKS_MAX_GPUS:
        return None
    return max(struct.unpack_from("<%dQ" % ngpus, data, BOOKS_PEAK))


class _Summary:
    """In the controller: the budget in the header, and the report."""

    def __init__(self, config, settings, learned):
        self.config = config
        self.settings = settings
        self.learned = learned
        self.tests = []
        self.outcomes = {}
        self.workers = {}
        # The recorder of the one process, when no xdist workers run.
        self.local = None
        self.broker = bool(os.environ.get("GPUFRAC_JOB"))

    def pytest_report_header(self, config):
        lines = [_describe(self.settings, self.broker)]
        if self.settings.get("auto"):
            lines.append("gpufrac: " + self.settings["auto"])
        return lines

    def pytest_runtest_logreport(self, report):
        g = getattr(report, "gpufrac", None)
        if report.when == "teardown" and isinstance(g, dict):
            self.tests.append(dict(g, nodeid=report.nodeid))
        elif report.when == "call" or (report.when == "setup" and report.failed):
            self.outcomes[report.nodeid] = report.outcome

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        r = getattr(node, "workeroutput", {}).get("gpufrac")
        if r:
            self.workers[r["worker"]] = r

    def _ranked(self):
        for t in self.tests:
            t.setdefault("outcome", self.outcomes.get(t["nodeid"], "passed"))
        return sorted(self.tests, key=lambda t: (-t["peak"], t["nodeid"]))

    def _analyse(self):
        """Once, at the end: the run's peak from the job's books, and which
        tests ran together."""
        if getattr(self, "together", None) is None:
            self.run_peak = _job_books_peak()
            self.together, self.groups = _packing(self.tests)
            self.t0 = min([t["began"] for t in self.tests if t.get("began") is not None]
                          + [0.0])

    def _packs(self):
        """Whether the run packs tests side by side: budgets per test, and
        several workers."""
        return bool(self.settings.get("books")) and self.settings["workers"] > 1

    def _alone(self):
        """(test, why) of the tests that ran beside no other, in a run that
        packs tests."""
        if not self._packs():
            return []
        budgets = [t["budget"] for t in self.tests if t.get("budget")]
        return [(t,) + _alone_why(t, self.settings, budgets)
                for t in sorted(self.tests, key=lambda t: t["nodeid"])
                if not self.together.get(t["nodeid"])]

    def _json(self):
        s = self.settings
        self._analyse()
        return {
            "version": 1,
            "budget_bytes": s["budget"],
            "run_peak_bytes": self.run_peak,
            "split": s["split"] if s["workers"] else None,
            "workers": s["workers"],
            "cap_bytes": s["cap"],
            "broker": self.broker,
            "per_worker": [
                {
                    "worker": w["worker"],
                    "cap_bytes": w["cap"],
                    "peak_bytes": w["peak"],
                    "devices": w["devices"],
                    "tests": w["tests"],
                    "out_of_memory": w["out_of_memory"],
                }
                for w in sorted(self.workers.values(), key=lambda w: w["worker"])
            ],
            "tests": [
                {
                    "nodeid": t["nodeid"],
                    "worker": t["worker"],
                    "outcome": t["outcome"],
                    "peak_bytes": t["peak"],
                    "device": t["device"],
                    "start_bytes": t["start"],
                    "end_bytes": t["end"],
                    "devices": t["devices"],
                    "refused": bool(t.get("refused")),
                    "refusals": t.get("refused") or 0,
                    "wanted_bytes": t.get("wanted", t["peak"]),
                    "budget_bytes": t.get("budget"),
                    "budget_source": t.get("source"),
                    "cap_bytes": t.get("cap"),
                    "declared_bytes": t.get("declared"),
                    "learned_bytes": t.get("learned"),
                    "waited_s": round(t.get("waited") or 0.0, 3),
                    "began_s": None if t.get("began") is None else round(t["began"] - self.t0, 3),
                    "ended_s": None if t.get("ended") is None else round(t["ended"] - self.t0, 3),
                    "ran_with": sorted(self.together.get(t["nodeid"], ())),
                    "retried_from": None if not t.get("retried_from") else {
                        "budget_bytes": t["retried_from"]["budget"],
                        "wanted_bytes": t["retried_from"]["wanted"],
                        "peak_bytes": t["retried_from"]["peak"],
                    },
                }
                for t in self._ranked()
            ],
            "ran_together": self.groups,
            "ran_alone": [{"nodeid": t["nodeid"], "why": why} for t, why, _ in self._alone()],
        }

    def _learn(self):
        """Each measured test's budget for later runs (_learned_budget)."""
        learned = dict(self.learned)
        run = self.settings["budget"]
        for t in self.tests:
            # A skipped test measured nothing worth keeping.
            if self.outcomes.get(t["nodeid"]) not in ("passed", "failed"):
                continue
            asked = max(t["peak"], t.get("wanted") or 0)
            budget = _learned_budget(asked, run)
            # "peak": what it asked for, which is its peak unless the cap
            # refused it more.
            entry = {"budget": budget, "peak": asked}
            if asked > t["peak"]:
                entry["refused"] = True
            learned[t["nodeid"]] = entry
        self.config.cache.set(LEARNED_KEY, learned)

    def _outgrew(self):
        """Tests refused under their learned budget: each ran again with the
        whole budget, unless that is what it had."""
        return [t for t in self.tests if t.get("retried_from")
                or (t.get("refused") and t.get("source") == "learned")]

    def _say_retried(self, tr):
        """Each test that outgrew its learned budget, and what running it
        again with the whole budget found: always said, since its first
        run's failure is not in the log."""
        outgrew = sorted(self._outgrew(), key=lambda t: t["nodeid"])
        if not outgrew:
            return
        run = self.settings["budget"]
        tr.write_sep("-", "gpufrac: tests that outgrew their learned budget")
        for t in outgrew:
            r = t.get("retried_from")
            asked = max(t["peak"], t.get("wanted") or 0)
            if r is None:
                tr.write_line("%s outgrew its learned budget of %s (it asked for %s)" % (
                    t["nodeid"], gpufrac.format_size(t["budget"]), gpufrac.format_size(asked)))
                continue
            keeps = gpufrac.format_size(_learned_budget(asked, run))
            tr.write_line(
                "%s outgrew its learned budget of %s (it asked for %s there): run again alone "
                "with the run's whole budget of %s, it %s, peak %s; %s" % (
                    t["nodeid"], gpufrac.format_size(r["budget"]),
                    gpufrac.format_size(r["wanted"]), gpufrac.format_size(run),
                    self.outcomes.get(t["nodeid"], "passed"), gpufrac.format_size(t["peak"]),
                    ("--gpufrac-learn keeps %s as its budget" % keeps)
                    if self.settings.get("learn") else
                    ("--gpufrac-learn would keep %s as its budget" % keeps)))

    def _far_above(self):
        """Tests whose declaration is four times their peak or more (and
        at least 256 MiB above it): room the run could pack others into."""
        return [
            t for t in self._ranked()
            if t.get("declared") and t["declared"] >= 4 * t["peak"]
            and t["declared"] - t["peak"] >= 256 << 20
        ]

    def _say_packing(self, tr):
        """Which tests ran together, in a run that packs them, and why any
        ran alone: a few lines, whatever the run's size."""
        if not self._packs() or not self.tests:
            return
        tr.write_sep("-", "gpufrac: tests packed side by side")
        beside = sum(1 for t in self.tests if self.together.get(t["nodeid"]))
        most = max([len(g) for g in self.groups] + [1])
        tr.write_line("%d of %d tests ran beside others, at most %d at once%s" % (
            beside, len(self.tests), most,
            (": " + ", ".join(self.groups[0])) if self.groups and len(self.groups[0]) <= 6
            else ""))
        alone = self._alone()
        # Those that ran alone by their budget, which the user can change;
        # the others only happened to start and end between their
        # neighbours.
        forced = [(t, why) for t, why, by_budget in alone if by_budget]
        for t, why in forced[:10]:
            tr.write_line("%s ran alone: %s" % (t["nodeid"], why))
        more = len(forced) - 10
        if more > 0:
            tr.write_line("(%d more ran alone by their budget; --gpufrac-report-md or "
                          "--gpufrac-report-json lists them)" % more)
        if len(alone) > len(forced):
            tr.write_line("%d ran alone though there was room beside them: no other test ran "
                          "at the time" % (len(alone) - len(forced)))

    def pytest_unconfigure(self, config):
        books = self.settings.get("books")
        if books:
            shutil.rmtree(books, ignore_errors=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.local is not None:
            self.workers[self.local.name] = self.local.result()
        if self.settings.get("learn"):
            self._learn()
        path = _opt(self.config, "gpufrac_report_json")
        if path:
            _write(self.config, path, json.dumps(self._json(), indent=1) + "\n")
        path = _opt(self.config, "gpufrac_report_md")
        if path:
            _write(self.config, path, self._markdown())

    def _markdown(self):
        """The report for a CI step summary (GitHub's $GITHUB_STEP_SUMMARY,
        GitLab's and others' Markdown reports)."""
        self._analyse()
        s = self.settings
        lines = ["## gpufrac: GPU memory", "", _describe(s, self.broker)[len("gpufrac: "):] + ".", ""]
        if self.run_peak is not None and s["budget"]:
            lines += ["**The run's peak: %s of its %s budget** (all its processes at once, "
                      "from the job's books)." % (gpufrac.format_size(self.run_peak),
                                                  gpufrac.format_size(s["budget"])), ""]
        ranked = self._ranked()
        if not ranked:
            lines += ["No measurements: the tests did not run under libgpufrac.so.", ""]
            return "\n".join(lines)
        top = _opt(self.config, "gpufrac_report_top")
        shown = ranked if not top else ranked[:top]
        lines += [
            "| test | outcome | peak | budget | from | waited | refusals | worker | ran with |",
            "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: |",
        ]
        for t in shown:
            budget = t.get("budget")
            lines.append("| `%s` | %s | %s | %s | %s | %s | %d | %s | %d |" % (
                t["nodeid"], t["outcome"], gpufrac.format_size(t["peak"]),
                gpufrac.format_size(budget) if budget is not None else "–",
                t.get("source") or "–",
                "%.1f s" % t["waited"] if t.get("waited") else "–",
                t.get("refused") or 0, t["worker"], len(self.together.get(t["nodeid"], ()))))
        if len(ranked) > len(shown):
            lines.append("")
            lines.append("%d more tests, by peak; `--gpufrac-report-top 0` lists all." % (
                len(ranked) - len(shown)))
        lines.append("")
        if self._packs():
            lines += ["### Packing", ""]
            most = max([len(g) for g in self.groups] + [1])
            lines.append("%d of %d tests ran beside others, at most %d at once." % (
                sum(1 for t in self.tests if self.together.get(t["nodeid"])),
                len(self.tests), most))
            lines.append("")
            if self.groups:
                lines.append("Tests that ran together (the largest sets first):")
                lines.append("")
                for g in self.groups[:10]:
                    lines.append("- " + ", ".join("`%s`" % n for n in g))
                if len(self.groups) > 10:
                    lines.append("- … and %d more sets (`--gpufrac-report-json` has them all)" % (
                        len(self.groups) - 10))
                lines.append("")
            alone = self._alone()
            if alone:
                lines.append("Tests that ran alone:")
                lines.append("")
                for t, why, _ in alone[:20]:
                    lines.append("- `%s`: %s" % (t["nodeid"], why))
                if len(alone) > 20:
                    lines.append("- … and %d more" % (len(alone) - 20))
                lines.append("")
        if self.workers:
            lines += ["| worker | cap | peak | tests | out of memory |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            for w in sorted(self.workers.values(), key=lambda w: w["worker"]):
                lines.append("| %s | %s | %s | %d | %d |" % (
                    w["worker"], gpufrac.format_size(w["cap"]) if w["cap"] else "none",
                    gpufrac.format_size(w["peak"]), w["tests"], w["out_of_memory"]))
            lines.append("")
        return "\n".join(lines)

    def pytest_terminal_summary(self, terminalreporter):
        self._analyse()
        self._say_packing(terminalreporter)
        self._say_retried(terminalreporter)
        if not _opt(self.config, "gpufrac_report"):
            return
        tr = terminalreporter
        tr.write_sep("=", "gpufrac: GPU memory")
        tr.write_line(_describe(self.settings, self.broker))
        if not any(w.get("measured") for w in self.workers.values()) and not self.tests:
            tr.write_line(
                "no measurements: the tests did not run under a libgpufrac.so with "
                "gpufrac_mem_peak_reset"
            )
            return
        top = _opt(self.config, "gpufrac_report_top")
        ranked = self._ranked()
        shown = ranked if not top else ranked[:top]
        if shown:
            tr.write_line("")
            tr.write_line(
                "tests by peak (held at most during the test; 'at start' was held "
                "before it, by earlier tests or caching allocators):"
            )
            tr.write_line("%12s %12s %12s %12s  %-8s %s" % (
                "peak", "at start", "declared", "learned", "worker", "test"))

            def size(n):
                return gpufrac.format_size(n) if n is not None else "-"

            for t in shown:
                tr.write_line(
                    "%12s %12s %12s %12s  %-8s %s"
                    % (gpufrac.format_size(t["peak"]), gpufrac.format_size(t["start"]),
                       size(t.get("declared")), size(t.get("learned")),
                       t["worker"], t["nodeid"])
                )
            if len(ranked) > len(shown):
                tr.write_line(
                    "(%d more; --gpufrac-report-top 0 lists all)" % (len(ranked) - len(shown))
                )
        far = self._far_above()
        if far:
            tr.write_line("")
            tr.write_line("declared far above their peak (lower the mark to pack more tests):")
            for t in far:
                tr.write_line("  %s declares %s, peaked at %s" % (
                    t["nodeid"], gpufrac.format_size(t["declared"]),
                    gpufrac.format_size(t["peak"])))
        if self.run_peak is not None and self.settings["budget"]:
            tr.write_line("")
            tr.write_line("the run's peak: %s of its %s budget (all its processes at once)" % (
                gpufrac.format_size(self.run_peak), gpufrac.format_size(self.settings["budget"])))
        if self.workers:
            tr.write_line("")
            tr.write_line("%-8s %12s %12s %7s %14s" % ("worker", "cap", "peak", "tests", "out of memory"))
            for w in sorted(self.workers.values(), key=lambda w: w["worker"]):
                tr.write_line(
                    "%-8s %12s %12s %7d %14d"
                    % (w["worker"], gpufrac.format_size(w["cap"]) if w["cap"] else "none",
                       gpufrac.format_size(w["peak"]), w["tests"], w["out_of_memory"])
                )
