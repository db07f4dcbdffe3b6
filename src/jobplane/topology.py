"""The declarative RabbitMQ topology: exchange, queues, bindings, dead letters.

A topology is a TOML file (``JOBPLANE_TOPOLOGY``; ``topologies/default.toml``
when unset). The server uses it to refuse job types that no queue takes; the
relay publishes job dispatches to its jobs exchange and domain events to its
events exchange (``[events] exchange``, ``jobplane.events`` by default: a
durable topic exchange with no queues of jobplane's own, each consuming
service binds its own); workers consume its queues.

``jobplane topology apply`` declares it (:func:`declare`, which needs the
RabbitMQ *configure* permission). Relays and workers only check it
(:func:`ensure`): passive declares, which need no permission at all, and a
declaration of what is missing, which works for an account that may
configure (``jobplane dev`` on a fresh vhost) and otherwise ends in one
:class:`TopologyMissing` line. Their accounts need no configure rights.
``jobplane serve`` reports SERVING only once the topology is there
(:func:`until_declared`: the same check, tried again until it passes), and
``jobplane dev`` applies the topology it runs, bindings included (:func:`apply`).

The topology also records its owner: a small classic queue (``<exchange>.owner``)
holding one message with the id of the deployment that declared it first.
Relays and workers of another deployment (another database) find a stranger's
id there and report the collision at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from jobplane import broker
from jobplane.broker import access_refused
from jobplane.config import check_log_prefix
from jobplane.names import is_job_type
from jobplane.topics import EVENTS_EXCHANGE, topic_matches

if TYPE_CHECKING:
    from jobplane.store.deployment import Deployment

log = structlog.get_logger("jobplane.topology")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}$")
_PATTERN = re.compile(r"^(\*|#|[a-z0-9_-]+)(\.(\*|#|[a-z0-9_-]+))*$")
#: A queue's ``priority``, highest first (what it means: jobplane.workers.priority).
PRIORITIES = ("high", "normal", "low")


class TopologyError(ValueError):
    """The topology file is not valid."""


class TopologyMissing(TopologyError):
    """Part of the topology is missing on the broker and this account may not declare it."""


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One quorum queue and the routing-key patterns bound to it."""

    name: str
    bindings: tuple[str, ...]
    delivery_limit: int = 5
    max_attempts: int = 3
    #: One of PRIORITIES: how a worker orders its slots (jobplane.workers.priority).
    priority: str = "normal"
    # Defaults for jobs of this queue: attempt timeout, and the backoff of
    # retries (exponential from retry_base_delay, capped, with jitter).
    timeout_seconds: float = 3600.0
    retry_base_delay: float = 1.0
    retry_max_delay: float = 300.0
    #: Put before the ``job.*`` log event names of this queue's jobs (``ingestion.``);
    #: empty: JOBPLANE_LOG_JOB_PREFIX's.
    log_prefix: str = ""

    def takes(self, routing_key: str) -> bool:
        """True when one of the bindings matches ``routing_key``."""
        return any(topic_matches(p, routing_key) for p in self.bindings)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of a pipeline: a job type of its own, on the queue that takes it."""

    name: str
    type: str
    queue: str
    max_attempts: int
    timeout_seconds: float
    #: The algorithm, model or configuration version of the stage; a stage's
    #: result is keyed by (job, stage, version).
    version: str = ""
    #: The stage's share of the job's progress, relative to the other stages.
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A named, versioned, ordered chain of stages, submitted as one job (ADR-0017)."""

    name: str
    stages: tuple[StageSpec, ...]
    version: str = ""

    def stage_index(self, name: str) -> int | None:
        """The index of the stage called ``name``, or None."""
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        return None


@dataclass(frozen=True, slots=True)
class Topology:
    """Exchange, queues, dead-letter path and pipelines of one deployment."""

    exchange: str = "jobplane.jobs"
    dead_letter_exchange: str = "jobplane.jobs.dlx"
    failed_queue: str = "jobplane.failed"
    queues: tuple[QueueSpec, ...] = field(default_factory=tuple)
    #: The topic exchange of domain events (routing key: the event type).
    events_exchange: str = EVENTS_EXCHANGE
    pipelines: tuple[PipelineSpec, ...] = field(default_factory=tuple)

    def pipeline(self, name: str) -> PipelineSpec | None:
        """The pipeline called ``name``, or None."""
        for pipeline in self.pipelines:
            if pipeline.name == name:
                return pipeline
        return None

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

    @property
    def owner_queue(self) -> str:
        """The queue that records which deployment owns this topology."""
        return f"{self.exchange}.owner"

    def prefixed(self, prefix: str) -> Topology:
        """The same topology with every exchange and queue name prefixed."""
        return replace(
            self,
            exchange=prefix + self.exchange,
            dead_letter_exchange=prefix + self.dead_letter_exchange,
            failed_queue=prefix + self.failed_queue,
            queues=tuple(replace(q, name=prefix + q.name) for q in self.queues),
            events_exchange=prefix + self.events_exchange,
            pipelines=tuple(
                replace(p, stages=tuple(replace(s, queue=prefix + s.queue) for s in p.stages))
                for p in self.pipelines
            ),
        )


def parse_topology(data: dict[str, Any], *, source: str = "topology") -> Topology:
    """Build and check a :class:`Topology` from parsed TOML."""
    try:
        exchange = str(data.get("exchange", {}).get("name", "jobplane.jobs"))
        dead = data.get("dead_letter", {})
        events = data.get("events", {})
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
                log_prefix=check_log_prefix(str(q.get("log_prefix", "")), "log_prefix"),
            )
            for q in data.get("queues", [])
        )
        topology = Topology(
            exchange=exchange,
            dead_letter_exchange=str(dead.get("exchange", f"{exchange}.dlx")),
            failed_queue=str(dead.get("queue", "jobplane.failed")),
            queues=queues,
            events_exchange=str(events.get("exchange", EVENTS_EXCHANGE)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    _check(topology, source)
    pipelines = tuple(
        _parse_pipeline(p, topology, source) for p in _tables(data, "pipelines", source)
    )
    _check_pipelines(topology, pipelines, source)
    return replace(topology, pipelines=pipelines)


_STAGE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}")
_STAGE_KEYS = frozenset({"name", "type", "version", "max_attempts", "timeout_seconds", "weight"})
_PIPELINE_KEYS = frozenset({"name", "version", "stages"})
#: Stages of one pipeline at most: each is a row written with the job.
MAX_STAGES = 32


def _tables(data: dict[str, Any], key: str, source: str) -> list[dict[str, Any]]:
    found = data.get(key, [])
    if not isinstance(found, list) or not all(isinstance(t, dict) for t in found):
        raise TopologyError(f"{source}: [[{key}]] must be an array of tables")
    return found


def _parse_pipeline(data: dict[str, Any], topology: Topology, source: str) -> PipelineSpec:
    name = data.get("name")
    if not isinstance(name, str) or not is_job_type(name):
        raise TopologyError(f"{source}: pipeline name {name!r} is not a valid job type")
    where = f"{source}: pipeline {name!r}"
    unknown = set(data) - _PIPELINE_KEYS
    if unknown:
        raise TopologyError(f"{where}: unknown keys {sorted(unknown)}")
    version = _version(data.get("version", ""), where)
    tables = _tables(data, "stages", where)
    if not tables:
        raise TopologyError(f"{where}: needs at least one [[pipelines.stages]]")
    if len(tables) > MAX_STAGES:
        raise TopologyError(f"{where}: has {len(tables)} stages, at most {MAX_STAGES}")
    stages = []
    for table in tables:
        unknown = set(table) - _STAGE_KEYS
        if unknown:
            raise TopologyError(f"{where}: stage with unknown keys {sorted(unknown)}")
        stage_name = table.get("name")
        if not isinstance(stage_name, str) or not _STAGE_NAME.fullmatch(stage_name):
            raise TopologyError(
                f"{where}: stage name {stage_name!r} must be a lowercase word "
                "(letters, digits, '_', '-'; at most 63)"
            )
        at = f"{where}: stage {stage_name!r}"
        job_type = table.get("type")
        if not isinstance(job_type, str) or not is_job_type(job_type):
            raise TopologyError(f"{at}: type {job_type!r} is not a valid job type")
        queue = topology.route(job_type)
        if queue is None:
            raise TopologyError(f"{at}: no queue takes its type {job_type!r}")
        try:
            max_attempts = int(table.get("max_attempts", queue.max_attempts))
            timeout = float(table.get("timeout_seconds", queue.timeout_seconds))
            weight = float(table.get("weight", 1.0))
        except (TypeError, ValueError) as exc:
            raise TopologyError(f"{at}: {exc}") from exc
        if not 1 <= max_attempts <= 1000:
            raise TopologyError(f"{at}: max_attempts must be 1..1000")
        if not 0.001 <= timeout <= 7 * 86400:
            raise TopologyError(f"{at}: timeout_seconds must be between 0.001 and 604800")
        if not 0 < weight <= 1e6:
            raise TopologyError(f"{at}: weight must be > 0 and at most 1e6")
        stages.append(
            StageSpec(
                name=stage_name,
                type=job_type,
                queue=queue.name,
                max_attempts=max_attempts,
                timeout_seconds=timeout,
                version=_version(table.get("version", ""), at),
                weight=weight,
            )
        )
    return PipelineSpec(name=name, stages=tuple(stages), version=version)


def _version(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or (value and not _VERSION.fullmatch(value)):
        raise TopologyError(
            f"{where}: version {value!r} must be up to 64 letters, digits and '._:+-'"
        )
    return value


def _check_pipelines(topology: Topology, pipelines: tuple[PipelineSpec, ...], source: str) -> None:
    names = [p.name for p in pipelines]
    if len(set(names)) != len(names):
        raise TopologyError(f"{source}: pipeline names must be unique")
    stage_types = {s.type for p in pipelines for s in p.stages}
    for pipeline in pipelines:
        if pipeline.name in stage_types:
            # A stage's dispatch would be taken for a new pipeline job's.
            raise TopologyError(f"{source}: pipeline {pipeline.name!r} is also the type of a stage")
        stage_names = [s.name for s in pipeline.stages]
        if len(set(stage_names)) != len(stage_names):
            raise TopologyError(f"{source}: pipeline {pipeline.name!r} has two stages of one name")


def _check(topology: Topology, source: str) -> None:
    if not topology.queues:
        raise TopologyError(f"{source}: at least one queue is required")
    names = [topology.exchange, topology.dead_letter_exchange, topology.failed_queue]
    names += [topology.events_exchange]
    names += [q.name for q in topology.queues]
    for name in names:
        if not _NAME.match(name):
            raise TopologyError(f"{source}: {name!r} is not a valid exchange or queue name")
    if topology.events_exchange in (topology.exchange, topology.dead_letter_exchange):
        # An event would reach the job queues bound with `#`, as a job.
        raise TopologyError(f"{source}: the events exchange must be an exchange of its own")
    if len({q.name for q in topology.queues}) != len(topology.queues):
        raise TopologyError(f"{source}: queue names must be unique")
    for queue in topology.queues:
        if not queue.bindings:
            raise TopologyError(f"{source}: queue {queue.name!r} has no bindings")
        for pattern in queue.bindings:
            if not _PATTERN.match(pattern):
                raise TopologyError(f"{source}: binding {pattern!r} is not a topic pattern")
        if queue.priority not in PRIORITIES:
            raise TopologyError(
                f"{source}: queue {queue.name!r} has priority {queue.priority!r}; "
                f"allowed: {', '.join(PRIORITIES)}"
            )
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


#: ``JOBPLANE_TOPOLOGY=builtin:NAME`` loads ``jobplane/topologies/NAME.toml``.
BUILTIN = "builtin:"


def load_topology(path: Path | None = None) -> Topology:
    """Load ``path``, or the packaged default topology when None.

    ``builtin:NAME`` is a topology shipped with jobplane (``default``, ``ingest``).
    """
    if path is not None and str(path).startswith(BUILTIN):
        name = str(path)[len(BUILTIN) :]
        shipped = resources.files("jobplane").joinpath("topologies")
        known = sorted(f.name[:-5] for f in shipped.iterdir() if f.name.endswith(".toml"))
        if name not in known:
            raise TopologyError(f"no built-in topology {name!r}; jobplane ships {', '.join(known)}")
        text = shipped.joinpath(f"{name}.toml").read_text()
        source = f"built-in topology {name}"
    elif path is None:
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
    a queue and the failed queue. The events exchange is a durable topic
    exchange with no arguments and no queues: consumers bind their own.
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
        topology.failed_queue, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await failed.bind(dlx, routing_key="")
    await _declare_owner_queue(channel, topology.owner_queue)
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
    """
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
