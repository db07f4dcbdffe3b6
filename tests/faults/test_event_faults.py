"""Faults on the event path, injected into real processes and services.

Each run publishes events (by PublishEvent and in callers' transactions)
alongside jobs, breaks something while they flow, and is judged by L/D/O
for the jobs (tests/faults/cluster.py) and P/A/O for the events
(tests/faults/event_path.py): every committed event published at least
once, applied once by the inbox Consumer, streamed in commit order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from urllib.parse import urlsplit

import asyncpg
import pytest

from jobplane.store.engine import asyncpg_dsn
from jobplane.topology import Topology
from tests.faults.cluster import Cluster
from tests.faults.event_path import EventPath, event_path
from tests.faults.test_faults import _rabbitmqctl


@pytest.fixture
def topology(topology: Topology) -> Topology:
    """Every lifecycle event published: the judge counts the tap's copies of every event."""
    return replace(topology, publish_lifecycle=("job.#",))


@pytest.fixture
async def events(cluster: Cluster) -> AsyncIterator[EventPath]:
    path = await event_path(cluster)
    yield path
    await path.close()


async def _run(
    cluster: Cluster, events: EventPath, chaos: Callable[[], Awaitable[None]]
) -> dict[str, int]:
    """Jobs and events through the cluster while ``chaos`` runs; judged, and the counts."""
    async with cluster.client() as client:
        work = asyncio.gather(
            cluster.submit_many(client, 10, ms=50),
            events.publish_rpc(40),
            events.publish_in_transactions(20),
        )
        await chaos()
        names, _, _ = await work
        await cluster.wait_all_terminal(names, timeout=90)
        await cluster.check(names)
    await events.settle()
    counts, problems = await events.judge()
    assert not problems, "\n".join(problems[:20])
    assert counts["published"] == counts["acked"]
    assert counts["events"] == counts["applied"]
    return counts


async def test_relay_killed_mid_batch_while_publishing_events(
    cluster: Cluster, events: EventPath
) -> None:
    await cluster.server()
    await events.start()
    # A backlog first, so that the relay's first batch holds more than 40.
    await events.publish_rpc(60, prefix="backlog")
    relay = await cluster.relay(faults="crash:relay.event.confirmed@40")
    await cluster.worker("--concurrency", "4")

    async def chaos() -> None:
        # 40 events of the batch confirmed, the rest in flight, the position not moved.
        assert await relay.wait(timeout=60) == 137
        await cluster.relay()

    counts = await _run(cluster, events, chaos)
    # Published twice: the confirmed events the dead relay never moved past.
    assert counts["duplicates"] >= 40, counts
    assert counts["published"] == 120


async def test_broker_connections_cut_while_publishing_events(
    cluster: Cluster, events: EventPath
) -> None:
    vhost = urlsplit(cluster.amqp_url).path.lstrip("/")
    await cluster.server()
    await events.start()
    await cluster.relay()
    await cluster.worker("--concurrency", "4")

    async def chaos() -> None:
        for _ in range(2):
            await asyncio.sleep(0.7)
            listing = await asyncio.to_thread(_rabbitmqctl, "list_connections", "vhost", "pid")
            pids = [line.split()[1] for line in listing.splitlines() if line.split()[:1] == [vhost]]
            assert pids, listing
            for pid in pids:
                await asyncio.to_thread(_rabbitmqctl, "close_connection", pid, "fault test")

    counts = await _run(cluster, events, chaos)
    assert counts["published"] == 60


async def test_database_sessions_terminated_during_publish_event(
    cluster: Cluster, events: EventPath
) -> None:
    database = urlsplit(cluster.database_url).path.lstrip("/")
    await cluster.server()
    await events.start()
    await cluster.relay()
    await cluster.worker("--concurrency", "4")

    async def chaos() -> None:
        admin = await asyncpg.connect(asyncpg_dsn(cluster.database_url))
        try:
            for _ in range(3):
                await asyncio.sleep(0.5)
                # Every session: the server's mid-PublishEvent, the callers'
                # mid-transaction, the relay's, the consumer's and workers'.
                killed = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()",
                    database,
                )
                assert killed > 0
        finally:
            await admin.close()

    counts = await _run(cluster, events, chaos)
    assert counts["published"] == 60
