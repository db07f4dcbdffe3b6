"""The mutation sample's draw and interval, and the mutmut configuration it relies on."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sample() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_sample", ROOT / "scripts" / "mutation_sample.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(sizes: dict[str, int]) -> list[str]:
    return [
        f"jobplane.{module}.xǁCǁf__mutmut_{i}" if i % 2 else f"jobplane.{module}.x_f__mutmut_{i}"
        for module, size in sizes.items()
        for i in range(1, size + 1)
    ]


@pytest.mark.parametrize(
    ("caught", "tried", "low", "high"),
    [
        (270, 300, 0.8608, 0.9291),
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (5, 10, 0.2366, 0.7634),
        (87, 119, 0.6454, 0.8023),
    ],
)
def test_wilson_interval_gives_known_values(
    sample: ModuleType, caught: int, tried: int, low: float, high: float
) -> None:
    got_low, got_high = sample.wilson(caught, tried)
    assert got_low == pytest.approx(low, abs=5e-4)
    assert got_high == pytest.approx(high, abs=5e-4)


def test_wilson_interval_of_nothing_tried_is_everything(sample: ModuleType) -> None:
    assert sample.wilson(0, 0) == (0.0, 1.0)


def test_module_of_reads_both_kinds_of_mutant_name(sample: ModuleType) -> None:
    assert sample.module_of("jobplane.store.attempts.x_fail__mutmut_7") == "jobplane.store.attempts"
    assert (
        sample.module_of("jobplane.server.limits.xǁTenantLimiterǁ_prune__mutmut_3")
        == "jobplane.server.limits"
    )


def test_the_same_seed_draws_the_same_sample_whatever_the_listing_order(
    sample: ModuleType,
) -> None:
    names = _names({"store.a": 400, "server.b": 250, "workers.c": 50})
    first = sample.draw(names, 30, seed=1)
    assert len(first) == len(set(first)) == 30
    assert set(first) <= set(names)
    assert sample.draw(list(reversed(names)), 30, seed=1) == first
    assert sample.draw(names, 30, seed=2) != first
    assert sample.draw(names, 30, seed=1, stratify=False) == sample.draw(
        list(reversed(names)), 30, seed=1, stratify=False
    )


def test_a_sample_larger_than_the_population_is_the_population(sample: ModuleType) -> None:
    names = _names({"store.a": 3, "server.b": 2})
    assert sample.draw(names, 10, seed=1) == sorted(names)
    assert sample.draw(names, 10, seed=1, stratify=False) == sorted(names)


def test_each_module_gets_its_proportional_share(sample: ModuleType) -> None:
    sizes = {"store.a": 700, "server.b": 200, "workers.c": 100}
    drawn = Counter(sample.module_of(n) for n in sample.draw(_names(sizes), 50, seed=7))
    assert drawn == {"jobplane.store.a": 35, "jobplane.server.b": 10, "jobplane.workers.c": 5}


def test_largest_remainders_fill_the_sample_exactly(sample: ModuleType) -> None:
    # Quotas 2.8, 0.8 and 0.4: floors give 2, the two largest remainders one each.
    assert sample.allocate({"a": 7, "b": 2, "c": 1}, 4) == {"a": 3, "b": 1, "c": 0}
    shares = sample.allocate({f"m{i}": 13 + 7 * i for i in range(40)}, 300)
    assert sum(shares.values()) == 300


@pytest.mark.parametrize("stratify", [True, False])
def test_every_mutant_is_about_as_likely_to_be_drawn(sample: ModuleType, stratify: bool) -> None:
    # 60 mutants in modules of 30, 20 and 10, samples of 6: each mutant's
    # chance is 1/10, so 3,000 draws pick each about 300 times (sd ≈ 16).
    names = _names({"store.a": 30, "server.b": 20, "workers.c": 10})
    hits = Counter(
        name for seed in range(3000) for name in sample.draw(names, 6, seed, stratify=stratify)
    )
    assert set(hits) == set(names)
    assert all(225 <= hits[name] <= 375 for name in names), hits.most_common()


def test_the_report_counts_tried_mutants_and_lists_survivors(sample: ModuleType) -> None:
    names = ["m.x_f__mutmut_1", "m.x_f__mutmut_2", "m.x_f__mutmut_3", "m.x_f__mutmut_4"]
    status = {
        names[0]: "killed",
        names[1]: "timeout",
        names[2]: "survived",
        names[3]: "not checked",
        "m.x_g__mutmut_1": "killed",
    }
    lines = sample.report(names, status, 5)
    assert "      sample: 4 of 5 mutants (3 tried)" in lines
    assert "   kill rate: 2/3 = 66.7% (95% CI 20.8% to 93.9%, Wilson)" in lines
    assert "  survived: m.x_f__mutmut_3" in lines
    assert not any("m.x_g" in line for line in lines)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree make mutate runs mutmut in (scripts/mutation_tree.py)."""
    spec = importlib.util.spec_from_file_location(
        "mutation_tree", ROOT / "scripts" / "mutation_tree.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage: Path = tmp_path_factory.mktemp("mutate")
    module.build(stage, ROOT)
    return stage


def test_the_mutation_tree_holds_every_part_of_the_package_in_one_folder(tree: Path) -> None:
    package = tree / "src" / "jobplane"
    for part in ("server", "workers", "client", "migrations", "contrib"):
        assert (package / part / "__init__.py").is_file(), part
    assert (package / "store" / "machine" / "table.py").is_file()
    assert (tree / "tests" / "conftest.py").is_file()
    # mutmut regenerates a module whose source is newer than its mutant: copies keep mtimes.
    source = ROOT / "core" / "jobplane" / "store" / "jobs.py"
    assert (package / "store" / "jobs.py").stat().st_mtime == source.stat().st_mtime


def test_also_copy_leaves_the_mutated_modules_alone_and_copies_the_rest(tree: Path) -> None:
    # A copied file takes its source's mtime, and mutmut regenerates a module
    # whose mutated file is not newer than its source: copying a mutated
    # module would make every run regenerate every mutant. mutmut copies a
    # source path's other files only when they are missing, so those (the
    # store's SQL) must be copied to reach the tests when edited.
    settings = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["mutmut"]
    mutated = [Path(p) for p in settings["source_paths"]]
    copied = [Path(p) for p in settings["also_copy"]]
    for path in copied:
        assert (tree / path).exists(), path

    def files(path: Path) -> set[Path]:
        if (tree / path).is_file():
            return {path}
        return {
            f.relative_to(tree)
            for f in (tree / path).rglob("*")
            if f.is_file() and "__pycache__" not in f.parts
        }

    in_mutated = set().union(*(files(m) for m in mutated))
    in_copied = set().union(*(files(c) for c in copied))
    overwritten = {f for f in in_mutated & in_copied if f.suffix == ".py"}
    assert not overwritten, f"also_copy overwrites mutated modules: {sorted(map(str, overwritten))}"
    stale = {f for f in in_mutated - in_copied if f.suffix != ".py"}
    assert not stale, f"add to [tool.mutmut] also_copy: {sorted(map(str, stale))}"
    entries = {
        Path("src/jobplane") / e.name
        for e in (tree / "src" / "jobplane").iterdir()
        if e.name != "__pycache__" and not e.name.endswith(".egg-info")
    }
    missing = entries - set(mutated) - set(copied)
    assert not missing, f"add to [tool.mutmut] also_copy: {sorted(map(str, missing))}"


@pytest.fixture(scope="module")
def children() -> ModuleType:
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(
            "mutation_children", ROOT / "scripts" / "mutation_children.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


def test_children_tests_name_the_files_that_start_the_process(children: ModuleType) -> None:
    assert children.tests_for("jobplane.server.admin.x__keys_command__mutmut_30") == (
        "tests/integration/test_keys.py",
        "tests/integration/test_cli_and_sync.py",
        "tests/integration/test_operator_errors.py",
    )
    assert children.tests_for("jobplane.server.admin.x__workers__mutmut_13") == (
        "tests/integration/test_mixed_workers.py",
    )
    assert "tests/integration/test_dev_ready.py" in children.tests_for(
        "jobplane.server.devparts.x__dev_part__mutmut_67"
    )
    # Code of the test process itself is mutmut's to judge.
    assert children.tests_for("jobplane.store.attempts.x__limit_name__mutmut_14") == ()
    assert children.tests_for("jobplane.workers.delivery.xǁDeliveriesǁ_claim__mutmut_5") == ()
    named = {f for _, files in children.CHILD_TESTS for f in files}
    missing = [f for f in named if not (ROOT / "tests" / "integration" / f).exists()]
    assert not missing, missing


def test_children_verdicts_count_in_the_sample(
    sample: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mutants").mkdir()
    status = {
        "m.x_f__mutmut_1": "no tests",
        "m.x_f__mutmut_2": "killed",
        "m.x_f__mutmut_3": "survived",
    }
    assert sample.with_children(status) == status
    verdicts = {"m.x_f__mutmut_1": "killed", "m.x_f__mutmut_2": "survived"}
    verdicts["m.x_f__mutmut_3"] = "survived"
    (tmp_path / "mutants" / "children.json").write_text(json.dumps(verdicts))
    merged = sample.with_children(status)
    # A verdict never un-kills what mutmut killed.
    assert merged == {
        "m.x_f__mutmut_1": "killed",
        "m.x_f__mutmut_2": "killed",
        "m.x_f__mutmut_3": "survived",
    }


def test_the_report_says_how_many_the_later_verdicts_killed(sample: ModuleType) -> None:
    names = ["m.x_f__mutmut_1", "m.x_f__mutmut_2", "m.x_f__mutmut_3"]
    mutmuts = {names[0]: "killed", names[1]: "survived", names[2]: "no tests"}
    merged = {**mutmuts, names[1]: "killed"}
    lines = sample.report(names, merged, 3, mutmuts)
    assert "     of them: 1 killed by tests mutmut did not run" in lines
    assert "   kill rate: 2/3 = 66.7% (95% CI 20.8% to 93.9%, Wilson)" in lines
    assert not any("of them" in line for line in sample.report(names, merged, 3))


def test_a_second_look_runs_the_test_files_that_import_the_module(
    children: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "src" / "jobplane" / "store" / "machine" / "lifecycle.py"
    module.parent.mkdir(parents=True)
    module.write_text("MAX = 1\n_HIDDEN = 2\n\ndef event_id(): ...\n\nclass Feed: ...\n")
    files = {
        # The module itself, by its dotted name.
        "unit/test_direct.py": "import jobplane.store.machine.lifecycle\n",
        # A name it defines, from its package, in a parenthesised list.
        "integration/test_names.py": (
            "from jobplane.store.machine import (\n    MACHINE,\n    event_id,\n)\n"
            "event_id(); event_id(); event_id()\n"
        ),
        # The module from its package.
        "unit/test_leaf.py": "from jobplane.store.machine import lifecycle\nlifecycle.MAX\n",
        # Names from the module itself, indented; a longer name is no mention.
        "unit/test_from_module.py": (
            "def test():\n    from jobplane.store.machine.lifecycle import MAX\n"
            "    MAX, MAX_ATTEMPTS\n"
        ),
        # Neither: a private name, another module of that name, a mention only.
        "unit/test_private.py": "from jobplane.store.machine import _HIDDEN\n",
        "unit/test_other.py": "from jobplane.server import lifecycle\n",
        "unit/test_text.py": "# jobplane.store.machine.lifecycle's events\nMAX = 1\n",
        "unit/helper.py": "import jobplane.store.machine.lifecycle\n",
    }
    for name, source in files.items():
        path = tmp_path / "tests" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    # Those that name it most first (the cap out of the way).
    monkeypatch.setattr(children, "SECOND_LOOK_FILES", 10)
    found = children.importers("jobplane.store.machine.lifecycle", tmp_path)
    assert found == (
        "tests/integration/test_names.py",
        "tests/unit/test_from_module.py",
        "tests/unit/test_leaf.py",
        "tests/unit/test_direct.py",
    )
    assert children.importers("jobplane.store.nothing", tmp_path) == ()
    # No more than the cap.
    monkeypatch.setattr(children, "SECOND_LOOK_FILES", 2)
    assert children.importers("jobplane.store.machine.lifecycle", tmp_path) == found[:2]


def test_a_second_look_is_for_what_mutmut_tried_and_did_not_kill(
    children: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_m.py").write_text("from jobplane.store import m\n")
    names = [f"jobplane.store.m.x_f__mutmut_{i}" for i in range(1, 7)]
    kinds = ["survived", "no tests", "killed", "timeout", "not checked", "survived"]
    status = dict(zip(names, kinds, strict=True))
    verdicts = {names[5]: "survived"}  # judged on an earlier run
    chosen = children.to_judge(names, status, verdicts, tmp_path)
    assert chosen == [(n, ("tests/unit/test_m.py",)) for n in names[:2]]
    # A child's mutant is judged by the tests that start its process, tried or not.
    child = "jobplane.server.admin.x__workers__mutmut_13"
    assert children.to_judge([child], {child: "not checked"}, {}, tmp_path) == [
        (child, ("tests/integration/test_mixed_workers.py",))
    ]
