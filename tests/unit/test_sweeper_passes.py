"""One sweep's passes over a store faked at its seam: how an expired lease ends,
when the lost-dispatch pass runs, and the lines and report operators see; and
the loops a started sweeper runs beside them."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.attempt_end import Decision, Fail, Retry
from jobplane.names import job_name
from jobplane.store.sweeps import (
    EventsBehind,
    ExpiredLease,
    LeaseRepair,
    Republished,
    RepublishPass,
    SweepStore,
)
from jobplane.topology import QueueSpec, Topology
from jobplane.workers import sweeper as sweeper_module
from jobplane.workers.scheduler import Scheduler
from jobplane.workers.sweeper import Sweeper, SweepReport
from tests.support.logs import module_lines

ENGINE = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
TOPOLOGY = Topology(
    queues=(QueueSpec("work", ("w.#",), retry_base_delay=8.0, retry_max_delay=1000.0),)
)


class _Store(SweepStore):
    """Expired leases decided as the real store decides them; nothing else found."""

    def __init__(self, leases: list[ExpiredLease], republished: RepublishPass | None) -> None:
        super().__init__(ENGINE)
        self.leases = leases
        self.decisions: list[Decision] = []
        self.republished = republished
        self.republish_passes = 0

    async def expire_leases(self, *, grace: float, limit: int, decide: Any) -> LeaseRepair:
        taken, self.leases = self.leases[:limit], self.leases[limit:]
        decided = [decide(lease) for lease in taken]
        self.decisions += decided
        retried = sum(isinstance(d, Retry) for d in decided)
        return LeaseRepair(retried, len(decided) - retried)

    async def release_held(self, *, limit: int) -> int:
        return 0

    async def settle_dependencies(self, *, limit: int) -> int:
        return 0

    async def analyze_grown(self, **kwargs: Any) -> list[str]:
        return []

    async def republish_unclaimed(self, **kwargs: Any) -> RepublishPass | None:
        self.republish_passes += 1
        return self.republished

    async def stuck_outbox(self, **kwargs: Any) -> int:
        return 0

    async def events_behind(self, **kwargs: Any) -> EventsBehind:
        return EventsBehind(0, None)


class _Deadlines:
    async def run_once(self) -> int:
        return 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class _Interceptor:
    """Names a trace for any traceparent; keeps each report."""

    def __init__(self) -> None:
        self.reports: list[SweepReport] = []

    def trace_id(self, headers: dict[str, str]) -> str:
        return "trace-of-" + headers["traceparent"]

    def repaired(self, report: SweepReport) -> None:
        self.reports.append(report)


def _sweeper(store: _Store, **kwargs: Any) -> Sweeper:
    sweeper = Sweeper(ENGINE, topology=TOPOLOGY, schedules=False, **kwargs)
    sweeper._store = store
    sweeper.deadlines = _Deadlines()  # type: ignore[assignment]
    return sweeper


def _lease(attempt: int, budget_attempt: int, queue: str = "work") -> ExpiredLease:
    return ExpiredLease(uuid.uuid4(), attempt, budget_attempt, 3, queue)


async def test_an_expired_lease_is_retried_with_its_queues_backoff_or_fails_when_last() -> None:
    leases = [_lease(4, 1), _lease(3, 3), _lease(1, 2, queue="gone")]
    store = _Store(leases, RepublishPass([], 0, True))
    report = await _sweeper(store, batch_size=2).sweep_once()
    assert (report.requeued, report.failed) == (2, 1)
    retried, last, gone = store.decisions
    assert isinstance(retried, Retry) and isinstance(last, Fail) and isinstance(gone, Retry)
    message = "stopped heartbeating (its worker died or hung)"
    assert (retried.code, retried.message) == ("LEASE_EXPIRED", f"attempt 4 {message}")
    assert 4.0 <= retried.delay <= 8.0  # the queue's base, first of the budget
    assert (last.code, last.message) == ("LEASE_EXPIRED", f"attempt 3 {message}; no attempts left")
    assert last.attempts_exhausted
    # A queue that left the topology: the plain backoff (base 1 s, second attempt).
    assert 1.0 <= gone.delay <= 2.0


async def test_a_sweepers_retry_base_replaces_the_queues() -> None:
    store = _Store([_lease(1, 1)], RepublishPass([], 0, True))
    await _sweeper(store, retry_base_delay=100.0).sweep_once()
    (retried,) = store.decisions
    assert isinstance(retried, Retry) and 50.0 <= retried.delay <= 100.0


async def test_a_republished_dispatch_names_its_trace_and_the_report_is_handed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    traced, plain = uuid.uuid4(), uuid.uuid4()
    done = RepublishPass(
        [Republished(traced, uuid.uuid4(), 0, "00-abc-01"), Republished(plain, uuid.uuid4(), 3)],
        scanned=12,
        lap_done=False,
    )
    seen = _Interceptor()
    sweeper = _sweeper(_Store([], done), republish_after=50.0, interceptors=[seen])
    with module_lines(monkeypatch, sweeper_module, "jobplane.sweeper") as lines:
        report = await sweeper.sweep_once()
    assert report == SweepReport(requeued=0, failed=0, stuck_outbox=0, republished=2)
    assert seen.reports == [report]
    said = [(line["event"], line) for line in lines]
    republished = [line for event, line in said if event == "sweeper.dispatch.republished"]
    assert [(r["job"], r.get("trace_id"), r["next_after"]) for r in republished] == [
        (job_name(traced), "trace-of-00-abc-01", 50.0),
        (job_name(plain), None, 400.0),
    ]
    passes = [line for event, line in said if event == "sweeper.republish.pass"]
    assert passes == [
        {"event": "sweeper.republish.pass", "log_level": "debug", "scanned": 12, "lap_done": False}
    ]
    # Nothing else found: no other line at all.
    assert {event for event, _ in said} == {
        "sweeper.dispatch.republished",
        "sweeper.republish.pass",
    }


async def test_a_pass_another_sweeper_runs_is_skipped_and_counts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sweeper = _sweeper(_Store([], None))
    with module_lines(monkeypatch, sweeper_module, "jobplane.sweeper") as lines:
        report = await sweeper.sweep_once()
    assert report.republished == 0
    assert [dict(line) for line in lines] == [
        {
            "event": "sweeper.republish.skipped",
            "log_level": "debug",
            "reason": "another sweeper's pass is running",
        }
    ]


@pytest.mark.parametrize(
    ("kwargs", "every"),
    [
        ({}, 60.0),
        ({"republish_after": 100.0}, 30.0),
        ({"republish_after": 1000.0}, 100.0),
        ({"republish_after": 1000.0, "republish_every": 5.0}, 5.0),
    ],
    ids=["default", "at-least-30-s", "a-tenth", "given"],
)
async def test_the_lost_dispatch_pass_runs_on_its_own_schedule(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], every: float
) -> None:
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(sweeper_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    store = _Store([], RepublishPass([], 0, True))
    sweeper = _sweeper(store, **kwargs)
    await sweeper.sweep_once()  # the first sweep runs the pass
    clock.now += every - 0.5
    await sweeper.sweep_once()
    assert store.republish_passes == 1
    clock.now += 0.5
    await sweeper.sweep_once()
    assert store.republish_passes == 2


async def test_a_sweeper_never_started_stops_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeper = Sweeper(ENGINE, schedules=False)
    with module_lines(monkeypatch, sweeper_module, "jobplane.sweeper") as lines:
        await sweeper.stop()
    assert lines == []


async def test_a_sweeper_ticks_schedules_unless_told_not_to() -> None:
    assert isinstance(Sweeper(ENGINE).scheduler, Scheduler)
    sweeper = Sweeper(ENGINE, schedules=False, interval=3600.0)
    sweeper.deadlines = _Deadlines()  # type: ignore[assignment]
    assert sweeper.scheduler is None
    await sweeper.start()
    try:
        running = {task.get_name() for task in asyncio.all_tasks()}
        assert "jobplane-sweeper" in running
        assert "jobplane-scheduler" not in running
    finally:
        await sweeper.stop()
    assert "jobplane-sweeper" not in {task.get_name() for task in asyncio.all_tasks()}
