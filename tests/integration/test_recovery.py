"""Timeouts, graceful shutdown, the sweeper and the failed queue."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import aio_pika
import grpc
from grpc_health.v1 import health_pb2
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.topology import Topology
from jobplane.types import EventType
from jobplane.workers.dlq import FailedQueue
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.sweeper import Sweeper
from tests.support.parts import Started
from tests.support.queues import dead_letter
from tests.support.stack import Stack, eventually, start_stack


async def test_attempt_timeout_cancels_and_retries_then_fails(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    began: list[int] = []
    registry = Registry()

    @registry.handler("slow.op")
    async def slow(ctx: JobContext) -> dict[str, Any]:
        began.append(ctx.attempt)
        await asyncio.sleep(30)
        return {}

    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    client = stack.client()
    job = await client.submit("slow.op", {}, max_attempts=2, attempt_timeout=0.3)
    assert job.timeout.total_seconds() == 0.3
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "TIMEOUT"
    assert began == [1, 2]
    # Retryable, but no attempt was left: the failed event says so.
    last = [e async for e in client.watch(job.name)][-1]
    assert last.data["error"]["attempts_exhausted"] is True


async def test_queue_default_timeout_applies(stack: Stack) -> None:
    job = await stack.client().submit("demo.echo", {})
    assert job.timeout.total_seconds() == stack.topology.queues[0].timeout_seconds


async def test_shutdown_gives_grace_then_requeues_without_spending_an_attempt(
    stack: Stack,
) -> None:
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 200, "interval_ms": 20}, max_attempts=1)
    await eventually(lambda: _state_is(stack, job.name, JobState.RUNNING))
    assert stack.worker is not None
    await stack.worker.stop(grace=0.2)
    stack.worker = None

    interrupted = await client.get(job.name)
    assert interrupted.state is JobState.QUEUED
    assert interrupted.error is not None and interrupted.error.code == "WORKER_SHUTDOWN"
    assert interrupted.error.message == "the worker shut down during the attempt"

    # max_attempts is 1, yet the job runs again: the interrupted attempt was refunded.
    await stack.start_worker()
    done = await asyncio.wait_for(client.wait(job.name), timeout=30)
    assert done.state is JobState.SUCCEEDED
    assert done.attempt == 2


async def test_server_stop_reports_not_serving_and_ends_streams(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 500, "interval_ms": 20})
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        from jobplane.v1 import jobs_pb2, jobs_pb2_grpc

        stub = jobs_pb2_grpc.JobServiceStub(channel)
        stream = stub.WatchJob(
            jobs_pb2.WatchJobRequest(name=job.name),
            metadata=(("authorization", f"Bearer {stack.key}"),),
        )
        first = await stream.read()
        assert isinstance(first, jobs_pb2.WatchJobResponse) and first.seq == 1
        stopping = asyncio.create_task(stack.server.stop(grace=5))
        codes = set()
        try:
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    break
        except grpc.aio.AioRpcError as exc:
            codes.add(exc.code())
        await stopping
        # Ended by the server with UNAVAILABLE: the SDK resumes it elsewhere.
        assert codes == {grpc.StatusCode.UNAVAILABLE}
    status = await stack.server.health.Check(health_pb2.HealthCheckRequest(), None)  # type: ignore[arg-type]
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_sweeper_requeues_an_expired_lease_and_fails_when_none_left(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    again = await client.submit("demo.echo", {"n": 1}, max_attempts=2)
    doomed = await client.submit("demo.echo", {"n": 2}, max_attempts=1)
    # A worker claims both, then dies: its messages are gone, its leases run out.
    attempts = AttemptStore(stack.db, lease_seconds=0.2)
    for job in (again, doomed):
        claim = await attempts.claim(await stack.envelope(job.id))
        assert claim.status is ClaimStatus.CLAIMED
    await stack.scalar("UPDATE outbox SET published_at = now() RETURNING 1")
    await asyncio.sleep(0.4)

    sweepers = [Sweeper(engine, lease_grace=0.0, retry_base_delay=0.01) for _ in range(3)]
    reports = await asyncio.gather(*(s.sweep_once() for s in sweepers))
    assert sum(r.requeued for r in reports) == 1  # several sweepers, each job once
    assert sum(r.failed for r in reports) == 1

    lost = await client.get(doomed.name)
    assert lost.state is JobState.FAILED
    assert lost.error is not None and lost.error.code == "LEASE_EXPIRED"
    # No attempts are left: the final error does not say it is retryable.
    assert lost.error.retryable is False

    requeued = await client.get(again.name)
    assert requeued.state is JobState.QUEUED
    await stack.start_relay()
    await stack.start_worker()
    done = await asyncio.wait_for(client.wait(again.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    assert done.attempt == 2
    events = [e async for e in client.watch(again.name)]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert EventType.RETRY_SCHEDULED in [e.type for e in events]


async def test_the_sweepers_retry_of_an_expired_lease_backs_off_by_its_queue(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # Far from the defaults (1 s, capped at 300 s): a wait of the default
    # backoff cannot pass for the queue's.
    slow = replace(
        topology,
        queues=tuple(
            replace(q, retry_base_delay=400.0, retry_max_delay=500.0) for q in topology.queues
        ),
    )
    stack = await started(
        start_stack(engine, database_url, amqp_url, slow, relay=False, worker=False)
    )
    job = await stack.client().submit("demo.echo", {}, max_attempts=3)
    attempts = AttemptStore(stack.db)
    sweeper = Sweeper(engine, topology=slow, lease_grace=0.0)
    waits = []
    for _ in range(2):
        claim = await attempts.claim(await stack.envelope(job.id))
        assert claim.status is ClaimStatus.CLAIMED
        # Its worker died: the lease ran out long ago.
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE jobs SET lease_expires_at = now() - interval '1 h' WHERE id = :id"),
                {"id": job.id},
            )
        assert (await sweeper.sweep_once()).requeued == 1
        waits.append(
            await stack.scalar(
                "SELECT extract(epoch FROM next_attempt_time - now()) FROM jobs WHERE id = :id",
                id=job.id,
            )
        )
        due = await stack.scalar(
            "SELECT extract(epoch FROM o.available_at - j.next_attempt_time) "
            "FROM jobs j JOIN outbox o ON o.id = j.dispatch_id WHERE j.id = :id",
            id=job.id,
        )
        assert abs(due) < 1  # the new dispatch is due when the job says
    # 400 s at most, at least half of it; then 800 s capped at 500 s, at least half.
    # (A second of slack for the time between the sweep and the read.)
    assert 199 <= waits[0] <= 400, waits
    assert 249 <= waits[1] <= 500, waits


async def _redeliver(amqp_url: str, queue: str) -> None:
    """Take the waiting message and die holding it: the broker redelivers it."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        held = await (await channel.get_queue(queue)).get(timeout=10, no_ack=False)
        assert held is not None and not held.redelivered
    # Closed without an ack: the message is back, marked redelivered.


async def test_redelivery_of_a_dead_workers_message_waits_out_the_lease(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    job = await client.submit("demo.echo", {"x": 1})
    await eventually(
        lambda: stack.scalar(
            "SELECT count(*) = 1 FROM outbox WHERE kind = 'job.dispatch' "
            "AND published_at IS NOT NULL"
        )
    )
    # Claimed by a worker that then died holding its message.
    attempts = AttemptStore(stack.db, lease_seconds=1.0)
    assert (await attempts.claim(await stack.envelope(job.id))).status is (ClaimStatus.CLAIMED)
    await _redeliver(amqp_url, stack.topology.queues[0].name)
    await stack.start_worker(lease_seconds=1.0)
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    assert done.attempt == 2


async def test_a_first_delivery_of_a_running_job_is_a_copy_and_frees_its_slot(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    job = await client.submit("demo.echo", {"x": 1})
    # Another worker runs it under a long lease; this message is a copy
    # (a relay that published twice), not the one that worker holds.
    attempts = AttemptStore(stack.db, lease_seconds=600.0)
    assert (await attempts.claim(await stack.envelope(job.id))).status is (ClaimStatus.CLAIMED)
    await stack.start_worker(prefetch=1, concurrency=1)
    # With one slot, a copy waiting out a ten-minute lease would hold it.
    other = await client.submit("demo.echo", {"y": 2})
    assert (await asyncio.wait_for(client.wait(other.name), timeout=20)).state is (
        JobState.SUCCEEDED
    )
    running = await client.get(job.name)
    assert running.state is JobState.RUNNING and running.attempt == 1


async def test_failed_queue_list_replay_purge(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    job = await client.submit("demo.echo", {"from": "dlq"})
    await stack.scalar("UPDATE outbox SET published_at = now() RETURNING 1")
    stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo")
    failed = FailedQueue(amqp_url, stack.topology)
    await dead_letter(amqp_url, stack.topology, await stack.envelope(job.id), stray)

    listed = await failed.list()
    assert sorted(m.envelope.job_id for m in listed if m.envelope) == sorted(
        [uuid.UUID(job.id), stray.job_id]
    )
    assert len(await failed.list()) == 2  # listing leaves them queued

    report = await failed.replay(engine)
    assert report.replayed == [job.name]
    assert report.kept == [f"jobs/{stray.job_id}"]

    await stack.start_relay()
    await stack.start_worker()
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    assert await failed.purge() == 1
    assert await failed.list() == []


async def test_delivery_limit_dead_letters_a_crash_looping_message(
    amqp_url: str, topology: Topology
) -> None:
    from jobplane.topology import declare

    # Its own exchange and failed queue: no worker of another test sees these.
    base = topology.prefixed("limit.")
    limited = replace(base, queues=(replace(base.queues[0], delivery_limit=2),))
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await declare(channel, limited)
        await exchange.publish(aio_pika.Message(b"poison", message_id="p1"), "loop.x")
        queue = await channel.get_queue(limited.queues[0].name)
        deliveries = 0
        for _ in range(5):
            message = await queue.get(no_ack=False, fail=False, timeout=5)
            if message is None:
                break
            deliveries += 1
            await message.nack(requeue=True)

        async def dead_lettered() -> bool:
            failed = await channel.declare_queue(limited.failed_queue, passive=True)
            return failed.declaration_result.message_count == 1

        await eventually(dead_lettered)
        # Dead-lettered once delivered unsuccessfully more than the limit:
        # three deliveries, not the five tries we would have made.
        assert deliveries == 3


async def _state_is(stack: Stack, name: str, state: JobState) -> bool:
    return (await stack.client().get(name)).state is state


async def test_cancel_stops_a_waiting_retry(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    from jobplane.workers.handlers import RetryableError

    registry = Registry()

    @registry.handler("later.op")
    async def later(ctx: JobContext) -> dict[str, Any]:
        raise RetryableError("come back later", delay=60)

    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    client = stack.client()
    job = await client.submit("later.op", {})
    await eventually(lambda: _has_next_attempt(stack, job.name))
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED
    assert waiting.next_attempt_time is not None
    assert waiting.error is not None and waiting.error.message == "come back later"
    pending = "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
    assert await stack.scalar(pending) == 1

    cancelled = await client.cancel(job.name)
    assert cancelled.state is JobState.CANCELLED
    assert cancelled.next_attempt_time is None
    assert await stack.scalar(pending) == 0  # the retry was a row, and it is gone


async def test_a_fenced_out_attempt_cannot_write(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    from jobplane.store.attempts import LeaseLost, ProgressUpdate

    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    job = await client.submit("demo.echo", {})
    envelope = await stack.envelope(job.id)
    attempts = AttemptStore(stack.db, lease_seconds=0.1)
    stale = (await attempts.claim(envelope)).attempt
    assert stale is not None
    await asyncio.sleep(0.3)
    winner = (await attempts.claim(envelope)).attempt  # the lease ran out: a new attempt
    assert winner is not None and winner.attempt == stale.attempt + 1
    before = await client.get(job.name)

    update = ProgressUpdate(0.5, "stale", {})
    for write in (
        lambda: attempts.write_progress(stale, [update]),
        lambda: attempts.heartbeat(stale),
        lambda: attempts.succeed(stale, {"stale": True}),
        lambda: attempts.fail(stale, "X", "stale", retryable=False),
    ):
        try:
            await write()
        except LeaseLost:
            pass
        else:
            raise AssertionError("a stale attempt wrote")
    after = await client.get(job.name)
    assert after == before

    await attempts.succeed(winner, {"winner": True})
    assert (await client.get(job.name)).result == {"winner": True}


async def _has_next_attempt(stack: Stack, name: str) -> bool:
    return (await stack.client().get(name)).next_attempt_time is not None


async def test_one_sweep_repairs_every_expired_lease_batch_after_batch(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    """Five dead attempts, batches of two: the pass goes on while batches come
    back whole, whether their jobs were retried or failed (last attempts)."""
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    last = [await client.submit("demo.echo", {}, max_attempts=1) for _ in range(4)]
    more = await client.submit("demo.echo", {}, max_attempts=3)
    attempts = AttemptStore(stack.db)
    for job in [*last, more]:
        claim = await attempts.claim(await stack.envelope(job.id))
        assert claim.status is ClaimStatus.CLAIMED
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE jobs SET lease_expires_at = now() - interval '1 h'"))
    report = await Sweeper(engine, lease_grace=0.0, batch_size=2).sweep_once()
    assert (report.failed, report.requeued) == (4, 1)
    states = await stack.scalar("SELECT array_agg(state::text ORDER BY state::text) FROM jobs")
    assert states == ["failed"] * 4 + ["queued"]
