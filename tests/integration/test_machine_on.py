"""``machine.on(transitions, fn)``: a plain function run after each of a job's
transitions it names (ADR-0010), on the real database.

It gets the transition's connection and its :class:`Change` once per changed
row, and nothing for a transition it does not name or one that was refused;
what it writes commits with the transition, and an exception from it undoes
the transition and reaches the caller.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimStatus, ProgressUpdate
from jobplane.store.db import Database
from jobplane.store.machine import AnyConn, Change, StateMachine, Transition, fetch_rows
from jobplane.types import JobState
from tests.support.rows import insert_job, insert_tenant

_TYPE = "machine.on"
_LOG = text(
    "INSERT INTO on_log (job_id, transition, seq) VALUES (:job, :transition, :seq) RETURNING seq"
)


class _Audit:
    """What ``machine.on`` runs: records each change and writes it to ``on_log``
    on the transition's connection; refuses ``refuse`` after writing."""

    def __init__(self, refuse: Transition | None = None) -> None:
        self.seen: list[tuple[Transition, uuid.UUID, JobState | None, str]] = []
        self.refuse = refuse

    async def __call__(self, conn: AnyConn, change: Change) -> None:
        row = change.row
        self.seen.append((change.transition, row["id"], change.from_state, row["state"]))
        job = {"job": row["id"], "transition": change.transition.value, "seq": row["last_seq"]}
        await fetch_rows(conn, _LOG, job)
        if change.transition is self.refuse:
            raise RuntimeError(f"audit refuses {change.transition}")


@pytest.fixture
async def queued(engine: AsyncEngine) -> Envelope:
    """A QUEUED job's dispatch, and the table the audit writes to."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE on_log (job_id uuid, transition text, seq int)"))
    tenant = await insert_tenant(engine, "machine-on")
    job_id, dispatch_id = await insert_job(engine, tenant, "default", _TYPE)
    return Envelope(dispatch_id, job_id, tenant, _TYPE)


async def _logged(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT job_id, transition, seq FROM on_log ORDER BY seq"))
        return [tuple(row) for row in rows]


async def _job(engine: AsyncEngine, job_id: uuid.UUID) -> tuple[str, int]:
    async with engine.connect() as conn:
        row = await conn.execute(
            text("SELECT state, last_seq FROM jobs WHERE id = :id"), {"id": job_id}
        )
        state, seq = row.one()
        return str(state), int(seq)


async def test_the_function_runs_after_each_transition_it_names_and_its_writes_commit(
    engine: AsyncEngine, db: Database, queued: Envelope
) -> None:
    machine = StateMachine()
    audit = _Audit()
    hook = machine.on([Transition.CLAIM, Transition.SUCCEED], audit)
    assert [t for t in Transition if hook.follows(t)] == [Transition.CLAIM, Transition.SUCCEED]
    store = AttemptStore(db, machine=machine, lease_seconds=30)

    claimed = await store.claim(queued)
    assert claimed.status is ClaimStatus.CLAIMED and claimed.attempt is not None
    # A second delivery of the dispatch: the claim is refused, nothing runs.
    again = await store.claim(queued)
    assert again.status is ClaimStatus.IN_FLIGHT
    # Progress is not named.
    await store.write_progress(claimed.attempt, [ProgressUpdate(0.5, "half", {})])
    await store.succeed(claimed.attempt, {"ok": True})

    job = queued.job_id
    assert audit.seen == [
        (Transition.CLAIM, job, JobState.QUEUED, JobState.RUNNING.value),
        (Transition.SUCCEED, job, JobState.RUNNING, JobState.SUCCEEDED.value),
    ]
    # Events 1 (submitted), 2 (claimed), 3 (progress), 4 (succeeded).
    assert await _job(engine, job) == (JobState.SUCCEEDED.value, 4)
    # Written on the transition's connection, with the row as the transition left it.
    assert await _logged(engine) == [(job, "claim", 2), (job, "succeed", 4)]


async def test_a_function_that_raises_undoes_its_transition_and_reaches_the_caller(
    engine: AsyncEngine, db: Database, queued: Envelope
) -> None:
    machine = StateMachine()
    audit = _Audit(refuse=Transition.SUCCEED)
    machine.on([Transition.SUCCEED], audit)
    store = AttemptStore(db, machine=machine, lease_seconds=30)
    claimed = await store.claim(queued)
    assert claimed.status is ClaimStatus.CLAIMED and claimed.attempt is not None
    before = await _job(engine, queued.job_id)

    with pytest.raises(RuntimeError, match="audit refuses succeed"):
        await store.succeed(claimed.attempt, {"ok": True})
    # The job is RUNNING as it was, and the function's own write went with it.
    assert before[0] == JobState.RUNNING.value
    assert await _job(engine, queued.job_id) == before
    assert await _logged(engine) == []
    assert [seen[0] for seen in audit.seen] == [Transition.SUCCEED]
