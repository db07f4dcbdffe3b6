"""What the relay's claim reads into a batch, and what each mark of a batch
writes, over a scripted connection: every field of a claimed row, the fair
claim's queue places, and the binds of each mark (errors cut to 1000
characters, ids as text)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from jobplane.store import outbox
from jobplane.store.fair import FairClaim, FairRound, FairSlot
from jobplane.store.machine import Cause, Transition
from jobplane.store.outbox import (
    _CLAIM_BOTH,
    _CLAIM_ONE,
    _DEFER,
    _FAIR_CLAIM_BOTH,
    _LOCK_JOB,
    _LOCK_WAITING,
    _MARK_FAILED,
    _MARK_PUBLISHED,
    _MARK_RETRY,
    _MARK_RETURNED,
    _NEXT_DUE,
    GiveUp,
    OutboxBatch,
    OutboxKind,
    OutboxRow,
    OutboxStore,
    claim_statement,
)
from tests.support.store_fakes import FakeDb, ScriptedConn, ScriptedMachine


def _claimed(**changes: Any) -> dict[str, Any]:
    row = {
        "id": uuid.uuid4(),
        "tenant_id": uuid.uuid4(),
        "kind": "job.dispatch",
        "job_id": uuid.uuid4(),
        "routing_key": "mail",
        "correlation_id": "corr",
        "exchange": None,
        "body": None,
        "headers": None,
        "retried": None,
        "part": 0,
        "queue": None,
    }
    return {**row, **changes}


async def _claim(rows: list[dict[str, Any]], **kwargs: Any) -> tuple[OutboxBatch, FakeDb]:
    db = FakeDb()
    statement, _ = claim_statement(10, **kwargs)
    db.conn.answer(statement, rows)
    async with OutboxStore(db).claim(10, **kwargs) as batch:  # type: ignore[arg-type]
        return batch, db


async def test_a_claim_reads_every_field_of_each_row() -> None:
    dispatch = _claimed(retried=1, queue="ignored")
    event = _claimed(
        kind="event",
        job_id=None,
        routing_key="order.paid",
        exchange="events",
        body=memoryview(b'{"a":1}'),
        headers=json.dumps({"ce-type": "order.paid", "n": 2, "gone": None}),
        retried=False,
        part=1,
    )
    skip = [uuid.uuid4()]
    batch, db = await _claim([dispatch, event], skip=skip)
    assert batch.rows == [
        OutboxRow(
            id=dispatch["id"],
            kind=OutboxKind.JOB_DISPATCH,
            tenant_id=dispatch["tenant_id"],
            routing_key="mail",
            correlation_id="corr",
            exchange=None,
            body=None,
            headers={},
            job_id=dispatch["job_id"],
            retried=True,
            queue="",
        ),
        OutboxRow(
            id=event["id"],
            kind=OutboxKind.EVENT,
            tenant_id=event["tenant_id"],
            routing_key="order.paid",
            correlation_id="corr",
            exchange="events",
            body=b'{"a":1}',
            headers={"ce-type": "order.paid", "n": "2"},
            job_id=None,
            retried=False,
        ),
    ]
    assert type(batch.rows[1].body) is bytes
    assert batch.slots == []
    assert db.conn.ran(_CLAIM_BOTH) == [{"limit": 10, "skip": [str(skip[0])]}]
    assert db.opened == ["begin"]


@pytest.mark.parametrize("headers", [{"k": "v"}, '["not", "a", "map"]'])
async def test_headers_read_from_jsonb_as_text_or_as_a_map(headers: Any) -> None:
    batch, _ = await _claim([_claimed(headers=headers)])
    assert batch.rows[0].headers == ({"k": "v"} if isinstance(headers, dict) else {})


def _fair_binds(queue: str, credits: int, *, limit: int, skip: list[str]) -> dict[str, Any]:
    """The binds of a fair claim of up to ``limit`` rows from one queue with
    ``credits``, at the start of its round (no rank, time, cursor or pass yet)."""
    return {
        "queues": [queue],
        "credits": [credits],
        "ranks": [0],
        "vtimes": [0.0],
        "cursors": [None],
        "pass_queues": [],
        "pass_tenants": [],
        "pass_values": [],
        "spare": limit,
        "limit": limit,
        "skip": skip,
    }


async def test_a_fair_claim_reads_each_dispatchs_queue_and_place() -> None:
    tenant = uuid.uuid4()
    dispatch = _claimed(tenant_id=tenant, queue="bulk", start_tag="1.5", weight=2, part=0)
    event = _claimed(kind="event", job_id=None, queue=None, part=1)
    fair = FairClaim(FairRound(), {"bulk": (5, 0)})
    batch, db = await _claim([dispatch, event], fair=fair)
    assert [r.queue for r in batch.rows] == ["bulk", ""]
    assert batch.slots == [FairSlot("bulk", tenant, 1.5, 2.0)]
    assert db.conn.ran(_FAIR_CLAIM_BOTH) == [_fair_binds("bulk", 5, limit=10, skip=[])]


async def test_one_row_is_claimed_alone_due_or_not() -> None:
    db, row_id = FakeDb(), uuid.uuid4()
    db.conn.answer(_CLAIM_ONE, [_claimed(id=row_id)])
    async with OutboxStore(db).claim_one(row_id) as batch:  # type: ignore[arg-type]
        assert [r.id for r in batch.rows] == [row_id]
    assert db.conn.ran(_CLAIM_ONE) == [{"limit": 1, "id": row_id}]


async def test_the_next_due_row_is_seconds_away_or_none() -> None:
    db = FakeDb()
    store = OutboxStore(db)  # type: ignore[arg-type]
    assert await store.seconds_until_due() is None
    db.conn.answer(_NEXT_DUE, "2.5")
    assert await store.seconds_until_due() == 2.5
    assert db.opened == ["connect", "connect"]


async def test_marks_bind_ids_as_text_and_cut_errors_to_a_thousand_characters() -> None:
    conn = ScriptedConn()
    batch = OutboxBatch(conn, [])  # type: ignore[arg-type]
    ids = [uuid.uuid4(), uuid.uuid4()]
    text_ids = [str(i) for i in ids]
    error = "e" * 1001
    await batch.mark_published([])
    await batch.mark_retry([], error)
    await batch.defer([], error)
    assert conn.calls == []
    await batch.mark_published(ids)
    await batch.mark_retry(ids, error)
    await batch.defer(ids, error)
    row = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, uuid.uuid4(), "k")
    await batch.mark_failed(row, error)
    assert conn.ran(_MARK_PUBLISHED) == [{"ids": text_ids}]
    assert conn.ran(_MARK_RETRY) == [{"ids": text_ids, "error": "e" * 1000}]
    assert conn.ran(_DEFER) == [{"ids": text_ids, "error": "e" * 1000}]
    assert conn.ran(_MARK_FAILED) == [{"id": row.id, "error": "e" * 1000}]


async def test_returned_rows_to_give_up_on_are_those_past_both_bounds() -> None:
    conn = ScriptedConn()
    batch = OutboxBatch(conn, [])  # type: ignore[arg-type]
    assert await batch.mark_returned([], "x", give_up_after=1.0, give_up_returns=2) == []
    a, b = uuid.uuid4(), uuid.uuid4()
    conn.answer(_MARK_RETURNED, [{"id": str(a), "give_up": True}, {"id": b, "give_up": False}])
    given_up = await batch.mark_returned([a, b], "r" * 1200, give_up_after=30.0, give_up_returns=5)
    assert given_up == [a]
    assert conn.ran(_MARK_RETURNED) == [
        {"ids": [str(a), str(b)], "error": "r" * 1000, "min_returns": 5, "after": 30.0}
    ]


def _dispatch() -> OutboxRow:
    return OutboxRow(
        uuid.uuid4(), OutboxKind.JOB_DISPATCH, uuid.uuid4(), "mail", job_id=uuid.uuid4()
    )


async def test_giving_up_on_a_row_that_is_not_a_dispatch_fails_it_alone() -> None:
    conn = ScriptedConn()
    row = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, uuid.uuid4(), "order.paid")
    assert await OutboxBatch(conn, []).fail(row, "C", "m" * 1001) is GiveUp.NO_JOB  # type: ignore[arg-type]
    assert conn.ran(_MARK_FAILED) == [{"id": row.id, "error": "m" * 1000}]
    assert conn.ran(_LOCK_JOB) == []


async def test_giving_up_on_a_dispatch_whose_job_is_locked_writes_nothing() -> None:
    conn = ScriptedConn()
    row = _dispatch()
    assert await OutboxBatch(conn, []).fail(row, "C", "m") is GiveUp.BUSY  # type: ignore[arg-type]
    assert conn.ran(_LOCK_JOB) == [{"job_id": row.job_id, "dispatch_id": row.id}]
    assert conn.ran(_MARK_FAILED) == []


async def test_giving_up_on_a_dispatch_its_job_moved_on_from_fails_the_row_alone() -> None:
    conn = ScriptedConn()
    row = _dispatch()
    conn.answer(_LOCK_JOB, {"current": False})
    assert await OutboxBatch(conn, []).fail(row, "C", "m") is GiveUp.MOVED_ON  # type: ignore[arg-type]
    assert conn.ran(_MARK_FAILED) == [{"id": row.id, "error": "m"}]
    assert not [c for c in conn.calls if c[1] not in (_LOCK_JOB, _MARK_FAILED)]


def test_the_claim_statement_is_the_plain_or_the_fair_one() -> None:
    skip = [uuid.uuid4()]
    assert claim_statement(3, skip=skip) == (_CLAIM_BOTH, {"limit": 3, "skip": [str(skip[0])]})
    assert claim_statement(3) == (_CLAIM_BOTH, {"limit": 3, "skip": []})
    fair = FairClaim(FairRound(), {"q": (1, 0)})
    statement, binds = claim_statement(4, skip=skip, fair=fair)
    assert statement is _FAIR_CLAIM_BOTH
    assert binds == _fair_binds("q", 1, limit=4, skip=[str(skip[0])])


def _machine(monkeypatch: pytest.MonkeyPatch) -> ScriptedMachine:
    machine = ScriptedMachine()
    monkeypatch.setattr(outbox, "MACHINE", machine)
    return machine


async def test_giving_up_on_a_dispatch_its_job_waits_for_fails_the_job_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = _machine(monkeypatch)
    conn = ScriptedConn()
    row = _dispatch()
    conn.answer(_LOCK_JOB, {"current": True})
    outcome = await OutboxBatch(conn, []).fail(row, "UNROUTABLE", "x" * 1001)  # type: ignore[arg-type]
    assert outcome is GiveUp.JOB_FAILED
    assert conn.ran(_MARK_FAILED) == [{"id": row.id, "error": "x" * 1000}]
    (failed,) = machine.applied
    assert failed.transition is Transition.RELAY_FAIL
    assert failed.params == {
        "job_id": row.job_id,
        "dispatch_id": row.id,
        "code": "UNROUTABLE",
        "message": "x" * 1000,
    }
    assert failed.cause == Cause("x" * 1000, {"error": {"code": "UNROUTABLE", "retryable": False}})
    assert failed.returning == ("id",)


async def test_waiting_reasons_are_noted_on_the_jobs_still_waiting_for_those_dispatches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = _machine(monkeypatch)
    conn = ScriptedConn()
    noted, cleared, kept, busy = _dispatch(), _dispatch(), _dispatch(), _dispatch()
    event = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, uuid.uuid4(), "order.paid")
    locked = [
        {"id": noted.job_id, "waiting_code": None},
        {"id": cleared.job_id, "waiting_code": "UNROUTABLE"},
        {"id": kept.job_id, "waiting_code": "HANDED_BACK"},
    ]
    conn.answer(_LOCK_WAITING, locked)
    machine.answer(Transition.WAIT, [{"id": 1}], [])
    reasons = [
        (noted, "UNROUTABLE", "r" * 1001),
        (cleared, "", "ignored"),
        (kept, "", "ignored"),
        (busy, "UNROUTABLE", "m"),
        (event, "UNROUTABLE", "m"),
    ]
    changed = await OutboxBatch(conn, []).note_waiting(reasons, clears="UNROUTABLE")  # type: ignore[arg-type]
    assert changed == [noted]
    ids = [str(r.job_id) for r in (noted, cleared, kept, busy)]
    assert conn.ran(_LOCK_WAITING) == [{"ids": ids}]
    assert [a.params for a in machine.of(Transition.WAIT)] == [
        {
            "prepared": Transition.WAIT,
            "params": {
                "id": noted.job_id,
                "dispatch_id": noted.id,
                "waiting_code": "UNROUTABLE",
                "waiting_reason": "r" * 1000,
            },
            "cause": Cause(),
        },
        {
            "prepared": Transition.WAIT,
            "params": {
                "id": cleared.job_id,
                "dispatch_id": cleared.id,
                "waiting_code": None,
                "waiting_reason": None,
            },
            "cause": Cause(),
        },
    ]
    assert {a.params["prepared"] for a in machine.applied} == {Transition.WAIT}
    assert {a.returning for a in machine.applied} == {("id",)}


async def test_no_waiting_reason_to_note_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = _machine(monkeypatch)
    conn = ScriptedConn()
    event = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, uuid.uuid4(), "order.paid")
    assert await OutboxBatch(conn, []).note_waiting([(event, "X", "m")]) == []  # type: ignore[arg-type]
    assert conn.calls == []
    row = _dispatch()
    conn.answer(_LOCK_WAITING, [{"id": row.job_id, "waiting_code": "OTHER"}])
    assert await OutboxBatch(conn, []).note_waiting([(row, "", "")], clears="X") == []  # type: ignore[arg-type]
    assert machine.applied == []
