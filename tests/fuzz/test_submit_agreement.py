"""The SubmitJob RPC and ``jobplane.submit_job`` agree on every request.

Each drawn request (valid or not: bad types, huge, deep, NUL or NaN payloads,
odd labels, ids and timeouts, unroutable types) goes to a real server over
gRPC, for one tenant, and to the SQL function through :mod:`jobplane.txn`, for
another. Both must accept or both refuse; an accepted pair must have written
the same rows (job, first event, outbox row, its job.queued domain event
and that event's outbox row: compared column by column, and
the number of rows of every table). Then the same request_id again, with the
same request or a changed one: both must answer alike (the same job, or
REQUEST_ID_REUSED).

The SQL side gets the values the server got: what a protobuf Struct makes
of the payload's numbers, and the timeout as the server reads a Duration.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from google.protobuf import duration_pb2
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import txn
from jobplane.client import AsyncClient
from jobplane.convert import dict_from_struct, seconds_from_duration, struct_from_dict
from jobplane.errors import JobplaneError, RequestIdReused
from jobplane.names import parse_job_name
from jobplane.server import JobplaneServer
from jobplane.store.engine import asyncpg_dsn
from jobplane.store.machine import lifecycle_event_id
from jobplane.topology import QueueSpec, Topology
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


@dataclass(frozen=True)
class Request:
    """One SubmitJob, in the SDK's terms."""

    type: str
    payload: dict[str, Any]
    request_id: str
    correlation_id: str
    max_attempts: int
    labels: dict[str, str]
    timeout: float | None


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
    request_id=_mostly(st.uuids().map(str), st.one_of(st.just(""), texts())),
    correlation_id=_mostly(st.from_regex(r"[a-z0-9-]{0,40}", fullmatch=True), texts()),
    max_attempts=_mostly(
        st.integers(0, 100), integers(-(2**31), 2**31 - 1) | st.sampled_from([101, -1])
    ),
    labels=_mostly(_VALID_LABELS, _LABELS),
    timeout=_mostly(st.one_of(st.none(), st.floats(0.001, 604_800.0)), _TIMEOUTS),
)
_CHANGES = st.sampled_from(
    [
        {},
        {"payload": {"changed": True}},
        {"max_attempts": 5},
        {"labels": {"changed": "yes"}},
        {"correlation_id": "changed"},
        {"timeout": 7.25},
    ]
)

# What each path wrote, compared column by column.
_JOB = """
    SELECT type, queue, state, payload::text AS payload, max_attempts, correlation_id,
           labels::text AS labels, timeout_seconds, last_seq, attempt, retry_base,
           dispatch_id IS NOT NULL AS dispatched, result, error_code, progress
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
# Its job.queued (the relays publish it from this row), with what differs
# between two jobs (ids, tenant) written as placeholders.
_DOMAIN = """
    SELECT e.event_type, e.correlation_id, e.causation_id, e.project_id,
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

    async def tenants(self) -> tuple[AsyncClient, str]:
        """A client of a fresh tenant, and the name of another fresh one."""
        n = next(_counter)
        key, _tenant = await self.server.keys.create_key(f"rpc-{n}")
        await self.server.keys.create_key(f"sql-{n}")
        return AsyncClient(self.server.address, key), f"sql-{n}"

    async def counts(self) -> dict[str, int]:
        """Rows of every table."""
        return {t: await self.conn.fetchval(f'SELECT count(*) FROM "{t}"') for t in self.tables}

    async def written(self, job_id: Any) -> list[Any]:
        """What one job's submit wrote."""
        return [
            dict(await self.conn.fetchrow(_JOB, job_id) or {}),
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


async def _rpc(client: AsyncClient, request: Request) -> Any:
    try:
        job = await client.submit(
            request.type,
            request.payload,
            request_id=request.request_id,
            correlation_id=request.correlation_id,
            max_attempts=request.max_attempts,
            labels=request.labels,
            attempt_timeout=request.timeout,
        )
    except JobplaneError as exc:
        return exc
    return parse_job_name(job.name)


async def _sql(conn: asyncpg.Connection, tenant: str, request: Request) -> Any:
    payload, timeout = _as_the_server_reads(request)
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
            )
    except JobplaneError as exc:
        return exc


def _outcome(answer: Any, first: Any) -> str:
    if isinstance(answer, RequestIdReused):
        return "reused"
    if isinstance(answer, JobplaneError):
        return "refused"
    return "same job" if answer == first else "new job"


async def _judge(sides: Sides, request: Request, change: dict[str, Any]) -> None:
    client, sql_tenant = await sides.tenants()
    try:
        before = await sides.counts()
        rpc = await _rpc(client, request)
        between = await sides.counts()
        sql = await _sql(sides.conn, sql_tenant, request)
        after = await sides.counts()
        said = f"rpc: {rpc!r}, sql: {sql!r}"
        assert isinstance(rpc, JobplaneError) == isinstance(sql, JobplaneError), said
        rpc_rows = {t: between[t] - before[t] for t in before}
        sql_rows = {t: after[t] - between[t] for t in before}
        assert rpc_rows == sql_rows, said
        if isinstance(rpc, JobplaneError):
            return
        assert await sides.written(rpc) == await sides.written(sql)
        again = replace(request, **change)
        rpc_again = await _rpc(client, again)
        sql_again = await _sql(sides.conn, sql_tenant, again)
        said = f"again: rpc {rpc_again!r}, sql {sql_again!r}"
        assert _outcome(rpc_again, rpc) == _outcome(sql_again, sql), said
    finally:
        await client.close()


async def test_the_rpc_and_the_sql_function_agree(sides: Sides) -> None:
    loop = asyncio.get_running_loop()
    profile = settings.default
    assert profile is not None

    @settings(max_examples=profile.max_examples * 2)
    @given(_REQUESTS, _CHANGES)
    def check(request: Request, change: dict[str, Any]) -> None:
        note(repr(request)[:2000])
        asyncio.run_coroutine_threadsafe(_judge(sides, request, change), loop).result()

    await asyncio.to_thread(check)
    # The draws must reach both sides of every decision, or nothing was compared.
    accepted = await sides.conn.fetchval("SELECT count(*) FROM jobs")
    assert accepted > 20, accepted


def test_nan_cannot_reach_the_sql_function() -> None:
    """jsonb has no NaN: the helper refuses it as the RPC does, with the field."""
    with pytest.raises(JobplaneError) as refused:
        txn._json({"n": math.nan}, "payload")
    assert refused.value.field == "payload"
