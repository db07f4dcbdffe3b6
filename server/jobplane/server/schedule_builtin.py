"""Built-in schedules: jobplane's own retention, without an external crontab (ADR-0041).

Every tenant with a retention horizon (``jobplane tenants set-retention``) gets
``schedules/jobplane-retention``: ``maintenance.retention`` once a day at
03:15 UTC, spread over half an hour by its jitter so that tenants do not all
start at once, catching up once after downtime. The server installs them
when it starts, and ``tenants set-retention`` when a horizon is set (or
removes the schedule when it is lifted). Installing is idempotent: a tenant
that has the schedule keeps it as it is, changes included (pause it to stop
it; delete it and it comes back at the next start while the horizon is set).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.errors import ScheduleNotFound
from jobplane.schedule_spec import CatchUp, Overlap, Spec
from jobplane.schedule_types import JobTemplate, Schedule
from jobplane.store.schedules import ScheduleStore
from jobplane.topology import Topology

#: The id of the built-in retention schedule in each tenant.
RETENTION_SCHEDULE_ID = "jobplane-retention"
#: jobplane.workers.maintenance.RETENTION (the server imports no worker module for it).
RETENTION_TYPE = "maintenance.retention"

_TENANTS = text(
    "SELECT id, retention_days FROM tenants "
    "WHERE CAST(:tenant_id AS uuid) IS NULL OR id = :tenant_id ORDER BY id"
)


def retention_schedule() -> Schedule:
    """The built-in retention schedule of a tenant."""
    return Schedule(
        name=f"schedules/{RETENTION_SCHEDULE_ID}",
        template=JobTemplate(type=RETENTION_TYPE),
        spec=Spec(cron="15 3 * * *", time_zone="UTC", jitter_seconds=1800),
        description="built in: maintenance.retention daily, while the tenant has a horizon",
        overlap=Overlap.SKIP,
        catch_up=CatchUp.ONE,
    )


@dataclass(frozen=True, slots=True)
class Installed:
    """What :func:`sync_retention_schedules` changed."""

    created: int = 0
    removed: int = 0


async def sync_retention_schedules(
    engine: AsyncEngine, topology: Topology, tenant_id: uuid.UUID | None = None
) -> Installed:
    """Give each tenant with a horizon (or only ``tenant_id``) its retention schedule,
    and take it from those without one. Nothing when the topology routes no
    ``maintenance.retention``."""
    if topology.route(RETENTION_TYPE) is None:
        return Installed()
    store = ScheduleStore(engine)
    async with engine.connect() as conn:
        tenants = (await conn.execute(_TENANTS, {"tenant_id": tenant_id})).all()
    created = removed = 0
    for tenant, days in tenants:
        if days is not None:
            created += await store.ensure(tenant, retention_schedule())
            continue
        try:
            await store.delete(tenant, RETENTION_SCHEDULE_ID)
        except ScheduleNotFound:
            continue
        removed += 1
    return Installed(created=created, removed=removed)
