"""The mutmut configuration: what `make mutate` copies and what it mutates."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_also_copy_leaves_the_mutated_paths_alone_and_copies_the_rest() -> None:
    # A copied file takes its source's mtime, and mutmut regenerates a module
    # whose mutated file is not newer than its source: copying a mutated
    # path would make every run regenerate every mutant.
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    mutated = {Path(p) for p in settings["source_paths"]}
    copied = {Path(p) for p in settings["also_copy"]}
    package = ROOT / "src" / "jobplane"
    for path in copied:
        assert (ROOT / path).exists(), path
        assert not any(path == m or m in path.parents or path in m.parents for m in mutated), path
    entries = {
        Path("src/jobplane") / e.name
        for e in package.iterdir()
        if e.name != "__pycache__" and not e.name.endswith(".egg-info")
    }
    missing = entries - mutated - copied
    assert not missing, f"add to [tool.mutmut] also_copy: {sorted(map(str, missing))}"
