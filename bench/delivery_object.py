"""CPU per delivery of the worker's message object: aio-pika's ``IncomingMessage``
against :class:`~jobplane.workers.inbound.Delivery`, built from one aiormq
``DeliveredMessage`` shaped like a dispatch (ADR-0055).

    python -m bench.delivery_object [--count N] [--rounds R]

Each round builds ``N`` of each in turn and prints the process CPU time of
one, which the machine's load does not inflate as it does a wall clock.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiormq
from aio_pika.message import IncomingMessage
from aiormq.abc import DeliveredMessage
from pamqp.header import ContentHeader

from jobplane.workers.inbound import Delivery


class _Channel:
    is_closed = False


def dispatch_like() -> DeliveredMessage:
    """A delivery with a dispatch's properties: ids, type, timestamp, trace headers."""
    properties = aiormq.spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id="8f0c3a52-6f1e-4f43-9a55-1d1c6b7e2a10",
        correlation_id="c-1",
        timestamp=datetime(2026, 12, 7, tzinfo=UTC),
        message_type="job.dispatch",
        app_id="jobplane",
        headers={
            "x-jobplane-deployment": "d-1",
            "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        },
    )
    deliver = aiormq.spec.Basic.Deliver("ctag", 7, False, "jobplane.jobs", "demo.echo")
    channel: Any = _Channel()
    return DeliveredMessage(deliver, ContentHeader(0, 100, properties), b"x" * 100, channel)


def cpu_each(make: Callable[[], object], count: int) -> float:
    """Microseconds of process CPU time per call of ``make``."""
    started = time.process_time()
    for _ in range(count):
        make()
    return (time.process_time() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    message = dispatch_like()
    for round_ in range(1, args.rounds + 1):
        aio_pika = cpu_each(lambda: IncomingMessage(message), args.count)
        ours = cpu_each(lambda: Delivery(message, "q", "normal"), args.count)
        print(f"round {round_}: IncomingMessage {aio_pika:.2f} µs, Delivery {ours:.2f} µs CPU each")


if __name__ == "__main__":
    main()
