"""The one definition of "the database is down", over the errors each path raises."""

from __future__ import annotations

import socket

import asyncpg
import grpc
import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.server.status import error_for
from jobplane.store.db import Database, _wrapped
from jobplane.store.down import database_down, database_transient, pool_exhausted
from tests.support.db_errors import asyncpg_error, through_sqlalchemy

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


def _fatal(state: str) -> Exception:
    """asyncpg's error for SQLSTATE ``state`` sent as FATAL, as one ending the session is."""
    return asyncpg_error(state, severity="FATAL")


def test_asyncpg_raises_cannot_connect_now_for_57p03() -> None:
    assert isinstance(_fatal("57P03"), asyncpg.CannotConnectNowError)


@pytest.mark.parametrize(("state", "down"), CASES)
def test_each_path_of_a_database_error_reads_alike(state: str, down: bool) -> None:
    raw = _fatal(state)
    for error in (raw, through_sqlalchemy(raw), _wrapped(raw, "SELECT 1", None)):
        assert database_down(error) is down, repr(error)
        if down:
            assert database_transient(error)


@pytest.mark.parametrize("state", [state for state, down in CASES if down])
def test_a_database_that_is_down_is_unavailable_to_callers(state: str) -> None:
    for error in (_fatal(state), through_sqlalchemy(_fatal(state))):
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


def test_no_writable_host_of_a_multi_host_url_is_unavailable_not_internal() -> None:
    # target_session_attrs=read-write while a failover has left no primary:
    # asyncpg raises an InternalClientError subclass, which must not be INTERNAL.
    raw = asyncpg.TargetServerAttributeNotMatched("None of the hosts match the target attribute")
    for error in (raw, through_sqlalchemy(raw), _wrapped(raw, "(connect)", None)):
        assert database_down(error), repr(error)
        assert error_for(error, "SubmitJob").code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("state", ["25006", "57P01", "08006"])
def test_a_demoted_or_shut_down_primary_is_unavailable_not_internal(state: str) -> None:
    # 25006: a statement on the old primary after it became a standby;
    # 57P01: its sessions ended by the switchover's shutdown.
    for error in (_fatal(state), through_sqlalchemy(_fatal(state))):
        assert error_for(error, "SubmitJob").code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(10)
def test_an_exception_chain_that_loops_is_read_once() -> None:
    """A chain back to itself (an exception raised again while handling one that
    it caused) is read to its end once: an answer, not a loop."""
    first, second = RuntimeError("first"), ValueError("second")
    first.__cause__, second.__context__ = second, first
    assert database_down(first) is False
    down = ConnectionResetError("reset")
    first.__cause__, second.__cause__, down.__context__ = second, down, first
    assert database_down(first) is True
