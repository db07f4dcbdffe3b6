"""Database errors as each path raises them: asyncpg's own, and as SQLAlchemy's
asyncpg dialect translates and wraps them."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import (
    AsyncAdapt_asyncpg_connection,
    PGDialect_asyncpg,
)
from sqlalchemy.exc import DBAPIError


def asyncpg_error(state: str, message: str = "message", severity: str = "ERROR") -> Exception:
    """The exception asyncpg raises for an ErrorResponse with SQLSTATE ``state``."""
    error = asyncpg.PostgresError.new({"C": state, "M": message, "S": severity})
    assert isinstance(error, Exception)
    return error


def through_sqlalchemy(error: Exception) -> DBAPIError:
    """``error`` as SQLAlchemy's asyncpg dialect translates and wraps it."""
    dbapi = PGDialect_asyncpg.import_dbapi()  # type: ignore[no-untyped-call]
    with pytest.raises(dbapi.Error) as translated:
        AsyncAdapt_asyncpg_connection._handle_exception_no_connection(dbapi, error)
    wrapped = DBAPIError.instance(None, None, translated.value, dbapi.Error)
    assert isinstance(wrapped, DBAPIError)
    return wrapped
