"""The PublishEvent RPC and ``jobplane.publish_event`` agree on every request.

Each drawn event (valid or not: odd ids, types, times, ids of every length,
huge, deep, NUL or NaN payloads, trace context good and bad) goes to a real
server over gRPC, for one tenant, and to the SQL function through
:mod:`jobplane.txn`, for another, with the same event_id. Both must accept
or both refuse; an accepted pair must have written the same rows (the event,
compared column by column, trace context included, and read back as an
event the relay can publish; the number of rows of every table). Then the same event_id
again, with the same event or a changed one: both must answer alike (the
same event, or EVENT_ID_REUSED).

The SQL side gets the values the server got: what a protobuf Struct makes of
the payload's numbers, and the time as the server reads a Timestamp.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import asyncpg
import grpc
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import txn
from jobplane.client._errors import error_from_rpc
from jobplane.convert import dict_from_struct, struct_from_dict
from jobplane.errors import EventIdReused, JobplaneError
from jobplane.events import Event, decode, encode
from jobplane.server import JobplaneServer
from jobplane.store.engine import asyncpg_dsn
from jobplane.topology import QueueSpec, Topology
from jobplane.v1 import events_pb2, events_pb2_grpc
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
    exchange="agree-events.jobs",
    queues=(QueueSpec("agree-events.demo", ("demo.*",)),),
    events_exchange="agree-events.events",
)
_counter = itertools.count(1)
_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

_VALID_TYPES = st.from_regex(
    r"[a-z0-9][a-z0-9_-]{0,8}(\.[a-z0-9][a-z0-9_-]{0,8}){0,3}", fullmatch=True
)
_TYPES = st.one_of(
    st.sampled_from(["", "Artifact.created", "a." + "b" * 126, "a." + "b" * 127, "a..b", "a.b\n"]),
    texts(),
)
_IDS = st.one_of(
    st.sampled_from(
        [
            "",
            "00000000-0000-0000-0000-000000000000",
            "7B1C1B0E-0000-4000-8000-000000000001",
            "7b1c1b0e00004000800000000000000a",
            "{7b1c1b0e-0000-4000-8000-000000000001}",
            "7b1c1b0e-0000-4000-8000-00000000000g",
        ]
    ),
    texts(40),
)
_OPTIONAL_IDS = st.one_of(
    st.none(),
    st.sampled_from(["", "é" * 127, "é" * 128, "a" * 255, "a" * 256, "a\tb", "a\x7fb", "a\x00"]),
    texts(),
)
_TIMES = st.one_of(
    st.none(),
    st.sampled_from(
        [
            datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
            datetime(1970, 1, 1, tzinfo=UTC),
            datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        ]
    ),
    st.datetimes(datetime(1900, 1, 1), datetime(9999, 12, 31), timezones=st.just(UTC)),
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
_PAYLOADS = st.one_of(
    st.dictionaries(texts(12), _TREES, max_size=5),
    # Around the depth limit (32), below what protobuf itself refuses.
    st.builds(
        lambda kinds, leaf: {"deep": plain(Chain(tuple(kinds), leaf))},
        st.integers(28, 36).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n)),
        _LEAVES,
    ),
    st.integers(_LIMIT - 40, _LIMIT + 10).map(lambda n: {"blob": "é" * (n // 2), "n": 1.5e-7}),
)
# Payloads the RPC takes (no NUL, finite numbers), so most draws get past
# validation and the stored rows are compared.
_CLEAN_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
_CLEAN_PAYLOADS = st.dictionaries(
    _CLEAN_TEXT,
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            integers(-(2**53), 2**53),
            st.floats(allow_nan=False, allow_infinity=False),
            _CLEAN_TEXT,
        ),
        lambda kids: st.one_of(
            st.lists(kids, max_size=4), st.dictionaries(_CLEAN_TEXT, kids, max_size=4)
        ),
        max_leaves=12,
    ),
    max_size=5,
)
# Metadata values are printable ASCII; within that, valid and not.
_TRACE = st.one_of(
    st.none(),
    st.just(_TRACEPARENT),
    st.sampled_from([_TRACEPARENT.upper(), _TRACEPARENT + "-x", "00-00", "x" * 600]),
)
_TRACESTATE = st.one_of(st.none(), st.sampled_from(["vendor=x", "a" * 513, "k=v,l=w"]))


def _mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid three times in four."""
    return st.one_of(valid, valid, valid, odd)


@dataclass(frozen=True)
class Request:
    """One PublishEvent, in plain values (None: the field unset)."""

    event_id: str
    event_type: str
    payload: dict[str, Any]
    timestamp: datetime | None
    project_id: str | None
    correlation_id: str
    causation_id: str | None
    traceparent: str | None
    tracestate: str | None


_VALID = {
    "event_id": st.uuids().map(str),
    "event_type": _VALID_TYPES,
    "payload": _CLEAN_PAYLOADS,
    "timestamp": st.one_of(st.none(), _TIMES.filter(lambda t: t is None or t.year >= 1970)),
    "project_id": st.one_of(st.none(), st.just("web")),
    "correlation_id": st.from_regex(r"[a-z0-9-]{0,40}", fullmatch=True),
    "causation_id": st.one_of(st.none(), st.uuids().map(str)),
}
_ODD = {
    "event_id": _IDS,
    "event_type": _TYPES,
    "payload": _PAYLOADS,
    "timestamp": _TIMES,
    "project_id": _OPTIONAL_IDS,
    "correlation_id": texts(),
    "causation_id": _OPTIONAL_IDS,
}
# Half the draws valid in every field (their rows are compared), half with
# odd values here and there (their refusals are compared).
_REQUESTS = st.one_of(
    st.builds(Request, **_VALID, traceparent=_TRACE, tracestate=_TRACESTATE),
    st.builds(
        Request,
        **{name: _mostly(_VALID[name], _ODD[name]) for name in _VALID},
        traceparent=_TRACE,
        tracestate=_TRACESTATE,
    ),
)
_CHANGES = st.sampled_from(
    [
        {},
        {"payload": {"changed": True}},
        {"event_type": "other.type"},
        {"correlation_id": "changed"},
        {"project_id": "changed"},
        {"causation_id": None},
        {"timestamp": datetime(2030, 1, 1, tzinfo=UTC)},
        {"traceparent": None, "tracestate": None},
    ]
)

# What each path wrote, compared column by column (the time only when given).
_EVENT = """
    SELECT event_type, CASE WHEN $3 THEN event_time END AS event_time, project_id,
           correlation_id, causation_id, payload::text AS payload, job_id, traceparent,
           tracestate
    FROM events e JOIN tenants t ON t.id = e.tenant_id WHERE t.name = $1 AND event_id = $2
"""
# What the relays read to publish it.
_STORED = """
    SELECT e.tenant_id, e.event_id, e.event_type, e.event_time, e.project_id,
           e.correlation_id, e.causation_id, e.payload::text AS payload
    FROM events e JOIN tenants t ON t.id = e.tenant_id WHERE t.name = $1
"""
_TABLES = (
    "SELECT table_name FROM information_schema.tables "
    "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
)


@dataclass
class Sides:
    """A server for the RPC side, a connection for the SQL side, and tenants for both."""

    server: JobplaneServer
    stub: events_pb2_grpc.EventServiceAsyncStub
    conn: asyncpg.Connection
    tables: list[str]

    async def tenants(self) -> tuple[str, str, str]:
        """A key of a fresh tenant, its name, and the name of another fresh one."""
        n = next(_counter)
        key, _tenant = await self.server.keys.create_key(f"rpc-{n}")
        await self.server.keys.create_key(f"sql-{n}")
        return key, f"rpc-{n}", f"sql-{n}"

    async def counts(self) -> dict[str, int]:
        """Rows of every table."""
        return {t: await self.conn.fetchval(f'SELECT count(*) FROM "{t}"') for t in self.tables}

    async def written(self, tenant: str, request: Request) -> list[Any]:
        """What one tenant's publish wrote, and that it reads back as an event."""
        given = request.timestamp is not None
        event = await self.conn.fetchrow(_EVENT, tenant, uuid.UUID(request.event_id), given)
        for row in await self.conn.fetch(_STORED, tenant):
            # Checked as the constructor checks every event, then the body
            # the relay builds: every consumer's reader takes it.
            stored = Event(
                event_id=row["event_id"],
                event_type=row["event_type"],
                timestamp=row["event_time"],
                tenant_id=row["tenant_id"],
                project_id=row["project_id"],
                correlation_id=row["correlation_id"],
                causation_id=row["causation_id"],
                payload=json.loads(row["payload"]),
            )
            assert decode(encode(stored)) == stored
        return [dict(event or {})]


@pytest.fixture
async def sides(engine: AsyncEngine, database_url: str, started: Started) -> AsyncIterator[Sides]:
    server = JobplaneServer(
        engine, database_url, _TOPOLOGY, listen="127.0.0.1:0", max_payload_bytes=_LIMIT
    )
    await started(server, grace=0.5)  # which writes its limit for the SQL side
    conn: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            tables = [r["table_name"] for r in await conn.fetch(_TABLES)]
            yield Sides(server, events_pb2_grpc.EventServiceStub(channel), conn, tables)
    finally:
        await conn.close()


def _as_the_server_reads(request: Request) -> dict[str, Any]:
    """The payload the server gets from a Struct."""
    return dict_from_struct(struct_from_dict(request.payload))


async def _rpc(stub: events_pb2_grpc.EventServiceAsyncStub, key: str, request: Request) -> Any:
    message = events_pb2.PublishEventRequest(
        event_id=request.event_id,
        event_type=request.event_type,
        correlation_id=request.correlation_id,
    )
    message.payload.update(request.payload)
    if request.timestamp is not None:
        message.timestamp.FromDatetime(request.timestamp)
    if request.project_id is not None:
        message.project_id = request.project_id
    if request.causation_id is not None:
        message.causation_id = request.causation_id
    metadata = [("authorization", f"Bearer {key}")]
    if request.traceparent is not None:
        metadata.append(("traceparent", request.traceparent))
    if request.tracestate is not None:
        metadata.append(("tracestate", request.tracestate))
    try:
        reply = await stub.PublishEvent(message, metadata=tuple(metadata), timeout=30)
    except grpc.aio.AioRpcError as exc:
        return error_from_rpc(exc)
    return uuid.UUID(reply.event_id)


async def _sql(conn: asyncpg.Connection, tenant: str, request: Request) -> Any:
    try:
        async with conn.transaction():
            return await txn.publish_event(
                conn,
                tenant=tenant,
                event_type=request.event_type,
                payload=_as_the_server_reads(request),
                event_id=request.event_id,
                timestamp=request.timestamp,
                project_id=request.project_id,
                correlation_id=request.correlation_id,
                causation_id=request.causation_id,
                traceparent=request.traceparent,
                tracestate=request.tracestate,
            )
    except JobplaneError as exc:
        return exc


def _outcome(answer: Any, first: Any) -> str:
    if isinstance(answer, EventIdReused):
        return "reused"
    if isinstance(answer, JobplaneError):
        return "refused"
    return "same event" if answer == first else "other event"


async def _judge(sides: Sides, request: Request, change: dict[str, Any]) -> None:
    key, rpc_tenant, sql_tenant = await sides.tenants()
    before = await sides.counts()
    rpc = await _rpc(sides.stub, key, request)
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
    assert await sides.written(rpc_tenant, request) == await sides.written(sql_tenant, request)
    again = replace(request, **change)
    rpc_again = await _rpc(sides.stub, key, again)
    sql_again = await _sql(sides.conn, sql_tenant, again)
    said = f"again: rpc {rpc_again!r}, sql {sql_again!r}"
    assert _outcome(rpc_again, rpc) == _outcome(sql_again, sql), said
    assert await sides.counts() == after  # a replay writes nothing, by either path


async def test_the_rpc_and_the_sql_function_agree(sides: Sides) -> None:
    loop = asyncio.get_running_loop()
    profile = settings.default
    assert profile is not None

    @settings(max_examples=profile.max_examples)
    @given(_REQUESTS, _CHANGES)
    def check(request: Request, change: dict[str, Any]) -> None:
        note(repr(request)[:2000])
        asyncio.run_coroutine_threadsafe(_judge(sides, request, change), loop).result()

    await asyncio.to_thread(check)
    # The draws must reach both sides of every decision, or nothing was compared.
    accepted = await sides.conn.fetchval("SELECT count(*) FROM events")
    assert accepted > 40, accepted
