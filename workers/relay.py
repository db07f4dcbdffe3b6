"""The outbox relay: publish committed dispatch intents, confirmed, then mark them.

Rows are claimed with FOR UPDATE SKIP LOCKED, published persistent and
mandatory on a confirming channel, and marked by what the broker did with
each, in the claim's transaction:

- an ack: published;
- a nack, a timeout or a lost connection: due again after a backoff
  (transient; the relay reconnects only when its channel is gone);
- a return (no queue bound for the routing key): due again after a backoff,
  until the row has come back ``unroutable_returns`` times over at least
  ``unroutable_after`` seconds — then the job FAILS with
  ``JOB_TYPE_UNROUTABLE``. The server refuses types its topology file does
  not route, so a return means the broker's bindings differ from the file
  (not applied yet, being re-applied, a queue deleted): worth minutes of
  patience, not a job QUEUED for ever;
- a message the broker can never take (a correlation id or routing key
  longer than AMQP's 255-byte short strings, a body over the envelope limit):
  the row is failed and the job FAILS with ``DISPATCH_FAILED``, at once.

One row's fate never holds up the others of its batch. A crash after the
confirm and before the mark publishes the row again later: workers treat that
duplicate as harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, replace

import aio_pika
import aiormq
import pamqp.exceptions
import pamqp.frame
import pamqp.header
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.envelope import DEPLOYMENT_HEADER, MAX_ENVELOPE_BYTES
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.logs import describe_error
from jobplane.names import job_name
from jobplane.store.deployment import Deployment, this_deployment
from jobplane.store.listen import Listener
from jobplane.store.outbox import GiveUp, OutboxBatch, OutboxRow, OutboxStore
from jobplane.store.rows import OUTBOX_CHANNEL
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Ownership, Topology, TopologyMissing, ensure
from jobplane.workers.sweeper import Sweeper

log = structlog.get_logger("jobplane.relay")

DISPATCH_FAILED = "DISPATCH_FAILED"
JOB_TYPE_UNROUTABLE = "JOB_TYPE_UNROUTABLE"
_SHORT_STRING = 255  # bytes of an AMQP short string
# AMQP's smallest frame: a header frame this size fits any broker's frame_max.
_MIN_FRAME_MAX = 4096


class PublishFailed(Exception):
    """The broker did not confirm a message (a nack, or no answer in time)."""


class Returned(PublishFailed):
    """The broker returned the message: no queue is bound for its routing key."""


class Unpublishable(Exception):
    """The broker can never accept this message as it is; retrying cannot help."""


@dataclass(slots=True)
class _Link:
    connection: AbstractConnection
    channel: AbstractChannel
    exchange: AbstractExchange

    @property
    def closed(self) -> bool:
        return self.connection.is_closed or self.channel.is_closed

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.connection.close()


class Relay:
    """Moves due outbox rows to RabbitMQ; any number may run at once."""

    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        amqp_url: str,
        topology: Topology,
        *,
        batch_size: int = 100,
        poll_seconds: float = 1.0,
        publish_timeout: float = 10.0,
        faults: FaultPoints = NO_FAULTS,
        sweeper: Sweeper | None = None,
        sweep_interval: float = 5.0,
        unroutable_after: float = 300.0,
        unroutable_returns: int = 5,
    ) -> None:
        self._engine = engine
        self._store = OutboxStore(engine)
        self._amqp_url = amqp_url
        self._topology = topology
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._faults = faults
        self._wakeups = Listener(database_url, OUTBOX_CHANNEL)
        self._task: asyncio.Task[None] | None = None
        self._sweeper = sweeper
        self._sweep_interval = sweep_interval
        self._unroutable_after = unroutable_after
        self._unroutable_returns = unroutable_returns
        self._deployment: Deployment | None = None
        self._link: _Link | None = None
        self.ownership: Ownership | None = None
        self.published = 0
        self.failed = 0
        self.connects = 0

    @property
    def connected(self) -> bool:
        """True while the relay holds an open channel to the broker."""
        return self._link is not None and not self._link.closed

    async def start(self) -> None:
        """Check the topology, then relay in the background.

        Raises :class:`TopologyMissing` (or the broker's refusal) when this
        account cannot work with the broker as it is; a broker or database
        that is down is waited for in the background instead.
        """
        await self._wakeups.start()
        try:
            self._link = await self._open()
        except Exception as exc:
            if not (broker.broker_down(exc) or isinstance(exc, DBAPIError | OSError)):
                await self._wakeups.stop()
                raise
            log.warning("broker.unavailable", error=repr(exc), retry="in the background")
        self._task = asyncio.create_task(self._run(), name="jobplane-relay")
        if self._sweeper is not None:
            self._sweeper.start(self._sweep_interval)

    async def stop(self) -> None:
        """Stop; a batch in flight is rolled back and stays due."""
        if self._sweeper is not None:
            await self._sweeper.stop()
        await cancel_and_wait(self._task)
        self._task = None
        if self._link is not None:
            await self._link.close()
            self._link = None
        await self._wakeups.stop()

    async def _open(self) -> _Link:
        """Connect, check the topology and open a confirming channel."""
        if self._deployment is None:
            self._deployment = await this_deployment(self._engine)
        connection = await broker.connect(self._amqp_url)
        try:
            self.ownership = await ensure(connection, self._topology, self._deployment)
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(self._topology.exchange, ensure=False)
        except BaseException:
            with contextlib.suppress(Exception):
                await connection.close()
            raise
        self.connects += 1
        return _Link(connection, channel, exchange)

    async def _run(self) -> None:
        delay = 0.5
        with self._wakeups.subscribe() as wakeup:
            while True:
                try:
                    if self._link is None:
                        self._link = await self._open()
                    log.info("relay.connected")
                    delay = 0.5
                    while not self._link.closed:
                        moved = await self.relay_once(self._link.exchange)
                        if moved < self._batch_size:
                            await wakeup.wait(await self._idle_seconds())
                    log.warning("broker.unavailable", error="the channel closed", retry_in=delay)
                except asyncio.CancelledError:
                    raise
                except DBAPIError as exc:
                    log.warning("relay.db.error", error=describe_error(exc), retry_in=delay)
                except TopologyMissing as exc:
                    # Removed under a running relay; an operator may apply it again.
                    log.error("relay.topology.missing", error=str(exc), retry_in=delay)
                except Exception as exc:
                    if broker.broker_down(exc):
                        log.warning("broker.unavailable", error=repr(exc), retry_in=delay)
                    else:
                        # A relay that stops relaying is worse than one that
                        # keeps trying: say it loudly and try again.
                        log.error("relay.error", error=repr(exc), retry_in=delay, exc_info=exc)
                if self._link is not None:
                    await self._link.close()
                    self._link = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def drain_once(self) -> int:
        """Connect, publish every row due now, disconnect; returns rows taken."""
        link = await self._open()
        try:
            total = 0
            while (moved := await self.relay_once(link.exchange)) > 0:
                total += moved
                if moved < self._batch_size:
                    break
            return total
        finally:
            await link.close()

    async def _idle_seconds(self) -> float:
        due = await self._store.seconds_until_due()
        if due is None:
            return self._poll_seconds * 5
        return max(0.01, min(due, self._poll_seconds))

    async def relay_once(self, exchange: AbstractExchange) -> int:
        """Publish one batch of due rows; returns how many rows it took."""
        async with self._store.claim(self._batch_size) as batch:
            if not batch.rows:
                return 0
            results = await asyncio.gather(
                *(self._publish(exchange, row) for row in batch.rows), return_exceptions=True
            )
            confirmed: list[OutboxRow] = []
            retry: list[tuple[OutboxRow, Exception]] = []
            returned: list[tuple[OutboxRow, Exception]] = []
            give_up: list[tuple[OutboxRow, str, str]] = []  # row, error code, message
            for row, result in zip(batch.rows, results, strict=True):
                if result is None:
                    confirmed.append(row)
                elif not isinstance(result, Exception):
                    raise result  # cancelled: the batch rolls back and stays due
                elif isinstance(result, Unpublishable):
                    give_up.append((row, DISPATCH_FAILED, f"the broker cannot accept it: {result}"))
                elif isinstance(result, Returned):
                    returned.append((row, result))
                else:
                    retry.append((row, result))
            self._faults.hit("relay.after_confirm")
            await batch.mark_published([row.id for row in confirmed])
            for row, error in retry + returned:
                log.warning("broker.publish.failed", event_id=str(row.id), error=repr(error))
            if retry:
                await batch.mark_retry([row.id for row, _ in retry], repr(retry[0][1]))
            if returned:
                unroutable = await batch.mark_returned(
                    [row.id for row, _ in returned],
                    repr(returned[0][1]),
                    give_up_after=self._unroutable_after,
                    give_up_returns=self._unroutable_returns,
                )
                give_up += [
                    (row, JOB_TYPE_UNROUTABLE, self._unroutable_message(row))
                    for row, _ in returned
                    if row.id in unroutable
                ]
            for row, code, message in give_up:
                await self._give_up(batch, row, code, message)
            self.published += len(confirmed)
            log.debug(
                "relay.batch",
                published=len(confirmed),
                retry=len(retry),
                returned=len(returned),
                failed=len(give_up),
            )
        return len(batch.rows)

    def _unroutable_message(self, row: OutboxRow) -> str:
        return (
            f"no queue on the broker takes job type {row.envelope.job_type!r}: the dispatch "
            f"came back unroutable at least {self._unroutable_returns} times over "
            f"{self._unroutable_after:g}s (the broker's bindings differ from the topology; "
            "run `jobplane topology apply`)"
        )

    async def _give_up(self, batch: OutboxBatch, row: OutboxRow, code: str, message: str) -> None:
        outcome = await batch.fail(row, code, message)
        if outcome is GiveUp.BUSY:
            # Its job is being changed right now (a cancel, most likely): the
            # row stays due and the next pass decides.
            await batch.mark_retry([row.id], message)
            return
        self.failed += 1
        log.error(
            "relay.dispatch.failed",
            job=job_name(row.envelope.job_id),
            event_id=str(row.id),
            code=code,
            error=message,
            job_failed=outcome is GiveUp.JOB_FAILED,
        )

    async def _publish(self, exchange: AbstractExchange, row: OutboxRow) -> None:
        deployment = self._deployment.id if self._deployment is not None else None
        envelope = replace(row.envelope, deployment=deployment)
        message = aio_pika.Message(
            envelope.encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(envelope.event_id),
            correlation_id=envelope.correlation_id or None,
            type="jobplane.job.dispatch.v1",
            headers={
                "job_id": str(envelope.job_id),
                **({DEPLOYMENT_HEADER: envelope.deployment} if envelope.deployment else {}),
            },
        )
        check_publishable(message, exchange.name, envelope.job_type)
        try:
            confirmation = await exchange.publish(
                message,
                routing_key=envelope.job_type,
                mandatory=True,
                timeout=self._publish_timeout,
            )
        except aiormq.exceptions.PublishError as exc:  # a return, on a raising channel
            raise Returned("not confirmed: returned unroutable") from exc
        except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
            # Encoding refused it after all (check_publishable missed a case).
            raise Unpublishable(str(exc)) from exc
        # A returned (unroutable) message resolves the confirm too, carrying the
        # message instead of a Basic.Ack: that is not a publish.
        if isinstance(confirmation, aiormq.spec.Basic.Ack):
            return
        if isinstance(confirmation, aiormq.abc.DeliveredMessage):
            raise Returned("not confirmed: returned unroutable")
        raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")


def check_publishable(message: aio_pika.Message, exchange: str, routing_key: str) -> None:
    """Raise :class:`Unpublishable` unless AMQP can carry ``message`` as it is.

    Encodes the method and header frames the way the client will, without
    sending them: a string over 255 bytes (correlation id, routing key), a
    header that cannot be encoded, a header frame over the smallest frame
    size, a body over the envelope limit. Checked before the publish, so one
    bad row never reaches (or closes) the channel its batch shares.
    """
    if len(message.body) > MAX_ENVELOPE_BYTES:
        raise Unpublishable(f"body of {len(message.body)} bytes exceeds {MAX_ENVELOPE_BYTES}")
    for field, value in (
        ("routing key (job type)", routing_key),
        ("correlation id", message.correlation_id),
    ):
        size = len((value or "").encode("utf-8", "surrogatepass"))
        if size > _SHORT_STRING:
            raise Unpublishable(
                f"its {field} is {size} bytes; AMQP carries at most {_SHORT_STRING}"
            )
    try:
        pamqp.frame.marshal(
            aiormq.spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True),
            1,
        )
        header = pamqp.frame.marshal(
            pamqp.header.ContentHeader(0, len(message.body), message.properties), 1
        )
    except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
        raise Unpublishable(_short(exc)) from exc
    if len(header) > _MIN_FRAME_MAX:
        raise Unpublishable(f"message properties of {len(header)} bytes exceed one frame")


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
