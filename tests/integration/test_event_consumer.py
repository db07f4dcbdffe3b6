"""jobplane.events.Consumer on the real broker and database: each event applied once.

The tests publish straight into the events exchange, standing in for the
relay, with the body and properties of the contract (docs/events.md).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.events import Consumer, Event, Handler, ensure_inbox, prune_inbox
from jobplane.topology import TopologyMissing
from tests.support import services
from tests.support.events import (
    effects,
    event,
    inbox_rows,
    prepare,
    publish,
    record_effect,
    take_all,
)
from tests.support.queues import ready_count
from tests.support.stack import eventually

_counter = itertools.count(1)


@dataclass
class Names:
    """An exchange and consumer names no other test uses."""

    prefix: str

    @property
    def exchange(self) -> str:
        return f"{self.prefix}jobplane.events"

    def consumer(self, name: str) -> str:
        return f"{self.prefix}{name}"


@pytest.fixture
def names() -> Names:
    return Names(f"ev{next(_counter)}-{uuid.uuid4().hex[:6]}.")


@pytest.fixture
async def db(engine: AsyncEngine) -> AsyncEngine:
    """The consumer's database: the inbox and a side-effect table."""
    await prepare(engine)
    return engine


@dataclass
class Recorder:
    """A handler that records its side effect, and fails when told to."""

    calls: list[uuid.UUID] = field(default_factory=list)
    fail: Callable[[Event, int], bool] = lambda _event, _n: False

    async def __call__(self, event: Event, conn: AsyncConnection) -> None:
        self.calls.append(event.event_id)
        # Written before failing: a failed run must leave nothing behind.
        await record_effect(event, conn)
        if self.fail(event, self.calls.count(event.event_id)):
            raise RuntimeError("the handler failed")


@pytest.fixture
async def consumers(db: AsyncEngine, amqp_url: str, names: Names) -> AsyncIterator[_Consumers]:
    made = _Consumers(db, amqp_url, names)
    yield made
    for consumer in made.started:
        await consumer.stop()


class _Consumers:
    """Starts consumers on the test's database and exchange; stops them after the test."""

    def __init__(self, engine: AsyncEngine, amqp_url: str, names: Names) -> None:
        self.engine = engine
        self.amqp_url = amqp_url
        self.names = names
        self.started: list[Consumer] = []

    async def start(
        self, name: str, handler: Handler, patterns: list[str], **options: object
    ) -> Consumer:
        options.setdefault("retry_delay", 0.0)
        options.setdefault("amqp_url", self.amqp_url)
        consumer = Consumer(
            self.names.consumer(name),
            handler,
            engine=self.engine,
            patterns=patterns,
            exchange=self.names.exchange,
            **options,  # type: ignore[arg-type]
        )
        await consumer.start()
        self.started.append(consumer)
        return consumer


async def test_an_event_is_applied_once(consumers: _Consumers, db: AsyncEngine) -> None:
    handler = Recorder()
    consumer = await consumers.start("once", handler, ["job.*"])
    sent = event("job.started", job="jobs/1")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])

    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert handler.calls == [sent.event_id]
    assert await effects(db) == [(sent.event_id, "job.started")]
    assert await inbox_rows(db, consumer.name) == [sent.event_id]
    await eventually(lambda: _ready_is(consumers.amqp_url, consumer.queue, 0))


async def test_the_same_event_twice_is_applied_once(consumers: _Consumers, db: AsyncEngine) -> None:
    handler = Recorder()
    # Two at once: the copy may arrive while the first is still applied, and
    # must wait for it on the inbox row rather than run beside it.
    consumer = await consumers.start("twice", handler, ["job.*"], concurrency=2)
    sent = event("job.succeeded")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent, sent])

    await eventually(lambda: _async(consumer.counts.applied + consumer.counts.duplicates == 2))
    assert (consumer.counts.applied, consumer.counts.duplicates) == (1, 1)
    assert await effects(db) == [(sent.event_id, "job.succeeded")]
    assert handler.calls == [sent.event_id]


async def test_another_consumer_applies_the_same_event_for_itself(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    first = await consumers.start("mailer", Recorder(), ["job.*"])
    second = await consumers.start("indexer", Recorder(), ["job.*"])
    sent = event("job.failed")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])

    await eventually(lambda: _async(first.counts.applied == second.counts.applied == 1))
    assert await effects(db) == [(sent.event_id, "job.failed")] * 2
    assert await inbox_rows(db, first.name) == await inbox_rows(db, second.name) == [sent.event_id]


async def test_a_failing_handler_is_retried_and_its_writes_roll_back(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    handler = Recorder(fail=lambda _event, n: n == 1)
    consumer = await consumers.start("flaky", handler, ["job.*"])
    sent = event("job.started")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])

    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert consumer.counts.failed == 1
    assert handler.calls == [sent.event_id, sent.event_id]
    assert await effects(db) == [(sent.event_id, "job.started")]


async def test_a_lost_database_session_is_waited_out_without_counting_a_failure(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    calls: list[uuid.UUID] = []

    async def loses_its_session_once(got: Event, conn: AsyncConnection) -> None:
        calls.append(got.event_id)
        await record_effect(got, conn)
        if len(calls) == 1:
            # As a restart or failover would: the session ends mid-transaction.
            await conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    consumer = Consumer(
        consumers.names.consumer("outage"),
        loses_its_session_once,
        engine=db,
        amqp_url=consumers.amqp_url,
        patterns=["job.*"],
        exchange=consumers.names.exchange,
        delivery_limit=1,
        retry_delay=0.0,
    )
    async with consumer:
        sent = event("job.started")
        await publish(consumers.amqp_url, consumers.names.exchange, [sent])
        await eventually(lambda: _async(consumer.counts.applied == 1))
    assert consumer.counts.failed == 0
    assert calls == [sent.event_id, sent.event_id]
    assert await effects(db) == [(sent.event_id, "job.started")]
    assert await ready_count(consumers.amqp_url, consumer.dead_letter_queue) == 0


async def test_a_handler_cut_short_by_stop_leaves_nothing_and_runs_again(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    entered = asyncio.Event()

    async def hangs(got: Event, conn: AsyncConnection) -> None:
        await record_effect(got, conn)
        entered.set()
        await asyncio.Event().wait()

    first = await consumers.start("stopped", hangs, ["job.*"])
    sent = event("job.started")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])
    await asyncio.wait_for(entered.wait(), timeout=30)
    await first.stop(grace=0.1)
    assert await effects(db) == []
    assert await inbox_rows(db, first.name) == []

    handler = Recorder()
    again = await consumers.start("stopped", handler, ["job.*"])
    await eventually(lambda: _async(again.counts.applied == 1))
    assert handler.calls == [sent.event_id]
    assert await effects(db) == [(sent.event_id, "job.started")]


async def test_a_handler_that_always_fails_is_dead_lettered_after_the_limit(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    doomed = event("job.started", n=1)
    handler = Recorder(fail=lambda e, _n: e.event_id == doomed.event_id)
    consumer = await consumers.start("doomed", handler, ["job.*"], delivery_limit=2)
    await publish(consumers.amqp_url, consumers.names.exchange, [doomed])

    await eventually(lambda: _ready_is(consumers.amqp_url, consumer.dead_letter_queue, 1))
    # The first delivery and one per allowed return, then the dead letter.
    assert handler.calls == [doomed.event_id] * 3
    assert consumer.counts.failed == 3
    assert await effects(db) == []
    assert await inbox_rows(db, consumer.name) == []
    [dead] = await take_all(consumers.amqp_url, consumer.dead_letter_queue)
    assert dead.message_id == str(doomed.event_id)

    after = event("job.started", n=2)
    await publish(consumers.amqp_url, consumers.names.exchange, [after])
    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert await effects(db) == [(after.event_id, "job.started")]


async def test_a_message_that_is_not_an_event_is_dead_lettered_and_the_rest_go_on(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    handler = Recorder()
    consumer = await consumers.start("strays", handler, ["job.*"])
    good = event("job.cancelled")
    stray = b'{"v": 1, "event_type": "job.cancelled"}'
    await publish(
        consumers.amqp_url,
        consumers.names.exchange,
        [("job.cancelled", b"not json"), ("job.cancelled", stray), good],
    )

    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert consumer.counts.rejected == 2
    assert handler.calls == [good.event_id]
    await eventually(lambda: _ready_is(consumers.amqp_url, consumer.dead_letter_queue, 2))
    dead = await take_all(consumers.amqp_url, consumer.dead_letter_queue)
    assert sorted(m.body for m in dead) == sorted([b"not json", stray])


async def test_patterns_choose_the_events(consumers: _Consumers, db: AsyncEngine) -> None:
    jobs = Recorder()
    artifacts = Recorder()
    job_consumer = await consumers.start("jobs", jobs, ["job.*"])
    artifact_consumer = await consumers.start("artifacts", artifacts, ["artifact.#"])
    created = event("artifact.created")
    started = event("job.started")
    deeper = event("job.started.late")
    await publish(consumers.amqp_url, consumers.names.exchange, [created, started, deeper])

    await eventually(lambda: _async(artifact_consumer.counts.applied == 1))
    await eventually(lambda: _async(job_consumer.counts.applied == 1))
    # Stopped, every delivery of its queue is settled or back in it: what the
    # broker routed to it is all here.
    await job_consumer.stop()
    assert jobs.calls == [started.event_id]
    assert artifacts.calls == [created.event_id]
    assert await ready_count(consumers.amqp_url, job_consumer.queue) == 0


async def test_the_handler_sees_the_envelope_as_published(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    seen: list[Event] = []

    async def keep(got: Event, conn: AsyncConnection) -> None:
        seen.append(got)

    consumer = Consumer(
        consumers.names.consumer("envelope"),
        keep,
        engine=db,
        amqp_url=consumers.amqp_url,
        patterns=["deployment.#"],
        exchange=consumers.names.exchange,
    )
    async with consumer:
        first = Event.new(
            "deployment.started", {"env": "prod", "n": 3}, tenant_id=uuid.uuid4(), project_id="web"
        )
        then = Event.new(
            "deployment.completed", {"ok": True}, tenant_id=first.tenant_id, caused_by=first
        )
        await publish(consumers.amqp_url, consumers.names.exchange, [first, then])
        await eventually(lambda: _async(len(seen) == 2))
    assert seen == [first, then]
    assert seen[1].causation_id == str(first.event_id)
    assert seen[1].correlation_id == first.correlation_id == str(first.event_id)


async def test_passive_mode_declares_nothing_and_says_what_is_missing(
    consumers: _Consumers, db: AsyncEngine
) -> None:
    with pytest.raises(TopologyMissing, match="exchange"):
        await consumers.start("passive", Recorder(), [], passive=True)
    # An operator's account declares and binds it once ...
    setup = await consumers.start("passive", Recorder(), ["job.*"])
    await setup.stop()
    # ... and the passive consumer consumes it, bindings as they were.
    handler = Recorder()
    consumer = await consumers.start("passive", handler, [], passive=True)
    sent = event("job.started")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])
    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert handler.calls == [sent.event_id]


@pytest.fixture
def restricted_url(amqp_url: str, run_id: str) -> Iterator[str]:
    """A user of this run's vhost that may write and read, but configure nothing."""
    user = f"jp_{run_id}_events"
    vhost = urlsplit(amqp_url).path.lstrip("/")
    url = services.create_user(user, "s3cret", vhost, configure="^$", write=".*", read=".*")
    yield url
    services.delete_user(user)


async def test_an_account_without_configure_rights_consumes_passively(
    consumers: _Consumers, db: AsyncEngine, restricted_url: str
) -> None:
    with pytest.raises(TopologyMissing, match="may not declare"):
        await consumers.start("least", Recorder(), ["job.*"], amqp_url=restricted_url)
    setup = await consumers.start("least", Recorder(), ["job.*"])
    await setup.stop()
    handler = Recorder()
    consumer = await consumers.start(
        "least", handler, ["job.*"], amqp_url=restricted_url, passive=True
    )
    sent = event("job.started")
    await publish(consumers.amqp_url, consumers.names.exchange, [sent])
    await eventually(lambda: _async(consumer.counts.applied == 1))
    assert await effects(db) == [(sent.event_id, "job.started")]


async def test_the_inbox_is_created_once_and_pruned_by_age(db: AsyncEngine) -> None:
    await asyncio.gather(ensure_inbox(db), ensure_inbox(db), ensure_inbox(db))
    old, new = uuid.uuid4(), uuid.uuid4()
    async with db.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO jobplane_inbox (consumer, event_id, event_type, received_at) VALUES "
                "('c', :old, 'x', now() - interval '10 days'), ('c', :new, 'x', now())"
            ),
            {"old": old, "new": new},
        )
    assert await prune_inbox(db, older_than=timedelta(days=7)) == 1
    assert await inbox_rows(db, "c") == [new]


async def _async(value: bool) -> bool:
    return value


async def _ready_is(amqp_url: str, queue: str, count: int) -> bool:
    return await ready_count(amqp_url, queue) == count
