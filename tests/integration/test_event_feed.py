"""The relays publish the events table by a cursor: the subscribers' order, once, no gap.

On a real server, relays, Postgres and RabbitMQ: events whose transactions
commit out of their insert order reach a bound queue in the order
SubscribeEvents gives them; an event of a transaction still open holds back
those after it, never skips them; two relays publish each event once
between them, and the survivor of one taking over goes on where the
position stands; the sweeper says when the
feed is behind; a database migrated from 0009 publishes its old event rows
through the outbox and only the new ones by the feed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest
from sqlalchemy import text

from jobplane.events import Event, decode
from jobplane.store.engine import create_engine, migrate
from jobplane.store.event_feed import EventFeed
from jobplane.store.events import EARLIEST, EventStore, NewEvent, append
from jobplane.store.keys import KeyStore
from jobplane.topology import Topology
from jobplane.workers.relay import PublishFailed, Relay
from jobplane.workers.sweeper import Sweeper
from tests.support import services
from tests.support.event_api import all_published, bound_queue
from tests.support.events import take_all
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

# Server and relay; no worker (events need none).
pytestmark = pytest.mark.stack(worker=False)


def _event(stack: Stack, event_type: str, n: int) -> NewEvent:
    return NewEvent(Event.new(event_type, {"n": n}, tenant_id=stack.tenant_id))


async def _position(stack: Stack) -> tuple[int, int]:
    row = await stack.scalar("SELECT jsonb_build_array(txid::text::bigint, seq) FROM event_relay")
    return int(row[0]), int(row[1])


async def test_events_reach_the_exchange_in_the_feeds_order_and_wait_for_open_transactions(
    stack: Stack, amqp_url: str
) -> None:
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["feed.#"]) as (name, _):
        async with stack.engine.connect() as late, stack.engine.connect() as early:
            # "late" writes first (its transaction id and seq are the lower)
            # and commits last; "early" commits in between.
            await late.begin()
            await append(late, stack.tenant_id, [_event(stack, "feed.late", 1)])
            await early.begin()
            await append(early, stack.tenant_id, [_event(stack, "feed.early", 2)])
            await early.commit()
            async with stack.engine.begin() as third:
                await append(third, stack.tenant_id, [_event(stack, "feed.third", 3)])
            # Committed, but behind a transaction still open: not published,
            # and the position does not pass the open one.
            before = await _position(stack)
            await asyncio.sleep(1.0)
            assert await take_all(amqp_url, name) == []
            assert await _position(stack) == before
            await late.commit()
        await all_published(stack)
        messages = await take_all(amqp_url, name)
    # The feed's order, which subscriptions share: by writing transaction
    # (its id, drawn at its first write), then insert order. "late" began
    # first, so it comes first although it committed last: nothing was
    # passed while it was open, so nothing is out of place.
    types = [decode(m.body).event_type for m in messages]
    assert types == ["feed.late", "feed.early", "feed.third"]
    assert len({m.message_id for m in messages}) == 3
    subscribed = await stack.scalar(
        "SELECT jsonb_agg(event_type ORDER BY txid, seq) FROM events WHERE event_type LIKE 'feed.%'"
    )
    assert subscribed == types
    assert await _position(stack) > before


async def test_two_relays_publish_each_event_once_and_one_takes_over(
    stack: Stack, amqp_url: str
) -> None:
    assert stack.relay is not None
    first = stack.relay
    second = await stack.start_relay()
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["feed.#"]) as (name, _):
        for n in range(50):
            async with stack.engine.begin() as conn:
                await append(conn, stack.tenant_id, [_event(stack, "feed.one", n)])
        await all_published(stack)
        # One relay holds the feed at a time: no copy of any event.
        assert first.events_published + second.events_published == 50
        await first.stop()
        for n in range(50, 80):
            async with stack.engine.begin() as conn:
                await append(conn, stack.tenant_id, [_event(stack, "feed.two", n)])
        await all_published(stack)
        messages = await take_all(amqp_url, name)
    await second.stop()
    payloads = [decode(m.body).payload["n"] for m in messages]
    # In commit order (one writer, one transaction after the other), none lost,
    # none twice.
    assert payloads == list(range(80))


async def _feed_caught_up(stack: Stack) -> bool:
    behind = await stack.scalar(
        "SELECT count(*) FROM events e, event_relay r WHERE (e.txid, e.seq) > (r.txid, r.seq)"
    )
    return int(behind) == 0


async def test_an_event_the_broker_keeps_refusing_moves_to_the_outbox_and_the_rest_go_on(
    stack: Stack, amqp_url: str
) -> None:
    assert stack.relay is not None
    relay = stack.relay
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(stack.topology.events_exchange)
        # A queue that refuses every message routed to it: full at length 0,
        # and a full queue with reject-publish makes the broker nack.
        full = await channel.declare_queue(
            f"test.full.{uuid.uuid4().hex[:8]}",
            durable=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await full.bind(exchange, routing_key="refused.#")
        async with bound_queue(amqp_url, exchange.name, ["fine.#"]) as (name, _):
            async with stack.engine.begin() as conn:
                await append(conn, stack.tenant_id, [_event(stack, "refused.one", 0)])
            for n in range(1, 6):
                async with stack.engine.begin() as conn:
                    await append(conn, stack.tenant_id, [_event(stack, "fine.one", n)])

            # The feed goes past it after a few refusals, and on to the others.
            await eventually(lambda: _feed_caught_up(stack), timeout=60)
            assert relay.events_parked == 1
            fine = [decode(m.body).payload["n"] for m in await take_all(amqp_url, name)]
            # Each at least once, in order; the first batch (with the refused
            # one at its head) went out once before the feed published them
            # alone, and the passes between published the refused one alone.
            assert list(dict.fromkeys(fine)) == [1, 2, 3, 4, 5]
            assert len(fine) <= 10
            # It waits in the outbox, retried on its own.
            parked = await stack.scalar(
                "SELECT jsonb_build_object('published', published_at IS NOT NULL, "
                "'failed', failed_at IS NOT NULL, 'type', routing_key, 'body', "
                "convert_from(body, 'UTF8')::jsonb) FROM outbox WHERE kind = 'event'"
            )
            assert parked["type"] == "refused.one"
            assert (parked["published"], parked["failed"]) == (False, False)
            assert parked["body"]["payload"] == {"n": 0}

            # Once the broker takes it, it is published from there, once.
            catcher = await channel.declare_queue(
                f"test.catch.{uuid.uuid4().hex[:8]}", durable=True
            )
            await catcher.bind(exchange, routing_key="refused.#")
            await full.delete(if_unused=False, if_empty=False)

            async def published() -> bool:
                return bool(
                    await stack.scalar(
                        "SELECT published_at IS NOT NULL FROM outbox WHERE kind = 'event'"
                    )
                )

            await eventually(published, timeout=60)
            caught = await take_all(amqp_url, catcher.name)
            await catcher.delete(if_unused=False, if_empty=False)
    assert [decode(m.body).event_type for m in caught] == ["refused.one"]


async def test_the_sweeper_reports_events_no_relay_published(stack: Stack) -> None:
    assert stack.relay is not None
    await stack.relay.stop()
    async with stack.engine.begin() as conn:
        await append(conn, stack.tenant_id, [_event(stack, "feed.waiting", 1)])
        await conn.execute(text("UPDATE events SET create_time = now() - interval '2 minutes'"))
    report = await Sweeper(stack.engine, stuck_after=60).sweep_once()
    assert report.events_behind == 1
    await stack.start_relay()
    await all_published(stack)
    report = await Sweeper(stack.engine, stuck_after=60).sweep_once()
    assert report.events_behind == 0


@pytest.fixture
async def database_at_0009(run_id: str) -> AsyncIterator[str]:
    """A database migrated to 0009: events published through outbox rows."""
    async with services.database_at(run_id, "0009") as url:
        yield url


async def test_events_written_before_0010_are_published_once_through_their_outbox_rows(
    database_at_0009: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    engine = create_engine(database_at_0009, pool_size=10)
    started.callback(engine.dispose)
    keys = KeyStore(engine)
    _key, tenant = await keys.create_key("acme")
    await keys.close()
    # Published the 0009 way: an events row and its outbox row.
    async with engine.begin() as conn:
        old_id = await conn.scalar(
            text(
                "SELECT jobplane.publish_event(tenant => 'acme', event_id => :id, "
                "event_type => 'feed.old', payload => '{}')"
            ),
            {"id": str(uuid.uuid4())},
        )

    # 0010 starts the feed at the oldest transaction still running in the
    # whole cluster (transaction ids are the cluster's), so one of another
    # database's, older than the old event, would have the feed publish it
    # too (the overlap the migration allows: at least once). Wait until
    # none is left, as on a machine where this database is the only one.
    async def xmin_past_the_old_event() -> bool:
        async with engine.connect() as conn:
            return bool(
                await conn.scalar(
                    text(
                        "SELECT pg_snapshot_xmin(pg_current_snapshot()) > "
                        "(SELECT max(txid) FROM events)"
                    )
                )
            )

    await eventually(xmin_past_the_old_event, timeout=60)
    await migrate(database_at_0009, create=False)
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT count(*) FROM outbox WHERE kind = 'event'")) == 1
    stack = await started(start_stack(engine, database_at_0009, amqp_url, topology, worker=False))
    assert stack.relay is not None
    # The old row goes out before the queue is bound: the queue sees the new one only.
    await eventually(
        lambda: stack.scalar("SELECT published_at IS NOT NULL FROM outbox WHERE kind = 'event'")
    )
    async with bound_queue(amqp_url, topology.events_exchange, ["feed.#"]) as (name, _):
        async with engine.begin() as conn:
            new = await append(conn, tenant, [_event(stack, "feed.new", 1)])
        await all_published(stack)
        messages = await take_all(amqp_url, name)
    # The old one through its outbox row, the new one by the feed:
    # each once.
    assert (stack.relay.published, stack.relay.events_published) == (1, 1)
    published = await stack.scalar(
        "SELECT published_at IS NOT NULL FROM outbox WHERE kind = 'event'"
    )
    assert published
    assert [m.message_id for m in messages] == [str(new[0].event.event_id)]
    assert old_id is not None


async def test_a_refusal_mid_batch_moves_the_position_past_the_confirmed_prefix_only(
    stack: Stack, amqp_url: str
) -> None:
    """A batch whose third event the broker refuses (nacks) and whose others it
    confirms: the position moves past the first two only, the refused one is
    published again (alone) on the next passes, and the one behind it after."""
    # The stack's relay declared the topology; this test drives the feed's passes itself.
    assert stack.relay is not None
    await stack.relay.stop()
    relay = Relay(stack.engine, stack.database_url, amqp_url, stack.topology, db=stack.db)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(stack.topology.events_exchange)
        full = await channel.declare_queue(
            f"test.full.{uuid.uuid4().hex[:8]}",
            durable=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await full.bind(exchange, routing_key="refused.#")
        async with bound_queue(amqp_url, exchange.name, ["fine.#"]) as (name, queue):
            kinds = ["fine.one", "fine.two", "refused.three", "fine.four"]
            async with stack.engine.begin() as conn:
                written = await append(
                    conn, stack.tenant_id, [_event(stack, k, n) for n, k in enumerate(kinds)]
                )
            ids = [str(e.event.event_id) for e in written]
            positions = [(e.position.txid, e.position.seq) for e in written]
            assert positions == sorted(positions)
            start = await _position(stack)
            # Settled: a transaction still open anywhere on the server (other
            # databases' too) holds them back from the feed for a while.
            await eventually(
                lambda: stack.scalar(
                    "SELECT bool_and(txid < pg_snapshot_xmin(pg_current_snapshot())) FROM events"
                ),
                timeout=30,
            )

            with pytest.raises(PublishFailed):
                await relay.publish_events_once(channel)
            assert await _position(stack) == positions[1]
            # The whole batch went out; the two in front of the refusal and
            # the one behind it were confirmed.
            first = [m.message_id for m in await take_all(amqp_url, name)]
            assert first == [ids[0], ids[1], ids[3]]

            # Refused again: tried alone, and the position stays.
            with pytest.raises(PublishFailed):
                await relay.publish_events_once(channel)
            assert await _position(stack) == positions[1]
            assert await take_all(amqp_url, name) == []

            # Once the broker takes it, it goes out, then the one behind it.
            await full.delete(if_unused=False, if_empty=False)
            await queue.bind(exchange.name, routing_key="refused.#")
            again = await relay.publish_events_once(channel)
            assert again.published == 1
            assert await _position(stack) == positions[2]
            rest = await relay.publish_events_once(channel)
            assert rest.published == 1
            assert await _position(stack) == positions[3]
            later = [m.message_id for m in await take_all(amqp_url, name)]
    assert later == ids[2:]
    assert start < positions[0]
    assert relay.events_published == 4 and relay.events_parked == 0


@pytest.mark.stack(relay=False, worker=False)
async def test_the_feed_and_subscriptions_read_in_transaction_order_not_its_text(
    stack: Stack,
) -> None:
    # Two settled rows at transactions 9 and 10: as text, "10" sorts first.
    async with stack.engine.begin() as conn:
        for txid, event_type in ((10, "order.ten"), (9, "order.nine")):
            await conn.execute(
                text(
                    "INSERT INTO events (tenant_id, event_id, event_type, event_time, "
                    "correlation_id, payload, request_hash, txid) VALUES (:tenant, "
                    "gen_random_uuid(), :type, now(), 'c', '{}', '', "
                    "CAST(CAST(:txid AS text) AS xid8))"
                ),
                {"tenant": stack.tenant_id, "type": event_type, "txid": str(txid)},
            )
        await conn.execute(text("UPDATE event_relay SET txid = CAST('0' AS xid8), seq = 0"))
    async with EventFeed(stack.db).claim(1) as batch:
        assert batch is not None
        assert [e.stored.event.event_type for e in batch.events] == ["order.nine"]
    read = await EventStore(stack.engine).read_after(stack.tenant_id, None, EARLIEST, limit=1)
    assert [e.event.event_type for e in read.events] == ["order.nine"]
    assert read.position.txid == 9
