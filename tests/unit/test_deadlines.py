"""Deadlines' pure parts: the checks, the transition's row of the table, the SDK and CLI."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.client._cli_run import UsageError
from jobplane.client._cli_schedule import parse_deadline
from jobplane.client._schedule import set_deadline
from jobplane.errors import InvalidArgument
from jobplane.scheduling import deadline_of
from jobplane.store.machine import MACHINE, RULES, Phase, Transition
from jobplane.store.machine.hooks import CancelSignal, Dispatches
from jobplane.store.machine.stages import STAGE_STEPS, StageState, Which
from jobplane.types import EventType, JobState
from jobplane.v1 import jobs_pb2

NOW = datetime(2026, 12, 6, 12, tzinfo=UTC)
DAY = 86400.0


def test_a_time_or_a_duration_gives_the_deadline() -> None:
    assert deadline_of(None, None, now=NOW, horizon_seconds=DAY) is None
    assert deadline_of(None, 60, now=NOW, horizon_seconds=DAY) == NOW + timedelta(minutes=1)
    at = NOW + timedelta(hours=1)
    assert deadline_of(at, None, now=NOW, horizon_seconds=DAY) == at
    # After a schedule_time it may be: the job has from then to its deadline.
    start = NOW + timedelta(minutes=30)
    assert deadline_of(at, None, now=NOW, horizon_seconds=DAY, schedule_time=start) == at


@pytest.mark.parametrize(
    ("at", "after", "start", "field"),
    [
        (NOW + timedelta(hours=1), 60.0, None, "deadline_after"),  # both
        (NOW, None, None, "deadline"),  # not ahead
        (NOW - timedelta(seconds=1), None, None, "deadline"),  # past
        (NOW + timedelta(days=1, seconds=1), None, None, "deadline"),  # beyond the horizon
        (None, 0.0, None, "deadline_after"),
        (None, -1.0, None, "deadline_after"),
        (None, DAY + 1, None, "deadline_after"),
        (None, float("nan"), None, "deadline_after"),
        # Not after the job's schedule_time: it could never run.
        (NOW + timedelta(hours=1), None, NOW + timedelta(hours=1), "deadline"),
        (NOW + timedelta(hours=1), None, NOW + timedelta(hours=2), "deadline"),
        (None, 60.0, NOW + timedelta(minutes=5), "deadline_after"),
    ],
)
def test_bad_deadlines_name_their_field(
    at: datetime | None, after: float | None, start: datetime | None, field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        deadline_of(at, after, now=NOW, horizon_seconds=DAY, schedule_time=start)
    assert info.value.field == field


@given(
    after=st.floats(allow_nan=True, allow_infinity=True),
    start=st.none() | st.floats(min_value=-DAY, max_value=2 * DAY),
)
def test_a_deadline_taken_is_ahead_within_the_horizon_and_after_the_start(
    after: float, start: float | None
) -> None:
    schedule = None if start is None else NOW + timedelta(seconds=start)
    try:
        deadline = deadline_of(None, after, now=NOW, horizon_seconds=DAY, schedule_time=schedule)
    except InvalidArgument as refused:
        field = refused.field
    else:
        field = ""
    if field:
        assert field == "deadline_after"
        return
    assert deadline is not None
    assert NOW < deadline <= NOW + timedelta(seconds=DAY)
    assert schedule is None or deadline > schedule


def test_the_deadline_transition_ends_any_job_not_ended_failed() -> None:
    rule = RULES[Transition.DEADLINE]
    assert rule.sources == {Phase.QUEUED, Phase.RUNNING, Phase.RUNNING_EXPIRED}
    assert rule.target is JobState.FAILED
    assert rule.event is EventType.FAILED
    assert rule.lifecycle is not None and rule.lifecycle.value == "job.failed"
    assert rule.guard == "deadline <= now()"
    assert not rule.dispatch
    # The attempt's fence is cleared, and nothing waits or is due.
    for cleared in ("lease_token = NULL", "dispatch_id = NULL", "next_attempt_time = NULL"):
        assert cleared in rule.sets
    assert "error_code = 'DEADLINE_EXCEEDED'" in rule.sets
    assert "error_retryable = false" in rule.sets
    # A pipeline's stage fails with it, as a FAIL of it does.
    assert STAGE_STEPS[Transition.DEADLINE] == STAGE_STEPS[Transition.FAIL]
    assert STAGE_STEPS[Transition.DEADLINE].becomes[Which.CURRENT].state is StageState.FAILED


def test_a_claim_starts_no_job_past_its_deadline() -> None:
    claim = RULES[Transition.CLAIM]
    for guard in (claim.guard, claim.many_guard):
        assert "(deadline IS NULL OR deadline > now())" in guard


def test_the_deadline_signals_a_running_attempt_and_drops_a_pending_dispatch() -> None:
    (signal,) = CancelSignal().writes(Transition.DEADLINE)
    assert "from_state = 'running'" in signal.notify and "jobplane_cancel" in signal.notify
    (drop,) = Dispatches().writes(Transition.DEADLINE)
    assert drop.sql.strip().startswith("DELETE FROM outbox")
    statement = str(MACHINE.statement(Transition.DEADLINE))
    assert "SET state = 'failed'" in statement
    assert "deadline <= now()" in statement


def test_retry_keeps_a_deadline_ahead_and_drops_one_passed() -> None:
    for transition in (Transition.RETRY, Transition.RESTART):
        assert (
            "deadline = CASE WHEN jobs.deadline > now() THEN jobs.deadline END"
            in RULES[transition].sets
        )


def test_the_sdk_sets_one_field() -> None:
    request = jobs_pb2.SubmitJobRequest()
    set_deadline(request, NOW)
    assert request.HasField("deadline") and not request.HasField("deadline_after")
    request = jobs_pb2.SubmitJobRequest()
    set_deadline(request, timedelta(minutes=5))
    assert request.deadline_after.seconds == 300 and not request.HasField("deadline")
    request = jobs_pb2.SubmitJobRequest()
    set_deadline(request, 1.5)
    assert request.deadline_after.ToTimedelta() == timedelta(seconds=1.5)
    with pytest.raises(ValueError, match="timezone-aware"):
        set_deadline(jobs_pb2.SubmitJobRequest(), datetime(2027, 1, 1))


def test_the_cli_reads_a_time_or_a_duration() -> None:
    assert parse_deadline("2027-01-31T09:00:00Z") == datetime(2027, 1, 31, 9, tzinfo=UTC)
    assert parse_deadline("90") == timedelta(seconds=90)
    assert parse_deadline("1h30m") == timedelta(hours=1, minutes=30)
    for bad in ("2027-01-31T09:00:00", "-5m", "soon"):
        with pytest.raises(UsageError, match="--deadline"):
            parse_deadline(bad)
