"""What ``jobplane tenants`` prints and changes, run in-process on a real database.

docs/operations.md: ``list`` shows each tenant's horizon and dispatch weight (or one
JSON object per tenant); ``set-retention`` and ``set-weight`` say what now holds;
``retention`` and ``erase`` submit a maintenance job, print ``jobs/ID`` on stdout and
whom it is for on stderr; ``--wait`` follows the job until it ends. A tenant that
does not exist exits 1, a value out of range 2.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.jobs import JobStore
from jobplane.store.routes import sync_submit_rules
from jobplane.topology import load_topology
from jobplane.workers.maintenance import ERASURE, RETENTION
from tests.support.commands import tenants_command
from tests.support.logs import assert_answers


@pytest.fixture
async def tenants(
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Any:
    """``jobplane tenants ARGV`` in this process: its exit status, stdout and stderr.

    The database routes the default topology's types, as a server would have made it."""
    await sync_submit_rules(engine, load_topology(), max_payload_bytes=256 * 1024)
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    capsys.readouterr()

    async def run(*argv: str) -> tuple[int, str, str]:
        return await tenants_command(capsys, *argv)

    return run


async def _add_tenant(engine: AsyncEngine, name: str, **columns: int) -> uuid.UUID:
    tenant_id = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO tenants (id, name) VALUES (:id, :name)"),
            {"id": tenant_id, "name": name},
        )
        for column, value in columns.items():
            await conn.execute(
                text(f"UPDATE tenants SET {column} = :value WHERE id = :id"),
                {"value": value, "id": tenant_id},
            )
    return tenant_id


async def _jobs(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT j.id, t.name AS tenant, j.type, j.payload, j.request_id, j.state"
                " FROM jobs j JOIN tenants t ON t.id = j.tenant_id ORDER BY t.name"
            )
        )
        return [dict(row._mapping) for row in rows]


async def test_list_shows_horizons_and_weights(engine: AsyncEngine, tenants: Any) -> None:
    acme = await _add_tenant(engine, "acme", retention_days=30, dispatch_weight=3)
    globex = await _add_tenant(engine, "globex")

    code, out, err = await tenants("list")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{'acme':<40}  {'30d':>7}  {'w3':>5}  {acme}",
        f"{'globex':<40}  {'-':>7}  {'w1':>5}  {globex}",
    ]

    code, out, err = await tenants("list", "--json")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        json.dumps(
            {"dispatch_weight": weight, "id": str(id_), "name": name, "retention_days": days}
        )
        for id_, name, days, weight in ((acme, "acme", 30, 3), (globex, "globex", None, 1))
    ]


async def test_set_weight_and_set_retention_say_what_now_holds(
    engine: AsyncEngine, tenants: Any
) -> None:
    await _add_tenant(engine, "acme")

    code, out, err = await tenants("set-weight", "acme", "7")
    assert (code, out) == (0, "")
    assert err == "tenant 'acme': dispatch weight 7 (from the relays' next claim)\n"

    code, out, err = await tenants("set-retention", "acme", "30")
    assert (code, out) == (0, "")
    assert err == (
        "tenant 'acme': finished jobs and events are kept 30 days\n"
        "schedules/jobplane-retention runs maintenance.retention daily\n"
    )
    code, out, err = await tenants("set-retention", "acme", "45")
    assert err == "tenant 'acme': finished jobs and events are kept 45 days\n"

    code, out, err = await tenants("set-retention", "acme", "none")
    assert (code, out) == (0, "")
    assert err == (
        "tenant 'acme': finished jobs and events are kept for ever\n"
        "schedules/jobplane-retention deleted: no horizon\n"
    )
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text("SELECT retention_days, dispatch_weight FROM tenants WHERE name = 'acme'")
            )
        ).one()
    assert tuple(row) == (None, 7)


async def test_a_missing_tenant_exits_1_and_a_value_out_of_range_2(
    engine: AsyncEngine, tenants: Any
) -> None:
    await _add_tenant(engine, "acme")
    assert await tenants("set-weight", "nobody", "2") == (1, "", "error: no tenant 'nobody'\n")
    assert await tenants("set-retention", "nobody", "2") == (1, "", "error: no tenant 'nobody'\n")
    assert await tenants("retention", "nobody") == (1, "", "error: no tenant 'nobody'\n")
    assert await tenants("erase", "nobody", "--yes") == (1, "", "error: no tenant 'nobody'\n")
    code, out, err = await tenants("set-weight", "acme", "0")
    assert (code, out) == (2, "")
    assert err == "error: dispatch weight must be 1..1000, got 0\n"
    code, out, err = await tenants("set-retention", "acme", "0")
    assert (code, out) == (2, "")
    assert err == "error: retention days must be 1..36500, got 0\n"
    assert await _jobs(engine) == []


async def test_retention_submits_one_job_per_tenant_and_day(
    engine: AsyncEngine, tenants: Any
) -> None:
    await _add_tenant(engine, "globex")
    assert await tenants("retention", "--all") == (
        0,
        "",
        "no tenant has a retention horizon\n",
    )
    await _add_tenant(engine, "acme", retention_days=30)
    await _add_tenant(engine, "initech", retention_days=5)

    before = datetime.now(UTC).strftime("%Y-%m-%d")
    code, out, err = await tenants("retention", "--all")
    after = datetime.now(UTC).strftime("%Y-%m-%d")
    assert code == 0
    jobs = await _jobs(engine)
    # The request id is the day's (a run across midnight may see either).
    days = {f"{RETENTION}/{before}", f"{RETENTION}/{after}"}
    assert [(j["tenant"], j["type"], j["payload"]) for j in jobs] == [
        ("acme", RETENTION, {}),
        ("initech", RETENTION, {}),
    ]
    assert {j["request_id"] for j in jobs} <= days
    assert out.splitlines() == [f"jobs/{j['id']}" for j in jobs]
    assert err.splitlines() == [
        f"submitted jobs/{j['id']} for tenant {j['tenant']!r}" for j in jobs
    ]

    # Named tenants (with a horizon or not); a second run of the day is the same job.
    code, out, err = await tenants("retention", "initech", "globex")
    assert code == 0
    again = {j["tenant"]: j for j in await _jobs(engine)}
    days.add(f"{RETENTION}/{datetime.now(UTC):%Y-%m-%d}")
    assert len(again) == 3 and again["globex"]["request_id"] in days
    assert out.splitlines() == [f"jobs/{again['initech']['id']}", f"jobs/{again['globex']['id']}"]


async def test_erase_wants_yes_and_submits_an_erasure_naming_the_tenant(
    engine: AsyncEngine, tenants: Any
) -> None:
    await _add_tenant(engine, "acme")
    assert await tenants("erase", "acme") == (
        2,
        "",
        "error: erasing deletes every job, event, blob and index point of tenant "
        "'acme'; add --yes\n",
    )
    assert await _jobs(engine) == []

    code, out, err = await tenants("erase", "acme", "--yes")
    assert code == 0
    (job,) = await _jobs(engine)
    assert (job["tenant"], job["type"], job["payload"]) == ("acme", ERASURE, {"confirm": "acme"})
    prefix, _, request = job["request_id"].partition("/")
    assert prefix == ERASURE and uuid.UUID(request)
    assert out == f"jobs/{job['id']}\n"
    assert err == f"submitted jobs/{job['id']} for tenant 'acme'\n"
    # Each erasure is a new job: a request id of its own.
    await tenants("erase", "acme", "--yes")
    assert len(await _jobs(engine)) == 2


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once ``--wait`` has read its job (and so shown it) the first time."""
    event = asyncio.Event()
    read = JobStore.get

    async def get(self: JobStore, *args: Any, **kwargs: Any) -> Any:
        job = await read(self, *args, **kwargs)
        event.set()  # the command prints the line before it next waits
        return job

    monkeypatch.setattr(JobStore, "get", get)
    return event


async def _end_jobs(engine: AsyncEngine, shown: asyncio.Event, **columns: Any) -> None:
    """Every job, once ``--wait`` has shown it queued, ends with ``columns``
    (what a worker would write)."""
    await asyncio.wait_for(shown.wait(), 20)
    sets = ", ".join(f"{column} = :{column}" for column in columns)
    async with engine.begin() as conn:
        await conn.execute(text(f"UPDATE jobs SET {sets}"), columns)


async def test_wait_shows_progress_and_the_result(
    engine: AsyncEngine, tenants: Any, shown: asyncio.Event
) -> None:
    await _add_tenant(engine, "acme", retention_days=30)
    ended = asyncio.create_task(
        _end_jobs(
            engine,
            shown,
            state="succeeded",
            progress=1.0,
            progress_message="done",
            result='{"deleted": {"jobs": 3}}',
        )
    )
    code, out, err = await asyncio.wait_for(tenants("retention", "acme", "--wait"), 30)
    await ended
    (job,) = await _jobs(engine)
    assert code == 0
    assert out == f'jobs/{job["id"]}\n{{"deleted": {{"jobs": 3}}}}\n'
    assert err.splitlines() == [
        f"submitted jobs/{job['id']} for tenant 'acme'",
        f"jobs/{job['id']} QUEUED 0% ",
        f"jobs/{job['id']} SUCCEEDED 100% done",
    ]


@pytest.mark.parametrize("fmt", ["console", "json"])
async def test_wait_exits_1_when_the_job_fails(
    engine: AsyncEngine,
    tenants: Any,
    shown: asyncio.Event,
    fmt: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each line its JSON object with JOBPLANE_LOG_FORMAT=json: the progress too."""
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", fmt)
    await _add_tenant(engine, "acme")
    ended = asyncio.create_task(
        _end_jobs(
            engine,
            shown,
            state="failed",
            progress=0.5,
            progress_message="half",
            error_code="INTERNAL",
            error_message="disk full",
        )
    )
    code, out, err = await asyncio.wait_for(tenants("erase", "acme", "--yes", "--wait"), 30)
    await ended
    (job,) = await _jobs(engine)
    assert code == 1
    assert out == f"jobs/{job['id']}\n"
    job_id = str(job["id"])
    assert_answers(
        err,
        fmt,
        [
            (
                "maintenance.submitted",
                f"submitted jobs/{job_id} for tenant 'acme'",
                {"job_id": job_id, "tenant": "acme"},
            ),
            (
                "maintenance.progress",
                f"jobs/{job_id} QUEUED 0% ",
                {"job_id": job_id, "state": "QUEUED", "progress": 0.0, "progress_message": ""},
            ),
            (
                "maintenance.progress",
                f"jobs/{job_id} FAILED 50% half",
                {"job_id": job_id, "state": "FAILED", "progress": 0.5, "progress_message": "half"},
            ),
            ("command.failed", "error: INTERNAL: disk full", {"error": "INTERNAL: disk full"}),
        ],
    )


async def test_the_commands_log_warnings_up_in_the_configured_format(
    tenants: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No JOBPLANE_LOG_LEVEL: warnings and worse only; JOBPLANE_LOG_FORMAT is kept."""
    import structlog

    monkeypatch.delenv("JOBPLANE_LOG_LEVEL", raising=False)
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    assert await tenants("list") == (0, "", "")
    log = structlog.get_logger("jobplane.test")
    log.info("not shown")
    log.warning("shown", n=1)
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["event"] == "shown"
