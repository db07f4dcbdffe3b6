"""What the events of an attempt's outcome tell a watcher."""

from __future__ import annotations

import uuid

import pytest

from jobplane.client import JobState
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.types import EventType
from tests.support.stack import Stack


@pytest.mark.parametrize("retryable", [False, True])
async def test_a_failure_event_carries_the_error(bare: Stack, retryable: bool) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store = AttemptStore(bare.db)
    attempt = (await store.claim(await bare.envelope(job.id))).attempt
    assert attempt is not None
    await store.fail(attempt, "BROKEN_INPUT", "the input was broken", retryable=retryable)

    events = [e async for e in client.watch(job.name)]
    assert events[-1].type is EventType.FAILED
    assert events[-1].message == "the input was broken"
    assert events[-1].data == {
        "error": {"code": "BROKEN_INPUT", "message": "the input was broken", "retryable": retryable}
    }
    assert (await client.get(job.name)).state is JobState.FAILED


async def test_a_retry_event_says_why_when_and_which_attempt_comes_next(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store = AttemptStore(bare.db)
    attempt = (await store.claim(await bare.envelope(job.id))).attempt
    assert attempt is not None
    await store.schedule_retry(attempt, "FLAKY", "try again", delay=42.1234)

    # The job waits for its retry, so its stream has not ended: read the table.
    event = await bare.scalar(
        "SELECT jsonb_build_object('type', type, 'message', message, 'data', data) "
        "FROM job_events WHERE job_id = :id ORDER BY seq DESC LIMIT 1",
        id=uuid.UUID(job.id),
    )
    assert event == {
        "type": "retry_scheduled",
        "message": "try again",
        "data": {
            "error": {"code": "FLAKY", "message": "try again", "retryable": True},
            "delay_seconds": 42.123,
            "next_attempt": 2,
        },
    }
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED
    assert waiting.error is not None and waiting.error.code == "FLAKY"


async def test_a_cancelled_attempt_ends_with_a_cancelled_event(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store = AttemptStore(bare.db)
    attempt = (await store.claim(await bare.envelope(job.id))).attempt
    assert attempt is not None
    await store.cancelled(attempt)

    events = [e async for e in client.watch(job.name)]
    assert [(e.type, e.message) for e in events[-1:]] == [(EventType.CANCELLED, "cancelled")]
    assert (await client.get(job.name)).state is JobState.CANCELLED


async def test_only_a_refunded_retry_leaves_the_attempt_uncounted(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {}, max_attempts=1)
    store = AttemptStore(bare.db)
    first = (await store.claim(await bare.envelope(job.id))).attempt
    assert first is not None
    # Interrupted (a worker shutting down): the one allowed attempt is given back.
    await store.schedule_retry(first, "WORKER_SHUTDOWN", "shut down", delay=0, refund=True)
    second = await store.claim(await bare.envelope(job.id))
    assert second.status is ClaimStatus.CLAIMED
    assert second.attempt is not None and second.attempt.attempts_left == 0

    # A plain retry counts: with no attempt left, the next dispatch ends the job.
    await store.schedule_retry(second.attempt, "FLAKY", "try again", delay=0)
    third = await store.claim(await bare.envelope(job.id))
    assert third.status is ClaimStatus.EXHAUSTED
    done = await client.get(job.name)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "ATTEMPTS_EXHAUSTED"
