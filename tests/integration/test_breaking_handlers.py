"""Handlers that break in every way we could think of: each job ends (or waits for
its retry), and the worker goes on.

One worker with prefetch 1 runs every case, then a probe job: a delivery that
was never acked or nacked would hold the only prefetch slot, and the probe
would never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import asyncpg
import pytest

from jobplane.client import EventType, Job, JobState
from jobplane.store.attempts import LeaseLost
from jobplane.store.engine import create_engine
from jobplane.topology import load_topology
from jobplane.workers.handlers import JobContext, PermanentError, Registry, RetryableError
from tests.support import services
from tests.support.stack import Stack, eventually, start_stack

MAX_RESULT_BYTES = 4096
broken = Registry()


def smuggle(job_type: str, fn: Any) -> None:
    """Register what Registry.add refuses: the runtime must survive it anyway."""
    broken._handlers[job_type] = fn


@broken.handler("probe.ok")
async def probe(ctx: JobContext) -> dict[str, Any]:
    return {"probe": True}


def sync_returns_dict(ctx: JobContext) -> dict[str, Any]:
    return {}


def sync_raises(ctx: JobContext) -> dict[str, Any]:
    raise ValueError("sync boom")


async def async_generator(ctx: JobContext) -> AsyncIterator[dict[str, Any]]:
    yield {}


smuggle("break.sync_returns_dict", sync_returns_dict)
smuggle("break.sync_raises", sync_raises)
smuggle("break.async_generator", async_generator)
smuggle("break.not_callable_result", lambda ctx: 42)


def raising(job_type: str, make: Callable[[], BaseException]) -> None:
    async def handler(ctx: JobContext) -> dict[str, Any]:
        raise make()

    broken.add(job_type, handler)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


class NotStr(Exception):
    def __str__(self) -> str:
        return 42  # type: ignore[return-value]  # noqa: PLE0307 - the point of the case


raising("break.system_exit", lambda: SystemExit(3))
raising("break.keyboard_interrupt", KeyboardInterrupt)
raising("break.generator_exit", GeneratorExit)
raising("break.stray_cancelled_error", asyncio.CancelledError)
raising("break.unprintable_exception", Unprintable)
raising("break.str_not_a_string", NotStr)
raising("break.nul_and_huge_message", lambda: ValueError("\x00\ud800" + "x" * 100_000))
raising("break.permanent_bad_code", lambda: PermanentError("no", code=42))  # type: ignore[arg-type]
raising("break.permanent_lowercase_code", lambda: PermanentError("no", code="bad code"))
raising("break.retryable_nan_delay", lambda: RetryableError("later", delay=math.nan))
raising("break.retryable_string_delay", lambda: RetryableError("later", delay="soon"))  # type: ignore[arg-type]
raising("break.retryable_huge_delay", lambda: RetryableError("much later", delay=1e300))
raising("break.spurious_lease_lost", lambda: LeaseLost("not really"))
raising("break.stop_iteration", StopIteration)


def returning(job_type: str, make: Callable[[], Any]) -> None:
    async def handler(ctx: JobContext) -> Any:
        return make()

    broken.add(job_type, handler)


async def inner() -> dict[str, Any]:
    return {}


class Sneaky(dict[str, Any]):
    def items(self) -> Any:
        raise RuntimeError("no items")


def cyclic() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"d": value}
    return value


returning("break.coroutine_of_coroutine", inner)
returning("break.huge_result", lambda: {"x": "a" * (MAX_RESULT_BYTES + 1)})
returning("break.set_result", lambda: {"s": {1, 2}})
returning("break.nan_result", lambda: {"x": math.nan})
returning("break.nul_result", lambda: {"x": "a\x00b"})
returning("break.nul_key_result", lambda: {"a\x00": 1})
returning("break.surrogate_result", lambda: {"x": "\ud800"})
returning("break.deep_result", lambda: deep(200))
returning("break.cyclic_result", cyclic)
returning("break.huge_int_result", lambda: {"x": 10**400})
returning("break.int_key_result", lambda: {1: 2})
returning("break.list_result", lambda: [1, 2])
returning("break.bytes_result", lambda: {"b": b"\x00"})
returning("break.sneaky_dict_result", lambda: Sneaky(a=1))
returning("break.none_result", lambda: None)


@broken.handler("break.recursion")
async def recursion(ctx: JobContext) -> dict[str, Any]:
    def down(n: int) -> int:
        return down(n + 1) + 1

    return {"n": down(0)}


@broken.handler("break.self_cancel")
async def self_cancel(ctx: JobContext) -> dict[str, Any]:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(1)
    return {}


@broken.handler("break.blocks_loop_briefly")
async def blocks(ctx: JobContext) -> dict[str, Any]:
    time.sleep(0.3)  # noqa: ASYNC251 - the point of the case
    return {"blocked": True}


@broken.handler("break.nan_progress")
async def nan_progress(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(math.nan)
    return {}


@broken.handler("break.progress_data_not_json")
async def bad_progress_data(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(0.5, "half", {"x": math.inf})
    return {}


@broken.handler("break.nul_progress_message")
async def nul_progress(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(0.5, "a\x00b\ud800")
    return {"ok": True}


@broken.handler("break.swallows_cancellation")
async def stubborn(ctx: JobContext) -> dict[str, Any]:
    # Ignores the timeout's cancellation for 2.5 s, well past the worker's grace
    # (0.5 s), then ends by itself.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.1)
    return {"late": True}


@broken.handler("probe.refused")
async def refused(ctx: JobContext) -> dict[str, Any]:
    return {"fine": True}


@broken.handler("probe.unclaimable")
async def unclaimable(ctx: JobContext) -> dict[str, Any]:
    raise AssertionError("a refused claim never runs the handler")


@dataclass(frozen=True)
class Case:
    """A breaking job type and how its job must end."""

    type: str
    state: JobState
    code: str | None = None
    message: str | None = None  # a substring of the error message
    max_attempts: int = 1
    timeout: float | None = None
    check: Callable[[Job], None] | None = field(default=None, compare=False)


def _far_retry(job: Job) -> None:
    assert job.next_attempt_time is not None
    assert job.next_attempt_time > datetime.now(UTC) + timedelta(days=6)
    assert job.error is not None and job.error.retryable


def _bounded_message(job: Job) -> None:
    assert job.error is not None
    assert len(job.error.message) <= 4096
    assert "\\x00" in job.error.message and "\\ud800" in job.error.message


CASES = [
    Case("break.sync_returns_dict", JobState.FAILED, "BAD_HANDLER", "not an awaitable"),
    Case("break.sync_raises", JobState.FAILED, "HANDLER_ERROR", "ValueError: sync boom"),
    Case("break.async_generator", JobState.FAILED, "BAD_HANDLER", "async_generator"),
    Case("break.not_callable_result", JobState.FAILED, "BAD_HANDLER", "int"),
    Case("break.system_exit", JobState.FAILED, "HANDLER_ERROR", "SystemExit: 3"),
    Case("break.keyboard_interrupt", JobState.FAILED, "HANDLER_ERROR", "KeyboardInterrupt"),
    Case("break.generator_exit", JobState.FAILED, "HANDLER_ERROR", "GeneratorExit"),
    Case("break.stray_cancelled_error", JobState.FAILED, "HANDLER_ERROR", "CancelledError"),
    Case("break.self_cancel", JobState.FAILED, "HANDLER_ERROR", "not by the worker"),
    Case("break.unprintable_exception", JobState.FAILED, "HANDLER_ERROR", "str() raised"),
    Case("break.str_not_a_string", JobState.FAILED, "HANDLER_ERROR", "str() raised TypeError"),
    Case(
        "break.nul_and_huge_message",
        JobState.FAILED,
        "HANDLER_ERROR",
        "ValueError",
        check=_bounded_message,
    ),
    Case("break.permanent_bad_code", JobState.FAILED, "HANDLER_FAILED", "no"),
    Case("break.permanent_lowercase_code", JobState.FAILED, "HANDLER_FAILED", "no"),
    Case("break.retryable_nan_delay", JobState.FAILED, "HANDLER_RETRYABLE", "later", 2),
    Case("break.retryable_string_delay", JobState.FAILED, "HANDLER_RETRYABLE", "later", 2),
    Case(
        "break.retryable_huge_delay",
        JobState.QUEUED,
        "HANDLER_RETRYABLE",
        "much",
        max_attempts=2,
        check=_far_retry,
    ),
    Case("break.spurious_lease_lost", JobState.FAILED, "HANDLER_ERROR", "LeaseLost"),
    Case("break.stop_iteration", JobState.FAILED, "HANDLER_ERROR", "StopIteration"),
    Case("break.recursion", JobState.FAILED, "HANDLER_ERROR", "RecursionError"),
    Case("break.coroutine_of_coroutine", JobState.FAILED, "BAD_RESULT", "await is missing"),
    Case("break.huge_result", JobState.FAILED, "RESULT_TOO_LARGE", f"at most {MAX_RESULT_BYTES}"),
    Case("break.set_result", JobState.FAILED, "BAD_RESULT", "$.s: a set is not JSON"),
    Case("break.nan_result", JobState.FAILED, "BAD_RESULT", "not a finite number"),
    Case("break.nul_result", JobState.FAILED, "BAD_RESULT", "NUL"),
    Case("break.nul_key_result", JobState.FAILED, "BAD_RESULT", "NUL"),
    Case("break.surrogate_result", JobState.FAILED, "BAD_RESULT", "surrogate"),
    Case("break.deep_result", JobState.FAILED, "BAD_RESULT", "nested deeper"),
    Case("break.cyclic_result", JobState.FAILED, "BAD_RESULT", "nested deeper"),
    Case("break.huge_int_result", JobState.FAILED, "BAD_RESULT", "too large"),
    Case("break.int_key_result", JobState.FAILED, "BAD_RESULT", "not a string"),
    Case("break.list_result", JobState.FAILED, "BAD_RESULT", "list, not a JSON object"),
    Case("break.bytes_result", JobState.FAILED, "BAD_RESULT", "bytes is not JSON"),
    Case("break.sneaky_dict_result", JobState.FAILED, "BAD_RESULT", "RuntimeError"),
    Case("break.none_result", JobState.SUCCEEDED),
    Case("break.blocks_loop_briefly", JobState.SUCCEEDED),
    Case("break.nan_progress", JobState.FAILED, "HANDLER_ERROR", "finite number"),
    Case("break.progress_data_not_json", JobState.FAILED, "HANDLER_ERROR", "not a finite"),
    Case("break.nul_progress_message", JobState.SUCCEEDED),
    Case("break.swallows_cancellation", JobState.FAILED, "TIMEOUT", "timeout", 1, 0.3),
]


@pytest.fixture(scope="module")
async def breaking(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[Stack]:
    """One stack for every case: a worker with prefetch 1 and the broken handlers."""
    name = f"jp_{run_id}_breaking"
    await services.create_database(name, template=template_db)
    url = services.pg_url(name)
    engine = create_engine(url, pool_size=10)
    stack = await start_stack(
        engine,
        url,
        amqp_url,
        load_topology().prefixed("breaking."),
        registry=broken,
        worker_options={
            "concurrency": 1,
            "prefetch": 1,
            "cancel_grace": 0.5,
            "max_result_bytes": MAX_RESULT_BYTES,
        },
    )
    yield stack
    await stack.close()
    await engine.dispose()
    await services.drop_database(name)


def _ended_or_waiting(case: Case, job: Job) -> bool:
    if job.state.terminal:
        return True
    # A retry far in the future is an end for this test: the attempt was settled.
    return case.state is JobState.QUEUED and job.error is not None


@pytest.mark.parametrize("case", CASES, ids=[c.type.removeprefix("break.") for c in CASES])
async def test_a_breaking_handler_ends_its_job_and_the_worker_goes_on(
    breaking: Stack, case: Case
) -> None:
    client = breaking.client()
    job = await client.submit(
        case.type, {}, max_attempts=case.max_attempts, attempt_timeout=case.timeout
    )

    async def ended() -> bool:
        return _ended_or_waiting(case, await client.get(job.name))

    await eventually(ended, timeout=20)
    done = await client.get(job.name)
    assert done.state is case.state, done
    if case.code is None:
        assert done.error is None
    else:
        assert done.error is not None
        assert done.error.code == case.code
        assert case.message is not None and case.message in done.error.message
        if done.state is JobState.FAILED:
            assert done.error.retryable is False
    if case.check is not None:
        case.check(done)
    assert done.attempts_used == case.max_attempts or case.state is not JobState.FAILED

    # The same worker, with its one prefetch slot, still takes the next job.
    next_job = await client.submit("probe.ok", {})
    assert (await asyncio.wait_for(client.wait(next_job.name), 15)).state is JobState.SUCCEEDED


async def test_a_none_result_is_an_empty_object_and_nul_in_progress_is_escaped(
    breaking: Stack,
) -> None:
    client = breaking.client()
    done = await asyncio.wait_for(client.wait((await client.submit("break.none_result")).name), 15)
    assert done.result == {}
    job = await client.submit("break.nul_progress_message")
    events = [e async for e in client.watch(job.name)]
    [report] = [e for e in events if e.type is EventType.PROGRESS]
    assert report.message == "a\\x00b\\ud800"


async def test_an_outcome_the_database_refuses_fails_the_job_in_our_words(
    breaking: Stack,
) -> None:
    # A trigger stands for a value Postgres refuses that our checks missed:
    # the outcome fails the same way on every try, so it must not be retried
    # for ever (the worker would hold the message and its slot).
    await _execute(
        breaking,
        """
        CREATE OR REPLACE FUNCTION refuse_success() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'refused %', NEW.id; END $$;
        CREATE TRIGGER refuse_success BEFORE UPDATE ON jobs FOR EACH ROW
            WHEN (NEW.type = 'probe.refused' AND NEW.state = 'succeeded')
            EXECUTE FUNCTION refuse_success();
        """,
    )
    client = breaking.client()
    done = await asyncio.wait_for(client.wait((await client.submit("probe.refused")).name), 20)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "OUTCOME_REFUSED"
    assert "SQLSTATE P0001" in done.error.message
    assert str(done.id) not in done.error.message  # never the database's own words
    probe_job = await client.submit("probe.ok", {})
    assert (await asyncio.wait_for(client.wait(probe_job.name), 15)).state is JobState.SUCCEEDED


async def test_a_delivery_that_fails_before_any_state_is_nacked_until_dead_lettered(
    breaking: Stack,
) -> None:
    # The claim itself is refused (not a connection problem): the message is
    # nacked each time, and the broker's delivery limit dead-letters it.
    await _execute(
        breaking,
        """
        CREATE OR REPLACE FUNCTION refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'no claim'; END $$;
        CREATE TRIGGER refuse_claim BEFORE UPDATE ON jobs FOR EACH ROW
            WHEN (NEW.type = 'probe.unclaimable' AND NEW.state = 'running')
            EXECUTE FUNCTION refuse_claim();
        """,
    )
    client = breaking.client()
    job = await client.submit("probe.unclaimable")
    connection = await aio_pika.connect(breaking.amqp_url)
    async with connection:
        channel = await connection.channel()

        async def dead_lettered() -> bool:
            queue = await channel.declare_queue(breaking.topology.failed_queue, passive=True)
            return queue.declaration_result.message_count == 1

        await eventually(dead_lettered, timeout=20)
    assert (await client.get(job.name)).state is JobState.QUEUED
    probe_job = await client.submit("probe.ok", {})
    assert (await asyncio.wait_for(client.wait(probe_job.name), 15)).state is JobState.SUCCEEDED


async def _execute(stack: Stack, sql: str) -> None:
    conn = await asyncpg.connect(stack.database_url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
