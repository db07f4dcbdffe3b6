"""`jobplane_throttled_starts_total`: each claim a flow limit or a concurrency key
refuses counts once, labelled by the limit (never a key) and the job type, on a
Python worker and on WorkerService alike."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import grpc
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.observe.metrics import CONCURRENCY_KEY, Metrics, WorkerMetrics
from jobplane.topology import RateLimitSpec, Topology
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, Registry
from tests.integration.test_observability import samples, value
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

_THROTTLED = "jobplane_throttled_starts_total"


async def _waits_with(client: Any, job: Job, code: str) -> None:
    async def waiting() -> bool:
        return bool((await client.get(job.name)).waiting_code == code)

    await eventually(waiting, timeout=30)


async def _running(client: Any, job: Job) -> None:
    async def running() -> bool:
        return bool((await client.get(job.name)).state is JobState.RUNNING)

    await eventually(running, timeout=30)


async def test_a_worker_counts_the_claims_a_rate_limit_and_a_key_refused(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    limited = replace(topology, rate_limits=(RateLimitSpec("solo", ("solo.op",), max_running=1),))
    release = asyncio.Event()
    registry = Registry()

    @registry.handler("solo.op")
    @registry.handler("keyed.op")
    async def held(ctx: JobContext) -> dict[str, Any]:
        await release.wait()
        return {}

    metrics = Metrics()
    stack = await started(start_stack(engine, database_url, amqp_url, limited, worker=False))
    await stack.start_worker(registry, concurrency=4, interceptors=[WorkerMetrics(metrics)])
    client = stack.client()
    first = await client.submit("solo.op", {})
    await _running(client, first)
    second = await client.submit("solo.op", {})
    await _waits_with(client, second, "RATE_LIMITED")
    keyed = await client.submit("keyed.op", {}, concurrency_key="thread-1")
    await _running(client, keyed)
    behind = await client.submit("keyed.op", {}, concurrency_key="thread-1")
    await _waits_with(client, behind, "CONCURRENCY_LIMIT")

    found = samples((await metrics.exposition()).decode())
    assert value(found, _THROTTLED, limit="solo", type="solo.op") == 1
    assert value(found, _THROTTLED, limit=CONCURRENCY_KEY, type="keyed.op") == 1
    # The key itself is no label value.
    assert not any("thread-1" in dict(labels).values() for (_name, labels) in found)
    release.set()
    done = await asyncio.gather(
        *(client.wait(job.name, timeout=60) for job in (first, second, keyed, behind))
    )
    assert {job.state for job in done} == {JobState.SUCCEEDED}


async def _claim(stack: Stack, stub: Any, metadata: Any, name: str) -> Any:
    envelope = await stack.envelope(name.removeprefix("jobs/"))
    return await stub.ClaimJob(
        workers_pb2.ClaimJobRequest(
            event_id=str(envelope.event_id),
            job_id=str(envelope.job_id),
            tenant_id=str(envelope.tenant_id),
            type=envelope.job_type,
        ),
        metadata=metadata,
    )


async def test_worker_service_counts_the_claims_a_tenant_limit_refused(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    queue = replace(topology.queues[0], max_running_per_tenant=1)
    limited = replace(topology, queues=(queue, *topology.queues[1:]))
    stack = await started(
        start_stack(engine, database_url, amqp_url, limited, relay=False, worker=False)
    )
    metrics = Metrics()
    metrics.know_types(["remote.op"])
    stack.server.workers.metrics = metrics
    worker_key = (await stack.server.keys.create_worker()).key
    client = stack.client()
    first, second = [await client.submit("remote.op", {"i": i}) for i in range(2)]
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub = workers_pb2_grpc.WorkerServiceStub(channel)
        metadata = (("authorization", f"Bearer {worker_key}"),)
        claimed = await _claim(stack, stub, metadata, first.name)
        refused = await _claim(stack, stub, metadata, second.name)
    assert claimed.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
    assert refused.status == workers_pb2.ClaimJobResponse.STATUS_STALE
    assert (await client.get(second.name)).waiting_code == "TENANT_LIMIT"
    found = samples((await metrics.exposition()).decode())
    assert value(found, _THROTTLED, limit=f"queue/{queue.name}", type="remote.op") == 1
