"""structlog set-up: console lines for people, JSON lines for machines.

What must never reach a log line, whichever library writes it: API keys and
bearer tokens (:func:`scrub`), and tenants' data. The database drivers put
the values of a failing statement into their error messages (Postgres echoes
an invalid value, a unique violation's key, a RAISE's arguments; SQLAlchemy
adds the bound parameters unless the engine hides them), so a traceback shows
a database error by its class and SQLSTATE only (:func:`format_exception`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import traceback
from collections.abc import Mapping
from typing import Any, TextIO, cast

import asyncpg
import structlog
from structlog.typing import EventDict, ExcInfo, WrappedLogger

_SECRETS = re.compile(r"\bjp_[A-Za-z0-9_-]{32,}|(?i:\bbearer\s+)[^\s'\",]+")
_DATABASE_MODULES = ("asyncpg", "sqlalchemy")
# Attributes of a Postgres error that name the schema, never a value.
_SAFE_FIELDS = ("sqlstate", "table_name", "column_name", "constraint_name")
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def scrub(text: str) -> str:
    """``text`` with API keys and bearer tokens replaced."""
    return _SECRETS.sub(_mask, text)


def fingerprint(value: str) -> str:
    """What a log line shows of an id a caller chose (a request or correlation id):
    ``sha256:`` and 16 hex digits of its digest; "" for "".

    Callers put what they like in those ids, their own data included, and that
    never reaches a log line; a known id's lines are found by its fingerprint.
    """
    if not value:
        return ""
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _mask(match: re.Match[str]) -> str:
    found = match.group(0)
    return "jp_[REDACTED]" if found.startswith("jp_") else found.split()[0] + " [REDACTED]"


# Errors of the connection itself, whose messages never hold a value of a
# statement ("connection is closed", "terminating connection due to
# administrator command"): they stay readable.
_CONNECTION_ERRORS = (
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
)


def _withheld(exc: BaseException) -> bool:
    if isinstance(exc, _CONNECTION_ERRORS):
        return False
    return type(exc).__module__.split(".", 1)[0] in _DATABASE_MODULES


def describe_error(exc: BaseException) -> str:
    """One line naming ``exc`` that is safe to log (see :func:`format_exception`).

    A SQLAlchemy error is named with the driver's error it wraps.
    """
    inner: BaseException | None = exc
    while inner is not None and _from_sqlalchemy(inner):
        orig = getattr(inner, "orig", None)
        inner = orig if isinstance(orig, BaseException) else inner.__cause__
    line = _exception_only(inner or exc)[-1].strip().splitlines()[0]
    return line if inner is None or inner is exc else f"{_qualname(exc)} from {line}"


def _from_sqlalchemy(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("sqlalchemy")


def _qualname(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _exception_only(exc: BaseException) -> list[str]:
    if not _withheld(exc):
        return [scrub(line) for line in traceback.format_exception_only(type(exc), exc)]
    fields = " ".join(
        f"{name}={value}"
        for name in _SAFE_FIELDS
        if (value := getattr(exc, name, None)) and isinstance(value, str)
    )
    return [f"{_qualname(exc)}: [message withheld{': ' + fields if fields else ''}]\n"]


def format_exception(exc_info: ExcInfo) -> str:
    """A traceback like Python's, without database error messages or secrets."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    exc: BaseException | None = exc_info[1]
    link = ""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append((exc, link))
        if exc.__cause__ is not None:
            exc, link = exc.__cause__, _CAUSE
        elif exc.__context__ is not None and not exc.__suppress_context__:
            exc, link = exc.__context__, _CONTEXT
        else:
            exc = None
    lines: list[str] = []
    following = ""
    for exc, link in reversed(chain):
        lines.append(following)
        if exc.__traceback__ is not None:
            lines.append("Traceback (most recent call last):\n")
            lines.extend(traceback.format_tb(exc.__traceback__))
        lines.extend(_exception_only(exc))
        following = link
    return scrub("".join(lines)).rstrip("\n")


def _scrub_event(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = scrub(value)
    return event_dict


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is logged, not when logging was
    configured: an embedding program (or a test runner) may replace and close it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _NamedPrintLogger(structlog.PrintLogger):
    """A print logger that knows the name it was asked for (the ``logger`` field)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedPrintLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedPrintLogger:
        name = args[0] if args and isinstance(args[0], str) else "jobplane"
        return _NamedPrintLogger(self._file, name)


# The job.* event names' prefixes (seed 001 writes ingestion.job.completed):
# one for every queue, and one per queue from the topology file.
_prefixes: tuple[str, dict[str, str]] = ("", {})


def set_job_prefixes(default: str = "", per_queue: Mapping[str, str] | None = None) -> None:
    """Put ``default`` (or the event's queue's own prefix) before every ``job.*`` event name.

    A line names its queue with a ``queue`` field; ``broker.*`` and the other
    names are never prefixed.
    """
    global _prefixes  # noqa: PLW0603 - what configure() and the CLI set once
    _prefixes = (default, {q: p for q, p in (per_queue or {}).items() if p})


def _prefix_job_events(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    default, per_queue = _prefixes
    if default or per_queue:
        event = event_dict.get("event")
        if isinstance(event, str) and event.startswith("job."):
            prefix = per_queue.get(event_dict.get("queue", ""), default) if per_queue else default
            event_dict["event"] = prefix + event
    return event_dict


_HANDLER_NAME = "jobplane"


class _ForeignLevel(logging.Filter):
    """Lets through another library's records at ``level`` and above only."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def _renderer(fmt: str) -> structlog.types.Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())


def stdlib_formatter(fmt: str = "console") -> logging.Formatter:
    """The formatter of the standard library's records (``fmt``: console or json)."""
    return _stdlib_formatter(_renderer(fmt))


#: The trace-id processor the process registered (None: none; see
#: :func:`register_trace_ids`). Read it as ``_TRACE_IDS`` at each line.
_TRACE_IDS: structlog.types.Processor | None = None


def register_trace_ids(processor: structlog.types.Processor | None) -> None:
    """Have every line go through ``processor`` (None: none): the process registers
    tracing's (``jobplane.observe.tracing.log_trace_ids``) where it turns tracing on,
    so logging imports no tracing."""
    global _TRACE_IDS  # noqa: PLW0603 - the one switch every line reads
    _TRACE_IDS = processor


def _trace_ids(logger: WrappedLogger, name: str, event_dict: EventDict) -> EventDict:
    """The registered trace-id processor's fields on the line; none registered:
    one test."""
    processor = _TRACE_IDS
    if processor is None:
        return event_dict
    return cast("EventDict", processor(logger, name, event_dict))


def _stdlib_formatter(renderer: structlog.types.Processor) -> logging.Formatter:
    # The standard library's records through the same processors: the same
    # fields, the same scrubbing, database messages withheld from tracebacks.
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _trace_ids,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.ExceptionRenderer(format_exception),
            _scrub_event,
            renderer,
        ],
    )


# Whether configure() chose JSON lines: then what a command says to its
# operator is logged too, never printed as text (json_lines()).
_json_lines = False


def json_lines() -> bool:
    """True when logging is configured for JSON: every line a process writes to its
    operator must then be one JSON object."""
    return _json_lines


def json_line(event: str, level: str = "info", **fields: Any) -> str:
    """One line as the JSON renderer writes it, with no secret masked: for what a
    command shows on purpose (``jobplane dev``'s API key), never for a log line."""
    from datetime import UTC, datetime

    line = {
        **fields,
        "event": event,
        "level": level,
        "logger": "jobplane.cli",
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(line, default=str)


def configure(level: str = "info", fmt: str = "console", *, job_prefix: str | None = None) -> None:
    """Route structlog, and the standard library's logging (grpc, aio-pika, asyncpg,
    asyncio, ...), to stderr at ``level``, rendered alike (one JSON object a line in
    ``json``), each line naming its ``logger``.

    Other libraries' records are shown from warning up (from ``level`` up when it
    is higher). ``job_prefix``: see :func:`set_job_prefixes` (None keeps it).
    """
    global _json_lines  # noqa: PLW0603 - set once with the rest of logging
    _json_lines = fmt == "json"
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    if job_prefix is not None:
        set_job_prefixes(job_prefix, _prefixes[1])
    renderer = _renderer(fmt)
    stderr = cast("TextIO", _CurrentStderr())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _trace_ids,
            _prefix_job_events,
            structlog.processors.ExceptionRenderer(format_exception),
            _scrub_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_NamedPrintLoggerFactory(stderr),
        cache_logger_on_first_use=True,
    )
    formatter = _stdlib_formatter(renderer)
    handler = logging.StreamHandler(stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    handler.addFilter(_ForeignLevel(max(numeric, logging.WARNING)))
    root = logging.getLogger()
    for old in list(root.handlers):
        ours = old.get_name() == _HANDLER_NAME or isinstance(old, logging.StreamHandler)
        if ours and not _is_capture(old):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.WARNING))


def _is_capture(handler: logging.Handler) -> bool:
    """pytest's log capture (caplog) keeps its handlers."""
    return type(handler).__module__.startswith("_pytest")
