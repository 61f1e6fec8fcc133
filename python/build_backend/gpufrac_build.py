"""The build backend of pyproject.toml (PEP 517), for `pip install ./python`
and `pip wheel ./python` from a checkout: the wheel is what `cargo xtask
wheel` builds (the release binaries, built against glibc 2.28 with
cargo-zigbuild and zig). pip installs both from PyPI into the build's
environment (pyproject.toml's build requirements), so nothing but Rust and
Python is needed; xtask and cargo-zigbuild find zig as `python -m ziglang`
of this interpreter."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = dict(os.environ)
    if importlib.util.find_spec("ziglang") is not None:
        # The build environment's zig, through this interpreter: the
        # `python3` on PATH may be another one that cannot import it.
        env["CARGO_ZIGBUILD_PYTHON_PATH"] = sys.executable
    # pip puts its build environment's scripts (cargo-zigbuild) on PATH;
    # an interpreter started otherwise has them beside itself.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in (env.get("PATH"), bindir) if p)
    return env


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    out = subprocess.run(
        ["cargo", "xtask", "wheel", "--out-dir", os.path.abspath(wheel_directory)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        check=True,
        universal_newlines=True,
    ).stdout
    # xtask prints the wheel's path last.
    return os.path.basename(out.strip().splitlines()[-1])
