"""A worker killed in the middle of a big retention run; the run completes on another.

Real processes: `jobplane serve`, `relay` and `worker` (which runs the maintenance
handlers by default), the operator's `jobplane tenants` commands.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.maintenance import MaintenanceStore
from tests.faults.cluster import ROOT, Cluster
from tests.support.aged import aged_jobs
from tests.support.stack import eventually


async def _jobplane(cluster: Cluster, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env=cluster.env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def _count(engine: AsyncEngine, ids: list[uuid.UUID]) -> int:
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT count(*) FROM jobs WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return int(found.scalar_one())


async def test_retention_killed_mid_run_completes_on_a_new_worker(
    cluster: Cluster, engine: AsyncEngine
) -> None:
    await cluster.server()
    await cluster.relay()
    crashing = await cluster.worker(faults="crash:maintenance.retention.batch@3", lease=1.0)
    async with engine.begin() as conn:
        tenant = (
            await conn.execute(text("SELECT id FROM tenants WHERE name = 'faults'"))
        ).scalar_one()
        other = (
            await conn.execute(text("INSERT INTO tenants (name) VALUES ('other') RETURNING id"))
        ).scalar_one()
    old = await aged_jobs(engine, tenant, 5000, events=3, age_days=40)
    young = await aged_jobs(engine, tenant, 10, age_days=3)
    foreign = await aged_jobs(engine, other, 100, age_days=40)

    await MaintenanceStore(engine).set_retention("faults", 30)
    code, out, err = await _jobplane(cluster, "tenants", "retention", "faults")
    assert code == 0, err
    name = out.strip()
    assert name.startswith("jobs/"), out
    job_id = uuid.UUID(name.partition("/")[2])

    # Killed (os._exit, as SIGKILL) right after its third batch committed.
    assert await crashing.wait(timeout=60) == 137
    assert await _count(engine, old) == 5000 - 3 * 1000

    await cluster.worker(lease=1.0)

    async def state() -> str:
        async with engine.connect() as conn:
            found = await conn.execute(
                text("SELECT state FROM jobs WHERE id = :id"), {"id": job_id}
            )
            return str(found.scalar_one())

    async def ended() -> bool:
        return await state() in ("succeeded", "failed", "cancelled")

    await eventually(ended, timeout=30)
    assert await state() == "succeeded"
    assert await _count(engine, old) == 0
    assert await _count(engine, young) == 10
    assert await _count(engine, foreign) == 100
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT count(*) FROM job_events WHERE job_id = ANY(:ids)"), {"ids": old}
        )
        assert found.scalar_one() == 0

    # The operator's command again the same day: the same run, not a second one.
    code, out, err = await _jobplane(cluster, "tenants", "retention", "faults", "--wait")
    assert code == 0, err
    assert out.splitlines()[0] == name
