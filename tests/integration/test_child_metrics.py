"""`jobplane_jobs_submitted_total` on a Python worker: the children it writes
(``ctx.submit``) and a fan-out's children count there, by the child's type and
queue, once each (a replayed child is not created again, so not counted again);
a WorkerService worker's fan-out counts on the server that wrote it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.convert import struct_from_dict
from jobplane.observe.metrics import Metrics, WorkerMetrics
from jobplane.topology import Topology
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, Registry
from tests.integration.test_fan_out_workers import _claim as claim_next
from tests.integration.test_observability import samples, value
from tests.support import services
from tests.support.fan_out import fan_topology
from tests.support.parts import Started
from tests.support.stack import start_stack

pytestmark = pytest.mark.integration

_SUBMITTED = "jobplane_jobs_submitted_total"


@pytest.fixture
async def fans(amqp_url: str) -> AsyncIterator[Topology]:
    names = fan_topology(f"m{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


async def test_a_workers_children_count_once_each_by_type_and_queue(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    registry = Registry()

    @registry.handler("family.parent")
    async def parent(ctx: JobContext) -> dict[str, Any]:
        first = await ctx.submit("family.kid", key="a")
        again = await ctx.submit("family.kid", key="a")  # the same child: not created again
        second = await ctx.submit("family.kid", key="b")
        return {"kids": [first, again, second]}

    @registry.handler("family.kid")
    async def kid(ctx: JobContext) -> dict[str, Any]:
        return {}

    metrics = Metrics()
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    await stack.start_worker(registry, concurrency=4, interceptors=[WorkerMetrics(metrics)])
    client = stack.client()
    done = await client.wait((await client.submit("family.parent", {})).name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    queue = topology.route("family.kid")
    assert queue is not None
    found = samples((await metrics.exposition()).decode())
    assert value(found, _SUBMITTED, type="family.kid", queue=queue.name) == 2
    # The parent was submitted through the server: the worker does not count it.
    assert value(found, _SUBMITTED, type="family.parent", queue=queue.name) == 0


async def test_a_fan_outs_children_count_on_the_worker_that_spawned_them(
    engine: AsyncEngine, database_url: str, amqp_url: str, fans: Topology, started: Started
) -> None:
    registry = Registry()

    @registry.handler("docs.split")
    async def split(ctx: JobContext) -> list[dict[str, Any]]:
        return [{"batch": [word]} for word in ctx.payload["text"].split()]

    @registry.handler("docs.embed")
    async def embed(ctx: JobContext) -> dict[str, Any]:
        return {"vectors": [1]}

    @registry.handler("docs.index")
    async def index(ctx: JobContext) -> dict[str, Any]:
        return {"n": len(ctx.results)}

    metrics = Metrics()
    stack = await started(start_stack(engine, database_url, amqp_url, fans, worker=False))
    await stack.start_worker(registry, concurrency=4, interceptors=[WorkerMetrics(metrics)])
    client = stack.client()
    job = await client.submit("docs.ingest", {"text": "a bb ccc dddd"})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    pipeline = fans.pipeline("docs.ingest")
    assert pipeline is not None
    embed_stage = pipeline.stages[1]
    assert embed_stage.fan_out
    found = samples((await metrics.exposition()).decode())
    assert value(found, _SUBMITTED, type="docs.embed", queue=embed_stage.queue) == 4


async def test_a_worker_service_fan_outs_children_count_on_the_server(
    engine: AsyncEngine, database_url: str, amqp_url: str, fans: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, fans, worker=False))
    metrics = Metrics()
    metrics.know_types(["docs.embed"])
    stack.server.workers.metrics = metrics
    key = (await stack.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    await stack.client().submit("docs.ingest", {"text": "x"})
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub: Any = workers_pb2_grpc.WorkerServiceStub(channel)
        split = await claim_next(stack, stub, metadata)
        assert split.fans_out
        items = [struct_from_dict({"batch": [str(n)]}) for n in range(3)]
        await stub.CompleteJob(
            workers_pb2.CompleteJobRequest(attempt=split.attempt, items=items), metadata=metadata
        )
    pipeline = fans.pipeline("docs.ingest")
    assert pipeline is not None
    found = samples((await metrics.exposition()).decode())
    assert value(found, _SUBMITTED, type="docs.embed", queue=pipeline.stages[1].queue) == 3
