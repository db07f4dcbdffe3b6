"""The layout of ADR-0038: one package over the folders of the repository, no links."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_repository_holds_no_symlinks() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000")]
    assert not links, f"symlinks in the repository: {links}"


def test_each_part_is_the_real_home_of_its_code() -> None:
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    for package, folder in mapping.items():
        path = ROOT / folder
        assert path.is_dir() and not path.is_symlink(), folder
        assert (path / "__init__.py").is_file(), folder
        if package != "jobplane":
            part = package.removeprefix("jobplane.")
            # <part>/jobplane/<part>: the folder's only content is its part.
            assert folder == f"{part}/jobplane/{part}", folder
            assert sorted(p.name for p in (ROOT / part).iterdir()) == ["jobplane"], part
            assert sorted(
                p.name for p in (ROOT / part / "jobplane").iterdir() if p.name != "__pycache__"
            ) == [part]


def _packages_on_disk() -> set[str]:
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    found: set[str] = set()
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            name = ".".join((package, *relative.parts))
            if any(
                name.startswith(other + ".") or name == other
                for other in mapping
                if other != package and other.startswith(package + ".")
            ):
                continue
            found.add(name)
    return found


def test_the_package_list_names_every_package_and_nothing_else() -> None:
    assert set(SETUPTOOLS["packages"]) == _packages_on_disk()


def test_a_source_checkout_finds_every_part_beside_the_core() -> None:
    import jobplane.client
    import jobplane.contrib
    import jobplane.migrations
    import jobplane.server
    import jobplane.workers

    for part in (
        jobplane.server,
        jobplane.workers,
        jobplane.client,
        jobplane.migrations,
        jobplane.contrib,
    ):
        name = part.__name__.removeprefix("jobplane.")
        assert part.__file__ is not None
        assert Path(part.__file__).resolve() == (ROOT / name / "jobplane" / name / "__init__.py")
    assert Path(jobplane.__file__ or "").resolve() == ROOT / "core" / "jobplane" / "__init__.py"
