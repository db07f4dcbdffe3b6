"""Migrations install frozen copies of the SQL API (jobplane/migrations/sql), never the live files.

The live files (``jobplane/store/sql``) change with the next migration; a
migration that read them, or patched an earlier migration's text, would
install something else tomorrow than it installed today (ADR-0035).
"""

from __future__ import annotations

import _io
import ast
import builtins
import contextlib
import importlib.util
import io
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from jobplane.migrations import indexes

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "migrations" / "jobplane" / "migrations" / "versions"
FROZEN = ROOT / "migrations" / "jobplane" / "migrations" / "sql"
LIVE = ROOT / "core" / "jobplane" / "store" / "sql"
MIGRATIONS = sorted(VERSIONS.glob("[0-9]*.py"))
# What a migration may import: the frozen copies' reader, and nothing that
# could reach the live files or another migration's text.
# The concurrent index build's helper reads no file.
ALLOWED_IMPORTS = {
    "__future__",
    "alembic",
    "sqlalchemy",
    "jobplane.migrations.frozen",
    "jobplane.migrations.indexes",
}


class _Result:
    rowcount = 0

    def scalar_one(self) -> str:
        return '"public"'

    def scalar_one_or_none(self) -> None:
        return None


class _Bind:
    def execute(self, *_args: object) -> _Result:
        return _Result()


class _Context:
    @contextlib.contextmanager
    def autocommit_block(self) -> Iterator[None]:
        yield


class _Op:
    """Alembic's ``op`` as far as our migrations use it, keeping what they execute."""

    def __init__(self) -> None:
        self.executed: list[str] = []

    def execute(self, sql: object) -> None:
        self.executed.append(str(sql))

    def get_bind(self) -> _Bind:
        return _Bind()

    def get_context(self) -> _Context:
        return _Context()


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"jobplane_migration_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_migrations_and_the_files_are_there() -> None:
    assert len(MIGRATIONS) >= 16
    assert {"submit_job.sql", "publish_event.sql"} <= {p.name for p in LIVE.glob("*.sql")}
    assert (FROZEN / "0011_submit_job.sql").is_file()


@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda p: p.stem)
def test_a_migration_imports_only_the_frozen_copies_reader(path: Path) -> None:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported <= ALLOWED_IMPORTS, path.name


@pytest.mark.parametrize("step", ["upgrade", "downgrade"])
@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda p: p.stem)
def test_a_migration_reads_only_its_frozen_copies(
    path: Path, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _load(path)
    op = _Op()
    monkeypatch.setattr(module, "op", op)
    monkeypatch.setattr(indexes, "op", op)
    opened: list[Path] = []
    real_open = io.open

    def recording_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(os.fspath(file)).resolve())
        return real_open(file, *args, **kwargs)

    # Path.read_text opens through io.open, open() is builtins.open, and
    # importing a module's source (another migration's) through _io.open_code.
    monkeypatch.setattr(io, "open", recording_open)
    monkeypatch.setattr(builtins, "open", recording_open)
    real_open_code = _io.open_code

    def recording_open_code(file: str) -> Any:
        opened.append(Path(file).resolve())
        return real_open_code(file)

    monkeypatch.setattr(_io, "open_code", recording_open_code)
    getattr(module, step)()
    assert op.executed
    outside = [p for p in opened if not p.is_relative_to(FROZEN.resolve())]
    assert not outside, f"{path.name} {step} read {outside}"
