"""Size rules ruff has no rule for: files and functions a reader can hold.

No production file over 600 lines; no function over 80 lines unless a
comment beside its ``def`` (on the line above, or at the end of the ``def``
line) starting with ``# long:`` says why. ruff checks the rest of the size
rules (statements, branches, complexity; see ``[tool.ruff.lint]``).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _production_files() -> list[Path]:
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    return sorted(
        path
        for folder in folders
        for path in (ROOT / folder).rglob("*.py")
        if "v1" not in path.relative_to(ROOT / folder).parts[:1]
    )


def test_the_production_files_are_found() -> None:
    files = _production_files()
    assert len(files) > 100
    assert ROOT / "core" / "jobplane" / "store" / "machine" / "table.py" in files
    assert not any("/v1/" in str(f) for f in files)


def test_no_production_file_is_over_600_lines() -> None:
    over = {
        str(f.relative_to(ROOT)): n
        for f in _production_files()
        if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not over, f"split these (lines): {over}"


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        assert node.end_lineno is not None
        if node.end_lineno - first + 1 <= MAX_FUNCTION_LINES:
            continue
        above = lines[first - 2].strip() if first >= 2 else ""
        header = lines[node.lineno - 1]
        if above.startswith("# long:") or "# long:" in header:
            continue
        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    return found


def test_no_function_is_over_80_lines_without_a_reason_beside_it() -> None:
    long = [f for path in _production_files() for f in _long_functions(path)]
    assert not long, f"split these, or say why beside the def (# long: ...): {long}"


def test_a_long_function_without_a_reason_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    plain = tmp_path / "plain.py"
    plain.write_text(f"def f() -> None:\n{body}\n")
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text(f"# long: one table, read top to bottom\ndef f() -> None:\n{body}\n")
    assert _long_functions(plain, tmp_path) == ["plain.py:1 f"]
    assert _long_functions(reasoned, tmp_path) == []
