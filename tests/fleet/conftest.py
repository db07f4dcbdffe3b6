"""The fleet tests: make fleet's Postgres pair (and PgBouncer), a database per test."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from jobplane.store.engine import asyncpg_dsn, ensure_database, migrate
from jobplane.topology import Topology
from tests.faults.cluster import Cluster
from tests.fleet import patroni

_counter = itertools.count()


@pytest.fixture(scope="session")
def fleet() -> None:
    """The Postgres pair and PgBouncer, started if they do not run."""
    patroni.start()


@pytest.fixture
async def fleet_database(fleet: None, run_id: str) -> AsyncIterator[str]:
    """A fresh, migrated database on the pair (its name), once the pair is healthy."""
    await patroni.wait_healthy()
    name = f"jp_{run_id}_fleet{next(_counter)}"
    await ensure_database(patroni.direct_url(name))
    # A multi-host URL tries the standby first, and asyncpg gives up on a host
    # that lacks the database rather than trying the next: wait for the standby
    # to replay the CREATE DATABASE (synchronous commit waits for its flush only).
    for node in patroni.NODES:
        await patroni.wait_database(node, name)
    await migrate(patroni.direct_url(name), create=False)
    yield name
    await patroni.wait_healthy()
    admin = await asyncpg.connect(asyncpg_dsn(patroni.direct_url("postgres")))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def fleet_cluster(
    fleet_database: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The fault suite's processes, on the pair through the multi-host URL."""
    running = Cluster(patroni.direct_url(fleet_database), amqp_url, topology, tmp_path)
    await running.prepare()
    yield running
    await running.close()


@pytest.fixture
async def bouncer_cluster(
    fleet_database: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The same, every pool through PgBouncer; LISTEN and the tests' own reads direct."""
    running = Cluster(patroni.direct_url(fleet_database), amqp_url, topology, tmp_path)
    running.env["JOBPLANE_DATABASE_URL"] = patroni.bouncer_url(fleet_database)
    running.env["JOBPLANE_DATABASE_DIRECT_URL"] = patroni.direct_url(fleet_database)
    await running.prepare()
    yield running
    await running.close()
