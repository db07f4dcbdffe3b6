"""Every refusal of a WorkerService request, with the field it names and what it says.

A worker in another language reads these (docs/workers.md): the field is its
BadRequest violation, the message its description. Each range is checked at
both ends: the last value allowed passes, the first past it is refused.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from jobplane.envelope import Envelope
from jobplane.errors import InvalidArgument
from jobplane.server.worker_protocol import (
    MAX_CONCURRENCY,
    MAX_QUEUES,
    MAX_REPORTS,
    MAX_TYPES,
    MAX_WORKER_LABEL,
    Fence,
    Registration,
    WorkerService,
    parse_worker_name,
)
from jobplane.server.worker_requests import check_reports
from jobplane.store.attempts import ProgressUpdate
from jobplane.store.rows import dumps
from jobplane.topology import load_topology
from jobplane.workers.context import MAX_PROGRESS_DATA_BYTES, MAX_PROGRESS_MESSAGE

QUEUE = "jobplane.default"


def _refusal(call: Callable[..., Any]) -> tuple[str | None, str]:
    with pytest.raises(InvalidArgument) as refused:
        call()
    return refused.value.field, refused.value.message


def _envelope(body: bytes = b"", **fields: str) -> Envelope:
    named = {"event_id": "", "job_id": "", "tenant_id": "", "job_type": "", **fields}
    return WorkerService.envelope(body, **named)


def test_a_claim_names_each_missing_or_doubled_envelope_field() -> None:
    envelope = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "reports.render")
    fields = {
        "event_id": str(envelope.event_id),
        "job_id": str(envelope.job_id),
        "tenant_id": str(envelope.tenant_id),
        "job_type": envelope.job_type,
    }
    for argument, name in (
        ("event_id", "event_id"),
        ("job_id", "job_id"),
        ("tenant_id", "tenant_id"),
        ("job_type", "type"),
    ):
        missing = {**fields, argument: ""}
        assert _refusal(lambda missing=missing: _envelope(**missing)) == (
            name,
            f"{name} is required (or message_body instead of the fields)",
        )
        doubled = {argument: fields[argument]}
        assert _refusal(lambda doubled=doubled: _envelope(envelope.encode(), **doubled)) == (
            name,
            f"give message_body or the envelope's fields, not both ({name} is set)",
        )
    for argument in ("event_id", "job_id", "tenant_id"):
        bad = {**fields, argument: "not-a-uuid"}
        assert _refusal(lambda bad=bad: _envelope(**bad)) == (
            argument,
            f"{argument} 'not-a-uuid' is not a UUID",
        )


def test_a_message_body_that_is_no_envelope_says_why_within_160_characters() -> None:
    assert _refusal(lambda: _envelope(b"[1]")) == (
        "message_body",
        "message_body is not a dispatch envelope: 'not a JSON object'",
    )
    # The decode error repeats the caller's value: its repr is cut past 160 characters.
    fits = b'{"v": "%s"}' % (b"a" * 133)  # the reason's repr: 160 characters
    field, message = _refusal(lambda: _envelope(fits))
    assert field == "message_body"
    assert message.endswith("a'\"") and "…" not in message
    cut = b'{"v": "%s"}' % (b"a" * 134)  # 161 characters
    assert _refusal(lambda: _envelope(cut))[1].endswith("…(159 characters)")


# The service's check, and the request module's function it hands the reports to.
@pytest.mark.parametrize(
    "check", [WorkerService.reports, check_reports], ids=["service", "worker_requests"]
)
def test_progress_reports_are_refused_by_the_first_bad_one_with_what_is_wrong(
    check: Callable[..., list[ProgressUpdate]],
) -> None:
    def refused(reports: list[tuple[float, str, dict[str, Any]]], **options: Any) -> Any:
        return _refusal(lambda: check(reports, **options))

    ok: tuple[float, str, dict[str, Any]] = (0.5, "", {})
    assert refused([], required=True) == ("reports", "reports needs at least one report")
    assert refused([], required=True, field="pending") == (
        "pending",
        "pending needs at least one report",
    )
    assert refused([ok] * (MAX_REPORTS + 1)) == ("reports", "reports holds more than 100 reports")
    assert refused([ok, (float("inf"), "", {})]) == (
        "reports[1].progress",
        "reports[1].progress must be a finite number",
    )
    assert refused([(0.5, "m" * (MAX_PROGRESS_MESSAGE + 1), {})]) == (
        "reports[0].message",
        f"reports[0].message is longer than {MAX_PROGRESS_MESSAGE} characters",
    )
    assert refused([ok, ok, (0.5, "a\x00b", {})]) == (
        "reports[2].message",
        "reports[2].message has a NUL character",
    )
    assert refused([(0.5, "", {"n": float("nan")})]) == (
        "reports[0].data",
        "reports[0].data cannot be stored: '$.n: nan is not a finite number'",
    )
    # The problem names the path to the bad value: past 160 characters its repr is cut.
    deep = {"a" * 60: {"b" * 60: {"c" * 18: "x\x00"}}}  # a problem of 159 characters
    field, message = refused([(0.5, "", deep)])
    assert field == "reports[0].data" and message.endswith("…(159 characters)")
    assert refused([(0.5, "", {"a" * 60: {"b" * 60: {"c" * 17: "x\x00"}}})])[1].endswith(
        ": a NUL character'"
    )
    assert refused([(0.5, "", _data_of(MAX_PROGRESS_DATA_BYTES + 1))]) == (
        "reports[0].data",
        f"reports[0].data cannot be stored: 'larger than {MAX_PROGRESS_DATA_BYTES} bytes'",
    )


def _data_of(size: int) -> dict[str, Any]:
    """Progress data of exactly ``size`` bytes as stored."""
    data = {"b": "x" * (size - len(dumps({"b": ""})))}
    assert len(dumps(data).encode()) == size
    return data


def test_reports_at_every_limit_are_taken_whole_in_order() -> None:
    largest = _data_of(MAX_PROGRESS_DATA_BYTES)
    reports = [
        (0.25, "m" * MAX_PROGRESS_MESSAGE, largest),
        (2.0, "over", {"k": [1]}),
        (-3.0, "under", {}),
    ]
    assert WorkerService.reports(reports) == [
        ProgressUpdate(0.25, "m" * MAX_PROGRESS_MESSAGE, largest),
        ProgressUpdate(1.0, "over", {"k": [1]}),
        ProgressUpdate(0.0, "under", {}),
    ]
    assert len(WorkerService.reports([(0.0, "", {})] * MAX_REPORTS)) == MAX_REPORTS
    # No reports are none to store, unless the call needs one.
    assert WorkerService.reports([]) == []


def test_a_registration_is_refused_field_by_field_with_its_range() -> None:
    service: Any = WorkerService(None, None, load_topology(), workers=None)  # type: ignore[arg-type]
    good = Registration(["a.b"], [QUEUE], 1, host="h", pid=0, version="v")
    label = f"must be at most {MAX_WORKER_LABEL} characters, no control characters"
    for changes, refusal in (
        ({"types": []}, ("types", "types must hold 1..1000 job types")),
        ({"types": ["a.b"] * (MAX_TYPES + 1)}, ("types", "types must hold 1..1000 job types")),
        ({"queues": []}, ("queues", "queues must hold 1..100 queues")),
        ({"queues": [QUEUE] * (MAX_QUEUES + 1)}, ("queues", "queues must hold 1..100 queues")),
        (
            {"queues": [QUEUE, "nope"]},
            ("queues[1]", "queues[1] 'nope' is no queue of the topology"),
        ),
        ({"concurrency": 0}, ("concurrency", "concurrency must be 1..10000")),
        ({"concurrency": MAX_CONCURRENCY + 1}, ("concurrency", "concurrency must be 1..10000")),
        ({"host": "h" * (MAX_WORKER_LABEL + 1)}, ("host", f"host {label}")),
        ({"host": "a\x1fb"}, ("host", f"host {label}")),
        ({"version": "v" * (MAX_WORKER_LABEL + 1)}, ("version", f"version {label}")),
        ({"version": "a\nb"}, ("version", f"version {label}")),
        ({"pid": -1}, ("pid", "pid must not be negative")),
    ):
        bad = dataclasses.replace(good, **changes)
        assert _refusal(lambda bad=bad: service.registration(bad)) == refusal, changes
    field, message = _refusal(lambda: service.registration(dataclasses.replace(good, types=["A"])))
    assert field == "types[0]" and message.startswith("types[0] 'A' must be lowercase")
    # The last value of every range is taken.
    for changes in (
        {"types": [f"t.n{i}" for i in range(MAX_TYPES)]},
        {"queues": [QUEUE] * MAX_QUEUES},
        {"concurrency": MAX_CONCURRENCY},
        {"host": "h" * MAX_WORKER_LABEL, "version": " " * MAX_WORKER_LABEL},
    ):
        fine = dataclasses.replace(good, **changes)
        assert service.registration(fine) == fine, changes
    assert service.registration(good) == good


def test_a_fence_is_parsed_whole_or_refused_naming_its_part() -> None:
    job_id, token = uuid.uuid4(), uuid.uuid4()
    job = f"jobs/{job_id}"
    assert Fence.parse(job, 2, str(token)) == Fence(job_id, 2, token)
    assert _refusal(lambda: Fence.parse(job, 0, str(token))) == (
        "attempt.attempt",
        "attempt.attempt must be at least 1, got 0",
    )
    assert _refusal(lambda: Fence.parse(job, 1, "nope")) == (
        "attempt.lease_token",
        "attempt.lease_token 'nope' is not a UUID",
    )
    assert _refusal(lambda: Fence.parse("nope", 1, str(token))) == (
        "attempt.job",
        "attempt.job must look like jobs/{id}, got 'nope'",
    )
    # A fence under another name says so in every part.
    assert _refusal(lambda: Fence.parse(job, -1, str(token), field="parent"))[0] == (
        "parent.attempt"
    )
    assert _refusal(lambda: Fence.parse(job, 1, "", field="parent"))[0] == "parent.lease_token"
    assert _refusal(lambda: Fence.parse("", 1, str(token), field="parent"))[0] == "parent.job"


def test_a_worker_name_is_its_id_in_any_case_and_a_bad_one_is_shown() -> None:
    worker_id = uuid.uuid4()
    assert parse_worker_name(f"workers/{str(worker_id).upper()}") == worker_id
    assert _refusal(lambda: parse_worker_name("jobs/x")) == (
        "name",
        "name must look like workers/{id}, got 'jobs/x'",
    )
    assert _refusal(lambda: parse_worker_name(f"workers/{worker_id.hex}", field="worker")) == (
        "worker",
        f"worker must look like workers/{{id}}, got 'workers/{worker_id.hex}'",
    )
