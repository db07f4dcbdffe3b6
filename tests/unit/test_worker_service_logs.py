"""WorkerService's log lines name the attempt's ids (docs/operations.md, "Bound fields").

A claim binds them for the rest of the call; an outcome's line carries them
itself. Caller-chosen ids (``request_id``, ``correlation_id``) appear as
fingerprints only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from jobplane import __version__
from jobplane.envelope import Envelope
from jobplane.logs import fingerprint
from jobplane.names import job_name
from jobplane.server import worker_protocol as protocol_module
from jobplane.server.worker_protocol import (
    REGISTRATION_TTL,
    Fence,
    Registration,
    WorkerService,
    worker_name,
)
from jobplane.store.attempts import Attempt, ClaimResult, ClaimStatus
from tests.support.worker_service import (
    AttemptStoreFake,
    HeldAttemptsFake,
    WorkersFake,
    claimed_attempt,
    worker_service_on,
)

Lines = list[MutableMapping[str, Any]]


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    # A logger not yet used: one used by an earlier test in this process is
    # cached (cache_logger_on_first_use) and would write past capture_logs.
    monkeypatch.setattr(protocol_module, "log", structlog.get_logger("jobplane.server"))
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    structlog.contextvars.clear_contextvars()
    try:
        # What the server's own configuration does first: the call's bindings.
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured:
            yield captured
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.configure(**saved)


def _ids(attempt: Attempt) -> dict[str, str]:
    return {
        "job": job_name(attempt.job_id),
        "tenant_id": str(attempt.tenant_id),
        "correlation_id": fingerprint(attempt.correlation_id),
        "request_id": fingerprint(attempt.request_id),
        "queue": attempt.queue,
    }


def _line(lines: Lines, event: str) -> MutableMapping[str, Any]:
    (line,) = [line for line in lines if line["event"] == event]
    return line


class _Claims(AttemptStoreFake):
    """The claim of one attempt."""

    def __init__(self, attempt: Attempt) -> None:
        super().__init__()
        self.attempt = attempt

    async def claim(self, envelope: Envelope) -> ClaimResult:
        return ClaimResult(ClaimStatus.CLAIMED, attempt=self.attempt)


def _setup(**changes: Any) -> tuple[WorkerService, AttemptStoreFake, Attempt, Fence]:
    attempt = claimed_attempt(correlation_id="order-17", request_id="req-9", **changes)
    store = _Claims(attempt)
    service = worker_service_on(store, HeldAttemptsFake(attempt))
    return service, store, attempt, Fence(attempt.job_id, attempt.attempt, attempt.lease_token)


async def test_a_claim_binds_the_jobs_ids_to_the_calls_lines(lines: Lines) -> None:
    service, _store, attempt, _fence = _setup(queue="reports")
    envelope = Envelope(uuid.uuid4(), attempt.job_id, attempt.tenant_id, attempt.type, "order-17")
    await service.claim(envelope)
    bound = {**_ids(attempt), "routing_key": attempt.type}
    for event in ("job.received", "job.started"):
        line = _line(lines, event)
        assert {k: line.get(k) for k in bound} == bound, event
        assert (line["attempt"], line["type"]) == (1, attempt.type)
        # The caller's ids themselves never reach the line.
        assert "order-17" not in str(line) and "req-9" not in str(line)
    # Bound for the rest of the call: a later line of it names the job too.
    structlog.get_logger("jobplane.server").info("after")
    assert _line(lines, "after")["request_id"] == fingerprint("req-9")


async def test_each_outcome_line_names_the_attempts_ids(lines: Lines) -> None:
    cases: list[tuple[str, Any]] = [
        ("job.completed", lambda s, f: s.complete(f, {}, [])),
        ("job.failed", lambda s, f: s.fail(f, "X", "m", retryable=False, delay=None, pending=[])),
        (
            "job.retry_scheduled",
            lambda s, f: s.fail(f, "X", "m", retryable=True, delay=None, pending=[]),
        ),
    ]
    for event, call in cases:
        service, _store, attempt, fence = _setup(queue="reports")
        await call(service, fence)
        line = _line(lines, event)
        assert {k: line.get(k) for k in _ids(attempt)} == _ids(attempt), event
        lines.clear()
    service, store, attempt, fence = _setup(queue="reports")
    store.cancel = True
    await service.cancelled(fence, [])
    line = _line(lines, "job.cancelled")
    assert {k: line.get(k) for k in _ids(attempt)} == _ids(attempt)


class _Parked(AttemptStoreFake):
    """unpark hands out ``pages`` of counts, then 0."""

    def __init__(self, pages: list[int]) -> None:
        super().__init__()
        self.pages = pages

    async def unpark(self, types: Any, queues: Any) -> int:
        await super().unpark(types, queues)
        return self.pages.pop(0) if self.pages else 0


async def test_a_registration_is_recorded_said_and_unparks_page_by_page(lines: Lines) -> None:
    store, registry = _Parked([500, 500, 3]), WorkersFake()
    service = worker_service_on(store, HeldAttemptsFake(), registry)
    worker_id = await service.register(
        Registration(types=["a.b"], queues=["jobplane.default"], concurrency=2, host="h", pid=7)
    )
    assert registry.calls == [("register", worker_id)]
    assert registry.registered == [
        {
            "host": "h",
            "pid": 7,
            "types": ["a.b"],
            "queues": ["jobplane.default"],
            "concurrency": 2,
            "version": f"workerservice/{__version__}",  # it gave none
            "ttl": REGISTRATION_TTL,
        }
    ]
    line = _line(lines, "worker_service.registered")
    assert (line["worker"], line["types"], line["queues"]) == (
        worker_name(worker_id),
        ["a.b"],
        ["jobplane.default"],
    )
    # A full page of 500 may leave more: asked again until a page is short.
    assert store.unparked == [(["a.b"], ["jobplane.default"])] * 3
    unparked = [line["jobs"] for line in lines if line["event"] == "worker_service.jobs.unparked"]
    assert unparked == [500, 500, 3]
    await service.register(Registration(["a.b"], ["jobplane.default"], 1, version="go/1.2"))
    assert registry.registered[-1]["version"] == "go/1.2"
