"""docs/architecture.md names only paths and documents that exist, so it cannot rot silently."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"

# A backticked span is taken for a path when it has a slash or a file's
# extension and nothing a path of ours never has (spaces, quotes, calls).
_SPAN = re.compile(r"`([^`\n]+)`")
_PATHLIKE = re.compile(r"^[\w.{}/-]+$")
_EXTENSION = re.compile(r"\.(py|pyi|md|sql|toml|proto|mako|txt|yaml|cfg)$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose() -> str:
    # The diagram abbreviates names to fit; the tables and lists are what is held.
    return re.sub(r"^```.*?^```", "", PAGE.read_text(encoding="utf-8"), flags=re.M | re.S)


def _paths() -> list[str]:
    spans = (m.group(1) for m in _SPAN.finditer(_prose()))
    return [
        s
        for s in spans
        if _PATHLIKE.match(s) and ("/" in s or _EXTENSION.search(s)) and not s.startswith(".")
    ]


def _exists(path: str) -> bool:
    # `migrations/jobplane/migrations/sql/{revision}_{name}.sql` names a pattern:
    # one file must match it.
    if "{" in path:
        return any(ROOT.glob(re.sub(r"\{[^}]*\}", "*", path)))
    return (ROOT / path).exists()


def test_every_backticked_path_exists() -> None:
    paths = _paths()
    assert len(paths) > 40, f"the page names only {len(paths)} paths: is the pattern right?"
    missing = sorted({p for p in paths if not _exists(p)})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_linked_document_exists() -> None:
    targets = [t for t in _LINK.findall(_prose()) if "://" not in t]
    adrs = [t for t in targets if t.startswith("adr/0")]
    assert len(adrs) >= 10, f"the page links only {len(adrs)} ADRs"
    missing = sorted(
        {t for t in targets if not (PAGE.parent / t.split("#", 1)[0]).resolve().exists()}
    )
    assert not missing, f"docs/architecture.md links documents that do not exist: {missing}"
