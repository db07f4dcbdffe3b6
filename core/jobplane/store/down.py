"""One definition of "the database is down", for every process.

A statement can fail because Postgres refused *it* (a constraint, a bug: the
same statement fails again) or because the database could not be reached or
dropped the session (a restart, a failover, ``pg_terminate_backend``: the
same statement works later). Callers treat the second kind alike everywhere
— the server answers UNAVAILABLE so clients repeat the call; workers, relays
and sweepers wait and try again — so it is decided here, once.

No connection of a process's own pool coming free in time is neither: the
database answers, the process asks more of it at once than its pool holds.
It is retried as the database down is (:func:`database_unavailable`), but
said as what it is (:class:`PoolExhausted`), so that an operator raises the
pool's size rather than looks for an outage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from jobplane.errors import Unavailable
from jobplane.logs import describe_error

# SQLSTATEs of a session the server ended or would not start. Class 08 is
# "connection exception"; 57P01-57P03 are shutdowns and "cannot connect now";
# 53300 is too_many_connections; 25006 (read-only transaction) is what a
# demoted primary answers after a failover until clients reconnect.
_DOWN_CLASSES = frozenset({"08"})
_DOWN_STATES = frozenset({"57P01", "57P02", "57P03", "53300", "25006"})

_DOWN_TYPES: tuple[type[BaseException], ...] = (
    PoolTimeout,
    OSError,  # includes ConnectionError and TimeoutError
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    # Several hosts, none of them what target_session_attrs asks for: during a
    # failover no node is writable for a few seconds (ADR-0048).
    asyncpg.TargetServerAttributeNotMatched,
)


class DatabaseUnavailable(Unavailable):
    """The database is unreachable or busy right now; the call may be repeated."""


class PoolExhausted(Exception):
    """Every connection of the pool was in use for as long as a statement may wait
    for one: the process needs more connections at once than its pool holds."""


def pool_exhausted(exc: BaseException) -> bool:
    """True when ``exc`` is (or wraps) :class:`PoolExhausted`."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PoolExhausted):
            return True
        orig = current.orig if isinstance(current, DBAPIError) else None
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


def database_unavailable(exc: BaseException) -> bool:
    """True when the same call may work later with nothing changed: the database is
    down (:func:`database_down`) or the process's pool had no connection free."""
    return pool_exhausted(exc) or database_down(exc)


def database_down(exc: BaseException) -> bool:
    """True when ``exc`` means the database (not the statement) failed.

    Looks through SQLAlchemy's wrapper and the exception chain, since drivers
    wrap the socket error that says what happened.
    """
    if pool_exhausted(exc):
        return False  # the wait that timed out was the pool's (its TimeoutError is an OSError)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _tls_refused(current):
            return False
        if isinstance(current, DBAPIError):
            if current.connection_invalidated:
                return True
            if isinstance(current.orig, BaseException) and _down(current.orig):
                return True
        elif _down(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _tls_refused(exc: BaseException) -> bool:
    """Whether the server answered that it has no TLS to a URL that requires it.

    That is the server's configuration, not an outage: it answers the same
    to every try (sslmode=require against a server without TLS), so it is said
    once rather than waited out. asyncpg raises it as a bare ConnectionError.
    """
    return isinstance(exc, ConnectionError) and "rejected SSL upgrade" in str(exc)


def _down(exc: BaseException) -> bool:
    if isinstance(exc, _DOWN_TYPES):
        return True
    state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if isinstance(state, str) and state and (state[:2] in _DOWN_CLASSES or state in _DOWN_STATES):
        return True
    cause = exc.__cause__
    return cause is not None and cause is not exc and isinstance(cause, _DOWN_TYPES)


# Besides a database that is down, what may pass when the same statement is
# tried again: a serialization failure or deadlock (class 40), insufficient
# resources (53), operator intervention such as a cancelled statement (57) and
# a system error (58). Anything else is about the statement itself.
_TRANSIENT_CLASSES = frozenset({"40", "53", "57", "58"})


def database_transient(exc: BaseException) -> bool:
    """True when trying the same statement again may work (:func:`database_down` or a
    transient refusal); False when Postgres or the driver refused the statement for
    what it is (an error without a SQLSTATE that is not a lost connection is the
    driver refusing a value: it would refuse it again)."""
    if database_unavailable(exc):
        return True
    state = sqlstate(exc)
    return state is not None and state[:2] in _TRANSIENT_CLASSES


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE Postgres answered with, looking through wrappers; None if none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(state, str) and state:
            return state
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def database_error_name(exc: BaseException) -> str:
    """The driver's error class and SQLSTATE, never its message (that may quote values)."""
    inner: BaseException = exc
    while isinstance(inner, DBAPIError) and isinstance(inner.orig, BaseException):
        inner = inner.orig.__cause__ or inner.orig
    return f"{type(inner).__name__}, SQLSTATE {sqlstate(exc) or '?'}"


T = TypeVar("T")


async def until_database_up(
    op: Callable[[], Awaitable[T]], log: Any, *, max_delay: float = 10.0
) -> T:
    """``op()``, repeated with a growing backoff while the database is down (or the
    pool has no connection free)."""
    delay = 0.5
    while True:
        try:
            return await op()
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            log.warning("database.unavailable", error=describe_error(exc), retry_in=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


# A transaction Postgres rolled back whole because another held what it
# waited for while waiting for what it held (40P01, deadlock_detected), or
# because a concurrent one changed what it read (40001,
# serialization_failure). Nothing it wrote stays; the same transaction run
# again most likely passes.
CONFLICT_STATES = frozenset({"40P01", "40001"})
#: How many times :func:`again_on_conflict` runs a transaction at most.
CONFLICT_TRIES = 5


def conflicted(exc: BaseException) -> bool:
    """Whether ``exc`` is a deadlock or a serialization failure (:data:`CONFLICT_STATES`)."""
    return sqlstate(exc) in CONFLICT_STATES


async def again_on_conflict(op: Callable[[], Awaitable[T]], log: Any, what: str) -> T:
    """``op()`` (one whole transaction), run again after a deadlock or a
    serialization failure, at most :data:`CONFLICT_TRIES` times in all, after a
    short pause; the last try's error is raised as it is."""
    delay = 0.01
    for _ in range(CONFLICT_TRIES - 1):
        try:
            return await op()
        except Exception as exc:
            if not conflicted(exc):
                raise
            log.info("database.conflict.retry", what=what, error=describe_error(exc))
        await asyncio.sleep(delay)
        delay *= 2
    return await op()
