"""What must hold after every call the fuzzer makes, checked against the real server.

Each call goes out as raw bytes on the method's path (so a body need not be
a valid message) and its answer is judged:

- a refusal is never INTERNAL or UNKNOWN, carries ErrorInfo (and BadRequest
  naming the field for INVALID_ARGUMENT), is small, and wrote nothing;
- an accepted SubmitJob can be read back by the SDK through GetJob, ListJobs
  (the whole page decodes) and WatchJob, with what was sent;
- an accepted BatchSubmitJobs answers one job a request, in order, and wrote
  each job it created whole (its event and dispatch) and nothing else; the
  jobs it created read back as SubmitJob's do;
- an accepted PublishEvent answers with a valid event of the caller's tenant
  and wrote one event and one outbox row (none for a replay), which the relay
  can publish;
- every reply decodes in the SDK;
- the server still answers its health check with SERVING.

Between calls every job the fuzzer can name is where its seed left it — the
terminal ones terminal, so that any watch stream ends on its own: a job a
call queued again is cancelled, one a call cancelled is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import event

from jobplane.client import AsyncClient, JobState
from jobplane.convert import dict_from_struct, event_from_pb, job_from_pb
from jobplane.events.convert import event_from_pb as domain_event_from_pb
from jobplane.topology import QueueSpec, StageSpec
from jobplane.types import EventType, Job
from jobplane.v1 import events_pb2, jobs_pb2
from tests.support.answers import Refusal, check_refusal
from tests.support.stack import Stack

SERVICE = jobs_pb2.DESCRIPTOR.services_by_name["JobService"]
EVENT_SERVICE = events_pb2.DESCRIPTOR.services_by_name["EventService"]
# SubscribeEvents never ends by itself: tests/integration/test_subscribe_events.py
# covers its requests, with a bad-request table.
METHODS = {
    m.name: m
    for service in (SERVICE, EVENT_SERVICE)
    for m in service.methods
    if m.name != "SubscribeEvents"
}
_REPLIES: dict[str, type[message.Message]] = {
    "PublishEvent": events_pb2.Event,
    "SubmitJob": jobs_pb2.Job,
    "BatchSubmitJobs": jobs_pb2.BatchSubmitJobsResponse,
    "GetJob": jobs_pb2.Job,
    "ListJobs": jobs_pb2.ListJobsResponse,
    "CancelJob": jobs_pb2.Job,
    "RetryJob": jobs_pb2.Job,
    "WatchJob": jobs_pb2.WatchJobResponse,
}
# A call that has not answered in this long is a hang, not a slow answer.
HANG_SECONDS = 60.0
# Domain events stored (Stack.counts counts jobs, their events and dispatches).
_EVENT_ROWS = "SELECT count(*) FROM events"

Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass
class Seeds:
    """Jobs and tokens made before the fuzzing starts, for hints to name."""

    queued: list[str]
    terminal: list[str]
    page_tokens: list[str]


@dataclass
class Oracle:
    """Makes a call, then checks everything that must hold after it."""

    stack: Stack
    channel: grpc.aio.Channel
    client: AsyncClient
    seeds: Seeds
    outcomes: Counter[str] = field(default_factory=Counter)
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    unreported: list[str] = field(default_factory=list)

    @property
    def auth(self) -> Metadata:
        """The stack's key, as the SDK sends it."""
        return (("authorization", f"Bearer {self.stack.key}"),)

    async def call(
        self, method: str, body: bytes, metadata: Metadata | None = None
    ) -> Refusal | None:
        """Send ``body`` to ``method`` and judge the answer: the refusal, if refused."""
        metadata = self.auth if metadata is None else metadata
        before = await self.stack.counts()
        events_before = await self.stack.scalar(_EVENT_ROWS)
        try:
            async with asyncio.timeout(HANG_SECONDS):
                replies = await self._send(method, body, metadata)
        except grpc.aio.AioRpcError as error:
            refusal = check_refusal(error)
            self.codes[method, refusal.code.name] += 1
            # One line per field, not per label key.
            field_name = re.sub(r"\[.*\]$", "[…]", refusal.field or "")
            self._count(f"{method}: {refusal.code.name} {refusal.reason} {field_name}")
            after = await self.stack.counts()
            assert after == before, f"refused {method} wrote rows: {before} -> {after}"
            assert await self.stack.scalar(_EVENT_ROWS) == events_before, method
            await self.check_serving()
            return refusal
        self.codes[method, "OK"] += 1
        self._count(f"{method}: OK")
        await self._accepted(method, body, replies, before, events_before)
        await self.check_serving()
        return None

    async def _send(self, method: str, body: bytes, metadata: Metadata) -> list[bytes]:
        path = f"/{METHODS[method].containing_service.full_name}/{method}"
        if METHODS[method].server_streaming:
            stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = self.channel.unary_stream(
                path
            )
            return [reply async for reply in stream(body, metadata=metadata)]
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(path)
        return [await unary(body, metadata=metadata)]

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.unreported.append(outcome)

    def report(self) -> None:
        """Hand the outcomes since the last report to hypothesis' statistics.

        Call it from the thread that runs the hypothesis test.
        """
        while self.unreported:
            event(self.unreported.pop(0))

    async def check_serving(self) -> None:
        """The server, JobService and EventService still report SERVING."""
        health: Any = health_pb2_grpc.HealthStub(self.channel)
        for service in ("", SERVICE.full_name, EVENT_SERVICE.full_name):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _accepted(
        self,
        method: str,
        body: bytes,
        replies: list[bytes],
        before: dict[str, int],
        events_before: int,
    ) -> None:
        decoded = [_REPLIES[method].FromString(r) for r in replies]
        if method == "ListJobs":
            for job in decoded[0].jobs:  # type: ignore[attr-defined]
                job_from_pb(job)
            return
        if method == "WatchJob":
            seqs = [event_from_pb(e).seq for e in decoded]  # type: ignore[arg-type]
            assert seqs == sorted(set(seqs)), seqs
            return
        if method == "BatchSubmitJobs":
            await self._batch_accepted(body, decoded[0], before)  # type: ignore[arg-type]
            return
        if method == "PublishEvent":
            sent = events_pb2.PublishEventRequest.FromString(body)
            event = domain_event_from_pb(decoded[0])  # type: ignore[arg-type]
            assert event.tenant_id == self.stack.tenant_id
            assert str(event.event_id) == sent.event_id
            after = await self.stack.counts()
            events_after = await self.stack.scalar(_EVENT_ROWS)
            if events_after != events_before:  # not a replay
                assert event.event_type == sent.event_type
                assert _same_json(event.payload, dict_from_struct(sent.payload))
                assert events_after == events_before + 1, (events_before, events_after)
            # No job, and no job dispatch.
            assert after == before, (before, after)
            return
        job = job_from_pb(decoded[0])  # type: ignore[arg-type]
        if method == "SubmitJob":
            request = jobs_pb2.SubmitJobRequest.FromString(body)
            after = await self.stack.counts()
            if after == before:
                # The same request_id and request again: the original job.
                assert job.request_id == request.request_id
                return
            assert after == {k: v + 1 for k, v in before.items()}, (before, after)
            await self.read_back(job, request)
        elif method == "RetryJob":
            assert job.state is JobState.QUEUED
            await self.client.cancel(job.name)
        elif method == "CancelJob":
            assert job.state is JobState.CANCELLED
            await self.client.retry(job.name)

    async def _batch_accepted(
        self, body: bytes, reply: jobs_pb2.BatchSubmitJobsResponse, before: dict[str, int]
    ) -> None:
        sent = jobs_pb2.BatchSubmitJobsRequest.FromString(body)
        jobs = [job_from_pb(job) for job in reply.jobs]
        assert 1 <= len(jobs) == len(sent.requests), (len(jobs), len(sent.requests))
        for job, request in zip(jobs, sent.requests, strict=True):
            assert job.request_id == (request.request_id or job.request_id)
        ids = [r.request_id for r in sent.requests if r.request_id]
        assert len(ids) == len(set(ids)), ids
        after = await self.stack.counts()
        created = after["jobs"] - before["jobs"]
        # Each job it created is whole: one event and one dispatch each.
        assert after == {k: v + created for k, v in before.items()}, (before, after)
        self._count(f"BatchSubmitJobs: created {min(created, 3)}{'+' if created > 3 else ''}")
        if created == len(jobs):
            # No replay among them: the last is the newest job (ids are
            # time-ordered in request order), and reads back as SubmitJob's.
            await self.read_back(jobs[-1], sent.requests[-1])

    async def read_back(self, job: Job, request: jobs_pb2.SubmitJobRequest) -> None:
        """The SDK reads an accepted job back as sent, through every read call."""
        client = self.client
        stored = await client.get(job.name)
        assert stored.name == job.name
        assert stored.state is JobState.QUEUED
        assert stored.type == request.type
        assert _same_json(stored.payload, dict_from_struct(request.payload))
        assert stored.request_id == (request.request_id or stored.request_id)
        assert stored.correlation_id == request.correlation_id
        assert stored.labels == dict(request.labels)
        # A pipeline job runs its first stage, with that stage's defaults.
        pipeline = self.stack.topology.pipeline(request.type)
        defaults: QueueSpec | StageSpec | None = self.stack.topology.route(request.type)
        if pipeline is not None:
            defaults = pipeline.stages[0]
            assert [s.name for s in stored.stages] == [s.name for s in pipeline.stages]
            assert stored.stage == pipeline.stages[0].name
        else:
            assert stored.stages == () and stored.stage == ""
        assert defaults is not None
        assert stored.max_attempts == (request.max_attempts or defaults.max_attempts)
        if request.HasField("timeout"):
            sent = request.timeout.seconds + request.timeout.nanos / 1e9
            assert math.isclose(stored.timeout.total_seconds(), sent, abs_tol=1e-6)
        else:
            assert stored.timeout == timedelta(seconds=defaults.timeout_seconds)

        page = await client.list()
        assert stored.name in [j.name for j in page.jobs]
        by_type = await client.list(type=stored.type, page_size=1)
        assert [j.name for j in by_type.jobs] == [stored.name]

        await client.cancel(stored.name)
        events = [e async for e in client.watch(stored.name)]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[0].type is EventType.QUEUED
        assert events[-1].type is EventType.CANCELLED
        self._count("SubmitJob: read back")


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON: numbers by value, NaN never (it must not get this far)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isfinite(a) and a == b
    return bool(a == b)


async def seed(stack: Stack, client: AsyncClient) -> Seeds:
    """Jobs for hints to name: three cancelled, one queued; and issued page tokens."""
    terminal = []
    for n in range(3):
        job = await client.submit("demo.echo", {"seed": n}, labels={"seed": str(n)})
        await client.cancel(job.name)
        terminal.append(job.name)
    queued = [(await client.submit("seed.queued", {})).name]
    tokens = [
        (await client.list(page_size=1)).next_page_token,
        (await client.list(page_size=1, state=JobState.CANCELLED)).next_page_token,
        (await client.list(page_size=1, type="demo.echo")).next_page_token,
    ]
    assert all(tokens)
    return Seeds(queued=queued, terminal=terminal, page_tokens=tokens)


@contextlib.asynccontextmanager
async def raw_channel(stack: Stack) -> Any:
    """A channel to the stack's server with default client options."""
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        yield channel
