"""Try the mutants of code that runs only in child processes against the tests
that start those processes.

Usage (in make mutate's tree, after scripts/mutation_sample.py):
    python scripts/mutation_children.py [--size N] [--seed S] [GLOB ...]

mutmut runs, for each mutant, the tests its first pass saw call the mutated
function. It sees only the test process: a function that runs in a process a
test starts (the CLI's commands, ``jobplane dev``'s parts) is called by no
test it knows of, so its mutants are "no tests" (never tried), and a mutant
of a function called both in the test process (an argument parser built) and
in a child (the command run) is tried only against the first kind of test.
tests/conftest.py makes a child import the mutated tree and inherit the
mutant switched on; this script runs, for each such mutant of the sample that
mutmut did not kill, the test files that start the process its function runs
in (:data:`CHILD_TESTS`), with the mutant on. A failing test kills it.

**A second look** at every other mutant of the sample mutmut tried (or found
no tests for) and did not kill:
mutmut's first pass links a function only to the tests that called it while
it watched, so code that runs once per process and is cached (the state
machine's statements, built at first use and kept) is linked to whichever
tests happened to build it first. The test files that import the mutant's
module (:func:`importers`, at most :data:`SECOND_LOOK_FILES` of them, those
that name it most first) are run with the mutant on, as for a child's.

The verdicts are kept in ``mutants/children.json`` (name → "killed" or
"survived") and read by scripts/mutation_sample.py's report, so a stopped run
resumes and the rate counts them (the report says how many it added).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from fnmatch import fnmatch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mutation_sample

VERDICTS = Path("mutants/children.json")
# Switches the trampolines on (so children get the tree) and no mutant.
NO_MUTANT = "jobplane.none.x_none__mutmut_0"
_IT = "tests/integration/"
# The first glob a mutant's name matches gives the test files that start the
# processes its function runs in.
CHILD_TESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "jobplane.server.admin.x_*key*",
        ("test_keys.py", "test_cli_and_sync.py", "test_operator_errors.py"),
    ),
    ("jobplane.server.admin.x__workers*", ("test_mixed_workers.py",)),
    ("jobplane.server.admin.x*", ("test_maintenance.py", "test_schedule_cli.py")),
    ("jobplane.server.cli.x__dashboard*", ("test_dashboard_commands.py",)),
    ("jobplane.server.cli.x__topology*", ("test_operator_errors.py", "test_least_privilege.py")),
    ("jobplane.server.cli.x*", ("test_dashboard_commands.py", "test_json_logs.py")),
    ("jobplane.server.dev*", ("test_dev_command.py", "test_dev_processes.py", "test_dev_ready.py")),
    (
        "jobplane.workers.cli.x__dlq*",
        ("test_cli_and_sync.py", "test_operator_errors.py", "test_recovery.py"),
    ),
    ("jobplane.workers.cli.x_register_sweep*", ("test_sweep_process.py", "test_cli_and_sync.py")),
    ("jobplane.workers.cli.x_register_worker*", ("test_sync_handlers.py", "test_json_logs.py")),
    ("jobplane.workers.cli.x*", ("test_cli_and_sync.py", "test_json_logs.py")),
)


def tests_for(name: str) -> tuple[str, ...]:
    """The test files that start the process ``name``'s function runs in (none: not a child's)."""
    for pattern, files in CHILD_TESTS:
        if fnmatch(name, pattern):
            return tuple(_IT + f for f in files)
    return ()


#: The most test files a second look runs for one mutant.
SECOND_LOOK_FILES = 3
#: Where a second look finds the test files (in-process tests: the children's
#: are :data:`CHILD_TESTS`'s).
SECOND_LOOK_DIRS = ("tests/unit", "tests/integration")


def importers(module: str, root: Path) -> tuple[str, ...]:
    """The test files under ``root`` that import ``module`` (dotted), or a name it
    defines from its package, those that name it most first (unit tests first
    among equals); at most :data:`SECOND_LOOK_FILES`. ``root`` holds ``src/``
    and ``tests/``."""
    package, _, leaf = module.rpartition(".")
    names = {leaf, *defined(root / "src" / Path(*module.split(".")).with_suffix(".py"))}
    direct = re.compile(rf"^\s*import\s+{re.escape(module)}\b", re.MULTILINE)
    listing = r"\s+import\s+(\([^)]*\)|[^\n]*)"
    from_module = re.compile(rf"^\s*from\s+{re.escape(module)}{listing}", re.MULTILINE)
    from_package = re.compile(rf"^\s*from\s+{re.escape(package)}{listing}", re.MULTILINE)
    found: list[tuple[int, int, str]] = []
    for rank, folder in enumerate(SECOND_LOOK_DIRS):
        for path in sorted((root / folder).glob("test_*.py")):
            source = path.read_text(encoding="utf-8")
            words = {w for found_list in from_package.findall(source) for w in _words(found_list)}
            ours = {w for found_list in from_module.findall(source) for w in _words(found_list)}
            if direct.search(source) or ours or words & names:
                named = (names & words) | ours | {leaf}
                mentions = sum(len(re.findall(rf"\b{re.escape(n)}\b", source)) for n in named)
                found.append((-mentions, rank, f"{folder}/{path.name}"))
    return tuple(name for *_, name in sorted(found)[:SECOND_LOOK_FILES])


def _words(listing: str) -> set[str]:
    return set(re.findall(r"\w+", listing))


def defined(path: Path) -> set[str]:
    """The public names a module's top level defines (none when it is not a file)."""
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {name for name in found if not name.startswith("_")}


def to_judge(
    names: Sequence[str], status: dict[str, str], verdicts: dict[str, str], root: Path
) -> list[tuple[str, tuple[str, ...]]]:
    """The mutants of ``names`` to run test files against, and those files: for
    a child's mutant, tried or not, :data:`CHILD_TESTS`'s; for another that
    mutmut tried, or found no tests for, and did not kill, a second look's
    (:func:`importers` under ``root``). One already judged and one mutmut
    killed are left out, and so is one it has not tried yet, but for a
    child's (its own choice of tests comes first)."""
    chosen = []
    for name in names:
        if name in verdicts or status.get(name) in mutation_sample.CAUGHT:
            continue
        files = tests_for(name)
        if not files and status.get(name) not in mutation_sample.UNTRIED:
            files = importers(mutation_sample.module_of(name), root)
        if files:
            chosen.append((name, files))
    return chosen


def load() -> dict[str, str]:
    """The verdicts so far."""
    return dict(json.loads(VERDICTS.read_text())) if VERDICTS.exists() else {}


def judge(name: str, files: Sequence[str]) -> str:
    """Run ``files`` with mutant ``name`` on: "killed" if a test fails.

    ``name`` of no module (:data:`NO_MUTANT`) runs them unmutated."""
    env = {**os.environ, "MUTANT_UNDER_TEST": name}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path("mutants/src").resolve()), os.environ.get("PYTHONPATH")])
    )
    command = [
        *(sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout=60"),
        *("--reruns=1", "-m", "not soak and not node and not source_lines and not figures"),
    ]
    done = subprocess.run(
        [*command, *files], check=False, cwd="mutants", env=env, capture_output=True
    )
    return "survived" if done.returncode == 0 else "killed"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=300, help="the sample's size (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="the sample's seed (default 1)")
    parser.add_argument("patterns", nargs="*", metavar="GLOB", help="the sample's globs")
    args = parser.parse_args(argv)

    status = mutation_sample.outcomes(Path(sys.executable).with_name("mutmut"))
    pool = [n for n in status if not args.patterns or any(fnmatch(n, p) for p in args.patterns)]
    names = mutation_sample.draw(pool, args.size, args.seed)
    verdicts = load()
    clean: dict[tuple[str, ...], bool] = {}
    for name, files in to_judge(names, status, verdicts, Path("mutants")):
        for each in [(file,) for file in files]:
            if each not in clean:
                # A test that fails unmutated would kill every mutant.
                clean[each] = judge(NO_MUTANT, each) == "survived"
        passing = tuple(f for f in files if clean[(f,)])
        if passing not in clean:  # together, as they are judged
            clean[passing] = bool(passing) and judge(NO_MUTANT, passing) == "survived"
        if not clean[passing]:
            print(f"  no test files passing without a mutant, not judged: {name}", flush=True)
            continue
        verdicts[name] = judge(name, passing)
        VERDICTS.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
        print(f"{verdicts[name]:>9}: {name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
