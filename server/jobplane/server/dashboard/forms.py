"""The dashboard's query parameters and form fields, checked whole.

Anything not as expected is a :class:`BadField` naming the field, which the
app answers with a 400 page; nothing reaches a store with a value it did not
check.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime

from multidict import MultiMapping

from jobplane.errors import InvalidArgument
from jobplane.events.envelope import EventError, validate_pattern
from jobplane.names import validate_job_type
from jobplane.types import JobState, WaitingCode

MAX_VALUE = 1024
DEFAULT_SIZE = 50
MAX_SIZE = 1000
_LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?")
STATES = {state.value: state for state in JobState}
_WAITING = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
#: The waiting codes the jobs page offers (any other code may still be typed in a URL).
WAITING_CODES = tuple(code.value for code in WaitingCode)


class BadField(ValueError):
    """A query parameter or form field that cannot be used."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True, slots=True)
class JobFilters:
    """The jobs page's filters, as checked values."""

    state: JobState | None = None
    type: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    since: datetime | None = None
    until: datetime | None = None
    size: int = DEFAULT_SIZE
    page: str = ""
    #: Only QUEUED jobs waiting for this reason (a waiting code, e.g. SCHEDULED).
    waiting: str = ""


def single(query: MultiMapping[str], allowed: Collection[str]) -> dict[str, str]:
    """Each parameter once, each known, each at most MAX_VALUE characters without NUL."""
    values: dict[str, str] = {}
    for name, value in query.items():
        if name not in allowed:
            raise BadField(name[:64] or "(empty)", "is not a parameter of this page")
        if name in values:
            raise BadField(name, "is given more than once")
        if len(value) > MAX_VALUE:
            raise BadField(name, f"is longer than {MAX_VALUE} characters")
        if any(ord(c) < 32 for c in value):
            raise BadField(name, "has control characters")
        values[name] = value
    return values


def job_filters(query: MultiMapping[str]) -> JobFilters:
    """The jobs page's ``state``, ``type``, ``label``, ``since``, ``until``, ``size``,
    ``page`` and ``waiting``."""
    raw = single(query, ("state", "type", "label", "since", "until", "size", "page", "waiting"))
    state = None
    if raw.get("state"):
        state = STATES.get(raw["state"].lower())
        if state is None:
            raise BadField("state", f"must be one of {', '.join(STATES)}")
    job_type = raw.get("type", "").strip()
    if job_type:
        try:
            validate_job_type(job_type)
        except InvalidArgument as exc:
            raise BadField("type", exc.message) from None
    labels = _labels(raw.get("label", ""))
    since = _time("since", raw.get("since", ""))
    until = _time("until", raw.get("until", ""))
    if since is not None and until is not None and since >= until:
        raise BadField("until", "must be later than since")
    size = _int("size", raw.get("size", ""), DEFAULT_SIZE, 1, MAX_SIZE)
    waiting = raw.get("waiting", "").strip().upper()
    if waiting and not _WAITING.fullmatch(waiting):
        raise BadField("waiting", "must be a waiting code, e.g. SCHEDULED or CONCURRENCY_LIMIT")
    if waiting and state is not None and state is not JobState.QUEUED:
        raise BadField("waiting", "only QUEUED jobs wait: choose state queued or any")
    page = raw.get("page", "")
    return JobFilters(state, job_type, labels, since, until, size, page, waiting)


def _labels(text: str) -> dict[str, str]:
    """``key=value`` pairs separated by commas."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not _LABEL_KEY.fullmatch(key):
            raise BadField("label", "must be key=value pairs, separated by commas")
        if key in labels:
            raise BadField("label", f"names {key} twice")
        labels[key] = value.strip()
    if len(labels) > 16:
        raise BadField("label", "at most 16 labels")
    return labels


def _time(name: str, text: str) -> datetime | None:
    """An ISO 8601 date or time; without an offset it is UTC."""
    if not text.strip():
        return None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BadField(name, "must be an ISO 8601 time, e.g. 2026-12-01T09:30") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        return when.astimezone(UTC)
    except (OverflowError, ValueError):
        raise BadField(name, "is out of range") from None


def _int(name: str, text: str, default: int, low: int, high: int) -> int:
    if not text:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 12:
        raise BadField(name, f"must be a whole number {low}..{high}")
    value = int(text)
    if not low <= value <= high:
        raise BadField(name, f"must be a whole number {low}..{high}")
    return value


def after_seq(query: MultiMapping[str], last_event_id: str | None) -> int:
    """Where a live job stream starts: ``Last-Event-ID`` (a reconnect), else ``after``."""
    raw = single(query, ("after",))
    if last_event_id:
        return _int("Last-Event-ID", last_event_id.strip(), 0, 0, 2**62)
    return _int("after", raw.get("after", ""), 0, 0, 2**62)


def event_patterns(query: MultiMapping[str]) -> list[str]:
    """The events page's ``type``: routing-key patterns separated by commas."""
    raw = single(query, ("type",))
    patterns = [p.strip() for p in raw.get("type", "").split(",") if p.strip()]
    for pattern in patterns:
        try:
            validate_pattern(pattern)
        except EventError as exc:
            raise BadField("type", f"{exc} (patterns like job.* or artifact.#)") from None
    if len(patterns) > 16:
        raise BadField("type", "at most 16 patterns")
    return patterns


def no_query(query: MultiMapping[str]) -> None:
    """Pages that take no parameters refuse any."""
    single(query, ())
