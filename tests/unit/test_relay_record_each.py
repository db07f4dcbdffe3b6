"""The relay's record of rows one at a time, on a store that answers from a script:
a row another relay took meanwhile is left alone, and a transient database error
while settling a refused row is raised for the relay to wait, not taken for a
refusal of the row."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.store.outbox import GiveUp, OutboxKind, OutboxRow
from jobplane.topology import load_topology
from jobplane.workers.relay_record import Fate, OutboxRecording, Recorded, RowOutcome
from tests.support.db_errors import asyncpg_error, through_sqlalchemy


class _Batch:
    """A claimed batch that records what is written in it."""

    def __init__(self, rows: list[OutboxRow]) -> None:
        self.rows = rows
        self.writes: list[tuple[str, Any]] = []

    async def mark_published(self, ids: list[uuid.UUID]) -> None:
        self.writes.append(("published", ids))

    async def fail(self, row: OutboxRow, code: str, message: str) -> GiveUp:
        self.writes.append(("fail", row.id))
        return GiveUp.JOB_FAILED

    async def mark_failed(self, row: OutboxRow, message: str) -> None:
        self.writes.append(("mark_failed", row.id))


class _Store:
    """``claim_one`` answers each call with the next batch, or raises the next error."""

    def __init__(self, *answers: _Batch | BaseException) -> None:
        self.answers = list(answers)

    @asynccontextmanager
    async def claim_one(self, row_id: uuid.UUID) -> AsyncIterator[_Batch]:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        yield answer


class _Recording(OutboxRecording):
    def __init__(self, store: _Store) -> None:
        self._store = store  # type: ignore[assignment]
        self._topology = load_topology()
        self._intercept = None
        self._held = {}
        self._unroutable_after = 60.0
        self._unroutable_returns = 3
        self.published = 0
        self.failed = 0


def _row() -> OutboxRow:
    return OutboxRow(
        uuid.uuid4(), OutboxKind.JOB_DISPATCH, uuid.uuid4(), "demo.echo", job_id=uuid.uuid4()
    )


async def test_a_row_another_relay_took_meanwhile_is_left_alone() -> None:
    empty = _Batch([])
    store = _Store(empty)
    recording = _Recording(store)
    recorded = await recording._record_each([RowOutcome(_row(), Fate.CONFIRMED)])
    assert store.answers == []  # the row was claimed, and found taken
    assert recorded == Recorded()
    assert empty.writes == [] and recording.published == 0


async def test_a_transient_error_settling_a_refused_row_is_raised_not_taken_for_a_refusal() -> None:
    row = _row()
    lost = through_sqlalchemy(asyncpg_error("08006", "connection failure"))
    later = _Batch([row])
    recording = _Recording(_Store(lost, later))
    refusal = through_sqlalchemy(asyncpg_error("23514", "check violation"))
    with pytest.raises(DBAPIError) as raised:
        await recording._settle_refused(row, refusal)
    assert raised.value is lost
    # Nothing else was tried: the row stays due, and is not failed on its own.
    assert later.writes == [] and recording._held == {} and recording.failed == 0
