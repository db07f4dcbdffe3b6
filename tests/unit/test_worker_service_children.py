"""WorkerService's children, without a server: a fan-out stage's items (ADR-0047),
SubmitChildJob's child, and the registrations and attempts the service keeps."""

from __future__ import annotations

import dataclasses
import tomllib
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from jobplane.attempt_end import ADVANCED
from jobplane.errors import AttemptLeaseLost, FailedPrecondition, InvalidArgument
from jobplane.names import job_name
from jobplane.server import worker_protocol as protocol_module
from jobplane.server.worker_protocol import Fence, Registration, WorkerService
from jobplane.store.attempts import Attempt, LeaseLost, StageRun
from jobplane.topology import parse_topology
from jobplane.workers.children import ChildRequest, fence_of
from tests.support.logs import Lines, module_lines
from tests.support.worker_service import (
    PENDING,
    AttemptStoreFake,
    HeldAttemptsFake,
    Recorded,
    WorkersFake,
    claimed_attempt,
    worker_service_on,
)

TOPOLOGY = parse_topology(
    tomllib.loads(
        """
[[queues]]
name = "q"
bindings = ["#"]

[[pipelines]]
name = "p.run"
[[pipelines.stages]]
name = "split"
type = "p.split"
[[pipelines.stages]]
name = "map"
type = "p.map"
fan_out = true
[[pipelines.stages]]
name = "join"
type = "p.join"
"""
    ),
    source="t.toml",
)
SPLIT = StageRun("p.run", "v1", "split", 0, 3, "v1", {}, fans_out=True)


class _Fans(AttemptStoreFake):
    """AttemptStore.fanned_out and finish, recorded."""

    async def finish(self, outcome: Any, pending: Any = ()) -> None:
        self._write("finish", outcome.attempt, items=outcome.items, pending=pending)

    def fanned_out(self, attempt: Attempt, items: Any) -> Any:
        return SimpleNamespace(attempt=attempt, items=items)


def _fan_setup(**options: Any) -> tuple[WorkerService, _Fans, HeldAttemptsFake, Recorded, Fence]:
    attempt, store, metrics = (
        claimed_attempt(type="p.split", queue="q", stage=SPLIT),
        _Fans(),
        Recorded(),
    )
    held = HeldAttemptsFake(attempt)
    fakes: Any = (store, held, None)
    service = WorkerService(fakes[0], fakes[1], TOPOLOGY, workers=fakes[2], **options)
    service.metrics = metrics  # type: ignore[assignment]
    return service, store, held, metrics, Fence(attempt.job_id, 1, attempt.lease_token)


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Any:
    with module_lines(monkeypatch, protocol_module, "jobplane.server") as captured:
        yield captured


async def test_a_stage_before_a_fan_out_completes_with_one_child_per_item(lines: Lines) -> None:
    service, store, held, metrics, fence = _fan_setup()
    items = [{"page": 1}, {"page": 2}]
    await service.complete(fence, {}, PENDING, items=items)
    assert store.calls == [("finish", {"items": items, "pending": PENDING})]
    assert metrics.calls == [
        ("submitted", ("p.map", "q", 2)),
        ("attempt_ended", ("p.split", "q", ADVANCED)),
    ]
    (line,) = lines
    assert (line["event"], line["attempt"], line["children"]) == ("job.fanned_out", 1, 2)
    assert (line["job"], line["queue"]) == (job_name(fence.job_id), "q")
    # Done with: the next call of the attempt reads it again.
    held.attempts.clear()
    with pytest.raises(AttemptLeaseLost):
        await service.heartbeat(fence)


async def test_a_fan_out_is_refused_before_anything_is_written_naming_what_is_wrong() -> None:
    service, store, _held, metrics, fence = _fan_setup(max_result_bytes=40)

    async def refused(items: list[Any], **options: Any) -> tuple[str | None, str]:
        with pytest.raises(InvalidArgument) as error:
            await service.complete(fence, {}, [], items=items, **options)
        return error.value.field, error.value.message

    assert await refused([{"page": 1}], has_result=True) == (
        "result",
        "a stage before a fan-out stage completes with items, not a result",
    )
    assert await refused([{"page": 1}, 7]) == (
        "items",
        "item 1 is a int: each item must be an object (the child's payload)",
    )
    assert await refused([{"page": 1}, {"text": "x" * 50}]) == (
        "items",
        "payload is 61 bytes serialized; the limit is 40",
    )
    # An empty list spawns no child: the stage still completes.
    await service.complete(fence, {}, [], items=[])
    assert store.calls == [("finish", {"items": [], "pending": []})]
    assert metrics.calls[-1] == ("attempt_ended", ("p.split", "q", ADVANCED))


async def test_items_are_for_a_stage_before_a_fan_out_only() -> None:
    for stage in (None, dataclasses.replace(SPLIT, fans_out=False)):
        attempt, store = claimed_attempt(stage=stage), AttemptStoreFake()
        service = worker_service_on(store, HeldAttemptsFake(attempt))
        fence = Fence(attempt.job_id, 1, attempt.lease_token)
        with pytest.raises(InvalidArgument) as refused:
            await service.complete(fence, {}, [], items=[{"page": 1}])
        assert (refused.value.field, refused.value.message) == (
            "items",
            "items are for a stage before a fan-out stage (ClaimJobResponse.fans_out)",
        )
        assert store.calls == []


# -- SubmitChildJob ----------------------------------------------------------------


class _Children:
    """ChildStore.submit: the child's name, created unless its key was seen; recorded."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, str, Any]] = []
        self.lost = False

    async def submit(self, fence: Any, key: str, new: Any) -> tuple[Any, bool]:
        if self.lost:
            raise LeaseLost("moved on")
        created = key not in [k for _, k, _ in self.submitted]
        self.submitted.append((fence, key, new))
        return SimpleNamespace(name=f"jobs/child-{key}"), created


def _child_setup(**options: Any) -> tuple[WorkerService, _Children, Recorded, Attempt, Fence]:
    attempt, children, metrics = claimed_attempt(correlation_id="order-17"), _Children(), Recorded()
    service = worker_service_on(
        AttemptStoreFake(), HeldAttemptsFake(attempt), children=children, **options
    )
    service.metrics = metrics  # type: ignore[assignment]
    return service, children, metrics, attempt, Fence(attempt.job_id, 1, attempt.lease_token)


async def test_a_child_is_submitted_under_the_attempts_fence_once_per_key() -> None:
    service, children, metrics, attempt, fence = _child_setup()
    spent: list[uuid.UUID] = []
    service.take_submit = spent.append
    request = ChildRequest(key="page-1", type="reports.render", payload={"page": 1})
    assert await service.submit_child(fence, request) == ("jobs/child-page-1", True)
    ((parent, key, new),) = children.submitted
    assert (parent, key) == (fence_of(attempt), "page-1")
    # The child inherits its parent's correlation id and gets its queue's defaults.
    assert (new.type, new.queue, new.payload) == ("reports.render", "jobplane.default", {"page": 1})
    assert (new.correlation_id, new.max_attempts) == ("order-17", 3)
    assert spent == [attempt.tenant_id]
    assert metrics.calls == [("submitted", ("reports.render", "jobplane.default"))]
    # The same key again: the same child, not counted again (the submit is still spent).
    assert await service.submit_child(fence, request) == ("jobs/child-page-1", False)
    assert len(metrics.calls) == 1 and len(spent) == 2


async def test_a_child_is_checked_against_the_servers_limits() -> None:
    service, children, _metrics, _parent, fence = _child_setup(
        max_result_bytes=20, max_schedule_seconds=60.0
    )
    big = ChildRequest(key="k", type="reports.render", payload={"text": "x" * 30})
    with pytest.raises(InvalidArgument) as refused:
        await service.submit_child(fence, big)
    assert refused.value.field == "payload"
    late = ChildRequest(key="k", type="reports.render", payload={}, schedule_delay_seconds=61.0)
    with pytest.raises(InvalidArgument) as refused:
        await service.submit_child(fence, late)
    assert refused.value.field == "schedule_delay"
    assert children.submitted == []
    soon = dataclasses.replace(late, schedule_delay_seconds=59.0)
    assert (await service.submit_child(fence, soon))[1] is True


async def test_a_child_of_an_attempt_that_lost_its_lease_is_lease_lost() -> None:
    service, children, _metrics, attempt, fence = _child_setup()
    children.lost = True
    request = ChildRequest(key="k", type="reports.render", payload={})
    with pytest.raises(AttemptLeaseLost) as lost:
        await service.submit_child(fence, request)
    assert lost.value.message.startswith(f"{job_name(attempt.job_id)} attempt 1 does not hold")


async def test_a_server_without_a_child_store_refuses_children() -> None:
    attempt = claimed_attempt()
    service = worker_service_on(AttemptStoreFake(), HeldAttemptsFake(attempt))
    request = ChildRequest(key="k", type="reports.render", payload={})
    with pytest.raises(FailedPrecondition) as refused:
        await service.submit_child(Fence(attempt.job_id, 1, attempt.lease_token), request)
    assert refused.value.message == "this server does not take child jobs"


# -- workers and attempts kept -----------------------------------------------------


async def test_a_registered_worker_labels_its_types_and_stops_by_its_id() -> None:
    registry, metrics = WorkersFake(), Recorded()
    service = worker_service_on(AttemptStoreFake(), HeldAttemptsFake(), registry)
    service.metrics = metrics  # type: ignore[assignment]
    worker_id = await service.register(Registration(["a.b", "a.c"], ["jobplane.default"], 1))
    assert registry.calls == [("register", worker_id)]
    assert metrics.calls == [("know_types", (["a.b", "a.c"],))]
    await service.stop_worker(worker_id)
    assert registry.calls == [("register", worker_id), ("stop", worker_id)]


async def test_the_oldest_attempt_kept_is_let_go_past_ten_thousand() -> None:
    attempts = [claimed_attempt(job_id=uuid.uuid4()) for _ in range(10_001)]
    held = HeldAttemptsFake(*attempts)
    service = worker_service_on(AttemptStoreFake(), held)
    fences = [Fence(a.job_id, 1, a.lease_token) for a in attempts]
    for fence in fences:
        await service.heartbeat(fence)
    assert held.reads == 10_001
    # The second and the last are still kept; the first was let go and is read again.
    await service.heartbeat(fences[1])
    await service.heartbeat(fences[-1])
    assert held.reads == 10_001
    await service.heartbeat(fences[0])
    assert held.reads == 10_002


async def test_a_fan_out_whose_write_loses_the_lease_is_lease_lost() -> None:
    service, store, held, metrics, fence = _fan_setup()
    store.lost = "finish"
    with pytest.raises(AttemptLeaseLost, match="attempt 1 does not hold the job"):
        await service.complete(fence, {}, [], items=[{"page": 1}])
    assert metrics.calls == []
    held.attempts.clear()
    with pytest.raises(AttemptLeaseLost):
        await service.heartbeat(fence)
    assert held.reads == 2
