"""Deadlines: a job not ended by its deadline ends FAILED, DEADLINE_EXCEEDED (ADR-0044).

Whatever its state: QUEUED with no worker, RUNNING (its handler is stopped
and its outcome cannot land afterwards), held by its concurrency key, in a
pipeline's second stage. The sweeper's deadline loop ends it; a claim of a
job past its deadline starts nothing. A job that ends in time keeps its
end; bad deadlines are refused with the field and write nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import txn
from jobplane.client import InvalidArgument, Job, JobState
from jobplane.errors import InvalidArgument as SqlInvalidArgument
from jobplane.store.attempts import AttemptStore, ClaimStatus, LeaseLost
from jobplane.store.deadlines import DeadlineStore
from jobplane.store.engine import asyncpg_dsn
from jobplane.topology import Topology
from jobplane.types import EventType, JobEvent, StageState
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.sweeper import Sweeper
from tests.integration.test_pipelines import _PIPELINE, Stages, aidj, pipeline  # noqa: F401
from tests.support.answers import check_refusal
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

pytestmark = pytest.mark.timeout(120)

_EXCEEDED = "DEADLINE_EXCEEDED"
_PAST = "UPDATE jobs SET deadline = now() - interval '1 millisecond' WHERE id = :id"
_PENDING = "SELECT count(*) FROM outbox WHERE job_id = :id AND published_at IS NULL"


@pytest.fixture
async def sweeper(engine: AsyncEngine) -> AsyncIterator[Sweeper]:
    """A sweeper as ``jobplane relay`` runs one: its deadline loop on its own clock."""
    async with Sweeper(engine, schedules=False) as running:
        yield running


async def _past(stack: Stack, job: Job) -> None:
    """Move ``job``'s deadline just behind now (the test does not wait for it)."""
    async with stack.engine.begin() as conn:
        await conn.execute(text(_PAST), {"id": uuid.UUID(job.id)})


async def _ended(stack: Stack, job: Job) -> Job:
    done = await asyncio.wait_for(stack.client().wait(job.name), timeout=30)
    assert done.state is JobState.FAILED, done
    assert done.error is not None and done.error.code == _EXCEEDED
    assert not done.error.retryable
    return done


@pytest.mark.stack(relay=False, worker=False)
async def test_a_queued_job_with_no_worker_ends_at_its_deadline(
    stack: Stack, sweeper: Sweeper
) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {}, deadline=timedelta(seconds=1))
    assert job.state is JobState.QUEUED and job.deadline is not None
    assert job.deadline > job.create_time
    seen: list[JobEvent] = []

    async def watch() -> None:
        async for event in client.watch(job.name):
            seen.append(event)

    watching = asyncio.create_task(watch())
    done = await _ended(stack, job)
    await asyncio.wait_for(watching, timeout=30)
    assert done.end_time is not None and done.end_time >= job.deadline
    assert done.deadline == job.deadline and done.attempt == 0
    # WatchJob: the job's FAILED event ends the stream, saying why.
    assert [e.type for e in seen] == [EventType.QUEUED, EventType.FAILED]
    assert seen[-1].data["error"]["code"] == _EXCEEDED
    assert seen[-1].message == "the job did not end by its deadline"
    # Its dispatch is dropped (nothing left for a relay), and job.failed published.
    assert await stack.scalar(_PENDING, id=job.id) == 0
    failed = await stack.scalar(
        "SELECT payload->'error'->>'code' FROM events "
        "WHERE job_id = :id AND event_type = 'job.failed'",
        id=job.id,
    )
    assert failed == _EXCEEDED


def _sleeper(started: list[str], stopped: list[str], ended: list[str]) -> Registry:
    registry = Registry()

    @registry.handler("slow.sleep")
    async def sleep(ctx: JobContext) -> dict[str, Any]:
        started.append(ctx.name)
        try:
            await asyncio.sleep(float(ctx.payload.get("seconds", 3600)))
        except asyncio.CancelledError:
            stopped.append(ctx.name)
            raise
        ended.append(ctx.name)
        return {"slept": True}

    return registry


async def test_a_running_job_is_ended_and_its_handler_stopped(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    sweeper: Sweeper,
) -> None:
    began: list[str] = []
    stopped: list[str] = []
    finished: list[str] = []
    stack = await started(
        start_stack(
            engine, database_url, amqp_url, topology, registry=_sleeper(began, stopped, finished)
        )
    )
    client = stack.client()
    job = await client.submit("slow.sleep", {}, deadline=timedelta(minutes=10))
    await eventually(lambda: _true(began == [job.name]), timeout=30)
    assert (await client.get(job.name)).state is JobState.RUNNING
    await _past(stack, job)
    done = await _ended(stack, job)
    assert done.attempt == 1
    # The worker was told as a cancel is told: the handler's task was cancelled.
    await eventually(lambda: _true(stopped == [job.name]), timeout=30)
    assert finished == []
    # What the stopped attempt then wrote (a cancel's outcome) was fenced out.
    await asyncio.sleep(1.0)
    again = await client.get(job.name)
    assert (again.state, again.error) == (JobState.FAILED, done.error)
    terminal = await stack.scalar(
        "SELECT count(*) FROM job_events WHERE job_id = :id "
        "AND type IN ('succeeded', 'failed', 'cancelled')",
        id=job.id,
    )
    assert terminal == 1


async def _true(value: bool) -> bool:
    return value


async def test_the_fenced_out_attempt_can_write_nothing(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    job = await client.submit("demo.echo", {}, deadline=timedelta(minutes=10))
    claim = await store.claim(await bare.envelope(job.id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None
    await _past(bare, job)
    ended = await DeadlineStore(bare.engine).end_due(limit=10)
    assert [(str(r["id"]), r["from_state"]) for r in ended] == [(job.id, "running")]
    with pytest.raises(LeaseLost):
        await store.heartbeat(claim.attempt)
    with pytest.raises(LeaseLost):
        await store.succeed(claim.attempt, {"late": True})
    done = await client.get(job.name)
    assert done.state is JobState.FAILED and done.result is None
    assert done.error is not None and done.error.code == _EXCEEDED


async def test_a_claim_past_the_deadline_starts_nothing_and_ends_the_job(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    job = await client.submit("demo.echo", {}, deadline=timedelta(minutes=10))
    await _past(bare, job)
    claim = await store.claim(await bare.envelope(job.id))
    assert (claim.status, claim.state, claim.attempt) == (
        ClaimStatus.FINISHED,
        JobState.FAILED,
        None,
    )
    done = await client.get(job.name)
    assert done.state is JobState.FAILED and done.attempt == 0 and done.start_time is None
    assert done.error is not None and done.error.code == _EXCEEDED


async def test_a_worker_service_worker_learns_its_lease_is_lost(bare: Stack) -> None:
    client = bare.client()
    key = (await bare.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    job = await client.submit("demo.echo", {}, deadline=timedelta(minutes=10))
    async with grpc.aio.insecure_channel(bare.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)
        envelope = await bare.envelope(job.id)
        claimed = await stub.ClaimJob(
            workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
        )
        assert claimed.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
        await _past(bare, job)
        assert len(await DeadlineStore(bare.engine).end_due(limit=10)) == 1
        fence = claimed.attempt
        with pytest.raises(grpc.aio.AioRpcError) as beat:
            await stub.Heartbeat(workers_pb2.HeartbeatRequest(attempt=fence), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as complete:
            await stub.CompleteJob(workers_pb2.CompleteJobRequest(attempt=fence), metadata=metadata)
        for error in (beat.value, complete.value):
            refusal = check_refusal(error)
            assert (refusal.code, refusal.reason) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "LEASE_LOST",
            )
    assert (await client.get(job.name)).error.code == _EXCEEDED  # type: ignore[union-attr]


async def test_a_pipeline_job_ends_in_its_second_stage(
    pipeline: tuple[Stack, Stages],  # noqa: F811
    sweeper: Sweeper,
) -> None:
    stack, stages = pipeline
    stages.hold_neural = True
    job = await stack.client().submit(_PIPELINE, {"track": "t-d"}, deadline=timedelta(minutes=5))
    await asyncio.wait_for(stages.neural_started.wait(), 30)
    await _past(stack, job)
    done = await _ended(stack, job)
    assert done.stage == "neural"
    assert [(s.name, s.state) for s in done.stages] == [
        ("native", StageState.SUCCEEDED),
        ("neural", StageState.FAILED),
        ("index", StageState.PENDING),
    ]
    neural = done.stages[1]
    assert neural.error is not None and neural.error.code == _EXCEEDED
    await asyncio.sleep(1.0)
    assert stages.runs[(job.id, "index")] == 0
    assert await stack.scalar(_PENDING, id=job.id) == 0


async def test_a_held_job_ends_and_its_key_frees_nothing_it_should_not(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    deadlines = DeadlineStore(bare.engine)
    far = timedelta(minutes=10)
    first = await client.submit("demo.echo", {}, concurrency_key="k", deadline=far)
    second = await client.submit("demo.echo", {}, concurrency_key="k", deadline=far)
    third = await client.submit("demo.echo", {}, concurrency_key="k")
    running = await store.claim(await bare.envelope(first.id))
    assert running.status is ClaimStatus.CLAIMED
    for held in (second, third):
        assert (await store.claim(await bare.envelope(held.id))).status is ClaimStatus.HELD

    # The held job ends; the key is still full: the third stays held.
    await _past(bare, second)
    assert [str(r["id"]) for r in await deadlines.end_due(limit=10)] == [second.id]
    ended = await client.get(second.name)
    assert ended.state is JobState.FAILED and ended.waiting_code == ""
    assert ended.error is not None and ended.error.code == _EXCEEDED
    assert await _dispatch(bare, third) is None
    assert (await client.get(first.name)).state is JobState.RUNNING

    # The running one ends by its deadline: its slot goes to the third.
    await _past(bare, first)
    assert [str(r["id"]) for r in await deadlines.end_due(limit=10)] == [first.id]
    assert await _dispatch(bare, third) is not None
    assert (await store.claim(await bare.envelope(third.id))).status is ClaimStatus.CLAIMED


async def _dispatch(stack: Stack, job: Job) -> Any:
    return await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id)


async def test_a_job_that_ends_in_time_keeps_its_end(stack: Stack, sweeper: Sweeper) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {"n": 1}, deadline=timedelta(minutes=10))
    done = await asyncio.wait_for(client.wait(job.name), timeout=30)
    assert done.state is JobState.SUCCEEDED
    await _past(stack, job)
    assert await DeadlineStore(stack.engine).end_due(limit=10) == []
    assert await sweeper.sweep_once() is not None
    again = await client.get(job.name)
    assert again.state is JobState.SUCCEEDED and again.error is None
    assert again.deadline is not None


async def test_retry_of_a_job_past_its_deadline_runs_without_one(bare: Stack) -> None:
    client = bare.client()
    ahead = await client.submit("demo.echo", {}, deadline=timedelta(minutes=10))
    job = await client.submit("demo.echo", {}, deadline=timedelta(minutes=10))
    await _past(bare, job)
    await DeadlineStore(bare.engine).end_due(limit=10)
    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED and retried.deadline is None
    # A deadline still ahead bounds the retry too.
    store = AttemptStore(bare.db, lease_seconds=30.0)
    claim = await store.claim(await bare.envelope(ahead.id))
    assert claim.attempt is not None
    await store.fail(claim.attempt, "BOOM", "boom", retryable=False)
    again = await client.retry(ahead.name)
    assert again.deadline == ahead.deadline


# -- bad input ---------------------------------------------------------------


@pytest.fixture
async def stub(stack: Stack) -> AsyncIterator[jobs_pb2_grpc.JobServiceAsyncStub]:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        yield jobs_pb2_grpc.JobServiceStub(channel)


def _at(delta: timedelta) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(datetime.now(UTC) + delta)
    return stamp


def _after(seconds: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds)


@pytest.mark.stack(relay=False, worker=False)
async def test_bad_deadlines_are_refused_with_the_field_and_write_nothing(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    hour = timedelta(hours=1)
    same = _at(hour)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"deadline": _at(hour), "deadline_after": _after(60)}, "deadline_after"),
        ({"deadline": _at(-timedelta(seconds=5))}, "deadline"),
        ({"deadline": _at(timedelta(days=400))}, "deadline"),
        ({"deadline_after": _after(0)}, "deadline_after"),
        ({"deadline_after": _after(-5)}, "deadline_after"),
        ({"deadline": _at(hour), "schedule_time": _at(2 * hour)}, "deadline"),
        ({"deadline": same, "schedule_time": same}, "deadline"),
        ({"deadline_after": _after(60), "schedule_delay": _after(600)}, "deadline_after"),
        ({"deadline": timestamp_pb2.Timestamp(seconds=2**62)}, "deadline"),
    ]
    before = await stack.counts()
    metadata = (("authorization", f"Bearer {stack.key}"),)
    for fields, field in cases:
        request = jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=str(uuid.uuid4()))
        for name, value in fields.items():
            getattr(request, name).CopyFrom(value)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitJob(request, metadata=metadata)
        refusal = check_refusal(info.value)
        assert refusal.code is grpc.StatusCode.INVALID_ARGUMENT, fields
        assert refusal.field == field, fields
    assert await stack.counts() == before
    # A batch names the request.
    with pytest.raises(InvalidArgument) as batch:
        await stack.client().submit_many(
            [{"type": "demo.echo"}, {"type": "demo.echo", "deadline": timedelta(seconds=-1)}]
        )
    assert batch.value.field == "requests[1].deadline_after"
    assert await stack.counts() == before


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    yield connection
    await connection.close()


@pytest.mark.stack(relay=False, worker=False)
async def test_the_sql_api_takes_a_deadline_and_refuses_bad_ones(
    stack: Stack, conn: asyncpg.Connection
) -> None:
    at = datetime.now(UTC) + timedelta(hours=2)
    by_time = await txn.submit_job(conn, tenant="acme", type="demo.echo", deadline=at)
    by_after = await txn.submit_job(
        conn, tenant="acme", type="demo.echo", deadline=timedelta(minutes=10)
    )
    assert (await stack.client().get(f"jobs/{by_time}")).deadline == at
    after = (await stack.client().get(f"jobs/{by_after}")).deadline
    assert after is not None and timedelta(minutes=9) < after - datetime.now(UTC)
    # Old callers (no deadline) work as before.
    plain = await txn.submit_job(conn, tenant="acme", type="demo.echo")
    assert (await stack.client().get(f"jobs/{plain}")).deadline is None
    before = await stack.counts()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"deadline": datetime.now(UTC) - timedelta(seconds=1)}, "deadline"),
        ({"deadline": datetime.now(UTC) + timedelta(days=400)}, "deadline"),
        ({"deadline": 0}, "deadline_after"),
        ({"deadline": timedelta(days=367)}, "deadline_after"),
        ({"deadline": at, "schedule_time": at + timedelta(hours=1)}, "deadline"),
        ({"deadline": 60, "schedule_delay": 600}, "deadline_after"),
    ]
    for kwargs, field in cases:
        with pytest.raises(SqlInvalidArgument) as info:
            await txn.submit_job(conn, tenant="acme", type="demo.echo", **kwargs)
        assert info.value.field == field, kwargs
    assert await stack.counts() == before


# -- the CLI and the dashboard -----------------------------------------------


async def test_the_cli_submits_a_deadline_and_shows_it(stack: Stack) -> None:
    from tests.integration.test_cli_and_sync import jobplane

    code, out, err = await jobplane(
        stack, "submit", "demo.echo", "--in", "5m", "--deadline", "2099-01-01T00:00:00Z"
    )
    assert code == 1 and "deadline" in err, err  # beyond the horizon: refused, naming it
    code, out, err = await jobplane(
        stack, "submit", "demo.echo", "--in", "5m", "--deadline", "10m", "--json"
    )
    assert code == 0, err
    submitted = json.loads(out)
    assert submitted["deadline"] is not None
    code, out, err = await jobplane(stack, "get", submitted["name"])
    assert code == 0 and "deadline" in out, err
    code, out, err = await jobplane(stack, "submit", "demo.echo", "--deadline", "soon")
    assert code == 2 and "--deadline" in err


async def test_the_job_page_shows_the_deadline(
    template_db: str, run_id: str, amqp_url: str
) -> None:
    from tests.support.dashboard import browserless, ui_stack

    async with ui_stack(template_db, run_id, amqp_url) as ui:
        client = ui.stack.client()
        job = await client.submit("demo.echo", {}, schedule_delay=600, deadline=3600)
        plain = await client.submit("demo.echo", {}, schedule_delay=600)
        assert job.deadline is not None
        async with browserless(ui.url, ui.stack.key) as http:
            page = await (await http.get(f"/jobs/{job.id}")).text()
            assert 'id="job-deadline"' in page
            assert job.deadline.strftime("%Y-%m-%d %H:%M:%S") in page
            other = await (await http.get(f"/jobs/{plain.id}")).text()
            assert 'id="job-deadline"' not in other


@pytest.mark.stack(relay=False, worker=False)
async def test_a_deadline_ends_a_job_its_dependents_wait_for_and_a_waiting_one(
    stack: Stack, sweeper: Sweeper
) -> None:
    """A deadline is an end like any other: the jobs that run after it are
    settled by their policy; a job still waiting for others ends at its own."""
    client = stack.client()
    first = await client.submit("demo.echo", {}, deadline=timedelta(seconds=1))
    failing = await client.submit("demo.echo", {}, after=[first])
    anyway = await client.submit("demo.echo", {}, after=[first], after_failure="run_anyway")
    late = await client.submit("demo.echo", {}, after=[anyway], deadline=timedelta(seconds=2))
    await _ended(stack, first)
    failed = await asyncio.wait_for(client.wait(failing.name), timeout=30)
    assert failed.state is JobState.FAILED
    assert failed.error is not None and failed.error.code == "DEPENDENCY_FAILED"

    # Run anyway: dispatched now (no worker here, so it stays QUEUED, not waiting).
    async def dispatched() -> bool:
        return (await client.get(anyway.name)).waiting_code != "DEPENDENCIES"

    await eventually(dispatched)
    # The job after it waited for it, and its own deadline came first.
    await _ended(stack, late)
