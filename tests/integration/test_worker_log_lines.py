"""The Python worker's lifecycle lines, in-process on real Postgres and RabbitMQ.

docs/operations.md lists each event and its fields, and the fields bound to
every line of a delivery: ``job``, ``event_id``, ``tenant_id``,
``correlation_id`` (a fingerprint), ``queue``, ``exchange``, ``routing_key``,
``delivery_tag``, ``redelivered``, and after the claim ``request_id`` (a
fingerprint). tests/integration/test_observability.py reads them from a
``jobplane dev`` process; this test reads them from the worker's own code.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, MutableMapping
from dataclasses import replace
from typing import Any

import aio_pika
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.logs import fingerprint
from jobplane.names import job_name
from jobplane.topology import Topology
from jobplane.types import JobState
from jobplane.workers import delivery
from jobplane.workers.handlers import JobContext, PermanentError, Registry, RetryableError
from tests.support.logs import module_lines
from tests.support.stack import Stack, eventually, start_stack

Lines = list[MutableMapping[str, Any]]

registry = Registry()


@registry.handler("lines.ok")
async def _ok(ctx: JobContext) -> dict[str, Any]:
    return {"ok": True}


@registry.handler("lines.flaky")
async def _flaky(ctx: JobContext) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise RetryableError("not yet", delay=0.2, code="NOT_YET")
    return {"attempt": ctx.attempt}


@registry.handler("lines.bad")
async def _bad(ctx: JobContext) -> dict[str, Any]:
    raise PermanentError("no such report", code="BAD_INPUT")


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, delivery, "jobplane.worker") as captured:
        yield captured


async def test_each_attempt_logs_its_lines_with_the_deliverys_ids(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, lines: Lines
) -> None:
    stack = await start_stack(engine, database_url, amqp_url, topology, registry=registry)
    try:
        client = stack.client()
        submitted = {
            job_type: await client.submit(
                job_type, {}, correlation_id=f"order-{job_type}", request_id=f"req-{job_type}"
            )
            for job_type in ("lines.ok", "lines.flaky", "lines.bad")
        }
        ended = [(await client.wait(job.name, timeout=30)).state for job in submitted.values()]
        assert ended == [JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.FAILED]
        # A copy of a finished job's dispatch, and a message for no job of ours.
        copy = replace(
            await stack.envelope(submitted["lines.ok"].id), correlation_id="order-lines.ok"
        )
        stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "lines.ok")
        await _publish(stack, copy, stray)

        async def settled() -> bool:
            events = {line["event"] for line in lines}
            return {"job.message.duplicate", "job.message.unknown_job"} <= events

        await eventually(settled)
    finally:
        await stack.close()
    queue = topology.queues[0].name

    def of(job_type: str) -> list[tuple[str, dict[str, Any]]]:
        name = submitted[job_type].name
        return [
            (str(line["event"]), {k: v for k, v in line.items() if k != "event"})
            for line in lines
            # A delivery's lines (the relay's job.dispatched names the job too).
            if line.get("job") == name and "delivery_tag" in line
        ]

    for job_type in submitted:
        for event, fields in of(job_type):
            # Bound to every line of the delivery; the caller's ids by fingerprint only.
            assert fields["tenant_id"] == str(stack.tenant_id)
            assert fields["correlation_id"] == fingerprint(f"order-{job_type}")
            assert (fields["queue"], fields["routing_key"]) == (queue, job_type), event
            assert fields["exchange"] == topology.exchange
            assert isinstance(fields["delivery_tag"], int) and fields["redelivered"] is False
            uuid.UUID(fields["event_id"])
            assert f"order-{job_type}" not in str(fields) and f"req-{job_type}" not in str(fields)
            if event.startswith("job.") and not event.startswith("job.message."):
                # Bound once the claim names the attempt.
                assert fields["request_id"] == fingerprint(f"req-{job_type}"), event

    def events(job_type: str) -> list[tuple[str, dict[str, Any]]]:
        wanted = ("attempt", "type", "code", "error", "delay", "offloaded")
        return [
            (event, {k: v for k, v in fields.items() if k in wanted})
            for event, fields in of(job_type)
            if event.startswith("job.") and not event.startswith("job.message.")
        ]

    assert events("lines.ok") == [
        ("job.received", {"attempt": 1, "type": "lines.ok"}),
        ("job.started", {"attempt": 1, "type": "lines.ok"}),
        ("job.completed", {"attempt": 1, "offloaded": False}),
    ]
    assert events("lines.flaky") == [
        ("job.received", {"attempt": 1, "type": "lines.flaky"}),
        ("job.started", {"attempt": 1, "type": "lines.flaky"}),
        (
            "job.retry_scheduled",
            {"attempt": 1, "delay": 0.2, "code": "NOT_YET", "error": "not yet"},
        ),
        ("job.received", {"attempt": 2, "type": "lines.flaky"}),
        ("job.started", {"attempt": 2, "type": "lines.flaky"}),
        ("job.completed", {"attempt": 2, "offloaded": False}),
    ]
    assert events("lines.bad") == [
        ("job.received", {"attempt": 1, "type": "lines.bad"}),
        ("job.started", {"attempt": 1, "type": "lines.bad"}),
        ("job.failed", {"attempt": 1, "code": "BAD_INPUT", "error": "no such report"}),
    ]
    (duplicate,) = [line for line in lines if line["event"] == "job.message.duplicate"]
    assert (duplicate["job"], duplicate["status"], duplicate["log_level"]) == (
        submitted["lines.ok"].name,
        "finished",
        "info",
    )
    (unknown,) = [line for line in lines if line["event"] == "job.message.unknown_job"]
    assert (unknown["job"], unknown["event_id"], unknown["log_level"]) == (
        job_name(stray.job_id),
        str(stray.event_id),
        "error",
    )


async def _publish(stack: Stack, *envelopes: Envelope) -> None:
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(stack.topology.exchange)
        for envelope in envelopes:
            await exchange.publish(
                aio_pika.Message(envelope.encode(), message_id=str(envelope.event_id)),
                routing_key=envelope.job_type,
            )
