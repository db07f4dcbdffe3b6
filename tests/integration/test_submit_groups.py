"""Concurrent SubmitJob calls share a statement, and each keeps its own answer (ADR-0030)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient
from jobplane.errors import RequestIdReused
from jobplane.observe.metrics import Metrics
from jobplane.server import JobplaneServer
from jobplane.server.limits import TenantLimits
from jobplane.topology import Topology
from tests.integration.test_observability import samples
from tests.support.parts import Started
from tests.support.servers import Servers

CALLS = 60


@pytest.fixture
async def served(
    engine: AsyncEngine, database_url: str, topology: Topology, started: Started
) -> tuple[JobplaneServer, AsyncClient, Metrics]:
    metrics = Metrics()
    servers = await started(Servers(engine, database_url, topology))
    server = await servers.start(metrics=metrics, limits=TenantLimits(submits_per_second=0))
    key, _tenant = await server.keys.create_key("acme")
    return server, servers.client(server, key), metrics


async def _groups(metrics: Metrics) -> tuple[float, float]:
    """Submit statements written, and the calls in them."""
    found = samples((await metrics.exposition()).decode())
    count = sum(v for (n, _), v in found.items() if n == "jobplane_submit_group_size_count")
    total = sum(v for (n, _), v in found.items() if n == "jobplane_submit_group_size_sum")
    return count, total


async def test_concurrent_calls_share_statements_and_each_gets_its_own_job(
    served: tuple[JobplaneServer, AsyncClient, Metrics],
) -> None:
    _server, client, metrics = served
    jobs = await asyncio.gather(*(client.submit("demo.echo", {"n": i}) for i in range(CALLS)))
    assert [j.payload for j in jobs] == [{"n": i} for i in range(CALLS)]
    assert len({j.name for j in jobs}) == CALLS
    statements, calls = await _groups(metrics)
    assert calls == CALLS
    # They came together: fewer statements than calls.
    assert statements < CALLS


async def test_a_refused_call_in_a_group_fails_alone(
    served: tuple[JobplaneServer, AsyncClient, Metrics],
) -> None:
    _server, client, metrics = served
    taken = await client.submit("demo.echo", {"first": True}, request_id="taken")
    before = await _groups(metrics)
    replay_id = f"replay-{uuid.uuid4().hex}"
    results = await asyncio.gather(
        *(client.submit("demo.echo", {"n": i}) for i in range(20)),
        # The same request_id for another request: refused, alone.
        client.submit("demo.echo", {"first": False}, request_id="taken"),
        # The same request as before: its job, not a new one.
        client.submit("demo.echo", {"first": True}, request_id="taken"),
        # One request sent twice at once: one job for both.
        client.submit("demo.echo", {"twice": True}, request_id=replay_id),
        client.submit("demo.echo", {"twice": True}, request_id=replay_id),
        *(client.submit("demo.echo", {"m": i}) for i in range(20)),
        return_exceptions=True,
    )
    ok, refused, again, once, twice = results[:20], results[20], results[21], *results[22:24]
    ok += results[24:]
    assert isinstance(refused, RequestIdReused)
    assert not isinstance(again, BaseException) and again.name == taken.name
    assert not isinstance(once, BaseException) and not isinstance(twice, BaseException)
    assert once.name == twice.name
    assert all(not isinstance(r, BaseException) for r in ok)
    assert len({r.name for r in ok if not isinstance(r, BaseException)}) == 40
    statements, calls = await _groups(metrics)
    assert calls - before[1] == len(results)
    assert statements - before[0] < len(results)
