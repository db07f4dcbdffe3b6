"""Delayed jobs and concurrency keys together: a keyed job with a schedule starts
after both its time and the end of the key's running job (ADR-0039, ADR-0040).

Its dispatch is due at its time; delivered then, its key still full, it is held
(CONCURRENCY_LIMIT, a stored code, which wins over the computed SCHEDULED);
the holder's end releases it, and its new dispatch is due at once, its time
being past. A holder that ends first releases nothing: the job still waits
for its time.
"""

from __future__ import annotations

import asyncio
import functools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.topology import Topology
from jobplane.types import WaitingCode
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

pytestmark = pytest.mark.timeout(120)


async def _code_is(client: Any, job: Job, code: str) -> bool:
    return bool((await client.get(job.name)).waiting_code == code)


@pytest.fixture
async def holding(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> tuple[Any, Job, asyncio.Event]:
    """A client of a stack whose worker runs two jobs at once, the job that holds
    key ``thread`` (RUNNING), and the gate that ends it."""
    gate = asyncio.Event()
    registry = Registry()

    @registry.handler("keyed.op")
    async def keyed(ctx: JobContext) -> dict[str, Any]:
        if ctx.payload.get("hold"):
            await gate.wait()
        return {}

    stack: Stack = await started(
        start_stack(engine, database_url, amqp_url, topology, worker=False)
    )
    await stack.start_worker(registry, concurrency=2)
    client = stack.client()
    holder = await client.submit("keyed.op", {"hold": True}, concurrency_key="thread")
    await eventually(lambda: _running(client, holder))
    return client, holder, gate


async def test_a_delayed_keyed_job_starts_after_its_time_and_its_holders_end(
    holding: tuple[Any, Job, asyncio.Event],
) -> None:
    client, holder, gate = holding
    delayed = await client.submit("keyed.op", {}, concurrency_key="thread", schedule_delay=1.0)
    assert delayed.schedule_time is not None
    assert delayed.waiting_code == WaitingCode.SCHEDULED

    # Its time comes while the holder runs: delivered, and held by its key.
    await eventually(functools.partial(_code_is, client, delayed, "CONCURRENCY_LIMIT"))
    held = await client.get(delayed.name)
    assert held.state is JobState.QUEUED and holder.name in held.waiting_reason
    await asyncio.sleep(0.3)
    assert (await client.get(delayed.name)).state is JobState.QUEUED

    gate.set()
    ended = await client.wait(holder.name, timeout=30)
    done = await client.wait(delayed.name, timeout=30)
    assert ended.state is JobState.SUCCEEDED and done.state is JobState.SUCCEEDED
    assert ended.end_time is not None and done.start_time is not None
    assert done.start_time >= delayed.schedule_time
    assert done.start_time >= ended.end_time
    assert done.waiting_code == ""


async def test_a_holder_that_ends_first_leaves_the_delayed_job_waiting_for_its_time(
    holding: tuple[Any, Job, asyncio.Event],
) -> None:
    client, holder, gate = holding
    # A time rather than a delay: the same rule.
    due = datetime.now(UTC) + timedelta(seconds=1.5)
    delayed = await client.submit("keyed.op", {}, concurrency_key="thread", schedule_time=due)
    assert delayed.schedule_time == due

    gate.set()
    ended = await client.wait(holder.name, timeout=30)
    assert ended.end_time is not None and ended.end_time < delayed.schedule_time
    waiting = await client.get(delayed.name)
    assert waiting.state is JobState.QUEUED and waiting.waiting_code == WaitingCode.SCHEDULED

    done = await client.wait(delayed.name, timeout=30)
    assert done.state is JobState.SUCCEEDED and done.start_time is not None
    assert done.start_time >= delayed.schedule_time
    assert done.start_time - delayed.schedule_time < timedelta(seconds=5)


async def _running(client: Any, job: Job) -> bool:
    return bool((await client.get(job.name)).state is JobState.RUNNING)
