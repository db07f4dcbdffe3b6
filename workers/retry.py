"""The retry policy: exponential backoff with jitter, and which database errors
are worth another try."""

from __future__ import annotations

import random

from sqlalchemy.exc import DBAPIError

from jobplane.store.down import database_transient


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> float:
    """Exponential backoff with jitter: up to base·2^(attempt-1), at least half of it."""
    ceiling = min(cap, base * 2 ** max(0, attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


def transient_db_error(exc: BaseException) -> bool:
    """True when ``exc`` (a DBAPIError or OSError) may pass if the same write is tried again."""
    return database_transient(exc)


def db_error_name(exc: DBAPIError) -> str:
    """The driver's class and SQLSTATE, never its message: that may quote values."""
    sqlstate = getattr(exc.orig, "sqlstate", None) or "?"
    cause = exc.orig.__cause__ if exc.orig is not None else None
    name = type(cause).__name__ if cause is not None else type(exc.orig).__name__
    return f"{name}, SQLSTATE {sqlstate}"
