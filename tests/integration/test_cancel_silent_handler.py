"""Cancelling a handler that never reports progress.

A running job is cancelled through its row; the worker learns of it from the
cancel notification at once, or from its next heartbeat when the notification
was lost. Neither path may depend on the handler writing progress: a handler
that only waits must be stopped too, and the job must end CANCELLED.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack


def _silent(started: list[str], stopped: list[str]) -> Registry:
    registry = Registry()

    @registry.handler("silent.wait")
    async def wait(ctx: JobContext) -> dict[str, Any]:
        started.append(ctx.name)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped.append(ctx.name)
            raise
        return {}

    return registry


async def test_a_cancel_notification_stops_a_handler_that_reports_nothing(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    began: list[str] = []
    stopped: list[str] = []
    # A lease this long puts the heartbeat after the first one far beyond the
    # test's time limit: only the notification can stop the handler here.
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            registry=_silent(began, stopped),
            worker_options={"lease_seconds": 600.0},
        )
    )
    client = stack.client()
    job = await client.submit("silent.wait", {})
    await eventually(lambda: _is(began == [job.name]))
    claimed = await _lease_expiry(stack, job.id)
    # The early first heartbeat (which would also see a cancel) is behind us.
    await eventually(lambda: _lease_extended(stack, job.id, claimed))

    await client.cancel(job.name, reason="no longer needed")
    done = await asyncio.wait_for(client.wait(job.name), timeout=30)
    assert done.state is JobState.CANCELLED
    assert done.error is not None and done.error.message == "no longer needed"
    assert stopped == [job.name]


async def test_a_heartbeat_stops_a_silent_handler_whose_cancel_notification_was_lost(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    began: list[str] = []
    stopped: list[str] = []
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            registry=_silent(began, stopped),
            worker_options={"lease_seconds": 1.5},
        )
    )
    client = stack.client()
    job = await client.submit("silent.wait", {})
    await eventually(lambda: _is(began == [job.name]))
    # The request as the API stores it, without its notification (NOTIFY
    # is only a hint: one lost costs latency, never the cancel).
    async with engine.begin() as conn:
        requested = await conn.execute(
            text(
                "UPDATE jobs SET cancel_requested_at = now(), cancel_reason = 'lost the hint' "
                "WHERE id = :id AND state = 'running'"
            ),
            {"id": uuid.UUID(job.id)},
        )
        assert requested.rowcount == 1
    done = await asyncio.wait_for(client.wait(job.name), timeout=30)
    assert done.state is JobState.CANCELLED
    assert done.error is not None and done.error.message == "lost the hint"
    assert stopped == [job.name]


async def _lease_expiry(stack: Stack, job_id: str) -> datetime:
    value = await stack.scalar(
        "SELECT lease_expires_at FROM jobs WHERE id = :id", id=uuid.UUID(job_id)
    )
    assert isinstance(value, datetime)
    return value


async def _lease_extended(stack: Stack, job_id: str, since: datetime) -> bool:
    return await _lease_expiry(stack, job_id) > since


async def _is(value: bool) -> bool:
    return value
