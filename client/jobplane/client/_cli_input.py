"""What the client commands read from their command line: names, payloads, labels, and
the jobs of a ``--from-jsonl`` file; what is wrong with them raises :class:`UsageError`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jobplane.client._cli_run import UsageError
from jobplane.client.batch import JobSpec
from jobplane.client.joblines import BadLine, parse_job_lines


def full_name(raw: str) -> str:
    """``jobs/{id}`` for a name or a bare id."""
    return raw if "/" in raw else f"jobs/{raw}"


def blob_name_of(raw: str) -> str:
    """``blobs/{sha256}`` for a name or a bare digest."""
    return raw if "/" in raw else f"blobs/{raw}"


def parse_payload(text: str | None, path: str | None) -> dict[str, Any]:
    """The payload of ``--payload`` or ``--payload-file``; must be a JSON object."""
    source = "--payload"
    if path is not None:
        source = "--payload-file"
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a JSON object, got {_JSON_KINDS[type(value)]}")
    return value


_JSON_KINDS: dict[type, str] = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def read_job_lines(path: str) -> list[tuple[int, JobSpec]]:
    """The jobs of ``--from-jsonl PATH`` ('-': stdin), each with its line number."""
    try:
        if path == "-":
            return parse_job_lines(sys.stdin)
        with Path(path).open(encoding="utf-8") as lines:
            return parse_job_lines(lines)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text: {exc.reason}") from exc
    except BadLine as exc:
        raise UsageError(str(exc)) from exc


def parse_labels(items: list[str]) -> dict[str, str]:
    """``--label KEY=VALUE`` options as a dict."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label must look like KEY=VALUE, got {item!r}")
        labels[key] = value
    return labels
