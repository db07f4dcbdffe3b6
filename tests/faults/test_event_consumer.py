"""A consumer process killed around its commit: after a restart each event is applied once.

The consumer runs in a process of its own with a fault point armed that ends
it with ``os._exit`` (as SIGKILL would: no ack, nothing flushed). Killed
after its commit, the event's side effect and inbox row are there and the
message comes back: the restarted consumer acks it without running the
handler. Killed before its commit, nothing is there: the restarted consumer
applies it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.events import Consumer, Event
from tests.support.events import effects, event, inbox_rows, prepare, publish, record_effect
from tests.support.queues import ready_count
from tests.support.stack import eventually

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("point", "committed"),
    [("events.consumer.after_commit", True), ("events.consumer.before_commit", False)],
)
async def test_a_consumer_killed_around_its_commit_applies_the_event_once(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    tmp_path: Path,
    point: str,
    committed: bool,
) -> None:
    await prepare(engine)
    prefix = f"kill-{uuid.uuid4().hex[:8]}."
    exchange, name = f"{prefix}jobplane.events", f"{prefix}consumer"
    calls: list[uuid.UUID] = []

    async def counted(got: Event, conn: AsyncConnection) -> None:
        calls.append(got.event_id)
        await record_effect(got, conn)

    def consumer() -> Consumer:
        return Consumer(
            name,
            counted,
            engine=engine,
            amqp_url=amqp_url,
            patterns=["job.*"],
            exchange=exchange,
            retry_delay=0.0,
        )

    # Declared and bound first, so the event waits in the queue for the process.
    async with consumer():
        pass
    sent = event("job.succeeded")
    log = tmp_path / "consumer.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.faults.event_consumer",
            database_url,
            amqp_url,
            exchange,
            name,
            "job.*",
            cwd=ROOT,
            env={**os.environ, "JOBPLANE_FAULTS": f"crash:{point}"},
            stdout=out,
            stderr=out,
        )
        try:
            await publish(amqp_url, exchange, [sent])
            code = await asyncio.wait_for(process.wait(), timeout=60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert code == 137, log.read_text()[-2000:]

    expected = [(sent.event_id, "job.succeeded")] if committed else []
    assert await effects(engine) == expected
    assert await inbox_rows(engine, name) == [e for e, _ in expected]
    # Never acked: the broker holds it again for the next consumer.
    await eventually(lambda: _ready_is(amqp_url, name, 1))

    async with consumer() as restarted:
        await eventually(lambda: _true(restarted.counts.applied + restarted.counts.duplicates == 1))
        assert (restarted.counts.applied, restarted.counts.duplicates) == (
            (0, 1) if committed else (1, 0)
        )
    assert calls == ([] if committed else [sent.event_id])
    assert await effects(engine) == [(sent.event_id, "job.succeeded")]
    assert await inbox_rows(engine, name) == [sent.event_id]
    assert await ready_count(amqp_url, name) == 0


async def _true(value: bool) -> bool:
    return value


async def _ready_is(amqp_url: str, queue: str, count: int) -> bool:
    return await ready_count(amqp_url, queue) == count
