"""Two deployments on one vhost, with the same queue names, run every job of both.

Each deployment has its own database (and server, relay and worker). Their
workers receive each other's messages; a message of the other deployment is
handed back to the queue, never dead-lettered, and the shared topology is
reported at start.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import aio_pika
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.store.deployment import this_deployment
from jobplane.store.engine import create_engine
from jobplane.topology import Topology
from tests.support import services
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

_other = itertools.count(1)


@pytest.fixture
async def other_database(template_db: str, run_id: str) -> AsyncIterator[str]:
    """A second database cloned from the same template: another deployment."""
    name = f"jp_{run_id}_other{next(_other)}"
    await services.create_database(name, template=template_db)
    yield services.pg_url(name)
    await services.drop_database(name)


async def _failed_messages(amqp_url: str, topology: Topology) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(topology.failed_queue, passive=True)
        count = queue.declaration_result.message_count
        assert count is not None
        return count


async def test_two_deployments_on_one_vhost_run_all_their_jobs(
    engine: AsyncEngine,
    database_url: str,
    other_database: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    other_engine = create_engine(other_database, pool_size=10)
    started.callback(other_engine.dispose)
    ids = [await this_deployment(engine), await this_deployment(other_engine)]
    assert ids[0].id != ids[1].id  # cloned from one template, still two identities

    # A declares the topology first (it owns it) and has no worker yet.
    a = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    b = await started(start_stack(other_engine, other_database, amqp_url, topology))
    assert b.relay is not None and b.relay.ownership is not None
    assert b.worker is not None and b.worker.ownership is not None
    for ownership in (b.relay.ownership, b.worker.ownership):
        assert ownership.conflict
        assert ownership.owner_id == ids[0].id and ownership.ours.id == ids[1].id
    assert a.relay is not None and a.relay.ownership is not None
    assert not a.relay.ownership.conflict

    # Only B's worker consumes: A's messages reach it and must come back.
    a_client, b_client = a.client(), b.client()
    a_jobs = [await a_client.submit("demo.echo", {"of": "a", "i": i}) for i in range(5)]
    await eventually(lambda: _at_least(b, 5))
    await a.start_worker()
    b_jobs = [await b_client.submit("demo.echo", {"of": "b", "i": i}) for i in range(5)]
    a_jobs += [await a_client.submit("demo.echo", {"of": "a", "i": i}) for i in range(5, 10)]

    for client, jobs in ((a_client, a_jobs), (b_client, b_jobs)):
        for job in jobs:
            done = await asyncio.wait_for(client.wait(job.name), timeout=30)
            assert done.state is JobState.SUCCEEDED, done
    assert await _failed_messages(amqp_url, topology) == 0


async def _at_least(stack: Stack, bounced: int) -> bool:
    return stack.worker is not None and stack.worker.bounced >= bounced
