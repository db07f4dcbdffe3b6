"""A RabbitMQ node lost under load: the three-node cluster of scripts/fleet/rabbitmq.sh.

Relay and workers are real processes (tests/faults/cluster.py) naming the
three nodes in JOBPLANE_AMQP_URL. Under load the node that leads the work
queue is SIGKILLed; the run is judged as the fault suite judges: nothing
lost (L), nothing run twice (D, and each job completed by one attempt only),
every watcher's events in order (O); then dead-lettering is checked through
the survivors. The pause — the longest gap between job completions from the
kill on — is printed::

    make fleet-rabbitmq
    pytest -m fleet -s tests/fleet/test_rabbit_cluster.py
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import aio_pika
import pytest

from jobplane import broker
from jobplane.topology import Topology, apply, load_topology
from tests.faults.cluster import Cluster
from tests.faults.test_faults import _check_watchers, _each_ran_once, _watch_sample
from tests.fleet import rabbit_nodes
from tests.fleet.rabbit_nodes import NODES, setting

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(600)]

JOBS = 300
#: Each job's handler time: the load runs for several seconds on two workers.
MS = 300


@pytest.fixture(scope="module")
def rabbit_cluster() -> None:
    """The three nodes, started and clustered if they are not."""
    rabbit_nodes.start()
    assert sorted(rabbit_nodes.running_nodes()) == list(NODES)


@pytest.fixture
def vhost(rabbit_cluster: None) -> Iterator[str]:
    """A vhost of the test's own on the cluster; after it, every node runs again."""
    name = f"jp_fleet_{uuid.uuid4().hex[:8]}"
    rabbit_nodes.create_vhost(name)
    yield name
    rabbit_nodes.start()  # a node the test killed comes back and rejoins
    rabbit_nodes.delete_vhost(name)


@pytest.fixture
async def mq_fleet(database_url: str, vhost: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The fault suite's processes on the test database and the cluster's vhost."""
    topology = load_topology().prefixed("fleet.")
    running = Cluster(database_url, setting(NODES, vhost), topology, tmp_path)
    await running.prepare()
    yield running
    await running.close()


async def test_losing_the_node_that_leads_the_work_queue(mq_fleet: Cluster, vhost: str) -> None:
    fleet = mq_fleet
    topology = fleet.topology
    work = topology.queues[0].name
    await fleet.server()  # declares the topology: quorum queues on all three nodes
    for name in (work, topology.failed_queue):
        assert sorted(rabbit_nodes.queue(vhost, name)["members"]) == list(NODES), name
    leader = rabbit_nodes.queue(vhost, work)["leader"]
    others = [n for n in NODES if n != leader]
    # The relay and one worker on the leader's node, the other worker on another.
    on_leader = replace(fleet, amqp_url=setting([leader, *others], vhost))
    relay = await on_leader.relay()
    moving = await on_leader.worker("--concurrency", "8")
    await replace(fleet, amqp_url=setting([*others, leader], vhost)).worker("--concurrency", "8")
    # The relay's and the first worker's (the API's listing lags by seconds).
    await _until(lambda: _connections_on(vhost, leader) >= 2, "two connections on the leader")

    async with fleet.client() as client:
        names = await fleet.submit_many(client, JOBS // 2, ms=MS)
        seen, tasks = await _watch_sample(fleet, client, names)
        # Submitted while the node dies: the relay publishes them around the kill.
        more = asyncio.create_task(fleet.submit_many(client, JOBS - JOBS // 2, ms=MS))
        await _until_succeeded(fleet, JOBS // 5)
        killed_at = await _database_now(fleet)
        rabbit_nodes.kill(leader)
        names += await more
        await fleet.wait_all_terminal(names, timeout=120)
        counts = await fleet.check(names)  # L and D
        await _each_ran_once(fleet, JOBS)
        await _check_watchers(client, seen, tasks)  # O
    assert counts == {"jobs": JOBS, "effects": JOBS}

    survivors = tuple(others)
    moved = rabbit_nodes.queue(vhost, work, nodes=survivors)
    assert moved["leader"] in survivors
    await _until(lambda: _connections_on(vhost, leader, nodes=survivors) == 0, "none on it")
    await _dead_lettering_works(setting(survivors, vhost), topology, vhost, survivors)

    pause, before = await _pause(fleet, names, killed_at)
    relay_back = _first_after(relay.log, "relay.connected", killed_at)
    worker_back = _first_after(moving.log, "broker.reconnected", killed_at)
    print(
        f"\nRabbitMQ leader {leader} SIGKILLed under load ({JOBS} jobs of {MS} ms, two "
        f"workers x 8): longest gap between completions from the kill on {pause:.2f} s "
        f"(before the kill: {before:.2f} s); the relay published again after "
        f"{relay_back:.2f} s, its worker consumed again after {worker_back:.2f} s; "
        f"new leader {moved['leader']}"
    )


def _first_after(log: Path, event: str, since: datetime) -> float:
    """Seconds from ``since`` to the first ``event`` a process logged after it."""
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, rest = line.partition(" ")
        if event not in rest:
            continue
        with contextlib.suppress(ValueError):
            at = datetime.fromisoformat(stamp)
            if at > since:
                return (at - since).total_seconds()
    raise AssertionError(f"no {event} after {since} in {log.name}")


async def _until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.5)


def _connections_on(vhost: str, node: str, *, nodes: tuple[str, ...] = NODES) -> int:
    listing = rabbit_nodes.api("GET", f"vhosts/{vhost}/connections", nodes=nodes)
    return sum(1 for c in listing if c.get("node") == node)


async def _until_succeeded(fleet: Cluster, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = await fleet.query("SELECT count(*) AS n FROM jobs WHERE state = 'succeeded'")
        if rows[0]["n"] >= count:
            return
        assert time.monotonic() < deadline, f"{rows[0]['n']} of {count} jobs succeeded"
        await asyncio.sleep(0.05)


async def _database_now(fleet: Cluster) -> datetime:
    rows = await fleet.query("SELECT clock_timestamp() AS now")
    now: datetime = rows[0]["now"]
    return now


async def _pause(fleet: Cluster, names: list[str], killed_at: datetime) -> tuple[float, float]:
    """The longest gap between completions from the last one before the kill on,
    and the longest before it (for comparison)."""
    ids = [uuid.UUID(n.partition("/")[2]) for n in names]
    rows = await fleet.query(
        "SELECT end_time FROM jobs WHERE id = ANY($1::uuid[]) ORDER BY end_time", ids
    )
    ends = [r["end_time"] for r in rows]
    earlier = [t for t in ends if t <= killed_at]
    later = [t for t in ends if t > killed_at]
    after = [*earlier[-1:], *later]
    pause = max((b - a).total_seconds() for a, b in itertools.pairwise(after))
    before = max(
        ((b - a).total_seconds() for a, b in itertools.pairwise(earlier)),
        default=0.0,
    )
    return pause, before


async def _dead_lettering_works(
    amqp_url: str, topology: Topology, vhost: str, survivors: tuple[str, ...]
) -> None:
    """A message no worker can read goes to the failed queue, through the survivors."""
    connection = await broker.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(topology.exchange, ensure=False)
        await exchange.publish(
            aio_pika.Message(b"not an envelope", message_id="fleet-stray"),
            routing_key="fault.work",
            mandatory=True,
        )
    deadline = time.monotonic() + 60
    while True:
        failed = rabbit_nodes.queue(vhost, topology.failed_queue, nodes=survivors)
        if failed.get("messages", 0) >= 1:
            return
        assert time.monotonic() < deadline, f"nothing dead-lettered: {failed}"
        await asyncio.sleep(0.2)


async def test_the_topology_sets_the_quorum_group_size(vhost: str) -> None:
    # Two members of three nodes: the argument reaches the broker, for the
    # job queues and the failed queue alike.
    topology = replace(load_topology().prefixed("fleet.two."), quorum_group_size=2)
    await apply(setting(NODES, vhost), topology)
    for name in (topology.queues[0].name, topology.failed_queue):
        found = rabbit_nodes.queue(vhost, name)
        assert len(found["members"]) == 2, found
        assert found["arguments"]["x-quorum-initial-group-size"] == 2
