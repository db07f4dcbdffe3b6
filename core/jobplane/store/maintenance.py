"""The SQL of the maintenance jobs: tenants' retention horizons, and deletion in batches.

Every statement names one tenant and deletes at most one batch, in a
transaction of its own: a run can stop anywhere (a crash, a timeout, a
shutdown) and the next one starts from what is left. Nothing here changes
a job's state; deleting a job is not a transition of the state machine
(ADR-0010): it appends nothing, and only a finished job, locked and
re-checked in the deleting statement, is ever deleted (ADR-0022).

What may go:

- a finished job (SUCCEEDED, FAILED, CANCELLED) with its ``job_events``,
  ``job_stages``, outbox rows and references to blobs (``job_blobs``). A job
  locked by someone else (a RetryJob under way) is skipped, not waited for;
- an event (``events``) the relays have published: at or behind the feed's
  position (ADR-0016). Events after it are still to reach the broker;
  retention never deletes them, erasure does (nothing of the tenant may be
  published after it);
- an outbox row of no job (a parked event) once published; erasure deletes
  them published or not.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.errors import TenantNotFound
from jobplane.store.engine import autocommit
from jobplane.store.machine import state_is
from jobplane.types import TERMINAL_STATES, JobState

#: Longest retention horizon a tenant may have (about a century).
MAX_RETENTION_DAYS = 36500

_FINISHED = state_is(*sorted(TERMINAL_STATES, key=lambda s: list(JobState).index(s)))
_LIVE_J = state_is(JobState.QUEUED, JobState.RUNNING, column="j.state")

# A job another job that has not ended depends on (ADR-0045: a job that
# runs after it; ADR-0047: a fan-out's job, whose join reads its children's
# results through the edges) is kept until that one ends.
_NOT_NEEDED = f"""NOT (has_dependents AND EXISTS (
        SELECT 1 FROM job_dependencies d JOIN jobs w ON w.id = d.job_id
        WHERE d.depends_on = jobs.id
          AND {state_is(JobState.QUEUED, JobState.RUNNING, column="w.state")}))"""

# A batch is at most :limit jobs and, past the first job, at most :max_rows
# of their events: a job that reported progress ten thousand times is a
# batch of its own instead of making one transaction of millions of rows.
# ``create_time < :cutoff`` is implied by ``end_time < :cutoff``; said, it
# lets the (tenant_id, state, create_time) index find the candidates. The
# lock is taken with SKIP LOCKED and the WHERE is re-checked on the locked
# row: a job that a RetryJob is moving back to QUEUED is not deleted.
_DELETE_JOBS = f"""
WITH candidates AS (
    SELECT id, create_time, last_seq FROM jobs
    WHERE tenant_id = :tenant_id AND {_FINISHED} AND id <> :keep
      {{age}} AND {_NOT_NEEDED}
    ORDER BY create_time, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM (
        SELECT id, row_number() OVER w AS n, sum(last_seq + 1) OVER w AS upto
        FROM candidates WINDOW w AS (ORDER BY create_time, id)
    ) c
    WHERE n = 1 OR upto <= :max_rows
), gone_events AS (
    DELETE FROM job_events e USING picked p
    WHERE e.job_id = p.id AND e.tenant_id = :tenant_id RETURNING 1
), gone_stages AS (
    DELETE FROM job_stages s USING picked p
    WHERE s.job_id = p.id AND s.tenant_id = :tenant_id RETURNING 1
), gone_outbox AS (
    DELETE FROM outbox o USING picked p
    WHERE o.job_id = p.id AND o.tenant_id = :tenant_id RETURNING 1
), gone_refs AS (
    DELETE FROM job_blobs b USING picked p
    WHERE b.job_id = p.id AND b.tenant_id = :tenant_id RETURNING 1
), gone_jobs AS (
    DELETE FROM jobs j USING picked p
    WHERE j.id = p.id AND j.tenant_id = :tenant_id RETURNING 1
)
SELECT (SELECT count(*) FROM gone_jobs) AS jobs,
       (SELECT count(*) FROM gone_events) AS job_events,
       (SELECT count(*) FROM gone_stages) AS job_stages,
       (SELECT count(*) FROM gone_outbox) AS outbox,
       (SELECT count(*) FROM gone_refs) AS job_blobs
"""
_AGE = "AND create_time < :cutoff AND end_time < :cutoff"
_DELETE_OLD_JOBS = text(_DELETE_JOBS.format(age=_AGE))
_DELETE_FINISHED_JOBS = text(_DELETE_JOBS.format(age=""))
_COUNT_OLD_JOBS = text(
    f"""
    SELECT count(*) FROM jobs
    WHERE tenant_id = :tenant_id AND {_FINISHED} AND id <> :keep {_AGE} AND {_NOT_NEEDED}
    """
)
_COUNT_JOBS = text("SELECT count(*) FROM jobs WHERE tenant_id = :tenant_id AND id <> :keep")
_LIVE_JOBS = text(
    f"""
    SELECT j.id, j.type, (j.create_time, j.id) < (k.create_time, k.id) AS older
    FROM jobs j, jobs k
    WHERE j.tenant_id = :tenant_id AND {_LIVE_J} AND j.id <> :keep AND k.id = :keep
    ORDER BY j.create_time, j.id LIMIT :limit
    """
)

# Published: at or behind the feed's position, the (txid, seq) of the last
# event the relays published (ADR-0016). No position, nothing published.
_DELETE_PUBLISHED_EVENTS = text(
    """
    WITH picked AS (
        SELECT e.event_id FROM events e, event_relay r
        WHERE e.tenant_id = :tenant_id AND (e.txid, e.seq) <= (r.txid, r.seq)
          AND e.create_time < :cutoff
        ORDER BY e.txid, e.seq
        LIMIT :limit
    )
    DELETE FROM events e USING picked p
    WHERE e.tenant_id = :tenant_id AND e.event_id = p.event_id
    """
)
# Erasure: every event of the tenant but those of the erasing job itself
# (its receipt: job.queued, job.started, and the job.succeeded to come).
_DELETE_ALL_EVENTS = text(
    """
    WITH picked AS (
        SELECT event_id FROM events
        WHERE tenant_id = :tenant_id AND job_id IS DISTINCT FROM :keep
        LIMIT :limit
    )
    DELETE FROM events e USING picked p
    WHERE e.tenant_id = :tenant_id AND e.event_id = p.event_id
    """
)
_DELETE_PUBLISHED_EVENT_ROWS = text(
    """
    WITH picked AS (
        SELECT id FROM outbox
        WHERE tenant_id = :tenant_id AND job_id IS NULL AND create_time < :cutoff
          AND published_at IS NOT NULL
        LIMIT :limit
    )
    DELETE FROM outbox o USING picked p WHERE o.id = p.id AND o.tenant_id = :tenant_id
    """
)
_DELETE_ALL_EVENT_ROWS = text(
    """
    WITH picked AS (
        SELECT id FROM outbox WHERE tenant_id = :tenant_id AND job_id IS NULL LIMIT :limit
    )
    DELETE FROM outbox o USING picked p WHERE o.id = p.id AND o.tenant_id = :tenant_id
    """
)

_DELETE_SCHEDULES = text("DELETE FROM schedules WHERE tenant_id = :tenant_id")
_BLOB_COUNT = text("SELECT count(*) FROM blobs WHERE tenant_id = :tenant_id")
_TENANT_COLUMNS = "id, name, retention_days, dispatch_weight"
_TENANT = text(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE id = :tenant_id")
_TENANT_BY_NAME = text(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE name = :name")
_CUTOFF = text("SELECT now() - make_interval(days => :days)")
_TENANTS = text(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")
_SET_RETENTION = text(
    f"UPDATE tenants SET retention_days = :days WHERE name = :name RETURNING {_TENANT_COLUMNS}"
)
# Read by the relay's next claim: a change takes effect at once, on every relay.
_SET_WEIGHT = text(
    f"UPDATE tenants SET dispatch_weight = :weight WHERE name = :name RETURNING {_TENANT_COLUMNS}"
)
#: A tenant's dispatch weight: 1 (every tenant's default) to this.
MAX_DISPATCH_WEIGHT = 1000

#: Every table of a tenant's data, and the rows of it left after an erasure
#: besides the erasing job's own (its receipt).
_LEFT = {
    "jobs": "SELECT count(*) FROM jobs WHERE tenant_id = :tenant_id AND id <> :keep",
    "job_events": (
        "SELECT count(*) FROM job_events WHERE tenant_id = :tenant_id AND job_id <> :keep"
    ),
    "job_stages": (
        "SELECT count(*) FROM job_stages WHERE tenant_id = :tenant_id AND job_id <> :keep"
    ),
    "outbox": (
        "SELECT count(*) FROM outbox WHERE tenant_id = :tenant_id AND job_id IS DISTINCT FROM :keep"
    ),
    "events": (
        "SELECT count(*) FROM events WHERE tenant_id = :tenant_id AND job_id IS DISTINCT FROM :keep"
    ),
    # A blob uploaded while the erasure ran (its row is written after its
    # object): the next attempt deletes it with the rest.
    "blobs": (
        "SELECT count(*) FROM blobs b WHERE b.tenant_id = :tenant_id AND NOT EXISTS ("
        " SELECT 1 FROM job_blobs r WHERE r.tenant_id = b.tenant_id AND r.digest = b.digest"
        " AND r.job_id = :keep)"
    ),
}


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant, its retention horizon (None: kept for ever) and its dispatch weight."""

    id: uuid.UUID
    name: str
    retention_days: int | None
    #: Its share of a queue's credit against the other tenants waiting there (ADR-0042).
    dispatch_weight: int = 1


@dataclass(frozen=True, slots=True)
class LiveJob:
    """A QUEUED or RUNNING job; ``older``: submitted before the job asking."""

    id: uuid.UUID
    type: str
    older: bool


@dataclass(frozen=True, slots=True)
class DeletedJobs:
    """What one batch of job deletions removed."""

    jobs: int = 0
    job_events: int = 0
    job_stages: int = 0
    outbox: int = 0
    #: References to blobs (``job_blobs``): a blob no job references any more
    #: is collected by age (its own ``touched_at``).
    job_blobs: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts by table."""
        return {
            "jobs": self.jobs,
            "job_events": self.job_events,
            "job_stages": self.job_stages,
            "outbox": self.outbox,
            "job_blobs": self.job_blobs,
        }


def check_retention_days(days: int | None) -> None:
    """ValueError unless ``days`` is None (for ever) or 1..36500."""
    if days is None:
        return
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_RETENTION_DAYS:
        raise ValueError(f"retention days must be 1..{MAX_RETENTION_DAYS}, got {days}")


def check_dispatch_weight(weight: int) -> None:
    """ValueError unless ``weight`` is a whole number 1..1000."""
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int)
        or not 1 <= weight <= MAX_DISPATCH_WEIGHT
    ):
        raise ValueError(f"dispatch weight must be 1..{MAX_DISPATCH_WEIGHT}, got {weight!r}")


class MaintenanceStore:
    """Tenants' horizons and the deleting statements, one short transaction each.

    ``keep`` is the job that must survive whatever a statement deletes: the
    maintenance job that runs it.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._auto = autocommit(engine)

    # -- tenants ---------------------------------------------------------------

    async def tenant(self, tenant_id: uuid.UUID) -> Tenant:
        """The tenant of ``tenant_id`` (:class:`TenantNotFound` when there is none)."""
        return await self._tenant(_TENANT, {"tenant_id": tenant_id}, str(tenant_id))

    async def tenant_named(self, name: str) -> Tenant:
        """The tenant called ``name`` (:class:`TenantNotFound` when there is none)."""
        return await self._tenant(_TENANT_BY_NAME, {"name": name}, name)

    async def tenants(self) -> list[Tenant]:
        """Every tenant, by name."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(_TENANTS)).all()
        return [_tenant(row) for row in rows]

    async def set_retention(self, name: str, days: int | None) -> Tenant:
        """Set the horizon of the tenant called ``name`` (None: keep for ever)."""
        check_retention_days(days)
        async with self._auto.connect() as conn:
            row = (await conn.execute(_SET_RETENTION, {"name": name, "days": days})).first()
        if row is None:
            raise TenantNotFound(f"no tenant {name!r}", field="tenant")
        return _tenant(row)

    async def set_weight(self, name: str, weight: int) -> Tenant:
        """Set the dispatch weight of the tenant called ``name`` (1 to 1000)."""
        check_dispatch_weight(weight)
        async with self._auto.connect() as conn:
            row = (await conn.execute(_SET_WEIGHT, {"name": name, "weight": weight})).first()
        if row is None:
            raise TenantNotFound(f"no tenant {name!r}", field="tenant")
        return _tenant(row)

    async def _tenant(self, statement: Any, params: dict[str, Any], what: str) -> Tenant:
        async with self._auto.connect() as conn:
            row = (await conn.execute(statement, params)).first()
        if row is None:
            raise TenantNotFound(f"no tenant {what!r}", field="tenant")
        return _tenant(row)

    # -- retention -------------------------------------------------------------

    async def cutoff(self, days: int) -> datetime:
        """``days`` before now, by the database's clock (the one end_time is written by)."""
        async with self._auto.connect() as conn:
            found: datetime = (await conn.execute(_CUTOFF, {"days": days})).scalar_one()
        return found

    async def count_expired_jobs(
        self, tenant_id: uuid.UUID, cutoff: datetime, *, keep: uuid.UUID
    ) -> int:
        """Finished jobs of the tenant that ended before ``cutoff``."""
        params = {"tenant_id": tenant_id, "cutoff": cutoff, "keep": keep}
        async with self._auto.connect() as conn:
            return int((await conn.execute(_COUNT_OLD_JOBS, params)).scalar_one())

    async def delete_expired_jobs(
        self,
        tenant_id: uuid.UUID,
        cutoff: datetime,
        *,
        keep: uuid.UUID,
        limit: int,
        max_rows: int,
    ) -> DeletedJobs:
        """One batch: finished jobs that ended before ``cutoff``, with their rows."""
        params = {"tenant_id": tenant_id, "cutoff": cutoff}
        return await self._delete_jobs(_DELETE_OLD_JOBS, params, keep, limit, max_rows)

    async def delete_published_events(
        self, tenant_id: uuid.UUID, cutoff: datetime, *, limit: int
    ) -> int:
        """One batch: published events created before ``cutoff``."""
        params = {"tenant_id": tenant_id, "cutoff": cutoff, "limit": limit}
        return await self._rowcount(_DELETE_PUBLISHED_EVENTS, params)

    async def delete_published_event_rows(
        self, tenant_id: uuid.UUID, cutoff: datetime, *, limit: int
    ) -> int:
        """One batch: published outbox rows of no job, created before ``cutoff``."""
        params = {"tenant_id": tenant_id, "cutoff": cutoff, "limit": limit}
        return await self._rowcount(_DELETE_PUBLISHED_EVENT_ROWS, params)

    # -- erasure ---------------------------------------------------------------

    async def live_jobs(
        self, tenant_id: uuid.UUID, *, keep: uuid.UUID, limit: int = 1000
    ) -> list[LiveJob]:
        """Up to ``limit`` QUEUED or RUNNING jobs of the tenant, oldest first."""
        params = {"tenant_id": tenant_id, "keep": keep, "limit": limit}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(_LIVE_JOBS, params)).all()
        return [LiveJob(uuid.UUID(str(r[0])), str(r[1]), bool(r[2])) for r in rows]

    async def count_jobs(self, tenant_id: uuid.UUID, *, keep: uuid.UUID) -> int:
        """Jobs of the tenant in any state, ``keep`` aside."""
        async with self._auto.connect() as conn:
            found = await conn.execute(_COUNT_JOBS, {"tenant_id": tenant_id, "keep": keep})
            return int(found.scalar_one())

    async def delete_finished_jobs(
        self, tenant_id: uuid.UUID, *, keep: uuid.UUID, limit: int, max_rows: int
    ) -> DeletedJobs:
        """One batch: finished jobs of the tenant whatever their age, with their rows."""
        params = {"tenant_id": tenant_id}
        return await self._delete_jobs(_DELETE_FINISHED_JOBS, params, keep, limit, max_rows)

    async def delete_all_events(self, tenant_id: uuid.UUID, *, keep: uuid.UUID, limit: int) -> int:
        """One batch: events of the tenant, published or not, but ``keep``'s."""
        params = {"tenant_id": tenant_id, "keep": keep, "limit": limit}
        return await self._rowcount(_DELETE_ALL_EVENTS, params)

    async def delete_all_event_rows(self, tenant_id: uuid.UUID, *, limit: int) -> int:
        """One batch: outbox rows of no job of the tenant, published or not."""
        return await self._rowcount(
            _DELETE_ALL_EVENT_ROWS, {"tenant_id": tenant_id, "limit": limit}
        )

    async def blob_count(self, tenant_id: uuid.UUID) -> int:
        """Blobs (rows) of the tenant."""
        async with self._auto.connect() as conn:
            return int((await conn.execute(_BLOB_COUNT, {"tenant_id": tenant_id})).scalar_one())

    async def delete_schedules(self, tenant_id: uuid.UUID) -> int:
        """Delete the tenant's recurring schedules (erasure: none may start a job after it)."""
        return await self._rowcount(_DELETE_SCHEDULES, {"tenant_id": tenant_id})

    async def left(self, tenant_id: uuid.UUID, *, keep: uuid.UUID) -> dict[str, int]:
        """Rows of the tenant in each table, ``keep``'s own aside."""
        params = {"tenant_id": tenant_id, "keep": keep}
        async with self._auto.connect() as conn:
            return {
                table: int((await conn.execute(text(sql), params)).scalar_one())
                for table, sql in _LEFT.items()
            }

    # -- helpers ---------------------------------------------------------------

    async def _delete_jobs(
        self,
        statement: Any,
        params: dict[str, Any],
        keep: uuid.UUID,
        limit: int,
        max_rows: int,
    ) -> DeletedJobs:
        params = {**params, "keep": keep, "limit": limit, "max_rows": max_rows}
        async with self._auto.connect() as conn:
            row = (await conn.execute(statement, params)).mappings().one()
        return DeletedJobs(
            jobs=int(row["jobs"]),
            job_events=int(row["job_events"]),
            job_stages=int(row["job_stages"]),
            outbox=int(row["outbox"]),
            job_blobs=int(row["job_blobs"]),
        )

    async def _rowcount(self, statement: Any, params: dict[str, Any]) -> int:
        async with self._auto.connect() as conn:
            result = await conn.execute(statement, params)
            return int(result.rowcount)


def _tenant(row: Any) -> Tenant:
    return Tenant(
        id=uuid.UUID(str(row[0])),
        name=str(row[1]),
        retention_days=None if row[2] is None else int(row[2]),
        dispatch_weight=int(row[3]),
    )
