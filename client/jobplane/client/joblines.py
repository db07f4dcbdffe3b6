"""Jobs as JSON Lines, for ``jobplane submit --from-jsonl``.

One JSON object a line, with the fields of ``jobplane submit``::

    {"type": "reports.render", "payload": {"report": 7}, "request_id": "r-7",
     "correlation_id": "", "max_attempts": 3, "labels": {"team": "bi"}, "timeout": 60}

``type`` is required; ``payload`` (an object), ``request_id``,
``correlation_id`` (strings), ``max_attempts`` (an integer), ``labels`` (an
object of strings), ``timeout`` (seconds an attempt may run), and for a
delayed job one of ``schedule_time`` (an RFC 3339 time with its zone) and
``schedule_delay`` (seconds) are optional. Blank lines are skipped; any other
key is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from jobplane.client.batch import JobSpec

_FIELDS = (
    *("type", "payload", "request_id", "correlation_id", "max_attempts", "labels", "timeout"),
    *("schedule_time", "schedule_delay"),
)


class BadLine(ValueError):
    """A line that is not a job; ``line`` is its number (from 1)."""

    def __init__(self, line: int, message: str) -> None:
        self.line = line
        super().__init__(f"line {line}: {message}")


def parse_job_lines(lines: Iterable[str]) -> list[tuple[int, JobSpec]]:
    """Each job of ``lines`` with its line number; :class:`BadLine` for the first bad one."""
    jobs = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            jobs.append((number, _job(number, line)))
    return jobs


def _job(number: int, line: str) -> JobSpec:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadLine(number, f"not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise BadLine(number, "must be a JSON object")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise BadLine(number, f"unknown field {unknown[0]!r} (fields: {', '.join(_FIELDS)})")
    job_type = value.get("type")
    if not isinstance(job_type, str) or not job_type:
        raise BadLine(number, "needs a 'type', a string")
    payload = _typed(number, value, "payload", dict, "an object")
    labels = _typed(number, value, "labels", dict, "an object")
    if labels is not None and not all(isinstance(v, str) for v in labels.values()):
        raise BadLine(number, "'labels' must map names to strings")
    max_attempts = _typed(number, value, "max_attempts", int, "an integer")
    timeout = _typed(number, value, "timeout", (int, float), "a number of seconds")
    if isinstance(max_attempts, bool) or isinstance(timeout, bool):
        raise BadLine(number, "'max_attempts' and 'timeout' are numbers, not booleans")
    at, delay = _schedule(number, value)
    return JobSpec(
        job_type,
        payload,
        request_id=_typed(number, value, "request_id", str, "a string"),
        correlation_id=_typed(number, value, "correlation_id", str, "a string") or "",
        max_attempts=max_attempts or 0,
        labels=labels,
        attempt_timeout=timeout,
        schedule_time=at,
        schedule_delay=delay,
    )


def _schedule(number: int, value: dict[str, Any]) -> tuple[datetime | None, float | None]:
    """A line's ``schedule_time`` (RFC 3339, with its zone) or ``schedule_delay`` (seconds)."""
    text = _typed(number, value, "schedule_time", str, "an RFC 3339 time with its zone")
    delay = _typed(number, value, "schedule_delay", (int, float), "a number of seconds")
    if isinstance(delay, bool):
        raise BadLine(number, "'schedule_delay' is a number of seconds, not a boolean")
    if text is not None and delay is not None:
        raise BadLine(number, "set one of 'schedule_time' and 'schedule_delay'")
    if text is None:
        return None, None if delay is None else float(delay)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BadLine(number, f"'schedule_time' {text!r} is no RFC 3339 time") from None
    if at.tzinfo is None:
        raise BadLine(number, "'schedule_time' needs its zone ('Z' or an offset)")
    return at, None


def _typed(number: int, value: dict[str, Any], key: str, kind: Any, what: str) -> Any:
    found = value.get(key)
    if found is not None and not isinstance(found, kind):
        raise BadLine(number, f"{key!r} must be {what}")
    return found
