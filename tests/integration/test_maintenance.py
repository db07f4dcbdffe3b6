"""The maintenance jobs on the real stack: retention deletes exactly what is old and
finished of one tenant; erasure leaves nothing of the tenant; both can run again."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.store.maintenance import DeletedJobs, MaintenanceStore
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.maintenance import ERASURE, RETENTION, Maintenance
from tests.support.aged import aged_event_rows, aged_events, aged_jobs, tenant_rows
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.stack(worker=False)


async def _start_worker(stack: Stack, **options: Any) -> None:
    maintenance = Maintenance(stack.engine, stack.db, live_wait=10.0, poll_interval=0.1, **options)
    await stack.start_worker(demo_registry.merge(maintenance.registry()))


async def _tenant_id(stack: Stack, name: str) -> uuid.UUID:
    return (await MaintenanceStore(stack.engine).tenant_named(name)).id


async def _all_published(stack: Stack) -> None:
    """Until the relays' feed has published every event written so far."""

    async def published() -> bool:
        behind = await stack.scalar(
            "SELECT count(*) FROM events e, event_relay r WHERE (e.txid, e.seq) > (r.txid, r.seq)"
        )
        return int(behind) == 0

    await eventually(published, timeout=15)


async def _job_rows(engine: AsyncEngine, ids: list[uuid.UUID]) -> dict[str, int]:
    """Rows of these jobs in jobs, job_events, job_stages and outbox."""
    counts = {}
    async with engine.connect() as conn:
        for table, column in (
            ("jobs", "id"),
            ("job_events", "job_id"),
            ("job_stages", "job_id"),
            ("outbox", "job_id"),
        ):
            found = await conn.execute(
                text(f"SELECT count(*) FROM {table} WHERE {column} = ANY(:ids)"), {"ids": ids}
            )
            counts[table] = int(found.scalar_one())
    return counts


async def test_retention_deletes_old_finished_jobs_of_its_tenant_only(stack: Stack) -> None:
    await _start_worker(stack)
    await stack.new_key("globex")
    acme, globex = stack.tenant_id, await _tenant_id(stack, "globex")
    engine = stack.engine
    await MaintenanceStore(engine).set_retention("acme", 30)
    await MaintenanceStore(engine).set_retention("globex", 30)
    old = [
        *await aged_jobs(engine, acme, 25, state="succeeded", events=4),
        *await aged_jobs(engine, acme, 10, state="failed", events=2, stages=3),
        *await aged_jobs(engine, acme, 5, state="cancelled", events=1),
    ]
    young = await aged_jobs(engine, acme, 6, state="succeeded", age_days=10)
    live = [
        *await aged_jobs(engine, acme, 3, state="queued", job_type="nobody.handles"),
        *await aged_jobs(engine, acme, 2, state="running", job_type="nobody.handles"),
    ]
    # A live job is never deleted, whatever its timestamps say (as a RetryJob
    # whose row kept an old end_time would look).
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET end_time = create_time WHERE id = ANY(:ids)"), {"ids": live}
        )
    foreign = await aged_jobs(engine, globex, 20, state="succeeded", stages=2)
    await aged_events(engine, acme, 30, age_days=40)
    await aged_events(engine, acme, 7, age_days=5)
    await aged_events(engine, globex, 12, age_days=40)
    await aged_event_rows(engine, acme, 4, age_days=40)
    await aged_event_rows(engine, acme, 2, age_days=40, published=False)
    await _all_published(stack)
    before_young = await _job_rows(engine, young + live)
    before_globex = await tenant_rows(engine, globex)

    client = stack.client()
    job = await client.submit(RETENTION, {"batch_size": 7})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None
    assert done.result["horizon_days"] == 30
    assert done.result["deleted"] == {
        "jobs": 40,
        "job_events": 25 * 4 + 10 * 2 + 5 * 1,
        "job_stages": 10 * 3,
        "outbox": 40 + 4,
        "events": 30,
    }
    assert await _job_rows(engine, old) == {
        "jobs": 0,
        "job_events": 0,
        "job_stages": 0,
        "outbox": 0,
    }
    assert await _job_rows(engine, young + live) == before_young
    assert await tenant_rows(engine, globex) == before_globex
    assert await _job_rows(engine, foreign) == {
        "jobs": 20,
        "job_events": 60,
        "job_stages": 40,
        "outbox": 20,
    }
    young_events = await stack.scalar(
        "SELECT count(*) FROM events WHERE tenant_id = :t AND event_type = 'aged.happened'",
        t=acme,
    )
    assert young_events == 7
    unpublished_rows = await stack.scalar(
        "SELECT count(*) FROM outbox WHERE tenant_id = :t AND kind = 'event'", t=acme
    )
    assert unpublished_rows == 2
    # Progress was reported as it went, batch by batch.
    reports = await stack.scalar(
        "SELECT count(*) FROM job_events WHERE job_id = :id AND type = 'progress'", id=done.id
    )
    assert reports >= 40 // 7
    # ... each against the number of old jobs counted first.
    async with engine.connect() as conn:
        messages = (
            (
                await conn.execute(
                    text("SELECT message FROM job_events WHERE job_id = :id AND type = 'progress'"),
                    {"id": done.id},
                )
            )
            .scalars()
            .all()
        )
    counted = [m for m in messages if " jobs" in m and "events" not in m]
    assert counted and all("40" in m for m in counted), messages

    # Again: nothing is old any more; the first run's own job is young.
    again = await client.wait((await client.submit(RETENTION, {})).name, timeout=30)
    assert again.state is JobState.SUCCEEDED, again.error
    assert again.result is not None
    assert again.result["deleted"] == {}
    assert await _job_rows(engine, young + live) == before_young
    assert await tenant_rows(engine, globex) == before_globex


async def test_retention_horizon_comes_from_the_tenant_and_payload_only_narrows_it(
    stack: Stack,
) -> None:
    await _start_worker(stack)
    engine = stack.engine
    old = await aged_jobs(engine, stack.tenant_id, 5, age_days=40)
    client = stack.client()

    # No horizon: nothing is deleted, and a payload cannot make one.
    kept = await client.wait((await client.submit(RETENTION, {})).name, timeout=30)
    assert kept.state is JobState.SUCCEEDED, kept.error
    assert kept.result == {"tenant": "acme", "horizon_days": None, "deleted": {}}
    refused = await client.wait(
        (await client.submit(RETENTION, {"older_than_days": 35})).name, timeout=30
    )
    assert refused.state is JobState.FAILED
    assert refused.error is not None and refused.error.code == "INVALID_PAYLOAD"

    await MaintenanceStore(engine).set_retention("acme", 30)
    for payload in ({"older_than_days": 29}, {"batch_size": 0}, {"tenant": "globex"}):
        bad = await client.wait((await client.submit(RETENTION, payload)).name, timeout=30)
        assert bad.state is JobState.FAILED, payload
        assert bad.error is not None and bad.error.code == "INVALID_PAYLOAD", payload
    assert (await _job_rows(engine, old))["jobs"] == 5

    # A longer horizon than the tenant's keeps these 40-day-old jobs.
    longer = await client.wait(
        (await client.submit(RETENTION, {"older_than_days": 45})).name, timeout=30
    )
    assert longer.state is JobState.SUCCEEDED, longer.error
    assert (await _job_rows(engine, old))["jobs"] == 5
    plain = await client.wait((await client.submit(RETENTION, {})).name, timeout=30)
    assert plain.state is JobState.SUCCEEDED, plain.error
    assert (await _job_rows(engine, old))["jobs"] == 0


async def test_retention_never_deletes_events_the_feed_has_not_published(
    engine: AsyncEngine,
) -> None:
    store = MaintenanceStore(engine)
    tenant_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO tenants (id, name) VALUES (:id, 'feedless')"), {"id": tenant_id}
        )
        # The feed has published nothing of what follows.
        await conn.execute(
            text("UPDATE event_relay SET txid = CAST(pg_current_xact_id() AS xid8), seq = 0")
        )
    await aged_events(engine, tenant_id, 9, age_days=40)
    cutoff = await store.cutoff(30)
    assert await store.delete_published_events(tenant_id, cutoff, limit=100) == 0
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE event_relay SET (txid, seq) = "
                "(SELECT txid, seq FROM events ORDER BY txid DESC, seq DESC LIMIT 1 OFFSET 3)"
            )
        )
    assert await store.delete_published_events(tenant_id, cutoff, limit=100) == 6
    assert await store.delete_published_events(tenant_id, cutoff, limit=100) == 0


async def test_erasure_leaves_nothing_of_the_tenant_and_touches_no_other(stack: Stack) -> None:
    await _start_worker(stack)
    await stack.new_key("globex")
    acme, globex = stack.tenant_id, await _tenant_id(stack, "globex")
    engine = stack.engine
    await aged_jobs(engine, acme, 30, state="succeeded", stages=2)
    await aged_jobs(engine, acme, 5, state="failed", age_days=1)
    await aged_jobs(engine, acme, 4, state="queued", job_type="nobody.handles")
    await aged_events(engine, acme, 15)
    await aged_event_rows(engine, acme, 3, published=False)
    await aged_jobs(engine, globex, 12, state="succeeded", stages=1)
    await aged_jobs(engine, globex, 2, state="queued", job_type="nobody.handles")
    await aged_events(engine, globex, 8)
    await aged_event_rows(engine, globex, 2)
    client = stack.client()
    running = await client.submit("demo.progress", {"steps": 400, "interval_ms": 50})

    async def started() -> bool:
        return (await client.get(running.name)).state is JobState.RUNNING

    await eventually(started)
    before_globex = await tenant_rows(engine, globex)
    assert all(before_globex[t] for t in ("jobs", "job_events", "job_stages", "events"))

    # Without the tenant's name in the payload, nothing happens.
    refused = await client.wait((await client.submit(ERASURE, {})).name, timeout=30)
    assert refused.state is JobState.FAILED
    assert refused.error is not None and refused.error.code == "CONFIRMATION_REQUIRED"
    assert (await client.get(running.name)).state is JobState.RUNNING

    job = await client.submit(ERASURE, {"confirm": "acme", "batch_size": 8})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None
    assert done.result["index"] == "not configured"
    left = await tenant_rows(engine, acme, keep=uuid.UUID(done.id))
    assert set(left) >= {"jobs", "job_events", "job_stages", "outbox", "events", "api_keys"}
    # The tenant and its keys stay: erasure deletes its data, not the tenant.
    assert left.pop("api_keys") == 1
    assert left == dict.fromkeys(left, 0)
    assert await tenant_rows(engine, globex) == before_globex
    # The receipt stays, with its own events, and the tenant can read it.
    assert (await client.get(job.name)).state is JobState.SUCCEEDED
    receipt = await stack.scalar(
        "SELECT count(*) FROM job_events WHERE job_id = :id AND type IN ('queued', 'succeeded')",
        id=done.id,
    )
    assert receipt == 2
    lifecycle = await stack.scalar(
        "SELECT string_agg(event_type, ',' ORDER BY seq) FROM events WHERE job_id = :id",
        id=done.id,
    )
    assert lifecycle == "job.queued,job.started,job.succeeded"

    # Again: nothing of the tenant is left but the first erasure's receipt, which goes.
    again = await client.wait((await client.submit(ERASURE, {"confirm": "acme"})).name, timeout=30)
    assert again.state is JobState.SUCCEEDED, again.error
    assert again.result is not None
    assert again.result["deleted"]["jobs"] == 1
    left = await tenant_rows(engine, acme, keep=uuid.UUID(again.id))
    assert left.pop("api_keys") == 1
    assert left == dict.fromkeys(left, 0)
    assert await tenant_rows(engine, globex) == before_globex


async def test_operator_commands_set_horizons_and_erase(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.integration.test_cli_and_sync import jobplane
    from tests.support.commands import tenants_command

    monkeypatch.setenv("JOBPLANE_DATABASE_URL", stack.database_url)

    async def tenants(*argv: str) -> tuple[int, str, str]:
        """``jobplane tenants ...`` in this process (the subprocess is tried once, below)."""
        return await tenants_command(capsys, *argv)

    await _start_worker(stack)
    await aged_jobs(stack.engine, stack.tenant_id, 3, age_days=40)
    code, _out, err = await tenants("set-retention", "acme", "0")
    assert code == 2 and "1..36500" in err
    code, _out, err = await tenants("set-retention", "nobody", "30")
    assert code == 1 and "no tenant 'nobody'" in err
    code, _out, err = await tenants("set-retention", "acme", "30")
    assert code == 0, err
    code, out, _err = await tenants("list", "--json")
    assert code == 0
    listed = {t["name"]: t for t in map(json.loads, out.splitlines())}
    assert listed["acme"]["retention_days"] == 30
    code, out, err = await tenants("retention", "--all", "--wait")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["deleted"]["jobs"] == 3
    code, _out, err = await tenants("erase", "acme")
    assert code == 2 and "--yes" in err

    await aged_jobs(stack.engine, stack.tenant_id, 4, age_days=1)
    code, out, err = await jobplane(stack, "tenants", "erase", "acme", "--yes", "--wait")
    assert code == 0, err
    erased = uuid.UUID(out.splitlines()[0].partition("/")[2])
    assert json.loads(out.splitlines()[-1])["deleted"]["jobs"] == 5
    left = await tenant_rows(stack.engine, stack.tenant_id, keep=erased)
    assert left.pop("api_keys") == 1
    assert left == dict.fromkeys(left, 0)
    code, _out, err = await tenants("set-retention", "acme", "none")
    assert code == 0, err
    assert await stack.scalar("SELECT retention_days FROM tenants WHERE name = 'acme'") is None


async def test_an_erasure_gives_way_to_an_earlier_one_of_the_tenant(stack: Stack) -> None:
    await _start_worker(stack)
    [earlier] = await aged_jobs(
        stack.engine, stack.tenant_id, 1, state="running", age_days=1, job_type=ERASURE
    )
    kept = await aged_jobs(stack.engine, stack.tenant_id, 3, age_days=40)
    client = stack.client()
    job = await client.submit(ERASURE, {"confirm": "acme"}, max_attempts=1)
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "ERASURE_IN_PROGRESS"
    # The earlier one was not asked to stop, and nothing was deleted.
    state = await stack.scalar(
        "SELECT state || ' ' || (cancel_requested_at IS NULL) FROM jobs WHERE id = :id", id=earlier
    )
    assert state == "running true"
    assert (await _job_rows(stack.engine, kept))["jobs"] == 3


async def test_retention_skips_a_job_locked_by_a_retry_and_keeps_it_once_retried(
    engine: AsyncEngine,
) -> None:
    import asyncio

    store = MaintenanceStore(engine)
    tenant_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO tenants (id, name) VALUES (:id, 'racer')"), {"id": tenant_id}
        )
    [retried, *others] = await aged_jobs(engine, tenant_id, 4, state="failed", age_days=40)
    cutoff = await store.cutoff(30)
    async with engine.connect() as retry:
        # A RetryJob holds the job's row lock while it moves it back to QUEUED.
        await retry.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": retried})
        done = await asyncio.wait_for(
            store.delete_expired_jobs(
                tenant_id, cutoff, keep=uuid.uuid4(), limit=100, max_rows=1000
            ),
            timeout=5,
        )
        assert done.jobs == 3
        await retry.execute(
            text("UPDATE jobs SET state = 'queued', end_time = NULL WHERE id = :id"),
            {"id": retried},
        )
        await retry.commit()
    again = await store.delete_expired_jobs(
        tenant_id, cutoff, keep=uuid.uuid4(), limit=100, max_rows=1000
    )
    assert again.jobs == 0
    assert (await _job_rows(engine, [retried]))["jobs"] == 1
    assert (await _job_rows(engine, others))["jobs"] == 0


async def test_a_batch_is_bounded_by_its_jobs_events_but_takes_at_least_one_job(
    engine: AsyncEngine,
) -> None:
    store = MaintenanceStore(engine)
    tenant_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO tenants (id, name) VALUES (:id, 'chatty')"), {"id": tenant_id}
        )
    await aged_jobs(engine, tenant_id, 1, age_days=50, events=40)
    await aged_jobs(engine, tenant_id, 5, age_days=40, events=10)
    cutoff = await store.cutoff(30)

    async def batch() -> DeletedJobs:
        return await store.delete_expired_jobs(
            tenant_id, cutoff, keep=uuid.uuid4(), limit=100, max_rows=25
        )

    # The oldest job alone has more events than a batch may hold: a batch of its own.
    assert (await batch()).as_dict() == {
        "jobs": 1,
        "job_events": 40,
        "job_stages": 0,
        "outbox": 1,
        "job_blobs": 0,
    }
    # Then two at a time: 2 x (10 + 1) rows fit in 25, three do not.
    assert [(await batch()).jobs for _ in range(4)] == [2, 2, 1, 0]


async def test_an_erasure_stopped_after_a_batch_is_finished_by_the_next(stack: Stack) -> None:
    from jobplane.faults import FaultPoints

    # Every batch of this worker's erasures fails right after it committed.
    maintenance = Maintenance(
        stack.engine, stack.db, faults=FaultPoints(["maintenance.erasure.batch"])
    )
    failing = await stack.start_worker(demo_registry.merge(maintenance.registry()))
    await aged_jobs(stack.engine, stack.tenant_id, 30, age_days=3)
    client = stack.client()
    stopped = await client.wait(
        (await client.submit(ERASURE, {"confirm": "acme", "batch_size": 10}, max_attempts=1)).name,
        timeout=30,
    )
    assert stopped.state is JobState.FAILED
    left = await stack.scalar("SELECT count(*) FROM jobs WHERE tenant_id = :t", t=stack.tenant_id)
    assert left == 30 - 10 + 1  # one batch went; the stopped erasure is a finished job now
    await failing.stop(grace=1.0)
    stack.workers.remove(failing)

    await _start_worker(stack)
    done = await client.wait(
        (await client.submit(ERASURE, {"confirm": "acme", "batch_size": 10})).name, timeout=30
    )
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None and done.result["deleted"]["jobs"] == 21
    left_rows = await tenant_rows(stack.engine, stack.tenant_id, keep=uuid.UUID(done.id))
    assert left_rows.pop("api_keys") == 1
    assert left_rows == dict.fromkeys(left_rows, 0)
