"""Migration 0006 keeps every outbox row a dispatch, and the relay still publishes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from jobplane.store.keys import KeyStore
from jobplane.store.outbox import OutboxKind
from jobplane.topology import Topology
from jobplane.types import JobState
from tests.support import services
from tests.support.parts import Started
from tests.support.rows import insert_job
from tests.support.stack import start_stack


@pytest.fixture
async def old_database(run_id: str) -> AsyncIterator[str]:
    """A database migrated to 0005 only: the outbox as it was."""
    async with services.database_at(run_id, "0005") as url:
        yield url


async def test_rows_written_before_0006_stay_dispatches_and_run(
    old_database: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    engine = create_engine(old_database, pool_size=10)
    started.callback(engine.dispose)
    keys = KeyStore(engine)
    _key, tenant = await keys.create_key("acme")
    await keys.close()
    job_id, dispatch_id = await insert_job(engine, tenant, topology.queues[0].name, "demo.echo")
    await migrate(old_database, create=False)
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text("SELECT kind, job_id, exchange, body, headers FROM outbox WHERE id = :id"),
                {"id": dispatch_id},
            )
        ).one()
        default = await conn.scalar(
            text(
                "SELECT column_default FROM information_schema.columns "
                "WHERE table_name = 'outbox' AND column_name = 'kind'"
            )
        )
    assert tuple(row) == (OutboxKind.JOB_DISPATCH.value, job_id, None, None, {})
    # The database's default kind is the one the code names.
    assert default == f"'{OutboxKind.JOB_DISPATCH.value}'::text"

    stack = await started(start_stack(engine, old_database, amqp_url, topology))
    client = stack.client()
    done = await asyncio.wait_for(client.wait(f"jobs/{job_id}"), timeout=20)
    assert done.state is JobState.SUCCEEDED
