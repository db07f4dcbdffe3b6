"""A worker's other requests of the job table: giving back a job it has no
handler for, dispatching parked jobs again, claiming a group of deliveries in
one statement, and freeing the keys and flow limits ended jobs held (a failure
of which is logged, never raised: the outcome has committed)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from jobplane.envelope import Envelope
from jobplane.store import attempts
from jobplane.store.attempts import AttemptStore, ClaimRequest, ClaimStatus, HandBack
from jobplane.store.claims import CLAIMED, INSPECT
from jobplane.store.machine import Cause, Transition
from jobplane.store.machine.flow import ENDED_KEYS, FREE
from tests.support.attempts import an_attempt
from tests.support.logs import module_lines
from tests.support.store_fakes import FakeDb, ScriptedMachine


def _store(*, groupable: bool = True) -> tuple[AttemptStore, FakeDb, ScriptedMachine]:
    db, machine = FakeDb(), ScriptedMachine(groupable=groupable)
    store = AttemptStore(db, lease_seconds=9.0, machine=machine)  # type: ignore[arg-type]
    return store, db, machine


def _envelope() -> Envelope:
    return Envelope(
        event_id=uuid.uuid4(), job_id=uuid.uuid4(), tenant_id=uuid.uuid4(), job_type="mail"
    )


@pytest.mark.parametrize(
    ("handled", "status"), [(True, HandBack.HANDED_BACK), (0, HandBack.PARKED)]
)
async def test_a_job_given_back_is_handed_back_or_parked_with_its_reason(
    handled: Any, status: HandBack
) -> None:
    store, _, machine = _store()
    envelope = _envelope()
    machine.answer(Transition.HAND_BACK, [{"handled": handled, "waiting_reason": "why"}])
    assert await store.hand_back(envelope, base_delay=1.5, max_delay=60.0) == (status, "why")
    (applied,) = machine.applied
    assert applied.transition is Transition.HAND_BACK
    new_dispatch = applied.params.pop("new_dispatch_id")
    assert isinstance(new_dispatch, uuid.UUID) and new_dispatch != envelope.event_id
    assert applied.params == {
        "id": envelope.job_id,
        "tenant_id": envelope.tenant_id,
        "dispatch_id": envelope.event_id,
        "base_delay": 1.5,
        "max_delay": 60.0,
    }
    assert applied.returning == ("handled", "waiting_reason")
    assert machine.sessions == [((Transition.HAND_BACK, Transition.PARK), False)]


async def test_a_job_that_cannot_be_given_back_is_not_queued_or_not_found() -> None:
    store, db, machine = _store()
    envelope = _envelope()
    db.conn.answer(INSPECT, None, {"state": "running"})
    assert await store.hand_back(envelope, base_delay=1, max_delay=2) == (HandBack.NOT_FOUND, "")
    assert await store.hand_back(envelope, base_delay=1, max_delay=2) == (HandBack.NOT_QUEUED, "")
    first = db.conn.ran(INSPECT)[0]
    assert first == machine.applied[0].params


async def test_parked_jobs_of_the_workers_types_and_queues_are_dispatched_again() -> None:
    store, _, machine = _store()
    assert await store.unpark([], ["q"]) == 0
    assert await store.unpark(["t"], []) == 0
    assert machine.applied == []
    machine.answer(Transition.UNPARK, [{"id": 1}, {"id": 2}])
    assert await store.unpark(("a", "b"), ("q",)) == 2
    (applied,) = machine.applied
    assert applied.transition is Transition.UNPARK
    assert applied.params == {"types": ["a", "b"], "queues": ["q"], "limit": 500}
    assert applied.returning == ("id",)
    assert machine.sessions == [((Transition.UNPARK,), False)]
    await store.unpark(["a"], ["q"], limit=3)
    assert machine.applied[-1].params["limit"] == 3


def _claim_params(envelope: Envelope, lease_token: uuid.UUID) -> dict[str, Any]:
    """What a claim of ``envelope`` binds, under ``lease_token``, on the 9 s lease."""
    return {
        "id": envelope.job_id,
        "tenant_id": envelope.tenant_id,
        "dispatch_id": envelope.event_id,
        "type": "mail",
        "lease_token": lease_token,
        "lease_seconds": 9.0,
    }


async def test_a_group_claims_each_request_with_the_binds_taken_at_its_request() -> None:
    store, db, machine = _store()
    first, second = _envelope(), _envelope()
    requests = [store.claim_request(first, worker="w"), store.claim_request(second)]
    one: ClaimRequest = requests[0]
    assert one.envelope is first and one.worker == "w"
    assert isinstance(one.lease_token, uuid.UUID)
    assert one.lease_token != requests[1].lease_token
    assert one.binds["prepared"] is Transition.CLAIM
    assert one.binds["cause"] == Cause("attempt started", {"worker": "w"})
    assert one.binds["params"] == _claim_params(first, one.lease_token)
    assert requests[1].binds["cause"] == Cause("attempt started", {})
    claimed = {
        "type": "mail",
        "payload": {},
        "attempt": 1,
        "max_attempts": 1,
        "retry_base": 0,
        "correlation_id": "",
        "request_id": "r",
        "timeout_seconds": 5,
        "queue": "q",
        "lifecycle_seq": None,
        "stage": None,
    }
    machine.answer(Transition.CLAIM, [], [claimed])
    results = await store.claim_many(requests)
    assert results[0] is None
    assert results[1] is not None and results[1].status is ClaimStatus.CLAIMED
    attempt = results[1].attempt
    assert attempt is not None
    assert (attempt.job_id, attempt.lease_token) == (second.job_id, requests[1].lease_token)
    assert attempt.started_event_id is None
    assert [a.params for a in machine.applied] == [
        {
            "prepared": Transition.CLAIM,
            "params": _claim_params(first, one.lease_token),
            "cause": Cause("attempt started", {"worker": "w"}),
        },
        {
            "prepared": Transition.CLAIM,
            "params": _claim_params(second, requests[1].lease_token),
            "cause": Cause("attempt started", {}),
        },
    ]
    assert {a.returning for a in machine.applied} == {CLAIMED}
    assert db.opened == ["begin"]


async def test_a_claim_a_group_refused_is_tried_alone_by_its_worker() -> None:
    store, _, machine = _store()
    request = store.claim_request(_envelope(), worker="w-2")
    result = await store.refused_claim(request)
    assert result.status is ClaimStatus.NOT_FOUND
    (claim,) = machine.of(Transition.CLAIM)
    assert claim.cause == Cause("attempt started", {"worker": "w-2"})
    assert claim.params["dispatch_id"] == request.envelope.event_id


@pytest.mark.parametrize("groupable", [True, False])
def test_whether_a_group_can_claim_or_finish_is_the_machines(groupable: bool) -> None:
    store, _, _ = _store(groupable=groupable)
    assert store.groups_claims is groupable
    assert store.groups(store.was_cancelled(an_attempt())) is groupable


async def test_the_keys_ended_jobs_held_are_released_each_in_its_own_transaction() -> None:
    store, db, machine = _store()
    tenant = uuid.uuid4()
    rows = [
        {"tenant_id": tenant, "concurrency_key": "b", "flow_slots": ["limit/x/1"]},
        None,
        {"tenant_id": tenant, "concurrency_key": "a", "flow_slots": None},
    ]
    db.conn.answer(ENDED_KEYS, [{"key": "limit/x/1"}])
    db.conn.answer(FREE, [{"free": 2}])
    await store.release_ended(rows)
    released = [a.params for a in machine.of(Transition.RELEASE)]
    assert released == [{"tenant_id": tenant, "key": "a"}, {"tenant_id": tenant, "key": "b"}]
    assert [a.params for a in machine.of(Transition.RELEASE_LIMIT)] == [
        {"key": "limit/x/1", "free": 2}
    ]
    assert db.conn.ran(ENDED_KEYS) == [{"keys": ["limit/x/1"]}]
    assert db.opened == ["begin", "begin", "connect", "begin"]


async def test_a_release_that_fails_is_logged_and_left_to_the_sweeper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, db, machine = _store()
    tenant = uuid.uuid4()

    async def broken(*_: Any, **__: Any) -> list[Any]:
        raise RuntimeError("database went away")

    monkeypatch.setattr(machine, "apply", broken)
    rows = [{"tenant_id": tenant, "concurrency_key": "k", "flow_slots": ["limit/x/1"]}]
    with module_lines(monkeypatch, attempts, "jobplane.store.t") as lines:
        db.conn.answer(ENDED_KEYS, [{"key": "limit/x/1"}])
        await store.release_ended(rows)
    assert [(line["event"], line["log_level"]) for line in lines] == [
        ("store.concurrency.release_failed", "warning"),
        ("store.flow.release_failed", "warning"),
    ]
    assert lines[0]["tenant_id"] == str(tenant)
    assert lines[0]["error"] == lines[1]["error"] == "RuntimeError: database went away"
