"""How an attempt's end is made ready and written: each outcome's transition,
values and event, the fence it is written under, and what a fenced-out write
or a finished one leads to.

The machine is scripted (tests/support/store_fakes.py): what is pinned here
is what the store asks of it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from jobplane.fanout import FAN_OUT_REFUSED
from jobplane.store.attempts import AttemptStore, LeaseLost, ProgressUpdate, StageRun
from jobplane.store.machine import HEARTBEAT, Cause, Emitted, Transition
from jobplane.types import BlobRef
from tests.support.attempts import an_attempt
from tests.support.store_fakes import FakeDb, ScriptedMachine

ENDED = ("id", "tenant_id", "concurrency_key", "flow_slots")


def _store() -> tuple[AttemptStore, FakeDb, ScriptedMachine]:
    db, machine = FakeDb(), ScriptedMachine()
    return AttemptStore(db, machine=machine), db, machine  # type: ignore[arg-type]


def _stage(index: int, count: int, *, fans_out: bool = False) -> StageRun:
    return StageRun("p", "v1", f"s{index}", index, count, "1", {}, fans_out=fans_out)


def _fence(attempt: Any) -> dict[str, Any]:
    return {"id": attempt.job_id, "attempt": attempt.attempt, "lease_token": attempt.lease_token}


def _emitted() -> tuple[Emitted, ...]:
    return (Emitted(None, b"{}", b"h"),)  # type: ignore[arg-type]


def test_a_plain_success_writes_its_result_and_any_result_blob() -> None:
    store, _, _ = _store()
    attempt = an_attempt(attempt=2)
    emitted = _emitted()
    blob = BlobRef("blobs/abc", "abc", 42)
    outcome = store.succeeded(attempt, {"ok": "é"}, emitted=emitted, result_blob=blob)
    assert outcome.transition is Transition.SUCCEED
    assert outcome.attempt is attempt
    params = {
        **_fence(attempt),
        "result": '{"ok":"é"}',
        "result_blob": "abc",
        "result_blob_size": 42,
    }
    cause = Cause("succeeded", emitted=emitted)
    assert outcome.params == params
    assert outcome.cause == cause
    assert outcome.binds == {"prepared": Transition.SUCCEED, "params": params, "cause": cause}
    plain = store.succeeded(attempt, {})
    assert plain.params["result_blob"] is None and plain.params["result_blob_size"] is None
    last = store.succeeded(an_attempt(stage=_stage(1, 2)), {})
    assert last.transition is Transition.SUCCEED


def test_a_stage_before_the_last_advances_with_a_new_dispatch() -> None:
    store, _, _ = _store()
    attempt = an_attempt(stage=_stage(0, 2))
    emitted = _emitted()
    outcome = store.succeeded(attempt, {"n": 1}, emitted=emitted)
    assert outcome.transition is Transition.ADVANCE
    dispatch = outcome.params["dispatch_id"]
    assert isinstance(dispatch, uuid.UUID)
    assert outcome.params == {**_fence(attempt), "result": '{"n":1}', "dispatch_id": dispatch}
    assert outcome.cause == Cause("stage s0 succeeded", emitted=emitted)


def test_a_stage_before_a_fan_out_spawns_one_child_per_item() -> None:
    store, _, _ = _store()
    attempt = an_attempt(stage=_stage(0, 3, fans_out=True))
    emitted = _emitted()
    # A handler's result is whatever it returned: before a fan-out, a list.
    items: Any = [{"a": 1}, {"b": 2}]
    outcome = store.succeeded(attempt, items, emitted=emitted)
    assert outcome.transition is Transition.FAN_OUT
    assert outcome.params == {**_fence(attempt), "result": '{"children":2}', "children": 2}
    assert outcome.cause == Cause("stage s0 succeeded", emitted=emitted, items=[{"a": 1}, {"b": 2}])


def test_a_fan_out_of_something_not_a_list_fails_the_stage_for_good() -> None:
    store, _, _ = _store()
    attempt = an_attempt(stage=_stage(0, 3, fans_out=True))
    outcome = store.succeeded(attempt, {"not": "a list"})
    assert outcome.transition is Transition.FAIL
    message = "a stage before a fan-out stage must return a list of items, not dict"
    assert outcome.params == {
        **_fence(attempt),
        "error_code": FAN_OUT_REFUSED,
        "error_message": message,
        "retryable": False,
    }


def test_a_failure_carries_its_error_and_details_in_its_event() -> None:
    store, _, _ = _store()
    attempt = an_attempt()
    outcome = store.failed(attempt, "BAD", "it broke", retryable=True, details={"tb": "x"})
    assert outcome.transition is Transition.FAIL
    assert outcome.params == {
        **_fence(attempt),
        "error_code": "BAD",
        "error_message": "it broke",
        "retryable": True,
    }
    error = {"tb": "x", "code": "BAD", "message": "it broke", "retryable": True}
    assert outcome.cause == Cause("it broke", {"error": error})
    bare = store.failed(attempt, "BAD", "m", retryable=False)
    assert bare.cause.data == {"error": {"code": "BAD", "message": "m", "retryable": False}}


def test_details_never_override_the_error_fields() -> None:
    store, _, _ = _store()
    details = {"code": "X", "message": "y", "retryable": "z"}
    outcome = store.failed(an_attempt(), "BAD", "m", retryable=False, details=details)
    assert outcome.cause.data["error"] == {"code": "BAD", "message": "m", "retryable": False}
    retry = store.retried(an_attempt(), "BAD", "m", delay=1, details=details)
    assert retry.cause.data["error"] == {"code": "BAD", "message": "m", "retryable": True}


def test_a_cancel_writes_nothing_but_its_fence() -> None:
    store, _, _ = _store()
    attempt = an_attempt()
    outcome = store.was_cancelled(attempt)
    assert outcome.transition is Transition.CANCELLED
    assert outcome.params == _fence(attempt)
    assert outcome.cause == Cause("cancelled")


@pytest.mark.parametrize(("refund", "flag"), [(False, 0), (True, 1)])
def test_a_retry_is_due_after_its_delay_and_names_the_next_attempt(refund: bool, flag: int) -> None:
    store, _, _ = _store()
    attempt = an_attempt(attempt=2)
    outcome = store.retried(
        attempt, "SLOW", "timed out", delay=1.23456, refund=refund, details={"tb": "t"}
    )
    assert outcome.transition is Transition.SCHEDULE_RETRY
    dispatch = outcome.params["dispatch_id"]
    assert isinstance(dispatch, uuid.UUID)
    assert outcome.params == {
        **_fence(attempt),
        "error_code": "SLOW",
        "error_message": "timed out",
        "dispatch_id": dispatch,
        "delay": 1.23456,
        "refund": flag,
    }
    error = {"tb": "t", "code": "SLOW", "message": "timed out", "retryable": True}
    data = {"error": error, "delay_seconds": 1.235, "next_attempt": 3}
    assert outcome.cause == Cause("timed out", data)
    plain = store.retried(attempt, "S", "m", delay=2)
    assert type(plain.params["delay"]) is float
    assert plain.params["refund"] == 0


async def test_an_outcome_is_written_fenced_and_frees_what_its_job_held() -> None:
    store, _, machine = _store()
    attempt = an_attempt()
    ended = {"id": 1, "tenant_id": attempt.tenant_id, "concurrency_key": "k", "flow_slots": None}
    machine.answer(Transition.FAIL, [ended])
    await store.fail(attempt, "BAD", "m", retryable=False)
    (fail,) = machine.of(Transition.FAIL)
    assert fail.params == {
        **_fence(attempt),
        "error_code": "BAD",
        "error_message": "m",
        "retryable": False,
    }
    assert fail.returning == ENDED
    assert fail.cause.message == "m"
    (release,) = machine.of(Transition.RELEASE)
    assert release.params == {"tenant_id": attempt.tenant_id, "key": "k"}
    assert machine.sessions[0] == ((Transition.FAIL,), False)


async def test_pending_progress_commits_with_the_outcome_in_one_transaction() -> None:
    store, _, machine = _store()
    attempt = an_attempt()
    machine.answer(Transition.PROGRESS, [{"k": 1, "cancel_requested": False}])
    machine.answer(Transition.CANCELLED, [{"concurrency_key": None, "flow_slots": None}])
    await store.cancelled(attempt, [ProgressUpdate(0.5, "half", {})])
    assert machine.sessions == [((Transition.CANCELLED,), True)]
    assert [a.transition for a in machine.applied] == [Transition.PROGRESS, Transition.CANCELLED]
    progress = machine.applied[0]
    assert progress.params["ids"] == [attempt.job_id]
    assert progress.params["last_message"] == ["half"]
    assert progress.returning == ("k", "cancel_requested")


async def test_a_fenced_out_outcome_raises_lease_lost_naming_the_attempt() -> None:
    store, _, machine = _store()
    attempt = an_attempt(attempt=4)
    with pytest.raises(LeaseLost, match=rf"^jobs/{attempt.job_id} attempt 4 was fenced out$"):
        await store.succeed(attempt, {})
    with pytest.raises(LeaseLost, match=rf"^jobs/{attempt.job_id} attempt 4 was fenced out$"):
        await store.schedule_retry(attempt, "X", "m", delay=1.0)
    assert [a.transition for a in machine.applied] == [
        Transition.SUCCEED,
        Transition.SCHEDULE_RETRY,
    ]


async def test_fenced_out_progress_raises_lease_lost_and_written_progress_tells_cancel() -> None:
    store, _, machine = _store()
    attempt = an_attempt(attempt=2)
    update = ProgressUpdate(0.1, "m", {})
    with pytest.raises(LeaseLost, match=rf"^jobs/{attempt.job_id} attempt 2 was fenced out$"):
        await store.write_progress(attempt, [update])
    machine.answer(Transition.PROGRESS, [{"k": 1, "cancel_requested": 1}])
    assert await store.write_progress(attempt, [update]) is True
    other = an_attempt()
    machine.answer(Transition.PROGRESS, [{"k": 2, "cancel_requested": 0}])
    many = await store.write_progress_many([(attempt, [update]), (other, [update])])
    assert many == [None, False]


async def test_many_outcomes_are_written_one_statement_a_transition_in_order() -> None:
    store, _, machine = _store()
    a, b, c = an_attempt(), an_attempt(), an_attempt()
    outcomes = [
        store.was_cancelled(a),
        store.failed(b, "X", "m", retryable=False),
        store.was_cancelled(c),
    ]
    ended = {"id": 1, "tenant_id": c.tenant_id, "concurrency_key": "k2", "flow_slots": None}
    machine.answer(Transition.CANCELLED, [], [ended])
    machine.answer(Transition.FAIL, [{"concurrency_key": None, "flow_slots": None}])
    assert await store.finish_many(outcomes) == [False, True, True]
    assert [x.transition for x in machine.applied[:3]] == [
        Transition.CANCELLED,
        Transition.CANCELLED,
        Transition.FAIL,
    ]
    assert machine.applied[0].params == {
        "prepared": Transition.CANCELLED,
        "params": _fence(a),
        "cause": Cause("cancelled"),
    }
    assert {x.returning for x in machine.applied[:3]} == {ENDED}
    (release,) = machine.of(Transition.RELEASE)
    assert release.params == {"tenant_id": c.tenant_id, "key": "k2"}


async def test_a_heartbeat_extends_the_lease_under_its_fence() -> None:
    store, db, _ = _store()
    store.lease_seconds = 7.0
    attempt = an_attempt(attempt=3)
    db.conn.answer(HEARTBEAT, [True], [False])
    assert await store.heartbeat(attempt) is True
    assert await store.heartbeat(attempt) is False
    assert db.conn.ran(HEARTBEAT)[0] == {**_fence(attempt), "lease_seconds": 7.0}
    with pytest.raises(LeaseLost, match=rf"^jobs/{attempt.job_id} attempt 3 lost its lease$"):
        await store.heartbeat(attempt)
