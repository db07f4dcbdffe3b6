"""A venv with the worker install alone: ``pip install 'jobplane[worker]'`` (ADR-0033).

Kept under .cache/worker-venv/, named by a digest of Python's version and the
requirements of the base install and the worker extra, so a run reuses it
until they change; this run's wheel is installed into it each time.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.sdk_venv import _pip
from tests.support.wheel import ROOT, built_wheel, requirements, wheel_metadata

CACHE = ROOT / ".cache" / "worker-venv"


def worker_python() -> Path:
    """The interpreter of a venv where pip installed the wheel with its worker extra."""
    metadata = wheel_metadata(built_wheel())
    wanted = sorted(str(r) for r in [*requirements(metadata), *requirements(metadata, "worker")])
    key = hashlib.sha256("\n".join([sys.version, *wanted]).encode()).hexdigest()[:16]
    venv = CACHE / key
    python = venv / "bin" / "python"
    stamp = venv / ".complete"
    if not stamp.exists():
        # Written last: a venv whose install was cut short is made again whole.
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(python, "install", f"{built_wheel()}[worker]")
        stamp.write_text("\n".join(wanted) + "\n")
    _pip(python, "install", "--no-deps", "--force-reinstall", str(built_wheel()))
    return python
