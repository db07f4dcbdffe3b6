"""A delivery is acked only after its attempt's outcome is committed.

Acking earlier loses the message when the worker dies before the commit; the
sweeper would repair it a lease later, so no end-to-end check notices. Here the
broker itself is the witness: with a prefetch of one, the broker hands the
worker its next message only after the previous one was acked.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.queues import ready_count
from tests.support.stack import Stack, eventually, start_stack


async def test_the_message_stays_unacked_while_the_outcome_waits_for_its_commit(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    began: list[str] = []
    returned: list[str] = []
    release = asyncio.Event()
    registry = Registry()

    @registry.handler("hold.me")
    async def hold(ctx: JobContext) -> dict[str, Any]:
        began.append(ctx.name)
        if ctx.payload.get("hold"):
            await release.wait()
        returned.append(ctx.name)
        return {"done": True}

    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            registry=registry,
            worker_options={"prefetch": 1},
        )
    )
    queue = topology.queues[0].name
    client = stack.client()
    first = await client.submit("hold.me", {"hold": True})
    await eventually(lambda: _is(began == [first.name]))

    # Another connection holds the job's row lock, so the outcome the
    # worker writes once the handler returns waits for it, uncommitted.
    async with engine.connect() as blocker, blocker.begin():
        await blocker.execute(
            text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": uuid.UUID(first.id)}
        )
        release.set()
        await eventually(lambda: _is(returned == [first.name]))
        await eventually(lambda: _outcome_waits_on_a_lock(stack))

        second = await client.submit("hold.me", {"hold": False})
        await eventually(
            lambda: stack.scalar(
                "SELECT published_at IS NOT NULL FROM outbox WHERE job_id = :id",
                id=uuid.UUID(second.id),
            )
        )
        # Long enough for the broker to deliver the second message if the
        # first one had been acked (it takes milliseconds).
        await asyncio.sleep(1.0)
        assert await ready_count(amqp_url, queue) == 1
        assert began == [first.name]
        assert (await client.get(second.name)).state is JobState.QUEUED
        assert (await client.get(first.name)).state is JobState.RUNNING

    # The lock is gone: the outcome commits, then the ack frees the slot.
    done = await asyncio.wait_for(client.wait(first.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    after = await asyncio.wait_for(client.wait(second.name), timeout=20)
    assert after.state is JobState.SUCCEEDED
    assert began == [first.name, second.name]
    assert await ready_count(amqp_url, queue) == 0


async def _outcome_waits_on_a_lock(stack: Stack) -> bool:
    waiting = await stack.scalar(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock' "
        "AND query LIKE '%UPDATE jobs%'"
    )
    return bool(waiting)


async def _is(value: bool) -> bool:
    return value
