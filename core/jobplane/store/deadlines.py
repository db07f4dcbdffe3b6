"""Deadlines: jobs not ended by the time they must have, ended FAILED (ADR-0044).

A job submitted with a deadline holds it in ``jobs.deadline``. The sweeper's
deadline pass (:class:`DeadlineStore`) finds the jobs past theirs through the
partial index ``jobs_deadline_due`` (jobs not ended that have one, by
deadline: migration 0022), a page at a time, and applies the machine's
DEADLINE transition to each: FAILED, ``DEADLINE_EXCEEDED``, whatever the
job's stage or attempt. The transition clears the running attempt's fence
(its outcome cannot land) and signals its worker as a cancel is signalled.
What the ended jobs held (a slot of their concurrency key, of a flow limit)
is released after the commit, as after any other end; a release lost to a
crash is the sweeper's held-jobs repair's.

A claim of a job past its deadline starts nothing: CLAIM's guard refuses it
and the claim ends the job instead (:class:`~jobplane.store.attempts.AttemptStore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.concurrency import ended_keys, release_key
from jobplane.store.engine import autocommit
from jobplane.store.flow import ended_limits, limit_keys, release_limit
from jobplane.store.machine import MACHINE, Cause, Row, StateMachine, Transition, state_is
from jobplane.types import JobState

# The index's own predicate, spelled as it is (so the planner uses it).
_NOT_ENDED = f"deadline IS NOT NULL AND {state_is(JobState.QUEUED, JobState.RUNNING)}"
# A page of the jobs past their deadline, the earliest first; rows another
# sweeper (or a claim, or an outcome) holds are left to it.
_DUE = text(
    f"""
    SELECT id, tenant_id FROM jobs
    WHERE {_NOT_ENDED} AND deadline <= now()
    ORDER BY deadline
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)
# Seconds until the earliest deadline of a job not ended (negative: past; NULL: none).
_NEXT = text(f"SELECT extract(epoch FROM min(deadline) - now()) FROM jobs WHERE {_NOT_ENDED}")
_ENDED = ("id", "tenant_id", "concurrency_key", "flow_slots", "from_state")
_CAUSE = Cause("the job did not end by its deadline")


class DeadlineStore:
    """The sweeper's deadline pass: jobs past their deadline ended FAILED."""

    def __init__(self, engine: AsyncEngine, *, machine: StateMachine = MACHINE) -> None:
        self._engine = engine
        self._auto = autocommit(engine)
        self._machine = machine

    async def end_due(self, *, limit: int) -> list[Row]:
        """End up to ``limit`` jobs past their deadline, in one transaction; their rows
        (``id``, ``tenant_id``, ``from_state``, …). What they held is released after."""
        ended: list[Row] = []
        async with self._engine.begin() as conn:
            for row in (await conn.execute(_DUE, {"limit": limit})).all():
                params = {"id": row.id, "tenant_id": row.tenant_id}
                ended.extend(
                    await self._machine.apply(
                        conn, Transition.DEADLINE, params, _CAUSE, returning=_ENDED
                    )
                )
        await self._release(ended)
        return ended

    async def seconds_until_next(self) -> float | None:
        """Seconds until the earliest deadline of a job not ended (0 when one is
        past); None when no job has one."""
        async with self._auto.connect() as conn:
            seconds = (await conn.execute(_NEXT)).scalar_one_or_none()
        return None if seconds is None else max(0.0, float(seconds))

    async def _release(self, ended: Sequence[Row]) -> None:
        """The slots the ended jobs held, or were promised, due to their held jobs."""
        keys: set[tuple[Any, str]] = ended_keys(ended)
        for tenant_id, key in sorted(keys, key=str):
            async with self._engine.begin() as conn:
                await release_key(conn, self._machine, tenant_id, key)
        async with self._auto.connect() as conn:
            flow_keys = await limit_keys(conn, ended_limits(ended))
        for key in flow_keys:
            async with self._engine.begin() as conn:
                await release_limit(conn, self._machine, key)
