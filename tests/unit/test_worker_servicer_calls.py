"""WorkerService's gRPC adapter in process: each request's fields reach the service,
and each answer carries what a worker in any language reads (docs/workers.md).

The RPCs run unwrapped (``__wrapped__``: past the worker-key gate, which
tests/unit/test_gate_unit.py covers) over a WorkerService on fakes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2

from jobplane.envelope import Envelope
from jobplane.errors import InvalidArgument
from jobplane.fanout import ItemResult
from jobplane.server.worker_protocol import Claimed, worker_name
from jobplane.server.worker_servicer import (
    WorkerServiceServicer,
    _stage_fields,
    child_request,
    claim_to_pb,
)
from jobplane.store.attempts import ClaimResult, ClaimStatus, HandBack, ProgressUpdate, StageRun
from jobplane.types import JobError, JobState
from jobplane.v1 import workers_pb2
from jobplane.workers.children import ChildRequest
from tests.support.worker_service import (
    ClaimsFake,
    HeldAttemptsFake,
    WorkersFake,
    claimed_attempt,
    worker_service_on,
)

Claim = workers_pb2.ClaimJobResponse


def _near(stamp: timestamp_pb2.Timestamp, seconds: float) -> bool:
    """Whether ``stamp`` is about ``seconds`` from now."""
    expected = datetime.now(UTC) + timedelta(seconds=seconds)
    return abs((stamp.ToDatetime(tzinfo=UTC) - expected).total_seconds()) < 5


def test_a_claim_of_a_joining_stage_answers_its_stage_inputs_and_childrens_results() -> None:
    results = (
        ItemResult(0, "jobs/a", JobState.SUCCEEDED, result={"words": 3}),
        ItemResult(1, "jobs/b", JobState.FAILED, error=JobError("BAD_PAGE", "page 2 is blank")),
    )
    stage = StageRun("p.run", "v1", "join", 2, 3, "v7", {"split": {"n": 2}}, results=results)
    # Past its budget (a fourth attempt of three): no attempt is left, never fewer.
    attempt = claimed_attempt(stage=stage, attempt=4, correlation_id="order-17", request_id="req-9")
    reply = claim_to_pb(Claimed(ClaimResult(ClaimStatus.CLAIMED, attempt=attempt), 30.0, 5.0))
    assert (reply.type, reply.max_attempts, reply.attempts_left) == ("reports.render", 3, 0)
    assert (reply.correlation_id, reply.request_id) == ("order-17", "req-9")
    assert (reply.stage, reply.stage_version, reply.fans_out) == ("join", "v7", False)
    assert reply.inputs.fields["split"].struct_value.fields["n"].number_value == 2
    assert reply.attempt == workers_pb2.AttemptRef(
        job=f"jobs/{attempt.job_id}", attempt=4, lease_token=str(attempt.lease_token)
    )
    assert _near(reply.lease_expire_time, 30.0)
    succeeded, failed = reply.results
    assert (succeeded.index, succeeded.job, succeeded.state) == (0, "jobs/a", "SUCCEEDED")
    assert (succeeded.error_code, succeeded.error_message) == ("", "")
    assert succeeded.result.fields["words"].number_value == 3
    assert (failed.index, failed.job, failed.state) == (1, "jobs/b", "FAILED")
    assert (failed.error_code, failed.error_message) == ("BAD_PAGE", "page 2 is blank")
    assert not failed.HasField("result")


def test_a_claim_says_whether_the_stage_fans_out_and_a_plain_job_neither() -> None:
    split = StageRun("p.run", "v1", "split", 0, 3, "v1", {}, fans_out=True)
    for stage, fans_out in ((split, True), (None, False)):
        attempt = claimed_attempt(stage=stage)
        reply = claim_to_pb(Claimed(ClaimResult(ClaimStatus.CLAIMED, attempt=attempt), 9.0, 3.0))
        assert (reply.fans_out, list(reply.results)) == (fans_out, [])
        assert reply.lease_duration.ToTimedelta() == timedelta(seconds=9)
        assert _near(reply.lease_expire_time, 9.0)
    held = claim_to_pb(Claimed(ClaimResult(ClaimStatus.HELD), 30.0, 5.0))
    assert held.status == Claim.STATUS_STALE and not held.HasField("retry_after")


def test_stage_fields_of_any_shape_are_strings_and_a_mapping_by_name() -> None:
    odd: Any = SimpleNamespace(stage=SimpleNamespace(name=None, version=2, inputs=[1]))
    assert _stage_fields(odd) == ("", "", None)
    keyed: Any = SimpleNamespace(stage=SimpleNamespace(name="n", version="v", inputs={1: {}}))
    assert _stage_fields(keyed) == ("n", "v", {"1": {}})
    bare: Any = SimpleNamespace(stage=SimpleNamespace())
    assert _stage_fields(bare) == ("", "", None)
    stageless: Any = SimpleNamespace()
    assert _stage_fields(stageless) == ("", "", None)


def test_a_child_request_is_read_field_by_field() -> None:
    payload = struct_pb2.Struct()
    payload.update({"page": 1})
    request = workers_pb2.SubmitChildJobRequest(
        key="page-1",
        type="reports.render",
        payload=payload,
        max_attempts=2,
        timeout=duration_pb2.Duration(seconds=90, nanos=500_000_000),
        correlation_id="order-17",
        schedule_time=timestamp_pb2.Timestamp(seconds=1_800_000_000, nanos=250_000),
        schedule_delay=duration_pb2.Duration(seconds=30),
    )
    assert child_request(request) == ChildRequest(
        key="page-1",
        type="reports.render",
        payload={"page": 1},
        max_attempts=2,
        timeout_seconds=90.5,
        correlation_id="order-17",
        schedule_time=datetime(2027, 1, 15, 8, 0, 0, 250, tzinfo=UTC),
        schedule_delay_seconds=30.0,
    )
    # Unset: the queue's and the parent's.
    assert child_request(workers_pb2.SubmitChildJobRequest(key="k", type="t")) == ChildRequest(
        key="k", type="t", payload={}
    )
    for name, value in (
        ("timeout", duration_pb2.Duration(seconds=1, nanos=-1)),
        ("schedule_delay", duration_pb2.Duration(seconds=1, nanos=-1)),
        ("schedule_time", timestamp_pb2.Timestamp(seconds=1, nanos=-1)),
    ):
        bad = workers_pb2.SubmitChildJobRequest(key="k", type="t")
        getattr(bad, name).CopyFrom(value)
        with pytest.raises(InvalidArgument) as refused:
            child_request(bad)
        assert refused.value.field == name


# -- the RPCs ---------------------------------------------------------------------


async def _call(servicer: WorkerServiceServicer, rpc: str, request: Any) -> Any:
    return await getattr(WorkerServiceServicer, rpc).__wrapped__(servicer, request)


def _servicer() -> tuple[WorkerServiceServicer, ClaimsFake, WorkersFake, Any]:
    attempt = claimed_attempt()
    store, workers = ClaimsFake(ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)), WorkersFake()
    service = worker_service_on(store, HeldAttemptsFake(attempt), workers)
    ref = workers_pb2.AttemptRef(
        job=f"jobs/{attempt.job_id}", attempt=1, lease_token=str(attempt.lease_token)
    )
    return WorkerServiceServicer(service), store, workers, ref


async def test_a_message_is_named_by_its_fields_or_its_body() -> None:
    servicer, store, _workers, _ref = _servicer()
    envelope = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "reports.render")
    by_fields = workers_pb2.ClaimJobRequest(
        event_id=str(envelope.event_id),
        job_id=str(envelope.job_id),
        tenant_id=str(envelope.tenant_id),
        type=envelope.job_type,
    )
    assert (await _call(servicer, "ClaimJob", by_fields)).status == Claim.STATUS_CLAIMED
    assert store.claimed == [envelope]
    store.hand_back_answer = (HandBack.PARKED, "NO_WORKER")
    body = workers_pb2.HandBackJobRequest(message_body=envelope.encode())
    reply = await _call(servicer, "HandBackJob", body)
    assert (reply.status, reply.waiting_reason) == (
        workers_pb2.HandBackJobResponse.STATUS_PARKED,
        "NO_WORKER",
    )
    assert [handed[0] for handed in store.handed_back] == [envelope]


async def test_each_call_on_an_attempt_needs_its_ref_and_passes_its_reports() -> None:
    servicer, store, _workers, ref = _servicer()
    with pytest.raises(InvalidArgument) as refused:
        await _call(servicer, "Heartbeat", workers_pb2.HeartbeatRequest())
    assert (refused.value.field, refused.value.message) == (
        "attempt",
        "attempt is required: the AttemptRef ClaimJob returned",
    )
    beat = await _call(servicer, "Heartbeat", workers_pb2.HeartbeatRequest(attempt=ref))
    assert beat.cancel_requested is False and _near(beat.lease_expire_time, 30.0)
    with pytest.raises(InvalidArgument, match="reports needs at least one report"):
        await _call(servicer, "ReportProgress", workers_pb2.ReportProgressRequest(attempt=ref))
    data = struct_pb2.Struct()
    data.update({"k": "v"})
    report = workers_pb2.Progress(progress=0.5, message="half", data=data)
    progress = workers_pb2.ReportProgressRequest(attempt=ref, reports=[report])
    assert (await _call(servicer, "ReportProgress", progress)).cancel_requested is False
    assert store.calls[-1] == (
        "write_progress",
        {"updates": [ProgressUpdate(0.5, "half", {"k": "v"})]},
    )
    # Reports are optional with an outcome.
    await _call(servicer, "CompleteJob", workers_pb2.CompleteJobRequest(attempt=ref))
    assert store.calls[-1] == ("succeed", {"result": {}, "pending": [], "result_blob": None})


async def test_a_failure_answers_the_retry_it_scheduled() -> None:
    servicer, store, _workers, ref = _servicer()
    retry = workers_pb2.FailJobRequest(
        attempt=ref, code="SLOW", retryable=True, retry_delay=duration_pb2.Duration(seconds=2)
    )
    reply = await _call(servicer, "FailJob", retry)
    assert reply.retry_scheduled is True
    assert reply.retry_delay.ToTimedelta() == timedelta(seconds=2)
    assert store.calls[-1][1]["delay"] == 2.0
    servicer, store, _workers, ref = _servicer()
    permanent = workers_pb2.FailJobRequest(attempt=ref, code="BAD", message="no")
    reply = await _call(servicer, "FailJob", permanent)
    assert reply.retry_scheduled is False and not reply.HasField("retry_delay")
    assert store.calls[-1][0] == "fail"


async def test_a_worker_registers_renews_and_stops_by_its_name() -> None:
    servicer, _store, workers, _ref = _servicer()
    request = workers_pb2.RegisterWorkerRequest(
        types=["a.b"], queues=["jobplane.default"], concurrency=1, host="h", pid=7, version="v9"
    )
    reply = await _call(servicer, "RegisterWorker", request)
    ((call, worker_id),) = workers.calls
    assert call == "register"
    (fields,) = workers.registered
    assert fields == {
        "host": "h",
        "pid": 7,
        "types": ["a.b"],
        "queues": ["jobplane.default"],
        "concurrency": 1,
        "version": "v9",
        "ttl": 16.0,
    }
    assert reply.name == worker_name(worker_id)
    assert reply.ttl.ToTimedelta() == timedelta(seconds=16)
    assert reply.renew_interval.ToTimedelta() == timedelta(seconds=5)
    await _call(servicer, "RenewWorker", workers_pb2.RenewWorkerRequest(name=reply.name))
    await _call(servicer, "StopWorker", workers_pb2.StopWorkerRequest(name=reply.name))
    assert workers.calls[1:] == [("renew", worker_id), ("stop", worker_id)]
    assert workers.renewed == [(worker_id, 16.0)]


@pytest.fixture
def far_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The server's local zone nine hours from UTC."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("far_from_utc")
async def test_lease_expire_times_are_utc_whatever_the_servers_zone() -> None:
    attempt = claimed_attempt()
    reply = claim_to_pb(Claimed(ClaimResult(ClaimStatus.CLAIMED, attempt=attempt), 30.0, 5.0))
    assert _near(reply.lease_expire_time, 30.0)
    servicer, _store, _workers, ref = _servicer()
    beat = await _call(servicer, "Heartbeat", workers_pb2.HeartbeatRequest(attempt=ref))
    assert _near(beat.lease_expire_time, 30.0)
