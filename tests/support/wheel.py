"""The wheel of this tree, built once per test process, and what its metadata says."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# What a build sees (the Dockerfile copies the same): never build/, whose
# leftovers of earlier builds setuptools would put into the wheel.
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "core",
    "contrib",
    "server",
    "workers",
    "client",
    "migrations",
)


@functools.cache
def built_wheel() -> Path:
    """Build the wheel from a clean copy of the sources; the same path all run long."""
    out = Path(tempfile.mkdtemp(prefix="jobplane-wheel-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    tree = out / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    tree.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore)
        else:
            shutil.copy2(source, tree / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(tree),
        ],
        check=True,
        capture_output=True,
    )
    return next(out.glob("jobplane-*.whl"))


def wheel_metadata(wheel: Path) -> Message:
    """The wheel's METADATA (core metadata, an email-style header block)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode())


def requirements(metadata: Message, extra: str | None = None) -> list[Requirement]:
    """The Requires-Dist of the base install (``extra=None``) or of one extra only."""
    found = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or "extra" not in str(marker):
            wanted = extra is None
        else:
            # In this extra, and not in the base install too.
            wanted = (
                extra is not None
                and marker.evaluate({"extra": extra})
                and not marker.evaluate({"extra": ""})
            )
        if wanted:
            found.append(requirement)
    return found
