"""serve, relay, worker and `keys` need only DML on jobplane's tables, the concurrency
keys' blocker function every claim names, and the sweeper's scheduler EXECUTE on
jobplane.submit_job besides (docs/security.md)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.store.engine import asyncpg_dsn, create_engine, migrate
from jobplane.store.keys import KeyStore
from jobplane.topology import Topology
from tests.support import services
from tests.support.parts import Started
from tests.support.servers import refused_within
from tests.support.stack import start_stack

_BLOCKER = "jobplane.concurrency_blocker(uuid, text, integer, uuid, timestamptz)"


@pytest.fixture
async def dml_url(database_url: str) -> AsyncIterator[str]:
    """The test database as a login role that may only read and write jobplane's rows."""
    role = f"jp_dml_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        await admin.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        # What docs/security.md tells operators to run.
        await admin.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"'
        )
        await admin.execute(f'REVOKE ALL ON alembic_version FROM "{role}"')
        # Every claim names jobplane's functions (ADR-0040, ADR-0043).
        await admin.execute(f'GRANT USAGE ON SCHEMA jobplane TO "{role}"')
        await admin.execute(f'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA jobplane TO "{role}"')
        yield make_url(database_url).set(username=role).render_as_string(hide_password=False)
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def test_the_processes_run_with_a_dml_only_role(
    dml_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    engine: AsyncEngine = create_engine(dml_url, pool_size=4)
    started.callback(engine.dispose)
    # The role really is limited: no DDL.
    async with engine.connect() as conn:
        with pytest.raises(ProgrammingError, match="permission denied"):
            await conn.execute(text("CREATE TABLE intruder (id int)"))
    stack = await started(start_stack(engine, dml_url, amqp_url, topology))
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 2, "interval_ms": 10})
    events = [e async for e in client.watch(job.name)]
    assert events[-1].state is JobState.SUCCEEDED
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    # A job with a concurrency key: the claim's guard calls jobplane.concurrency_blocker.
    keyed = await client.submit("demo.echo", {}, concurrency_key="k")
    assert (await asyncio.wait_for(client.wait(keyed.name), timeout=20)).state is (
        JobState.SUCCEEDED
    )
    # Key administration too: revoke notifies the server.
    keys = KeyStore(engine)
    created = await keys.create("other")
    await stack.client(created.key).list()
    await keys.revoke(created.key_id)
    assert await refused_within(stack.client(created.key), 1.0)


async def test_the_sweepers_early_analyze_leaves_tables_it_does_not_own(
    dml_url: str, engine: AsyncEngine
) -> None:
    from jobplane.store.sweeps import SweepStore

    async with engine.begin() as conn:  # as the owner
        await conn.execute(text("CREATE TABLE t_owned (id int) WITH (autovacuum_enabled = false)"))
        await conn.execute(text("INSERT INTO t_owned SELECT generate_series(1, 2000)"))
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        await conn.commit()
    runtime = create_engine(dml_url, pool_size=1)
    try:
        # Grown past the rule, but ANALYZE would only warn for this role, every sweep.
        assert await SweepStore(runtime).analyze_grown(tables=("t_owned",)) == []
    finally:
        await runtime.dispose()
    # The owner's sweeper does it.
    assert await SweepStore(engine).analyze_grown(tables=("t_owned",)) == ["t_owned"]


async def test_migrating_to_concurrency_keys_grants_the_runtime_role_its_blocker(
    run_id: str,
) -> None:
    """A role given the runtime rights before 0018 can still claim after it."""
    name = f"jp_{run_id}_role0018"
    role = f"jp_dml_{uuid.uuid4().hex[:10]}"
    await services.create_database(name)
    url = services.pg_url(name)
    admin: asyncpg.Connection | None = None
    try:
        await migrate(url, revision="0017")
        admin = await asyncpg.connect(asyncpg_dsn(url))
        await admin.execute(f'CREATE ROLE "{role}"')
        await admin.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        await admin.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"'
        )
        await migrate(url)
        assert await admin.fetchval(
            "SELECT has_function_privilege($1, $2, 'EXECUTE')"
            " AND has_schema_privilege($1, 'jobplane', 'USAGE')",
            role,
            _BLOCKER,
        )
        # Nobody else was given it.
        assert not await admin.fetchval(
            "SELECT has_function_privilege('public', $1, 'EXECUTE')", _BLOCKER
        )
    finally:
        if admin is not None:
            await admin.close()
        await services.drop_database(name)
        cleanup = await asyncpg.connect(asyncpg_dsn(services.pg_url("postgres")))
        try:
            await cleanup.execute(f'DROP ROLE IF EXISTS "{role}"')
        finally:
            await cleanup.close()


async def test_the_sweepers_scheduler_submits_runs_with_the_documented_grants(
    dml_url: str, engine: AsyncEngine, topology: Topology
) -> None:
    """A schedule's run goes through jobplane.submit_job: the runtime role's grant
    of it (docs/security.md) is what the sweeper needs to tick schedules."""
    from jobplane.schedule_spec import Spec
    from jobplane.schedule_types import JobTemplate, Schedule
    from jobplane.store.routes import sync_submit_rules
    from jobplane.store.schedule_ticks import tick_once
    from jobplane.store.schedules import ScheduleStore

    await sync_submit_rules(engine, topology, max_payload_bytes=256 * 1024)

    async with engine.begin() as conn:  # as the owner, what docs/security.md says to grant
        await conn.execute(text(f'GRANT USAGE ON SCHEMA jobplane TO "{_role_of(dml_url)}"'))
        # The signature grows as fields are added: grant whichever it is.
        for (signature,) in await conn.execute(
            text(
                "SELECT p.oid::regprocedure::text FROM pg_proc p "
                "WHERE p.proname = 'submit_job' AND p.pronamespace = 'jobplane'::regnamespace"
            )
        ):
            await conn.execute(
                text(f'GRANT EXECUTE ON FUNCTION {signature} TO "{_role_of(dml_url)}"')
            )
        tenant_id = (
            await conn.execute(text("INSERT INTO tenants (name) VALUES ('ticked') RETURNING id"))
        ).scalar_one()
    schedule = await ScheduleStore(engine).create(
        tenant_id,
        Schedule(
            name="schedules/hourly",
            template=JobTemplate(type="demo.echo", payload={"n": 1}),
            spec=Spec(interval_seconds=3600),
        ),
    )
    assert schedule.next_run_time is not None
    runtime = create_engine(dml_url, pool_size=1)
    try:
        report = await tick_once(runtime, now=schedule.next_run_time + timedelta(seconds=1))
    finally:
        await runtime.dispose()
    error = (await ScheduleStore(engine).get(tenant_id, "hourly")).last_error
    assert (report.runs, report.failed, error) == (1, 0, "")


def _role_of(url: str) -> str:
    return str(make_url(url).username)
