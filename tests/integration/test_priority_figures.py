"""The figures of ADR-0019, measured on the tests' topology (two high queues, one low).

Not part of ``make test`` (marker ``figures``): ``.venv/bin/python -m pytest
-m figures -s tests/integration/test_priority_figures.py`` prints one line per
variant — the scheduler as it is, without its reserve, and with strict
priority (no weighted turns).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.topology import Topology
from jobplane.workers import priority
from tests.support import services
from tests.support.parts import Started
from tests.support.priorities import CONCURRENCY, Board, mixed_topology, submit
from tests.support.stack import eventually, start_stack

pytestmark = pytest.mark.figures

VARIANTS = {
    "as-is": ({}, {}),
    "no-reserve": ({"reserve": 0}, {}),
    "strict": ({}, {"high": 10**9}),
}


@pytest.fixture
async def priorities(amqp_url: str, topology: Topology) -> AsyncIterator[Topology]:
    mixed = mixed_topology(topology)
    yield mixed
    await services.delete_topology(amqp_url, mixed)


@pytest.fixture(params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    options, weights = VARIANTS[request.param]
    for cls, weight in weights.items():
        monkeypatch.setitem(priority.WEIGHTS, cls, weight)
    return request.param, options


async def test_high_wait_behind_long_low_jobs(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    priorities: Topology,
    variant: Any,
    started: Started,
) -> None:
    name, options = variant
    board = Board()
    stack = await started(start_stack(engine, database_url, amqp_url, priorities, worker=False))
    client = stack.client()
    await submit(client, "lo.work", 200)
    registry = board.registry({"high": 0.0, "low": 2.0})
    await stack.start_worker(registry, concurrency=CONCURRENCY, **options)

    async def full() -> bool:
        return board.running["low"] >= CONCURRENCY - 1

    await eventually(full, timeout=20)
    await asyncio.sleep(0.2)
    waits = []
    for job_type in ("hi.a.work", "hi.b.work") * 5:
        submitted = time.monotonic()
        (job,) = await submit(client, job_type, 1)

        async def began(job: str = job) -> bool:
            return job in board.started

        await eventually(began, timeout=30, interval=0.005)
        waits.append(board.started[job] - submitted)
        await asyncio.sleep(0.05)
    print(
        f"\nwait {name}: 10 high jobs behind 200 low ones of 2 s, concurrency {CONCURRENCY}: "
        f"submit -> start p50 {statistics.median(waits) * 1000:.0f} ms, "
        f"max {max(waits) * 1000:.0f} ms; handlers at once at most {board.peak}"
    )


async def test_low_share_under_a_stream_of_high_jobs(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    priorities: Topology,
    variant: Any,
    started: Started,
) -> None:
    name, options = variant
    board = Board()
    stack = await started(start_stack(engine, database_url, amqp_url, priorities, worker=False))
    client = stack.client()
    await submit(client, "lo.work", 300)
    await submit(client, "hi.a.work", 40)
    await submit(client, "hi.b.work", 40)
    registry = board.registry({"high": 0.03, "low": 0.03})
    await stack.start_worker(registry, concurrency=CONCURRENCY, **options)
    submitted, began = 80, time.monotonic()
    while time.monotonic() < began + 6.0:
        if submitted - sum(1 for cls, _ in board.starts if cls == "high") < 40:
            await submit(client, "hi.a.work", 10)
            await submit(client, "hi.b.work", 10)
            submitted += 20
        else:
            await asyncio.sleep(0.02)
    elapsed = time.monotonic() - began
    window = list(board.starts)
    high = sum(1 for cls, _ in window if cls == "high")
    low = len(window) - high
    print(
        f"\nshare {name}: 6 s of a high stream over 300 low jobs of 30 ms: starts "
        f"high {high}, low {low} (low {low / len(window):.0%}), "
        f"{len(window) / elapsed:.0f} starts/s; handlers at once at most {board.peak}"
    )
