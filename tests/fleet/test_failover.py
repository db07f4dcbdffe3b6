"""The Postgres leader changes under load: judged as the fault suite judges (L, D, O).

A switchover, a killed postmaster (Patroni restarts it) and a lost leader
node (its Patroni and postmaster killed: the standby takes over once the
leader key expires). Every process reaches the pair through the multi-host
URL with ``target_session_attrs=read-write``; none may die, every refused
call must have been UNAVAILABLE, and the time to the first successful
submit is printed (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from jobplane.client import AsyncClient
from tests.faults.cluster import Cluster
from tests.fleet import patroni
from tests.fleet.load import Codes, Load, check_watches, survivors, until, watch_all

pytestmark = pytest.mark.fleet

SUBMITTERS = 4


async def failover_under_load(
    cluster: Cluster, label: str, disrupt: Callable[[], patroni.Failover], *, same_ok: bool
) -> patroni.Failover:
    await cluster.server()
    await cluster.relay()
    for _ in range(2):
        await cluster.worker("--concurrency", "8")
    codes = Codes()
    load = Load()
    async with AsyncClient(cluster.address, cluster.key, interceptors=[codes]) as client:
        submitters = [asyncio.create_task(load.submitter(client, k)) for k in range(SUBMITTERS)]
        await until(lambda: len(load.names) >= 60, what="the first submits")
        seen, watches = await watch_all(client, load.names[-10:])
        failover = await asyncio.to_thread(disrupt)
        await patroni.wait_new_leader(failover, same_ok=same_ok)
        assert failover.leader_at is not None
        await until(lambda: load.ok_after(failover.leader_at or 0) >= 60, what="submits after")
        load.stop.set()
        await asyncio.gather(*submitters)
        await cluster.wait_all_terminal(load.names, timeout=120)
        counts = await cluster.check(load.names)  # L, D, O as stored
        await check_watches(client, seen, watches)  # O on the streams
    refused = codes.refusals()
    led = (
        f"new leader after {failover.leader_at - failover.started:.2f} s"
        if failover.new_leader != failover.old_leader
        else "same leader"
    )
    print(
        f"\n{label}: {failover.old_leader} -> {failover.new_leader}; {led}; "
        f"first submit begun after the "
        f"disruption ok after {load.first_ok_after(failover.started):.2f} s; longest "
        f"submit {load.longest():.2f} s; {counts['jobs']} jobs; refusals {refused}"
    )
    assert set(refused) <= {grpc.StatusCode.UNAVAILABLE.name}, refused
    assert not survivors(cluster), survivors(cluster)
    return failover


async def test_switchover_under_load(fleet_cluster: Cluster) -> None:
    failover = await failover_under_load(
        fleet_cluster, "switchover", patroni.switchover, same_ok=False
    )
    assert failover.new_leader != failover.old_leader


async def test_killed_postmaster_under_load(fleet_cluster: Cluster) -> None:
    await failover_under_load(
        fleet_cluster,
        "killed postmaster",
        lambda: patroni.kill_leader(node_too=False),
        same_ok=True,
    )


async def test_lost_leader_node_under_load(fleet_cluster: Cluster) -> None:
    lost: list[str] = []

    def disrupt() -> patroni.Failover:
        failover = patroni.kill_leader(node_too=True)
        lost.append(failover.old_leader)
        return failover

    try:
        failover = await failover_under_load(
            fleet_cluster, "lost leader node", disrupt, same_ok=False
        )
        assert failover.new_leader != failover.old_leader
    finally:
        for node in lost:
            await asyncio.to_thread(patroni.restart_node, node)
        started = time.monotonic()
        await patroni.wait_healthy()
        print(f"{lost} back as the synchronous standby after {time.monotonic() - started:.1f} s")
