"""WorkerService's requests and answers, without a server: what is checked, what is said."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest

from jobplane.attempt_end import ADVANCED, CANCELLED, COMPLETED, FAILED, RETRY, completed
from jobplane.blobs.reader import BlobInfo
from jobplane.config import ConfigError, Settings
from jobplane.envelope import Envelope
from jobplane.errors import AttemptLeaseLost, CancelNotRequested, InvalidArgument, WorkerNotFound
from jobplane.names import job_name
from jobplane.server import worker_protocol as protocol_module
from jobplane.server.worker_protocol import (
    REGISTRATION_TTL,
    Claimed,
    Failed,
    Fence,
    Registration,
    WorkerService,
    parse_worker_name,
    worker_name,
)
from jobplane.server.worker_servicer import _stage_fields, claim_to_pb
from jobplane.store.attempts import (
    ClaimResult,
    ClaimStatus,
    StageRun,
)
from jobplane.store.rows import dumps
from jobplane.topology import load_topology, parse_topology
from jobplane.types import BlobRef
from jobplane.v1 import workers_pb2
from jobplane.workers.handlers import PermanentError
from jobplane.workers.outcome import MAX_ERROR_MESSAGE, MAX_RETRY_DELAY, check_result
from tests.support.logs import module_lines
from tests.support.worker_service import (
    PENDING,
    AttemptStoreFake,
    HeldAttemptsFake,
    RenewalsFake,
    claimed_attempt,
    worker_service_on,
)

Claim = workers_pb2.ClaimJobResponse


def _field(call: Any) -> str | None:
    with pytest.raises(InvalidArgument) as refused:
        call()
    return refused.value.field


def test_a_fence_names_the_part_that_is_wrong() -> None:
    job, token = f"jobs/{uuid.uuid4()}", str(uuid.uuid4())
    assert Fence.parse(job, 1, token).attempt == 1
    assert _field(lambda: Fence.parse("nope", 1, token)) == "attempt.job"
    assert _field(lambda: Fence.parse(job, 0, token)) == "attempt.attempt"
    assert _field(lambda: Fence.parse(job, 1, "not-a-uuid")) == "attempt.lease_token"


def test_a_claim_names_its_message_by_body_or_by_all_four_fields() -> None:
    envelope = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "reports.render")
    none = {"event_id": "", "job_id": "", "tenant_id": "", "job_type": ""}
    assert WorkerService.envelope(envelope.encode(), **none) == envelope
    fields = {
        "event_id": str(envelope.event_id),
        "job_id": str(envelope.job_id),
        "tenant_id": str(envelope.tenant_id),
        "job_type": envelope.job_type,
    }
    assert WorkerService.envelope(b"", **fields) == envelope
    assert _field(lambda: WorkerService.envelope(b"", **none)) == "event_id"
    assert _field(lambda: WorkerService.envelope(b"", **{**fields, "tenant_id": ""})) == (
        "tenant_id"
    )
    assert _field(lambda: WorkerService.envelope(b"", **{**fields, "job_id": "x"})) == "job_id"
    assert _field(lambda: WorkerService.envelope(b"", **{**fields, "job_type": "A B"})) == "type"
    assert _field(lambda: WorkerService.envelope(envelope.encode(), **fields)) == "event_id"
    assert _field(lambda: WorkerService.envelope(b"not json", **none)) == "message_body"


def test_progress_reports_are_checked_one_by_one() -> None:
    ok = WorkerService.reports([(1.5, "m", {}), (-1.0, "", {"k": [1]})])
    assert [u.progress for u in ok] == [1.0, 0.0]
    assert _field(lambda: WorkerService.reports([], required=True)) == "reports"
    assert _field(lambda: WorkerService.reports([(0.0, "", {})] * 101)) == "reports"
    assert _field(lambda: WorkerService.reports([(0.1, "", {}), (float("nan"), "", {})])) == (
        "reports[1].progress"
    )
    assert _field(lambda: WorkerService.reports([(0.1, "x" * 4097, {})])) == "reports[0].message"
    assert _field(lambda: WorkerService.reports([(0.1, "a\x00", {})])) == "reports[0].message"
    assert _field(lambda: WorkerService.reports([(0.1, "", {"n": float("inf")})])) == (
        "reports[0].data"
    )
    assert _field(lambda: WorkerService.reports([(0.1, "", {"b": "x" * 70_000})])) == (
        "reports[0].data"
    )


def test_a_claimed_attempt_is_answered_whole() -> None:
    attempt = claimed_attempt()
    reply = claim_to_pb(Claimed(ClaimResult(ClaimStatus.CLAIMED, attempt=attempt), 30.0, 5.0))
    assert reply.status == Claim.STATUS_CLAIMED
    assert reply.attempt.job == f"jobs/{attempt.job_id}"
    assert reply.attempt.lease_token == str(attempt.lease_token)
    assert (reply.max_attempts, reply.attempts_left) == (3, 2)
    assert reply.timeout.seconds == 60 and reply.lease_duration.seconds == 30
    assert reply.payload.fields["a"].number_value == 1
    assert (reply.stage, reply.stage_version, reply.HasField("inputs")) == ("", "", False)
    assert not reply.HasField("retry_after")


def test_other_answers_say_only_what_to_do() -> None:
    waiting = claim_to_pb(Claimed(ClaimResult(ClaimStatus.IN_FLIGHT), 30.0, 5.0))
    assert waiting.status == Claim.STATUS_IN_FLIGHT and waiting.retry_after.seconds == 5
    assert not waiting.HasField("attempt")
    elsewhere = Claimed(ClaimResult(ClaimStatus.NOT_FOUND), 30.0, 5.0, other_deployment=True)
    assert claim_to_pb(elsewhere).status == Claim.STATUS_OTHER_DEPLOYMENT
    for status, answer in (
        (ClaimStatus.FINISHED, Claim.STATUS_FINISHED),
        (ClaimStatus.STALE, Claim.STATUS_STALE),
        (ClaimStatus.NOT_FOUND, Claim.STATUS_NOT_FOUND),
        (ClaimStatus.EXHAUSTED, Claim.STATUS_EXHAUSTED),
    ):
        assert claim_to_pb(Claimed(ClaimResult(status), 30.0, 5.0)).status == answer


def test_stage_fields_come_from_the_attempt_when_it_has_them() -> None:
    assert _stage_fields(claimed_attempt()) == ("", "", None)

    @dataclasses.dataclass(frozen=True)
    class StageRun:
        name: str = "embed"
        version: str = "v2"
        inputs: dict[str, dict[str, Any]] = dataclasses.field(
            default_factory=lambda: {"split": {"chunks": 3}}
        )

    @dataclasses.dataclass(frozen=True)
    class StagedAttempt:
        stage: StageRun | None = dataclasses.field(default_factory=StageRun)

    staged: Any = StagedAttempt()
    assert _stage_fields(staged) == ("embed", "v2", {"split": {"chunks": 3}})
    plain: Any = StagedAttempt(stage=None)
    assert _stage_fields(plain) == ("", "", None)


def test_the_worker_lease_is_a_setting_within_bounds() -> None:
    assert Settings.from_env({}).worker_lease_seconds == 30.0
    assert Settings.from_env({"JOBPLANE_WORKER_LEASE_SECONDS": "12.5"}).worker_lease_seconds == 12.5
    for bad in ("0", "nan", "inf", "3601", "soon"):
        with pytest.raises(ConfigError, match="JOBPLANE_WORKER_LEASE_SECONDS"):
            Settings.from_env({"JOBPLANE_WORKER_LEASE_SECONDS": bad})


def test_a_registration_is_checked_field_by_field() -> None:
    topology = load_topology()
    queue = topology.queues[0].name
    service: Any = WorkerService(None, None, topology, workers=None)  # type: ignore[arg-type]
    good = Registration(["a.b"], [queue], 2, host="h", pid=7, version="v")
    assert service.registration(good) == good
    for changes, field_name in (
        ({"types": []}, "types"),
        ({"types": ["a.b", "B"]}, "types[1]"),
        ({"types": ["a.b"] * 1001}, "types"),
        ({"queues": []}, "queues"),
        ({"queues": [queue, "nope"]}, "queues[1]"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": 10_001}, "concurrency"),
        ({"host": "h" * 256}, "host"),
        ({"version": "a\tb"}, "version"),
        ({"pid": -1}, "pid"),
    ):
        bad = dataclasses.replace(good, **changes)
        assert _field(lambda bad=bad: service.registration(bad)) == field_name, changes


def test_worker_names() -> None:
    worker_id = uuid.uuid4()
    assert parse_worker_name(worker_name(worker_id)) == worker_id
    for bad in ("", str(worker_id), f"jobs/{worker_id}", f"workers/{worker_id}x", "workers/"):
        assert _field(lambda bad=bad: parse_worker_name(bad)) == "name"


async def test_a_renewal_extends_the_registration_and_unparks_what_it_runs() -> None:
    store, worker_id = AttemptStoreFake(), uuid.uuid4()
    workers = RenewalsFake((["reports.render"], ["jobplane.default"]))
    await worker_service_on(store, HeldAttemptsFake(), workers).renew(worker_id)
    assert workers.renewed == [(worker_id, REGISTRATION_TTL)]
    assert store.unparked == [(["reports.render"], ["jobplane.default"])]


async def test_renewing_a_worker_that_is_gone_names_it() -> None:
    store, worker_id = AttemptStoreFake(), uuid.uuid4()
    with pytest.raises(WorkerNotFound) as refused:
        await worker_service_on(store, HeldAttemptsFake(), RenewalsFake(None)).renew(worker_id)
    assert refused.value.message == f"{worker_name(worker_id)} is not registered, or stopped"
    assert store.unparked == []


async def test_a_lease_lost_at_the_write_is_lease_lost_and_the_attempt_forgotten() -> None:
    attempt, store = claimed_attempt(), AttemptStoreFake()
    held = HeldAttemptsFake(attempt)
    service = worker_service_on(store, held)
    fence = Fence(attempt.job_id, attempt.attempt, attempt.lease_token)
    assert await service.heartbeat(fence) is False
    assert await service.heartbeat(fence) is False
    assert held.reads == 1  # kept by its fence after the first read
    store.lost = "heartbeat"
    with pytest.raises(AttemptLeaseLost) as lost:
        await service.heartbeat(fence)
    assert lost.value.message == (
        f"{job_name(attempt.job_id)} attempt 1 does not hold the job with this lease token "
        "(the lease ran out and another attempt took it, or the job moved on); "
        "nothing was written"
    )
    # Forgotten: the next call reads the attempt again, finds it gone, and says so alike.
    held.attempts.clear()
    with pytest.raises(AttemptLeaseLost) as gone:
        await service.heartbeat(fence)
    assert held.reads == 2
    assert gone.value.message == lost.value.message


class _Metrics:
    def __init__(self) -> None:
        self.ended: list[tuple[str, str, str]] = []

    def attempt_ended(self, job_type: str, queue: str, outcome: str) -> None:
        self.ended.append((job_type, queue, outcome))


@pytest.fixture
def log_lines(monkeypatch: pytest.MonkeyPatch) -> Any:
    with module_lines(monkeypatch, protocol_module, "jobplane.server") as lines:
        yield lines


def _outcome_setup(
    **changes: Any,
) -> tuple[WorkerService, AttemptStoreFake, HeldAttemptsFake, _Metrics, Fence]:
    attempt, store, metrics = claimed_attempt(**changes), AttemptStoreFake(), _Metrics()
    held = HeldAttemptsFake(attempt)
    service = worker_service_on(store, held)
    service.metrics = metrics  # type: ignore[assignment]
    return (
        service,
        store,
        held,
        metrics,
        Fence(attempt.job_id, attempt.attempt, attempt.lease_token),
    )


async def _forgotten(service: WorkerService, held: HeldAttemptsFake, fence: Fence) -> bool:
    """Whether the outcome let go of the attempt: the next call reads it again."""
    reads = held.reads
    held.attempts.clear()
    with pytest.raises(AttemptLeaseLost):
        await service.heartbeat(fence)
    return held.reads == reads + 1


def _events(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {line["event"]: line for line in lines}


async def test_a_retryable_failure_with_attempts_left_schedules_the_queues_backoff(
    log_lines: list[dict[str, Any]],
) -> None:
    service, store, held, metrics, fence = _outcome_setup(attempt=2)
    failed = await service.fail(fence, "", "boom", retryable=True, delay=None, pending=PENDING)
    assert failed.retry_scheduled is True and failed.delay is not None
    # Attempt 2 of the queue's backoff: base·2, at least half of it.
    queue = load_topology().queue("jobplane.default")
    assert queue.retry_base_delay <= failed.delay <= 2 * queue.retry_base_delay
    assert store.calls == [
        (
            "schedule_retry",
            {"code": "HANDLER_ERROR", "message": "boom", "delay": failed.delay, "pending": PENDING},
        )
    ]
    assert metrics.ended == [("reports.render", "jobplane.default", RETRY)]
    line = _events(log_lines)["job.retry_scheduled"]
    assert (line["attempt"], line["code"], line["delay"], line["error"]) == (
        2,
        "HANDLER_ERROR",
        failed.delay,
        "boom",
    )
    assert await _forgotten(service, held, fence)


async def test_a_retry_delay_given_by_the_worker_is_the_delay() -> None:
    service, store, _held, _metrics, fence = _outcome_setup()
    failed = await service.fail(fence, "SLOW", "later", retryable=True, delay=2.5, pending=[])
    assert (failed.retry_scheduled, failed.delay) == (True, 2.5)
    assert store.calls[0][1]["delay"] == 2.5


@pytest.mark.parametrize(
    ("retryable", "attempt", "details"),
    [(False, 1, {}), (True, 3, {"attempts_exhausted": True})],
    ids=["permanent", "last-attempt"],
)
async def test_a_failure_without_a_retry_fails_the_job(
    retryable: bool, attempt: int, details: dict[str, Any], log_lines: list[dict[str, Any]]
) -> None:
    service, store, held, metrics, fence = _outcome_setup(attempt=attempt)
    failed = await service.fail(
        fence, "BAD_INPUT", "no", retryable=retryable, delay=None, pending=PENDING
    )
    assert (failed.retry_scheduled, failed.delay) == (False, None)
    assert store.calls == [
        (
            "fail",
            {
                "code": "BAD_INPUT",
                "message": "no",
                "retryable": False,
                "pending": PENDING,
                "details": details,
            },
        )
    ]
    assert metrics.ended == [("reports.render", "jobplane.default", FAILED)]
    line = _events(log_lines)["job.failed"]
    assert (line["attempt"], line["code"], line["error"]) == (attempt, "BAD_INPUT", "no")
    assert await _forgotten(service, held, fence)


async def test_a_success_stores_the_result_after_the_pending_reports(
    log_lines: list[dict[str, Any]],
) -> None:
    service, store, held, metrics, fence = _outcome_setup()
    await service.complete(fence, {"pages": 3}, PENDING)
    assert store.calls == [
        ("succeed", {"result": {"pages": 3}, "pending": PENDING, "result_blob": None})
    ]
    assert metrics.ended == [("reports.render", "jobplane.default", completed(None))]
    assert _events(log_lines)["job.completed"]["attempt"] == 1
    assert await _forgotten(service, held, fence)


async def test_cancelled_ends_the_attempt_once_cancel_was_requested(
    log_lines: list[dict[str, Any]],
) -> None:
    service, store, held, metrics, fence = _outcome_setup()
    with pytest.raises(CancelNotRequested):
        await service.cancelled(fence, PENDING)
    assert [name for name, _ in store.calls] == ["heartbeat"]
    store.cancel = True
    await service.cancelled(fence, PENDING)
    assert store.calls[-1] == ("cancelled", {"pending": PENDING})
    assert metrics.ended == [("reports.render", "jobplane.default", CANCELLED)]
    assert _events(log_lines)["job.cancelled"]["attempt"] == 1
    assert await _forgotten(service, held, fence)


OUTCOMES: dict[str, tuple[str, Any]] = {
    "heartbeat": ("heartbeat", lambda service, fence: service.heartbeat(fence)),
    "complete": ("succeed", lambda service, fence: service.complete(fence, {}, [])),
    "fail": (
        "fail",
        lambda service, fence: service.fail(
            fence, "X", "", retryable=False, delay=None, pending=[]
        ),
    ),
    "retry": (
        "schedule_retry",
        lambda service, fence: service.fail(fence, "X", "", retryable=True, delay=None, pending=[]),
    ),
    "cancelled": ("cancelled", lambda service, fence: service.cancelled(fence, [])),
    "cancelled-check": ("heartbeat", lambda service, fence: service.cancelled(fence, [])),
}


@pytest.mark.parametrize("call", list(OUTCOMES))
async def test_every_call_whose_write_loses_the_lease_is_lease_lost(call: str) -> None:
    service, store, held, _metrics, fence = _outcome_setup()
    store.lost, make = OUTCOMES[call]
    store.cancel = True
    with pytest.raises(AttemptLeaseLost, match="attempt 1 does not hold"):
        await make(service, fence)
    assert await _forgotten(service, held, fence)


async def test_a_result_that_cannot_be_stored_is_refused_with_its_code() -> None:
    service, store, _held, _metrics, fence = _outcome_setup()
    bad = {"ratio": float("nan")}
    problem = check_result(bad, max_bytes=256 * 1024)
    assert isinstance(problem, PermanentError)
    with pytest.raises(InvalidArgument) as refused:
        await service.complete(fence, bad, [])
    assert (refused.value.field, refused.value.message) == ("result", str(problem))
    assert refused.value.metadata == {"code": problem.code}
    assert store.calls == []


class _Blobs:
    """BlobStore.put_bytes, recorded."""

    def __init__(self) -> None:
        self.put: list[tuple[uuid.UUID, bytes, str | None]] = []

    async def put_bytes(
        self, tenant_id: uuid.UUID, data: bytes, *, content_type: str | None = None
    ) -> BlobInfo:
        self.put.append((tenant_id, data, content_type))
        return BlobInfo(f"blobs/{len(data)}", f"sha-{len(data)}", len(data))


async def test_a_result_over_the_inline_limit_goes_to_a_blob_unless_a_stage_returns_it() -> None:
    small, large = {"a": 1}, {"text": "x" * 50}
    for stage, result, offloaded in (
        (None, small, False),
        (None, large, True),
        # A stage's result feeds the next stage: kept inline.
        (StageRun("p", "v1", "split", 0, 2, "v1", {}), large, False),
    ):
        attempt, store, blobs, metrics = (
            claimed_attempt(stage=stage),
            AttemptStoreFake(),
            _Blobs(),
            _Metrics(),
        )
        # A result of exactly the inline limit stays inline.
        service = worker_service_on(
            store, HeldAttemptsFake(attempt), blobs=blobs, inline_bytes=len(dumps(small))
        )
        service.metrics = metrics  # type: ignore[assignment]
        await service.complete(Fence(attempt.job_id, 1, attempt.lease_token), result, [])
        body = dumps(result).encode()
        if offloaded:
            assert blobs.put == [(attempt.tenant_id, body, "application/json")]
            ref = BlobRef(f"blobs/{len(body)}", f"sha-{len(body)}", len(body))
            assert store.calls == [("succeed", {"result": {}, "pending": [], "result_blob": ref})]
        else:
            assert blobs.put == []
            assert store.calls == [
                ("succeed", {"result": result, "pending": [], "result_blob": None})
            ]
        # The first of two stages advances the job; a plain job completes.
        assert metrics.ended == [
            ("reports.render", "jobplane.default", COMPLETED if stage is None else ADVANCED)
        ]


async def test_progress_is_written_for_the_attempt_and_answers_the_cancel_flag() -> None:
    service, store, _held, _metrics, fence = _outcome_setup()
    assert await service.progress(fence, PENDING) is False
    store.cancel = True
    assert await service.progress(fence, PENDING) is True
    assert store.calls == [("write_progress", {"updates": PENDING})] * 2
    assert (
        store.fences
        == [claimed_attempt(job_id=fence.job_id, lease_token=fence.lease_token).fence()] * 2
    )
    store.lost = "write_progress"
    with pytest.raises(AttemptLeaseLost, match="attempt 1 does not hold"):
        await service.progress(fence, PENDING)


async def test_a_failure_report_is_checked_before_anything_is_written() -> None:
    service, store, held, _metrics, fence = _outcome_setup()

    async def refused(code: str = "X", message: str = "", **options: Any) -> InvalidArgument:
        options = {"retryable": True, "delay": None, "pending": [], **options}
        with pytest.raises(InvalidArgument) as error:
            await service.fail(fence, code, message, **options)
        return error.value

    bad_code = await refused("lower")
    assert (bad_code.field, bad_code.message) == (
        "code",
        "code 'lower' must be UPPER_SNAKE: A-Z first, then A-Z, 0-9, '_'; at most 64 characters",
    )
    assert (await refused("A" * 65)).field == "code"
    assert (await refused(message="x" * (MAX_ERROR_MESSAGE + 1))).field == "message"
    permanent = await refused(retryable=False, delay=1.0)
    assert (permanent.field, permanent.message) == (
        "retry_delay",
        "retry_delay is for a retryable failure only",
    )
    for delay in (-0.001, MAX_RETRY_DELAY + 0.001):
        out_of_range = await refused(delay=delay)
        assert (out_of_range.field, out_of_range.message) == (
            "retry_delay",
            f"retry_delay must be 0 .. {MAX_RETRY_DELAY:g} seconds",
        )
    assert store.calls == [] and held.reads == 0
    # Both ends of the range are delays (the held attempt is read again for each).
    for delay in (0.0, MAX_RETRY_DELAY):
        failed = await service.fail(fence, "X", "", retryable=True, delay=delay, pending=[])
        assert failed == Failed(True, delay)


async def test_a_retry_waits_the_backoff_of_the_attempts_own_queue() -> None:
    topology = parse_topology(
        {"queues": [{"name": "slow", "retry_base_delay": 40.0, "retry_max_delay": 600.0}]}
    )
    attempt, store = claimed_attempt(queue="slow"), AttemptStoreFake()
    fakes: Any = (store, HeldAttemptsFake(attempt))
    service = WorkerService(fakes[0], fakes[1], topology, workers=fakes[1])
    fence = Fence(attempt.job_id, attempt.attempt, attempt.lease_token)
    failed = await service.fail(fence, "X", "", retryable=True, delay=None, pending=[])
    assert failed.delay is not None and 20.0 <= failed.delay <= 40.0
