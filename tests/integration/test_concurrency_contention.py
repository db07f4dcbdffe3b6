"""Concurrency keys under contention: several workers, retries, pipelines, a running
count sampled the whole time; never more than the limit RUNNING for a key."""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from tests.integration.test_pipelines import _PIPELINE, Stages, aidj, pipeline
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

_RUNNING = text(
    "SELECT concurrency_key, count(*) FROM jobs "
    "WHERE state = 'running' AND concurrency_key IS NOT NULL GROUP BY concurrency_key"
)


class _Gauge:
    """How many handlers of each key run at once, and the most seen."""

    def __init__(self) -> None:
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.order: dict[str, list[int]] = {}

    def enter(self, key: str, index: int) -> None:
        self.now[key] += 1
        self.most[key] = max(self.most[key], self.now[key])
        self.order.setdefault(key, []).append(index)

    def leave(self, key: str) -> None:
        self.now[key] -= 1


async def _sample(stack: Stack, most: Counter[str], stop: asyncio.Event) -> None:
    """The database's RUNNING count by key, as often as it answers."""
    while not stop.is_set():
        async with stack.engine.connect() as conn:
            rows: list[tuple[str, int]] = [(r[0], r[1]) for r in await conn.execute(_RUNNING)]
            for key, count in rows:
                most[key] = max(most[key], int(count))
        await asyncio.sleep(0.005)


async def test_many_workers_never_run_more_than_a_keys_limit(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    gauge = _Gauge()
    registry = Registry()
    flaky: set[str] = set()

    @registry.handler("keyed.op")
    async def keyed(ctx: JobContext) -> dict[str, Any]:
        key = str(ctx.payload["key"])
        gauge.enter(key, int(ctx.payload["i"]))
        try:
            await asyncio.sleep(random.uniform(0.005, 0.03))
            if ctx.payload["i"] % 4 == 0 and ctx.name not in flaky:
                flaky.add(ctx.name)
                raise RetryableError("once more", delay=0.01)
            return {}
        finally:
            gauge.leave(key)

    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    for _ in range(3):
        await stack.start_worker(registry, concurrency=6)
    limits = {"one": 1, "two": 2, "three": 3}
    stop = asyncio.Event()
    sampled: Counter[str] = Counter()
    sampler = asyncio.create_task(_sample(stack, sampled, stop))
    client = stack.client()
    jobs: list[Job] = []
    try:
        for i in range(60):
            key = list(limits)[i % 3]
            jobs.append(
                await client.submit(
                    "keyed.op",
                    {"key": key, "i": i},
                    concurrency_key=key,
                    concurrency_limit=limits[key],
                    max_attempts=3,
                )
            )
        done = await asyncio.wait_for(
            asyncio.gather(*(client.wait(job.name) for job in jobs)), timeout=90
        )
    finally:
        stop.set()
        await sampler
    assert [job.state for job in done] == [JobState.SUCCEEDED] * len(jobs)
    for key, limit in limits.items():
        assert gauge.most[key] <= limit, (key, gauge.most[key])
        assert sampled[key] <= limit, (key, sampled[key])
    # The limit was reached, not just respected by running one at a time.
    assert gauge.most["three"] >= 2


async def test_jobs_waiting_for_a_key_run_first_in_first_out(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    gauge = _Gauge()
    gate = asyncio.Event()
    registry = Registry()

    @registry.handler("fifo.op")
    async def fifo(ctx: JobContext) -> dict[str, Any]:
        gauge.enter("fifo", int(ctx.payload["i"]))
        try:
            if ctx.payload["i"] == 0:
                await gate.wait()
            return {}
        finally:
            gauge.leave("fifo")

    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    for _ in range(2):
        await stack.start_worker(registry, concurrency=4)
    client = stack.client()
    first = await client.submit("fifo.op", {"i": 0}, concurrency_key="fifo")
    await eventually(lambda: _state_is(client, first, JobState.RUNNING))
    later = [await client.submit("fifo.op", {"i": i}, concurrency_key="fifo") for i in range(1, 8)]
    for job in later:
        await eventually(functools.partial(_held, client, job))
    gate.set()
    await asyncio.wait_for(asyncio.gather(*(client.wait(j.name) for j in later)), timeout=30)
    assert gauge.order["fifo"] == list(range(8))
    assert gauge.most["fifo"] == 1


async def _state_is(client: Any, job: Job, state: JobState) -> bool:
    return bool((await client.get(job.name)).state is state)


async def _held(client: Any, job: Job) -> bool:
    return bool((await client.get(job.name)).waiting_code == "CONCURRENCY_LIMIT")


async def test_pipeline_jobs_of_a_key_run_one_stage_at_a_time(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, _stages = pipeline
    client = stack.client()
    stop = asyncio.Event()
    sampled: Counter[str] = Counter()
    sampler = asyncio.create_task(_sample(stack, sampled, stop))
    try:
        jobs = [
            await client.submit(_PIPELINE, {"track": f"t-{i}"}, concurrency_key="album")
            for i in range(4)
        ]
        done = await asyncio.wait_for(
            asyncio.gather(*(client.wait(job.name) for job in jobs)), timeout=60
        )
    finally:
        stop.set()
        await sampler
    assert [job.state for job in done] == [JobState.SUCCEEDED] * 4
    assert sampled["album"] == 1


# The pipeline's fixtures, used here by name.
__all__ = ["aidj", "pipeline"]
