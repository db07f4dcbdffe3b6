"""A live watch feed of one tenant's job is never shared with another tenant.

The server reads each watched job once for all of its watchers in the
process; another tenant asking for the same name while the owner is watching
must still get NOT_FOUND, and no event.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobEvent, JobNotFound
from jobplane.topology import Topology
from jobplane.types import EventType
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.stack import eventually, start_stack


async def test_another_tenant_cannot_join_a_watched_job(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    release = asyncio.Event()
    registry = Registry()

    @registry.handler("hold.me")
    async def hold(ctx: JobContext) -> dict[str, Any]:
        await ctx.progress(0.5, "halfway")
        await release.wait()
        return {}

    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    mine = stack.client()
    theirs = stack.client(await stack.new_key("globex"))
    job = await mine.submit("hold.me", {})
    seen: list[JobEvent] = []

    async def watch() -> None:
        async for event in mine.watch(job.name):
            seen.append(event)

    watcher = asyncio.create_task(watch())
    # The owner's stream is live: the job's feed is open in the server.
    await eventually(lambda: _is(any(e.type is EventType.PROGRESS for e in seen)))

    stolen: list[JobEvent] = []

    async def intrude(after_seq: int) -> None:
        async for event in theirs.watch(job.name, after_seq=after_seq):
            stolen.append(event)

    for after_seq in (0, 1):
        # Bounded: a stream that joined the feed would wait for the job's end.
        with pytest.raises(JobNotFound):
            await asyncio.wait_for(intrude(after_seq), timeout=10)
    assert stolen == []

    release.set()
    await asyncio.wait_for(watcher, timeout=20)
    assert seen[-1].type is EventType.SUCCEEDED
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))


async def _is(value: bool) -> bool:
    return value
