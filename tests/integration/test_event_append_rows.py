"""What appending domain events in a caller's transaction returns and stores: each
event where it sits, a replay as first stored, a reused id refused
(docs/events.md, publishing in a transaction)."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta

import pytest

from jobplane.errors import EventIdReused
from jobplane.events import Event
from jobplane.store.events import NewEvent, append
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)

_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_an_append_returns_each_event_where_it_sits_and_a_replay_as_first_stored(
    stack: Stack,
) -> None:
    job = await stack.client().submit("demo.echo", {})
    job_id = uuid.UUID(job.id)
    first = Event.new("thing.made", {"n": 1}, tenant_id=stack.tenant_id, project_id="p-1")
    second = Event.new("thing.made", {"n": 2}, tenant_id=stack.tenant_id, caused_by=first)
    async with stack.engine.begin() as conn:
        stored = await append(
            conn,
            stack.tenant_id,
            [
                NewEvent(first, job_id=job_id, traceparent=_TRACE, tracestate="k=v"),
                NewEvent(second),
                NewEvent(first, job_id=job_id),  # the same again, in the same transaction
            ],
        )
    assert [(s.event, s.job_id, s.created) for s in stored] == [
        (first, job_id, True),
        (second, None, True),
        (first, job_id, False),
    ]
    one, two, again = (s.position for s in stored)
    assert one.txid == two.txid and one.seq < two.seq and again == one
    row = await stack.scalar(
        "SELECT jsonb_build_array(event_type, payload, project_id, correlation_id, causation_id,"
        " job_id, traceparent, tracestate) FROM events WHERE event_id = :id",
        id=first.event_id,
    )
    assert row == [
        "thing.made",
        {"n": 1},
        "p-1",
        first.correlation_id,
        first.causation_id,
        str(job_id),
        _TRACE,
        "k=v",
    ]
    traced = await stack.scalar(
        "SELECT jsonb_build_array(traceparent, tracestate) FROM events WHERE event_id = :id",
        id=second.event_id,
    )
    assert traced == [None, None]

    # Later: the same values (1.0 is 1 to Postgres), and a time its publisher did not
    # choose, are the stored event; a time chosen that differs is another event.
    later = replace(first, payload={"n": 1.0}, timestamp=first.timestamp + timedelta(seconds=1))
    async with stack.engine.begin() as conn:
        (replayed,) = await append(
            conn, stack.tenant_id, [NewEvent(later, job_id=job_id, timestamp_given=False)]
        )
        assert (replayed.event, replayed.job_id, replayed.created) == (first, job_id, False)
        assert replayed.position == one
        with pytest.raises(EventIdReused) as refused:
            await append(conn, stack.tenant_id, [NewEvent(later, job_id=job_id)])
    assert refused.value.message == (
        f"event_id {str(first.event_id)!r} was published with a different event"
    )
    assert refused.value.field == "event_id"
    changed = replace(first, payload={"n": 3})
    async with stack.engine.begin() as conn:
        with pytest.raises(EventIdReused):
            await append(
                conn, stack.tenant_id, [NewEvent(changed, job_id=job_id, timestamp_given=False)]
            )
        stranger = Event.new("thing.made", tenant_id=uuid.uuid4())
        with pytest.raises(ValueError, match=f"^event {stranger.event_id} belongs to another"):
            await append(conn, stack.tenant_id, [NewEvent(stranger)])
    count = await stack.scalar("SELECT count(*) FROM events WHERE event_type = 'thing.made'")
    assert count == 2
