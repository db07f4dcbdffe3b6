"""Every WorkerService request the fuzzer can make gets a precise answer.

Requests are drawn from the proto descriptors (strategies.py), with hints
naming real attempts (claimed before the fuzzing starts) and real dispatch
messages, so that draws get past validation and the fence too. Each call
goes out as raw bytes with a worker key: a refusal is never INTERNAL or
UNKNOWN, carries ErrorInfo (BadRequest naming the field for
INVALID_ARGUMENT), and wrote nothing; a reply decodes; the server still
reports SERVING.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.server.worker_protocol import Registration, worker_name
from jobplane.topology import Topology
from jobplane.v1 import workers_pb2
from tests.fuzz.conftest import PROFILE
from tests.fuzz.oracle import HANG_SECONDS
from tests.fuzz.strategies import Hints, floats, requests, texts
from tests.fuzz.test_requests import fuzz
from tests.support.answers import check_refusal
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack

pytestmark = [
    pytest.mark.timeout(150 if PROFILE == "quick" else 3600),
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

SERVICE = workers_pb2.DESCRIPTOR.services_by_name["WorkerService"]
METHODS = {m.name: m for m in SERVICE.methods}
_ATTEMPT_FIELDS = [
    f"jobplane.v1.{m.input_type.name}.attempt" for m in SERVICE.methods if m.name != "ClaimJob"
]


@dataclass
class WorkerSeeds:
    """Attempts claimed, and dispatch messages of jobs, for hints to name."""

    refs: list[workers_pb2.AttemptRef]
    bodies: list[bytes]
    job_ids: list[str]
    dispatch_ids: list[str]
    tenant_id: str
    queues: list[str]
    worker_names: list[str]


@dataclass
class WorkerOracle:
    """Calls WorkerService with a worker key and judges each answer."""

    stack: Stack
    channel: grpc.aio.Channel
    key: str
    seeds: WorkerSeeds
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)

    def report(self) -> None:
        """What the shared fuzz loop reports after each example (nothing here)."""

    async def call(self, method: str, body: bytes) -> None:
        before = await self.stack.counts()
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(
            f"/{SERVICE.full_name}/{method}"
        )
        try:
            async with asyncio.timeout(HANG_SECONDS):
                reply = await unary(body, metadata=(("authorization", f"Bearer {self.key}"),))
        except grpc.aio.AioRpcError as error:
            refusal = check_refusal(error)
            self.codes[method, refusal.code.name] += 1
            after = await self.stack.counts()
            assert after == before, f"refused {method} wrote rows: {before} -> {after}"
        else:
            self.codes[method, "OK"] += 1
            GetMessageClass(METHODS[method].output_type).FromString(reply)
        health: Any = health_pb2_grpc.HealthStub(self.channel)
        answer = await health.Check(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=10
        )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def _copy(ref: message.Message) -> Callable[[Any], None]:
    return lambda target: target.CopyFrom(ref)


def hints(seeds: WorkerSeeds) -> Hints:
    """Plausible values per field: real attempts, messages and ids."""
    refs = st.sampled_from(seeds.refs)
    found: dict[str, st.SearchStrategy[Any]] = {name: refs.map(_copy) for name in _ATTEMPT_FIELDS}
    found.update(
        {
            "jobplane.v1.AttemptRef.job": st.sampled_from([r.job for r in seeds.refs]),
            "jobplane.v1.AttemptRef.attempt": st.integers(0, 2),
            "jobplane.v1.AttemptRef.lease_token": st.one_of(
                st.sampled_from([r.lease_token for r in seeds.refs]), st.uuids().map(str)
            ),
            "jobplane.v1.ClaimJobRequest.message_body": st.sampled_from(seeds.bodies),
            "jobplane.v1.HandBackJobRequest.message_body": st.sampled_from(seeds.bodies),
            "jobplane.v1.RegisterWorkerRequest.types": st.sampled_from(["fuzz.work", "demo.echo"]),
            "jobplane.v1.RegisterWorkerRequest.queues": st.sampled_from(seeds.queues),
            "jobplane.v1.RegisterWorkerRequest.concurrency": st.integers(1, 8),
            "jobplane.v1.RegisterWorkerRequest.host": texts(),
            "jobplane.v1.RenewWorkerRequest.name": st.sampled_from(seeds.worker_names),
            "jobplane.v1.StopWorkerRequest.name": st.sampled_from(seeds.worker_names),
            "jobplane.v1.ClaimJobRequest.event_id": st.sampled_from(seeds.dispatch_ids),
            "jobplane.v1.ClaimJobRequest.job_id": st.sampled_from(seeds.job_ids),
            "jobplane.v1.ClaimJobRequest.tenant_id": st.just(seeds.tenant_id),
            "jobplane.v1.ClaimJobRequest.type": st.sampled_from(["fuzz.work", "demo.echo"]),
            "jobplane.v1.Progress.progress": st.one_of(st.floats(0, 1), floats()),
            "jobplane.v1.Progress.message": texts(),
            "jobplane.v1.FailJobRequest.code": st.sampled_from(["", "BROKEN", "TIMEOUT"]),
            "jobplane.v1.FailJobRequest.message": texts(),
            "jobplane.v1.FailJobRequest.retryable": st.booleans(),
            "jobplane.v1.SubmitChildJobRequest.type": st.sampled_from(["fuzz.work", "demo.echo"]),
            "jobplane.v1.SubmitChildJobRequest.key": st.one_of(
                st.sampled_from(["a", "b"]), texts()
            ),
        }
    )
    return found


@pytest.fixture
async def oracle(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> AsyncIterator[WorkerOracle]:
    """A server and relay (no worker), some attempts claimed, a worker key."""
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    refs, bodies, job_ids, dispatch_ids = [], [], [], []
    for n in range(8):
        job = await client.submit("fuzz.work", {"n": n})
        envelope = await stack.envelope(job.id)
        bodies.append(envelope.encode())
        job_ids.append(str(envelope.job_id))
        dispatch_ids.append(str(envelope.event_id))
        if n < 6:  # two stay queued, for claims to take
            claimed = await stack.server.workers.claim(envelope)
            attempt = claimed.result.attempt
            assert attempt is not None
            refs.append(
                workers_pb2.AttemptRef(
                    job=job.name, attempt=attempt.attempt, lease_token=str(attempt.lease_token)
                )
            )
    bodies.append(b'{"v":1}')
    queues = [q.name for q in stack.topology.queues]
    registered = [
        await stack.server.workers.register(Registration(["fuzz.work"], queues, 1))
        for _ in range(3)
    ]
    seeds = WorkerSeeds(
        refs,
        bodies,
        job_ids,
        dispatch_ids,
        str(stack.tenant_id),
        queues,
        [worker_name(w) for w in registered],
    )
    key = (await stack.server.keys.create_worker()).key
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        judge = WorkerOracle(stack, channel, key, seeds)
        yield judge
    print(f"\n{sum(judge.codes.values())} calls: {dict(judge.codes)}")


@pytest.mark.parametrize("method", sorted(METHODS))
async def test_every_worker_request_message(oracle: WorkerOracle, method: str) -> None:
    strategy = requests(METHODS[method].input_type, hints(oracle.seeds))

    async def judge(request: Any) -> None:
        await oracle.call(method, request.SerializeToString())

    await fuzz(oracle, strategy, judge, scale=0.5)  # type: ignore[arg-type]
    # Past validation too: accepted, or refused by the fence or the registration.
    passed = ("OK", "FAILED_PRECONDITION", "NOT_FOUND")
    assert sum(oracle.codes[method, code] for code in passed) > 0, dict(oracle.codes)


async def test_raw_worker_bodies(oracle: WorkerOracle) -> None:
    strategy = st.tuples(st.sampled_from(sorted(METHODS)), st.binary(max_size=256))

    async def judge(drawn: tuple[str, bytes]) -> None:
        await oracle.call(*drawn)

    await fuzz(oracle, strategy, judge, scale=0.5)  # type: ignore[arg-type]
    assert sum(oracle.codes.values()) > 0
