"""Flow limits of the topology, decided at the claim: a limit's RUNNING jobs never
exceed max_running, its starts never exceed its rate, a queue's per-tenant limit
leaves other tenants alone, and a limit changed by a sync applies at the next claim."""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.store.routes import sync_submit_rules
from jobplane.store.sweeps import SweepStore
from jobplane.topology import RateLimitSpec, Topology
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.stack import eventually, start_stack

_RUNNING = text("SELECT count(*) FROM jobs WHERE state = 'running' AND type LIKE :pattern")
_STARTS = text(
    "SELECT start_time FROM jobs WHERE type = :type AND state = 'succeeded' ORDER BY start_time"
)


class _Gauge:
    """How many handlers run at once, and the most seen."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    def enter(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def leave(self) -> None:
        self.now -= 1


async def _sample(engine: AsyncEngine, pattern: str, most: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with engine.connect() as conn:
            count = int((await conn.execute(_RUNNING, {"pattern": pattern})).scalar_one())
        most[0] = max(most[0], count)
        await asyncio.sleep(0.005)


async def _code_is(client: Any, job: Job, code: str) -> bool:
    return bool((await client.get(job.name)).waiting_code == code)


async def _state_is(client: Any, job: Job, state: JobState) -> bool:
    return bool((await client.get(job.name)).state is state)


async def test_many_workers_never_run_more_than_max_running(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    limited = replace(
        topology, rate_limits=(RateLimitSpec("partner", ("partner.*",), max_running=3),)
    )
    gauge = _Gauge()
    registry = Registry()

    @registry.handler("partner.call")
    async def call(ctx: JobContext) -> dict[str, Any]:
        gauge.enter()
        try:
            await asyncio.sleep(random.uniform(0.005, 0.03))
            return {}
        finally:
            gauge.leave()

    stack = await started(start_stack(engine, database_url, amqp_url, limited, worker=False))
    for _ in range(3):
        await stack.start_worker(registry, concurrency=6)
    stop = asyncio.Event()
    sampled = [0]
    sampler = asyncio.create_task(_sample(engine, "partner.%", sampled, stop))
    client = stack.client()
    try:
        jobs = [await client.submit("partner.call", {"i": i}) for i in range(40)]
        done = await asyncio.wait_for(
            asyncio.gather(*(client.wait(job.name) for job in jobs)), timeout=90
        )
    finally:
        stop.set()
        await sampler
    assert [job.state for job in done] == [JobState.SUCCEEDED] * len(jobs)
    assert gauge.most <= 3 and sampled[0] <= 3, (gauge.most, sampled[0])
    # The limit was reached, not just respected by running one at a time.
    assert gauge.most >= 2


def _over_the_rate(starts: list[datetime], per_second: float, burst: float) -> list[Any]:
    """Windows [starts[i], starts[j]] with more starts than per_second * width + burst."""
    over = []
    for i in range(len(starts)):
        for j in range(i, len(starts)):
            width = (starts[j] - starts[i]).total_seconds()
            # A microsecond's rounding of the emission interval, at most.
            if j - i + 1 > per_second * width + burst + 1e-6 * per_second * (j - i + 1):
                over.append((i, j, width))
    return over


async def test_starts_never_exceed_the_rate_and_a_backlog_streams(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    per_second, burst = 20.0, 3.0
    limited = replace(
        topology,
        rate_limits=(RateLimitSpec("quota", ("rated.op",), per_second=per_second, burst=burst),),
    )
    registry = Registry()

    @registry.handler("rated.op")
    async def rated(ctx: JobContext) -> dict[str, Any]:
        return {}

    stack = await started(start_stack(engine, database_url, amqp_url, limited, worker=False))
    for _ in range(2):
        await stack.start_worker(registry, concurrency=8)
    client = stack.client()
    jobs = await asyncio.gather(*(client.submit("rated.op", {"i": i}) for i in range(40)))
    done = await asyncio.wait_for(
        asyncio.gather(*(client.wait(job.name) for job in jobs)), timeout=90
    )
    assert [job.state for job in done] == [JobState.SUCCEEDED] * len(jobs)
    async with engine.connect() as conn:
        starts = [r[0] for r in await conn.execute(_STARTS, {"type": "rated.op"})]
        # Held jobs waited at the rate (a dispatch each more), not in the broker.
        dispatches = (await conn.execute(text("SELECT count(*) FROM outbox"))).scalar_one()
    assert len(starts) == len(jobs)
    assert _over_the_rate(starts, per_second, burst) == []
    assert dispatches > len(jobs)


async def test_a_queues_per_tenant_limit_holds_one_tenant_not_the_other(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    queue = replace(topology.queues[0], max_running_per_tenant=1)
    limited = replace(topology, queues=(queue, *topology.queues[1:]))
    gate = asyncio.Event()
    registry = Registry()

    @registry.handler("tenant.op")
    async def op(ctx: JobContext) -> dict[str, Any]:
        if ctx.payload.get("wait"):
            await gate.wait()
        return {}

    stack = await started(start_stack(engine, database_url, amqp_url, limited, worker=False))
    await stack.start_worker(registry, concurrency=8)
    acme = stack.client()
    other = stack.client(await stack.new_key("globex"))
    first = await acme.submit("tenant.op", {"wait": True})
    await eventually(lambda: _state_is(acme, first, JobState.RUNNING))
    later = [await acme.submit("tenant.op", {"wait": True}) for _ in range(3)]
    for job in later:
        await eventually(functools.partial(_code_is, acme, job, "TENANT_LIMIT"))
    held = await acme.get(later[0].name)
    assert held.state is JobState.QUEUED
    assert f"queue {queue.name} allows 1 running jobs per tenant" in held.waiting_reason
    # Another tenant's job of the same queue is not held by acme's budget.
    theirs = await other.submit("tenant.op", {})
    assert (await asyncio.wait_for(other.wait(theirs.name), 30)).state is JobState.SUCCEEDED
    gate.set()
    done = await asyncio.wait_for(
        asyncio.gather(*(acme.wait(j.name) for j in [first, *later])), timeout=30
    )
    assert [j.state for j in done] == [JobState.SUCCEEDED] * 4


async def test_a_limit_changed_by_a_sync_applies_without_a_restart(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    one = replace(topology, rate_limits=(RateLimitSpec("live", ("live.op",), max_running=1),))
    gate = asyncio.Event()
    gauge = _Gauge()
    registry = Registry()

    @registry.handler("live.op")
    async def live(ctx: JobContext) -> dict[str, Any]:
        gauge.enter()
        try:
            await gate.wait()
            return {}
        finally:
            gauge.leave()

    stack = await started(start_stack(engine, database_url, amqp_url, one, worker=False))
    await stack.start_worker(registry, concurrency=8)
    client = stack.client()
    # The first runs before the others are submitted: claims of concurrent
    # deliveries commit in no set order, so which of three runs would be chance.
    first = await client.submit("live.op", {"i": 0})
    await eventually(functools.partial(_state_is, client, first, JobState.RUNNING))
    jobs = [first, *[await client.submit("live.op", {"i": i}) for i in (1, 2)]]
    for job in jobs[1:]:
        await eventually(functools.partial(_code_is, client, job, "RATE_LIMITED"))
    held = await client.get(jobs[1].name)
    assert "rate limit live allows 1 running at once" in held.waiting_reason
    assert gauge.most == 1
    # `jobplane topology apply` of a file with max_running = 3: the held jobs are
    # released by the sweeper's next pass, and the next claims admit them.
    three = replace(topology, rate_limits=(RateLimitSpec("live", ("live.op",), max_running=3),))
    assert await sync_submit_rules(engine, three, max_payload_bytes=1 << 20)
    await SweepStore(engine).release_held(limit=100)
    for job in jobs:
        await eventually(functools.partial(_state_is, client, job, JobState.RUNNING))
    assert gauge.most == 3
    gate.set()
    done = await asyncio.wait_for(asyncio.gather(*(client.wait(j.name) for j in jobs)), 30)
    assert Counter(j.state for j in done) == {JobState.SUCCEEDED: 3}
