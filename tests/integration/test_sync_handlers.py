"""Plain ``def`` handlers: run in the worker's threads, with the same context.

Progress and emits from the handler's thread reach Postgres as an async
handler's do; a cancel reaches the thread through ``ctx.cancelled`` and the
next context call, and a handler still waiting for a thread never runs; an
error retries or fails the job as any handler's; the lease is extended while
the thread runs; a thread that never returns does not keep the worker's
process from exiting.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import EventType, JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import AttemptStopped, PermanentError, Registry, SyncJobContext
from tests.faults.cluster import Cluster
from tests.support.parts import Started
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


# Holds the worker's only handler thread until the test lets it go.
release = threading.Event()


@registry.handler("sync.blocker")
def _blocker(ctx: SyncJobContext) -> dict[str, Any]:
    seen.setdefault(ctx.id, {})["started"] = True
    release.wait(60)
    return {}


@registry.handler("sync.deaf")
def _deaf(ctx: SyncJobContext) -> dict[str, Any]:
    # Ignores every stop: only the end of its process ends it.
    time.sleep(3600)
    return {}


@registry.handler("sync.queued")
def _queued(ctx: SyncJobContext) -> dict[str, Any]:
    seen.setdefault(ctx.id, {})["ran"] = True
    return {}


async def _start(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, **options: Any
) -> Stack:
    return await start_stack(
        engine, database_url, amqp_url, topology, registry=registry, worker_options=options
    )


async def test_a_sync_handler_reports_progress_emits_and_succeeds_in_a_thread(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(_start(engine, database_url, amqp_url, topology))
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
        "SELECT payload->>'n' FROM events WHERE event_type = 'sync.made' AND correlation_id = :job",
        job=job.id,
    )
    assert made == "21"


async def test_a_cancel_reaches_a_sync_handler_that_checks_its_context(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(_start(engine, database_url, amqp_url, topology))
    client = stack.client()
    job = await client.submit("sync.loop", {})

    async def began() -> bool:
        return bool(seen.get(job.id, {}).get("started"))

    await eventually(began, timeout=30)
    await client.cancel(job.name, reason="not wanted")
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.CANCELLED
    assert done.error is not None and done.error.message == "not wanted"
    assert seen[job.id] == {"started": True, "saw_cancelled": True, "stopped_at_call": True}
    # The thread ended: the worker is free again and runs the next job.
    assert not stack.worker or not stack.worker.running_jobs
    again = await client.submit("sync.report", {"n": 1})
    assert (await client.wait(again.name, timeout=30)).state is JobState.SUCCEEDED


async def test_a_sync_handler_that_raises_is_retried_or_failed_as_an_async_one(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(_start(engine, database_url, amqp_url, topology))
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


async def test_the_lease_of_a_sync_handler_is_extended_while_its_thread_runs(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(_start(engine, database_url, amqp_url, topology, lease_seconds=2.0))
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


async def test_a_cancelled_sync_handler_still_waiting_for_a_thread_never_runs(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    release.clear()
    stack = await started(
        _start(engine, database_url, amqp_url, topology, concurrency=2, sync_threads=1)
    )
    try:
        client = stack.client()
        blocker = await client.submit("sync.blocker", {})

        async def blocking() -> bool:
            return bool(seen.get(blocker.id, {}).get("started"))

        await eventually(blocking, timeout=30)
        queued = await client.submit("sync.queued", {})

        async def claimed() -> bool:
            return queued.name in stack.worker.running_jobs if stack.worker else False

        # Claimed and in a slot, its work item behind the blocker's in the pool.
        await eventually(claimed, timeout=30)
        await client.cancel(queued.name, reason="not wanted")
        assert (await client.wait(queued.name, timeout=30)).state is JobState.CANCELLED

        async def dropped() -> bool:
            return queued.name not in stack.worker.running_jobs if stack.worker else True

        # Its slot is free at once, not after the blocker's thread.
        await eventually(dropped, timeout=10)
        release.set()
        assert (await client.wait(blocker.name, timeout=30)).state is JobState.SUCCEEDED

        async def idle() -> bool:
            return not stack.worker or not stack.worker.running_jobs

        await eventually(idle, timeout=10)
        assert "ran" not in seen.get(queued.id, {})
    finally:
        release.set()


async def test_a_worker_exits_on_sigterm_though_a_sync_handler_ignores_its_stop(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
    started: Started,
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    cluster = Cluster(database_url, amqp_url, topology, tmp_path)
    try:
        args = ["worker", "--handlers", f"{__name__}:registry", "--no-maintenance"]
        worker = await cluster._spawn([*args, "--grace", "1"], "worker.started")
        job = await stack.client().submit("sync.deaf", {})

        async def running() -> bool:
            state = await stack.scalar(
                "SELECT state FROM jobs WHERE id = :id", id=uuid.UUID(job.id)
            )
            return bool(state == "running")

        await eventually(running, timeout=30)
        sent = time.monotonic()
        worker.kill(signal.SIGTERM)
        # Its grace (1 s), then the worker's wait for stopped handlers (10 s),
        # then its exit: a pool thread that is joined at exit would hang it.
        assert await worker.wait(timeout=60) == 0, worker.log.read_text()[-3000:]
        assert time.monotonic() - sent < 45
    finally:
        await cluster.close()
