"""The build backend of pyproject.toml (PEP 517), for `pip install ./python`
and `pip wheel ./python` from a checkout: the wheel is what `cargo xtask
wheel` builds (the release binaries, built against glibc 2.28 with
cargo-zigbuild; it says what to install when the tools are missing)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    out = subprocess.run(
        ["cargo", "xtask", "wheel", "--out-dir", os.path.abspath(wheel_directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        check=True,
        universal_newlines=True,
    ).stdout
    # xtask prints the wheel's path last.
    return os.path.basename(out.strip().splitlines()[-1])
