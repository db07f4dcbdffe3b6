"""The deadline loop: jobs past their deadline ended within about a second (ADR-0044).

Runs inside the sweeper (``jobplane relay`` and ``jobplane sweep`` run one),
on a clock of its own rather than the sweep's (5 s by default): it sleeps
until the earliest deadline of a job not ended, but never longer than
``poll`` seconds (1 s by default), so a job submitted meanwhile with an
earlier deadline is seen by the next wake-up. A job is ended at most about
``poll`` seconds after its deadline (plus the pass's own time) while a
sweeper runs; with none running, at the next claim of its dispatch (a claim
starts no job past its deadline) or when a sweeper starts.

Safe in many processes at once: the store takes the jobs with SKIP LOCKED.
"""

from __future__ import annotations

import asyncio

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.logs import describe_error
from jobplane.names import job_name
from jobplane.store.deadlines import DeadlineStore
from jobplane.store.down import database_transient
from jobplane.tasks import cancel_and_wait

log = structlog.get_logger("jobplane.sweeper")

#: Seconds the loop sleeps at most between two looks at the deadlines.
DEFAULT_POLL = 1.0
# A wake-up just before a deadline (the clocks of Postgres and this process
# differ by a little) finds nothing due, and a due job another transaction
# holds locked is skipped: either way the loop sleeps this long at least.
_MIN_SLEEP = 0.05


class DeadlineLoop:
    """Ends the jobs past their deadline: :meth:`run_once`, or in the background."""

    def __init__(self, engine: AsyncEngine, *, poll: float = DEFAULT_POLL, limit: int = 100):
        self.store = DeadlineStore(engine)
        self._poll = poll
        self._limit = limit
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> int:
        """End every job past its deadline now, a page at a time; how many were."""
        total = 0
        while True:
            ended = await self.store.end_due(limit=self._limit)
            for row in ended:
                log.warning(
                    "job.deadline_exceeded",
                    job=job_name(row["id"]),
                    tenant_id=str(row["tenant_id"]),
                    was=row["from_state"],
                )
            total += len(ended)
            if len(ended) < self._limit:
                return total

    async def start(self) -> None:
        """Run in the background until :meth:`stop`."""
        self._task = asyncio.create_task(self._loop(), name="jobplane-deadlines")

    async def stop(self) -> None:
        """Stop the background loop."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _loop(self) -> None:
        while True:
            wait = self._poll
            try:
                await self.run_once()
                until = await self.store.seconds_until_next()
                if until is not None:
                    wait = min(self._poll, max(until, _MIN_SLEEP))
            except Exception as exc:
                # Whatever the failure, say it and look again next time.
                if database_transient(exc):
                    log.warning("sweeper.db.error", error=describe_error(exc))
                else:
                    log.error("sweeper.deadlines.error", error=describe_error(exc), exc_info=exc)
            await asyncio.sleep(wait)
