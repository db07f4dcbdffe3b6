"""The topology on the broker: declaring it, checking it, and recording its owner."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from jobplane import broker
from jobplane.broker import access_refused
from jobplane.topology.model import Topology, TopologyMissing

if TYPE_CHECKING:
    from jobplane.store.deployment import Deployment

log = structlog.get_logger("jobplane.topology")


async def declare(channel: AbstractChannel, topology: Topology) -> AbstractExchange:
    """Declare everything idempotently; returns the jobs exchange.

    Queues are quorum queues: a bounded ``x-delivery-limit`` turns a crash loop
    into a dead letter, dead-lettered with the at-least-once strategy (which
    needs ``x-overflow=reject-publish``) so a message is never dropped between
    a queue and the failed queue. The events exchange is a durable topic
    exchange with no arguments and no queues: consumers bind their own.

    Each quorum queue gets ``x-quorum-initial-group-size`` only when the
    topology's ``[quorum] initial_group_size`` is set (ADR-0049): RabbitMQ
    compares it when a queue is declared again, so a queue declared without
    it would refuse a declare that adds it.
    """
    exchange = await channel.declare_exchange(
        topology.exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )
    await channel.declare_exchange(
        topology.events_exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )
    dlx = await channel.declare_exchange(
        topology.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    failed = await channel.declare_queue(
        topology.failed_queue, durable=True, arguments=topology.quorum_arguments()
    )
    await failed.bind(dlx, routing_key="")
    await _declare_owner_queue(channel, topology.owner_queue)
    for spec in topology.queues:
        queue = await channel.declare_queue(
            spec.name,
            durable=True,
            arguments={
                **topology.quorum_arguments(),
                "x-delivery-limit": spec.delivery_limit,
                "x-dead-letter-exchange": topology.dead_letter_exchange,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            },
        )
        for pattern in spec.bindings:
            await queue.bind(exchange, routing_key=pattern)
    return exchange


@dataclass(frozen=True, slots=True)
class Ownership:
    """Which deployment owns a topology, as recorded on the broker, and who asked."""

    ours: Deployment
    # The owner's id and database as recorded; None when nothing is recorded
    # (the owner queue is missing and this account may not create it).
    owner_id: str | None
    owner_database: str | None = None

    @property
    def conflict(self) -> bool:
        """True when another deployment owns the topology (it shares our queues)."""
        return self.owner_id is not None and self.owner_id != self.ours.id

    def describe_owner(self) -> str:
        """The owner, for people: its id and database."""
        return f"{self.owner_id} (database {self.owner_database or '?'!r})"


async def ensure(
    connection: AbstractConnection, topology: Topology, deployment: Deployment
) -> Ownership:
    """Check the topology on the broker; declare only what is missing.

    Each check is a passive declare on a channel of its own (a missing entity
    closes the channel). Passive declares need no permission, so an account
    without configure rights passes when the topology is there; when a part
    is missing and the account may not declare it, :class:`TopologyMissing`
    names what is missing. Bindings of existing queues are the operator's
    (``jobplane topology apply``) and are left alone.

    Then the owner queue is read (see :func:`claim_ownership`); a topology
    owned by another deployment is logged as an error (``topology.owner.conflict``).
    """
    await declare_missing(connection, topology)
    ownership = await claim_ownership(connection, topology, deployment)
    if ownership.conflict:
        log.error(
            "topology.owner.conflict",
            exchange=topology.exchange,
            owner=ownership.describe_owner(),
            this=str(deployment),
            consequence="both deployments consume these queues; each hands the other's "
            "messages back, which costs latency. Give each deployment its own vhost or "
            "topology names (JOBPLANE_TOPOLOGY)",
        )
    return ownership


async def declare_missing(connection: AbstractConnection, topology: Topology) -> list[str]:
    """Check the topology on the broker and declare it when part of it is missing.

    Returns what was missing (empty: all there). Passive checks need no
    permission; when something is missing and this account may not declare it,
    raises :class:`TopologyMissing` naming what is missing.
    """
    checks = [
        (f"exchange {topology.exchange!r}", "exchange", topology.exchange),
        (f"exchange {topology.dead_letter_exchange!r}", "exchange", topology.dead_letter_exchange),
        (f"queue {topology.failed_queue!r}", "queue", topology.failed_queue),
        *((f"queue {q.name!r}", "queue", q.name) for q in topology.queues),
        (f"exchange {topology.events_exchange!r}", "exchange", topology.events_exchange),
    ]
    missing = [label for label, kind, name in checks if not await _exists(connection, kind, name)]
    if missing:
        try:
            async with _channel(connection) as channel:
                await declare(channel, topology)
        except aiormq.exceptions.AMQPError as exc:
            if not access_refused(exc):
                raise
            raise TopologyMissing(
                f"the RabbitMQ topology is incomplete (missing {', '.join(missing)}) and this "
                "account may not declare it: run `jobplane topology apply` with an account "
                "that may configure"
            ) from exc
        log.info("topology.declared", missing=missing)
    return missing


async def apply(amqp_url: str, topology: Topology) -> None:
    """Declare all of ``topology`` on the broker at ``amqp_url``, the bindings of queues
    that exist already among it (``jobplane dev``: the routes it runs exist)."""
    connection = await broker.connect(amqp_url)
    async with connection, _channel(connection) as channel:
        await declare(channel, topology)


async def until_declared(amqp_url: str, topology: Topology) -> None:
    """Return once ``topology`` is on the broker at ``amqp_url``: checked, and what is
    missing declared when this account may; otherwise tried again with a growing
    backoff (a broker down, or an account that must wait for ``jobplane topology apply``).
    Any other error (a wrong password, a vhost not permitted, TLS) is raised: trying
    again would not mend it.
    """

    async def check() -> None:
        connection = await broker.connect(amqp_url)
        async with connection:
            await declare_missing(connection, topology)

    delay = 0.5
    while True:
        try:
            await broker.until_up(check, log)
        except TopologyMissing as exc:  # missing and not ours to declare: say so, wait
            log.error("topology.unavailable", error=str(exc) or repr(exc), retry_in=delay)
        else:
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)


async def claim_ownership(
    connection: AbstractConnection,
    topology: Topology,
    deployment: Deployment,
    *,
    take_over: bool = False,
) -> Ownership:
    """Read the topology's owner; record ``deployment`` when there is none.

    The owner queue holds one persistent message naming the deployment that
    declared the topology first. It is read with basic.get and put back with
    nack(requeue), which needs only read permission; recording needs write
    permission (publishing to it). Creating the queue needs configure: an
    account without it leaves an absent owner queue absent (nothing recorded,
    a warning), because the owner is a diagnosis, not a condition of working.

    ``take_over``: replace the recorded owner with ``deployment`` (for an
    operator whose previous deployment is gone).

    The owner queue is a classic queue, on one node of a cluster: while that
    node is down the owner cannot be read, which is said (a warning) and
    nothing more — a relay reconnecting after losing that node must not wait
    for it to come back (ADR-0049). A take-over raises.
    """
    try:
        return await _claim(connection, topology, deployment, take_over=take_over)
    except aiormq.exceptions.ChannelNotFoundEntity as exc:
        if take_over or not broker.home_node_down(exc):
            raise
        log.warning(
            "topology.owner.unreachable",
            queue=topology.owner_queue,
            reason="the owner queue's node is down; the owner is read again on the next connect",
            error=str(exc),
        )
        return Ownership(deployment, None)


async def _claim(
    connection: AbstractConnection, topology: Topology, deployment: Deployment, *, take_over: bool
) -> Ownership:
    name = topology.owner_queue
    if not await _exists(connection, "queue", name):
        try:
            async with _channel(connection) as channel:
                await _declare_owner_queue(channel, name)
        except aiormq.exceptions.AMQPError as exc:
            if not access_refused(exc):
                raise
            log.warning(
                "topology.owner.unrecorded",
                queue=name,
                reason="the owner queue is missing and this account may not declare it; "
                "`jobplane topology apply` creates it",
            )
            return Ownership(deployment, None)
    async with _channel(connection) as channel:
        queue = await channel.get_queue(name, ensure=False)
        if take_over:
            await queue.purge()
        recorded = None
        for _ in range(3):  # more than one round only when a record races ours
            recorded = await _peek(queue) or await _record(channel, name, deployment)
            if recorded is not None:
                break
    if recorded is None:
        return Ownership(deployment, None)
    return Ownership(deployment, *recorded)


async def _peek(queue: aio_pika.abc.AbstractQueue) -> tuple[str, str | None] | None:
    """The recorded owner, left in the queue; None when nothing is recorded."""
    # An empty answer may be another process peeking at this moment (its
    # message is unacked, not ready): ask again before concluding.
    for delay in (0.0, 0.05, 0.2):
        await asyncio.sleep(delay)
        message = await queue.get(no_ack=False, fail=False)
        if message is not None:
            await message.nack(requeue=True)
            return _parse_owner(message.body)
    return None


async def _record(
    channel: AbstractChannel, name: str, deployment: Deployment
) -> tuple[str, str | None] | None:
    """Record ``deployment`` as the owner; None if another record won the race."""
    body = json.dumps({"deployment": deployment.id, "database": deployment.database}).encode()
    try:
        await channel.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=name,
        )
    except aio_pika.exceptions.DeliveryError:
        return None  # the queue holds one message already (x-overflow reject-publish)
    return deployment.id, deployment.database


def _parse_owner(body: bytes) -> tuple[str, str | None]:
    try:
        data = json.loads(body)
        return str(data["deployment"]), str(data.get("database") or "") or None
    except (ValueError, KeyError, TypeError):
        return "unreadable", None


async def _declare_owner_queue(channel: AbstractChannel, name: str) -> None:
    # Classic, not quorum: a quorum queue counts every nack(requeue) of the
    # peek towards a delivery limit (RabbitMQ 4 sets one by default) and would
    # drop the record. One message at most; a second record is refused.
    await channel.declare_queue(
        name,
        durable=True,
        arguments={"x-queue-type": "classic", "x-max-length": 1, "x-overflow": "reject-publish"},
    )


async def _exists(connection: AbstractConnection, kind: str, name: str) -> bool:
    try:
        async with _channel(connection) as channel:
            if kind == "exchange":
                await channel.get_exchange(name, ensure=True)
            else:
                await channel.get_queue(name, ensure=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    return True


@contextlib.asynccontextmanager
async def _channel(connection: AbstractConnection) -> AsyncIterator[AbstractChannel]:
    """A channel for one step; closed after it (if the broker has not closed it)."""
    channel = await connection.channel()
    try:
        yield channel
    finally:
        if not channel.is_closed:
            with contextlib.suppress(aiormq.exceptions.AMQPError, OSError):
                await channel.close()
