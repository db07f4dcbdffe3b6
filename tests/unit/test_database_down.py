"""The one definition of "the database is down", over the errors each path raises."""

from __future__ import annotations

import socket

import asyncpg
import grpc
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import (
    AsyncAdapt_asyncpg_connection,
    PGDialect_asyncpg,
)
from sqlalchemy.exc import DBAPIError

from jobplane.server.status import error_for
from jobplane.store.db import Database, _wrapped
from jobplane.store.down import database_down, database_transient, pool_exhausted

# (SQLSTATE, down): a restart or failover refuses or ends sessions (57P01-57P03,
# class 08); a statement refused for what it is stays refused.
CASES = [
    ("57P03", True),  # cannot_connect_now: "the database system is starting up"
    ("57P01", True),  # admin_shutdown
    ("57P02", True),  # crash_shutdown
    ("08006", True),  # connection_failure
    ("53300", True),  # too_many_connections
    ("23505", False),  # unique_violation
    ("42P01", False),  # undefined_table
]


def _asyncpg_error(state: str) -> Exception:
    """The exception asyncpg raises for an ErrorResponse with SQLSTATE ``state``."""
    error = asyncpg.PostgresError.new({"C": state, "M": "message", "S": "FATAL"})
    assert isinstance(error, Exception)
    return error


def _through_sqlalchemy(error: Exception) -> DBAPIError:
    """``error`` as SQLAlchemy's asyncpg dialect translates and wraps it."""
    dbapi = PGDialect_asyncpg.import_dbapi()  # type: ignore[no-untyped-call]
    with pytest.raises(dbapi.Error) as translated:
        AsyncAdapt_asyncpg_connection._handle_exception_no_connection(dbapi, error)
    wrapped = DBAPIError.instance(None, None, translated.value, dbapi.Error)
    assert isinstance(wrapped, DBAPIError)
    return wrapped


def test_asyncpg_raises_cannot_connect_now_for_57p03() -> None:
    assert isinstance(_asyncpg_error("57P03"), asyncpg.CannotConnectNowError)


@pytest.mark.parametrize(("state", "down"), CASES)
def test_each_path_of_a_database_error_reads_alike(state: str, down: bool) -> None:
    raw = _asyncpg_error(state)
    for error in (raw, _through_sqlalchemy(raw), _wrapped(raw, "SELECT 1", None)):
        assert database_down(error) is down, repr(error)
        if down:
            assert database_transient(error)


@pytest.mark.parametrize("state", [state for state, down in CASES if down])
def test_a_database_that_is_down_is_unavailable_to_callers(state: str) -> None:
    for error in (_asyncpg_error(state), _through_sqlalchemy(_asyncpg_error(state))):
        assert error_for(error, "GetJob").code is grpc.StatusCode.UNAVAILABLE


def test_a_server_without_tls_for_a_url_that_requires_it_is_a_refusal_not_an_outage() -> None:
    # asyncpg's error for sslmode=require when the server answers it has no TLS.
    refused = ConnectionError('PostgreSQL server at "127.0.0.1:5432" rejected SSL upgrade')
    assert not database_down(refused)
    assert database_down(ConnectionRefusedError(111, "Connect call failed"))


async def test_a_connection_timed_out_while_being_made_is_the_database_down() -> None:
    """The pool's wait covers making a connection too: timed out there, with room
    in the pool, it is the database that did not answer, not a full pool."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        port = silent.getsockname()[1]
        db = Database(f"postgresql://u@127.0.0.1:{port}/db", size=1, acquire_timeout=0.3)
        try:
            with pytest.raises(DBAPIError) as waited:
                async with db.connect():
                    pass
        finally:
            await db.close()
    assert database_down(waited.value)
    assert not pool_exhausted(waited.value)
