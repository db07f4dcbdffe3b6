"""The topology's routes and the payload limit, in the database for ``jobplane.submit_job``.

The SQL function cannot read the topology file or the server's settings, so
``job_routes`` and ``submit_settings`` hold what it needs to decide as
``JobService.submit`` does: which queue takes a job type (the first queue, in
the file's order, one of whose binding patterns matches), that queue's
default max_attempts and attempt timeout, and the payload limit.

:func:`sync_submit_rules` writes them. ``jobplane migrate``, ``jobplane
topology apply`` and every server start call it; it writes nothing when the
rows already say what the topology says, so it can run at every start. Two
servers with different topologies (a rolling change) take turns: the last
one started wins, as it would for the RPCs it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS
from jobplane.store.flow_sync import sync_flow_limits
from jobplane.store.lifecycle_publish import sync_lifecycle_publish
from jobplane.topics import topic_regex
from jobplane.topology import Topology

# Any fixed number: the key of the advisory lock that orders concurrent syncs.
_SYNC_LOCK = 0x6A70_726F_7574  # "jprout"

_LOCK = text("SELECT pg_advisory_xact_lock(:key)")
_READ_ROUTES = text(
    "SELECT rank, queue, pattern, regex, max_attempts, timeout_seconds FROM job_routes "
    "ORDER BY rank"
)
_READ_PIPELINES = text("SELECT name FROM job_pipelines ORDER BY name")
_CLEAR_PIPELINES = text("DELETE FROM job_pipelines")
_INSERT_PIPELINE = text("INSERT INTO job_pipelines (name) VALUES (:name)")
_READ_LIMIT = text(
    "SELECT max_payload_bytes, lifecycle_events, max_schedule_seconds FROM submit_settings"
)
_CLEAR_ROUTES = text("DELETE FROM job_routes")
_INSERT_ROUTE = text(
    "INSERT INTO job_routes (rank, queue, pattern, regex, max_attempts, timeout_seconds) "
    "VALUES (:rank, :queue, :pattern, :regex, :max_attempts, :timeout_seconds)"
)
_WRITE_LIMIT = text(
    "INSERT INTO submit_settings (singleton, max_payload_bytes, lifecycle_events, "
    "max_schedule_seconds) VALUES (true, :limit, :lifecycle, :horizon) "
    "ON CONFLICT (singleton) DO UPDATE SET max_payload_bytes = EXCLUDED.max_payload_bytes, "
    "lifecycle_events = EXCLUDED.lifecycle_events, "
    "max_schedule_seconds = EXCLUDED.max_schedule_seconds, update_time = now()"
)


@dataclass(frozen=True, slots=True)
class Route:
    """One binding of one queue, in the order ``Topology.route`` tries them."""

    rank: int
    queue: str
    pattern: str
    regex: str
    max_attempts: int
    timeout_seconds: float


def routes_of(topology: Topology) -> list[Route]:
    """The rows ``job_routes`` holds for ``topology``."""
    routes: list[Route] = []
    for queue in topology.queues:
        for pattern in queue.bindings:
            routes.append(
                Route(
                    rank=len(routes) + 1,
                    queue=queue.name,
                    pattern=pattern,
                    regex=topic_regex(pattern),
                    max_attempts=queue.max_attempts,
                    timeout_seconds=float(queue.timeout_seconds),
                )
            )
    return routes


async def sync_submit_rules(
    engine: AsyncEngine | AsyncConnection,
    topology: Topology,
    *,
    max_payload_bytes: int,
    lifecycle_events: bool = True,
    max_schedule_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
) -> bool:
    """Make ``job_routes`` and ``submit_settings`` say what ``topology`` and the limits say.

    ``lifecycle_events``: whether ``jobplane.submit_job`` writes ``job.queued``
    as the servers do (the process passes its settings' ``lifecycle_events``);
    ``max_schedule_seconds``: how far ahead it lets a job be scheduled.
    Returns whether anything was written. Needs only SELECT, INSERT, UPDATE
    and DELETE on the tables (the servers' database role has them); also
    writes the flow limits (``flow_limits``, ``queue_limits``: ADR-0043) and
    the lifecycle events the relays publish (``lifecycle_publish``: ADR-0052).
    """
    wanted = routes_of(topology)
    pipelines = sorted(p.name for p in topology.pipelines)
    limits = _Limits(max_payload_bytes, lifecycle_events, float(max_schedule_seconds))
    if isinstance(engine, AsyncConnection):
        return await _sync(engine, topology, wanted, pipelines, limits)
    async with engine.begin() as conn:
        return await _sync(conn, topology, wanted, pipelines, limits)


@dataclass(frozen=True, slots=True)
class _Limits:
    """The row of ``submit_settings``."""

    max_payload_bytes: int
    lifecycle_events: bool
    max_schedule_seconds: float


async def _sync(
    conn: AsyncConnection,
    topology: Topology,
    wanted: list[Route],
    pipelines: list[str],
    limits: _Limits,
) -> bool:
    await conn.execute(_LOCK, {"key": _SYNC_LOCK})
    # The flow limits (ADR-0043): the next claim reads them.
    flows_changed = await sync_flow_limits(conn, topology)
    # The lifecycle events the relays publish (ADR-0052): their next pass reads it.
    published_changed = await sync_lifecycle_publish(conn, topology)
    # Pipelines are submitted through SubmitJob only: jobplane.submit_job
    # refuses their names.
    named = list((await conn.execute(_READ_PIPELINES)).scalars())
    changed = named != pipelines or flows_changed or published_changed
    if named != pipelines:
        await conn.execute(_CLEAR_PIPELINES)
        if pipelines:
            await conn.execute(_INSERT_PIPELINE, [{"name": name} for name in pipelines])
    rows = (await conn.execute(_READ_ROUTES)).all()
    current = [
        Route(r.rank, r.queue, r.pattern, r.regex, r.max_attempts, r.timeout_seconds) for r in rows
    ]
    settings = (await conn.execute(_READ_LIMIT)).first()
    current_settings = None if settings is None else _Limits(*settings)
    if current == wanted and current_settings == limits:
        return changed
    if current != wanted:
        await conn.execute(_CLEAR_ROUTES)
        await conn.execute(
            _INSERT_ROUTE,
            [
                {
                    "rank": r.rank,
                    "queue": r.queue,
                    "pattern": r.pattern,
                    "regex": r.regex,
                    "max_attempts": r.max_attempts,
                    "timeout_seconds": r.timeout_seconds,
                }
                for r in wanted
            ],
        )
    if current_settings != limits:
        await conn.execute(
            _WRITE_LIMIT,
            {
                "limit": limits.max_payload_bytes,
                "lifecycle": limits.lifecycle_events,
                "horizon": limits.max_schedule_seconds,
            },
        )
    return True
