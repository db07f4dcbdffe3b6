"""The Node consumer of docs/events.md applies each event once (``make events-node``).

Not part of ``make test``: it needs Node and the example's npm packages,
which ``make events-node`` installs first.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.events import event, inbox_rows, publish, take_all
from tests.support.queues import ready_count
from tests.support.stack import eventually

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "events" / "node"

pytestmark = pytest.mark.node


async def test_the_node_example_applies_each_event_once(
    engine: AsyncEngine, database_url: str, amqp_url: str
) -> None:
    node = shutil.which("node")
    assert node is not None, "Node is needed (make events-node)"
    assert (EXAMPLE / "node_modules").is_dir(), "run `make events-node` (it installs the example)"
    prefix = f"node-{uuid.uuid4().hex[:8]}."
    exchange, consumer = f"{prefix}jobplane.events", f"{prefix}consumer"
    process = await asyncio.create_subprocess_exec(
        node,
        "consumer.mjs",
        cwd=EXAMPLE,
        env={
            **os.environ,
            "AMQP_URL": amqp_url,
            "DATABASE_URL": database_url,
            "EXCHANGE": exchange,
            "CONSUMER": consumer,
            "PATTERNS": "job.*",
        },
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        started = json.loads(await asyncio.wait_for(process.stdout.readline(), timeout=30))
        assert started["event"] == "events.consumer.started"
        sent = event("job.succeeded", answer=42)
        other = event("artifact.created")
        await publish(amqp_url, exchange, [sent, ("job.failed", b"not an event"), other, sent])
        outcomes = [
            json.loads(await asyncio.wait_for(process.stdout.readline(), timeout=30))["event"]
            for _ in range(2)
        ]
        assert outcomes == ["event.applied", "event.duplicate"]
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT event_id, payload FROM event_log"))).all()
        assert [(row[0], row[1]) for row in rows] == [(sent.event_id, {"answer": 42})]
        assert await inbox_rows(engine, consumer) == [sent.event_id]
        await eventually(lambda: _ready_is(amqp_url, f"{consumer}.dead", 1))
        [dead] = await take_all(amqp_url, f"{consumer}.dead")
        assert dead.body == b"not an event"
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), timeout=30)


async def _ready_is(amqp_url: str, queue: str, count: int) -> bool:
    return await ready_count(amqp_url, queue) == count
