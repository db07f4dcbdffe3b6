"""A worker process SIGKILLed while its job holds the only slot of a limit's
``max_running``: the slot is freed when the lease expires (the relay's sweeper
ends the attempt) and the job held behind it runs on the next worker.

Real processes (`serve`, `relay` with its sweeper, `worker`) on the test's
database and vhost; the topology file carries the ``[[rate_limits]]`` entry.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from jobplane.client import Job, JobState
from jobplane.topology import RateLimitSpec, Topology
from tests.faults.cluster import Cluster
from tests.support.stack import eventually

_LIMIT = RateLimitSpec("solo", ("fault.work",), max_running=1)


@pytest.fixture
async def cluster(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """Processes on this test's database and vhost, under one limit; all killed at the end."""
    running = Cluster(database_url, amqp_url, replace(topology, rate_limits=(_LIMIT,)), tmp_path)
    await running.prepare()
    yield running
    await running.close()


async def test_a_killed_worker_frees_its_slot_at_lease_expiry_and_the_held_job_runs(
    cluster: Cluster,
) -> None:
    await cluster.server()
    await cluster.relay()
    # A lease long enough that a busy machine's late heartbeat cannot end the
    # attempt before the kill: only the kill may free the slot.
    worker = await cluster.worker(lease=6.0)
    async with cluster.client() as client:
        # Its one attempt runs for ten minutes: only the lease's expiry can end it.
        holder = await client.submit("fault.work", {"ms": 600_000}, max_attempts=1)

        async def holding() -> bool:
            return (await client.get(holder.name)).state is JobState.RUNNING

        await eventually(holding, timeout=30)
        waiting = await client.submit("fault.work", {"ms": 10})

        async def held(job: Job = waiting) -> bool:
            return (await client.get(job.name)).waiting_code == "RATE_LIMITED"

        await eventually(held, timeout=30)
        worker.kill()
        await worker.wait()
        assert (await client.get(waiting.name)).state is JobState.QUEUED
        await cluster.worker(lease=2.0)
        done = await client.wait(waiting.name, timeout=60)
        dead = await client.get(holder.name)
    assert done.state is JobState.SUCCEEDED, done
    assert dead.state is JobState.FAILED and dead.error is not None
    # Its last attempt's lease ran out: no attempt is left.
    assert dead.error.code == "ATTEMPTS_EXHAUSTED", dead.error
    # The slot was the holder's until its attempt ended: one RUNNING at a time.
    (row,) = await cluster.query(
        "SELECT h.end_time <= w.start_time AS after FROM jobs h, jobs w "
        "WHERE h.id = $1 AND w.id = $2",
        uuid.UUID(holder.id),
        uuid.UUID(waiting.id),
    )
    assert row["after"], row
