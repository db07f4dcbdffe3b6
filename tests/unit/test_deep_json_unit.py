"""The server finds the JSON field nested too deep in a body protobuf cannot decode."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from jobplane.server.decode import MAX_FIELDS_READ, too_deep_json
from jobplane.v1 import jobs_pb2, workers_pb2
from tests.support.deep_json import deep_struct, wire_field

LIMIT = 32


def _progress(struct: bytes) -> bytes:
    return wire_field(3, struct)


@given(
    depth=st.integers(1, 150),
    arrays=st.data(),
    index=st.integers(0, 3),
)
def test_the_field_past_the_limit_is_named_and_one_within_is_not(
    depth: int, arrays: st.DataObject, index: int
) -> None:
    kinds = arrays.draw(st.lists(st.booleans(), min_size=depth - 1, max_size=depth - 1))
    shallow = _progress(deep_struct([False] * 3))
    reports = [shallow] * index + [_progress(deep_struct(kinds))] + [shallow]
    body = b"".join(wire_field(2, report) for report in reports)
    found = too_deep_json(workers_pb2.ReportProgressRequest.DESCRIPTOR, body)
    assert found == (f"reports[{index}].data" if depth > LIMIT else None)


def test_a_batchs_request_is_named_by_its_index() -> None:
    submit = jobs_pb2.SubmitJobRequest(type="a.b").SerializeToString()
    deep = submit + wire_field(2, deep_struct([True] * 60))
    body = wire_field(1, submit) + wire_field(1, deep)
    with pytest.raises(DecodeError):
        jobs_pb2.BatchSubmitJobsRequest.FromString(body)
    assert too_deep_json(jobs_pb2.BatchSubmitJobsRequest.DESCRIPTOR, body) == (
        "requests[1].payload"
    )


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xff\xff",  # a tag that never ends
        wire_field(2, deep_struct([False] * 40))[:-3],  # cut short
        b"\x13\x14",  # a group
        b"\x12\x7f",  # longer than the body
    ],
)
def test_a_body_that_is_not_protobuf_names_nothing(body: bytes) -> None:
    assert too_deep_json(jobs_pb2.SubmitJobRequest.DESCRIPTOR, body) is None


def test_the_search_reads_a_bounded_number_of_messages() -> None:
    """A body full of values just within the limit is not read through at length
    (its refusal stays MALFORMED_REQUEST); one that is not still is."""
    deep = wire_field(2, deep_struct([True] * 60))
    within = wire_field(2, deep_struct([True] * (LIMIT - 1)))
    descriptor = jobs_pb2.SubmitJobRequest.DESCRIPTOR
    assert too_deep_json(descriptor, deep + within * 100) == "payload"
    assert too_deep_json(descriptor, deep + within * 1000) is None


def test_the_search_counts_every_field_it_steps_over() -> None:
    """One-byte fields of no interest spend the search's budget as messages do: a
    body of more of them than the bound is not walked through to its deep value."""
    filler = b"\x78\x00"  # field 15 (unknown to the request), varint 0
    deep = wire_field(2, deep_struct([True] * 60))
    descriptor = jobs_pb2.SubmitJobRequest.DESCRIPTOR
    assert too_deep_json(descriptor, filler * (MAX_FIELDS_READ - 1000) + deep) == "payload"
    assert too_deep_json(descriptor, filler * MAX_FIELDS_READ + deep) is None
