"""The schedules table: create, read, list, change and delete a tenant's schedules.

Every statement is scoped by tenant, as the job table's are. The ticking (and
a triggered run) is :mod:`jobplane.store.schedule_ticks`: a run's job and the
schedule's advance commit together there.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.errors import ScheduleExists, ScheduleNotFound
from jobplane.names import job_name
from jobplane.schedule_spec import CatchUp, Overlap, Spec, jitter_of, next_tick
from jobplane.schedule_types import JobTemplate, Schedule
from jobplane.store.rows import dumps

__all__ = ["COLUMN_NAMES", "ScheduleCursor", "ScheduleStore", "schedule_from_row", "timing"]

#: A page's position: the last schedule's (create_time, id).
ScheduleCursor = tuple[datetime, str]

COLUMN_NAMES = (
    *("id", "uid", "description", "job_type", "payload", "labels", "max_attempts"),
    *("timeout_seconds", "cron", "time_zone", "interval_seconds", "start_time", "end_time"),
    *("jitter_seconds", "overlap", "catch_up", "catch_up_limit", "paused", "anchor_time"),
    *("next_tick", "next_run_time", "buffered_tick", "last_run_time", "recent_runs", "runs"),
    *("skipped", "last_error", "create_time", "update_time"),
)
SCHEDULE_COLUMNS = ", ".join(COLUMN_NAMES)
# What a create or an update writes (the rest is the ticker's).
_WRITTEN = (
    "description",
    "job_type",
    "payload",
    "labels",
    "max_attempts",
    "timeout_seconds",
    "cron",
    "time_zone",
    "interval_seconds",
    "start_time",
    "end_time",
    "jitter_seconds",
    "overlap",
    "catch_up",
    "catch_up_limit",
    "paused",
    "anchor_time",
    "next_tick",
    "next_run_time",
)


def _bind(column: str) -> str:
    """The bind of a written column (its JSON as jsonb)."""
    return f"CAST(:{column} AS jsonb)" if column in ("payload", "labels") else f":{column}"


_INSERT = text(
    f"""
    INSERT INTO schedules (tenant_id, id, uid, {", ".join(_WRITTEN)})
    VALUES (:tenant_id, :id, :uid, {", ".join(_bind(c) for c in _WRITTEN)})
    ON CONFLICT (tenant_id, id) DO NOTHING
    RETURNING {SCHEDULE_COLUMNS}
    """
)
_UPDATE = text(
    f"""
    UPDATE schedules SET {", ".join(f"{c} = {_bind(c)}" for c in _WRITTEN)},
        buffered_tick = CASE WHEN :paused THEN NULL ELSE buffered_tick END,
        update_time = now()
    WHERE tenant_id = :tenant_id AND id = :id
    RETURNING {SCHEDULE_COLUMNS}
    """
)
_SELECT = text(
    f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE tenant_id = :tenant_id AND id = :id"
)
_SELECT_FOR_UPDATE = text(
    f"SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE tenant_id = :tenant_id AND id = :id FOR UPDATE"
)
_LIST = text(
    f"""
    SELECT {SCHEDULE_COLUMNS} FROM schedules
    WHERE tenant_id = :tenant_id
      AND (CAST(:after_time AS timestamptz) IS NULL OR (create_time, id) < (:after_time, :after_id))
    ORDER BY create_time DESC, id DESC
    LIMIT :limit
    """
)
_DELETE = text("DELETE FROM schedules WHERE tenant_id = :tenant_id AND id = :id")


def timing(
    uid: str, spec: Spec, anchor: datetime, after: datetime
) -> tuple[datetime | None, datetime | None]:
    """The next tick after ``after`` and when its run starts (the tick and its jitter)."""
    tick = next_tick(spec, anchor, after)
    if tick is None:
        return None, None
    return tick, tick + jitter_of(uid, tick, spec.jitter_seconds)


def schedule_from_row(row: Mapping[Any, Any]) -> Schedule:
    """A row of ``schedules`` (SCHEDULE_COLUMNS) as a :class:`Schedule`."""
    return Schedule(
        name=f"schedules/{row['id']}",
        template=JobTemplate(
            type=row["job_type"],
            payload=dict(row["payload"]),
            labels=dict(row["labels"]),
            max_attempts=row["max_attempts"],
            timeout_seconds=row["timeout_seconds"],
        ),
        spec=Spec(
            cron=row["cron"],
            time_zone=row["time_zone"],
            interval_seconds=row["interval_seconds"],
            start_time=row["start_time"],
            end_time=row["end_time"],
            jitter_seconds=row["jitter_seconds"],
        ),
        description=row["description"],
        overlap=Overlap(row["overlap"]),
        catch_up=CatchUp(row["catch_up"]),
        catch_up_limit=row["catch_up_limit"],
        paused=row["paused"],
        next_run_time=None if row["paused"] else row["next_run_time"],
        last_run_time=row["last_run_time"],
        recent_runs=tuple(job_name(job_id) for job_id in row["recent_runs"]),
        runs=row["runs"],
        skipped=row["skipped"],
        last_error=row["last_error"],
        create_time=row["create_time"],
        update_time=row["update_time"],
    )


def _binds(schedule: Schedule, anchor: datetime, uid: str, now: datetime) -> dict[str, Any]:
    """The written columns of ``schedule``, its next tick computed from ``now``."""
    tick, run = timing(uid, schedule.spec, anchor, now)
    spec, template = schedule.spec, schedule.template
    return {
        "description": schedule.description,
        "job_type": template.type,
        "payload": dumps(template.payload),
        "labels": dumps(template.labels),
        "max_attempts": template.max_attempts,
        "timeout_seconds": template.timeout_seconds,
        "cron": spec.cron,
        "time_zone": spec.time_zone,
        "interval_seconds": spec.interval_seconds,
        "start_time": spec.start_time,
        "end_time": spec.end_time,
        "jitter_seconds": spec.jitter_seconds,
        "overlap": schedule.overlap.value,
        "catch_up": schedule.catch_up.value,
        "catch_up_limit": schedule.catch_up_limit,
        "paused": schedule.paused,
        "anchor_time": anchor,
        "next_tick": tick,
        "next_run_time": run,
    }


class ScheduleStore:
    """A tenant's schedules, one short transaction each."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def create(self, tenant_id: uuid.UUID, schedule: Schedule) -> Schedule:
        """Write ``schedule`` (first tick after now); :class:`ScheduleExists` if its id is taken."""
        now = datetime.now(UTC)
        uid = uuid.uuid4()
        anchor = schedule.spec.start_time or now
        binds = {"tenant_id": tenant_id, "id": schedule.id, "uid": uid}
        binds |= _binds(schedule, anchor, str(uid), now)
        async with self._engine.begin() as conn:
            row = (await conn.execute(_INSERT, binds)).mappings().first()
        if row is None:
            raise ScheduleExists(f"{schedule.name} exists already", field="schedule_id")
        return schedule_from_row(row)

    async def ensure(self, tenant_id: uuid.UUID, schedule: Schedule) -> bool:
        """Create ``schedule`` unless the tenant has one of its id; whether it was created."""
        try:
            await self.create(tenant_id, schedule)
        except ScheduleExists:
            return False
        return True

    async def get(self, tenant_id: uuid.UUID, schedule_id: str) -> Schedule:
        """One schedule; :class:`ScheduleNotFound` otherwise."""
        async with self._engine.connect() as conn:
            row = await _row(conn, _SELECT, tenant_id, schedule_id)
        return schedule_from_row(row)

    async def list(
        self, tenant_id: uuid.UUID, *, limit: int, after: ScheduleCursor | None
    ) -> list[Schedule]:
        """Newest first, after ``after``."""
        binds = {
            "tenant_id": tenant_id,
            "limit": limit,
            "after_time": after[0] if after else None,
            "after_id": after[1] if after else "",
        }
        async with self._engine.connect() as conn:
            rows = (await conn.execute(_LIST, binds)).mappings().all()
        return [schedule_from_row(row) for row in rows]

    async def update(
        self,
        tenant_id: uuid.UUID,
        schedule_id: str,
        change: Callable[[Schedule], Schedule],
    ) -> Schedule:
        """``change`` applied to the stored schedule, under its lock.

        A changed spec counts its interval from now and ticks next after now
        (as a resumed schedule does); an unchanged one keeps its next tick.
        """
        now = datetime.now(UTC)
        async with self._engine.begin() as conn:
            row = await _row(conn, _SELECT_FOR_UPDATE, tenant_id, schedule_id)
            current = schedule_from_row(row)
            updated = change(current)
            uid = str(row["uid"])
            moved = updated.spec != current.spec or (current.paused and not updated.paused)
            anchor = (updated.spec.start_time or now) if moved else row["anchor_time"]
            binds = {"tenant_id": tenant_id, "id": schedule_id}
            binds |= _binds(updated, anchor, uid, now)
            if not moved:
                binds |= {"next_tick": row["next_tick"], "next_run_time": row["next_run_time"]}
            written = (await conn.execute(_UPDATE, binds)).mappings().one()
        return schedule_from_row(written)

    async def delete(self, tenant_id: uuid.UUID, schedule_id: str) -> None:
        """Delete it (the jobs it started stay); :class:`ScheduleNotFound` otherwise."""
        async with self._engine.begin() as conn:
            done = await conn.execute(_DELETE, {"tenant_id": tenant_id, "id": schedule_id})
        if not done.rowcount:
            raise ScheduleNotFound(f"schedules/{schedule_id} not found")


async def _row(
    conn: AsyncConnection, statement: Any, tenant_id: uuid.UUID, schedule_id: str
) -> Mapping[Any, Any]:
    row = (
        (await conn.execute(statement, {"tenant_id": tenant_id, "id": schedule_id}))
        .mappings()
        .first()
    )
    if row is None:
        raise ScheduleNotFound(f"schedules/{schedule_id} not found")
    return row
