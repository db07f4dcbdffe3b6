"""A database out of disk or memory refuses a call UNAVAILABLE: nothing was
written and the same call passes once there is room (docs/operations.md,
"A full disk")."""

from __future__ import annotations

import asyncpg
import grpc
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import (
    AsyncAdapt_asyncpg_connection,
    PGDialect_asyncpg,
)
from sqlalchemy.exc import DBAPIError

from jobplane.server.status import error_for
from jobplane.store.db import _wrapped


def _asyncpg_error(state: str) -> Exception:
    error = asyncpg.PostgresError.new({"C": state, "M": "could not extend file", "S": "ERROR"})
    assert isinstance(error, Exception)
    return error


def _through_sqlalchemy(error: Exception) -> DBAPIError:
    dbapi = PGDialect_asyncpg.import_dbapi()  # type: ignore[no-untyped-call]
    with pytest.raises(dbapi.Error) as translated:
        AsyncAdapt_asyncpg_connection._handle_exception_no_connection(dbapi, error)
    wrapped = DBAPIError.instance(None, None, translated.value, dbapi.Error)
    assert isinstance(wrapped, DBAPIError)
    return wrapped


@pytest.mark.parametrize("state", ["53100", "53200"])  # disk_full, out_of_memory
def test_a_database_out_of_room_is_unavailable_to_callers(state: str) -> None:
    raw = _asyncpg_error(state)
    assert isinstance(_asyncpg_error("53100"), asyncpg.DiskFullError)
    for error in (raw, _through_sqlalchemy(raw), _wrapped(raw, "SELECT 1", None)):
        assert error_for(error, "SubmitJob").code is grpc.StatusCode.UNAVAILABLE, repr(error)


def test_a_statement_refused_for_what_it_is_stays_internal() -> None:
    error = _asyncpg_error("42P01")  # undefined_table: no retry mends it
    assert error_for(error, "SubmitJob").code is grpc.StatusCode.INTERNAL
