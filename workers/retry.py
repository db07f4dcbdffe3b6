"""The retry policy: exponential backoff with jitter, and which database errors
are worth another try."""

from __future__ import annotations

import random

from sqlalchemy.exc import DBAPIError


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> float:
    """Exponential backoff with jitter: up to base·2^(attempt-1), at least half of it."""
    ceiling = min(cap, base * 2 ** max(0, attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


# SQLSTATE classes worth another try: connection exception, insufficient
# resources, operator intervention (admin shutdown, cancel), system error,
# transaction rollback (serialization failure, deadlock). Anything else is
# about the statement and would fail the same way again.
_TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "53", "57", "58", "40"})


def transient_db_error(exc: BaseException) -> bool:
    """True when ``exc`` (a DBAPIError or OSError) may pass if the same write is tried again."""
    if not isinstance(exc, DBAPIError):
        return True  # OSError: the network
    if exc.connection_invalidated:
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return not sqlstate or str(sqlstate)[:2] in _TRANSIENT_SQLSTATE_CLASSES


def db_error_name(exc: DBAPIError) -> str:
    """The driver's class and SQLSTATE, never its message: that may quote values."""
    sqlstate = getattr(exc.orig, "sqlstate", None) or "?"
    cause = exc.orig.__cause__ if exc.orig is not None else None
    name = type(cause).__name__ if cause is not None else type(exc.orig).__name__
    return f"{name}, SQLSTATE {sqlstate}"
