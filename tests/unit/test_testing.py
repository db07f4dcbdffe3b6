"""jobplane.testing: a handler's attempt without Postgres or RabbitMQ, judged as
the worker judges it."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

from jobplane.fanout import ItemResult
from jobplane.testing import MemoryBlobs, run_handler, run_handler_sync
from jobplane.types import JobState
from jobplane.workers import (
    AttemptStopped,
    EmitError,
    JobContext,
    PermanentError,
    Registry,
    RetryableError,
    SyncJobContext,
)

registry = Registry()


@registry.handler("t.async")
async def _async(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(0.5, "half", {"rows": ctx.payload["rows"]})
    ctx.emit("report.rendered", {"rows": ctx.payload["rows"]})
    name = await ctx.put_blob(b"%PDF", content_type="application/pdf")
    return {"pdf": name, "attempt": ctx.attempt}


@registry.handler("t.sync")
def _sync(ctx: SyncJobContext) -> dict[str, Any]:
    source = ctx.read_blob(ctx.payload["source"])
    ctx.progress(2.0, "x" * 5000)  # clamped and cut as the worker stores them
    ctx.emit("text.upper", {"n": len(source)})
    name = ctx.put_blob(source.upper())
    return {"out": name, "thread": threading.current_thread().name}


async def test_an_async_handler_records_progress_emits_blobs_and_its_result() -> None:
    outcome = await run_handler(registry, "t.async", {"rows": 3}, attempt=2)
    assert outcome.status == "succeeded" and outcome.error is None
    assert outcome.result is not None and outcome.result["attempt"] == 2
    assert [(p.progress, p.message, p.data) for p in outcome.progress] == [
        (0.5, "half", {"rows": 3})
    ]
    assert [(e.event_type, e.payload) for e in outcome.emitted] == [
        ("report.rendered", {"rows": 3})
    ]
    assert outcome.blobs == {outcome.result["pdf"]: b"%PDF"}
    assert outcome.context.type == "t.async"


async def test_a_sync_handler_runs_in_a_thread_with_the_same_context() -> None:
    blobs = MemoryBlobs()
    source = blobs.add(b"hello")
    outcome = await run_handler(registry, "t.sync", {"source": source}, blobs=blobs)
    assert outcome.status == "succeeded", outcome.error
    assert outcome.result is not None
    assert outcome.result["thread"] != threading.current_thread().name
    assert outcome.blobs == {outcome.result["out"]: b"HELLO"}
    [report] = outcome.progress
    assert report.progress == 1.0 and len(report.message) == 4096
    assert [e.event_type for e in outcome.emitted] == ["text.upper"]


async def test_errors_are_retried_or_failed_as_the_worker_decides() -> None:
    async def flaky(ctx: JobContext) -> dict[str, Any]:
        raise RetryableError("later", delay=5, code="BUSY")

    retry = await run_handler(flaky, attempt=1, max_attempts=2)
    assert retry.status == "retry"
    assert retry.error is not None and (retry.error.code, retry.error.delay) == ("BUSY", 5.0)
    assert isinstance(retry.error.exception, RetryableError)
    last = await run_handler(flaky, attempt=2, max_attempts=2)
    assert last.status == "failed" and last.error is not None and last.error.retryable

    def permanent(ctx: SyncJobContext) -> dict[str, Any]:
        raise PermanentError("never", code="NOPE")

    failed = await run_handler(permanent)
    assert failed.status == "failed" and failed.error is not None
    assert (failed.error.code, failed.error.retryable) == ("NOPE", False)

    def crashes(ctx: SyncJobContext) -> dict[str, Any]:
        raise KeyError("k")

    crashed = await run_handler(crashes)
    assert crashed.status == "retry" and crashed.error is not None
    assert crashed.error.code == "HANDLER_ERROR" and "KeyError" in crashed.error.message

    async def bad_result(ctx: JobContext) -> Any:
        return [1, 2]

    refused = await run_handler(bad_result)
    assert refused.status == "failed" and refused.error is not None
    assert refused.error.code == "BAD_RESULT" and refused.error.exception is None


async def test_emitted_events_are_dropped_unless_the_attempt_succeeds() -> None:
    async def emits_then_fails(ctx: JobContext) -> dict[str, Any]:
        ctx.emit("thing.tried", {})
        raise PermanentError("no")

    outcome = await run_handler(emits_then_fails)
    # Kept here to look at; the status says a worker would publish none.
    assert outcome.status == "failed" and len(outcome.emitted) == 1


async def test_a_pipeline_stage_sees_its_stage_and_the_earlier_results() -> None:
    async def summarize(ctx: JobContext) -> dict[str, Any]:
        return {
            "pipeline": ctx.pipeline,
            "stage": ctx.stage,
            "version": ctx.stage_version,
            "inputs": list(ctx.inputs),
            "previous": ctx.previous,
        }

    outcome = await run_handler(
        summarize,
        "aidj.summarize",
        {"track": 1},
        pipeline="aidj.analyze",
        stage="summarize",
        stage_version="v2",
        inputs={"decode": {"frames": 10}, "tempo": {"bpm": 120}},
    )
    assert outcome.result == {
        "pipeline": "aidj.analyze",
        "stage": "summarize",
        "version": "v2",
        "inputs": ["decode", "tempo"],
        "previous": {"bpm": 120},
    }
    plain = await run_handler(summarize)
    assert plain.result is not None and plain.result["stage"] == "" and plain.result["inputs"] == []


async def test_cancel_after_stops_async_and_sync_handlers_as_the_worker_does() -> None:
    async def sleeps(ctx: JobContext) -> dict[str, Any]:
        await asyncio.sleep(60)
        return {}

    outcome = await run_handler(sleeps, cancel_after=0.05)
    assert outcome.status == "cancelled" and outcome.context.cancelled

    seen: list[str] = []

    def loops(ctx: SyncJobContext) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append("saw it")
        try:
            ctx.progress(0.9)  # raises: the attempt is stopped
        except AttemptStopped:
            seen.append("stopped at the call")
            raise
        seen.append("went on")
        return {}

    stopped = await run_handler(loops, cancel_after=0.05)
    assert stopped.status == "cancelled"
    assert seen == ["saw it", "stopped at the call"] and stopped.progress == []
    assert stopped.error is None


async def test_a_registry_without_the_type_says_what_it_has() -> None:
    with pytest.raises(LookupError, match=r"t\.async, t\.sync"):
        await run_handler(registry, "t.missing")


def test_run_handler_sync_needs_no_event_loop() -> None:
    job_id = uuid.uuid4()

    def named(ctx: SyncJobContext) -> dict[str, Any]:
        return {"name": ctx.name, "correlation": ctx.correlation_id}

    outcome = run_handler_sync(named, "t.named", job_id=job_id, correlation_id="c-1")
    assert outcome.result == {"name": f"jobs/{job_id}", "correlation": "c-1"}


def test_the_sync_context_has_every_attribute_of_the_async_one() -> None:
    # The plain handler's face must not drift from the async one's, either way.
    public = {n for n in dir(JobContext) if not n.startswith("_")}
    sync_public = {n for n in dir(SyncJobContext) if not n.startswith("_")}
    assert public - sync_public == {"open_blob"}  # streaming is for async handlers
    assert sync_public - public == {"async_context"}


async def test_each_attribute_of_the_sync_context_reads_its_namesake() -> None:
    # The sync context declares its job attributes as getters of the async
    # one's: each must read the attribute it is named after, and say what it does.
    async def emits(ctx: JobContext) -> dict[str, Any]:
        ctx.emit("report.rendered")
        return {}

    outcome = await run_handler(
        emits,
        "t.attributes",
        {"rows": 1},
        attempt=2,
        max_attempts=5,
        correlation_id="corr",
        request_id="req",
        pipeline="pipe",
        pipeline_version="v1",
        stage="render",
        stage_version="v2",
        inputs={"parse": {"n": 1}},
        fans_out=True,
        results=[ItemResult(0, "jobs/x", JobState.SUCCEEDED, {"n": 2})],
    )
    ctx = outcome.context
    sync_ctx = SyncJobContext(ctx, asyncio.get_running_loop(), contextvars.copy_context())
    attributes = [n for n, v in vars(JobContext).items() if isinstance(v, property)]
    values = {n: getattr(ctx, n) for n in attributes}
    assert len({repr(v) for v in values.values()}) == len(values), values  # tell them apart
    for name in attributes:
        assert getattr(sync_ctx, name) == values[name], name
        assert getattr(SyncJobContext, name).__doc__, name


async def _doubles(ctx: Any, n: int) -> dict[str, Any]:
    await ctx.progress(0.5)
    return {"n": n * 2}


def _without_wraps(fn: Any) -> Any:
    def wrapper(ctx: Any) -> Any:
        return fn(ctx, 2)

    return wrapper


@pytest.mark.parametrize(
    "handler",
    [lambda ctx: _doubles(ctx, 2), _without_wraps(_doubles)],
    ids=["lambda", "decorator-without-wraps"],
)
async def test_a_plain_function_that_returns_a_coroutine_fails_the_job_and_holds_no_loop(
    handler: Any,
) -> None:
    # Classed plain (it is no `async def`): its coroutine, built in the thread
    # with the thread's context, must not be awaited on the loop, where its
    # `await ctx.progress()` would wait for the loop it blocks.
    outcome = await asyncio.wait_for(run_handler(handler), 10)
    assert outcome.status == "failed"
    assert outcome.error is not None and outcome.error.code == "BAD_HANDLER"
    assert "register the async function itself" in outcome.error.message


async def test_the_sync_context_refuses_a_call_from_the_loop_s_own_thread() -> None:
    # Waiting there for a task of the same loop would never end.
    outcome = await run_handler(_async, "t.async", {"rows": 1})
    sync_ctx = SyncJobContext(
        outcome.context, asyncio.get_running_loop(), contextvars.copy_context()
    )
    with pytest.raises(RuntimeError, match="from the event loop"):
        sync_ctx.progress(0.5)


async def test_cancel_after_gives_up_on_a_plain_handler_that_ignores_the_stop() -> None:
    release = threading.Event()

    def deaf(ctx: SyncJobContext) -> dict[str, Any]:
        release.wait(10)
        return {}

    try:
        with pytest.raises(TimeoutError, match=r"deaf.* did not end within 0\.2 s"):
            await run_handler(deaf, cancel_after=0.05, grace=0.2)
    finally:
        release.set()


def test_run_handler_sync_gives_up_on_a_plain_handler_that_ignores_the_stop() -> None:
    release = threading.Event()

    def deaf(ctx: SyncJobContext) -> dict[str, Any]:
        release.wait(30)
        return {}

    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="deaf"):
            # Its event loop ends too, without waiting for the handler's thread.
            run_handler_sync(deaf, cancel_after=0.05, grace=0.2)
        assert time.monotonic() - started < 20
    finally:
        release.set()


def test_jobplane_testing_imports_without_the_object_store_drivers() -> None:
    # The worker install (jobplane[worker]) has no aioboto3, botocore or aiohttp.
    program = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('aioboto3', 'aiobotocore', 'botocore', 'aiohttp'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import jobplane.testing\n"
        "outcome = jobplane.testing.run_handler_sync(lambda ctx: {'ok': ctx.type})\n"
        "assert outcome.result == {'ok': 'test.job'}, outcome\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=60)


async def test_an_emit_over_the_event_payload_limit_is_refused_by_itself() -> None:
    """One event over the payload limit is refused, though the attempt's
    events together stay under their 1 MiB."""
    refused: list[EmitError] = []

    async def emits(ctx: JobContext) -> dict[str, Any]:
        ctx.emit("small.one", {"text": "x" * 1_000})
        try:
            ctx.emit("big.one", {"text": "x" * 2_000})
        except EmitError as exc:
            refused.append(exc)
        return {}

    outcome = await run_handler(emits, max_result_bytes=1_500)
    assert outcome.status == "succeeded"
    assert [e.event_type for e in outcome.emitted] == ["small.one"]
    assert len(refused) == 1 and refused[0].field == "payload"
    assert "limit is 1500" in str(refused[0])
