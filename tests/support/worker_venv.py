"""A venv with the worker install alone: ``pip install 'jobplane[worker]'`` (ADR-0033),
on the newest versions its ranges allow or on exactly their floors.

Kept under .cache/worker-venv/, named by a digest of Python's version and the
requirements of the base install and the worker extra, so a run reuses it
until they change; this run's wheel is installed into it each time.
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement

from tests.support.sdk_venv import _pip, cached_venv, floor
from tests.support.wheel import ROOT, built_wheel, requirements, wheel_metadata

CACHE = ROOT / ".cache" / "worker-venv"


def worker_python(*, lowest: bool = False) -> Path:
    """The interpreter of a venv where pip installed the wheel with its worker extra
    (``lowest``: the floors of the base install and the extra, exactly)."""
    metadata = wheel_metadata(built_wheel())
    chosen = [
        r
        for r in [*requirements(metadata), *requirements(metadata, "worker")]
        if r.marker is None or r.marker.evaluate({"extra": "worker"})
    ]
    wanted = sorted(_pinned(r) if lowest else str(r) for r in chosen)

    def install(python: Path) -> None:
        if lowest:
            _pip(python, "install", *wanted)
        else:
            _pip(python, "install", f"{built_wheel()}[worker]")

    return cached_venv(CACHE, wanted, install)


def _pinned(requirement: Requirement) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}=={floor(requirement)}"
