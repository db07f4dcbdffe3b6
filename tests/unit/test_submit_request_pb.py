"""A SubmitJobRequest read into plain values: every field to its own, an unset
message field to None (a set one, even all zeros, to its value), and a
malformed Duration or Timestamp refused on its field."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from jobplane.errors import InvalidArgument
from jobplane.server.service import SubmitRequest
from jobplane.server.servicer import submit_request
from jobplane.v1 import jobs_pb2

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def test_every_field_of_a_request_is_read() -> None:
    request = jobs_pb2.SubmitJobRequest(
        type="reports.render",
        request_id="r-1",
        correlation_id="c-1",
        max_attempts=4,
        labels={"team": "a", "tier": "b"},
        timeout=duration_pb2.Duration(seconds=90, nanos=500_000_000),
        payload_blob="blobs/x",
        blob_references=["blobs/a", "blobs/b"],
        schedule_time=timestamp_pb2.Timestamp(seconds=1_800_000_000, nanos=7_000),
        schedule_delay=duration_pb2.Duration(seconds=5),
        concurrency_key="acct",
        concurrency_limit=3,
        concurrency_mode=jobs_pb2.CONCURRENCY_MODE_REJECT,
        deadline=timestamp_pb2.Timestamp(seconds=1_900_000_000),
        deadline_after=duration_pb2.Duration(seconds=60, nanos=250_000_000),
        after=["jobs/a", "jobs/b"],
        after_failure=jobs_pb2.DEPENDENCY_FAILURE_POLICY_RUN_ANYWAY,
    )
    request.payload.update({"n": 1, "s": "x"})
    assert submit_request(request) == SubmitRequest(
        type="reports.render",
        payload={"n": 1, "s": "x"},
        request_id="r-1",
        correlation_id="c-1",
        max_attempts=4,
        labels={"team": "a", "tier": "b"},
        timeout_seconds=90.5,
        payload_blob="blobs/x",
        blob_references=("blobs/a", "blobs/b"),
        schedule_time=datetime(2027, 1, 15, 8, 0, 0, 7, tzinfo=UTC),
        schedule_delay_seconds=5.0,
        concurrency_key="acct",
        concurrency_limit=3,
        concurrency_mode=2,
        deadline=datetime(2030, 3, 17, 17, 46, 40, tzinfo=UTC),
        deadline_after_seconds=60.25,
        after=("jobs/a", "jobs/b"),
        after_failure=3,
    )


def test_unset_fields_are_the_defaults_and_set_zeros_are_values() -> None:
    assert submit_request(jobs_pb2.SubmitJobRequest(type="t")) == SubmitRequest("t", {})
    zeros = jobs_pb2.SubmitJobRequest(
        type="t",
        timeout=duration_pb2.Duration(),
        schedule_time=timestamp_pb2.Timestamp(),
        schedule_delay=duration_pb2.Duration(),
        deadline=timestamp_pb2.Timestamp(),
        deadline_after=duration_pb2.Duration(),
    )
    assert submit_request(zeros) == SubmitRequest(
        "t",
        {},
        timeout_seconds=0.0,
        schedule_time=_EPOCH,
        schedule_delay_seconds=0.0,
        deadline=_EPOCH,
        deadline_after_seconds=0.0,
    )


@pytest.mark.parametrize("field", ["timeout", "schedule_delay", "deadline_after"])
def test_a_malformed_duration_is_refused_on_its_field(field: str) -> None:
    request = jobs_pb2.SubmitJobRequest(type="t")
    getattr(request, field).CopyFrom(duration_pb2.Duration(seconds=1, nanos=-1))
    with pytest.raises(InvalidArgument) as refused:
        submit_request(request)
    assert (refused.value.field, refused.value.message) == (
        field,
        f"{field} is not a valid Duration (seconds=1, nanos=-1)",
    )


@pytest.mark.parametrize("field", ["schedule_time", "deadline"])
def test_a_malformed_timestamp_is_refused_on_its_field(field: str) -> None:
    request = jobs_pb2.SubmitJobRequest(type="t")
    getattr(request, field).CopyFrom(timestamp_pb2.Timestamp(seconds=3, nanos=1_000_000_000))
    with pytest.raises(InvalidArgument) as refused:
        submit_request(request)
    assert (refused.value.field, refused.value.message) == (
        field,
        f"{field} is not a valid Timestamp (seconds=3, nanos=1000000000)",
    )
