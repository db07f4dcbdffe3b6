"""What a retention or erasure pass asks of the store, in which order, and what it reports:
its progress updates, its log lines and its result, with the store faked (the SQL
itself is pinned by tests/integration/test_maintenance*.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import pytest
import structlog

from jobplane.faults import FaultPoints, InjectedFault
from jobplane.store.maintenance import DeletedJobs, LiveJob, Tenant
from jobplane.workers import maintenance
from jobplane.workers.handlers import JobContext, PermanentError, RetryableError
from jobplane.workers.maintenance import Maintenance
from tests.support.logs import capture_every_level

CUTOFF = datetime(2026, 11, 7, 10, 30, tzinfo=UTC)
FIRST = DeletedJobs(jobs=2, job_events=6, job_stages=1, outbox=2, job_blobs=1)
SECOND = DeletedJobs(jobs=3, job_events=4)


class _Ctx:
    """A job's context: its ids and payload, and the progress it reported."""

    def __init__(self, tenant: Tenant, payload: dict[str, Any]) -> None:
        self.job = uuid.uuid4()
        self.id, self.tenant_id = str(self.job), str(tenant.id)
        self.name = f"jobs/{self.job}"
        self.payload = payload
        self.reports: list[tuple[float, str, dict[str, Any] | None]] = []

    async def progress(self, fraction: float, message: str = "", data: Any = None) -> None:
        self.reports.append((round(fraction, 6), message, data))


class _Store:
    """The maintenance store: scripted answers, and every call made of it."""

    def __init__(self, tenant: Tenant) -> None:
        self.the_tenant = tenant
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.expired = [FIRST, SECOND]
        self.expired_count = 5
        self.finished: list[DeletedJobs] = []
        self.events, self.rows = [7], [2]
        self.live: list[list[LiveJob]] = []
        self.counts: list[int] = [0]
        self.blobs = 0
        self.rows_left = {"jobs": 0, "job_events": 0}

    def _note(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    async def tenant(self, tenant_id: uuid.UUID) -> Tenant:
        assert tenant_id == self.the_tenant.id
        return self.the_tenant

    async def cutoff(self, days: int) -> datetime:
        self._note("cutoff", days)
        return CUTOFF

    async def count_expired_jobs(self, *args: Any, **kwargs: Any) -> int:
        self._note("count_expired_jobs", *args, **kwargs)
        return self.expired_count

    async def delete_expired_jobs(self, *args: Any, **kwargs: Any) -> DeletedJobs:
        self._note("delete_expired_jobs", *args, **kwargs)
        return self.expired.pop(0) if self.expired else DeletedJobs()

    async def delete_published_events(self, *args: Any, **kwargs: Any) -> int:
        self._note("delete_published_events", *args, **kwargs)
        return self.events.pop(0) if self.events else 0

    async def delete_published_event_rows(self, *args: Any, **kwargs: Any) -> int:
        self._note("delete_published_event_rows", *args, **kwargs)
        return self.rows.pop(0) if self.rows else 0

    async def delete_schedules(self, *args: Any) -> int:
        self._note("delete_schedules", *args)
        return 2

    async def live_jobs(self, *args: Any, **kwargs: Any) -> list[LiveJob]:
        self._note("live_jobs", *args, **kwargs)
        return self.live.pop(0) if self.live else []

    async def delete_finished_jobs(self, *args: Any, **kwargs: Any) -> DeletedJobs:
        self._note("delete_finished_jobs", *args, **kwargs)
        return self.finished.pop(0) if self.finished else DeletedJobs()

    async def count_jobs(self, *args: Any, **kwargs: Any) -> int:
        self._note("count_jobs", *args, **kwargs)
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]

    async def delete_all_events(self, *args: Any, **kwargs: Any) -> int:
        self._note("delete_all_events", *args, **kwargs)
        return self.events.pop(0) if self.events else 0

    async def delete_all_event_rows(self, *args: Any, **kwargs: Any) -> int:
        self._note("delete_all_event_rows", *args, **kwargs)
        return self.rows.pop(0) if self.rows else 0

    async def blob_count(self, *args: Any) -> int:
        self._note("blob_count", *args)
        return self.blobs

    async def left(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        self._note("left", *args, **kwargs)
        return dict(self.rows_left)


class _Jobs:
    def __init__(self) -> None:
        self.cancelled: list[tuple[uuid.UUID, uuid.UUID, str]] = []

    async def cancel(self, tenant_id: uuid.UUID, job_id: uuid.UUID, reason: str) -> None:
        self.cancelled.append((tenant_id, job_id, reason))


class _Blobs:
    def __init__(self, count: int) -> None:
        self.count = count
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def delete_unreferenced(self, *args: Any) -> int:
        self.calls.append(("delete_unreferenced", args))
        return self.count

    async def delete_tenant(self, *args: Any) -> int:
        self.calls.append(("delete_tenant", args))
        return self.count


class _Index:
    def __init__(self) -> None:
        self.erased: list[str] = []

    async def delete_tenant(self, tenant_id: str) -> int:
        self.erased.append(tenant_id)
        return 9


class _Setup:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, days: int | None) -> None:
        self.tenant = Tenant(uuid.uuid4(), "acme", days)
        self.store, self.jobs = _Store(self.tenant), _Jobs()
        monkeypatch.setattr(maintenance, "MaintenanceStore", lambda _engine: self.store)
        monkeypatch.setattr(maintenance, "JobStore", lambda _engine, _db: self.jobs)
        # A logger not used before: a cached one would write past capture_logs.
        monkeypatch.setattr(maintenance, "log", structlog.get_logger("jobplane.maintenance.t"))

    def maintenance(self, **kwargs: Any) -> Maintenance:
        return Maintenance(cast(Any, None), cast(Any, None), **kwargs)

    def ctx(self, payload: dict[str, Any]) -> _Ctx:
        return _Ctx(self.tenant, payload)


async def _run(handler: Any, ctx: _Ctx) -> Any:
    return await handler(cast(JobContext, ctx))


def _deleted(phase: str, **counts: int) -> dict[str, Any]:
    return {"phase": phase, "deleted": counts}


JOBS_DONE = {"jobs": 5, "job_events": 10, "job_stages": 1, "outbox": 2, "job_blobs": 1}


async def test_retention_deletes_jobs_events_rows_and_blobs_past_the_horizon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, 30)
    blobs = _Blobs(4)
    ctx = setup.ctx({})
    with capture_every_level() as logs:
        result = await _run(setup.maintenance(blobs=cast(Any, blobs)).retention, ctx)
    tid, me = setup.tenant.id, ctx.job
    deleted = {**JOBS_DONE, "events": 7, "outbox": 4, "blobs": 4}
    assert result == {
        "tenant": "acme",
        "horizon_days": 30,
        "cutoff": CUTOFF.isoformat(),
        "deleted": deleted,
        "blobs": "collected",
    }
    after_first = dict(FIRST.as_dict())
    assert ctx.reports == [
        (0.0, "5 finished jobs ended before 2026-11-07 10:30", _deleted("jobs")),
        (0.36, "2 of 5 jobs", _deleted("jobs", **after_first)),
        (0.9, "5 of 5 jobs", _deleted("jobs", **JOBS_DONE)),
        (0.9, "7 events rows deleted", _deleted("events", **JOBS_DONE, events=7)),
        (
            0.92,
            "4 outbox rows deleted",
            _deleted("events", **{**JOBS_DONE, "events": 7, "outbox": 4}),
        ),
        (0.95, "events deleted", _deleted("events", **{**JOBS_DONE, "events": 7, "outbox": 4})),
        (1.0, "done", _deleted("blobs", **deleted)),
    ]
    batch = {"keep": me, "limit": 1000, "max_rows": 20_000}
    assert setup.store.calls == [
        ("cutoff", (30,), {}),
        ("count_expired_jobs", (tid, CUTOFF), {"keep": me}),
        *[("delete_expired_jobs", (tid, CUTOFF), batch)] * 3,
        *[("delete_published_events", (tid, CUTOFF), {"limit": 1000})] * 2,
        *[("delete_published_event_rows", (tid, CUTOFF), {"limit": 1000})] * 2,
    ]
    assert blobs.calls == [("delete_unreferenced", (tid, CUTOFF))]
    assert logs == [
        {
            "event": "maintenance.retention.started",
            "log_level": "info",
            "job": ctx.name,
            "tenant": "acme",
            "horizon_days": 30,
            "cutoff": CUTOFF.isoformat(),
        },
        {
            "event": "maintenance.retention.done",
            "log_level": "info",
            "job": ctx.name,
            "tenant": "acme",
            "horizon_days": 30,
            "deleted": deleted,
        },
    ]


async def test_a_retention_payload_widens_the_horizon_and_sets_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, 30)
    setup.store.expired, setup.store.events, setup.store.rows = [], [], []
    ctx = setup.ctx({"older_than_days": 45, "batch_size": 2})
    result = await _run(setup.maintenance().retention, ctx)
    assert result["horizon_days"] == 45 and result["deleted"] == {}
    assert result["blobs"] == "not configured"
    tid, me = setup.tenant.id, ctx.job
    assert setup.store.calls == [
        ("cutoff", (45,), {}),
        ("count_expired_jobs", (tid, CUTOFF), {"keep": me}),
        ("delete_expired_jobs", (tid, CUTOFF), {"keep": me, "limit": 2, "max_rows": 20_000}),
        ("delete_published_events", (tid, CUTOFF), {"limit": 2}),
        ("delete_published_event_rows", (tid, CUTOFF), {"limit": 2}),
    ]
    # Without an object store the last report is still of the events.
    assert ctx.reports[-1] == (1.0, "done", _deleted("events"))


async def test_retention_of_a_tenant_without_a_horizon_deletes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, None)
    ctx = setup.ctx({"batch_size": 5})
    result = await _run(setup.maintenance().retention, ctx)
    assert result == {"tenant": "acme", "horizon_days": None, "deleted": {}}
    assert ctx.reports == [(1.0, "no retention horizon: nothing is deleted", None)]
    assert setup.store.calls == []
    with pytest.raises(PermanentError, match="unknown fields confirm"):
        await _run(setup.maintenance().retention, setup.ctx({"confirm": "acme"}))


async def test_a_retention_stopped_after_a_batch_reported_that_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, 30)
    ctx = setup.ctx({})
    faults = FaultPoints(["maintenance.retention.batch"])
    with pytest.raises(InjectedFault):
        await _run(setup.maintenance(faults=faults).retention, ctx)
    assert [call[0] for call in setup.store.calls].count("delete_expired_jobs") == 1
    assert ctx.reports == [(0.0, "5 finished jobs ended before 2026-11-07 10:30", _deleted("jobs"))]


async def test_erasure_stops_the_tenants_jobs_then_deletes_all_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, None)
    store, running = setup.store, uuid.uuid4()
    # A job runs: it is cancelled, and waited for until it stopped.
    store.live = [[LiveJob(running, "demo.echo", True)], []]
    store.finished = [SECOND, DeletedJobs(), DeletedJobs(jobs=1), DeletedJobs()]
    store.counts, store.events, store.rows = [1, 0], [4], [1]
    blobs, index = _Blobs(3), _Index()
    ctx = setup.ctx({"confirm": "acme", "batch_size": 50})
    handler = setup.maintenance(blobs=cast(Any, blobs), index=index, poll_interval=0.01)
    with capture_every_level() as logs:
        result = await _run(handler.erasure, ctx)
    tid, me = setup.tenant.id, ctx.job
    jobs = {"schedules": 2, "jobs": 4, "job_events": 4}
    deleted = {**jobs, "events": 4, "outbox": 1, "blobs": 3, "index_points": 9}
    assert result == {
        "tenant": "acme",
        "deleted": deleted,
        "blobs": "erased",
        "index": "erased",
        "left": {"jobs": 0, "job_events": 0},
    }
    assert setup.jobs.cancelled == [(tid, running, "the tenant's data is erased")]
    assert blobs.calls == [("delete_tenant", (tid,))] and index.erased == [str(tid)]
    so_far = {"schedules": 2, "jobs": 3, "job_events": 4}
    assert ctx.reports == [
        (0.0, "stopping the tenant's jobs", _deleted("jobs", schedules=2)),
        (0.1, "3 jobs deleted", _deleted("jobs", **so_far)),
        (0.1, "waiting for 1 jobs to stop", _deleted("jobs", **so_far)),
        (0.1, "4 jobs deleted", _deleted("jobs", **jobs)),
        (0.5, "4 events rows deleted", _deleted("events", **jobs, events=4)),
        (0.6, "1 outbox rows deleted", _deleted("events", **jobs, events=4, outbox=1)),
        (0.7, "events deleted", _deleted("events", **jobs, events=4, outbox=1)),
        (0.8, "blobs deleted", _deleted("blobs", **jobs, events=4, outbox=1, blobs=3)),
        (1.0, "done", _deleted("index", **deleted)),
    ]
    batch = {"keep": me, "limit": 50, "max_rows": 20_000}
    assert store.calls == [
        ("delete_schedules", (tid,), {}),
        ("live_jobs", (tid,), {"keep": me}),
        *[("delete_finished_jobs", (tid,), batch)] * 2,
        ("count_jobs", (tid,), {"keep": me}),
        ("live_jobs", (tid,), {"keep": me}),
        *[("delete_finished_jobs", (tid,), batch)] * 2,
        ("count_jobs", (tid,), {"keep": me}),
        *[("delete_all_events", (tid,), {"keep": me, "limit": 50})] * 2,
        *[("delete_all_event_rows", (tid,), {"limit": 50})] * 2,
        ("left", (tid,), {"keep": me}),
    ]
    assert logs == [
        {
            "event": "maintenance.erasure.started",
            "log_level": "info",
            "job": ctx.name,
            "tenant": "acme",
        },
        {
            "event": "maintenance.erasure.done",
            "log_level": "info",
            "job": ctx.name,
            "tenant": "acme",
            "deleted": deleted,
            "index": "erased",
        },
    ]


async def test_erasure_needs_the_tenants_name_to_confirm(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch, None)
    for payload in ({}, {"confirm": "ACME"}, {"confirm": "globex"}):
        with pytest.raises(PermanentError) as refused:
            await _run(setup.maintenance().erasure, setup.ctx(payload))
        assert refused.value.code == "CONFIRMATION_REQUIRED"
        assert str(refused.value) == (
            "payload.confirm must be the tenant's name: erasure deletes every job, event, "
            "blob and index point of the tenant"
        )
    with pytest.raises(PermanentError, match="unknown fields older_than_days"):
        await _run(
            setup.maintenance().erasure, setup.ctx({"confirm": "acme", "older_than_days": 1})
        )
    assert setup.store.calls == []


async def test_erasure_without_an_object_store_or_index(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch, None)
    setup.store.events, setup.store.rows = [], []
    ctx = setup.ctx({"confirm": "acme"})
    result = await _run(setup.maintenance().erasure, ctx)
    assert (result["blobs"], result["index"]) == ("not configured", "not configured")
    assert result["deleted"] == {"schedules": 2}
    assert ("blob_count", (setup.tenant.id,), {}) in setup.store.calls
    assert ctx.reports[-2:] == [
        (0.8, "blobs deleted", _deleted("events", schedules=2)),
        (1.0, "done", _deleted("events", schedules=2)),
    ]
    # With blobs left to delete, it must run where the object store is.
    setup.store.blobs = 1
    with pytest.raises(PermanentError) as refused:
        await _run(setup.maintenance().erasure, setup.ctx({"confirm": "acme"}))
    assert refused.value.code == "BLOB_STORE_NOT_CONFIGURED"


async def test_rows_written_during_an_erasure_make_it_go_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, None)
    setup.store.rows_left = {"jobs": 1, "job_events": 0, "outbox": 3}
    ctx = setup.ctx({"confirm": "acme"})
    with capture_every_level() as logs, pytest.raises(RetryableError) as again:
        await _run(setup.maintenance().erasure, ctx)
    assert (
        str(again.value) == "rows of the tenant were written during the erasure: jobs 1, outbox 3"
    )
    assert (again.value.code, again.value.delay) == ("TENANT_WRITTEN_DURING_ERASURE", 1.0)
    assert [line["event"] for line in logs] == ["maintenance.erasure.started"]
    assert ctx.reports[-1][:2] == (0.8, "blobs deleted")


async def test_an_erasure_gives_way_to_an_earlier_one_and_waits_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, None)
    earlier, later = uuid.uuid4(), uuid.uuid4()
    setup.store.live = [
        [
            LiveJob(later, "maintenance.erasure", False),
            LiveJob(earlier, "maintenance.erasure", True),
        ]
    ]
    with pytest.raises(RetryableError) as again:
        await _run(setup.maintenance().erasure, setup.ctx({"confirm": "acme"}))
    assert str(again.value) == f"an earlier erasure of the tenant is under way: jobs/{earlier}"
    assert (again.value.code, again.value.delay) == ("ERASURE_IN_PROGRESS", 5.0)
    assert setup.jobs.cancelled == []
    # A later erasure, or another job, is cancelled; one that does not stop is waited for.
    setup.store.live = [[LiveJob(later, "maintenance.erasure", False)]]
    setup.store.counts = [2]
    ctx = setup.ctx({"confirm": "acme"})
    handler = setup.maintenance(live_wait=0.05, poll_interval=0.01)
    with pytest.raises(RetryableError) as again:
        await _run(handler.erasure, ctx)
    assert str(again.value) == (
        "2 jobs of the tenant are still running after 0.05s; they were asked to stop"
    )
    assert (again.value.code, again.value.delay) == ("TENANT_JOBS_RUNNING", 5.0)
    assert [job for _tenant, job, _why in setup.jobs.cancelled] == [later]
    # One report while it waits, not one per poll.
    assert [m for _f, m, _d in ctx.reports].count("waiting for 2 jobs to stop") == 1


async def test_retention_progress_stops_at_nine_tenths_when_more_jobs_expired_than_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = _Setup(monkeypatch, 30)
    # One job had expired when counted; two more ended past the horizon meanwhile.
    setup.store.expired_count = 1
    setup.store.expired = [DeletedJobs(jobs=1), DeletedJobs(jobs=2)]
    ctx = setup.ctx({})
    await _run(setup.maintenance().retention, ctx)
    assert [(fraction, message) for fraction, message, _data in ctx.reports[1:3]] == [
        (0.9, "1 of 1 jobs"),
        (0.9, "3 of 1 jobs"),
    ]
