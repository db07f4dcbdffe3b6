"""What a schedule's run is and when a trigger may start one: schedules of pipelines,
and TriggerSchedule with an overlap policy (docs/scheduling.md)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import FailedPrecondition, InvalidArgument, JobState, Overlap, Schedule
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.store.schedule_ticks import tick_once
from jobplane.topology import Topology
from tests.integration.test_cli_and_sync import jobplane
from tests.integration.test_pipelines import aidj  # noqa: F401 (a fixture)
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def _count(stack: Stack, name: str) -> int:
    return int(
        await stack.scalar(
            f"SELECT count(*) FROM jobs WHERE labels->>'{SCHEDULE_LABEL}' = '{name}'"
        )
    )


async def test_trigger_skip_is_refused_naming_the_running_job_and_writes_nothing(
    stack: Stack,
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    first = await client.trigger_schedule(schedule)  # stays QUEUED: no worker
    with pytest.raises(FailedPrecondition) as refused:
        await client.trigger_schedule(schedule, overlap=Overlap.SKIP)
    assert first.name in refused.value.message
    assert await _count(stack, schedule.name) == 1
    assert (await client.get_schedule(schedule)).runs == 1
    # Unspecified and ALLOW_ALL run anyway.
    await client.trigger_schedule(schedule)
    await client.trigger_schedule(schedule, overlap=Overlap.ALLOW_ALL)
    assert await _count(stack, schedule.name) == 3


async def test_trigger_skip_runs_when_nothing_runs_and_a_replay_returns_its_run(
    stack: Stack,
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    job = await client.trigger_schedule(schedule, request_id="once", overlap=Overlap.SKIP)
    assert job.state is JobState.QUEUED
    # The same request again is that run, not a refusal because it runs.
    again = await client.trigger_schedule(schedule, request_id="once", overlap=Overlap.SKIP)
    assert again.name == job.name
    await client.cancel(job.name)
    after = await client.trigger_schedule(schedule, overlap=Overlap.SKIP)
    assert after.name != job.name
    assert (await client.get_schedule(schedule)).runs == 2


async def test_trigger_cancel_other_cancels_the_earlier_runs(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    first = await client.trigger_schedule(schedule)
    second = await client.trigger_schedule(schedule)
    newest = await client.trigger_schedule(schedule, overlap=Overlap.CANCEL_OTHER)
    assert (await client.get(first.name)).state is JobState.CANCELLED
    assert (await client.get(second.name)).state is JobState.CANCELLED
    assert (await client.get(newest.name)).state is JobState.QUEUED


async def test_trigger_buffer_one_is_refused_on_its_field(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    with pytest.raises(InvalidArgument) as refused:
        await client.trigger_schedule(schedule, overlap=Overlap.BUFFER_ONE)
    assert refused.value.field == "overlap_policy"
    assert await _count(stack, schedule.name) == 0


async def test_the_trigger_command_takes_an_overlap_policy(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600, schedule_id="hourly")
    first = await client.trigger_schedule(schedule)
    code, _, err = await jobplane(stack, "schedules", "trigger", "hourly", "--overlap", "skip")
    assert code == 1 and first.name in err
    code, out, err = await jobplane(
        stack, "schedules", "trigger", "hourly", "--overlap", "cancel_other"
    )
    assert code == 0, err
    assert "jobs/" in out and first.name not in out
    assert (await client.get(first.name)).state is JobState.CANCELLED
    assert await _count(stack, schedule.name) == 2


@pytest.fixture
async def aidj_stack(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    aidj: Topology,  # noqa: F811
    started: Started,
) -> Stack:
    """A server alone on the seed's topology (its pipelines)."""
    return await started(
        start_stack(engine, database_url, amqp_url, aidj, relay=False, worker=False)
    )


async def test_a_schedule_of_a_pipeline_submits_pipeline_jobs(aidj_stack: Stack) -> None:
    stack, engine, topology = aidj_stack, aidj_stack.engine, aidj_stack.topology
    pipeline = topology.pipelines[0]
    client = stack.client()
    schedule = await client.create_schedule(
        pipeline.name, {"track": "t1"}, interval=60, labels={"team": "dj"}
    )
    first = schedule.next_run_time
    assert first is not None
    report = await tick_once(engine, now=first + timedelta(seconds=1), topology=topology)
    assert report.runs == 1 and report.refused == 0
    (ticked,) = (await client.get_schedule(schedule)).recent_runs
    job = await client.get(ticked)
    # As SubmitJob makes a job of the pipeline.
    direct = await client.submit(pipeline.name, {"track": "t1"})
    assert job.type == direct.type == pipeline.name
    assert job.pipeline_version == direct.pipeline_version
    assert [(s.name, s.type, s.state) for s in job.stages] == [
        (s.name, s.type, s.state) for s in direct.stages
    ]
    assert job.stage == direct.stage == pipeline.stages[0].name
    assert job.labels == {"team": "dj", SCHEDULE_LABEL: schedule.name}
    # The same tick again is the same job; a trigger is a pipeline job too.
    again = await tick_once(engine, now=first + timedelta(seconds=1), topology=topology)
    assert again.runs == 0
    triggered = await client.trigger_schedule(schedule)
    assert triggered.type == pipeline.name and len(triggered.stages) == len(pipeline.stages)


async def _refused_first_run(
    stack: Stack, ticker: Topology, payload: str | None = None
) -> Schedule:
    """A schedule of the pipeline, every minute, whose first run a ticker on ``ticker``
    refuses, as read after that tick; ``payload`` (JSON), when given, is written over the
    schedule's own in its table first."""
    client = stack.client()
    schedule = await client.create_schedule(
        stack.topology.pipelines[0].name, {"track": "t1"}, interval=60
    )
    first = schedule.next_run_time
    assert first is not None
    if payload is not None:
        async with stack.engine.begin() as conn:
            await conn.execute(
                text("UPDATE schedules SET payload = CAST(:payload AS jsonb) WHERE id = :id"),
                {"payload": payload, "id": schedule.id},
            )
    report = await tick_once(stack.engine, now=first + timedelta(seconds=1), topology=ticker)
    assert report.refused == 1 and report.runs == 0
    return await client.get_schedule(schedule)


async def test_a_ticker_without_the_pipeline_refuses_the_run_in_last_error(
    aidj_stack: Stack,
) -> None:
    seen = await _refused_first_run(aidj_stack, Topology())
    assert "pipeline" in seen.last_error and seen.recent_runs == ()


async def test_a_pipeline_run_naming_a_deleted_blob_is_refused_in_last_error(
    aidj_stack: Stack,
) -> None:
    # As if the blob the payload names were deleted after the schedule was written.
    seen = await _refused_first_run(
        aidj_stack, aidj_stack.topology, '{"input": "blobs/' + "a" * 64 + '"}'
    )
    assert seen.last_error == "BLOB_NOT_FOUND: the payload references a blob that does not exist"
    assert seen.recent_runs == ()


async def test_a_held_tick_of_a_pipeline_runs_as_a_pipeline_job(aidj_stack: Stack) -> None:
    stack, engine, topology = aidj_stack, aidj_stack.engine, aidj_stack.topology
    pipeline = topology.pipelines[0]
    client = stack.client()
    schedule = await client.create_schedule(
        pipeline.name, {"track": "t1"}, interval=10, overlap=Overlap.BUFFER_ONE
    )
    first = schedule.next_run_time
    assert first is not None
    for k in range(2):  # the first run stays QUEUED (no worker): the second tick is held
        await tick_once(engine, now=first + timedelta(seconds=10 * k + 1), topology=topology)
    (running,) = (await client.get_schedule(schedule)).recent_runs
    await client.cancel(running)
    # The run has ended: the held tick runs, a job of the pipeline as any run is.
    await tick_once(engine, now=first + timedelta(seconds=12), topology=topology)
    seen = await client.get_schedule(schedule)
    assert seen.last_error == "" and seen.runs == 2
    held = await client.get(next(run for run in seen.recent_runs if run != running))
    assert held.type == pipeline.name and held.stage == pipeline.stages[0].name
    assert [s.name for s in held.stages] == [s.name for s in pipeline.stages]
