"""What a caller is told for a failure: the classification of :func:`error_for`,
its log lines, and the rich status :func:`to_grpc_status` builds."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from sqlalchemy.exc import DBAPIError

from jobplane.errors import InternalError, InvalidArgument, JobNotFound, TenantLimitExceeded
from jobplane.server import status as status_module
from jobplane.server.status import DB_UNAVAILABLE, error_for, to_grpc_status
from jobplane.store.down import PoolExhausted
from tests.support.logs import module_lines

Lines = list[MutableMapping[str, Any]]


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, status_module, "jobplane.server") as captured:
        yield captured


def test_our_own_errors_are_answered_as_they_are(lines: Lines) -> None:
    error = JobNotFound("jobs/x not found")
    assert error_for(error, "GetJob") is error
    assert lines == []


def test_a_full_pool_is_unavailable_and_said_so(lines: Lines) -> None:
    full = DBAPIError("SELECT 1", {}, PoolExhausted("all 6 in use"))
    assert error_for(PoolExhausted("all 6 in use"), "SubmitJob") is DB_UNAVAILABLE
    assert error_for(full, "SubmitJob") is DB_UNAVAILABLE
    assert [(line["event"], line["log_level"], line["rpc"]) for line in lines] == [
        ("rpc.database_pool_exhausted", "warning", "SubmitJob")
    ] * 2
    assert lines[0]["error"].endswith("PoolExhausted: all 6 in use")
    assert DB_UNAVAILABLE.code is grpc.StatusCode.UNAVAILABLE


def test_a_lost_connection_is_unavailable_and_said_so(lines: Lines) -> None:
    assert error_for(ConnectionRefusedError(111, "refused"), "GetJob") is DB_UNAVAILABLE
    (line,) = lines
    assert (line["event"], line["log_level"], line["rpc"]) == (
        "rpc.database_unavailable",
        "warning",
        "GetJob",
    )


def test_anything_else_is_internal_with_its_traceback_logged(lines: Lines) -> None:
    bug = KeyError("k")
    answer = error_for(bug, "ListJobs")
    assert isinstance(answer, InternalError)
    assert answer.code is grpc.StatusCode.INTERNAL
    assert "k" not in answer.message  # nothing of the failure reaches the caller
    (line,) = lines
    assert (line["event"], line["log_level"], line["rpc"], line["exc_info"]) == (
        "rpc.failed",
        "error",
        "ListJobs",
        bug,
    )


def _details(status: grpc.Status) -> tuple[status_pb2.Status, list[Any]]:
    (key, value), *_ = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    proto = status_pb2.Status.FromString(value)
    found: list[Any] = []
    for detail in proto.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
        ):
            if detail.Is(kind.DESCRIPTOR):
                unpacked = kind()
                detail.Unpack(unpacked)
                found.append(unpacked)
    return proto, found


def test_a_field_error_names_its_field_twice() -> None:
    error = InvalidArgument("payload is too big", field="payload", metadata={"max": "10"})
    status = to_grpc_status(error)
    assert (status.code, status.details) == (grpc.StatusCode.INVALID_ARGUMENT, error.message)
    proto, (info, bad) = _details(status)
    assert proto.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (info.reason, info.domain) == (error.reason, "jobplane.dev")
    assert dict(info.metadata) == {"max": "10", "field": "payload"}
    (violation,) = bad.field_violations
    assert (violation.field, violation.description, violation.reason) == (
        "payload",
        "payload is too big",
        error.reason,
    )


def test_an_error_without_a_field_or_delay_carries_its_info_alone() -> None:
    _proto, found = _details(to_grpc_status(JobNotFound("jobs/x not found")))
    (info,) = found
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert (info.reason, dict(info.metadata)) == ("JOB_NOT_FOUND", {})


@pytest.mark.parametrize(
    ("delay", "nanos"), [(0.25, 250_000_000), (1.5, 1_500_000_000), (0.0, 0), (-1, 0)]
)
def test_a_retry_delay_goes_as_retry_info(delay: float, nanos: int) -> None:
    error = TenantLimitExceeded("slow down", retry_delay=delay)
    _proto, (_info, retry) = _details(to_grpc_status(error))
    assert retry.retry_delay.ToNanoseconds() == nanos
