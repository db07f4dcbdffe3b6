"""Batch submission without a server: the limiter counts a batch's jobs, the SDK
splits and renumbers, the CLI's job lines parse or name their line."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.client.batch import JobSpec, batches, shifted
from jobplane.client.joblines import BadLine, parse_job_lines
from jobplane.errors import InvalidArgument, TenantLimitExceeded, at_item
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.v1 import jobs_pb2

TENANT = uuid.UUID(int=1)


def test_a_batch_spends_a_token_a_job_all_or_none() -> None:
    now = [0.0]
    limiter = TenantLimiter(
        TenantLimits(submits_per_second=10, submit_burst=100), clock=lambda: now[0]
    )
    limiter.take_submit(TENANT, 60)
    with pytest.raises(TenantLimitExceeded) as info:
        limiter.take_submit(TENANT, 50)
    # Nothing was spent by the refusal: 40 are left, 10 more come in a second.
    assert info.value.retry_delay == pytest.approx(1.0)
    limiter.take_submit(TENANT, 40)
    with pytest.raises(TenantLimitExceeded) as info:
        limiter.take_submit(TENANT, 100, taken=1)
    assert info.value.retry_delay is None and "burst of 100" in info.value.message
    now[0] = 100.0
    limiter.take_submit(TENANT, 99, taken=1)


@given(st.lists(st.integers(0, 3000), max_size=60), st.integers(1, 7), st.integers(1, 20_000))
def test_batches_keep_order_and_bounds(sizes: list[int], size: int, max_bytes: int) -> None:
    requests = [jobs_pb2.SubmitJobRequest(type="t", request_id="r" * n) for n in sizes]
    split = list(batches(requests, size=size, max_bytes=max_bytes))
    assert [r for b in split for r in b] == requests
    for b in split:
        assert 1 <= len(b) <= size
        # Over the bytes only when a request is alone.
        assert len(b) == 1 or sum(r.ByteSize() + 6 for r in b) <= max_bytes


@given(st.integers(0, 999), st.integers(0, 5000), st.sampled_from(["payload", "", "labels[k]"]))
def test_a_refusal_is_renumbered_to_the_callers_index(index: int, offset: int, field: str) -> None:
    error = at_item(InvalidArgument("bad", field=field or None), index)
    moved = shifted(error, offset)
    assert type(moved) is InvalidArgument and moved.reason == error.reason
    want = f"requests[{index + offset}]"
    assert moved.field == (f"{want}.{field}" if field else want)
    assert moved.metadata["index"] == str(index + offset)
    assert moved.message == f"{want}: bad"


def test_job_lines_parse_and_name_the_bad_line() -> None:
    lines = [
        '{"type": "a.b", "payload": {"x": 1}, "request_id": "r", "timeout": 2.5}\n',
        "\n",
        '{"type": "a.c", "labels": {"k": "v"}, "max_attempts": 3, "correlation_id": "c"}\n',
    ]
    assert parse_job_lines(lines) == [
        (1, JobSpec("a.b", {"x": 1}, request_id="r", attempt_timeout=2.5)),
        (3, JobSpec("a.c", labels={"k": "v"}, max_attempts=3, correlation_id="c")),
    ]
    for bad in (
        "[1]",
        "{",
        '{"payload": {}}',
        '{"type": "a", "x": 1}',
        '{"type": "a", "labels": {"k": 1}}',
        '{"type": "a", "max_attempts": true}',
        '{"type": "a", "payload": []}',
    ):
        with pytest.raises(BadLine) as info:
            parse_job_lines([lines[0], bad])
        assert info.value.line == 2 and str(info.value).startswith("line 2: ")
    with pytest.raises(TypeError):
        JobSpec.of({"type": "a", "colour": "red"})
