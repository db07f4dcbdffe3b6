"""The declarative RabbitMQ topology: exchange, queues, bindings, dead letters.

A topology is a TOML file (``JOBPLANE_TOPOLOGY``; ``topologies/default.toml``
when unset). The server uses it to refuse job types that no queue takes; the
relay publishes to its exchange; workers declare it and consume its queues.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}$")
_PATTERN = re.compile(r"^(\*|#|[a-z0-9_-]+)(\.(\*|#|[a-z0-9_-]+))*$")


class TopologyError(ValueError):
    """The topology file is not valid."""


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One quorum queue and the routing-key patterns bound to it."""

    name: str
    bindings: tuple[str, ...]
    delivery_limit: int = 5
    max_attempts: int = 3
    priority: str = "normal"
    # Defaults for jobs of this queue: attempt timeout, and the backoff of
    # retries (exponential from retry_base_delay, capped, with jitter).
    timeout_seconds: float = 3600.0
    retry_base_delay: float = 1.0
    retry_max_delay: float = 300.0

    def takes(self, routing_key: str) -> bool:
        """True when one of the bindings matches ``routing_key``."""
        return any(topic_matches(p, routing_key) for p in self.bindings)


@dataclass(frozen=True, slots=True)
class Topology:
    """Exchange, queues and dead-letter path of one deployment."""

    exchange: str = "jobplane.jobs"
    dead_letter_exchange: str = "jobplane.jobs.dlx"
    failed_queue: str = "jobplane.failed"
    queues: tuple[QueueSpec, ...] = field(default_factory=tuple)

    def route(self, job_type: str) -> QueueSpec | None:
        """The first queue that takes ``job_type``, or None."""
        for queue in self.queues:
            if queue.takes(job_type):
                return queue
        return None

    def queue(self, name: str) -> QueueSpec:
        """The queue called ``name``."""
        for queue in self.queues:
            if queue.name == name:
                return queue
        raise TopologyError(f"no queue named {name!r} in the topology")

    def prefixed(self, prefix: str) -> Topology:
        """The same topology with every exchange and queue name prefixed."""
        return replace(
            self,
            exchange=prefix + self.exchange,
            dead_letter_exchange=prefix + self.dead_letter_exchange,
            failed_queue=prefix + self.failed_queue,
            queues=tuple(replace(q, name=prefix + q.name) for q in self.queues),
        )


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more."""
    return _match(pattern.split("."), key.split("."))


def _match(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    if head in ("*", words[0]):
        return _match(rest, words[1:])
    return False


def parse_topology(data: dict[str, Any], *, source: str = "topology") -> Topology:
    """Build and check a :class:`Topology` from parsed TOML."""
    try:
        exchange = str(data.get("exchange", {}).get("name", "jobplane.jobs"))
        dead = data.get("dead_letter", {})
        queues = tuple(
            QueueSpec(
                name=str(q["name"]),
                bindings=tuple(str(b) for b in q.get("bindings", ["#"])),
                delivery_limit=int(q.get("delivery_limit", 5)),
                max_attempts=int(q.get("max_attempts", 3)),
                priority=str(q.get("priority", "normal")),
                timeout_seconds=float(q.get("timeout_seconds", 3600.0)),
                retry_base_delay=float(q.get("retry_base_delay", 1.0)),
                retry_max_delay=float(q.get("retry_max_delay", 300.0)),
            )
            for q in data.get("queues", [])
        )
        topology = Topology(
            exchange=exchange,
            dead_letter_exchange=str(dead.get("exchange", f"{exchange}.dlx")),
            failed_queue=str(dead.get("queue", "jobplane.failed")),
            queues=queues,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    _check(topology, source)
    return topology


def _check(topology: Topology, source: str) -> None:
    if not topology.queues:
        raise TopologyError(f"{source}: at least one queue is required")
    names = [topology.exchange, topology.dead_letter_exchange, topology.failed_queue]
    names += [q.name for q in topology.queues]
    for name in names:
        if not _NAME.match(name):
            raise TopologyError(f"{source}: {name!r} is not a valid exchange or queue name")
    if len({q.name for q in topology.queues}) != len(topology.queues):
        raise TopologyError(f"{source}: queue names must be unique")
    for queue in topology.queues:
        if not queue.bindings:
            raise TopologyError(f"{source}: queue {queue.name!r} has no bindings")
        for pattern in queue.bindings:
            if not _PATTERN.match(pattern):
                raise TopologyError(f"{source}: binding {pattern!r} is not a topic pattern")
        if queue.max_attempts < 1 or queue.delivery_limit < 1:
            raise TopologyError(
                f"{source}: queue {queue.name!r} needs max_attempts and delivery_limit >= 1"
            )
        if queue.timeout_seconds <= 0 or queue.retry_base_delay < 0:
            raise TopologyError(f"{source}: queue {queue.name!r} needs timeout_seconds > 0")
        if queue.retry_max_delay < queue.retry_base_delay:
            raise TopologyError(
                f"{source}: queue {queue.name!r} has retry_max_delay < retry_base_delay"
            )


def load_topology(path: Path | None = None) -> Topology:
    """Load ``path``, or the packaged default topology when None."""
    if path is None:
        text = resources.files("jobplane").joinpath("topologies/default.toml").read_text()
        source = "default topology"
    else:
        try:
            text = path.read_text()
        except OSError as exc:
            raise TopologyError(f"cannot read topology {path}: {exc}") from exc
        source = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    return parse_topology(data, source=source)


async def declare(channel: AbstractChannel, topology: Topology) -> AbstractExchange:
    """Declare everything idempotently; returns the jobs exchange.

    Queues are quorum queues: a bounded ``x-delivery-limit`` turns a crash loop
    into a dead letter, dead-lettered with the at-least-once strategy (which
    needs ``x-overflow=reject-publish``) so a message is never dropped between
    a queue and the failed queue.
    """
    exchange = await channel.declare_exchange(
        topology.exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )
    dlx = await channel.declare_exchange(
        topology.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    failed = await channel.declare_queue(
        topology.failed_queue, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await failed.bind(dlx, routing_key="")
    for spec in topology.queues:
        queue = await channel.declare_queue(
            spec.name,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delivery-limit": spec.delivery_limit,
                "x-dead-letter-exchange": topology.dead_letter_exchange,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            },
        )
        for pattern in spec.bindings:
            await queue.bind(exchange, routing_key=pattern)
    return exchange
