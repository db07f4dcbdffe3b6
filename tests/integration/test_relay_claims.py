"""Relays share the outbox: a row one relay holds never holds up the others.

Any number of relays may run at once. Each claims due rows another relay does
not hold (the claim skips locked rows), so a relay stuck mid-batch, or a slow
broker confirm, delays only its own rows, and no row is published by two
relays in one pass.

A test that counts a backlog larger than a queue's credit in the broker's
queue, which no worker consumes, runs its relays with fair dispatch off. The
fair claim's own sharing is tests/integration/test_fair_dispatch.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import replace

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobSpec
from jobplane.store.db import Database
from jobplane.store.fair import FairClaim, FairRound, FairSlot
from jobplane.store.outbox import OutboxKind, OutboxRow, OutboxStore
from jobplane.topology import Topology
from jobplane.workers.relay import FairSettings
from tests.support.event_api import all_published
from tests.support.parts import Started
from tests.support.plans import OTHERS, part, relay_claims, rows_read
from tests.support.queues import ready_count
from tests.support.stack import Stack, eventually, start_stack

_NO_CREDIT = FairSettings(enabled=False)


async def test_a_relay_publishes_the_rows_another_relay_holds_not(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    queue = topology.queues[0].name
    unpublished = "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
    client = stack.client()
    jobs = [await client.submit("demo.echo", {"i": i}) for i in range(4)]
    first = uuid.UUID(jobs[0].id)

    # Another relay's claim: the earliest due row, locked by an open transaction.
    async with engine.connect() as other, other.begin():
        held = await other.execute(
            text(
                "SELECT id FROM outbox WHERE kind = 'job.dispatch' "
                "AND job_id = :job AND published_at IS NULL FOR UPDATE"
            ),
            {"job": first},
        )
        assert held.scalar_one() is not None
        await stack.start_relay()
        await eventually(lambda: _scalar_is(stack, unpublished, 1))
        assert await stack.scalar(
            "SELECT published_at IS NULL FROM outbox WHERE kind = 'job.dispatch' AND job_id = :job",
            job=first,
        )
        assert await ready_count(amqp_url, queue) == 3

    # Released: the held row goes out too, and every row exactly once.
    await eventually(lambda: _scalar_is(stack, unpublished, 0))
    await eventually(lambda: _ready_is(amqp_url, queue, 4))
    assert (
        await stack.scalar("SELECT max(publish_attempts) FROM outbox WHERE kind = 'job.dispatch'")
        == 1
    )


async def test_relays_claiming_at_once_publish_each_row_once(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # job.queued published: every job has an event for the feed to publish.
    published = replace(topology, publish_lifecycle=("job.queued",))
    stack = await started(
        start_stack(engine, database_url, amqp_url, published, relay=False, worker=False)
    )
    queue = topology.queues[0].name
    client = stack.client()
    for i in range(60):
        await client.submit("demo.echo", {"i": i})
    relays = [await stack.start_relay(fair=_NO_CREDIT) for _ in range(3)]
    try:
        await eventually(
            lambda: _scalar_is(
                stack,
                "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL",
                0,
            ),
            timeout=30,
        )
        await eventually(lambda: _ready_is(amqp_url, queue, 60))
        assert (
            await stack.scalar(
                "SELECT max(publish_attempts) FROM outbox WHERE kind = 'job.dispatch'"
            )
            == 1
        )
        # Every dispatch once, and every job.queued once: one relay at a
        # time holds the event feed.
        await all_published(stack)
        assert await stack.scalar("SELECT max(publish_attempts) FROM outbox") == 1
        assert sum(r.published for r in relays) == 60
        assert sum(r.events_published for r in relays) == 60
    finally:
        for relay in relays[:-1]:
            await relay.stop()  # the last one is stopped with the stack


async def _scalar_is(stack: Stack, sql: str, expected: int) -> bool:
    return bool(await stack.scalar(sql) == expected)


async def _ready_is(amqp_url: str, queue: str, expected: int) -> bool:
    return await ready_count(amqp_url, queue) == expected


async def test_a_backlog_of_dispatches_costs_the_other_rows_claim_nothing(
    engine: AsyncEngine,
    db: Database,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    """The relay's claim of rows that are not dispatches (parked events), its part
    ``others``, reads none of the due dispatches, fair dispatch on or off: a
    backlog would otherwise be read whole on every pass."""
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    jobs = await stack.client().submit_many([JobSpec("demo.echo", {}) for _ in range(500)])
    assert len(jobs) == 500
    for name, (statement, binds) in relay_claims(topology).items():
        async with db.begin() as conn:
            await conn.execute("ANALYZE outbox")
            plan = await conn.fetch("EXPLAIN (ANALYZE, FORMAT JSON) " + statement.text, binds)
        root = plan[0][0][0]["Plan"]
        assert rows_read(part(root, OTHERS)) == 0, (name, plan[0][0])


_EVENT_ROW = text(
    "INSERT INTO outbox (id, tenant_id, kind, routing_key, correlation_id, body, headers, "
    "available_at) VALUES (gen_random_uuid(), :tenant, 'event', 'x.happened', '', "
    "CAST('{}' AS bytea), CAST('{}' AS jsonb), now() - make_interval(secs => :ago))"
)


async def test_one_claim_takes_each_kind_up_to_the_limit_dispatches_first(
    engine: AsyncEngine,
    db: Database,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    """The relay's claim is one statement (ADR-0053) and takes what its two did:
    up to the limit of dispatches (fair or not), then up to the limit of other
    rows, none of those held back; only the dispatches have places in a round."""
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    await stack.client().submit_many([JobSpec("demo.echo", {"i": i}) for i in range(6)])
    async with engine.begin() as conn:
        for ago in (3, 2, 1):
            await conn.execute(_EVENT_ROW, {"tenant": stack.tenant_id, "ago": ago})
        events = (
            await conn.execute(text("SELECT id FROM outbox WHERE kind = 'event' ORDER BY 1"))
        ).scalars()
        held_event = next(iter(events))
    queue = topology.queues[0].name
    store = OutboxStore(db)
    for fair in (None, FairClaim(FairRound(), {queue: (100, 1)})):
        rows, slots = await _claimed(store, 4, fair=fair)
        assert [row.kind for row in rows] == [OutboxKind.JOB_DISPATCH] * 4 + [OutboxKind.EVENT] * 3
        assert len(slots) == (0 if fair is None else 4)
        assert {slot.queue for slot in slots} <= {queue}
        skip = {rows[0].id, held_event}
        rows, _ = await _claimed(store, 10, skip=skip, fair=fair)
        assert not skip & {row.id for row in rows}
        assert [row.kind for row in rows] == [OutboxKind.JOB_DISPATCH] * 5 + [OutboxKind.EVENT] * 2


async def _claimed(
    store: OutboxStore,
    limit: int,
    *,
    skip: Collection[uuid.UUID] = (),
    fair: FairClaim | None = None,
) -> tuple[list[OutboxRow], list[FairSlot]]:
    """What one claim takes (rows, the dispatches' places); nothing is marked, so
    the rows stay due when its transaction ends."""
    async with store.claim(limit, skip=skip, fair=fair) as batch:
        return batch.rows, batch.slots


async def test_the_one_claim_reads_a_limit_of_a_dispatch_backlog_not_the_backlog(
    engine: AsyncEngine,
    db: Database,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    """Both parts in one statement keep each part's plan: a backlog of dispatches
    costs the claim the limit's index entries, and the other rows' part none."""
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    jobs = await stack.client().submit_many([JobSpec("demo.echo", {}) for _ in range(500)])
    assert len(jobs) == 500
    statement, binds = relay_claims(topology, limit=10)["in due order"]
    async with db.begin() as conn:
        await conn.execute("ANALYZE outbox")
        plan = await conn.fetch("EXPLAIN (ANALYZE, FORMAT JSON) " + statement.text, binds)
    root = plan[0][0][0]["Plan"]
    assert root["Actual Rows"] == 10
    assert rows_read(part(root, "dispatches")) <= 20, plan[0][0]
    assert rows_read(part(root, OTHERS)) == 0, plan[0][0]
