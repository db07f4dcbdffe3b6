"""structlog set-up: console lines for people, JSON lines for machines.

What must never reach a log line, whichever library writes it: API keys and
bearer tokens (:func:`scrub`), and tenants' data. The database drivers put
the values of a failing statement into their error messages (Postgres echoes
an invalid value, a unique violation's key, a RAISE's arguments; SQLAlchemy
adds the bound parameters unless the engine hides them), so a traceback shows
a database error by its class and SQLSTATE only (:func:`format_exception`).
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
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


class _ScrubbingFormatter(logging.Formatter):
    """Standard-library records (grpc, asyncio, ...) under the same rules."""

    def formatException(self, ei: Any) -> str:
        return format_exception(ei)

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is logged, not when logging was
    configured: an embedding program (or a test runner) may replace and close it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", fmt: str = "console") -> None:
    """Route structlog (and stdlib logging) to stderr at ``level``."""
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.ExceptionRenderer(format_exception),
            _scrub_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=cast("TextIO", _CurrentStderr())),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=cast("TextIO", _CurrentStderr())
    )
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_ScrubbingFormatter(logging.BASIC_FORMAT))
