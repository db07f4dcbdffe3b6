"""Relay and worker run on an account without RabbitMQ configure rights.

The operator declares the topology once (`jobplane topology apply`, with an
account that may configure); relays and workers only check it. With the
topology absent they stop with one line saying what is missing and what to
run, instead of looping on ACCESS_REFUSED.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.broker import REFUSALS
from jobplane.client import JobState
from jobplane.topology import Topology, TopologyMissing, until_declared
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.relay import Relay
from jobplane.workers.runtime import Worker
from tests.faults.cluster import topology_toml
from tests.support import services
from tests.support.parts import Started
from tests.support.stack import start_stack


def _user(run_id: str) -> str:
    return f"jp_{run_id}_worker"


@pytest.fixture
def restricted_url(amqp_url: str, run_id: str) -> Iterator[str]:
    """A user of this run's vhost that may write and read, but configure nothing."""
    vhost = urlsplit(amqp_url).path.lstrip("/")
    url = services.create_user(
        _user(run_id), "s3cret", vhost, configure="^$", write=".*", read=".*"
    )
    # Reconnect soon after a closed connection (aio-pika waits 5 s by default).
    yield f"{url}?reconnect_interval=0.5"
    services.delete_user(_user(run_id))


async def jobplane(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # A process that loops instead of stopping fails the test here.
    _out, err = await asyncio.wait_for(process.communicate(), timeout=timeout)
    assert process.returncode is not None
    return process.returncode, err.decode()


def _env(database_url: str, amqp_url: str, topology_file: Path) -> dict[str, str]:
    return {
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_TOPOLOGY": str(topology_file),
        "JOBPLANE_LOG_LEVEL": "error",
    }


async def test_without_the_topology_relay_and_worker_stop_with_one_clear_line(
    engine: AsyncEngine,
    database_url: str,
    restricted_url: str,
    topology: Topology,
    tmp_path: Path,
) -> None:
    relay = Relay(engine, database_url, restricted_url, topology)
    with pytest.raises(TopologyMissing) as refused:
        await relay.start()
    message = str(refused.value)
    assert f"exchange {topology.exchange!r}" in message
    assert f"queue {topology.queues[0].name!r}" in message
    assert "jobplane topology apply" in message

    worker = Worker(engine, database_url, restricted_url, topology, demo_registry)
    with pytest.raises(TopologyMissing):
        await worker.start()

    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    for command in ("relay", "worker"):
        code, err = await jobplane(command, env=_env(database_url, restricted_url, path))
        assert code != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("error: the RabbitMQ topology is incomplete"), err
        assert "jobplane topology apply" in lines[0]


async def test_after_topology_apply_a_restricted_account_runs_jobs(
    run_id: str,
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    restricted_url: str,
    topology: Topology,
    tmp_path: Path,
    started: Started,
) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    # The restricted account cannot apply it...
    code, err = await jobplane("topology", "apply", env=_env(database_url, restricted_url, path))
    assert code == 1 and "ACCESS_REFUSED" in err, err
    # ...the administrator can.
    code, err = await jobplane("topology", "apply", env=_env(database_url, amqp_url, path))
    assert code == 0, err

    stack = await started(start_stack(engine, database_url, restricted_url, topology))
    client = stack.client()
    jobs = [await client.submit("demo.echo", {"i": i}) for i in range(3)]
    for job in jobs:
        done = await asyncio.wait_for(client.wait(job.name), timeout=20)
        assert done.state is JobState.SUCCEEDED
    assert stack.worker is not None and stack.worker.ownership is not None
    assert not stack.worker.ownership.conflict

    # Reconnecting restores channels and consumers without configure rights too.
    assert await asyncio.to_thread(services.close_connections_of, _user(run_id)) >= 2
    job = await client.submit("demo.echo", {"after": "reconnect"})
    done = await asyncio.wait_for(client.wait(job.name), timeout=30)
    assert done.state is JobState.SUCCEEDED


async def test_serve_stops_waiting_for_the_topology_at_a_refusal_waiting_cannot_mend(
    amqp_url: str, topology: Topology
) -> None:
    # serve waits (topology.unavailable) while the broker is down or the topology is
    # missing; a wrong password stays wrong, so it is raised (serve's one line).
    parts = urlsplit(amqp_url)
    wrong = urlunsplit(
        parts._replace(netloc=f"guest:not-the-password@{parts.hostname}:{parts.port}")
    )
    async with asyncio.timeout(60):
        with pytest.raises(REFUSALS):
            await until_declared(wrong, topology)
