"""Submit → dispatch → work → watch, end to end on real Postgres and RabbitMQ."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from jobplane.client import (
    FailedPrecondition,
    JobAlreadyTerminal,
    JobEvent,
    JobNotRetryable,
    JobState,
)
from jobplane.types import EventType
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from tests.support.parts import Started
from tests.support.stack import Stack


async def collect(stack: Stack, name: str, after_seq: int = 0) -> list[JobEvent]:
    return [e async for e in stack.client().watch(name, after_seq=after_seq)]


async def test_progress_job_succeeds_and_its_stream_is_ordered(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 8, "interval_ms": 20})
    assert job.state is JobState.QUEUED
    assert job.name.startswith("jobs/")

    events = await asyncio.wait_for(collect(stack, job.name), timeout=20)

    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(events) + 1))
    progress = [e.progress for e in events]
    assert progress == sorted(progress)
    assert events[-1].type is EventType.SUCCEEDED
    assert events[-1].terminal
    assert [e for e in events if e.terminal] == [events[-1]]
    assert sum(e.type is EventType.PROGRESS for e in events) == 8
    assert events[0].type is EventType.QUEUED
    assert events[-1].state is JobState.SUCCEEDED

    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED
    assert done.result == {"steps": 8}
    assert done.progress == 1.0
    assert done.attempt == 1
    assert done.last_seq == len(events)
    assert done.start_time is not None and done.end_time is not None


async def test_after_seq_resumes_exactly_and_late_watchers_get_history(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 5, "interval_ms": 10})
    finished = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert finished.state is JobState.SUCCEEDED
    n = finished.last_seq

    # A late joiner gets the whole history, and the stream closes by itself.
    history = await asyncio.wait_for(collect(stack, job.name), timeout=5)
    assert [e.seq for e in history] == list(range(1, n + 1))

    for k in (0, 1, 3, n - 1):
        resumed = await asyncio.wait_for(collect(stack, job.name, after_seq=k), timeout=5)
        assert [e.seq for e in resumed] == list(range(k + 1, n + 1))
        assert resumed == history[k:]

    # Past the terminal event: nothing, and the stream still ends.
    assert await asyncio.wait_for(collect(stack, job.name, after_seq=n), timeout=5) == []


async def test_echo_result_is_payload(stack: Stack) -> None:
    client = stack.client()
    payload: dict[str, Any] = {"text": "hi", "n": 3, "nested": {"xs": [1, 2.5, None, True]}}
    job = await client.submit("demo.echo", payload, labels={"team": "data"})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    assert done.result == payload
    assert done.labels == {"team": "data"}


async def test_failing_handler_fails_the_job_with_its_error(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.fail", {"message": "boom"})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.FAILED
    assert done.error is not None
    assert "boom" in done.error.message
    assert done.error.retryable is False
    assert done.attempt == 1  # permanent: no second attempt


async def test_retryable_errors_use_more_attempts_then_succeed(
    engine: Any, database_url: str, amqp_url: str, topology: Any, started: Started
) -> None:
    from tests.support.stack import start_stack

    calls: list[int] = []
    registry = Registry()

    @registry.handler("flaky.op")
    async def flaky(ctx: JobContext) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RetryableError("not yet", delay=0.05)
        return {"attempt": ctx.attempt}

    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    client = stack.client()
    job = await client.submit("flaky.op", {}, max_attempts=3)
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    assert calls == [1, 2, 3]
    assert done.result == {"attempt": 3}
    events = await collect(stack, job.name)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert sum(e.type is EventType.RETRY_SCHEDULED for e in events) == 2

    # Out of attempts: FAILED with the last error, which no longer says
    # retryable (nothing will retry the job).
    calls.clear()
    job2 = await client.submit("flaky.op", {}, max_attempts=2)
    done2 = await asyncio.wait_for(client.wait(job2.name), timeout=20)
    assert done2.state is JobState.FAILED
    assert calls == [1, 2]
    assert done2.error is not None and not done2.error.retryable
    assert done2.error.code == "HANDLER_RETRYABLE"
    assert "not yet" in done2.error.message


async def test_retry_job_starts_a_new_attempt(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.fail", {})
    failed = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert failed.state is JobState.FAILED

    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED
    again = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert again.state is JobState.FAILED
    assert again.attempt == 2

    events = await collect(stack, job.name)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events if e.terminal] == [EventType.FAILED, EventType.FAILED]


async def test_retry_and_cancel_refuse_wrong_states(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {"x": 1})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    with pytest.raises(JobNotRetryable):
        await client.retry(job.name)
    with pytest.raises(JobAlreadyTerminal):
        await client.cancel(job.name)
    with pytest.raises(FailedPrecondition):
        await client.cancel(job.name)


async def test_list_pages_newest_first_with_filters(stack: Stack) -> None:
    client = stack.client()
    names = []
    for i in range(7):
        job = await client.submit("demo.echo", {"i": i})
        names.append(job.name)
    failing = await client.submit("demo.fail", {})
    await asyncio.wait_for(client.wait(failing.name), timeout=20)

    seen: list[str] = []
    token = ""
    while True:
        page = await client.list(page_size=3, page_token=token, type="demo.echo")
        assert len(page.jobs) <= 3
        seen += [j.name for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == list(reversed(names))

    failed = await client.list(state=JobState.FAILED)
    assert [j.name for j in failed.jobs] == [failing.name]

    everything = await client.list()
    assert len(everything.jobs) == 8
    assert not everything.next_page_token


async def test_health_and_reflection_are_served(stack: Stack) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="jobplane.v1.JobService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        reflect: Any = reflection_pb2_grpc.ServerReflectionStub(channel)  # type: ignore[arg-type]
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflect.ServerReflectionInfo(iter([request])):
            services = {s.name for s in response.list_services_response.service}
            assert "jobplane.v1.JobService" in services
            assert "grpc.health.v1.Health" in services
            break
        else:
            raise AssertionError("no reflection response")
