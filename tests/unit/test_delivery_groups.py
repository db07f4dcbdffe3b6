"""The worker's outcome groups (ADR-0028): which failure of a group's statement
runs each of its outcomes alone, and which fails them all.

A statement refused for what one row holds (a value, a constraint) would be
refused again with the same row, so the others must not share its fate: each
is written alone. A passing database error or anything else is every
outcome's error: none of them committed, and each delivery is redelivered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.faults import NO_FAULTS
from jobplane.workers.delivery import Deliveries


class DriverError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"driver error {sqlstate}")
        self.sqlstate = sqlstate


def db_error(sqlstate: str) -> DBAPIError:
    return DBAPIError("UPDATE jobs ...", {}, DriverError(sqlstate))


class Store:
    """finish_many over names: a group holding "bad" fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.groups: list[list[str]] = []

    async def finish_many(self, outcomes: list[str]) -> list[bool]:
        self.groups.append(list(outcomes))
        if "bad" in outcomes:
            raise self.error
        return [True] * len(outcomes)

    async def claim_many(self, requests: list[Any]) -> list[Any]:
        raise AssertionError("no claims here")


async def _finish(error: Exception) -> tuple[list[Any], list[list[str]]]:
    """Three outcomes written in one window, "bad" among them: what each caller got."""
    deliveries: Any = Deliveries.__new__(Deliveries)
    store = Store(error)
    deliveries._store, deliveries._faults, deliveries._intercept = store, NO_FAULTS, None
    _claims, outcomes, _acks = deliveries._group_commit(window=0.05, max_size=64)
    assert outcomes is not None
    results = await asyncio.gather(
        *(outcomes.submit(name) for name in ("a", "bad", "c")), return_exceptions=True
    )
    return results, store.groups


@pytest.mark.parametrize("sqlstate", ["23505", "22P05", "P0001", "44000"])
async def test_a_group_refused_for_a_rows_values_writes_each_outcome_alone(sqlstate: str) -> None:
    error = db_error(sqlstate)
    results, groups = await _finish(error)
    assert results == [True, error, True]
    assert groups == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


@pytest.mark.parametrize(
    "error",
    [db_error("40001"), db_error("08006"), RuntimeError("a bug")],
    ids=["serialization", "connection", "not-the-database"],
)
async def test_a_group_that_failed_otherwise_fails_every_outcome_once(error: Exception) -> None:
    results, groups = await _finish(error)
    assert results == [error, error, error]
    assert groups == [["a", "bad", "c"]]
