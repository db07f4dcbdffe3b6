"""WorkerService runs pipeline stages: each claim names its stage and inputs, and a
stage's CompleteJob advances the pipeline, also when the server reads the attempt back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import grpc
import pytest
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState, StageState
from jobplane.convert import struct_from_dict
from jobplane.topology import Topology, load_topology
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from tests.support import services
from tests.support.stack import Stack, start_stack

_AIDJ = Path(__file__).parents[2] / "examples" / "topologies" / "aidj.toml"


@pytest.fixture
async def aidj(amqp_url: str) -> AsyncIterator[Topology]:
    names = load_topology(_AIDJ).prefixed(f"w{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, aidj: Topology
) -> AsyncIterator[Stack]:
    running = await start_stack(engine, database_url, amqp_url, aidj, worker=False)
    yield running
    await running.close()


async def _next_message(amqp_url: str, queue: str) -> bytes:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        source = await channel.get_queue(queue)
        for _ in range(200):
            message = await source.get(fail=False)
            if message is not None:
                await message.ack()
                return message.body
            await asyncio.sleep(0.05)
    raise AssertionError(f"no message on {queue}")


async def test_worker_service_runs_every_stage_of_a_pipeline(stack: Stack) -> None:
    key = (await stack.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    queues = {q.name.rsplit(".", 1)[-1]: q.name for q in stack.topology.queues}
    client = stack.client()
    job = await client.submit("aidj.analyze", {"track": "t-1"})
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)
        seen = []
        for stage in ("native", "neural", "index"):
            body = await _next_message(stack.amqp_url, queues[stage])
            claim = await stub.ClaimJob(
                workers_pb2.ClaimJobRequest(message_body=body), metadata=metadata
            )
            assert claim.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
            seen.append((claim.stage, claim.stage_version, json_format.MessageToDict(claim.inputs)))
            if stage == "neural":
                # As after a restart, or a claim made by another server.
                stack.server.workers._kept.clear()
            await stub.CompleteJob(
                workers_pb2.CompleteJobRequest(
                    attempt=claim.attempt, result=struct_from_dict({"done": stage})
                ),
                metadata=metadata,
            )
    assert seen == [
        ("native", "mir-1.4", {}),
        ("neural", "clap-2", {"native": {"done": "native"}}),
        ("index", "qdrant-1", {"native": {"done": "native"}, "neural": {"done": "neural"}}),
    ]
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED and done.result == {"done": "index"}
    assert [s.state for s in done.stages] == [StageState.SUCCEEDED] * 3
