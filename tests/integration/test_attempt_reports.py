"""What a user sees of attempts: progress per attempt, the final error, the traceback."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import EventType, JobEvent, JobState
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from tests.integration.test_cli_and_sync import jobplane
from tests.support.parts import Started
from tests.support.stack import start_stack

registry = Registry()


@registry.handler("flaky.report")
async def flaky(ctx: JobContext) -> dict[str, Any]:
    if ctx.attempt == 1:
        await ctx.progress(0.4, "first try")
        raise RetryableError("try again", delay=0)
    await ctx.progress(0.2, "second try")
    await ctx.progress(0.6, "second try")
    return {"attempt": ctx.attempt}


def parse(text: str) -> int:
    raise ValueError(f"bad input {text}")


@registry.handler("always.fails")
async def always_fails(ctx: JobContext) -> dict[str, Any]:
    return {"n": parse("42")}


async def test_a_new_attempt_starts_from_zero_and_never_runs_backwards(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    client = stack.client()
    job = await client.submit("flaky.report", {}, max_attempts=2)
    events = await asyncio.wait_for(_collect(client.watch(job.name)), 20)
    by_attempt: dict[int, list[JobEvent]] = {}
    for event in events:
        if event.type in (EventType.STARTED, EventType.PROGRESS):
            by_attempt.setdefault(event.attempt, []).append(event)
    assert sorted(by_attempt) == [1, 2]
    for attempt, seen in by_attempt.items():
        assert seen[0].type is EventType.STARTED
        # The STARTED event of attempt 2 no longer carries attempt 1's 0.4.
        assert seen[0].progress == 0.0, (attempt, seen[0])
        progress = [e.progress for e in seen]
        assert progress == sorted(progress), (attempt, progress)
    assert [e.progress for e in by_attempt[2]] == [0.0, 0.2, 0.6]
    assert by_attempt[2][0].message == "attempt started"
    assert events[-1].type is EventType.SUCCEEDED and events[-1].progress == 1.0


async def test_the_final_failure_is_not_retryable_keeps_its_traceback_and_reads_well(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, registry=registry))
    client = stack.client()
    job = await client.submit("always.fails", {}, max_attempts=2)
    done = await asyncio.wait_for(client.wait(job.name), 20)
    assert done.state is JobState.FAILED
    assert done.error is not None
    assert done.error.code == "HANDLER_ERROR"
    assert done.error.message == "ValueError: bad input 42"
    assert done.error.retryable is False
    assert (done.attempt, done.attempts_used) == (2, 2)

    events = [e async for e in client.watch(job.name)]
    [retry] = [e for e in events if e.type is EventType.RETRY_SCHEDULED]
    [failed] = [e for e in events if e.type is EventType.FAILED]
    for event in (retry, failed):
        trace = event.data["error"]["traceback"]
        assert trace.startswith("Traceback (most recent call last)")
        assert "in parse" in trace and "in always_fails" in trace
        assert trace.rstrip().endswith("ValueError: bad input 42")
        assert len(trace) <= 8192
    assert retry.data["error"]["retryable"] is True
    assert failed.data["error"]["retryable"] is False
    assert failed.data["error"]["attempts_exhausted"] is True

    code, out, _err = await jobplane(stack, "get", job.name)
    assert code == 0
    shown = _fields(out)
    assert shown["attempts"] == "2 of 2 used"
    assert shown["error"] == "HANDLER_ERROR: ValueError: bad input 42"

    # RetryJob gives the job a new budget: attempts 3 and 4 are its 1st and 2nd.
    await client.retry(job.name)
    again = await asyncio.wait_for(client.wait(job.name), 20)
    assert again.state is JobState.FAILED
    assert (again.attempt, again.attempts_used, again.max_attempts) == (4, 2, 2)
    code, out, _err = await jobplane(stack, "get", job.name)
    assert _fields(out)["attempts"] == "2 of 2 used (4 started in all)"
    assert "4 of 2" not in out and "retryable" not in out
    code, out, _err = await jobplane(stack, "list")
    assert code == 0 and "\t2/2\t" in out and "4/2" not in out


async def _collect(events: Any) -> list[JobEvent]:
    return [e async for e in events]


def _fields(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}
