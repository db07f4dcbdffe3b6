"""What a worker's claim answers, for each state it finds its job in.

The claim and the transitions it falls back on (DEADLINE, EXHAUST, HOLD) are
the state machine's; here the machine and the connection are scripted, and
the tests pin what the store decides from what they answer: the status, the
state, the transitions it asks for and why, and what it frees afterwards.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimResult, ClaimStatus
from jobplane.store.claims import _STAGES, CLAIMED, INSPECT, StageRun
from jobplane.store.machine import Cause, Transition, lifecycle_event_id
from jobplane.store.machine.flow import ENDED_KEYS
from jobplane.types import JobState
from tests.support.store_fakes import FakeDb, ScriptedMachine

ENDED = ("id", "tenant_id", "concurrency_key", "flow_slots")
LEASE_END = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _envelope() -> Envelope:
    return Envelope(
        event_id=uuid.uuid4(), job_id=uuid.uuid4(), tenant_id=uuid.uuid4(), job_type="mail"
    )


def _found(envelope: Envelope, state: JobState, **changes: Any) -> dict[str, Any]:
    """The INSPECT row of the job ``envelope`` dispatches, in ``state``."""
    row = {
        "state": state.value,
        "dispatch_id": envelope.event_id,
        "type": envelope.job_type,
        "lease_expires_at": LEASE_END,
        "lease_expired": False,
        "exhausted": False,
        "tenant_id": envelope.tenant_id,
        "concurrency_key": None,
        "flow_key": None,
        "past_deadline": False,
    }
    return {**row, **changes}


def _store() -> tuple[AttemptStore, FakeDb, ScriptedMachine]:
    db, machine = FakeDb(), ScriptedMachine()
    store = AttemptStore(db, lease_seconds=12.5, machine=machine)  # type: ignore[arg-type]
    return store, db, machine


async def _claim_finding(envelope: Envelope, *found: dict[str, Any] | None, **script: Any) -> Any:
    store, db, machine = _store()
    db.conn.answer(INSPECT, *found)
    for name, rows in script.items():
        machine.answer(Transition[name], *rows)
    result = await store.claim(envelope, worker="w-1")
    return result, db, machine


async def test_a_claim_binds_the_dispatch_and_a_fresh_lease_and_names_its_worker() -> None:
    envelope = _envelope()
    result, db, machine = await _claim_finding(envelope, None)
    assert result == ClaimResult(ClaimStatus.NOT_FOUND)
    (claim,) = machine.of(Transition.CLAIM)
    token = claim.params.pop("lease_token")
    assert isinstance(token, uuid.UUID)
    assert claim.params == {
        "id": envelope.job_id,
        "tenant_id": envelope.tenant_id,
        "dispatch_id": envelope.event_id,
        "type": "mail",
        "lease_seconds": 12.5,
    }
    assert claim.cause == Cause("attempt started", {"worker": "w-1"})
    assert claim.returning == CLAIMED
    assert db.conn.ran(INSPECT) == [{**claim.params, "lease_token": token}]
    # One session, a transaction whenever any transition a claim may end in needs one.
    transitions, _ = machine.sessions[0]
    assert set(transitions) == {
        Transition.CLAIM,
        Transition.EXHAUST,
        Transition.DEADLINE,
        Transition.HOLD,
        Transition.THROTTLE,
    }


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
async def test_a_job_that_ended_is_finished_in_its_state(state: JobState) -> None:
    envelope = _envelope()
    result, _, machine = await _claim_finding(envelope, _found(envelope, state))
    assert result == ClaimResult(ClaimStatus.FINISHED, state=state)
    assert [a.transition for a in machine.applied] == [Transition.CLAIM]


@pytest.mark.parametrize("field", ["dispatch_id", "type"])
async def test_a_message_for_another_dispatch_or_type_is_stale(field: str) -> None:
    envelope = _envelope()
    other = uuid.uuid4() if field == "dispatch_id" else "sms"
    found = _found(envelope, JobState.QUEUED, **{field: other}, past_deadline=True)
    result, _, machine = await _claim_finding(envelope, found)
    assert result == ClaimResult(ClaimStatus.STALE, state=JobState.QUEUED)
    assert [a.transition for a in machine.applied] == [Transition.CLAIM]


async def test_the_dispatch_id_matches_whether_read_as_text_or_uuid() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.RUNNING, dispatch_id=str(envelope.event_id))
    result, _, _ = await _claim_finding(envelope, found)
    assert result == ClaimResult(
        ClaimStatus.IN_FLIGHT, state=JobState.RUNNING, lease_expires_at=LEASE_END
    )


async def test_a_job_past_its_deadline_is_failed_and_its_key_and_limits_freed() -> None:
    envelope = _envelope()
    ended = {
        "id": envelope.job_id,
        "tenant_id": envelope.tenant_id,
        "concurrency_key": "k1",
        "flow_slots": None,
    }
    found = _found(envelope, JobState.RUNNING, past_deadline=True)
    result, db, machine = await _claim_finding(envelope, found, DEADLINE=[[ended]])
    assert result == ClaimResult(ClaimStatus.FINISHED, state=JobState.FAILED)
    (deadline,) = machine.of(Transition.DEADLINE)
    assert deadline.cause == Cause("past its deadline")
    assert deadline.returning == ENDED
    assert deadline.params == machine.of(Transition.CLAIM)[0].params
    (release,) = machine.of(Transition.RELEASE)
    assert release.params == {"tenant_id": envelope.tenant_id, "key": "k1"}
    assert db.opened[-1] == "begin"


async def test_a_deadline_another_writer_settled_first_reads_on() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.RUNNING, past_deadline=True)
    result, _, machine = await _claim_finding(envelope, found)
    assert result == ClaimResult(
        ClaimStatus.IN_FLIGHT, state=JobState.RUNNING, lease_expires_at=LEASE_END
    )
    assert machine.of(Transition.RELEASE) == []


async def test_a_job_out_of_attempts_is_exhausted_once_its_lease_is_gone() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.RUNNING, lease_expired=True, exhausted=True)
    result, _, machine = await _claim_finding(envelope, found, EXHAUST=[[{"id": 1}]])
    assert result == ClaimResult(ClaimStatus.EXHAUSTED, state=JobState.FAILED)
    (exhaust,) = machine.of(Transition.EXHAUST)
    assert exhaust.cause == Cause("no attempts left")
    assert exhaust.returning == ("id",)
    assert exhaust.params == machine.of(Transition.CLAIM)[0].params


async def test_a_live_lease_keeps_an_exhausted_job_in_flight() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.RUNNING, exhausted=True)
    result, _, machine = await _claim_finding(envelope, found)
    assert result.status is ClaimStatus.IN_FLIGHT
    assert machine.of(Transition.EXHAUST) == []


async def test_a_running_job_changed_under_the_claim_is_in_flight_without_a_lease() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.RUNNING, lease_expired=True, exhausted=True)
    result, _, machine = await _claim_finding(envelope, found)
    assert result == ClaimResult(ClaimStatus.IN_FLIGHT, state=JobState.RUNNING)
    assert machine.of(Transition.HOLD) == []


@pytest.mark.parametrize(
    ("flow_key", "limit"),
    [(None, ""), ("limit/emails/t1@rate", "emails"), ("queue/bulk/t1", "queue/bulk")],
)
async def test_a_queued_job_its_key_or_limit_holds_is_held(flow_key: Any, limit: str) -> None:
    envelope = _envelope()
    held = {"id": envelope.job_id, "waiting_code": "THROTTLED", "flow_key": flow_key}
    held |= {"tenant_id": envelope.tenant_id, "concurrency_key": None}
    found = _found(envelope, JobState.QUEUED)
    result, db, machine = await _claim_finding(envelope, found, HOLD=[[held]])
    assert result == ClaimResult(
        ClaimStatus.HELD, state=JobState.QUEUED, waiting_code="THROTTLED", limit=limit
    )
    (hold,) = machine.of(Transition.HOLD)
    assert hold.cause == Cause("held")
    assert hold.returning == ("id", "waiting_code", "flow_key", "tenant_id", "concurrency_key")
    assert hold.params == machine.of(Transition.CLAIM)[0].params
    # Held for a running budget: the budget is released after the hold, for an
    # older job held while the slot was promised to this one (ADR-0059); a
    # start rate's reservation holds no slot.
    released = [{"keys": [flow_key]}] if limit == "queue/bulk" else []
    assert db.conn.ran(ENDED_KEYS) == released


async def test_a_key_freed_between_claim_and_hold_is_claimed_again() -> None:
    envelope = _envelope()
    found = _found(envelope, JobState.QUEUED)
    claimed = {
        "type": "mail",
        "payload": {"to": "a"},
        "attempt": 1,
        "max_attempts": 3,
        "retry_base": 0,
        "correlation_id": "c",
        "request_id": "r",
        "timeout_seconds": 60,
        "queue": "default",
        "lifecycle_seq": 2,
        "stage": None,
        "create_time": LEASE_END,
    }
    result, db, machine = await _claim_finding(envelope, found, CLAIM=[[], [claimed]])
    assert result.status is ClaimStatus.CLAIMED
    attempt = result.attempt
    assert attempt is not None
    assert attempt.job_id == envelope.job_id and attempt.tenant_id == envelope.tenant_id
    assert attempt.lease_token == machine.of(Transition.CLAIM)[1].params["lease_token"]
    assert attempt.started_event_id == lifecycle_event_id(envelope.job_id, 2)
    assert attempt.payload == {"to": "a"} and attempt.create_time == LEASE_END
    assert attempt.stage is None
    assert len(machine.of(Transition.CLAIM)) == 2
    # The claim after the first in a transaction: the key's lock its guard takes
    # is held to the end, through the hold that follows if it is refused.
    assert machine.depths == [(Transition.CLAIM, 0), (Transition.HOLD, 0), (Transition.CLAIM, 1)]
    assert db.conn.depth == 0


async def test_a_claim_its_key_keeps_refusing_gives_up_in_flight_after_three_tries() -> None:
    envelope = _envelope()
    found = [_found(envelope, JobState.QUEUED) for _ in range(4)]
    result, db, machine = await _claim_finding(envelope, *found)
    assert result == ClaimResult(ClaimStatus.IN_FLIGHT, state=JobState.QUEUED)
    assert len(machine.of(Transition.CLAIM)) == 3
    assert len(machine.of(Transition.HOLD)) == 3
    assert len(db.conn.ran(INSPECT)) == 3
    assert [depth for _, depth in machine.depths] == [0, 0, 1, 1, 1, 1]


async def test_a_claim_without_a_worker_names_none() -> None:
    store, _, machine = _store()
    await store.claim(_envelope())
    assert machine.of(Transition.CLAIM)[0].cause == Cause("attempt started", {})


async def test_a_claimed_pipeline_job_runs_its_stage_with_the_results_before_it() -> None:
    store, db, machine = _store()
    envelope = _envelope()
    claimed = {
        "type": "p.second",
        "payload": "{}",
        "attempt": 2,
        "max_attempts": 3,
        "retry_base": 1,
        "correlation_id": "",
        "request_id": "r",
        "timeout_seconds": 60,
        "queue": "default",
        "lifecycle_seq": None,
        "pipeline": "p",
        "pipeline_version": "3",
        "stage": 1,
    }
    stages = [
        {"idx": 0, "name": "first", "version": "a", "result": '{"n": 1}', "fan_out": False},
        {"idx": 1, "name": "second", "version": "b", "result": None, "fan_out": False},
    ]
    db.conn.answer(_STAGES, stages)
    machine.answer(Transition.CLAIM, [claimed])
    result = await store.claim(envelope)
    assert result.attempt is not None
    assert result.attempt.started_event_id is None
    assert result.attempt.stage == StageRun("p", "3", "second", 1, 2, "b", {"first": {"n": 1}})
    assert db.conn.ran(_STAGES) == [{"id": envelope.job_id}]
