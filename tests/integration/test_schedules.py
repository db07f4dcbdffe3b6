"""Recurring schedules on real Postgres and RabbitMQ: the calls, each tick exactly
one job across racing tickers and crashes, the overlap and catch-up policies,
pause, resume and trigger (docs/scheduling.md, ADR-0041)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.client import (
    BlobNotFound,
    CatchUp,
    InvalidArgument,
    JobState,
    Overlap,
    ScheduleExists,
    ScheduleNotFound,
)
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.server.schedule_builtin import sync_retention_schedules
from jobplane.store.engine import create_engine
from jobplane.store.schedule_ticks import FAILURE_BACKOFF, tick_once
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.maintenance import Maintenance
from jobplane.workers.scheduler import Scheduler
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

pytestmark = pytest.mark.stack(worker=False, relay=False)

BERLIN = ZoneInfo("Europe/Berlin")


async def _jobs_of(stack: Stack, name: str) -> list[tuple[str, str]]:
    """(request_id, state) of the schedule's jobs, oldest first."""
    async with stack.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT request_id, state FROM jobs WHERE labels->>:label = :name "
                "ORDER BY create_time, request_id"
            ),
            {"label": SCHEDULE_LABEL, "name": name},
        )
        return [(str(r), str(s)) for r, s in rows]


async def _move_due(stack: Stack, schedule_id: str, tick: datetime) -> None:
    """As if the schedule's next tick were ``tick`` (every ticker was down since)."""
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET next_tick = :tick, next_run_time = :tick WHERE id = :id"),
            {"tick": tick, "id": schedule_id},
        )


async def test_create_get_list_update_delete_per_tenant(stack: Stack) -> None:
    client = stack.client()
    made = await client.create_schedule(
        "demo.echo",
        {"n": 1},
        cron="30 2 * * *",
        time_zone="Europe/Berlin",
        labels={"team": "bi"},
        schedule_id="nightly",
        description="the nightly echo",
    )
    assert made.name == "schedules/nightly"
    assert made.next_run_time is not None and made.next_run_time > datetime.now(UTC)
    assert made.next_run_time.astimezone(BERLIN).strftime("%H:%M") in {"02:30", "03:00"}
    with pytest.raises(ScheduleExists):
        await client.create_schedule("demo.echo", interval=60, schedule_id="nightly")
    other = await client.create_schedule("demo.echo", interval=3600)
    assert (await client.get_schedule("nightly")).template.payload == {"n": 1}
    page = await client.list_schedules(page_size=1)
    assert [s.name for s in page.schedules] == [other.name]
    rest = await client.list_schedules(page_size=1, page_token=page.next_page_token)
    assert [s.name for s in rest.schedules] == ["schedules/nightly"]
    assert [s.name async for s in client.iter_schedules()] == [other.name, "schedules/nightly"]

    changed = await client.update_schedule("nightly", payload={"n": 2}, cron="0 3 * * *")
    assert changed.template.payload == {"n": 2}
    assert changed.spec.cron == "0 3 * * *"
    assert changed.spec.time_zone == "Europe/Berlin"
    assert changed.template.labels == {"team": "bi"}

    # Another tenant sees none of them.
    stranger = stack.client(await stack.new_key("globex"))
    assert (await stranger.list_schedules()).schedules == []
    with pytest.raises(ScheduleNotFound):
        await stranger.get_schedule("nightly")
    with pytest.raises(ScheduleNotFound):
        await stranger.delete_schedule("nightly")

    await client.delete_schedule("nightly")
    with pytest.raises(ScheduleNotFound):
        await client.get_schedule("nightly")


async def test_ticks_submit_jobs_that_carry_the_schedule_and_run(
    stack: Stack, started: Started
) -> None:
    await stack.start_relay()
    await stack.start_worker()
    client = stack.client()
    schedule = await client.create_schedule(
        "demo.echo", {"hello": "world"}, interval=1, overlap=Overlap.ALLOW_ALL
    )
    await started(Scheduler(stack.engine, poll=0.1))

    async def two_ran() -> bool:
        jobs = await _jobs_of(stack, schedule.name)
        return sum(state == "succeeded" for _, state in jobs) >= 2

    await eventually(two_ran, timeout=20)
    seen = await client.get_schedule(schedule)
    assert seen.runs >= 2 and seen.last_run_time is not None
    job = await client.get(seen.recent_runs[0])
    assert job.labels[SCHEDULE_LABEL] == schedule.name
    assert job.payload == {"hello": "world"}
    queued = await stack.scalar(
        "SELECT payload FROM events WHERE event_type = 'job.queued' AND job_id = :id",
        id=seen.recent_runs[-1].removeprefix("jobs/"),
    )
    if queued is not None:  # lifecycle events are on: job.queued names the schedule
        assert queued["labels"][SCHEDULE_LABEL] == schedule.name


async def test_each_tick_is_exactly_one_job_across_racing_tickers(
    stack: Stack, database_url: str
) -> None:
    client = stack.client()
    names = []
    for i in range(4):
        made = await client.create_schedule(
            "demo.echo",
            {"i": i},
            interval=1,
            overlap=Overlap.ALLOW_ALL,
            catch_up=CatchUp.ALL,
            catch_up_limit=1000,
        )
        names.append(made.name)
        # Twenty seconds of downtime to catch up on, raced for by every ticker.
        first = made.next_run_time
        assert first is not None
        await _move_due(stack, made.id, first - timedelta(seconds=20))
    engines = [create_engine(database_url, pool_size=2) for _ in range(3)]
    ended = time.monotonic() + 4

    async def ticker(index: int) -> None:
        while time.monotonic() < ended:
            await tick_once(engines[index])
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(*(ticker(i) for i in range(3)))
    finally:
        for engine in engines:
            await engine.dispose()
    for name in names:
        jobs = await _jobs_of(stack, name)
        ticks = sorted(datetime.fromisoformat(r.rsplit("/", 1)[1]) for r, _ in jobs)
        assert len(ticks) == len(set(ticks)) >= 22
        # One job per tick, none missed: consecutive seconds.
        assert all(b - a == timedelta(seconds=1) for a, b in pairwise(ticks))
        schedule = await client.get_schedule(name)
        assert schedule.runs == len(jobs)
        assert schedule.next_run_time is not None and schedule.next_run_time > ticks[-1]


async def test_a_crash_between_claim_and_commit_leaves_the_tick_due_and_no_job(
    stack: Stack,
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=60)
    due = schedule.next_run_time
    assert due is not None
    now = due + timedelta(seconds=1)
    with pytest.raises(InjectedFault):
        await tick_once(stack.engine, now=now, faults=FaultPoints({"schedule.before_commit"}))
    assert await _jobs_of(stack, schedule.name) == []
    assert (await client.get_schedule(schedule)).next_run_time == due
    report = await tick_once(stack.engine, now=now)
    assert report.runs == 1
    (only,) = await _jobs_of(stack, schedule.name)
    assert only[0].endswith(due.isoformat())
    assert (await tick_once(stack.engine, now=now)).runs == 0
    assert (await client.get_schedule(schedule)).next_run_time == due + timedelta(seconds=60)


async def test_overlap_skip_starts_nothing_while_a_run_is_going(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.SKIP)
    first = schedule.next_run_time
    assert first is not None
    for k in range(4):  # the first run stays QUEUED: no worker
        await tick_once(stack.engine, now=first + timedelta(seconds=10 * k + 1))
    jobs = await _jobs_of(stack, schedule.name)
    assert len(jobs) == 1
    seen = await client.get_schedule(schedule)
    assert seen.runs == 1 and seen.skipped == 3
    await client.cancel(seen.recent_runs[0])
    await tick_once(stack.engine, now=first + timedelta(seconds=41))
    assert len(await _jobs_of(stack, schedule.name)) == 2


async def test_overlap_buffer_one_runs_one_held_tick_when_the_run_ends(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.BUFFER_ONE)
    first = schedule.next_run_time
    assert first is not None
    for k in range(3):
        await tick_once(stack.engine, now=first + timedelta(seconds=10 * k + 1))
    assert len(await _jobs_of(stack, schedule.name)) == 1
    await client.cancel((await client.get_schedule(schedule)).recent_runs[0])
    await tick_once(stack.engine, now=first + timedelta(seconds=25))
    jobs = await _jobs_of(stack, schedule.name)
    assert len(jobs) == 2
    assert jobs[1][0].endswith((first + timedelta(seconds=10)).isoformat())


async def test_a_held_tick_runs_before_a_newer_tick_due_with_it(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.BUFFER_ONE)
    first = schedule.next_run_time
    assert first is not None
    for k in range(2):  # the first run stays QUEUED: no worker; the second tick is held
        await tick_once(stack.engine, now=first + timedelta(seconds=10 * k + 1))
    await client.cancel((await client.get_schedule(schedule)).recent_runs[0])
    # The run has ended and the next tick is due too: the held tick, older, runs
    # first; the new one is held behind it.
    await tick_once(stack.engine, now=first + timedelta(seconds=21))
    jobs = await _jobs_of(stack, schedule.name)
    assert [r.rsplit("/", 1)[1] for r, _ in jobs] == [
        (first + timedelta(seconds=s)).isoformat() for s in (0, 10)
    ]
    seen = await client.get_schedule(schedule)
    assert seen.runs == 2 and seen.skipped == 0
    async with stack.engine.connect() as conn:
        held = await conn.scalar(
            text("SELECT buffered_tick FROM schedules WHERE id = :id"), {"id": schedule.id}
        )
    assert held == first + timedelta(seconds=20)


async def test_overlap_cancel_other_cancels_the_earlier_run(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.CANCEL_OTHER)
    first = schedule.next_run_time
    assert first is not None
    await tick_once(stack.engine, now=first + timedelta(seconds=1))
    await tick_once(stack.engine, now=first + timedelta(seconds=11))
    states = [state for _, state in await _jobs_of(stack, schedule.name)]
    assert states == ["cancelled", "queued"]


async def test_overlap_cancel_other_cancels_nothing_when_the_new_run_is_refused(
    stack: Stack,
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.CANCEL_OTHER)
    first = schedule.next_run_time
    assert first is not None
    await tick_once(stack.engine, now=first + timedelta(seconds=1))
    async with stack.engine.begin() as conn:  # the next run names a blob that is gone
        await conn.execute(
            text("UPDATE schedules SET payload = CAST(:payload AS jsonb) WHERE id = :id"),
            {"payload": '{"input": "blobs/' + "b" * 64 + '"}', "id": schedule.id},
        )
    report = await tick_once(stack.engine, now=first + timedelta(seconds=11))
    assert report.refused == 1
    assert [state for _, state in await _jobs_of(stack, schedule.name)] == ["queued"]
    assert (await client.get_schedule(schedule)).last_error.startswith("BLOB_NOT_FOUND")


@pytest.mark.parametrize(("policy", "expected"), [(CatchUp.SKIP, 0), (CatchUp.ONE, 1)])
async def test_catch_up_after_downtime(stack: Stack, policy: CatchUp, expected: int) -> None:
    client = stack.client()
    now = datetime.now(UTC)
    # Ticks every 10 minutes, the newest 5 minutes ago: missed, as are the older ones.
    schedule = await client.create_schedule(
        "demo.echo",
        interval=600,
        start_time=now - timedelta(hours=1, minutes=5),
        catch_up=policy,
        overlap=Overlap.ALLOW_ALL,
    )
    await _move_due(stack, schedule.id, now - timedelta(minutes=45))
    await tick_once(stack.engine)
    assert len(await _jobs_of(stack, schedule.name)) == expected
    after = await client.get_schedule(schedule)
    assert after.next_run_time is not None
    assert after.next_run_time - now == timedelta(minutes=5)


async def test_pause_resume_and_trigger(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", {"x": 1}, interval=5)
    paused = await client.pause_schedule(schedule)
    assert paused.paused and paused.next_run_time is None
    assert (await tick_once(stack.engine, now=datetime.now(UTC) + timedelta(hours=1))).runs == 0
    job = await client.trigger_schedule(schedule, request_id="by-hand")
    assert job.state is JobState.QUEUED
    assert job.labels[SCHEDULE_LABEL] == schedule.name
    again = await client.trigger_schedule(schedule, request_id="by-hand")
    assert again.name == job.name
    resumed = await client.resume_schedule(schedule)
    assert not resumed.paused and resumed.next_run_time is not None
    assert resumed.next_run_time > datetime.now(UTC)
    assert resumed.recent_runs == (job.name,)
    with pytest.raises(ScheduleNotFound):
        await client.trigger_schedule("schedules/nope")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"cron": "61 * * * *"}, "schedule.spec.cron"),
        ({"cron": "* * * * *", "time_zone": "Nowhere/Special"}, "schedule.spec.time_zone"),
        ({"interval": 0.5}, "schedule.spec.interval"),
        ({"interval": -1}, "schedule.spec.interval"),
        ({}, "schedule.spec.interval"),
        ({"cron": "* * * * *", "interval": 60}, "schedule.spec.cron"),
        (
            {
                "interval": 60,
                "start_time": datetime(2030, 1, 1, tzinfo=UTC),
                "end_time": datetime(2029, 1, 1, tzinfo=UTC),
            },
            "schedule.spec.end_time",
        ),
        (
            {"interval": 60, "start_time": datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)},
            "schedule.spec.start_time",
        ),
        ({"interval": 60, "type": "Bad Type"}, "schedule.job.type"),
        ({"interval": 60, "labels": {SCHEDULE_LABEL: "x"}}, "schedule.job.labels"),
        ({"interval": 60, "max_attempts": 1000}, "schedule.job.max_attempts"),
        ({"interval": 60, "schedule_id": "Not_An_Id"}, "schedule_id"),
    ],
)
async def test_bad_input_is_refused_on_its_field_and_writes_nothing(
    stack: Stack, options: dict[str, object], field: str
) -> None:
    job_type = str(options.pop("type", "demo.echo"))
    with pytest.raises(InvalidArgument) as refused:
        await stack.client().create_schedule(job_type, **options)  # type: ignore[arg-type]
    assert refused.value.field == field
    assert await stack.scalar("SELECT count(*) FROM schedules") == 0


async def test_a_type_no_queue_takes_is_refused(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    narrow = replace(topology, queues=(replace(topology.queues[0], bindings=("reports.*",)),))
    stack = await started(
        start_stack(engine, database_url, amqp_url, narrow, relay=False, worker=False)
    )
    with pytest.raises(InvalidArgument) as refused:
        await stack.client().create_schedule("billing.charge", interval=60)
    assert refused.value.reason == "JOB_TYPE_UNROUTABLE"
    assert refused.value.field == "schedule.job.type"
    assert await stack.scalar("SELECT count(*) FROM schedules") == 0


async def test_a_payload_naming_a_missing_blob_is_refused_at_create_and_update(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    blobs: BlobStore,
) -> None:
    stack = await started(
        start_stack(
            engine, database_url, amqp_url, topology, relay=False, worker=False, blobs=blobs
        )
    )
    client = stack.client()
    missing = {"input": "blobs/" + "c" * 64}
    with pytest.raises(BlobNotFound) as refused:
        await client.create_schedule("demo.echo", missing, interval=60)
    assert refused.value.field == "schedule.job.payload"
    assert await stack.scalar("SELECT count(*) FROM schedules") == 0
    schedule = await client.create_schedule("demo.echo", {"n": 1}, interval=60)
    with pytest.raises(BlobNotFound) as refused:
        await client.update_schedule(schedule, payload=missing)
    assert refused.value.field == "schedule.job.payload"
    assert (await client.get_schedule(schedule)).template.payload == {"n": 1}


async def test_a_bad_update_changes_nothing(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=60)
    with pytest.raises(InvalidArgument) as refused:
        await client.update_schedule(schedule, interval=0)
    assert refused.value.field == "schedule.spec.interval"
    assert (await client.get_schedule(schedule)).spec.interval_seconds == 60


async def test_a_tenant_with_a_horizon_gets_the_builtin_retention_schedule(stack: Stack) -> None:
    async with stack.engine.begin() as conn:
        await conn.execute(text("UPDATE tenants SET retention_days = 30 WHERE name = 'acme'"))
    done = await sync_retention_schedules(stack.engine, stack.topology)
    assert (done.created, done.removed) == (1, 0)
    again = await sync_retention_schedules(stack.engine, stack.topology)
    assert (again.created, again.removed) == (0, 0)
    schedule = await stack.client().get_schedule("jobplane-retention")
    assert schedule.template.type == "maintenance.retention"
    assert schedule.catch_up is CatchUp.ONE
    assert schedule.next_run_time is not None
    # Its tick submits the tenant's retention job.
    await _move_due(stack, schedule.id, datetime.now(UTC) - timedelta(seconds=1))
    assert (await tick_once(stack.engine)).runs == 1
    (run,) = await _jobs_of(stack, schedule.name)
    assert run[1] == "queued"
    async with stack.engine.begin() as conn:
        await conn.execute(text("UPDATE tenants SET retention_days = NULL WHERE name = 'acme'"))
    gone = await sync_retention_schedules(stack.engine, stack.topology)
    assert (gone.created, gone.removed) == (0, 1)
    with pytest.raises(ScheduleNotFound):
        await stack.client().get_schedule("jobplane-retention")


async def test_erasure_deletes_the_tenants_schedules_first(stack: Stack, started: Started) -> None:
    await stack.start_relay()
    maintenance = Maintenance(stack.engine, stack.db, live_wait=10.0, poll_interval=0.1)
    await stack.start_worker(demo_registry.merge(maintenance.registry()))
    client = stack.client()
    ticking = await client.create_schedule("demo.echo", interval=1, overlap=Overlap.ALLOW_ALL)
    await started(Scheduler(stack.engine, poll=0.1))

    async def ran() -> bool:
        return bool(await _jobs_of(stack, ticking.name))

    await eventually(ran)
    job = await client.submit("maintenance.erasure", {"confirm": "acme"})
    done = await client.wait(job.name, timeout=60)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None and done.result["deleted"]["schedules"] == 1
    assert await stack.scalar("SELECT count(*) FROM schedules") == 0
    assert await _jobs_of(stack, ticking.name) == []


async def test_a_schedule_whose_tick_fails_stops_no_other_schedule(stack: Stack) -> None:
    """A tick that errors (a blob gone, a zone this host lacks) is that schedule's
    error alone: another tenant's schedule due after it still runs."""
    other = stack.client(await stack.new_key("globex"))
    good = await other.create_schedule("demo.echo", interval=60)
    client = stack.client()
    gone = await client.create_schedule("demo.echo", interval=60, schedule_id="blob-gone")
    zoneless = await client.create_schedule("demo.echo", cron="* * * * *", schedule_id="zoneless")
    due = good.next_run_time
    assert due is not None
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET payload = CAST(:payload AS jsonb) WHERE id = 'blob-gone'"),
            {"payload": '{"input": "blobs/' + "a" * 64 + '"}'},
        )
        await conn.execute(
            text("UPDATE schedules SET time_zone = 'Nowhere/Atlantis' WHERE id = 'zoneless'")
        )
    for schedule_id in ("blob-gone", "zoneless"):
        await _move_due(stack, schedule_id, due - timedelta(seconds=30))
    now = due + timedelta(seconds=1)

    report = await tick_once(stack.engine, now=now)

    assert (report.runs, report.refused, report.failed) == (1, 1, 1)
    assert len(await _jobs_of(stack, good.name)) == 1
    refused = await client.get_schedule(gone)
    assert refused.last_error.startswith("BLOB_NOT_FOUND")
    assert refused.next_run_time is not None and refused.next_run_time > now
    failed = await client.get_schedule(zoneless)
    assert "ZoneInfoNotFoundError" in failed.last_error
    assert failed.next_run_time == now + FAILURE_BACKOFF
    assert await _jobs_of(stack, gone.name) == await _jobs_of(stack, zoneless.name) == []
    # Put off, the failed one is not claimed again in the same minute.
    assert (await tick_once(stack.engine, now=now)).failed == 0


async def test_a_held_tick_runs_when_the_sweeper_ticks_by_the_clock(stack: Stack) -> None:
    """The sweeper gives no time (``now=None``): the held tick runs at the clock's."""
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=10, overlap=Overlap.BUFFER_ONE)
    first = schedule.next_run_time
    assert first is not None
    for k in range(2):
        await tick_once(stack.engine, now=first + timedelta(seconds=10 * k + 1))
    await client.cancel((await client.get_schedule(schedule)).recent_runs[0])
    await tick_once(stack.engine)
    jobs = await _jobs_of(stack, schedule.name)
    assert [r.rsplit("/", 1)[1] for r, _ in jobs] == [
        (first + timedelta(seconds=s)).isoformat() for s in (0, 10)
    ]
    seen = await client.get_schedule(schedule)
    assert seen.runs == 2
    # The run started now, by the clock.
    assert seen.last_run_time is not None
    assert abs((seen.last_run_time - datetime.now(UTC)).total_seconds()) < 60


async def test_a_held_tick_that_fails_is_counted_and_dropped(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule(
        "demo.echo", cron="* * * * *", overlap=Overlap.BUFFER_ONE, schedule_id="held"
    )
    first = schedule.next_run_time
    assert first is not None
    for k in range(2):  # the first run stays QUEUED: no worker; the second tick is held
        await tick_once(stack.engine, now=first + timedelta(seconds=60 * k + 1))
    await client.cancel((await client.get_schedule(schedule)).recent_runs[0])
    async with stack.engine.begin() as conn:
        # A row no API writes (a payload not an object): its run cannot be built.
        await conn.execute(text("UPDATE schedules SET payload = '[1]' WHERE id = 'held'"))
    # No tick is due: only the held one runs, and fails.
    report = await tick_once(stack.engine, now=first + timedelta(seconds=70))
    assert (report.runs, report.failed) == (0, 1)
    failed = await stack.scalar("SELECT last_error FROM schedules WHERE id = 'held'")
    assert failed.startswith("INTERNAL: TypeError")
    assert await stack.scalar(
        "SELECT (runs, skipped, buffered_tick, next_run_time) FROM schedules WHERE id = 'held'"
    ) == (1, 1, None, first + timedelta(seconds=120))  # the held tick dropped, counted skipped
    assert len(await _jobs_of(stack, schedule.name)) == 1
    assert (await tick_once(stack.engine, now=first + timedelta(seconds=70))).failed == 0
