"""A job submitted inside the caller's own transaction exists iff that transaction commits.

The caller's service shares jobplane's Postgres: its rows, the job and the
job's outbox row commit together (seed 001's request path), through
``jobplane.submit_job`` from asyncpg, SQLAlchemy or plain SQL text.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from jobplane import txn
from jobplane.client import JobState
from jobplane.errors import (
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
    RequestIdReused,
    TenantNotFound,
    UnroutableJobType,
)
from jobplane.names import job_name
from jobplane.store.engine import asyncpg_dsn
from jobplane.store.routes import sync_submit_rules
from jobplane.topics import topic_matches, topic_regex
from jobplane.topology import QueueSpec, Topology
from tests.support.stack import Stack, eventually

_CALLER_TABLE = "CREATE TABLE source_files (id uuid PRIMARY KEY, job_id uuid)"


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The caller service's own connection, with a table of its own."""
    connection: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    await connection.execute(_CALLER_TABLE)
    yield connection
    await connection.close()


async def _ingest(conn: asyncpg.Connection, request_id: str = "") -> tuple[uuid.UUID, uuid.UUID]:
    """Seed 001's request: the caller's row and the job that will process it, at once."""
    file_id = uuid.uuid4()
    job_id = await txn.submit_job(
        conn,
        tenant="acme",
        type="demo.echo",
        payload={"file_id": str(file_id)},
        request_id=request_id or f"ingest-{file_id}",
    )
    await conn.execute("INSERT INTO source_files (id, job_id) VALUES ($1, $2)", file_id, job_id)
    return file_id, job_id


async def test_a_rolled_back_caller_leaves_no_job_and_wakes_nothing(
    stack: Stack, conn: asyncpg.Connection, database_url: str
) -> None:
    notes: asyncio.Queue[str] = asyncio.Queue()
    listener: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    caller = conn.get_server_pid()

    def heard(_conn: object, pid: int, _channel: str, payload: object) -> None:
        # The stack's own processes notify this channel too (a worker that
        # starts unparks jobs): only the caller's session counts.
        if pid == caller:
            notes.put_nowait(str(payload))

    await listener.add_listener("jobplane_outbox", heard)
    try:
        tx = conn.transaction()
        await tx.start()
        _file_id, job_id = await _ingest(conn)
        await tx.rollback()
        # Notifications arrive in commit order: a later commit's marker comes
        # first only if the rolled-back submit sent none.
        await conn.execute("NOTIFY jobplane_outbox, 'marker'")
        assert await asyncio.wait_for(notes.get(), timeout=10) == "marker"
    finally:
        await listener.close()
    assert await stack.counts() == {"jobs": 0, "job_events": 0, "outbox": 0}
    assert await conn.fetchval("SELECT count(*) FROM source_files") == 0
    # Nothing was published: the next committed job is the only one a worker sees.
    async with conn.transaction():
        _file_id, next_id = await _ingest(conn)
    done = await asyncio.wait_for(stack.client().wait(job_name(next_id)), timeout=30)
    assert done.state is JobState.SUCCEEDED
    dispatched = (
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND kind = 'job.dispatch'"
    )
    assert await stack.scalar(dispatched) == 1
    assert not await stack.scalar("SELECT count(*) FROM jobs WHERE id = :id", id=job_id)


async def test_a_committed_caller_runs_its_job_once_visible_through_the_api(
    stack: Stack, conn: asyncpg.Connection
) -> None:
    async with conn.transaction():
        file_id, job_id = await _ingest(conn)
    client = stack.client()
    events = [e async for e in client.watch(job_name(job_id))]
    assert [e.state for e in events][-1] is JobState.SUCCEEDED
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    job = await client.get(job_name(job_id))
    assert job.state is JobState.SUCCEEDED
    assert job.result == {"file_id": str(file_id)}  # demo.echo returns its payload
    assert job.attempt == 1
    assert job.request_id == f"ingest-{file_id}"
    assert sum(e.state is JobState.RUNNING for e in events) == 1
    row = await conn.fetchrow("SELECT * FROM source_files")
    assert row is not None and row["job_id"] == job_id


async def test_one_request_id_in_two_transactions_is_one_job(
    stack: Stack, conn: asyncpg.Connection
) -> None:
    ids = []
    for _ in range(2):
        async with conn.transaction():
            ids.append(
                await txn.submit_job(
                    conn, tenant="acme", type="demo.echo", payload={"n": 1}, request_id="once"
                )
            )
    assert ids[0] == ids[1]
    assert await stack.scalar("SELECT count(*) FROM jobs") == 1
    assert await stack.scalar("SELECT count(*) FROM outbox WHERE kind = 'job.dispatch'") == 1
    # ... and one job.queued.
    assert await stack.scalar("SELECT count(*) FROM events WHERE event_type = 'job.queued'") == 1
    # The RPC with the same request is the same job too, whichever path came first.
    job = await stack.client().submit("demo.echo", {"n": 1}, request_id="once")
    assert job.name == job_name(ids[0])
    # A different request with that id is refused, by its reason and field.
    with pytest.raises(RequestIdReused) as refused:
        async with conn.transaction():
            await txn.submit_job(
                conn, tenant="acme", type="demo.echo", payload={"n": 2}, request_id="once"
            )
    assert refused.value.field == "request_id"
    assert refused.value.reason == "REQUEST_ID_REUSED"
    rpc_first = await stack.client().submit("demo.echo", {"n": 3}, request_id="rpc-first")
    async with conn.transaction():
        same = await txn.submit_job(
            conn, tenant="acme", type="demo.echo", payload={"n": 3}, request_id="rpc-first"
        )
    assert job_name(same) == rpc_first.name


@pytest.mark.parametrize("first_commits", [True, False])
async def test_two_concurrent_transactions_with_one_request_id(
    stack: Stack, conn: asyncpg.Connection, database_url: str, first_commits: bool
) -> None:
    other: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        first = conn.transaction()
        await first.start()
        _f, first_id = await _ingest(conn, request_id="race")
        second = other.transaction()
        await second.start()
        blocked = asyncio.create_task(
            txn.submit_job(
                other,
                tenant="acme",
                type="demo.echo",
                payload={"file_id": await conn.fetchval("SELECT id::text FROM source_files")},
                request_id="race",
            )
        )
        pid = other.get_server_pid()

        async def waiting() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
                )
            )

        await eventually(waiting)
        await (first.commit() if first_commits else first.rollback())
        second_id = await asyncio.wait_for(blocked, timeout=10)
        await second.commit()
    finally:
        await other.close()
    assert (second_id == first_id) is first_commits
    assert await stack.scalar("SELECT count(*) FROM jobs") == 1
    assert await stack.scalar("SELECT count(*) FROM outbox WHERE kind = 'job.dispatch'") == 1
    done = await asyncio.wait_for(stack.client().wait(job_name(second_id)), timeout=30)
    assert done.state is JobState.SUCCEEDED


async def _keyed_replay(conn: asyncpg.Connection) -> uuid.UUID:
    return await txn.submit_job(
        conn,
        tenant="acme",
        type="demo.echo",
        request_id="replayed",
        concurrency_key="k",
        concurrency_limit=1,
        concurrency_mode="reject",
    )


async def test_a_reject_mode_replay_racing_its_request_returns_its_job(
    stack: Stack, conn: asyncpg.Connection, database_url: str
) -> None:
    """The second waits for the key's lock while the first inserts; it then
    counts the first's job in flight, but that job is its own request's."""
    other: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        first = conn.transaction()
        await first.start()
        first_id = await _keyed_replay(conn)
        second = other.transaction()
        await second.start()
        blocked = asyncio.create_task(_keyed_replay(other))
        pid = other.get_server_pid()

        async def waiting() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
                )
            )

        await eventually(waiting)
        await first.commit()
        second_id = await asyncio.wait_for(blocked, timeout=10)
        await second.commit()
    finally:
        await other.close()
    assert second_id == first_id
    assert await stack.scalar("SELECT count(*) FROM jobs") == 1


async def test_through_a_sqlalchemy_session_and_connection(
    stack: Stack, engine: AsyncEngine
) -> None:
    async with engine.begin() as setup:
        await setup.execute(text(_CALLER_TABLE))
    async with AsyncSession(engine) as session, session.begin():
        await session.execute(text("INSERT INTO source_files (id) VALUES (gen_random_uuid())"))
        in_session = await txn.submit_job(
            session, tenant="acme", type="demo.echo", payload={"via": "session"}
        )
    async with engine.connect() as connection:
        await connection.execute(text("INSERT INTO source_files (id) VALUES (gen_random_uuid())"))
        rolled_back = await txn.submit_job(connection, tenant="acme", type="demo.echo")
        await connection.rollback()
        await connection.execute(text("INSERT INTO source_files (id) VALUES (gen_random_uuid())"))
        committed = await txn.submit_job(
            connection, tenant="acme", type="demo.echo", payload={"via": "connection"}
        )
        await connection.commit()
    client = stack.client()
    for job_id, via in ((in_session, "session"), (committed, "connection")):
        done = await asyncio.wait_for(client.wait(job_name(job_id)), timeout=30)
        assert done.result == {"via": via}
    assert await stack.scalar("SELECT count(*) FROM jobs") == 2
    assert await stack.scalar("SELECT count(*) FROM source_files") == 2
    assert not await stack.scalar("SELECT count(*) FROM jobs WHERE id = :id", id=rolled_back)
    # A refusal inside a session comes back as the SDK's exception.
    async with AsyncSession(engine) as session:
        with pytest.raises(InvalidArgument) as refused:
            await txn.submit_job(session, tenant="acme", type="Not A Type")
        assert refused.value.field == "type"


async def test_from_plain_sql_text(stack: Stack, database_url: str) -> None:
    """What a service in any language sends: one script, named arguments."""
    script = """
    CREATE TABLE source_files (id uuid PRIMARY KEY, job_id uuid);
    BEGIN;
    INSERT INTO source_files (id, job_id)
    SELECT '7b1c1b0e-0000-4000-8000-000000000001', jobplane.submit_job(
        tenant     => 'acme',
        type       => 'demo.echo',
        payload    => '{"file": "7b1c1b0e"}',
        request_id => 'ingest-7b1c1b0e',
        labels     => '{"source": "psql"}'
    );
    COMMIT;
    """
    psql = shutil.which("psql")
    if psql is not None:
        process = await asyncio.create_subprocess_exec(
            psql,
            "-v",
            "ON_ERROR_STOP=1",
            "-q",
            asyncpg_dsn(database_url),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _out, err = await asyncio.wait_for(process.communicate(script.encode()), timeout=30)
        assert process.returncode == 0, err.decode()
    else:  # the same text over the simple query protocol
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            await conn.execute(script)
        finally:
            await conn.close()
    job_id = await stack.scalar("SELECT job_id FROM source_files")
    done = await asyncio.wait_for(stack.client().wait(job_name(job_id)), timeout=30)
    assert done.state is JobState.SUCCEEDED
    assert done.labels == {"source": "psql"}
    assert done.result == {"file": "7b1c1b0e"}


async def test_refusals_carry_the_rpc_reasons(stack: Stack, conn: asyncpg.Connection) -> None:
    cases: list[tuple[dict[str, object], type[JobplaneError], str]] = [
        ({"tenant": "nobody"}, TenantNotFound, "tenant"),
        ({"type": "no.queue.takes.this"}, UnroutableJobType, "type"),
        ({"payload": {"blob": "x" * 300_000}}, PayloadTooLarge, "payload"),
        ({"payload": {"n": float("nan")}}, InvalidArgument, "payload"),
        ({"payload": {"s": "a\x00b"}}, InvalidArgument, "payload"),
        ({"labels": {"k": "a\x00"}}, InvalidArgument, "labels"),
        ({"max_attempts": 101}, InvalidArgument, "max_attempts"),
        ({"request_id": "a\nb"}, InvalidArgument, "request_id"),
        ({"correlation_id": "é" * 128}, InvalidArgument, "correlation_id"),
        ({"labels": {"Bad": "x"}}, InvalidArgument, "labels"),
        ({"attempt_timeout": 0.0}, InvalidArgument, "timeout"),
    ]
    # Only the demo types route here.
    topology = Topology(queues=(QueueSpec("only-demo", ("demo.*",)),))
    await sync_submit_rules(stack.engine, topology, max_payload_bytes=256 * 1024)
    for overrides, error, field in cases:
        arguments: dict[str, object] = {"tenant": "acme", "type": "demo.echo", **overrides}
        with pytest.raises(error) as refused:
            async with conn.transaction():
                await txn.submit_job(conn, **arguments)  # type: ignore[arg-type]
        assert type(refused.value) is error, overrides
        assert (refused.value.field or "").startswith(field), overrides
    size = await conn.fetchval("SELECT 1")  # the connection is usable after each rollback
    assert size == 1
    assert await stack.scalar("SELECT count(*) FROM jobs") == 0


_PARENT = "0190c0de-5a1e-7000-8000-00000000beef"


@pytest.mark.parametrize("request_id", [f"fan:{_PARENT}:0:1:0", f"child:{_PARENT}:chunk-1"])
async def test_the_systems_request_ids_are_refused_as_the_rpc_refuses_them(
    stack: Stack, conn: asyncpg.Connection, request_id: str
) -> None:
    """A fan-out's child's and a child job's request_id: a job of the caller's with
    one would be taken for that child, or make its submit fail."""
    with pytest.raises(InvalidArgument) as refused:
        async with conn.transaction():
            await txn.submit_job(conn, tenant="acme", type="demo.echo", request_id=request_id)
    with pytest.raises(InvalidArgument) as rpc:
        await stack.client().submit("demo.echo", {}, request_id=request_id)
    prefix = request_id.split(":", 1)[0]
    assert str(refused.value) == (
        f"request_id '{request_id}' starts with '{prefix}:', which is the system's "
        "(its prefixes: fan:, child:)"
    )
    assert str(refused.value) == str(rpc.value)
    assert refused.value.field == rpc.value.field == "request_id"
    assert await stack.counts() == {"jobs": 0, "job_events": 0, "outbox": 0}
    assert await stack.scalar("SELECT count(*) FROM events") == 0
    assert await stack.scalar("SELECT count(*) FROM outbox") == 0


async def test_a_request_id_with_fan_or_child_elsewhere_is_accepted(
    stack: Stack, conn: asyncpg.Connection
) -> None:
    """Only the two prefixes, whole and in lowercase, are the system's; the RPC takes
    the same ids, as the same jobs."""
    ids = ["fan", "child", "fan-out:1", "children:1", "x:fan:1", "my-child:1", "Fan:1", " fan:1"]
    for request_id in ids:
        async with conn.transaction():
            job_id = await txn.submit_job(
                conn, tenant="acme", type="demo.echo", request_id=request_id
            )
        job = await stack.client().submit("demo.echo", {}, request_id=request_id)
        assert job.name == job_name(job_id), request_id
        assert job.request_id == request_id
    assert await stack.scalar("SELECT count(*) FROM jobs") == len(ids)


async def test_a_role_that_may_only_execute_the_function(stack: Stack, database_url: str) -> None:
    """The caller's role needs no right on jobplane's tables, only EXECUTE."""
    role = f"jp_caller_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        dsn = asyncpg_dsn(database_url).replace("postgres@", f"{role}@", 1)
        caller: asyncpg.Connection = await asyncpg.connect(dsn)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await txn.submit_job(caller, tenant="acme", type="demo.echo")
            await admin.execute(f'GRANT USAGE ON SCHEMA jobplane TO "{role}"')
            await admin.execute(
                "GRANT EXECUTE ON FUNCTION jobplane.submit_job(text, text, jsonb, text, text, "
                "integer, jsonb, double precision, timestamptz, interval, text, integer, text, "
                "timestamptz, interval, uuid[], text) "
                f'TO "{role}"'
            )
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await caller.fetchval("SELECT count(*) FROM jobs")
            job_id = await txn.submit_job(caller, tenant="acme", type="demo.echo")
        finally:
            await caller.close()
        done = await asyncio.wait_for(stack.client().wait(job_name(job_id)), timeout=30)
        assert done.state is JobState.SUCCEEDED
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def test_routes_follow_the_topology_idempotently(engine: AsyncEngine) -> None:
    topology = Topology(
        queues=(
            QueueSpec("reports", ("reports.*",), max_attempts=7, timeout_seconds=9.5),
            QueueSpec("rest", ("#",)),
        )
    )
    assert await sync_submit_rules(engine, topology, max_payload_bytes=1000)
    assert not await sync_submit_rules(engine, topology, max_payload_bytes=1000)
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO tenants (name) VALUES ('acme')"))
        first = await txn.submit_job(conn, tenant="acme", type="reports.render")
        second = await txn.submit_job(conn, tenant="acme", type="reports.render.pdf")
        rows = {
            r.id: r
            for r in await conn.execute(
                text("SELECT id, queue, max_attempts, timeout_seconds FROM jobs")
            )
        }
    assert (rows[first].queue, rows[first].max_attempts, rows[first].timeout_seconds) == (
        "reports",
        7,
        9.5,
    )
    assert rows[second].queue == "rest"
    other = Topology(queues=(QueueSpec("rest", ("#",)),))
    assert await sync_submit_rules(engine, other, max_payload_bytes=1000)
    async with engine.connect() as conn:
        routes = (await conn.execute(text("SELECT queue, pattern FROM job_routes"))).all()
    assert [tuple(r) for r in routes] == [("rest", "#")]


async def test_a_binding_matches_in_sql_as_on_the_broker(conn: asyncpg.Connection) -> None:
    """Every pattern of up to three words against every key of up to four."""
    words = ["a", "b-c", "*", "#"]
    patterns = [".".join(p) for n in (1, 2, 3) for p in itertools.product(words, repeat=n)]
    keys = [".".join(k) for n in (1, 2, 3, 4) for k in itertools.product(["a", "b-c"], repeat=n)]
    pairs = [(p, k) for p in patterns for k in keys]
    in_sql = await conn.fetch(
        "SELECT '.' || k ~ r AS matches FROM unnest($1::text[], $2::text[]) AS t(r, k)",
        [topic_regex(p) for p, _k in pairs],
        [k for _p, k in pairs],
    )
    wrong = [
        pair
        for pair, row in zip(pairs, in_sql, strict=True)
        if row["matches"] != topic_matches(*pair)
    ]
    assert not wrong, wrong[:10]
