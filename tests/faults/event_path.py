"""The event path of a fault run: publishers, a tap, a resuming subscriber, and the judge.

Events travel PublishEvent (or ``jobplane.publish_event`` in a caller's
transaction) → ``events`` → the relays' feed → the events exchange →
queues. A run is judged, beside L/D/O of its jobs, by:

- **P** every event a publisher was told is stored is in ``events``, and
  every committed event was published at least once: a copy of it is in the
  tap (a durable queue bound ``#``), and the relays' position is past it;
- **A** the inbox :class:`~jobplane.events.Consumer`, in a process of its
  own, applied every committed event exactly once (one side-effect row) and
  nothing else;
- **O** a SubscribeEvents stream that resumes from its last cursor after
  every drop saw exactly the committed events in commit order: no gap, no
  repeat.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from dataclasses import dataclass, field

import aio_pika
import asyncpg
import grpc

from jobplane import txn
from jobplane.errors import JobplaneError
from jobplane.store.engine import asyncpg_dsn, create_engine
from jobplane.v1 import events_pb2, events_pb2_grpc
from tests.faults.cluster import Cluster, Proc
from tests.support.events import prepare

EVENT_TYPE = "fault.happened"


@dataclass
class EventPath:
    """The event side of a :class:`Cluster`: who publishes, who listens, what came out."""

    cluster: Cluster
    #: Event ids a publisher was told are stored (PublishEvent answered, or
    #: the caller's transaction committed).
    acked: list[uuid.UUID] = field(default_factory=list)
    #: Event ids a subscription streamed, in order, across its resumes.
    seen: list[uuid.UUID] = field(default_factory=list)
    resumes: int = 0
    consumer: Proc | None = None
    _subscriber: asyncio.Task[None] | None = None
    _channel: grpc.aio.Channel | None = None

    @property
    def tap(self) -> str:
        """The tap queue's name."""
        return f"{self.cluster.topology.events_exchange}.tap"

    @property
    def consumer_name(self) -> str:
        """The inbox consumer's name (and queue)."""
        return f"{self.cluster.topology.events_exchange}.consumer"

    async def start(self) -> None:
        """The tap and the consumer process; before the relay, so that they see every event."""
        engine = create_engine(self.cluster.database_url, pool_size=1)
        try:
            await prepare(engine)  # the inbox and the side-effect table
        finally:
            await engine.dispose()
        connection = await aio_pika.connect(self.cluster.amqp_url)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                self.cluster.topology.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )
            queue = await channel.declare_queue(self.tap, durable=True)
            await queue.bind(exchange, routing_key="#")
        self.consumer = Proc(
            self.cluster,
            [
                self.cluster.pool_url,
                self.cluster.amqp_url,
                self.cluster.topology.events_exchange,
                self.consumer_name,
                "#",
            ],
            module="tests.faults.event_consumer",
        )
        self.cluster.procs.append(self.consumer)
        await self.consumer.start(ready="events.consumer.started")
        self._channel = grpc.aio.insecure_channel(self.cluster.address)
        self._subscriber = asyncio.create_task(self._subscribe())

    async def close(self) -> None:
        """Stop the subscriber; delete the tap and the consumer's queues."""
        if self._subscriber is not None:
            self._subscriber.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._subscriber
        if self._channel is not None:
            await self._channel.close()
        with contextlib.suppress(Exception):
            connection = await aio_pika.connect(self.cluster.amqp_url)
            async with connection:
                channel = await connection.channel()
                for name in (self.tap, self.consumer_name, self.consumer_name + ".dead"):
                    await channel.queue_delete(name)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.cluster.key}"),)

    async def _subscribe(self) -> None:
        assert self._channel is not None
        stub = events_pb2_grpc.EventServiceStub(self._channel)
        cursor = ""
        while True:
            try:
                call = stub.SubscribeEvents(
                    events_pb2.SubscribeEventsRequest(type_patterns=["#"], after_cursor=cursor),
                    metadata=self._metadata(),
                )
                async for reply in call:
                    self.seen.append(uuid.UUID(reply.event.event_id))
                    cursor = reply.cursor
            except grpc.aio.AioRpcError:
                pass
            self.resumes += 1
            await asyncio.sleep(0.2)

    async def publish_rpc(self, count: int, *, prefix: str = "rpc") -> None:
        """``count`` PublishEvent calls, each repeated with its event_id until answered."""
        async with grpc.aio.insecure_channel(self.cluster.address) as channel:
            stub = events_pb2_grpc.EventServiceStub(channel)
            for i in range(count):
                event_id = uuid.uuid4()
                request = events_pb2.PublishEventRequest(
                    event_id=str(event_id), event_type=EVENT_TYPE
                )
                request.payload.update({"via": prefix, "i": i})
                for attempt in range(300):
                    try:
                        await stub.PublishEvent(request, metadata=self._metadata(), timeout=10)
                        break
                    except grpc.aio.AioRpcError:
                        if attempt == 299:
                            raise
                        await asyncio.sleep(0.1)
                self.acked.append(event_id)

    async def publish_in_transactions(self, count: int) -> None:
        """``count`` events, each in a caller's transaction with a row of its own,
        the whole transaction repeated (same event_id) until it commits."""
        dsn = asyncpg_dsn(self.cluster.database_url)
        conn: asyncpg.Connection | None = None
        try:
            for i in range(count):
                event_id = uuid.uuid4()
                for attempt in range(300):
                    try:
                        if conn is None or conn.is_closed():
                            conn = await asyncpg.connect(dsn)
                        async with conn.transaction():
                            await conn.execute(
                                "INSERT INTO fault_callers (event_id) VALUES ($1) "
                                "ON CONFLICT DO NOTHING",
                                event_id,
                            )
                            await txn.publish_event(
                                conn,
                                tenant="faults",
                                event_type=EVENT_TYPE,
                                payload={"via": "sql", "i": i},
                                event_id=event_id,
                            )
                        break
                    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, JobplaneError):
                        if attempt == 299:
                            raise
                        if conn is not None:
                            conn.terminate()
                            conn = None
                        await asyncio.sleep(0.1)
                self.acked.append(event_id)
        finally:
            if conn is not None:
                await conn.close()

    async def settle(self, timeout: float = 90) -> None:
        """Until every committed event is published, applied and streamed."""
        deadline = time.monotonic() + timeout
        while True:
            rows = await self.cluster.query(
                """
                SELECT (SELECT count(*) FROM events) AS committed,
                       (SELECT count(*) FROM events e, event_relay r
                          WHERE (e.txid, e.seq) > (r.txid, r.seq)) AS pending,
                       (SELECT count(DISTINCT event_id) FROM event_effects) AS applied
                """
            )
            committed, pending, applied = (
                rows[0]["committed"],
                rows[0]["pending"],
                rows[0]["applied"],
            )
            if pending == 0 and applied >= committed and len(set(self.seen)) >= committed:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"events never settled: {committed} committed, {pending} unpublished, "
                    f"{applied} applied, {len(set(self.seen))} streamed"
                )
            await asyncio.sleep(0.2)

    async def copies(self) -> collections.Counter[uuid.UUID]:
        """Copies of each event in the tap (taken out of it)."""
        counted: collections.Counter[uuid.UUID] = collections.Counter()
        connection = await aio_pika.connect(self.cluster.amqp_url)
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(self.tap)
            while (message := await queue.get(fail=False, no_ack=True)) is not None:
                counted[uuid.UUID(str(message.message_id))] += 1
        return counted

    async def judge(self) -> tuple[dict[str, int], list[str]]:
        """Judge P, A and O over every event of the run: counts, and every violation."""
        # Every event: the run's own, and the lifecycle events of its jobs.
        rows = await self.cluster.query(
            "SELECT event_id, event_type FROM events ORDER BY txid, seq"
        )
        committed = [r["event_id"] for r in rows]
        stored = set(committed)
        copies = await self.copies()
        effects = {
            r["event_id"]: r["n"]
            for r in await self.cluster.query(
                "SELECT event_id, count(*) AS n FROM event_effects GROUP BY event_id"
            )
        }
        # Behind the relays' position when the run settled: never published.
        unpublished = await self.cluster.query(
            "SELECT e.event_id, e.event_type FROM events e, event_relay r "
            "WHERE (e.txid, e.seq) > (r.txid, r.seq)"
        )
        problems = [
            f"P: {e} was acknowledged but is not stored" for e in self.acked if e not in stored
        ]
        problems += [f"P: {e} committed and never published" for e in committed if not copies[e]]
        problems += [f"P: {dict(r)} behind the relays' position" for r in unpublished]
        problems += [
            f"A: {e} applied {effects.get(e, 0)} times" for e in committed if effects.get(e) != 1
        ]
        problems += [f"A: {e} applied, never committed" for e in effects if e not in stored]
        if self.seen != committed:
            at = next(
                (i for i, (a, b) in enumerate(zip(self.seen, committed, strict=False)) if a != b),
                min(len(self.seen), len(committed)),
            )
            problems.append(
                f"O: the stream saw {len(self.seen)} events ({len(set(self.seen))} distinct) "
                f"of {len(committed)} committed, first difference at {at}"
            )
        counts = {
            "events": len(committed),
            "published": sum(1 for r in rows if r["event_type"] == EVENT_TYPE),
            "acked": len(self.acked),
            "copies": sum(copies.values()),
            "duplicates": sum(n - 1 for n in copies.values() if n > 1),
            "applied": sum(effects.values()),
            "resumes": self.resumes,
        }
        return counts, problems


CALLER_TABLE = "CREATE TABLE IF NOT EXISTS fault_callers (event_id uuid PRIMARY KEY)"


async def event_path(cluster: Cluster) -> EventPath:
    """An :class:`EventPath` of ``cluster`` (its tap and consumer not started yet)."""
    rows = await cluster.query(CALLER_TABLE)
    assert rows == []
    return EventPath(cluster)
