"""Every pool through PgBouncer in transaction pooling; LISTEN past it.

The server's, relay's and workers' pools reach the leader through PgBouncer
(``pgbouncer=true``), their LISTEN connections through
JOBPLANE_DATABASE_DIRECT_URL: submit, run and watch end to end, then the
fault suite's core scenario (workers SIGKILLed mid-handler) over the same path.
"""

from __future__ import annotations

import asyncio

import pytest

from jobplane.client import AsyncClient, JobState
from tests.faults.cluster import Cluster, check_stream
from tests.faults.test_faults import kill_workers_until_done
from tests.fleet import patroni
from tests.fleet.load import check_watches, survivors, through_bouncer, watch_all
from tests.fleet.test_failover import failover_under_load

pytestmark = pytest.mark.fleet


async def test_submit_run_and_watch_through_pgbouncer(bouncer_cluster: Cluster) -> None:
    cluster = bouncer_cluster
    await cluster.server()
    await cluster.relay()
    await cluster.worker("--concurrency", "8")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 50, ms=100)
        seen, watches = await watch_all(client, names[:10])
        await cluster.wait_all_terminal(names, timeout=90)
        counts = await cluster.check(names)
        await check_watches(client, seen, watches)
        job = await client.submit("fault.work", {"ms": 50}, request_id="one-more")
        ended = await asyncio.wait_for(client.wait(job.name), timeout=30)
        assert ended.state is JobState.SUCCEEDED
        events = [event async for event in client.watch(job.name)]
        check_stream(events, ended.last_seq)
    assert await through_bouncer(cluster) > 0  # the pools did go through PgBouncer
    assert not survivors(cluster), survivors(cluster)
    print(f"\nthrough PgBouncer: {counts['jobs'] + 1} jobs submitted, run and watched")


async def test_killed_workers_through_pgbouncer(bouncer_cluster: Cluster) -> None:
    cluster = bouncer_cluster
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "8") for _ in range(2)]
    async with AsyncClient(cluster.address, cluster.key) as client:
        names = await cluster.submit_many(client, 200, ms=300)
        seen, watches = await watch_all(client, names[:10])
        await kill_workers_until_done(cluster, workers, names, timeout=120)
        counts = await cluster.check(names)
        await check_watches(client, seen, watches)
    assert counts["effects"] == 200


async def test_switchover_under_load_through_pgbouncer(bouncer_cluster: Cluster) -> None:
    # Patroni's callback points PgBouncer at the new leader; the processes keep
    # their connections to PgBouncer and their LISTEN ones reconnect directly.
    failover = await failover_under_load(
        bouncer_cluster, "switchover through PgBouncer", patroni.switchover, same_ok=False
    )
    assert failover.new_leader != failover.old_leader
    assert await through_bouncer(bouncer_cluster) > 0
