"""A venv with the SDK alone, on the lowest versions its metadata allows.

The venv is kept under .cache/sdk-venv/, named by a digest of what it holds
(Python's version and the pinned requirements), so a run reuses it until a
floor changes; the jobplane wheel of the run is installed into it each time.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.wheel import ROOT, built_wheel, requirements, wheel_metadata

CACHE = ROOT / ".cache" / "sdk-venv"


def floor(requirement: Requirement) -> str:
    """The lowest version ``requirement`` allows: its ``>=`` bound."""
    bounds = [s.version for s in requirement.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"{requirement} has no single lower bound"
    return bounds[0]


def lowest_pins() -> dict[str, str]:
    """Distribution -> version: the floors of the base install and of the ``cli`` extra.

    The cli extra (rich) is there for the client commands; nothing of the
    SDK imports it (test_sdk_install.py checks).
    """
    metadata = wheel_metadata(built_wheel())
    chosen = [
        r
        for r in [*requirements(metadata), *requirements(metadata, "cli")]
        if r.marker is None or r.marker.evaluate({"extra": "cli"})
    ]
    return {r.name: floor(r) for r in chosen}


def sdk_python(pins: dict[str, str]) -> Path:
    """The interpreter of the venv holding ``pins`` and this run's wheel (no dependencies)."""
    listing = [f"{name}=={version}" for name, version in sorted(pins.items())]
    return cached_venv(CACHE, listing, lambda python: _pip(python, "install", *listing))


def cached_venv(cache: Path, wanted: list[str], install: Callable[[Path], None]) -> Path:
    """The interpreter of a venv under ``cache`` named by Python's version and
    ``wanted``, made by ``install(python)`` when not there yet; this run's wheel
    is installed into it each time (no dependencies)."""
    key = hashlib.sha256("\n".join([sys.version, *wanted]).encode()).hexdigest()[:16]
    venv = cache / key
    python = venv / "bin" / "python"
    stamp = venv / ".complete"
    if not stamp.exists():
        # Written last: a venv whose install was cut short is made again whole.
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        install(python)
        stamp.write_text("\n".join(wanted) + "\n")
    _pip(python, "install", "--no-deps", "--force-reinstall", str(built_wheel()))
    return python


def _pip(python: Path, *args: str) -> None:
    result = subprocess.run(
        [str(python), "-m", "pip", "-q", *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stderr}"
