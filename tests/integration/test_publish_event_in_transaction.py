"""An event published inside the caller's own transaction exists iff that transaction commits.

``jobplane.publish_event`` from asyncpg, SQLAlchemy and plain SQL text, on a
real server, relay, Postgres and RabbitMQ: a rolled-back caller leaves no
event and publishes nothing; a committed one reaches a bound queue once and
SubscribeEvents; a replay writes nothing, by either path.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from jobplane import txn
from jobplane.errors import (
    EventIdReused,
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
    TenantNotFound,
)
from jobplane.events import Event, decode, encode
from jobplane.events.convert import event_from_pb
from jobplane.store.engine import asyncpg_dsn
from tests.support.event_api import EventApi, all_published, bound_queue, event_api, request
from tests.support.events import take_all
from tests.support.stack import Stack

# Server and relay; no worker (events need none).
pytestmark = pytest.mark.stack(worker=False)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
_CALLER_TABLE = "CREATE TABLE artifacts (id uuid PRIMARY KEY, path text NOT NULL)"


@pytest.fixture
async def api(stack: Stack) -> AsyncIterator[EventApi]:
    async with event_api(stack) as client:
        yield client


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The caller service's own connection, with a table of its own."""
    connection: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    await connection.execute(_CALLER_TABLE)
    yield connection
    await connection.close()


async def _created(conn: asyncpg.Connection, **fields: object) -> uuid.UUID:
    """The caller's row and the event that says it exists, at once."""
    artifact = uuid.uuid4()
    await conn.execute("INSERT INTO artifacts (id, path) VALUES ($1, $2)", artifact, "a.tar")
    arguments: dict[str, object] = {
        "tenant": "acme",
        "event_type": "artifact.created",
        "payload": {"artifact": str(artifact)},
        **fields,
    }
    return await txn.publish_event(conn, **arguments)  # type: ignore[arg-type]


async def _counts(stack: Stack) -> dict[str, int]:
    return {t: int(await stack.scalar(f"SELECT count(*) FROM {t}")) for t in ("events", "outbox")}


async def test_a_rolled_back_caller_leaves_no_event_and_publishes_nothing(
    stack: Stack, api: EventApi, conn: asyncpg.Connection, database_url: str, amqp_url: str
) -> None:
    notes: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    listener: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    caller = conn.get_server_pid()

    def heard(_conn: object, pid: int, channel: str, payload: object) -> None:
        if pid == caller:  # only the caller's session counts
            notes.put_nowait((channel, str(payload)))

    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["artifact.*"]) as (queue, _):
        for channel in ("jobplane_outbox", "jobplane_domain_events"):
            await listener.add_listener(channel, heard)
        try:
            tx = conn.transaction()
            await tx.start()
            rolled_back = await _created(conn)
            await tx.rollback()
            # Notifications arrive in commit order: the marker comes first only
            # if the rolled-back publish sent none on either channel.
            await conn.execute("NOTIFY jobplane_domain_events, 'marker'")
            assert await asyncio.wait_for(notes.get(), 10) == ("jobplane_domain_events", "marker")
        finally:
            await listener.close()
        assert await _counts(stack) == {"events": 0, "outbox": 0}
        assert await conn.fetchval("SELECT count(*) FROM artifacts") == 0
        # The next committed event is the only one the queue and a subscriber get.
        async with conn.transaction():
            committed = await _created(conn)
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
    assert [decode(m.body).event_id for m in messages] == [committed]
    subscription = api.subscribe(["#"])
    try:
        (reply,) = await subscription.take(1)
    finally:
        subscription.cancel()
    assert reply.event.event_id == str(committed) != str(rolled_back)


async def test_a_committed_event_reaches_a_bound_queue_once_and_subscribers(
    stack: Stack, api: EventApi, conn: asyncpg.Connection, amqp_url: str
) -> None:
    event_id = uuid.uuid4()
    when = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
    # Keys in jsonb's order (shorter first), whole numbers: the body is then
    # byte for byte what jobplane.events.encode writes.
    payload = {"n": 18230, "ok": True, "path": "builds/42/app tar", "note": 'é "q"\n'}
    payload = dict(sorted(payload.items(), key=lambda kv: (len(kv[0]), kv[0])))
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["artifact.*"]) as (q, _):
        fields: dict[str, object] = {
            "event_id": event_id,
            "payload": payload,
            "timestamp": when,
            "project_id": "web",
            "correlation_id": "chain-7",
            "causation_id": "cause-6",
        }
        async with conn.transaction():
            got = await _created(conn, **fields, traceparent=TRACEPARENT, tracestate="vendor=x")
            # Again in the same transaction: the same event, nothing new.
            assert await _created(conn, **fields) == got
            with pytest.raises(EventIdReused):
                async with conn.transaction():  # a savepoint keeps the transaction
                    await _created(conn, **{**fields, "project_id": "api"})
        assert got == event_id
        await all_published(stack)
        (message,) = await take_all(amqp_url, q)
    expected = Event(
        event_id=event_id,
        event_type="artifact.created",
        timestamp=when,
        tenant_id=stack.tenant_id,
        project_id="web",
        correlation_id="chain-7",
        causation_id="cause-6",
        payload=payload,
    )
    assert decode(message.body) == expected
    assert message.body == encode(expected)
    assert message.routing_key == "artifact.created"
    assert message.message_id == str(event_id)
    assert message.correlation_id == "chain-7"
    assert message.delivery_mode == 2
    assert message.headers == {
        "causation_id": "cause-6",
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=x",
    }
    subscription = api.subscribe(["artifact.*"])
    try:
        (reply,) = await subscription.take(1)
    finally:
        subscription.cancel()
    assert event_from_pb(reply.event) == expected
    assert await _counts(stack) == {"events": 1, "outbox": 0}


async def test_replays_write_nothing_by_either_path(
    stack: Stack, api: EventApi, conn: asyncpg.Connection
) -> None:
    # SQL first, then the same event again in another transaction and by the RPC.
    first = uuid.uuid4()
    payload = {"b": 1, "a": [1, 2.5, "x"], "nested": {"k": None}}
    async with conn.transaction():
        await _created(conn, event_id=first, payload=payload, correlation_id="c")
    before = await _counts(stack)
    async with conn.transaction():
        assert await _created(conn, event_id=first, payload=payload, correlation_id="c") == first
    sent = request("artifact.created", event_id=str(first), correlation_id="c", payload=payload)
    reply = await api.publish(sent)
    assert reply.event_id == str(first)
    assert await _counts(stack) == before
    for change in ({"payload": {"b": 2}}, {"correlation_id": "other"}, {"project_id": "p"}):
        arguments = {"event_id": first, "payload": payload, "correlation_id": "c", **change}
        with pytest.raises(EventIdReused) as refused:
            async with conn.transaction():
                await _created(conn, **arguments)
        assert refused.value.field == "event_id"
    # The RPC first, then SQL: the same event, and a given time that differs is another.
    sent = request("artifact.created", payload={"z": "y", "a": 1})
    sent.timestamp.FromDatetime(datetime(2026, 12, 1, tzinfo=UTC))
    await api.publish(sent)
    stored = await _counts(stack)
    async with conn.transaction():
        same = await txn.publish_event(
            conn,
            tenant="acme",
            event_type="artifact.created",
            payload={"a": 1, "z": "y"},
            event_id=sent.event_id,
        )
    assert str(same) == sent.event_id
    with pytest.raises(EventIdReused):
        async with conn.transaction():
            await txn.publish_event(
                conn,
                tenant="acme",
                event_type="artifact.created",
                payload={"a": 1, "z": "y"},
                event_id=sent.event_id,
                timestamp=datetime(2026, 12, 2, tzinfo=UTC),
            )
    assert await _counts(stack) == stored


async def test_through_a_sqlalchemy_session_and_connection(
    stack: Stack, engine: AsyncEngine
) -> None:
    async with engine.begin() as setup:
        await setup.execute(text(_CALLER_TABLE))
    insert = text("INSERT INTO artifacts (id, path) VALUES (gen_random_uuid(), 'x')")
    async with AsyncSession(engine) as session, session.begin():
        await session.execute(insert)
        in_session = await txn.publish_event(
            session, tenant="acme", event_type="artifact.created", payload={"via": "session"}
        )
    async with engine.connect() as connection:
        await connection.execute(insert)
        rolled_back = await txn.publish_event(
            connection, tenant="acme", event_type="artifact.created"
        )
        await connection.rollback()
        await connection.execute(insert)
        committed = await txn.publish_event(
            connection, tenant="acme", event_type="artifact.deleted", payload={"via": "conn"}
        )
        await connection.commit()
    async with engine.connect() as reader:
        stored = await reader.execute(text("SELECT event_id, payload FROM events"))
    rows = {r.event_id: r.payload for r in stored}
    assert rows == {in_session: {"via": "session"}, committed: {"via": "conn"}}
    assert rolled_back not in rows
    await all_published(stack)
    async with AsyncSession(engine) as session:
        with pytest.raises(InvalidArgument) as refused:
            await txn.publish_event(session, tenant="acme", event_type="Not A Type")
        assert refused.value.field == "event_type"


async def test_from_plain_sql_text(stack: Stack, database_url: str) -> None:
    """What a service in any language sends: named arguments, the id as text."""
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await admin.execute(
            """
            BEGIN;
            SELECT jobplane.publish_event(
                tenant     => 'acme',
                event_id   => '7b1c1b0e-0000-4000-8000-000000000001',
                event_type => 'deployment.completed',
                payload    => '{"service": "web", "version": 42}'
            );
            COMMIT;
            """
        )
    finally:
        await admin.close()
    await all_published(stack)
    event = await stack.scalar(
        "SELECT jsonb_build_object('event_id', event_id, 'correlation_id', correlation_id, "
        "'payload', payload, 'tenant_id', tenant_id) FROM events"
    )
    assert event == {
        "event_id": "7b1c1b0e-0000-4000-8000-000000000001",
        "correlation_id": "7b1c1b0e-0000-4000-8000-000000000001",
        "payload": {"service": "web", "version": 42},
        "tenant_id": str(stack.tenant_id),
    }


async def test_refusals_carry_the_rpc_reasons(stack: Stack, conn: asyncpg.Connection) -> None:
    cases: list[tuple[dict[str, object], type[JobplaneError], str]] = [
        ({"tenant": "nobody"}, TenantNotFound, "tenant"),
        ({"tenant": "a\x00"}, TenantNotFound, "tenant"),
        ({"event_id": "7B1C1B0E-0000-4000-8000-000000000001"}, InvalidArgument, "event_id"),
        ({"event_id": "00000000-0000-0000-0000-000000000000"}, InvalidArgument, "event_id"),
        ({"event_id": ""}, InvalidArgument, "event_id"),
        ({"event_type": ""}, InvalidArgument, "event_type"),
        ({"event_type": "a" * 129}, InvalidArgument, "event_type"),
        ({"event_type": "Artifact.created"}, InvalidArgument, "event_type"),
        ({"payload": {"blob": "x" * 300_000}}, PayloadTooLarge, "payload"),
        ({"payload": {"n": float("inf")}}, InvalidArgument, "payload"),
        ({"payload": {"s": "a\x00b"}}, InvalidArgument, "payload"),
        ({"payload": {"s": "\ud800"}}, InvalidArgument, "payload"),
        ({"payload": _deep(33)}, InvalidArgument, "payload"),
        ({"timestamp": datetime(1969, 12, 31, tzinfo=UTC)}, InvalidArgument, "timestamp"),
        ({"timestamp": datetime(2026, 1, 1)}, InvalidArgument, "timestamp"),
        ({"project_id": ""}, InvalidArgument, "project_id"),
        ({"correlation_id": "é" * 128}, InvalidArgument, "correlation_id"),
        ({"causation_id": "a\tb"}, InvalidArgument, "causation_id"),
    ]
    for overrides, error, field in cases:
        with pytest.raises(error) as refused:
            async with conn.transaction():
                await _created(conn, **overrides)
        assert type(refused.value) is error, overrides
        assert refused.value.field == field, overrides
    # One below each limit passes, and the connection is usable after each rollback.
    async with conn.transaction():
        await _created(conn, event_type="a" * 128, payload=_deep(32), correlation_id="é" * 127)
    assert await _counts(stack) == {"events": 1, "outbox": 0}
    # Invalid trace context is ignored, not refused (W3C), as PublishEvent ignores it.
    async with conn.transaction():
        ignored = await _created(conn, traceparent="not-a-traceparent", tracestate="k=v")
    trace = await stack.scalar(
        "SELECT jsonb_build_object('traceparent', traceparent, 'tracestate', tracestate) "
        "FROM events WHERE event_id = :id",
        id=ignored,
    )
    assert trace == {"traceparent": None, "tracestate": "k=v"}


def _deep(levels: int) -> dict[str, object]:
    """A payload ``levels`` objects deep (the payload itself is the first)."""
    payload: dict[str, object] = {}
    for _ in range(levels - 1):
        payload = {"d": payload}
    return payload


async def test_a_role_that_may_only_execute_the_function(stack: Stack, database_url: str) -> None:
    """The caller's role needs no right on jobplane's tables, only EXECUTE."""
    role = f"jp_caller_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        dsn = asyncpg_dsn(database_url).replace("postgres@", f"{role}@", 1)
        caller: asyncpg.Connection = await asyncpg.connect(dsn)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await txn.publish_event(caller, tenant="acme", event_type="artifact.created")
            await admin.execute(f'GRANT USAGE ON SCHEMA jobplane TO "{role}"')
            await admin.execute(
                "GRANT EXECUTE ON FUNCTION jobplane.publish_event(text, text, text, jsonb, "
                f'timestamptz, text, text, text, text, text) TO "{role}"'
            )
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await caller.fetchval("SELECT count(*) FROM events")
            event_id = await txn.publish_event(caller, tenant="acme", event_type="artifact.created")
        finally:
            await caller.close()
        await all_published(stack)
        assert await stack.scalar("SELECT event_id FROM events") == event_id
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def test_the_last_microsecond_of_year_9999_is_stored_as_itself_by_either_path(
    stack: Stack, api: EventApi, conn: asyncpg.Connection
) -> None:
    """asyncpg sends datetime.max as 'infinity': neither path may store that."""
    last = datetime.max.replace(tzinfo=UTC)
    sent = request("artifact.created")
    sent.timestamp.FromDatetime(last)
    await api.publish(sent)
    async with conn.transaction():
        by_sql = await _created(conn, timestamp=last)
    assert await conn.fetchval("SELECT count(*) FROM events WHERE isfinite(event_time)") == 2
    subscription = api.subscribe(["#"])
    try:
        replies = await subscription.take(2)
    finally:
        subscription.cancel()
    assert [event_from_pb(r.event).timestamp for r in replies] == [last, last]
    assert {r.event.event_id for r in replies} == {sent.event_id, str(by_sql)}
