"""``ctx.emit``: the event a handler's attempt keeps for its success, and each refusal."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from jobplane.events.envelope import decode
from jobplane.store.machine.lifecycle import MAX_EMITTED_BYTES, MAX_EMITTED_EVENTS
from jobplane.workers import JobContext
from jobplane.workers.errors import EmitError
from tests.support.attempts import an_attempt, progress_context


def test_an_emitted_event_is_the_jobs_with_the_started_event_as_its_cause() -> None:
    started = uuid.uuid4()
    ctx, _ = progress_context(correlation_id="order 7", started_event_id=started)
    payload: dict[str, Any] = {"rows": [1, 2]}
    event_id = ctx.emit("report.rendered", payload, project_id="p-1")
    payload["rows"].append(3)  # copied at emit: changes nothing
    (kept,) = ctx.emitted
    event = kept.event
    assert event.event_id == event_id
    assert (event.event_type, event.payload, event.project_id) == (
        "report.rendered",
        {"rows": [1, 2]},
        "p-1",
    )
    assert event.tenant_id == ctx._attempt.tenant_id
    assert (event.correlation_id, event.causation_id) == ("order 7", str(started))
    # The body is the event as published.
    assert decode(kept.body) == event
    assert json.loads(kept.body)["payload"] == {"rows": [1, 2]}


def test_an_event_without_a_payload_has_an_empty_one_and_given_ids_win() -> None:
    ctx, _ = progress_context(correlation_id="c", started_event_id=uuid.uuid4())
    given = uuid.uuid4()
    assert ctx.emit("thing.done", event_id=given, causation_id="cause-1") == given
    event = ctx.emitted[0].event
    assert (event.payload, event.causation_id, event.project_id) == ({}, "cause-1", None)


def test_without_a_started_event_nothing_is_named_as_the_cause() -> None:
    ctx, _ = progress_context(correlation_id="c")
    ctx.emit("thing.done", {})
    assert ctx.emitted[0].event.causation_id is None


@pytest.mark.parametrize(
    ("correlation", "kept"),
    [
        ("order 7", True),
        ("é" * 127 + "x", True),  # 255 bytes
        ("é" * 128, False),  # 256 bytes
        ("", False),
        ("a\tb", False),
        ("a\x7fb", False),
    ],
    ids=["plain", "255-bytes", "256-bytes", "empty", "control", "delete"],
)
def test_the_events_correlation_is_the_jobs_when_an_envelope_can_carry_it(
    correlation: str, kept: bool
) -> None:
    ctx, _ = progress_context(correlation_id=correlation)
    ctx.emit("thing.done")
    expected = correlation if kept else str(ctx._attempt.job_id)
    assert ctx.emitted[0].event.correlation_id == expected


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (
            lambda ctx: ctx.emit("thing.done", [1]),
            "payload",
            "payload must be a dict (a JSON object), got list",
        ),
        (
            lambda ctx: ctx.emit("thing.done", {}, event_id="not-a-uuid"),
            "event_id",
            "event_id must be a uuid.UUID",
        ),
        (lambda ctx: ctx.emit("Bad Type", {}), "event_type", "event_type"),
        (lambda ctx: ctx.emit("thing.done", {"x": float("nan")}), "payload", "payload"),
        (
            lambda ctx: ctx.emit("thing.done", {"text": "x" * 200}),
            "payload",
            "the limit is 100",
        ),
    ],
    ids=["not-a-dict", "bad-event-id", "bad-type", "not-json", "over-the-limit"],
)
def test_a_refused_event_names_its_field_and_is_not_kept(
    call: Any, field: str, message: str
) -> None:
    ctx = JobContext(an_attempt(), _NoSink(), max_event_payload_bytes=100)
    with pytest.raises(EmitError) as raised:
        call(ctx)
    assert raised.value.field == field
    assert message in str(raised.value)
    assert ctx.emitted == ()


def test_an_event_at_the_payload_limit_is_kept() -> None:
    ctx = JobContext(an_attempt(), _NoSink(), max_event_payload_bytes=100)
    ctx.emit("thing.done", {"text": "x" * (100 - len('{"text":""}'))})
    assert len(ctx.emitted) == 1


def test_by_default_an_events_payload_is_at_most_256_kib() -> None:
    ctx, _ = progress_context()
    room = 256 * 1024 - len('{"text":""}')
    ctx.emit("thing.big", {"text": "x" * room})
    with pytest.raises(EmitError, match="the limit is 262144"):
        ctx.emit("thing.big", {"text": "x" * (room + 1)})
    assert len(ctx.emitted) == 1


def test_an_attempt_emits_at_most_its_number_of_events() -> None:
    ctx, _ = progress_context()
    for i in range(MAX_EMITTED_EVENTS):
        ctx.emit("thing.done", {"i": i})
    with pytest.raises(EmitError) as raised:
        ctx.emit("thing.done", {})
    assert raised.value.field == "event_type"
    assert str(raised.value) == f"an attempt may emit at most {MAX_EMITTED_EVENTS} events"
    assert [e.event.payload["i"] for e in ctx.emitted] == list(range(MAX_EMITTED_EVENTS))


def test_an_attempt_emits_at_most_its_bytes_of_events() -> None:
    ctx, _ = progress_context()
    big = {"text": "x" * 200_000}
    for _ in range(5):
        ctx.emit("thing.big", big)
    used = sum(len(e.body) for e in ctx.emitted)
    assert used < MAX_EMITTED_BYTES
    with pytest.raises(EmitError) as raised:
        ctx.emit("thing.big", big)
    assert raised.value.field == "payload"
    assert str(raised.value) == f"an attempt may emit at most {MAX_EMITTED_BYTES} bytes of events"
    # The refused event took none of the room: a small one still fits.
    ctx.emit("thing.small", {})
    assert [e.event_type for e in ctx.emitted] == ["thing.big"] * 5 + ["thing.small"]


class _NoSink:
    async def add(self, update: object) -> None:
        raise AssertionError("no progress in these tests")
