"""`jobplane sweep` as its own process: it ticks recurring schedules and ends jobs
at their deadlines on their own clocks, as a relay's sweeper does, so `relay
--no-sweep` beside `sweep` (deploy/kubernetes) still runs every schedule and
deadline; and SIGTERM, a pod's stop, ends its loop.

Real processes (`serve`, `relay --no-sweep`, `sweep`) on the test's database
and vhost; the jobs table says which ticks ran.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from jobplane.client import JobState, Overlap
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.topology import Topology
from tests.faults.cluster import Cluster
from tests.support.stack import eventually


@pytest.fixture
async def cluster(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """Processes on this test's database and vhost; all killed at the end."""
    running = Cluster(database_url, amqp_url, topology, tmp_path)
    await running.prepare()
    yield running
    await running.close()


async def _runs(cluster: Cluster, schedule_id: str) -> int:
    rows = await cluster.query(
        "SELECT count(*) AS n FROM jobs WHERE labels->>$1 = $2",
        SCHEDULE_LABEL,
        f"schedules/{schedule_id}",
    )
    return int(rows[0]["n"])


async def test_a_schedule_ticks_with_relay_no_sweep_and_a_sweep_process(cluster: Cluster) -> None:
    await cluster.server()
    relay = await cluster.relay("--no-sweep")
    sweep = await cluster._spawn(["sweep", "--interval", "0.5"], "leases:")
    async with cluster.client() as client:
        # Every tick runs: no worker runs them, and SKIP would skip while one waits.
        await client.create_schedule(
            "fault.work",
            {"ms": 1},
            interval=1,
            schedule_id="every-second",
            overlap=Overlap.ALLOW_ALL,
        )

    async def two_runs() -> bool:
        return await _runs(cluster, "every-second") >= 2

    await eventually(two_runs, timeout=30, interval=0.2)
    (row,) = await cluster.query("SELECT runs FROM schedules WHERE id = 'every-second'")
    assert row["runs"] >= 2
    # The sweep process ticked them; the relay, without its sweeper, ticked none.
    assert "scheduler.ticked" in sweep.log.read_text()
    assert "scheduler.ticked" not in relay.log.read_text()


async def test_sweep_once_ticks_the_due_schedules(cluster: Cluster) -> None:
    await cluster.server()
    async with cluster.client() as client:
        await client.create_schedule("fault.work", {"ms": 1}, interval=3600, schedule_id="hourly")
    # Due now, rather than in an hour.
    await cluster.query(
        "UPDATE schedules SET next_tick = now(), next_run_time = now() WHERE id = 'hourly'"
    )
    once = await cluster._spawn(["sweep", "--once"], "leases:")
    assert await once.wait() == 0
    assert await _runs(cluster, "hourly") == 1


async def test_a_sweep_process_ends_a_job_at_its_deadline_between_its_passes(
    cluster: Cluster,
) -> None:
    await cluster.server()
    # Passes a minute apart: only the deadline loop can end the job in time.
    sweep = await cluster._spawn(["sweep", "--interval", "60"], "leases:")
    async with cluster.client() as client:
        job = await client.submit("fault.work", {"ms": 1}, deadline=timedelta(seconds=1))
        started = time.monotonic()
        done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 15  # its deadline and about a second
    assert sweep.alive


async def test_sigterm_ends_the_sweep_loop_between_passes(cluster: Cluster) -> None:
    sweep = await cluster._spawn(["sweep", "--interval", "60"], "leases:")
    sweep.kill(signal.SIGTERM)
    # Status 0 once its schedulers and pools are closed, not killed by the signal
    # (-15), nor waiting out the interval.
    assert await sweep.wait(timeout=15) == 0
