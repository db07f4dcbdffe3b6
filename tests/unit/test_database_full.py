"""A database out of disk or memory refuses a call UNAVAILABLE: nothing was
written and the same call passes once there is room (docs/operations.md,
"A full disk")."""

from __future__ import annotations

import asyncpg
import grpc
import pytest

from jobplane.server.status import error_for
from jobplane.store.db import _wrapped
from tests.support.db_errors import asyncpg_error, through_sqlalchemy


def _full(state: str) -> Exception:
    """asyncpg's error for SQLSTATE ``state`` with the message of a disk full."""
    return asyncpg_error(state, "could not extend file")


@pytest.mark.parametrize("state", ["53100", "53200"])  # disk_full, out_of_memory
def test_a_database_out_of_room_is_unavailable_to_callers(state: str) -> None:
    raw = _full(state)
    assert isinstance(_full("53100"), asyncpg.DiskFullError)
    for error in (raw, through_sqlalchemy(raw), _wrapped(raw, "SELECT 1", None)):
        assert error_for(error, "SubmitJob").code is grpc.StatusCode.UNAVAILABLE, repr(error)


def test_a_statement_refused_for_what_it_is_stays_internal() -> None:
    error = _full("42P01")  # undefined_table: no retry mends it
    assert error_for(error, "SubmitJob").code is grpc.StatusCode.INTERNAL
