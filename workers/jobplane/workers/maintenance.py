"""The maintenance jobs: ``maintenance.retention`` and ``maintenance.erasure`` (ADR-0022).

Both are normal jobs of the job's own tenant, read from its row: a payload
can never name another tenant. They delete in batches, one short
transaction per batch (:mod:`jobplane.store.maintenance`), report progress
after each, and can be stopped anywhere: a re-run (another attempt, or
another job) starts from what is left and deletes nothing twice.

- ``maintenance.retention`` deletes the tenant's finished jobs that ended
  before its horizon (``tenants.retention_days``, set with
  ``jobplane tenants set-retention``) with their events, stages and outbox
  rows; its published events and published outbox rows of no job older than
  the horizon; and its unreferenced blobs older than the horizon. Payload
  (all optional): ``older_than_days`` (at least the tenant's horizon: a run
  may keep more, never less), ``batch_size`` (jobs per statement, 1..10000).
- ``maintenance.erasure`` deletes everything of the tenant: it cancels its
  live jobs and waits for them to stop, then deletes every job (but
  itself), event, outbox row, blob and index point of the tenant. The
  tenant and its keys stay (erasing data is not removing the tenant), and so
  does the erasure job itself, the receipt. Payload: ``confirm`` must be the
  tenant's name (a slip of a client cannot erase a tenant); ``batch_size``.

The handlers need the worker's database engine (and its blob store and
index when it has them): :class:`Maintenance` is built with them and gives
its :class:`~jobplane.workers.handlers.Registry`, which ``jobplane worker``
and ``jobplane dev`` merge into theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.errors import BlobStoreUnavailable, JobAlreadyTerminal, JobNotFound
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.logs import describe_error
from jobplane.store.db import Database
from jobplane.store.down import database_transient
from jobplane.store.jobs import JobStore
from jobplane.store.maintenance import (
    MAX_RETENTION_DAYS,
    DeletedJobs,
    MaintenanceStore,
    Tenant,
)
from jobplane.workers.handlers import JobContext, PermanentError, Registry, RetryableError

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

log = structlog.get_logger("jobplane.maintenance")

T = TypeVar("T")

RETENTION = "maintenance.retention"
ERASURE = "maintenance.erasure"
#: Jobs one deleting statement takes at most, unless the payload says otherwise.
DEFAULT_BATCH = 1000
MAX_BATCH = 10_000
#: Events (job_events rows) one statement deletes with its jobs, past its first job.
MAX_ROWS_PER_BATCH = 20_000
_RETENTION_KEYS = frozenset({"older_than_days", "batch_size"})
_ERASURE_KEYS = frozenset({"confirm", "batch_size"})


class TenantIndex(Protocol):
    """What erasure asks of the search index (``jobplane.contrib.ingest.index.Index``)."""

    async def delete_tenant(self, tenant_id: str) -> int:
        """Delete every point of the tenant; how many there were."""
        ...


@dataclass
class _Tally:
    """Rows deleted so far by table, and a progress report after each batch."""

    ctx: JobContext
    phase: str = ""
    deleted: dict[str, int] = field(default_factory=dict)

    def add(self, table: str, count: int) -> None:
        if count:
            self.deleted[table] = self.deleted.get(table, 0) + count

    def add_jobs(self, batch: DeletedJobs) -> None:
        for table, count in batch.as_dict().items():
            self.add(table, count)

    async def report(self, fraction: float, message: str) -> None:
        await self.ctx.progress(
            fraction, message, {"phase": self.phase, "deleted": dict(self.deleted)}
        )


class Maintenance:
    """The maintenance handlers, built with the worker's own resources.

    ``engine`` and ``db`` are the worker's (no connection of its own per job);
    ``blobs`` its object store (None: blobs are disabled, none to delete);
    ``index`` is the search index when ingestion is configured (None: no
    index points to erase). ``live_wait`` bounds how long one erasure
    attempt waits for the tenant's running jobs to stop before it gives the
    job back to be retried later.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        db: Database,
        *,
        blobs: BlobStore | None = None,
        index: TenantIndex | None = None,
        faults: FaultPoints = NO_FAULTS,
        live_wait: float = 60.0,
        poll_interval: float = 0.5,
    ) -> None:
        self._store = MaintenanceStore(engine)
        self._jobs = JobStore(engine, db)
        self._blobs = blobs
        self._index = index
        self._faults = faults
        self._live_wait = live_wait
        self._poll_interval = poll_interval

    def registry(self) -> Registry:
        """The handlers of ``maintenance.retention`` and ``maintenance.erasure``."""
        registry = Registry()
        registry.add(RETENTION, self.retention)
        registry.add(ERASURE, self.erasure)
        return registry

    # -- retention -------------------------------------------------------------

    async def retention(self, ctx: JobContext) -> dict[str, Any]:
        """Delete what of the job's tenant is older than its horizon."""
        me = uuid.UUID(ctx.id)
        tenant = await self._store.tenant(uuid.UUID(ctx.tenant_id))
        _only(ctx.payload, _RETENTION_KEYS)
        batch = _batch_size(ctx.payload)
        days = _horizon(ctx.payload, tenant)
        if days is None:
            await ctx.progress(1.0, "no retention horizon: nothing is deleted")
            return {"tenant": tenant.name, "horizon_days": None, "deleted": {}}
        cutoff = await self._store.cutoff(days)
        bound = log.bind(job=ctx.name, tenant=tenant.name, horizon_days=days)
        bound.info("maintenance.retention.started", cutoff=cutoff.isoformat())
        tally = _Tally(ctx, "jobs")
        total = await self._store.count_expired_jobs(tenant.id, cutoff, keep=me)
        await tally.report(0.0, f"{total} finished jobs ended before {cutoff:%Y-%m-%d %H:%M}")
        while True:
            done = await _again_if_transient(
                lambda: self._store.delete_expired_jobs(
                    tenant.id, cutoff, keep=me, limit=batch, max_rows=MAX_ROWS_PER_BATCH
                )
            )
            if not done.jobs:
                break
            tally.add_jobs(done)
            self._faults.hit("maintenance.retention.batch")
            gone = tally.deleted.get("jobs", 0)
            await tally.report(0.9 * min(1.0, gone / max(total, 1)), f"{gone} of {total} jobs")
        tally.phase = "events"
        await self._drain(
            tally,
            "events",
            lambda: self._store.delete_published_events(tenant.id, cutoff, limit=batch),
            0.9,
        )
        await self._drain(
            tally,
            "outbox",
            lambda: self._store.delete_published_event_rows(tenant.id, cutoff, limit=batch),
            0.92,
        )
        await tally.report(0.95, "events deleted")
        blobs = await self._retention_blobs(tally, tenant, cutoff)
        await tally.report(1.0, "done")
        bound.info("maintenance.retention.done", deleted=tally.deleted)
        return {
            "tenant": tenant.name,
            "horizon_days": days,
            "cutoff": cutoff.isoformat(),
            "deleted": tally.deleted,
            "blobs": blobs,
        }

    async def _retention_blobs(self, tally: _Tally, tenant: Tenant, cutoff: datetime) -> str:
        """The tenant's blobs no job references, last uploaded before ``cutoff``."""
        if self._blobs is None:
            return "not configured"
        tally.phase = "blobs"
        with _blob_store_errors():
            tally.add("blobs", await self._blobs.delete_unreferenced(tenant.id, cutoff))
        return "collected"

    # -- erasure ---------------------------------------------------------------

    async def erasure(self, ctx: JobContext) -> dict[str, Any]:
        """Delete everything of the job's tenant but the tenant, its keys and this job."""
        me = uuid.UUID(ctx.id)
        tenant = await self._store.tenant(uuid.UUID(ctx.tenant_id))
        _only(ctx.payload, _ERASURE_KEYS)
        batch = _batch_size(ctx.payload)
        confirm = ctx.payload.get("confirm")
        if confirm != tenant.name:
            raise PermanentError(
                "payload.confirm must be the tenant's name: erasure deletes every job, event, "
                "blob and index point of the tenant",
                code="CONFIRMATION_REQUIRED",
            )
        bound = log.bind(job=ctx.name, tenant=tenant.name)
        bound.info("maintenance.erasure.started")
        tally = _Tally(ctx, "jobs")
        # First: a recurring schedule would submit jobs behind the erasure.
        tally.add("schedules", await self._store.delete_schedules(tenant.id))
        await tally.report(0.0, "stopping the tenant's jobs")
        await self._stop_and_delete_jobs(tally, tenant, me, batch)
        tally.phase = "events"
        await self._drain(
            tally,
            "events",
            lambda: self._store.delete_all_events(tenant.id, keep=me, limit=batch),
            0.5,
        )
        await self._drain(
            tally,
            "outbox",
            lambda: self._store.delete_all_event_rows(tenant.id, limit=batch),
            0.6,
        )
        await tally.report(0.7, "events deleted")
        blobs = await self._erasure_blobs(tally, tenant)
        await tally.report(0.8, "blobs deleted")
        index = "not configured"
        if self._index is not None:
            from jobplane.contrib.ingest.index import IndexUnavailable

            tally.phase = "index"
            try:
                points = await self._index.delete_tenant(str(tenant.id))
            except IndexUnavailable as exc:
                # Down, or (local mode) held by the process that indexes: later.
                raise RetryableError(str(exc), code="INDEX_UNAVAILABLE") from exc
            tally.add("index_points", points)
            index = "erased"
        left = await self._store.left(tenant.id, keep=me)
        if any(left.values()):
            # Written meanwhile (a job submitted during the erasure): the next
            # attempt goes on from here.
            raise RetryableError(
                f"rows of the tenant were written during the erasure: {_nonzero(left)}",
                code="TENANT_WRITTEN_DURING_ERASURE",
                delay=1.0,
            )
        await tally.report(1.0, "done")
        bound.info("maintenance.erasure.done", deleted=tally.deleted, index=index)
        return {
            "tenant": tenant.name,
            "deleted": tally.deleted,
            "blobs": blobs,
            "index": index,
            "left": left,
        }

    async def _stop_and_delete_jobs(
        self, tally: _Tally, tenant: Tenant, me: uuid.UUID, batch: int
    ) -> None:
        """Cancel the tenant's live jobs, delete the finished ones, until none is left."""
        deadline = time.monotonic() + self._live_wait
        waiting = -1
        while True:
            live = await self._store.live_jobs(tenant.id, keep=me)
            # Two erasures must not cancel each other: the older one goes on
            # (and cancels this one), this one gives way.
            first = next((j for j in live if j.type == ERASURE and j.older), None)
            if first is not None:
                raise RetryableError(
                    f"an earlier erasure of the tenant is under way: jobs/{first.id}",
                    code="ERASURE_IN_PROGRESS",
                    delay=5.0,
                )
            for job in live:
                # It may have ended (or gone) meanwhile.
                with contextlib.suppress(JobAlreadyTerminal, JobNotFound):
                    await self._jobs.cancel(tenant.id, job.id, "the tenant's data is erased")
            while True:
                done = await _again_if_transient(
                    lambda: self._store.delete_finished_jobs(
                        tenant.id, keep=me, limit=batch, max_rows=MAX_ROWS_PER_BATCH
                    )
                )
                if not done.jobs:
                    break
                tally.add_jobs(done)
                self._faults.hit("maintenance.erasure.batch")
                await tally.report(0.1, f"{tally.deleted.get('jobs', 0)} jobs deleted")
            remaining = await self._store.count_jobs(tenant.id, keep=me)
            if not remaining:
                return
            if time.monotonic() > deadline:
                raise RetryableError(
                    f"{remaining} jobs of the tenant are still running after "
                    f"{self._live_wait:g}s; they were asked to stop",
                    code="TENANT_JOBS_RUNNING",
                    delay=5.0,
                )
            if remaining != waiting:  # one report per change, not per poll
                waiting = remaining
                await tally.report(0.1, f"waiting for {remaining} jobs to stop")
            await asyncio.sleep(self._poll_interval)

    async def _erasure_blobs(self, tally: _Tally, tenant: Tenant) -> str:
        """Every blob of the tenant: rows and objects (its jobs, and their references, are gone)."""
        if self._blobs is None:
            if await self._store.blob_count(tenant.id):
                raise PermanentError(
                    "the tenant has blobs and this worker has no object store (JOBPLANE_S3_URL): "
                    "run the erasure again where it has one",
                    code="BLOB_STORE_NOT_CONFIGURED",
                )
            return "not configured"
        tally.phase = "blobs"
        with _blob_store_errors():
            tally.add("blobs", await self._blobs.delete_tenant(tenant.id))
        return "erased"

    # -- helpers ---------------------------------------------------------------

    async def _drain(
        self,
        tally: _Tally,
        table: str,
        batch: Callable[[], Awaitable[int]],
        fraction: float,
    ) -> None:
        """Run ``batch()`` (one deleting statement) until it deletes nothing."""
        while True:
            count = await _again_if_transient(batch)
            if not count:
                return
            tally.add(table, count)
            await tally.report(fraction, f"{tally.deleted[table]} {table} rows deleted")


async def _again_if_transient(statement: Callable[[], Awaitable[T]]) -> T:
    """One deleting statement, tried again after a deadlock (with a relay or a
    transition holding the same rows), a serialization failure or a lost
    connection; after a few tries the error fails the attempt, which is retried."""
    delay = 0.1
    for _ in range(4):
        try:
            return await statement()
        except Exception as exc:
            if not database_transient(exc):
                raise
            log.warning("maintenance.batch.retry", error=describe_error(exc), delay=delay)
        await asyncio.sleep(delay)
        delay *= 2
    return await statement()


@contextlib.contextmanager
def _blob_store_errors() -> Iterator[None]:
    """An object store that is down fails the attempt, retryably: a re-run goes on."""
    try:
        yield
    except BlobStoreUnavailable as exc:
        raise RetryableError(str(exc), code="BLOB_STORE_UNAVAILABLE", delay=5.0) from exc


def _nonzero(counts: dict[str, int]) -> str:
    return ", ".join(f"{table} {n}" for table, n in counts.items() if n)


def _only(payload: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(payload) - allowed)
    if unknown:
        raise PermanentError(
            f"payload has unknown fields {', '.join(unknown)}; known: {', '.join(sorted(allowed))}",
            code="INVALID_PAYLOAD",
        )


def _whole(payload: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PermanentError(
            f"payload.{name} must be a whole number {low}..{high}, got {value!r}",
            code="INVALID_PAYLOAD",
        )
    return value


def _batch_size(payload: dict[str, Any]) -> int:
    return _whole(payload, "batch_size", 1, MAX_BATCH) or DEFAULT_BATCH


def _horizon(payload: dict[str, Any], tenant: Tenant) -> int | None:
    """The run's horizon: the tenant's, or a longer one the payload asks for."""
    asked = _whole(payload, "older_than_days", 1, MAX_RETENTION_DAYS)
    if asked is None:
        return tenant.retention_days
    if tenant.retention_days is None:
        raise PermanentError(
            f"tenant {tenant.name!r} has no retention horizon, so payload.older_than_days "
            "cannot widen one (jobplane tenants set-retention sets it)",
            code="INVALID_PAYLOAD",
        )
    if asked < tenant.retention_days:
        raise PermanentError(
            f"payload.older_than_days ({asked}) may only keep more than the tenant's "
            f"horizon of {tenant.retention_days} days, not less",
            code="INVALID_PAYLOAD",
        )
    return asked
