"""ScheduleService's checks of a schedule's job template, and of a trigger's overlap,
which refuse before anything reaches the database."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jobplane.errors import InvalidArgument, UnroutableJobType
from jobplane.schedule_spec import Overlap, Spec
from jobplane.schedule_types import SCHEDULE_LABEL, JobTemplate, Schedule
from jobplane.server.schedules import ScheduleService
from jobplane.store.engine import create_engine
from jobplane.topology import QueueSpec, Topology
from jobplane.topology.model import PipelineSpec, StageSpec


@pytest.fixture
async def service() -> AsyncIterator[ScheduleService]:
    """A service on an engine that never connects (these checks come first), with a
    topology that routes only the demo types, and a pipeline of them."""
    engine = create_engine("postgresql://unused@127.0.0.1:1/unused", pool_size=1)
    stage = StageSpec("echo", "demo.echo", "only-demo", 3, 60.0)
    topology = Topology(
        queues=(QueueSpec("only-demo", ("demo.*",)),),
        pipelines=(PipelineSpec("reports.build", (stage,)),),
    )
    yield ScheduleService(engine, topology, max_payload_bytes=100)
    await engine.dispose()


def _schedule(**template: Any) -> Schedule:
    return Schedule(
        name="", template=JobTemplate(**{"type": "demo.echo", **template}), spec=Spec(cron="@daily")
    )


def test_a_template_within_every_bound_passes(service: ScheduleService) -> None:
    labels = {f"k{i}": "v" for i in range(63)}
    for timeout in (0.001, 7 * 24 * 3600.0, None):
        service.check(_schedule(timeout_seconds=timeout, max_attempts=100, labels=labels))
    service.check(_schedule(max_attempts=0, payload={"n": 1}))
    # A pipeline runs by its stages' routes, not one of its own.
    service.check(_schedule(type="reports.build"))


def test_each_bad_template_field_is_named_under_the_schedule(service: ScheduleService) -> None:
    timeout = "timeout must be at least 0.001 and at most 604800 seconds"
    refusals: list[tuple[dict[str, Any], str, str | None]] = [
        ({"timeout_seconds": 0.0009}, "schedule.job.timeout", timeout),
        ({"timeout_seconds": 7 * 24 * 3600.0 + 1}, "schedule.job.timeout", timeout),
        (
            {"max_attempts": 101},
            "schedule.job.max_attempts",
            "max_attempts must be 0 (queue default) .. 100",
        ),
        ({"max_attempts": -1}, "schedule.job.max_attempts", None),
        (
            {"labels": {SCHEDULE_LABEL: "x"}},
            "schedule.job.labels",
            f"at most 63 labels, not {SCHEDULE_LABEL!r}: each run carries the schedule's "
            "name in it",
        ),
        ({"labels": {f"k{i}": "v" for i in range(64)}}, "schedule.job.labels", None),
        ({"payload": {"x": "y" * 200}}, "schedule.job.payload", None),
        ({"type": "Bad Type"}, "schedule.job.type", None),
    ]
    for template, field, message in refusals:
        with pytest.raises(InvalidArgument) as refused:
            service.check(_schedule(**template))
        assert refused.value.field == field, template
        if message is not None:
            assert refused.value.message == message
    with pytest.raises(UnroutableJobType) as unroutable:
        service.check(_schedule(type="nowhere.at.all"))
    assert unroutable.value.field == "schedule.job.type"
    assert unroutable.value.message == "no queue of the topology takes job type 'nowhere.at.all'"


async def test_a_trigger_refuses_the_overlap_of_a_tick(service: ScheduleService) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await service.trigger(uuid.UUID(int=1), "schedules/nightly", "r-1", Overlap.BUFFER_ONE)
    assert refused.value.field == "overlap_policy"
    assert refused.value.message == (
        "overlap_policy BUFFER_ONE is a tick's: a trigger runs now, is refused (SKIP) "
        "or cancels the earlier runs (CANCEL_OTHER)"
    )


async def test_a_bad_schedule_id_is_refused_by_the_id_given(service: ScheduleService) -> None:
    for given in ("Nightly", "9-lives", "a_b", "ends-"):
        with pytest.raises(InvalidArgument) as refused:
            await service.create(uuid.UUID(int=1), _schedule(), given)
        assert refused.value.field == "schedule_id"
        assert refused.value.message == (
            f"schedule_id {given!r} must be 1 to 63 lowercase letters, digits "
            "and '-', starting with a letter"
        )
