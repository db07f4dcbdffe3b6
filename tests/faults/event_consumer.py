"""A Consumer in a process of its own, for tests that kill it at a named point.

Usage: python -m tests.faults.event_consumer DATABASE_URL AMQP_URL EXCHANGE NAME PATTERN
(``JOBPLANE_FAULTS`` arms fault points, e.g. ``crash:events.consumer.after_commit``).
"""

from __future__ import annotations

import asyncio
import os
import sys

from jobplane.events import Consumer
from jobplane.faults import FaultPoints
from jobplane.logs import configure
from jobplane.store.engine import create_engine
from tests.support.events import record_effect


async def main(database_url: str, amqp_url: str, exchange: str, name: str, pattern: str) -> None:
    configure("info")
    engine = create_engine(database_url, pool_size=2)
    faults = FaultPoints(spec for spec in os.environ.get("JOBPLANE_FAULTS", "").split(",") if spec)
    consumer = Consumer(
        name,
        record_effect,
        engine=engine,
        amqp_url=amqp_url,
        patterns=[pattern],
        exchange=exchange,
        retry_delay=0.0,
        faults=faults,
    )
    try:
        await consumer.run()
    finally:
        await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
