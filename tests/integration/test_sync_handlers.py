"""Plain ``def`` handlers: run in the worker's threads, with the same context.

Progress and emits from the handler's thread reach Postgres as an async
handler's do; a cancel reaches the thread through ``ctx.cancelled`` and the
next context call; an error retries or fails the job as any handler's; the
lease is extended while the thread runs.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import EventType, JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import AttemptStopped, PermanentError, Registry, SyncJobContext
from tests.support.stack import Stack, eventually, start_stack

registry = Registry()
# What the handlers saw, by job id.
seen: dict[str, dict[str, Any]] = {}


@registry.handler("sync.report")
def _report(ctx: SyncJobContext) -> dict[str, Any]:
    seen[ctx.id] = {"thread": threading.current_thread().name}
    ctx.progress(0.25, "a quarter", {"step": 1})
    ctx.progress(0.75, "three quarters")
    ctx.emit("sync.made", {"n": ctx.payload["n"]})
    return {"doubled": ctx.payload["n"] * 2}


@registry.handler("sync.loop")
def _loop(ctx: SyncJobContext) -> dict[str, Any]:
    mine = seen.setdefault(ctx.id, {})
    mine["started"] = True
    deadline = time.monotonic() + 60
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    mine["saw_cancelled"] = ctx.cancelled
    try:
        ctx.progress(0.5, "after the cancel")
    except AttemptStopped:
        mine["stopped_at_call"] = True
        raise
    return {"ran_out": True}


@registry.handler("sync.flaky")
def _flaky(ctx: SyncJobContext) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise ValueError("the first attempt fails")
    return {"attempt": ctx.attempt}


@registry.handler("sync.fails")
def _fails(ctx: SyncJobContext) -> dict[str, Any]:
    raise PermanentError("cannot be done", code="SYNC_NOPE")


@registry.handler("sync.long")
def _long(ctx: SyncJobContext) -> dict[str, Any]:
    # Longer than two leases: without heartbeats the lease would run out
    # and the sweeper or another claim would take the job.
    time.sleep(4.5)
    ctx.progress(1.0, "done")
    return {"slept": 4.5}


async def _start(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, **options: Any
) -> Stack:
    return await start_stack(
        engine, database_url, amqp_url, topology, registry=registry, worker_options=options
    )


async def test_a_sync_handler_reports_progress_emits_and_succeeds_in_a_thread(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await _start(engine, database_url, amqp_url, topology)
    try:
        client = stack.client()
        job = await client.submit("sync.report", {"n": 21})
        done = await client.wait(job.name, timeout=30)
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.result == {"doubled": 42}
        assert seen[job.id]["thread"].startswith("jobplane-handler")
        reports = [
            (e.progress, e.message)
            async for e in client.watch(job.name)
            if e.type is EventType.PROGRESS
        ]
        assert reports == [(0.25, "a quarter"), (0.75, "three quarters")]
        made = await stack.scalar(
            "SELECT payload->>'n' FROM events WHERE event_type = 'sync.made' "
            "AND correlation_id = :job",
            job=job.id,
        )
        assert made == "21"
    finally:
        await stack.close()


async def test_a_cancel_reaches_a_sync_handler_that_checks_its_context(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await _start(engine, database_url, amqp_url, topology)
    try:
        client = stack.client()
        job = await client.submit("sync.loop", {})

        async def started() -> bool:
            return bool(seen.get(job.id, {}).get("started"))

        await eventually(started, timeout=30)
        await client.cancel(job.name, reason="not wanted")
        done = await client.wait(job.name, timeout=30)
        assert done.state is JobState.CANCELLED
        assert done.error is not None and done.error.message == "not wanted"
        assert seen[job.id] == {"started": True, "saw_cancelled": True, "stopped_at_call": True}
        # The thread ended: the worker is free again and runs the next job.
        assert not stack.worker or not stack.worker.running_jobs
        again = await client.submit("sync.report", {"n": 1})
        assert (await client.wait(again.name, timeout=30)).state is JobState.SUCCEEDED
    finally:
        await stack.close()


async def test_a_sync_handler_that_raises_is_retried_or_failed_as_an_async_one(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await _start(engine, database_url, amqp_url, topology)
    try:
        client = stack.client()
        flaky = await client.submit("sync.flaky", {}, max_attempts=2)
        fails = await client.submit("sync.fails", {}, max_attempts=3)
        flaky_done = await client.wait(flaky.name, timeout=30)
        assert flaky_done.state is JobState.SUCCEEDED, flaky_done.error
        assert flaky_done.result == {"attempt": 2}
        fails_done = await client.wait(fails.name, timeout=30)
        assert fails_done.state is JobState.FAILED
        assert fails_done.error is not None and fails_done.error.code == "SYNC_NOPE"
        assert fails_done.attempt == 1
    finally:
        await stack.close()


async def test_the_lease_of_a_sync_handler_is_extended_while_its_thread_runs(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await _start(engine, database_url, amqp_url, topology, lease_seconds=2.0)
    try:
        client = stack.client()
        job = await client.submit("sync.long", {}, max_attempts=1)
        claimed = None

        async def running() -> bool:
            nonlocal claimed
            claimed = await stack.scalar(
                "SELECT lease_expires_at FROM jobs WHERE id = :id AND state = 'running'",
                id=uuid.UUID(job.id),
            )
            return claimed is not None

        await eventually(running, timeout=30, interval=0.02)

        async def extended() -> bool:
            later = await stack.scalar(
                "SELECT lease_expires_at FROM jobs WHERE id = :id", id=uuid.UUID(job.id)
            )
            return later is not None and claimed is not None and later > claimed

        await eventually(extended, timeout=10)
        done = await client.wait(job.name, timeout=30)
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.attempt == 1
    finally:
        await stack.close()
