"""WorkerService's claims and hand-backs, without a server: what a claim answers,
counts and logs, and how a payload by reference is handed out or ends the attempt."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from jobplane.envelope import Envelope
from jobplane.errors import BlobNotFound, BlobStoreUnavailable
from jobplane.names import job_name
from jobplane.server import worker_protocol as protocol_module
from jobplane.server.worker_protocol import Claimed, Fence, WorkerService
from jobplane.store.attempts import Attempt, ClaimResult, ClaimStatus, HandBack
from jobplane.types import BlobRef, JobState
from tests.support.logs import Lines, module_lines
from tests.support.worker_service import (
    ClaimsFake,
    HeldAttemptsFake,
    Recorded,
    claimed_attempt,
    worker_service_on,
)

CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _envelope(attempt: Attempt, deployment: str | None = None) -> Envelope:
    return Envelope(uuid.uuid4(), attempt.job_id, attempt.tenant_id, attempt.type, "c", deployment)


def _setup(
    result: ClaimResult, *, lease_seconds: float = 30.0, **options: Any
) -> tuple[WorkerService, ClaimsFake, HeldAttemptsFake, Recorded]:
    store = ClaimsFake(result, lease_seconds)
    held = HeldAttemptsFake(*([result.attempt] if result.attempt else []))
    service = worker_service_on(store, held, **options)
    metrics = Recorded()
    service.metrics = metrics  # type: ignore[assignment]
    return service, store, held, metrics


@pytest.mark.parametrize(("lease", "poll"), [(30.0, 5.0), (9.0, 3.0)], ids=["capped", "third"])
async def test_a_claim_starts_the_attempt_counts_it_and_keeps_it(lease: float, poll: float) -> None:
    attempt = claimed_attempt(attempt=2, create_time=CREATED)
    result = ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)
    service, store, held, metrics = _setup(result, lease_seconds=lease)
    envelope = _envelope(attempt)
    # A redelivery polls at a third of the lease, at most every 5 s.
    assert await service.claim(envelope) == Claimed(result, lease, poll, other_deployment=False)
    assert store.claimed == [envelope]
    assert metrics.calls == [
        ("attempt_started", ("reports.render", "jobplane.default", 2, CREATED))
    ]
    # Kept by its fence: the next call of the attempt reads nothing back.
    assert await service.heartbeat(Fence(attempt.job_id, 2, attempt.lease_token)) is False
    assert held.reads == 0


async def test_a_held_claim_counts_the_limit_that_holds_it() -> None:
    attempt = claimed_attempt()
    service, _store, _held, metrics = _setup(ClaimResult(ClaimStatus.HELD, limit="rate/pdf"))
    claimed = await service.claim(_envelope(attempt))
    assert claimed.result.status is ClaimStatus.HELD
    assert metrics.calls == [("throttled", ("rate/pdf", "reports.render"))]
    for status in (ClaimStatus.STALE, ClaimStatus.IN_FLIGHT, ClaimStatus.FINISHED):
        service, _store, _held, metrics = _setup(ClaimResult(status))
        await service.claim(_envelope(attempt))
        assert metrics.calls == [], status


@pytest.mark.parametrize(
    ("status", "ours", "theirs", "other"),
    [
        (ClaimStatus.NOT_FOUND, "dep-a", "dep-b", True),
        (ClaimStatus.NOT_FOUND, "dep-a", "dep-a", False),
        (ClaimStatus.NOT_FOUND, None, "dep-b", False),
        (ClaimStatus.NOT_FOUND, "dep-a", None, False),
        (ClaimStatus.STALE, "dep-a", "dep-b", False),
    ],
    ids=["elsewhere", "ours", "unknown-here", "unnamed", "found"],
)
async def test_a_missing_job_is_another_deployments_only_when_both_are_named_and_differ(
    status: ClaimStatus, ours: str | None, theirs: str | None, other: bool
) -> None:
    attempt = claimed_attempt()
    service, store, _held, _metrics = _setup(ClaimResult(status))
    if ours is not None:
        service.deployment = ours
    claimed = await service.claim(_envelope(attempt, theirs))
    assert claimed.other_deployment is other
    # A hand-back says the same of the message.
    hand_back = HandBack.NOT_FOUND if status is ClaimStatus.NOT_FOUND else HandBack.NOT_QUEUED
    store.hand_back_answer = (hand_back, "NO_WORKER")
    envelope = _envelope(attempt, theirs)
    assert await service.hand_back(envelope) == (hand_back, "NO_WORKER", other)
    # Handed back after 0.5 s · 2^handbacks, at most 10 s (the Python worker's).
    assert store.handed_back == [(envelope, 0.5, 10.0)]


# -- payloads by reference ----------------------------------------------------------


class _Blobs:
    """BlobStore.read_bytes: the bytes, or the error, the test set; reads recorded."""

    def __init__(self, answer: bytes | Exception) -> None:
        self.answer = answer
        self.reads: list[tuple[uuid.UUID, str]] = []

    async def read_bytes(self, tenant_id: uuid.UUID, name: str) -> bytes:
        self.reads.append((tenant_id, name))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _by_reference(size: int = 12, **changes: Any) -> Attempt:
    ref = BlobRef("blobs/p1", "sha256:d", size)
    return claimed_attempt(payload={}, payload_blob=ref, create_time=CREATED, **changes)


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Any:
    with module_lines(monkeypatch, protocol_module, "jobplane.server") as captured:
        yield captured


@pytest.mark.parametrize("size", [12, 100], ids=["small", "at-the-limit"])
async def test_a_payload_by_reference_is_handed_out_inline(size: int, lines: Lines) -> None:
    attempt = _by_reference(size)
    blobs = _Blobs(b'{"pages": [1, 2]}')
    result = ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)
    service, store, held, metrics = _setup(result, blobs=blobs, max_result_bytes=100)
    claimed = await service.claim(_envelope(attempt))
    read = dataclasses.replace(attempt, payload={"pages": [1, 2]})
    assert claimed.result == ClaimResult(ClaimStatus.CLAIMED, attempt=read)
    assert blobs.reads == [(attempt.tenant_id, "blobs/p1")]
    assert [name for name, _ in metrics.calls] == ["attempt_started"]
    assert [line["event"] for line in lines] == ["job.received", "job.started"]
    assert await service.heartbeat(Fence(attempt.job_id, 1, attempt.lease_token)) is False
    assert held.reads == 0 and store.calls == [("heartbeat", {})]


UNAVAILABLE = BlobStoreUnavailable("the object store did not answer")


@pytest.mark.parametrize(
    ("answer", "size", "code", "message"),
    [
        (None, 12, "BLOBS_DISABLED", "this server has no object store"),
        (
            b"{}",
            101,
            "PAYLOAD_TOO_LARGE",
            "the payload went by reference (101 bytes); WorkerService hands out payloads "
            "of at most 100 bytes",
        ),
        (BlobNotFound("no blob blobs/p1"), 12, "BLOB_NOT_FOUND", "no blob blobs/p1"),
        (
            b"[1]",
            12,
            "PAYLOAD_INVALID",
            "the payload blob blobs/p1 holds a JSON list, not an object",
        ),
        (UNAVAILABLE, 12, "BLOB_STORE_UNAVAILABLE", "the object store did not answer"),
    ],
    ids=["no-store", "too-large", "gone", "not-an-object", "store-away-last-attempt"],
)
async def test_a_payload_that_cannot_be_handed_out_fails_the_job_and_says_why(
    answer: bytes | Exception | None, size: int, code: str, message: str, lines: Lines
) -> None:
    blobs = None if answer is None else _Blobs(answer)
    # The last attempt: even an outage of the store ends the job.
    attempt = _by_reference(size, attempt=3)
    result = ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)
    service, store, held, metrics = _setup(result, blobs=blobs, max_result_bytes=100)
    claimed = await service.claim(_envelope(attempt))
    assert claimed.result == ClaimResult(ClaimStatus.FINISHED, state=JobState.FAILED)
    details = {"attempts_exhausted": True} if code == "BLOB_STORE_UNAVAILABLE" else {}
    assert store.calls == [
        ("fail", {"code": code, "message": message, "retryable": False, "details": details})
    ]
    assert store.fences == [attempt.fence()]
    (line,) = lines
    assert (line["event"], line["log_level"]) == ("worker_service.payload_unavailable", "warning")
    assert (line["job"], line["code"]) == (job_name(attempt.job_id), code)
    # Nothing started: nothing counted, and the message is to be acked.
    assert metrics.calls == [] and held.reads == 0


async def test_an_outage_of_the_object_store_retries_the_attempt_with_the_queues_backoff(
    lines: Lines,
) -> None:
    attempt = _by_reference(attempt=2)
    result = ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)
    service, store, _held, metrics = _setup(result, blobs=_Blobs(UNAVAILABLE))
    claimed = await service.claim(_envelope(attempt))
    assert claimed.result == ClaimResult(ClaimStatus.STALE)
    ((name, args),) = store.calls
    # Attempt 2 of jobplane.default's backoff (base 1 s): 1 to 2 s.
    assert name == "schedule_retry" and 1.0 <= args["delay"] <= 2.0
    assert args == {
        "code": "BLOB_STORE_UNAVAILABLE",
        "message": "the object store did not answer",
        "delay": args["delay"],
    }
    assert [line["code"] for line in lines] == ["BLOB_STORE_UNAVAILABLE"]
    assert metrics.calls == []
