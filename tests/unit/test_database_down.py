"""The one definition of "the database is down", over the errors each path raises."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import asyncpg
import grpc
import pytest
import structlog
from sqlalchemy.dialects.postgresql.asyncpg import (
    AsyncAdapt_asyncpg_connection,
    PGDialect_asyncpg,
)
from sqlalchemy.exc import DBAPIError
from structlog.testing import capture_logs

from jobplane.server.status import error_for
from jobplane.store import down
from jobplane.store.db import Database, _wrapped
from jobplane.store.down import (
    PoolExhausted,
    database_down,
    database_transient,
    pool_exhausted,
    until_database_up,
)

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


async def test_until_database_up_waits_out_an_outage_with_a_growing_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    # This module's sleeps only, not the loop's.
    monkeypatch.setattr(down, "asyncio", SimpleNamespace(sleep=sleep))
    outcomes: list[Exception | str] = [
        PoolExhausted("all in use"),
        ConnectionRefusedError(111, "refused"),
        ConnectionRefusedError(111, "refused"),
        ConnectionRefusedError(111, "refused"),
        "up",
    ]

    async def op() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    log = structlog.get_logger("test")
    with capture_logs() as lines:
        assert await until_database_up(op, log, max_delay=1.5) == "up"
    assert slept == [0.5, 1.0, 1.5, 1.5]
    assert [(line["event"], line["retry_in"]) for line in lines] == [
        ("database.unavailable", delay) for delay in slept
    ]
    assert lines[0]["error"].endswith("PoolExhausted: all in use")

    async def bug() -> str:
        raise KeyError("k")

    with pytest.raises(KeyError):
        await until_database_up(bug, log)
    assert len(slept) == 4  # a failure that is not the database's is raised at once
