"""Build the tree ``make mutate`` runs mutmut in: the package in one folder.

Usage: python scripts/mutation_tree.py STAGE      (``make mutate`` uses build/mutate)

mutmut names a mutant by its file's path (``src/jobplane/store/jobs.py`` gives
``jobplane.store.jobs``) and, while the tests run, finds the mutant to switch
on by the running module's name, so the two must agree. The repository keeps
the package in several folders, one a part (ADR-0038: ``server/`` holds
``server/jobplane/server``), which mutmut would name ``server.jobplane...``.
This copies the parts into ``STAGE/src/jobplane`` as the wheel has them, with
what the tests read beside it (``tests/``, ``docs/``, the README, ...), and
leaves ``STAGE/mutants`` (mutmut's mutated copies and results) alone.

Every copy keeps its source's modification time: mutmut generates a module's
mutants again only when its source is newer than its mutated copy, so an
unchanged module costs nothing on the next run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each part's folder in the repository, and where the wheel puts it.
PARTS = {
    "core/jobplane": "src/jobplane",
    "server/jobplane/server": "src/jobplane/server",
    "workers/jobplane/workers": "src/jobplane/workers",
    "client/jobplane/client": "src/jobplane/client",
    "migrations/jobplane/migrations": "src/jobplane/migrations",
    "contrib/jobplane/contrib": "src/jobplane/contrib",
}
# What the tests read from the repository besides the package.
REST = (
    "tests",
    "examples",
    "proto",
    "docs",
    "scripts",
    "bench",
    "README.md",
    "Makefile",
    "compose.yaml",
    "pyproject.toml",
    "LICENSE",
    "deploy",
    "Dockerfile",
)
KEEP = {"mutants"}
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def build(stage: Path, root: Path = ROOT) -> None:
    """Make ``stage`` the merged tree of ``root``, leaving mutmut's results in it."""
    stage.mkdir(parents=True, exist_ok=True)
    for entry in stage.iterdir():
        if entry.name in KEEP:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for source, target in PARTS.items():
        shutil.copytree(root / source, stage / target, ignore=IGNORE, dirs_exist_ok=True)
    for name in REST:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, stage / name, ignore=IGNORE)
        elif path.exists():
            shutil.copy2(path, stage / name)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    build(Path(argv[0]).resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
