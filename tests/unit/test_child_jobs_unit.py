"""A child job as its parent's handler asks for it: a pipeline child with its stages,
a scheduled one, and what ``ctx.submit``'s writer hands the store and the metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobplane.errors import InvalidArgument
from jobplane.store.children import ParentFence
from jobplane.store.job_submit import NewJob
from jobplane.topology import PipelineSpec, QueueSpec, StageSpec, Topology
from jobplane.workers.children import ChildRequest, WorkerChildren, check_key, child_job
from tests.support.attempts import an_attempt

_STAGES = (
    StageSpec("resize", "img.resize", "img.work", 4, 30.0, version="v2", weight=1.0),
    StageSpec("tag", "img.tag", "img.work", 5, 60.0, weight=3.0, fan_out=True, max_failures=2),
)
# The pipeline's name routes to another queue than its first stage's: the stage's wins.
TOPOLOGY = Topology(
    queues=(QueueSpec("fan.work", ("fan.#",)), QueueSpec("img.work", ("img.#",))),
    pipelines=(PipelineSpec("fan.pics", _STAGES, version="7"),),
)


def _child(**fields: Any) -> NewJob:
    values: dict[str, Any] = {"key": "k", "type": "fan.pics", "payload": {"n": 1}, **fields}
    return child_job(
        TOPOLOGY, ChildRequest(**values), parent_correlation_id="p", max_payload_bytes=1024
    )


def test_a_pipeline_child_runs_the_pipelines_stages_with_their_own_settings() -> None:
    new = _child()
    assert (new.type, new.queue, new.payload, new.correlation_id) == (
        "fan.pics",
        "img.work",
        {"n": 1},
        "p",
    )
    assert (new.max_attempts, new.timeout_seconds, new.pipeline_version) == (0, 0.0, "7")
    stages = [
        (s.name, s.type, s.queue, s.version, s.max_attempts, s.timeout_seconds, s.base, s.span)
        for s in new.stages
    ]
    assert stages == [
        ("resize", "img.resize", "img.work", "v2", 4, 30.0, 0.0, 0.25),
        ("tag", "img.tag", "img.work", "", 5, 60.0, 0.25, 0.75),
    ]
    assert [(s.fan_out, s.max_failures) for s in new.stages] == [(False, 0), (True, 2)]


def test_a_pipeline_childs_attempts_and_timeout_replace_every_stages() -> None:
    new = _child(max_attempts=2, timeout_seconds=9.0)
    assert (new.max_attempts, new.timeout_seconds) == (2, 9.0)
    assert [(s.max_attempts, s.timeout_seconds) for s in new.stages] == [(2, 9.0), (2, 9.0)]


def test_a_plain_child_has_no_stages() -> None:
    new = _child(type="fan.leaf")
    assert (new.type, new.queue, new.stages, new.pipeline_version) == (
        "fan.leaf",
        "fan.work",
        (),
        "",
    )


def test_a_child_may_be_scheduled_within_the_horizon() -> None:
    before = datetime.now(UTC)
    later = _child(type="fan.leaf", schedule_delay_seconds=60.0).schedule_time
    assert later is not None
    assert before + timedelta(seconds=60) <= later <= datetime.now(UTC) + timedelta(seconds=60)
    at = datetime(datetime.now(UTC).year + 4, 1, 1, tzinfo=UTC)  # inside the 10-year horizon
    request = ChildRequest("k", "fan.leaf", {}, schedule_time=at)
    far = child_job(
        TOPOLOGY,
        request,
        parent_correlation_id="p",
        max_payload_bytes=64,
        horizon_seconds=10 * 365 * 86400.0,
    )
    assert far.schedule_time == at
    with pytest.raises(InvalidArgument) as refused:
        child_job(
            TOPOLOGY,
            ChildRequest("k", "fan.leaf", {}, schedule_delay_seconds=60.0),
            parent_correlation_id="p",
            max_payload_bytes=64,
            horizon_seconds=30.0,
        )
    assert refused.value.field == "schedule_delay"


REQUIRED = "key is required: it names the child among its parent's"
CONTROL = "key has control characters or is not UTF-8"


@pytest.mark.parametrize(
    ("key", "message"),
    [(None, REQUIRED), (7, REQUIRED), ("a\x1fb", CONTROL), ("a\x7fb", CONTROL)],
    ids=["none", "not-text", "unit-separator", "delete"],
)
def test_a_key_that_is_not_plain_text_is_refused(key: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_key(key)
    assert (refused.value.field, str(refused.value)) == ("key", message)


def test_a_key_may_hold_spaces_and_any_printable_character() -> None:
    assert check_key(" ") == " "
    assert check_key("chunk 1/é~") == "chunk 1/é~"


def test_a_correlation_id_may_hold_spaces() -> None:
    assert _child(correlation_id="order 7").correlation_id == "order 7"
    assert _child(correlation_id="é" * 127 + "x").correlation_id == "é" * 127 + "x"


class _Store:
    def __init__(self, created: bool) -> None:
        self.created = created
        self.asked: list[tuple[ParentFence, str, NewJob]] = []

    async def submit(self, fence: ParentFence, key: str, new: NewJob) -> tuple[Any, bool]:
        self.asked.append((fence, key, new))
        return type("Child", (), {"name": "jobs/child-1"})(), self.created


@pytest.mark.parametrize("created", [True, False], ids=["created", "existed"])
async def test_a_child_is_written_under_its_parents_attempt_and_counted_when_new(
    created: bool,
) -> None:
    store = _Store(created)
    counted: list[tuple[str, str, int]] = []
    children = WorkerChildren(
        store,  # type: ignore[arg-type]
        TOPOLOGY,
        max_payload_bytes=16,
        horizon_seconds=30.0,
        on_created=lambda *args: counted.append(args),
    )
    attempt = an_attempt(attempt=2, correlation_id="parent-c")
    request = ChildRequest("k-1", "fan.leaf", {"i": 1})

    assert await children.submit(attempt, request) == ("jobs/child-1", created)

    (fence, key, new) = store.asked[0]
    assert fence == ParentFence(attempt.tenant_id, attempt.job_id, 2, attempt.lease_token)
    assert (key, new.type, new.queue, new.correlation_id) == (
        "k-1",
        "fan.leaf",
        "fan.work",
        "parent-c",
    )
    assert counted == ([("fan.leaf", "fan.work", 1)] if created else [])
    # The writer's limits are the child's: its payload limit, its horizon.
    with pytest.raises(InvalidArgument, match="larger than 16 bytes"):
        await children.submit(attempt, ChildRequest("k-2", "fan.leaf", {"x": "y" * 20}))
    late = ChildRequest("k-3", "fan.leaf", {}, schedule_delay_seconds=60.0)
    with pytest.raises(InvalidArgument):
        await children.submit(attempt, late)
    assert len(store.asked) == 1


async def test_a_child_writer_without_a_metrics_hook_still_writes() -> None:
    store = _Store(True)
    children = WorkerChildren(store, TOPOLOGY, max_payload_bytes=64)  # type: ignore[arg-type]
    name, created = await children.submit(an_attempt(), ChildRequest("k", "fan.leaf", {}))
    assert (name, created, len(store.asked)) == ("jobs/child-1", True, 1)
