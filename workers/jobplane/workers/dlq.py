"""The failed (dead-letter) queue, for operators: list, replay, purge.

Messages land there when a worker rejects them before any state could be
written (not an envelope, unknown job) or when a quorum queue's delivery limit
is reached (a crash loop). Replay re-dispatches by job id through the outbox;
the message itself is never re-published.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractIncomingMessage
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.envelope import Envelope, EnvelopeError
from jobplane.store.sweeps import SweepStore
from jobplane.topology import Topology, declare


@dataclass(frozen=True, slots=True)
class FailedMessage:
    """One message in the failed queue, as an operator needs to see it."""

    message_id: str
    reason: str
    source_queue: str
    deaths: int
    envelope: Envelope | None
    problem: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        env = self.envelope
        return {
            "message_id": self.message_id,
            "reason": self.reason,
            "source_queue": self.source_queue,
            "deaths": self.deaths,
            "job": f"jobs/{env.job_id}" if env else None,
            "tenant_id": str(env.tenant_id) if env else None,
            "type": env.job_type if env else None,
            "problem": self.problem,
        }


@dataclass
class ReplayReport:
    """What a replay did with each message it took."""

    replayed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    #: Jobs that wait for other jobs (those they run after, their fan-out's
    #: children): their ends dispatch them; the message was stale, and dropped.
    waiting: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def describe(message: AbstractIncomingMessage) -> FailedMessage:
    """Read the envelope and the x-death header of a dead-lettered message."""
    deaths: Any = (message.headers or {}).get("x-death") or []
    first: dict[str, Any] = deaths[0] if deaths and isinstance(deaths[0], dict) else {}
    reason = str(first.get("reason", message.headers.get("x-first-death-reason", "")))
    source = str(first.get("queue", message.headers.get("x-first-death-queue", "")))
    count = sum(int(d.get("count", 1)) for d in deaths if isinstance(d, dict)) or 1
    try:
        envelope: Envelope | None = Envelope.decode(message.body)
        problem = ""
    except EnvelopeError as exc:
        envelope, problem = None, f"not a dispatch envelope: {exc}"
    return FailedMessage(
        message_id=message.message_id or "",
        reason=reason,
        source_queue=source,
        deaths=count,
        envelope=envelope,
        problem=problem,
    )


class FailedQueue:
    """Operator access to the topology's failed queue."""

    def __init__(self, amqp_url: str, topology: Topology) -> None:
        self._amqp_url = amqp_url
        self._topology = topology

    async def list(self, limit: int = 100) -> list[FailedMessage]:
        """Up to ``limit`` messages; they stay in the queue."""
        connection = await broker.connect(self._amqp_url)
        async with connection:
            channel = await connection.channel()
            await declare(channel, self._topology)
            queue = await channel.get_queue(self._topology.failed_queue)
            seen = []
            for _ in range(limit):
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                seen.append(describe(message))
            # Closing the channel without acks puts every message back.
            await channel.close()
        return seen

    async def replay(
        self,
        engine: AsyncEngine,
        limit: int = 100,
        *,
        tenant: uuid.UUID | None = None,
        jobs: frozenset[uuid.UUID] | None = None,
    ) -> ReplayReport:
        """Re-dispatch the jobs of up to ``limit`` messages through the outbox.

        A message is acked when its job was re-dispatched, has already
        ended, or waits for other jobs to end (their ends dispatch it, so
        the message is stale); one that names no job, or a job a live
        attempt holds, is kept.
        With ``tenant`` (and ``jobs``), only the messages of that tenant's
        jobs (of those jobs) are replayed; the others are left in the queue
        untouched and not reported.
        """
        store = SweepStore(engine)
        report = ReplayReport()
        connection = await broker.connect(self._amqp_url)
        async with connection:
            channel = await connection.channel()
            await declare(channel, self._topology)
            queue = await channel.get_queue(self._topology.failed_queue)
            for _ in range(limit):
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                failed = describe(message)
                env = failed.envelope
                if tenant is not None and (
                    env is None
                    or env.tenant_id != tenant
                    or (jobs is not None and env.job_id not in jobs)
                ):
                    continue  # not the caller's: back in the queue when the channel closes
                if env is None:
                    report.kept.append(failed.message_id or "(no id)")
                    continue
                name = f"jobs/{env.job_id}"
                job = await store.redispatch(
                    env.tenant_id, env.job_id, "re-dispatched from the failed queue"
                )
                if job is not None:
                    await message.ack()
                    report.replayed.append(name)
                    continue
                state = await store.state_of(env.tenant_id, env.job_id)
                if state in ("succeeded", "failed", "cancelled"):
                    await message.ack()
                    report.finished.append(name)
                elif await store.waits_for_jobs(env.tenant_id, env.job_id):
                    await message.ack()
                    report.waiting.append(name)
                else:
                    report.kept.append(name)
            await channel.close()
        return report

    async def purge(self) -> int:
        """Drop every message; returns how many there were."""
        connection = await broker.connect(self._amqp_url)
        async with connection:
            channel = await connection.channel()
            await declare(channel, self._topology)
            queue = await channel.get_queue(self._topology.failed_queue)
            result = await queue.purge()
            return int(result.message_count or 0)
