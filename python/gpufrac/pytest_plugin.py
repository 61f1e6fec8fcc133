"""pytest plugin: a GPU memory budget for a test run, split among pytest-xdist
workers, and the peak GPU memory of every test.

    pytest -n 4 --gpufrac-memory 8G            # each of 4 workers capped at 2 GiB
    pytest -n 4 --gpufrac-memory 8G --gpufrac-split shared   # one 8 GiB pool
    pytest --gpufrac-report --gpufrac-report-json gpu-mem.json

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

import json
import os
import sys

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
        choices=("worker", "shared"),
        default="worker",
        help="worker (default): each xdist worker gets SIZE/N as its own cap; "
        "shared: the workers draw on one budget of SIZE",
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
        "--gpufrac-report-json",
        metavar="PATH",
        help="write every test's peak GPU memory and each worker's peak to PATH "
        "as JSON",
    )


def _opt(config, name):
    return config.getoption(name, default=None)


def _wanted(config):
    """The run's settings from the command line; UsageError on bad input."""
    memory = _opt(config, "gpufrac_memory")
    budget = 0
    if memory is not None:
        try:
            budget = gpufrac.parse_size(memory)
        except ValueError as e:
            raise pytest.UsageError("--gpufrac-memory %s" % e)
        if budget == 0:
            raise pytest.UsageError(
                "--gpufrac-memory must be greater than 0; expected %s" % gpufrac.SIZE_EXAMPLE
            )
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
        "report": bool(_opt(config, "gpufrac_report") or _opt(config, "gpufrac_report_json")),
    }


def _active(w):
    return bool(w["budget"] or w["compute"] or w["report"])


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
    if w["compute"]:
        cmd += ["--gpu-compute", w["compute"]]
    if w["timeout"]:
        cmd += ["--timeout", w["timeout"]]
    cmd += ["--"] + _own_command(config)
    env = dict(os.environ)
    env[SETTINGS] = json.dumps(w)
    socket = os.environ.get("GPUFRAC_SOCKET") or "/run/gpufrac/broker.sock"
    if os.path.exists(socket):
        what = "%s of GPU memory" % gpufrac.format_size(w["budget"]) if w["budget"] else "a GPU"
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


def pytest_configure(config):
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
    if not gpufrac.shim_loaded() and settings["budget"] and not config.option.collectonly:
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
    settings = dict(settings, budget=budget, cap=cap, workers=workers)
    if workers:
        # For the workers, which take it.
        os.environ[SETTINGS] = json.dumps(settings)
    else:
        os.environ.pop(SETTINGS, None)
    summary = _Summary(config, settings)
    config.pluginmanager.register(summary, "gpufrac-summary")
    if not workers:
        summary.local = _Recorder(config, settings, "main")
        config.pluginmanager.register(summary.local, "gpufrac-recorder")


def _describe(settings, broker):
    """One line: the budget and how it is divided."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    where = "a gpufrac job with the broker" if broker else "a gpufrac job without a broker"
    if not b:
        return "gpufrac: no memory budget (measuring only), %s" % where
    if n and settings["split"] == "worker":
        how = "%d workers capped at %s each" % (n, gpufrac.format_size(cap))
    elif n:
        how = "shared by %d workers" % n
    else:
        how = "one process"
    return "gpufrac: GPU memory budget %s, %s; %s" % (gpufrac.format_size(b), how, where)


def _cap_phrase(settings, worker):
    """Which cap a worker's allocation ran into, in words."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    typed = settings.get("memory") or gpufrac.format_size(b)
    if n and settings["split"] == "worker":
        return "worker %s's cap of %s (--gpufrac-memory %s split %d ways)" % (
            worker, gpufrac.format_size(cap), typed, n)
    if n:
        return "the run's budget of %s, shared by %d workers (--gpufrac-split shared); " \
               "this was worker %s" % (gpufrac.format_size(b), n, worker)
    return "the run's cap of %s (--gpufrac-memory %s)" % (gpufrac.format_size(b), typed)


def _cap_short(settings, worker):
    """The same, for the one-line summary of a failure."""
    b, n, cap = settings["budget"], settings["workers"], settings["cap"]
    if n and settings["split"] == "worker":
        return "%s over its %s cap" % (worker, gpufrac.format_size(cap))
    if n:
        return "%s, shared %s budget spent" % (worker, gpufrac.format_size(b))
    return "over the %s cap" % gpufrac.format_size(b)


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
        """Whether the shim refused an allocation since the last look, which
        it then becomes."""
        now = self._refusals_now()
        refused = any(n > self.refusals.get(d, 0) for d, n in now.items())
        self.refusals = now
        return refused

    def pytest_runtest_logstart(self, nodeid, location):
        if self.counts_refusals:
            self.refusals = self._refusals_now()
        if self.measures:
            self._reset()
            self.start = {d: gpufrac.mem_used(d) for d in range(gpufrac.MAX_DEVICES)}

    # tryfirst: before xdist sends the report to the controller.
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        if report.when in ("setup", "call") and self.counts_refusals:
            refused = self._refused_since()
            if report.failed and refused and self.settings["budget"]:
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
            "device": dev,
            "start": self.start.get(dev, 0),
            "end": gpufrac.mem_used(dev),
            "devices": {str(d): p for d, p in peaks.items()},
        }
        report.user_properties.append(("gpufrac_peak_bytes", peaks.get(dev, 0)))

    def _annotate(self, report):
        cap = _cap_phrase(self.settings, self.name)
        peaks = [gpufrac.mem_peak(d) for d in range(gpufrac.MAX_DEVICES)] if self.measures else []
        held = max(peaks) if peaks else 0
        note = "This test ran out of GPU memory under %s." % cap
        if held:
            note += "\nThe worker held at most %s during the test before that." % (
                gpufrac.format_size(held))
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            crash.message = "[gpufrac: %s] %s" % (_cap_short(self.settings, self.name), crash.message)
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection(
                "gpufrac",
                note + "\nThe other tests and workers carry on. Raise --gpufrac-memory, "
                "run fewer workers (-n), or use --gpufrac-split shared to let one worker "
                "take more than its share; --gpufrac-report shows what each test needs.",
            )

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


class _Summary:
    """In the controller: the budget in the header, and the report."""

    def __init__(self, config, settings):
        self.config = config
        self.settings = settings
        self.tests = []
        self.outcomes = {}
        self.workers = {}
        # The recorder of the one process, when no xdist workers run.
        self.local = None
        self.broker = bool(os.environ.get("GPUFRAC_JOB"))

    def pytest_report_header(self, config):
        return [_describe(self.settings, self.broker)]

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

    def _json(self):
        s = self.settings
        return {
            "version": 1,
            "budget_bytes": s["budget"],
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
                }
                for t in self._ranked()
            ],
        }

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.local is not None:
            self.workers[self.local.name] = self.local.result()
        path = _opt(self.config, "gpufrac_report_json")
        if path:
            path = os.path.join(str(self.config.invocation_params.dir), path)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self._json(), f, indent=1)
                f.write("\n")
            os.replace(tmp, path)

    def pytest_terminal_summary(self, terminalreporter):
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
            tr.write_line("%12s %12s  %-8s %s" % ("peak", "at start", "worker", "test"))
            for t in shown:
                tr.write_line(
                    "%12s %12s  %-8s %s"
                    % (gpufrac.format_size(t["peak"]), gpufrac.format_size(t["start"]),
                       t["worker"], t["nodeid"])
                )
            if len(ranked) > len(shown):
                tr.write_line(
                    "(%d more; --gpufrac-report-top 0 lists all)" % (len(ranked) - len(shown))
                )
        if self.workers:
            tr.write_line("")
            tr.write_line("%-8s %12s %12s %7s %14s" % ("worker", "cap", "peak", "tests", "out of memory"))
            for w in sorted(self.workers.values(), key=lambda w: w["worker"]):
                tr.write_line(
                    "%-8s %12s %12s %7d %14d"
                    % (w["worker"], gpufrac.format_size(w["cap"]) if w["cap"] else "none",
                       gpufrac.format_size(w["peak"]), w["tests"], w["out_of_memory"])
                )
