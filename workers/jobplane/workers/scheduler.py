"""The scheduler: submits the runs of due recurring schedules (ADR-0041).

A part of its own (``async with Scheduler(engine):``), started by the
sweeper, which every deployment runs: ``jobplane relay`` (unless
``--no-sweep``), the loop of ``jobplane sweep`` (``--once``: one pass) and
``jobplane dev`` tick schedules with no extra process.
Any number may run at once: each due schedule is claimed with ``FOR UPDATE
SKIP LOCKED`` and its runs' jobs commit with its advance
(:mod:`jobplane.store.schedule_ticks`), so each tick is one job.

It looks every ``poll`` seconds (1 s: the shortest interval a schedule may
have); a schedule whose tick fails is rolled back alone, its error in its
``last_error``, and the pass goes on; a pass that fails (the database) is
logged and the next one runs on time.
"""

from __future__ import annotations

import asyncio

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error
from jobplane.store.down import database_transient
from jobplane.store.schedule_ticks import TickReport, tick_once
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Topology

log = structlog.get_logger("jobplane.scheduler")

#: A run submitted later than this after its due time is logged as late.
LATE_SECONDS = 10.0


class Scheduler(Lifecycle):
    """Ticks due schedules every ``poll`` seconds in the background until stopped."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        poll: float = 1.0,
        faults: FaultPoints = NO_FAULTS,
        topology: Topology | None = None,
    ) -> None:
        """``topology``: whose pipelines a schedule's runs may be (None: plain job types)."""
        self._engine = engine
        self._topology = topology
        self._poll = poll
        self._faults = faults
        self._task: asyncio.Task[None] | None = None

    async def tick_once(self) -> TickReport:
        """One pass over the due schedules (and the ticks BUFFER_ONE held back)."""
        report = await tick_once(self._engine, faults=self._faults, topology=self._topology)
        if report.runs or report.refused or report.failed:
            log.info(
                "scheduler.ticked",
                runs=report.runs,
                skipped=report.skipped,
                refused=report.refused,
                failed=report.failed,
                lag_seconds=round(report.lag_seconds, 3),
            )
        if report.lag_seconds > LATE_SECONDS:
            log.warning("scheduler.late", lag_seconds=round(report.lag_seconds, 1))
        return report

    async def start(self) -> None:
        """Tick in the background (the first pass at once)."""
        self._task = asyncio.create_task(self._loop(), name="jobplane-scheduler")

    async def stop(self) -> None:
        """Stop ticking; a pass in flight is cancelled and rolls back (its ticks stay due)."""
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        except Exception as exc:  # the loop catches everything; this is a last guard
            log.error("scheduler.failed", error=describe_error(exc), exc_info=exc)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick_once()
            except Exception as exc:
                # A scheduler that stops ticking loses runs silently: say it, go on.
                if database_transient(exc):
                    log.warning("scheduler.db.error", error=describe_error(exc))
                else:
                    log.error("scheduler.error", error=describe_error(exc), exc_info=exc)
            await asyncio.sleep(self._poll)
