"""Delayed jobs: submitted now, visible at once, dispatched when their time comes.

A job with a ``schedule_time`` (or a ``schedule_delay``) is QUEUED with
``waiting_code`` SCHEDULED until then; its dispatch is an outbox row due at
that time, which the relay publishes on time (it sleeps until the earliest
due row, and a NOTIFY wakes it for an earlier one). Cancelling it leaves no
dispatch behind; bad times are refused with the field and write nothing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from hypothesis import given, note, settings
from hypothesis import strategies as st

from jobplane import txn
from jobplane.client import InvalidArgument, JobState
from jobplane.errors import InvalidArgument as SqlInvalidArgument
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS
from jobplane.store.engine import asyncpg_dsn
from jobplane.types import WaitingCode
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.support.answers import check_refusal
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.timeout(120)

_DISPATCH = "SELECT {what} FROM outbox WHERE kind = 'job.dispatch' AND job_id = :id"


@pytest.fixture
async def stub(stack: Stack) -> AsyncIterator[jobs_pb2_grpc.JobServiceAsyncStub]:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        yield jobs_pb2_grpc.JobServiceStub(channel)


def _auth(stack: Stack) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {stack.key}"),)


async def test_a_delayed_job_waits_scheduled_then_runs_on_time(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {"n": 1}, schedule_delay=2.0)
    assert job.state is JobState.QUEUED
    assert job.schedule_time is not None
    assert job.waiting_code == WaitingCode.SCHEDULED
    assert job.schedule_time.isoformat() in job.waiting_reason
    # Get and List say the same; the dispatch is due at the job's time.
    got = await client.get(job.name)
    assert (got.waiting_code, got.schedule_time) == ("SCHEDULED", job.schedule_time)
    assert [j.waiting_code for j in (await client.list()).jobs] == ["SCHEDULED"]
    due = await stack.scalar(_DISPATCH.format(what="available_at"), id=job.id)
    assert due == job.schedule_time
    await asyncio.sleep(1.0)
    assert (await client.get(job.name)).state is JobState.QUEUED
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED
    assert done.start_time is not None and done.start_time >= job.schedule_time
    published = await stack.scalar(_DISPATCH.format(what="published_at"), id=job.id)
    assert timedelta(0) <= published - job.schedule_time < timedelta(seconds=1)
    assert done.waiting_code == "" and done.schedule_time == job.schedule_time


async def test_a_time_already_past_runs_at_once(stack: Stack) -> None:
    past = datetime(2001, 2, 3, tzinfo=UTC)
    job = await stack.client().submit("demo.echo", {}, schedule_time=past)
    assert job.schedule_time == past and job.waiting_code == ""
    assert (await stack.client().wait(job.name, timeout=30)).state is JobState.SUCCEEDED


async def test_a_job_without_a_schedule_has_none(stack: Stack) -> None:
    job = await stack.client().submit("demo.echo", {})
    assert job.schedule_time is None and job.waiting_code == ""


@pytest.mark.stack(worker=False)
async def test_cancelling_a_scheduled_job_leaves_no_dispatch(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {}, schedule_delay=1.0)
    cancelled = await client.cancel(job.name)
    assert cancelled.state is JobState.CANCELLED and cancelled.waiting_code == ""
    assert await stack.scalar(_DISPATCH.format(what="count(*)"), id=job.id) == 0
    await asyncio.sleep(1.5)
    assert (await client.get(job.name)).state is JobState.CANCELLED


@pytest.mark.stack(worker=False)
async def test_the_relay_wakes_for_an_earlier_row_and_publishes_it_on_time(
    stack: Stack,
) -> None:
    client = stack.client()
    # A row far ahead: the relay's wait is bounded by its poll, and a new
    # row's NOTIFY wakes it to look again.
    await client.submit("demo.echo", {"far": True}, schedule_delay=3600)
    soon = [
        await client.submit("demo.echo", {"i": i}, schedule_delay=1.0 + i / 2) for i in range(3)
    ]
    now_job = await client.submit("demo.echo", {"now": True})

    async def published(job_id: str) -> bool:
        return await stack.scalar(_DISPATCH.format(what="published_at"), id=job_id) is not None

    await eventually(lambda: published(now_job.id), timeout=5)
    for job in soon:
        assert job.schedule_time is not None
        await eventually(functools.partial(published, job.id), timeout=10)
        at = await stack.scalar(_DISPATCH.format(what="published_at"), id=job.id)
        assert timedelta(0) <= at - job.schedule_time < timedelta(seconds=1), at
    assert await stack.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 1


@pytest.mark.stack(relay=False, worker=False)
async def test_a_batch_takes_a_schedule_per_request(stack: Stack) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    jobs = await stack.client().submit_many(
        [
            {"type": "demo.echo", "schedule_time": at},
            {"type": "demo.echo"},
            {"type": "demo.echo", "schedule_delay": timedelta(minutes=5)},
        ]
    )
    assert [j.waiting_code for j in jobs] == ["SCHEDULED", "", "SCHEDULED"]
    assert jobs[0].schedule_time == at
    before = await stack.counts()
    with pytest.raises(InvalidArgument) as info:
        await stack.client().submit_many(
            [{"type": "demo.echo"}, {"type": "demo.echo", "schedule_delay": -1}]
        )
    assert info.value.field == "requests[1].schedule_delay"
    assert await stack.counts() == before


@pytest.mark.stack(relay=False, worker=False)
async def test_job_queued_carries_the_schedule_time(stack: Stack) -> None:
    at = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=678901)
    job = await stack.client().submit("demo.echo", {}, schedule_time=at)
    plain = await stack.client().submit("demo.echo", {})
    payloads = {
        str(row_job): json.loads(p) if isinstance(p, str) else p
        for row_job, p in await _queued_events(stack)
    }
    assert payloads[job.id]["schedule_time"] == at.strftime("%Y-%m-%dT%H:%M:%S.678901Z")
    assert "schedule_time" not in payloads[plain.id]


async def _queued_events(stack: Stack) -> list[tuple[Any, Any]]:
    from sqlalchemy import text

    async with stack.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT job_id, payload FROM events WHERE event_type = 'job.queued'")
        )
        return [(r[0], r[1]) for r in rows]


# -- the SQL API, in the caller's own transaction ----------------------------


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    yield connection
    await connection.close()


@pytest.mark.stack(relay=False, worker=False)
async def test_the_sql_api_takes_a_time_or_a_delay(stack: Stack, conn: asyncpg.Connection) -> None:
    at = datetime.now(UTC) + timedelta(hours=2)
    by_time = await txn.submit_job(conn, tenant="acme", type="demo.echo", schedule_time=at)
    by_delay = await txn.submit_job(
        conn, tenant="acme", type="demo.echo", schedule_delay=timedelta(minutes=10)
    )
    got = await stack.client().get(f"jobs/{by_time}")
    assert got.schedule_time == at and got.waiting_code == "SCHEDULED"
    due = await stack.scalar(_DISPATCH.format(what="available_at"), id=by_time)
    assert due == at
    delayed = await stack.client().get(f"jobs/{by_delay}")
    assert delayed.schedule_time is not None
    assert (
        timedelta(minutes=9)
        < delayed.schedule_time - datetime.now(UTC)
        < timedelta(minutes=10, seconds=5)
    )
    before = await stack.counts()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"schedule_time": at, "schedule_delay": 5}, "schedule_delay"),
        ({"schedule_time": datetime(1999, 12, 31, tzinfo=UTC)}, "schedule_time"),
        ({"schedule_time": datetime.now(UTC) + timedelta(days=400)}, "schedule_time"),
        ({"schedule_delay": -1}, "schedule_delay"),
        ({"schedule_delay": timedelta(days=367)}, "schedule_delay"),
        ({"schedule_delay": float("nan")}, "schedule_delay"),
    ]
    for kwargs, field in cases:
        with pytest.raises(SqlInvalidArgument) as info:
            await txn.submit_job(conn, tenant="acme", type="demo.echo", **kwargs)
        assert info.value.field == field, kwargs
    assert await stack.counts() == before


# -- bad input over gRPC ----------------------------------------------------

_HORIZON = int(DEFAULT_MAX_SCHEDULE_SECONDS)
_Y2000 = 946_684_800
_TIMESTAMP_MIN, _TIMESTAMP_MAX = -62_135_596_800, 253_402_300_799


def _valid_time(seconds: int) -> bool:
    now = datetime.now(UTC).timestamp()
    # A margin either side of the horizon: the server's clock moves meanwhile.
    return seconds >= _Y2000 and seconds < now + _HORIZON - 60


_TIMES = st.one_of(
    st.integers(_TIMESTAMP_MIN - 10, _TIMESTAMP_MAX + 10),
    st.integers(_Y2000 - 5, _Y2000 + 5),
    st.integers(-(2**63), 2**63 - 1),
    st.just(int(datetime.now(UTC).timestamp()) + _HORIZON + 3600),
)
_NANOS = st.one_of(st.just(0), st.integers(-(2**31), 2**31 - 1), st.integers(0, 999_999_999))
_DELAYS = st.one_of(
    st.integers(-5, 5),
    st.integers(_HORIZON - 5, _HORIZON + 5),
    st.integers(-(2**63), 2**63 - 1),
)


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[jobs_pb2.SubmitJobRequest, str | None]:
    """A request with a schedule, and the field it must be refused on (None: taken)."""
    request = jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=str(uuid.uuid4()))
    use_time, use_delay = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    time_nanos = delay_nanos = 0
    if use_time:
        seconds, time_nanos = draw(_TIMES), draw(_NANOS)
        request.schedule_time.CopyFrom(timestamp_pb2.Timestamp(seconds=seconds, nanos=time_nanos))
    if use_delay:
        delay, delay_nanos = draw(_DELAYS), draw(st.sampled_from([0, 1, -1, 500_000_000]))
        request.schedule_delay.CopyFrom(duration_pb2.Duration(seconds=delay, nanos=delay_nanos))
    return request, _refused_field(request, use_time, use_delay)


def _refused_field(request: jobs_pb2.SubmitJobRequest, time: bool, delay: bool) -> str | None:
    """The field the server names for ``request`` (its checks' order), None when valid."""
    if time:
        t = request.schedule_time
        if not (_TIMESTAMP_MIN <= t.seconds <= _TIMESTAMP_MAX and 0 <= t.nanos < 10**9):
            return "schedule_time"
    if delay:
        d = request.schedule_delay
        total = d.seconds + d.nanos / 1e9
        if (
            abs(d.seconds) > 315_576_000_000
            or (d.seconds > 0 > d.nanos)
            or (d.seconds < 0 < d.nanos)
        ):
            return "schedule_delay"
        if time:
            return "schedule_delay"
        return None if 0 <= total <= _HORIZON - 60 else "schedule_delay"
    return None if _valid_time(request.schedule_time.seconds) else "schedule_time"


def _ambiguous(request: jobs_pb2.SubmitJobRequest) -> bool:
    """Within a minute of a bound that moves with the clock: either answer is right."""
    if request.HasField("schedule_delay") or not request.HasField("schedule_time"):
        d = request.schedule_delay.seconds
        return abs(d - _HORIZON) <= 60
    now = datetime.now(UTC).timestamp()
    return abs(request.schedule_time.seconds - (now + _HORIZON)) <= 120


@pytest.mark.stack(relay=False, worker=False)
async def test_bad_schedules_are_refused_on_their_field_and_write_nothing(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    loop = asyncio.get_running_loop()
    seen = {"taken": 0, "refused": 0}

    async def judge(request: jobs_pb2.SubmitJobRequest, field: str | None) -> None:
        if _ambiguous(request):
            return
        before = await stack.counts()
        try:
            job = await stub.SubmitJob(request, metadata=_auth(stack))
        except grpc.aio.AioRpcError as exc:
            refusal = check_refusal(exc)
            assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT, refusal
            assert refusal.field == field, (refusal, field)
            assert await stack.counts() == before
            seen["refused"] += 1
            return
        assert field is None, f"taken, but {field} is wrong"
        assert job.HasField("schedule_time")
        seen["taken"] += 1

    @settings(max_examples=150, deadline=None)
    @given(_schedules())
    def check(drawn: tuple[jobs_pb2.SubmitJobRequest, str | None]) -> None:
        request, field = drawn
        note(str(request))
        asyncio.run_coroutine_threadsafe(judge(request, field), loop).result()

    await asyncio.to_thread(check)
    assert seen["taken"] > 5 and seen["refused"] > 20, seen


# -- cost: the jobs waiting cost the relay's claim nothing -------------------


@pytest.mark.stack(relay=False, worker=False)
async def test_the_claim_reads_no_waiting_row(stack: Stack) -> None:
    """With thousands of dispatches not yet due, the relay's claim (fair or in due
    order) reads its dispatches as ranges that stop at now(): none of the waiting
    ones but the fair claim's one probe per (queue, tenant)."""
    from sqlalchemy import text

    from jobplane.store.outbox import _NEXT_DUE
    from tests.support.plans import dispatch_parts, relay_claims, rows_read

    client = stack.client()
    for start in range(0, 10_000, 1000):
        await client.submit_many(
            [
                {"type": "demo.echo", "payload": {"i": i}, "schedule_delay": 86_400}
                for i in range(start, start + 1000)
            ]
        )
    due = await client.submit("demo.echo", {"due": True})
    async with stack.engine.connect() as conn:
        await conn.execute(text("ANALYZE outbox"))
        for name, (statement, binds) in relay_claims(stack.topology).items():
            plan = await _explained(conn, statement.text, binds)
            # The due dispatch, read by each step that takes it (the fair claim
            # counts it, then locks it), and the fair claim's probes of the
            # (queue, tenant) pairs and the tenant's weight.
            read = sum(rows_read(node) for node in dispatch_parts(plan["Plan"]))
            assert read <= 5, (name, read, json.dumps(plan))
            _few_pages_no_seq_scan(plan)
        _few_pages_no_seq_scan(await _explained(conn, _NEXT_DUE.text, {}))
        await conn.rollback()
    assert due.waiting_code == ""


async def _explained(conn: Any, sql: str, binds: dict[str, Any]) -> dict[str, Any]:
    from sqlalchemy import text

    result = await conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"), binds)
    plan: dict[str, Any] = result.scalar_one()[0]
    return plan


def _few_pages_no_seq_scan(plan: dict[str, Any]) -> None:
    from tests.support.plans import scans

    found, shown = scans(plan["Plan"]), json.dumps(plan)
    assert found and not [s for s in found if s.startswith("Seq Scan")], shown
    # A handful of pages, not the 10,000 waiting rows' hundreds.
    root = plan["Plan"]
    assert root["Shared Hit Blocks"] + root.get("Shared Read Blocks", 0) < 50, shown


@pytest.mark.stack(worker=False)
async def test_repairs_leave_a_scheduled_job_waiting(stack: Stack) -> None:
    """The sweeper re-publishes only dispatches published and lost; an operator's
    re-dispatch of a job not due yet is due at its schedule_time still."""
    from jobplane.store.sweeps import SweepStore
    from jobplane.workers.sweeper import Sweeper

    job = await stack.client().submit("demo.echo", {}, schedule_delay=3600)
    sweeper = Sweeper(stack.engine, republish_after=0.0, republish_every=0.0)
    for _ in range(2):
        result = await sweeper.sweep_once()
        assert result.republished == 0
    row = "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
    assert await stack.scalar(row) == 1
    again = await SweepStore(stack.engine).redispatch(stack.tenant_id, uuid.UUID(job.id), "test")
    assert again is not None and again.waiting_code == "SCHEDULED"
    due = await stack.scalar(
        "SELECT o.available_at FROM outbox o JOIN jobs j ON o.id = j.dispatch_id WHERE j.id = :id",
        id=job.id,
    )
    assert due == job.schedule_time
    assert (await stack.client().get(job.name)).waiting_code == "SCHEDULED"
