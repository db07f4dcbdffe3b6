"""SubscribeEvents: a tenant's events in commit order, resumable with no gap and no repeat.

A stream never ends by itself, so "nothing more came" is shown by a
sentinel: an event published last whose arrival as the very next message
proves nothing else came before it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.events import Event
from jobplane.server import JobplaneServer
from jobplane.server.limits import TenantLimits
from jobplane.store.events import EARLIEST, EventStore, NewEvent, Position, append
from jobplane.topology import Topology
from jobplane.v1 import events_pb2, events_pb2_grpc
from tests.support.answers import check_refusal
from tests.support.event_api import EventApi, Subscription, event_api, request
from tests.support.parts import Started
from tests.support.stack import Stack, eventually

# A server alone: subscriptions read Postgres, not the broker.
pytestmark = pytest.mark.stack(relay=False, worker=False)

EARLIEST_START = events_pb2.SubscribeEventsRequest.START_EARLIEST
LATEST_START = events_pb2.SubscribeEventsRequest.START_LATEST


@pytest.fixture
async def api(stack: Stack) -> AsyncIterator[EventApi]:
    async with event_api(stack) as client:
        yield client


def ids(replies: list[events_pb2.SubscribeEventsResponse]) -> list[str]:
    return [reply.event.event_id for reply in replies]


async def publish_all(api: EventApi, types: list[str], **fields: Any) -> list[str]:
    return [(await api.publish(request(t, **fields))).event_id for t in types]


async def then_next_is(api: EventApi, stream: Subscription, event_type: str = "zz.sentinel") -> str:
    """Nothing but a sentinel published now comes next on ``stream``; its event_id."""
    sentinel = await api.publish(request(event_type))
    (reply,) = await stream.take(1)
    assert reply.event.event_id == sentinel.event_id, "an event came that should not have"
    return sentinel.event_id


async def test_resume_at_every_cursor_gives_the_rest_without_gap_or_repeat(
    api: EventApi,
) -> None:
    types = ["artifact.created", "job.started", "artifact.deleted", "job.started.late", "x"]
    published = await publish_all(api, types * 2)
    stream = api.subscribe(["#"])
    replies = await stream.take(len(published))
    assert ids(replies) == published  # commit order: the order they were published
    cursors = [reply.cursor for reply in replies]
    assert len(set(cursors)) == len(cursors)
    published.append(await then_next_is(api, stream))
    stream.cancel()

    # A drop after any event: resuming with its cursor gives exactly the rest
    # (the sentinels of earlier rounds included), then nothing but what is new.
    for k, cursor in enumerate(cursors):
        resumed = api.subscribe(["#"], after_cursor=cursor)
        assert ids(await resumed.take(len(published) - k - 1)) == published[k + 1 :]
        published.append(await then_next_is(api, resumed, f"zz.sentinel{k}"))
        resumed.cancel()


async def test_patterns_choose_the_types_and_resuming_keeps_them(api: EventApi) -> None:
    types = ["artifact.created", "job.started", "artifact.deleted", "job.started.late", "job"]
    published = dict(zip(await publish_all(api, types), types, strict=True))
    stream = api.subscribe(["job.*", "artifact.created"])
    replies = await stream.take(2)
    assert [r.event.event_type for r in replies] == ["artifact.created", "job.started"]
    await then_next_is(api, stream, "job.sentinel")
    stream.cancel()
    # Resuming after the first: the rest of the matching ones only.
    resumed = api.subscribe(["job.*", "artifact.created"], after_cursor=replies[0].cursor)
    (again,) = await resumed.take(1)
    assert again.event.event_type == "job.started"
    assert published[again.event.event_id] == "job.started"
    assert (await resumed.take(1))[0].event.event_type == "job.sentinel"
    await then_next_is(api, resumed, "job.sentinel")
    resumed.cancel()

    hash_all = api.subscribe(["job.#"])
    assert [r.event.event_type for r in await hash_all.take(4)] == [
        "job.started",
        "job.started.late",
        "job",
        "job.sentinel",
    ]
    hash_all.cancel()


async def test_live_events_follow_the_stored_ones(api: EventApi) -> None:
    stored = await publish_all(api, ["a.one", "a.two"])
    stream = api.subscribe(["a.*"])
    assert ids(await stream.take(2)) == stored
    live = await publish_all(api, ["a.three", "b.other", "a.four"])
    assert ids(await stream.take(2)) == [live[0], live[2]]
    await then_next_is(api, stream, "a.sentinel")
    stream.cancel()


async def test_start_latest_begins_with_what_commits_after_the_call(
    api: EventApi, stack: Stack
) -> None:
    await publish_all(api, ["a.old", "a.older"])
    stream = api.subscribe(["#"], start=LATEST_START)
    # The stream is open once the server holds its stream slot: from then on
    # its start is fixed, and what is published now comes after it.
    await eventually(lambda: _streams(stack, 1))
    new = await publish_all(api, ["a.new"])
    assert ids(await stream.take(1)) == new
    stream.cancel()
    earliest = api.subscribe(["#"], start=EARLIEST_START)
    assert [r.event.event_type for r in await earliest.take(3)] == ["a.old", "a.older", "a.new"]
    earliest.cancel()


async def _streams(stack: Stack, count: int) -> bool:
    return stack.server.limiter.streams(stack.tenant_id) == count


async def test_another_tenants_events_never_appear(api: EventApi, stack: Stack) -> None:
    other = await stack.new_key("globex")
    theirs = api.subscribe(["#"], key=other)
    mine = await publish_all(api, ["artifact.created", "job.started"])
    sentinel = await api.stub.PublishEvent(
        request("their.sentinel"), metadata=api.metadata(other), timeout=30
    )
    (first,) = await theirs.take(1)
    assert first.event.event_id == sentinel.event_id
    assert first.event.tenant_id != str(stack.tenant_id)
    # My cursor, theirs to use: positions only, never my events.
    stream = api.subscribe(["#"])
    replies = await stream.take(2)
    assert ids(replies) == mine
    stream.cancel()
    with_my_cursor = api.subscribe(["#"], after_cursor=replies[0].cursor, key=other)
    (only,) = await with_my_cursor.take(1)
    assert only.event.event_id == sentinel.event_id
    with_my_cursor.cancel()
    theirs.cancel()


async def test_transactions_that_commit_out_of_order_leave_no_gap(
    api: EventApi, stack: Stack
) -> None:
    """Two writers hold their transactions open; the later one commits first.

    A reader that took the later one's event first, and moved its cursor
    past it, would never see the earlier one's: it must hold both back
    until both have committed, and then send them in commit-safe order.
    """
    engine = stack.engine
    store = EventStore(engine)
    tenant = stack.tenant_id
    stream = api.subscribe(["#"])
    first_event = Event.new("order.first", {}, tenant_id=tenant)
    second_event = Event.new("order.second", {}, tenant_id=tenant)
    async with engine.connect() as first, engine.connect() as second:
        await first.begin()
        await second.begin()
        (a,) = await append(first, tenant, [NewEvent(first_event)])
        (b,) = await append(second, tenant, [NewEvent(second_event)])
        assert a.position < b.position
        await second.commit()
        # Committed, but behind a transaction still open: held back.
        read = await store.read_after(tenant, None, EARLIEST, limit=100)
        assert read.events == [] and read.held
        # A later publish is held back behind it too.
        late = await api.publish(request("order.third"))
        read = await store.read_after(tenant, None, EARLIEST, limit=100)
        assert read.events == [] and read.held
        await first.commit()
    replies = await stream.take(3)
    assert ids(replies) == [str(first_event.event_id), str(second_event.event_id), late.event_id]
    sentinel = await then_next_is(api, stream)
    stream.cancel()
    # Resumed between them: the rest, once.
    resumed = api.subscribe(["#"], after_cursor=replies[0].cursor)
    rest = [str(second_event.event_id), late.event_id, sentinel]
    assert ids(await resumed.take(3)) == rest
    await then_next_is(api, resumed)
    resumed.cancel()


async def test_a_rolled_back_event_is_never_seen(api: EventApi, stack: Stack) -> None:
    tenant = stack.tenant_id
    async with stack.engine.connect() as conn:
        await conn.begin()
        await append(conn, tenant, [NewEvent(Event.new("never.seen", {}, tenant_id=tenant))])
        await conn.rollback()
    stream = api.subscribe(["#"])
    await then_next_is(api, stream)
    stream.cancel()
    # The sentinel alone was written.
    assert await stack.scalar("SELECT count(*) FROM events") == 1


def _cursor(txid: int, seq: int) -> str:
    return Position(txid, seq).cursor()


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no pattern", {"type_patterns": []}, "type_patterns"),
    ("empty pattern", {"type_patterns": ["a", ""]}, "type_patterns"),
    ("upper case", {"type_patterns": ["Job.*"]}, "type_patterns"),
    ("partial wildcard", {"type_patterns": ["job.st*"]}, "type_patterns"),
    ("empty word", {"type_patterns": ["job..started"]}, "type_patterns"),
    ("too long", {"type_patterns": ["a" * 256]}, "type_patterns"),
    ("too many", {"type_patterns": [f"p{n}" for n in range(65)]}, "type_patterns"),
    ("cursor not base64", {"after_cursor": "not a cursor!"}, "after_cursor"),
    ("cursor too short", {"after_cursor": _cursor(1, 1)[:-1]}, "after_cursor"),
    ("cursor too long", {"after_cursor": _cursor(1, 1) + "A"}, "after_cursor"),
    ("cursor of another version", {"after_cursor": "AgAAAAAAAAABAAAAAAAAAAE"}, "after_cursor"),
    ("cursor out of range", {"after_cursor": "Af__________AAAAAAAAAAE"}, "after_cursor"),
    ("cursor with odd bits", {"after_cursor": _cursor(1, 1)[:-1] + "F"}, "after_cursor"),
    ("unknown start", {"start": 7}, "start"),
]


@pytest.mark.parametrize(("case", "fields", "field"), BAD, ids=[case for case, _, _ in BAD])
async def test_bad_requests_are_refused(
    api: EventApi, case: str, fields: dict[str, Any], field: str
) -> None:
    message = events_pb2.SubscribeEventsRequest(type_patterns=["#"])
    for name, value in fields.items():
        if name == "type_patterns":
            del message.type_patterns[:]
            message.type_patterns.extend(value)
        else:
            setattr(message, name, value)
    call = api.stub.SubscribeEvents(message, metadata=api.metadata())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    refusal = check_refusal(info.value)
    assert refusal.code is grpc.StatusCode.INVALID_ARGUMENT, case
    assert refusal.field == field, (case, refusal.message)


async def test_a_stream_ends_unavailable_when_the_server_stops(stack: Stack) -> None:
    async with event_api(stack) as client:
        stream = client.subscribe(["#"])
        await eventually(lambda: _streams(stack, 1))
        await stack.server.stop(grace=5.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream.take(1)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_subscriptions_count_against_the_tenants_streams(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    server = JobplaneServer(
        engine, database_url, topology, listen="127.0.0.1:0", limits=TenantLimits(max_streams=1)
    )
    await started(server, grace=0.5)
    key, tenant = await server.keys.create_key("acme")
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub: events_pb2_grpc.EventServiceAsyncStub = events_pb2_grpc.EventServiceStub(channel)
        metadata = (("authorization", f"Bearer {key}"),)
        held = stub.SubscribeEvents(
            events_pb2.SubscribeEventsRequest(type_patterns=["#"]), metadata=metadata
        )
        await eventually(lambda: _held(server, tenant))
        refused = stub.SubscribeEvents(
            events_pb2.SubscribeEventsRequest(type_patterns=["#"]), metadata=metadata
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await refused.read()
        refusal = check_refusal(info.value)
        assert refusal.reason == "TENANT_LIMIT_EXCEEDED"
        held.cancel()


async def _held(server: JobplaneServer, tenant: Any) -> bool:
    return server.limiter.streams(tenant) == 1


async def test_a_published_event_wakes_a_waiting_stream_long_before_its_recheck(
    stack: Stack, api: EventApi
) -> None:
    # Without a wake-up, a waiting stream would read again only after a minute.
    stack.server.events._recheck_seconds = 60.0
    stream = api.subscribe(["#"])
    try:
        first = await publish_all(api, ["a.first"])
        assert ids(await stream.take(1)) == first  # the stream has read, and waits
        second = await publish_all(api, ["a.second"])
        assert ids(await stream.take(1)) == second
    finally:
        stream.cancel()
