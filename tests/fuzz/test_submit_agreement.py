"""SubmitJob, BatchSubmitJobs and ``jobplane.submit_job`` agree on every request.

Each drawn request (valid or not: bad types, huge, deep, NUL or NaN payloads,
odd labels, ids and timeouts, unroutable types, schedule times and delays in
and out of range, concurrency keys, limits and modes) goes to a real server
over gRPC as SubmitJob, for one tenant, and as the one request of a
BatchSubmitJobs, for another, and to the SQL function through
:mod:`jobplane.txn`, for a third. All must accept or all refuse, naming the
same field (the batch's prefixed ``requests[0].``); an accepted trio must have
written the same rows (job, first event, outbox row, its job.queued domain
event and that event's outbox row: compared column by column, and the
number of rows of every table). Then the same request_id again, with the
same request or a changed one: all must answer alike (the same job, or
REQUEST_ID_REUSED).

The SQL side gets the values the server got: what a protobuf Struct makes
of the payload's numbers, the timeout and the delay as the server reads a
Duration, the time as it reads a Timestamp, the mode's name. A Timestamp or
Duration protobuf cannot hold has no SQL counterpart: the two RPCs alone
are compared then.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import txn
from jobplane.client import AsyncClient
from jobplane.convert import dict_from_struct, seconds_from_duration, struct_from_dict
from jobplane.errors import JobplaneError, RequestIdReused
from jobplane.names import parse_job_name
from jobplane.scheduling import time_from_timestamp
from jobplane.server import JobplaneServer
from jobplane.store.engine import asyncpg_dsn
from jobplane.store.machine import lifecycle_event_id
from jobplane.topology import QueueSpec, Topology
from jobplane.v1 import jobs_pb2
from tests.fuzz.conftest import PROFILE
from tests.fuzz.strategies import Chain, integers, plain, texts
from tests.support.parts import Started

pytestmark = [
    pytest.mark.timeout(300 if PROFILE == "quick" else 3600),
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

# Small, so that sizes near it are cheap to reach.
_LIMIT = 4096
_TOPOLOGY = Topology(
    exchange="agree.jobs",
    queues=(
        QueueSpec("agree.demo", ("demo.*",), max_attempts=4, timeout_seconds=60.0),
        QueueSpec("agree.reports", ("reports.#", "*.pdf"), max_attempts=2, timeout_seconds=5.5),
    ),
)
_counter = itertools.count(1)

_TYPES = st.one_of(
    st.sampled_from(["demo.echo", "reports.render.pdf", "x.pdf", "other.thing", "", "Demo.echo"]),
    st.sampled_from(["demo." + "a" * 123, "demo." + "a" * 124, "demo.a b", "demo.echo\n"]),
    st.from_regex(r"(demo|reports|x)\.[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True),
    texts(),
)
_LABEL_KEYS = st.one_of(
    st.from_regex(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?", fullmatch=True),
    st.sampled_from(["A", "a" * 63, "a" * 64, "-a", "a-", "a\x00"]),
    texts(8),
)
_LABELS = st.one_of(
    st.dictionaries(_LABEL_KEYS, texts(), max_size=4),
    st.integers(60, 70).map(lambda n: {f"k{i}": "v" for i in range(n)}),
)
_NUMBERS = st.one_of(
    integers(-(2**53), 2**53),
    st.floats(),
    st.sampled_from([0.1, 1e15, 1e16, 1.5e-7, 9007199254740994.0, 4.73976911071541e16]),
)
_LEAVES = st.one_of(st.none(), st.booleans(), _NUMBERS, texts())
_TREES = st.recursive(
    _LEAVES,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(texts(12), kids, max_size=4)
    ),
    max_leaves=12,
)


def _near_the_limit(n: int) -> dict[str, Any]:
    return {"blob": "é" * (n // 2), "n": 1.5e-7}


_PAYLOADS = st.one_of(
    st.dictionaries(texts(12), _TREES, max_size=5),
    # Around the depth limit (32), below what protobuf itself refuses.
    st.builds(
        lambda kinds, leaf: {"deep": plain(Chain(tuple(kinds), leaf))},
        st.integers(28, 36).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n)),
        _LEAVES,
    ),
    st.integers(_LIMIT - 40, _LIMIT + 10).map(_near_the_limit),
)
_TIMEOUTS = st.one_of(
    st.none(),
    st.sampled_from([0.0, 0.001, 0.0009, 0.5, 604_800.0, 604_800.001, -1.0]),
    st.floats(-10.0, 700_000.0),
)


# The server's default horizon (JOBPLANE_MAX_SCHEDULE_SECONDS), and 2000-01-01.
_HORIZON = 366 * 86_400
_Y2000 = 946_684_800
_DAY = 86_400


def _at(offset: float) -> tuple[int, int]:
    """A Timestamp's (seconds, nanos) ``offset`` seconds from now, drawn when used."""
    seconds, fraction = divmod(time.time() + offset, 1)
    return int(seconds), int(fraction * 1e9)


# (seconds, nanos) of a Timestamp: past, due, ahead, around 2000, beyond the
# horizon (a day either side of it, so the two clocks cannot disagree), and
# outside protobuf's range.
_SCHEDULE_TIMES = st.one_of(
    st.none(),
    st.none(),
    st.floats(-20 * 365 * _DAY, _HORIZON - _DAY).map(_at),
    st.floats(_HORIZON + _DAY, 9000 * 365 * _DAY).map(_at),
    st.sampled_from(
        [(_Y2000, 0), (_Y2000 - 1, 999_999_999), (_Y2000, 1), (0, 0), (-62_135_596_800, 0)]
    ),
    st.tuples(integers(-(2**40), 2**40), integers(-(2**31), 2**31 - 1)),
)
# (seconds, nanos) of a Duration: 0, within the horizon, at it, beyond it,
# negative (by a second or a nanosecond), and not a valid Duration.
_SCHEDULE_DELAYS = st.one_of(
    st.none(),
    st.none(),
    st.tuples(st.integers(0, _HORIZON - 1), st.integers(0, 999_999_999)),
    st.sampled_from([(0, 0), (0, 1), (0, -1), (-1, 0), (_HORIZON, 0), (_HORIZON + 1, 0), (0, 999)]),
    st.tuples(integers(-(2**40), 2**40), integers(-(2**31), 2**31 - 1)),
)
_KEYS = st.one_of(
    st.just(""),
    st.just(""),
    st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True),
    st.sampled_from([" ", "\t", "k" * 256, "k" * 257, "k\x01", "k\x85", "k\x7f", "é" * 256]),
    texts(),
)
_KEY_LIMITS = st.one_of(
    st.just(0), st.sampled_from([1, 2, 10_000, 10_001, -1]), integers(-(2**31), 2**31 - 1)
)
# ConcurrencyMode's numbers (0: unspecified, 1: QUEUE, 2: REJECT) and ones it has not.
_MODES = st.one_of(st.sampled_from([0, 0, 1, 2]), st.sampled_from([3, -1, 2**31 - 1]))
_MODE_NAMES = {0: None, 1: "queue", 2: "reject"}


@dataclass(frozen=True)
class Request:
    """One SubmitJob, in the SDK's terms (the schedule as protobuf has it)."""

    type: str
    payload: dict[str, Any]
    request_id: str
    correlation_id: str
    max_attempts: int
    labels: dict[str, str]
    timeout: float | None
    schedule_time: tuple[int, int] | None = None
    schedule_delay: tuple[int, int] | None = None
    concurrency_key: str = ""
    concurrency_limit: int = 0
    concurrency_mode: int = 0


_VALID_TYPES = st.from_regex(r"(demo|reports|x)\.[a-z0-9][a-z0-9_.-]{0,10}", fullmatch=True)
_VALID_LABELS = st.dictionaries(
    st.from_regex(r"[a-z0-9]([a-z0-9._/-]{0,20}[a-z0-9])?", fullmatch=True),
    st.text(max_size=20).filter(lambda v: "\x00" not in v),
    max_size=4,
)


def _mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid three times in four, so that most draws get past validation."""
    return st.one_of(valid, valid, valid, odd)


_REQUESTS = st.builds(
    Request,
    type=_mostly(_VALID_TYPES, _TYPES),
    payload=_mostly(st.dictionaries(texts(12), _TREES, max_size=5), _PAYLOADS),
    request_id=_mostly(
        st.uuids().map(str),
        # The system's own prefixes (refused), and texts that only look like them.
        st.one_of(st.just(""), texts(), st.sampled_from(["fan:", "child:", "fan", "Fan:"]))
        | st.tuples(st.sampled_from(["fan:", "child:"]), texts(12)).map("".join),
    ),
    correlation_id=_mostly(st.from_regex(r"[a-z0-9-]{0,40}", fullmatch=True), texts()),
    max_attempts=_mostly(
        st.integers(0, 100), integers(-(2**31), 2**31 - 1) | st.sampled_from([101, -1])
    ),
    labels=_mostly(_VALID_LABELS, _LABELS),
    timeout=_mostly(st.one_of(st.none(), st.floats(0.001, 604_800.0)), _TIMEOUTS),
    # Mostly unset here: _KEYED_OR_SCHEDULED draws them on valid requests.
    schedule_time=_mostly(st.none(), _SCHEDULE_TIMES),
    schedule_delay=_mostly(st.none(), _SCHEDULE_DELAYS),
    concurrency_key=_mostly(st.just(""), _KEYS),
    concurrency_limit=_mostly(st.just(0), _KEY_LIMITS),
    concurrency_mode=_mostly(st.just(0), _MODES),
)
# The schedule and the concurrency key drawn on a request otherwise valid, so
# that their own checks (and the jobs they make) are reached every time.
_KEYED_OR_SCHEDULED = st.builds(
    Request,
    type=st.sampled_from(["demo.echo", "reports.render.pdf"]),
    payload=st.just({"n": 1}),
    request_id=st.one_of(st.just(""), st.uuids().map(str)),
    correlation_id=st.just(""),
    max_attempts=st.just(0),
    labels=st.just({}),
    timeout=st.none(),
    schedule_time=_SCHEDULE_TIMES,
    schedule_delay=_SCHEDULE_DELAYS,
    concurrency_key=_KEYS,
    concurrency_limit=_KEY_LIMITS,
    concurrency_mode=_MODES,
)
_CHANGES = st.sampled_from(
    [
        {},
        {"payload": {"changed": True}},
        {"max_attempts": 5},
        {"labels": {"changed": "yes"}},
        {"correlation_id": "changed"},
        {"timeout": 7.25},
        {"concurrency_key": "changed", "concurrency_limit": 0, "concurrency_mode": 0},
        {"schedule_delay": (5, 0), "schedule_time": None},
    ]
)

# What each path wrote, compared column by column.
_JOB = """
    SELECT type, queue, state, payload::text AS payload, max_attempts, correlation_id,
           labels::text AS labels, timeout_seconds, last_seq, attempt, retry_base,
           dispatch_id IS NOT NULL AS dispatched, result, error_code, progress,
           schedule_time IS NOT NULL AS scheduled, schedule_time, concurrency_key,
           concurrency_limit
    FROM jobs WHERE id = $1
"""
_EVENTS = """
    SELECT seq, type, state, progress, message, data::text AS data, attempt
    FROM job_events WHERE job_id = $1 ORDER BY seq
"""
_OUTBOX = """
    SELECT o.routing_key, o.correlation_id, o.published_at, o.id = j.dispatch_id AS current,
           o.available_at <= now() AS due
    FROM outbox o JOIN jobs j ON j.id = o.job_id WHERE o.job_id = $1
"""
# Its job.queued (the relays publish it from this row, when the topology
# declares its type: both paths mark it a lifecycle event), with what
# differs between two jobs (ids, tenant) written as placeholders.
_DOMAIN = """
    SELECT e.event_type, e.lifecycle, e.correlation_id, e.causation_id, e.project_id,
           e.payload::text AS payload, e.request_hash, e.traceparent, e.tracestate,
           e.event_id::text AS event_id, e.tenant_id::text AS tenant_id,
           e.event_time BETWEEN j.create_time AND now() AS timed
    FROM events e JOIN jobs j ON j.id = e.job_id
    WHERE e.job_id = $1 ORDER BY e.seq
"""
_TIME = re.compile(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"')
_TABLES = (
    "SELECT table_name FROM information_schema.tables "
    "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
)


@dataclass
class Sides:
    """A server for the RPC side, a connection for the SQL side, and tenants for both."""

    server: JobplaneServer
    conn: asyncpg.Connection
    tables: list[str]

    async def tenants(self) -> tuple[AsyncClient, AsyncClient, str]:
        """Clients of two fresh tenants, and the name of a third."""
        n = next(_counter)
        key, _tenant = await self.server.keys.create_key(f"rpc-{n}")
        batch_key, _tenant = await self.server.keys.create_key(f"batch-{n}")
        await self.server.keys.create_key(f"sql-{n}")
        return (
            AsyncClient(self.server.address, key),
            AsyncClient(self.server.address, batch_key),
            f"sql-{n}",
        )

    async def counts(self) -> dict[str, int]:
        """Rows of every table."""
        return {t: await self.conn.fetchval(f'SELECT count(*) FROM "{t}"') for t in self.tables}

    async def written(self, job_id: Any, *, at: bool) -> list[Any]:
        """What one job's submit wrote (its schedule_time itself when ``at``: not a
        delay's, which counts from each side's own clock)."""
        job = dict(await self.conn.fetchrow(_JOB, job_id) or {})
        if not at:
            job.pop("schedule_time")
        return [
            job,
            [dict(r) for r in await self.conn.fetch(_EVENTS, job_id)],
            [dict(r) for r in await self.conn.fetch(_OUTBOX, job_id)],
            [_placeholders(dict(r), job_id) for r in await self.conn.fetch(_DOMAIN, job_id)],
        ]


def _placeholders(row: dict[str, Any], job_id: Any) -> dict[str, Any]:
    """``row`` with the job's id, its tenant, its event's id and time as placeholders."""
    assert row.pop("event_id") == str(lifecycle_event_id(uuid.UUID(str(job_id)), 1))
    names = {
        str(lifecycle_event_id(uuid.UUID(str(job_id)), 1)): "<event>",
        str(job_id): "<job>",
        row.pop("tenant_id"): "<tenant>",
    }
    for key, value in row.items():
        if isinstance(value, str):
            shown = value
            for real, placeholder in names.items():
                shown = shown.replace(real, placeholder)
            row[key] = _TIME.sub('"<time>"', shown)
    return row


@pytest.fixture
async def sides(engine: AsyncEngine, database_url: str, started: Started) -> AsyncIterator[Sides]:
    server = JobplaneServer(
        engine, database_url, _TOPOLOGY, listen="127.0.0.1:0", max_payload_bytes=_LIMIT
    )
    await started(server, grace=0.5)  # which writes its routes and limit for the SQL side
    conn: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        tables = [r["table_name"] for r in await conn.fetch(_TABLES)]
        yield Sides(server, conn, tables)
    finally:
        await conn.close()


def _as_the_server_reads(request: Request) -> tuple[dict[str, Any], float | None]:
    """The payload and timeout the server gets from a Struct and a Duration."""
    payload = dict_from_struct(struct_from_dict(request.payload))
    if request.timeout is None:
        return payload, None
    duration = duration_pb2.Duration()
    duration.FromTimedelta(timedelta(seconds=request.timeout))
    return payload, seconds_from_duration(duration, field="timeout")


class _NoSqlValue(Exception):
    """A Timestamp or Duration protobuf cannot hold: nothing to hand the function."""


def _schedule_as_the_server_reads(request: Request) -> tuple[datetime | None, float | None]:
    """The time and the delay the server gets from a Timestamp and a Duration."""
    at = delay = None
    try:
        if request.schedule_time is not None:
            seconds, nanos = request.schedule_time
            at = time_from_timestamp(seconds, nanos, field="schedule_time")
        if request.schedule_delay is not None:
            seconds, nanos = request.schedule_delay
            duration = duration_pb2.Duration(seconds=seconds, nanos=nanos)
            delay = seconds_from_duration(duration, field="schedule_delay")
    except JobplaneError as exc:
        raise _NoSqlValue from exc
    return at, delay


def _pb(request: Request) -> jobs_pb2.SubmitJobRequest:
    """``request`` on the wire, as the SDK sends it (and the fields it checks, raw)."""
    message = jobs_pb2.SubmitJobRequest(
        type=request.type,
        payload=struct_from_dict(request.payload),
        request_id=request.request_id,
        correlation_id=request.correlation_id,
        max_attempts=request.max_attempts,
        labels=request.labels,
        concurrency_key=request.concurrency_key,
        concurrency_limit=request.concurrency_limit,
    )
    message.concurrency_mode = request.concurrency_mode  # type: ignore[assignment]
    if request.timeout is not None:
        message.timeout.FromTimedelta(timedelta(seconds=request.timeout))
    if request.schedule_time is not None:
        seconds, nanos = request.schedule_time
        message.schedule_time.CopyFrom(timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos))
    if request.schedule_delay is not None:
        seconds, nanos = request.schedule_delay
        message.schedule_delay.CopyFrom(duration_pb2.Duration(seconds=seconds, nanos=nanos))
    return message


async def _rpc(client: AsyncClient, request: Request) -> Any:
    try:
        job = await client._call(client._get_stub().SubmitJob, _pb(request))
    except JobplaneError as exc:
        return exc
    return parse_job_name(job.name)


async def _batch(client: AsyncClient, request: Request) -> Any:
    batch = jobs_pb2.BatchSubmitJobsRequest(requests=[_pb(request)])
    try:
        reply = await client._call(client._get_stub().BatchSubmitJobs, batch)
    except JobplaneError as exc:
        return exc
    (job,) = reply.jobs
    return parse_job_name(job.name)


async def _sql(conn: asyncpg.Connection, tenant: str, request: Request) -> Any:
    payload, timeout = _as_the_server_reads(request)
    at, delay = _schedule_as_the_server_reads(request)
    try:
        async with conn.transaction():
            return await txn.submit_job(
                conn,
                tenant=tenant,
                type=request.type,
                payload=payload,
                request_id=request.request_id,
                correlation_id=request.correlation_id,
                max_attempts=request.max_attempts,
                labels=request.labels,
                attempt_timeout=timeout,
                schedule_time=at,
                schedule_delay=delay,
                concurrency_key=request.concurrency_key,
                concurrency_limit=request.concurrency_limit,
                concurrency_mode=_MODE_NAMES.get(
                    request.concurrency_mode, f"mode-{request.concurrency_mode}"
                ),
            )
    except JobplaneError as exc:
        return exc


def _outcome(answer: Any, first: Any) -> str:
    if isinstance(answer, RequestIdReused):
        return "reused"
    if isinstance(answer, JobplaneError):
        return "refused"
    return "same job" if answer == first else "new job"


def _field(answer: Any) -> str | None:
    """The field a refusal names (a batch's without its ``requests[0].``); None: accepted."""
    if not isinstance(answer, JobplaneError):
        return None
    return (answer.field or "").removeprefix("requests[0].").removeprefix("requests[0]")


async def _sql_or_none(sides: Sides, tenant: str, request: Request) -> Any:
    """The SQL side's answer; ``_NoSqlValue`` when the request cannot reach it."""
    try:
        return await _sql(sides.conn, tenant, request)
    except _NoSqlValue as exc:
        return exc


async def _judge(sides: Sides, request: Request, change: dict[str, Any]) -> None:
    client, batch_client, sql_tenant = await sides.tenants()
    try:
        counts = [await sides.counts()]
        answers: list[Any] = []
        for side in ("rpc", "batch", "sql"):
            if side == "rpc":
                answers.append(await _rpc(client, request))
            elif side == "batch":
                answers.append(await _batch(batch_client, request))
            else:
                answers.append(await _sql_or_none(sides, sql_tenant, request))
            counts.append(await sides.counts())
        if isinstance(answers[2], _NoSqlValue):
            answers, counts = answers[:2], counts[:3]
        said = ", ".join(
            f"{side}: {a!r}" for side, a in zip(("rpc", "batch", "sql"), answers, strict=False)
        )
        assert len({_field(a) for a in answers}) == 1, said
        rows = [
            {t: after[t] - before[t] for t in after} for before, after in itertools.pairwise(counts)
        ]
        assert all(r == rows[0] for r in rows), said
        if isinstance(answers[0], JobplaneError):
            return
        at = request.schedule_time is not None
        written = [await sides.written(a, at=at) for a in answers]
        assert all(w == written[0] for w in written), said
        again = replace(request, **change)
        answers_again = [await _rpc(client, again), await _batch(batch_client, again)]
        if len(answers) == 3:
            answers_again.append(await _sql_or_none(sides, sql_tenant, again))
        outcomes = {_outcome(a, first) for a, first in zip(answers_again, answers, strict=True)}
        assert len(outcomes) == 1, f"again: {answers_again!r}"
    finally:
        await client.close()
        await batch_client.close()


def _check(sides: Sides, requests: st.SearchStrategy[Request], loop: Any) -> None:
    profile = settings.default
    assert profile is not None

    @settings(max_examples=profile.max_examples * 2)
    @given(requests, _CHANGES)
    def check(request: Request, change: dict[str, Any]) -> None:
        note(repr(request)[:2000])
        asyncio.run_coroutine_threadsafe(_judge(sides, request, change), loop).result()

    check()


async def test_the_rpcs_and_the_sql_function_agree(sides: Sides) -> None:
    await asyncio.to_thread(_check, sides, _REQUESTS, asyncio.get_running_loop())
    # The draws must reach both sides of every decision, or nothing was compared.
    accepted = await sides.conn.fetchval("SELECT count(*) FROM jobs")
    assert accepted > 20, accepted


async def test_schedules_and_concurrency_keys_agree(sides: Sides) -> None:
    await asyncio.to_thread(_check, sides, _KEYED_OR_SCHEDULED, asyncio.get_running_loop())
    # Delayed jobs, keyed jobs and refusals of each field were all compared.
    made = await sides.conn.fetchrow(
        "SELECT count(*) FILTER (WHERE schedule_time > create_time) AS delayed, "
        "count(*) FILTER (WHERE concurrency_key IS NOT NULL) AS keyed FROM jobs"
    )
    assert made is not None
    assert made["delayed"] > 10 and made["keyed"] > 10, dict(made)


def test_nan_cannot_reach_the_sql_function() -> None:
    """jsonb has no NaN: the helper refuses it as the RPC does, with the field."""
    with pytest.raises(JobplaneError) as refused:
        txn._json({"n": math.nan}, "payload")
    assert refused.value.field == "payload"
