"""gpufrac: share one NVIDIA GPU among many processes.

This package carries the ``gpufrac`` binary (installed on the environment's
``PATH``), the ``libgpufrac.so`` shim beside it, and a pytest plugin
(``--gpufrac-memory``, ``--gpufrac-report``; see ``gpufrac.pytest_plugin``).

From Python, a process running under the shim can ask what it is allowed and
what it holds::

    import gpufrac
    gpufrac.mem_limit(0), gpufrac.mem_used(0), gpufrac.mem_peak(0)

Every function answers 0 (and ``shim_loaded()`` False) in a process that runs
without the shim.
"""

import ctypes
import os
import shutil
import sysconfig

__all__ = [
    "binary",
    "format_size",
    "mem_limit",
    "mem_limit_set",
    "mem_peak",
    "mem_peak_reset",
    "mem_used",
    "mem_wanted",
    "parse_budget",
    "parse_size",
    "shim_loaded",
]

# Device ordinals the shim keeps books for (MAX_DEVICES in its source).
MAX_DEVICES = 64


def binary():
    """The path of the ``gpufrac`` binary this package installed.

    Looked up in the installed files first, so that it is found even when the
    environment's ``bin`` directory is not on ``PATH`` (``venv/bin/pytest``
    run without activating the venv, as CI scripts often do).
    """
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            files = distribution("gpufrac").files or []
        except PackageNotFoundError:
            files = []
        for f in files:
            if f.name == "gpufrac" and len(f.parts) > 1 and f.parts[-2] == "bin":
                p = os.path.realpath(str(f.locate()))
                if os.access(p, os.X_OK):
                    return p
    except ImportError:  # Python < 3.8
        pass
    p = os.path.join(sysconfig.get_path("scripts"), "gpufrac")
    if os.access(p, os.X_OK):
        return p
    p = shutil.which("gpufrac")
    if p:
        return p
    raise FileNotFoundError(
        "cannot find the gpufrac binary: this package installs it in the "
        "environment's bin directory (%s); reinstall it with "
        "`python -m pip install --force-reinstall gpufrac`" % sysconfig.get_path("scripts")
    )


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 1 << 10,
    "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 1 << 20,
    "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 1 << 30,
    "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 1 << 40,
}  # fmt: skip

SIZE_EXAMPLE = "a size such as 4G, 512M, 1.5G or 4294967296"
BUDGET_EXAMPLE = "a size such as 4G, 512M, 1.5G, 4294967296 or a percentage such as 25%"


def _split_decimal(text, s):
    """(digits before the point, digits after it, the rest) of ``s``, by
    the rules of the gpufrac CLI's parser (common/src/size.rs)."""
    i = 0
    while i < len(s) and s[i] in "0123456789":
        i += 1
    if i == 0:
        if s.startswith("-"):
            raise ValueError("%r: negative values are not allowed" % text)
        if s.startswith("."):
            raise ValueError("%r: write a leading zero, as in 0.5" % text)
        raise ValueError("%r does not start with a number" % text)
    whole, rest, frac = s[:i], s[i:], ""
    if rest.startswith("."):
        j = 1
        while j < len(rest) and rest[j] in "0123456789":
            j += 1
        if j == 1:
            raise ValueError("%r: no digits after the decimal point" % text)
        frac, rest = rest[1:j], rest[j:]
    if rest.startswith("."):
        raise ValueError("%r is a malformed number" % text)
    return whole, frac, rest


def _size(text):
    s = str(text).strip()
    if not s:
        raise ValueError("empty size")
    whole, frac, rest = _split_decimal(text, s)
    unit = rest.strip().lower()
    if unit not in _UNITS:
        raise ValueError("%r: unknown unit %r" % (text, rest.strip()))
    mult = _UNITS[unit]
    # Exact like the CLI: whole bytes, fractions rounded down.
    n = int(whole) * mult + (int(frac) * mult // 10 ** len(frac) if frac else 0)
    if n >= 1 << 64:
        raise ValueError("%r is too large: sizes are limited to just under 16 EiB" % text)
    return n


def parse_size(text):
    """Bytes in ``text``, written as ``gpufrac run --gpu-memory`` takes it:
    4G, 4GiB, 4GB, 512M, 1.5G or plain bytes; every unit is binary (x1024).
    Raises ValueError naming what is wrong."""
    try:
        return _size(text)
    except ValueError as e:
        raise ValueError("%s; expected %s" % (e, SIZE_EXAMPLE))


def parse_budget(text):
    """A memory budget as ``gpufrac run --gpu-memory`` takes it: a size
    (``parse_size``) or a percentage of the GPU (``25%``, ``12.5%``, in
    (0, 100]). Returns ``("bytes", n)`` or ``("percent", p)``; raises
    ValueError naming what is wrong."""
    s = str(text).strip()
    if not s.endswith("%"):
        try:
            return ("bytes", _size(s))
        except ValueError as e:
            raise ValueError("%s; expected %s" % (e, BUDGET_EXAMPLE))
    digits = s[:-1].rstrip()
    try:
        whole, frac, rest = _split_decimal(text, digits)
        if rest:
            raise ValueError("%r: unexpected %r after the number" % (text, rest.strip()))
    except ValueError as e:
        raise ValueError("%s; expected %s" % (e, BUDGET_EXAMPLE))
    value = float(digits)
    if value <= 0:
        raise ValueError("%r: a percentage must be greater than 0; expected %s" % (text, BUDGET_EXAMPLE))
    if value > 100:
        raise ValueError("%r is above 100%%; expected %s" % (text, BUDGET_EXAMPLE))
    return ("percent", value)


def resolve_budget(parsed, total):
    """Bytes of a ``parse_budget`` result, a percentage taken of ``total``
    and rounded down as the CLI does."""
    kind, v = parsed
    if kind == "bytes":
        return v
    return min(total, int(total * v / 100.0))


def format_size(n):
    """``4.00 GiB``, ``768.00 MiB``, ``512 B``: sizes as ``gpufrac status`` writes them."""
    n = int(n)
    if n < 1024:
        return "%d B" % n
    units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    shift, unit = 10, units[0]
    for i, name in enumerate(units[1:], 1):
        s = 10 * (i + 1)
        if n >> s == 0:
            break
        shift, unit = s, name
    hundredths = (n * 100) >> shift
    return "%d.%02d %s" % (hundredths // 100, hundredths % 100, unit)


def _shim_function(name):
    """A function of the preloaded shim's C API (include/gpufrac.h), or None
    without the shim. The lookup goes through the process's global scope,
    where LD_PRELOAD put the library."""
    try:
        f = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    f.argtypes = [ctypes.c_int]
    f.restype = ctypes.c_ulonglong
    return f


_limit = _shim_function("gpufrac_mem_limit")
_limit_set = _shim_function("gpufrac_mem_limit_set")
if _limit_set is not None:
    _limit_set.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
_used = _shim_function("gpufrac_mem_used")
_peak = _shim_function("gpufrac_mem_peak")
_peak_reset = _shim_function("gpufrac_mem_peak_reset")
_refusals = _shim_function("gpufrac_mem_refusals")
_wanted = _shim_function("gpufrac_mem_wanted")


def shim_loaded():
    """Whether this process runs under libgpufrac.so."""
    return _used is not None


def mem_limit(device=0):
    """This process's cap in bytes on CUDA device ``device`` (0: none).
    Initialises the shim (it reads its environment and loads the driver),
    so call it once the process uses CUDA anyway."""
    return _limit(device) if _limit else 0


def mem_limit_set(device, nbytes):
    """Sets this process's own cap on ``device`` to ``nbytes`` (0: back to
    the cap it started with), never above the cap it started with; returns
    the cap now in force (0: none). None when the shim is too old to have
    it."""
    return _limit_set(device, int(nbytes)) if _limit_set else None


def mem_used(device=0):
    """Bytes this process holds on ``device``, as the shim charges them."""
    return _used(device) if _used else 0


def mem_peak(device=0):
    """The most this process has held on ``device`` since the last
    ``mem_peak_reset`` (or since it started)."""
    return _peak(device) if _peak else 0


def mem_peak_reset(device=0):
    """Starts a new peak on ``device`` at what is held now; returns the peak
    before. None when the shim is too old to have it."""
    return _peak_reset(device) if _peak_reset else None


def mem_refusals(device=0):
    """Allocations the shim refused on ``device`` since the process started
    (its cap, or the job's): read before and after a piece of work, a
    difference means the work ran into its cap. None when the shim is too
    old to count them."""
    return _refusals(device) if _refusals else None


def mem_wanted(device=0):
    """The most this process asked to hold on ``device`` since the last
    ``mem_peak_reset``: its peak, or what it held when an allocation was
    refused plus that allocation, whichever is more. A test refused at its
    first allocation peaks at 0; this is what it needed. The peak when the
    shim is too old to say."""
    return _wanted(device) if _wanted else mem_peak(device)
