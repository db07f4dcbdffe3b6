"""What fan-out refuses on the real database (ADR-0047): a restart at the
fan-out stage, a retry of one child while its job waits for the children,
and request_ids in the system's own spaces."""

from __future__ import annotations

import pytest

from jobplane.client import FailedPrecondition, InvalidArgument, JobState
from tests.integration.test_fan_out import (  # noqa: F401
    _children,
    _claim,
    _end,
    _split,
    _store,
    fans,
    fbare,
)
from tests.support.stack import Stack

pytestmark = pytest.mark.integration


async def test_a_restart_from_the_fan_out_stage_is_refused_and_changes_nothing(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 2)
    a, b = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, a.id), False, i=0)
    await _end(store, await _claim(fbare, store, b.id), True, i=1)
    failed = await client.get(job.name)
    assert failed.state is JobState.FAILED
    with pytest.raises(InvalidArgument) as refused:
        await client.retry(job.name, from_stage="embed")
    assert refused.value.field == "from_stage"
    assert "stage before it" in str(refused.value) and "without from_stage" in str(refused.value)
    after = await client.get(job.name)
    assert after.state is JobState.FAILED and after.stage == failed.stage
    assert after.update_time == failed.update_time and after.last_seq == failed.last_seq
    # The stage before it spawns the children anew; a plain retry reruns the failed one.
    restarted = await client.retry(job.name, from_stage="split")
    assert restarted.state is JobState.QUEUED and restarted.stage == "split"
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.name == "split"


async def test_a_retry_of_a_child_while_its_job_waits_is_refused_and_changes_nothing(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.tolerant", 2)
    a, b = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, a.id), False, i=0)
    failed = await client.get(a.name)
    with pytest.raises(FailedPrecondition) as refused:
        await client.retry(a.name)
    assert refused.value.reason == "PARENT_WAITING"
    assert refused.value.metadata == {"parent": job.name}
    assert "retry the parent" in str(refused.value)
    after = await client.get(a.name)
    assert after.state is JobState.FAILED and after.last_seq == failed.last_seq
    # The join sees every child ended; then the child is the operator's again.
    await _end(store, await _claim(fbare, store, b.id), True, i=1)
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    assert [r.state for r in attempt.stage.results] == [JobState.FAILED, JobState.SUCCEEDED]
    again = await client.retry(a.name)
    assert again.state is JobState.QUEUED
