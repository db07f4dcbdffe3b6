"""The SDK's publish and subscribe, and `jobplane events`, without a server.

Scripted streams stand in for SubscribeEvents the way they do for WatchJob in
test_client_unit: what is judged is what the SDK asks for on each reconnect
and what it hands the caller.
"""

from __future__ import annotations

import argparse
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import grpc
import pytest

from jobplane.client import (
    AsyncClient,
    Client,
    Event,
    EventIdReused,
    EventSubscription,
    InternalError,
    InvalidArgument,
    JobplaneError,
    RetryPolicy,
    SubscribedEvent,
    TenantLimitExceeded,
    Unavailable,
    cli,
)
from jobplane.events.convert import event_to_pb
from jobplane.v1 import events_pb2
from tests.support.rpc_errors import error_info, rpc_error, tenant_limit, unavailable

TENANT = uuid.UUID("7d3c9d2e-4a51-4c8e-9d7e-0d6f1f1b2a33")
NOW = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
FAST = RetryPolicy(initial_delay=0.001, max_delay=0.01, max_elapsed=0.3, jitter=0)
EARLIEST = events_pb2.SubscribeEventsRequest.START_EARLIEST
LATEST = events_pb2.SubscribeEventsRequest.START_LATEST


def domain_event(n: int, event_type: str = "artifact.created") -> Event:
    return Event(
        event_id=uuid.UUID(int=n),
        event_type=event_type,
        timestamp=NOW,
        tenant_id=TENANT,
        correlation_id=str(uuid.UUID(int=n)),
        payload={"n": n},
    )


def reply(n: int) -> events_pb2.SubscribeEventsResponse:
    return events_pb2.SubscribeEventsResponse(event=event_to_pb(domain_event(n)), cursor=f"c{n}")


class FakeStream:
    """Stands in for a SubscribeEvents call: replies, then an error or an end."""

    def __init__(
        self,
        replies: Iterable[events_pb2.SubscribeEventsResponse],
        error: BaseException | None = None,
    ) -> None:
        self._replies = list(replies)
        self._error = error
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        for message in self._replies:
            yield message
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Script:
    """The streams successive SubscribeEvents calls get, and what each asked for."""

    def __init__(self, *streams: FakeStream) -> None:
        self.streams = list(streams)
        self.requests: list[events_pb2.SubscribeEventsRequest] = []
        self.opened: list[FakeStream] = []

    def __call__(self, request: events_pb2.SubscribeEventsRequest) -> FakeStream:
        self.requests.append(request)
        stream = self.streams.pop(0) if self.streams else FakeStream([], unavailable())
        self.opened.append(stream)
        return stream

    @property
    def cursors(self) -> list[str]:
        return [r.after_cursor for r in self.requests]


def scripted(
    monkeypatch: pytest.MonkeyPatch, script: Script, policy: RetryPolicy = FAST
) -> AsyncClient:
    client = AsyncClient("127.0.0.1:1", "key", watch_retry=policy)
    monkeypatch.setattr(client, "_open_subscription", script)
    return client


async def take(subscription: EventSubscription, count: int) -> list[SubscribedEvent]:
    taken = []
    async for item in subscription:
        taken.append(item)
        if len(taken) == count:
            break
    return taken


def numbers(items: list[SubscribedEvent]) -> list[int]:
    return [item.event.payload["n"] for item in items]


# -- subscribe ---------------------------------------------------------------------


async def test_subscribe_resumes_after_the_last_cursor_it_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = Script(
        FakeStream([reply(1), reply(2), reply(3)], unavailable()),
        FakeStream([], unavailable()),
        # A stream the server never ends by itself ended: resumed as well.
        FakeStream([reply(4)]),
        FakeStream([reply(5), reply(6)]),
    )
    client = scripted(monkeypatch, script)
    subscription = client.subscribe(["artifact.*", "job.#"])
    assert subscription.cursor is None
    items = await take(subscription, 6)
    assert numbers(items) == [1, 2, 3, 4, 5, 6]
    assert [item.cursor for item in items] == ["c1", "c2", "c3", "c4", "c5", "c6"]
    event, cursor = items[0]
    assert (event.event_id, cursor) == (uuid.UUID(int=1), "c1")
    assert script.cursors == ["", "c3", "c3", "c4"]
    assert script.requests[0].start == EARLIEST
    assert all(list(r.type_patterns) == ["artifact.*", "job.#"] for r in script.requests)
    assert subscription.cursor == "c6"
    await subscription.aclose()
    assert all(stream.cancelled for stream in script.opened)


async def test_subscribe_starts_after_a_cursor_or_at_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = Script(FakeStream([reply(8)], unavailable()), FakeStream([reply(9)]))
    client = scripted(monkeypatch, script)
    subscription = client.subscribe("#", after_cursor="c7", start="latest")
    assert subscription.cursor == "c7"
    assert numbers(await take(subscription, 2)) == [8, 9]
    assert script.cursors == ["c7", "c8"]
    assert list(script.requests[0].type_patterns) == ["#"]

    script = Script(FakeStream([], unavailable()), FakeStream([reply(1)], unavailable()))
    client = scripted(monkeypatch, script)
    subscription = client.subscribe(["#"], start="latest")
    assert numbers(await take(subscription, 1)) == [1]
    await subscription.aclose()
    # Nothing delivered before the first drop: LATEST again, no cursor.
    assert [(r.after_cursor, r.start) for r in script.requests] == [("", LATEST), ("", LATEST)]

    with pytest.raises(ValueError, match="earliest"):
        client.subscribe("#", start="oldest")  # type: ignore[arg-type]


async def test_subscribe_raises_refusals_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    refusal = rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        "after_cursor is not a cursor this server made",
        error_info("INVALID_ARGUMENT", field="after_cursor"),
    )
    script = Script(FakeStream([], refusal))
    client = scripted(monkeypatch, script)
    with pytest.raises(InvalidArgument) as info:
        await take(client.subscribe("#", after_cursor="bogus"), 1)
    assert info.value.field == "after_cursor"
    assert info.value.__cause__ is refusal
    assert len(script.requests) == 1


async def test_subscribe_gives_up_after_max_elapsed(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(initial_delay=0.001, max_delay=0.005, max_elapsed=0.05, jitter=0)
    script = Script(FakeStream([reply(1)], unavailable()))
    client = scripted(monkeypatch, script, policy)
    subscription = client.subscribe("#")
    seen: list[SubscribedEvent] = []

    async def drain() -> None:
        async for item in subscription:
            seen.append(item)

    with pytest.raises(Unavailable, match="after cursor c1") as info:
        await drain()
    assert numbers(seen) == [1]
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
    assert len(script.requests) > 2
    assert set(script.cursors[1:]) == {"c1"}
    assert subscription.cursor == "c1"


async def test_subscribe_waits_out_a_tenant_stream_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(
        FakeStream([reply(1)], unavailable()),
        FakeStream([], tenant_limit(0.02)),
        FakeStream([], tenant_limit(0.02)),
        FakeStream([reply(2)]),
    )
    client = scripted(monkeypatch, script)
    assert numbers(await take(client.subscribe("#"), 2)) == [1, 2]
    assert script.cursors == ["", "c1", "c1", "c1"]

    # A delay longer than the whole budget is raised at once.
    script = Script(FakeStream([], tenant_limit(5.0)))
    client = scripted(monkeypatch, script)
    with pytest.raises(TenantLimitExceeded) as info:
        await take(client.subscribe("#"), 1)
    assert info.value.retry_delay == pytest.approx(5.0)
    assert len(script.requests) == 1


async def test_subscribe_refuses_an_event_the_envelope_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = reply(1)
    bad.event.event_type = "Not A Type"
    client = scripted(monkeypatch, Script(FakeStream([bad])))
    with pytest.raises(InternalError, match="not valid") as info:
        await take(client.subscribe("#"), 1)
    assert info.value.field == "event_type"


async def test_closing_a_subscription_cancels_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(FakeStream([reply(1), reply(2)]))
    client = scripted(monkeypatch, script)
    async with client.subscribe("#") as subscription:
        assert (await anext(subscription)).cursor == "c1"
    assert script.opened[0].cancelled
    with pytest.raises(StopAsyncIteration):
        await anext(subscription)
    assert "c1" in repr(subscription)


def test_blocking_subscription_pulls_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(FakeStream([reply(1), reply(2)], unavailable()), FakeStream([reply(3)]))
    with Client("127.0.0.1:1", "key", watch_retry=FAST) as client:
        monkeypatch.setattr(client._async, "_open_subscription", script)
        seen = []
        with client.subscribe(["#"]) as subscription:
            for event, cursor in subscription:
                seen.append((event.payload["n"], cursor))
                if len(seen) == 3:
                    break
            assert subscription.cursor == "c3"
        assert seen == [(1, "c1"), (2, "c2"), (3, "c3")]
        assert all(stream.cancelled for stream in script.opened)
        assert list(subscription) == []


# -- publish -----------------------------------------------------------------------


class FakeEventStub:
    """Stands in for the EventService stub: PublishEvent fails with ``errors``, then
    answers with the event the request describes."""

    def __init__(self, *errors: grpc.aio.AioRpcError) -> None:
        self.errors = list(errors)
        self.requests: list[events_pb2.PublishEventRequest] = []

    async def PublishEvent(
        self, request: events_pb2.PublishEventRequest, **_: Any
    ) -> events_pb2.Event:
        self.requests.append(request)
        if self.errors:
            raise self.errors.pop(0)
        if not re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", request.event_id):
            raise rpc_error(
                grpc.StatusCode.INVALID_ARGUMENT,
                "event_id must be a UUID",
                error_info("INVALID_ARGUMENT", field="event_id"),
            )
        message = events_pb2.Event(
            event_id=request.event_id,
            event_type=request.event_type,
            tenant_id=str(TENANT),
            correlation_id=request.correlation_id or request.event_id,
            payload=request.payload,
        )
        if request.HasField("timestamp"):
            message.timestamp.CopyFrom(request.timestamp)
        else:
            message.timestamp.FromDatetime(NOW)
        if request.HasField("project_id"):
            message.project_id = request.project_id
        if request.HasField("causation_id"):
            message.causation_id = request.causation_id
        return message


def with_stub(stub: FakeEventStub, **kwargs: Any) -> AsyncClient:
    client = AsyncClient("127.0.0.1:1", "key", **kwargs)
    client._get_channel()
    client._event_stub = stub  # type: ignore[assignment]
    return client


async def test_publish_keeps_its_event_id_across_retries() -> None:
    stub = FakeEventStub(unavailable(), rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    client = with_stub(stub)
    try:
        event = await client.publish("artifact.created", {"artifact": "a.tar"})
    finally:
        await client.close()
    assert len(stub.requests) == 3
    ids = {r.event_id for r in stub.requests}
    assert ids == {str(event.event_id)}
    assert uuid.UUID(ids.pop()).version == 4
    assert event.payload == {"artifact": "a.tar"}
    assert event.correlation_id == str(event.event_id)
    assert not stub.requests[0].HasField("timestamp")
    assert not stub.requests[0].HasField("project_id")
    assert not stub.requests[0].HasField("causation_id")


async def test_publish_maps_event_id_reused_and_does_not_repeat_it() -> None:
    refusal = rpc_error(
        grpc.StatusCode.ALREADY_EXISTS,
        "event_id was published with a different event",
        error_info("EVENT_ID_REUSED"),
    )
    stub = FakeEventStub(refusal)
    client = with_stub(stub)
    try:
        with pytest.raises(EventIdReused) as info:
            await client.publish("artifact.created", event_id=uuid.UUID(int=5))
    finally:
        await client.close()
    assert info.value.__cause__ is refusal
    assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert len(stub.requests) == 1


async def test_publish_sends_every_field_given() -> None:
    stub = FakeEventStub()
    client = with_stub(stub)
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    event_id = "0193A2E5-0000-7000-8000-00000000000A"
    try:
        event = await client.publish(
            "deployment.completed",
            {"ok": True},
            event_id=event_id,
            timestamp=when,
            project_id="web",
            correlation_id="chain-1",
            causation_id="cause-1",
        )
        with pytest.raises(InvalidArgument) as info:
            await client.publish("a.b", timestamp=datetime(2026, 1, 1))
        assert info.value.field == "timestamp"
        # Not a UUID: sent as it is, for the server to name.
        with pytest.raises(InvalidArgument) as info:
            await client.publish("a.b", event_id="not-a-uuid")
        assert info.value.field == "event_id"
    finally:
        await client.close()
    first = stub.requests[0]
    assert first.event_id == event_id.lower()
    assert first.timestamp.ToDatetime(tzinfo=UTC) == when
    assert (first.project_id, first.correlation_id, first.causation_id) == (
        "web",
        "chain-1",
        "cause-1",
    )
    assert event.event_id == uuid.UUID(event_id)
    assert event.timestamp == when
    assert (event.project_id, event.causation_id) == ("web", "cause-1")
    assert [r.event_id for r in stub.requests[1:]] == ["not-a-uuid"]


async def test_publish_deadline_is_the_calls_own() -> None:
    # Nothing listens on port 1: repeated until the call's own timeout.
    client = AsyncClient("127.0.0.1:1", "key", timeout=60)
    try:
        with pytest.raises(Unavailable):
            await client.publish("a.b", timeout=0.3)
    finally:
        await client.close()


async def test_a_budget_spent_repeating_a_refused_call_says_why_it_was_refused() -> None:
    # Refused, then the repeat still connecting when the call's deadline passes.
    stub = FakeEventStub(
        unavailable(), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    )
    client = with_stub(stub)
    try:
        with pytest.raises(Unavailable):
            await client.publish("a.b", timeout=5)
    finally:
        await client.close()
    assert len(stub.requests) == 2
    # A deadline with nothing refused before it is the deadline.
    stub = FakeEventStub(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    client = with_stub(stub)
    try:
        with pytest.raises(JobplaneError) as raised:
            await client.publish("a.b", timeout=5)
    finally:
        await client.close()
    assert not isinstance(raised.value, Unavailable)
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_sync_publish_returns_the_event() -> None:
    stub = FakeEventStub(unavailable())
    with Client("127.0.0.1:1", "key") as client:
        client._loop.run(_install(client._async, stub))
        event = client.publish("artifact.created", {"n": 1}, project_id="p")
    assert (event.event_type, event.payload, event.project_id) == (
        "artifact.created",
        {"n": 1},
        "p",
    )
    assert len({r.event_id for r in stub.requests}) == 1


async def _install(client: AsyncClient, stub: FakeEventStub) -> None:
    client._get_channel()
    client._event_stub = stub  # type: ignore[assignment]


# -- jobplane events ---------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="jobplane")
    cli.register(root.add_subparsers(dest="command", required=True))
    return root


def test_events_publish_arguments() -> None:
    args = parser().parse_args(
        [
            "events",
            "publish",
            "artifact.created",
            "--payload",
            '{"a": 1}',
            "--id",
            "0193a2e5-0000-7000-8000-00000000000a",
            "--correlation-id",
            "c",
            "--causation-id",
            "d",
            "--project",
            "web",
            "--json",
        ]
    )
    assert callable(args.func)
    assert (args.event_type, args.payload, args.event_id) == (
        "artifact.created",
        '{"a": 1}',
        "0193a2e5-0000-7000-8000-00000000000a",
    )
    assert (args.correlation_id, args.causation_id, args.project_id, args.json) == (
        "c",
        "d",
        "web",
        True,
    )
    args = parser().parse_args(["events", "publish", "a.b"])
    assert (args.payload, args.payload_file, args.event_id, args.correlation_id) == (
        None,
        None,
        None,
        None,
    )
    with pytest.raises(SystemExit):
        parser().parse_args(["events", "publish", "a.b", "--payload", "{}", "--payload-file", "f"])
    with pytest.raises(SystemExit):
        parser().parse_args(["events", "publish"])


def test_events_tail_arguments() -> None:
    args = parser().parse_args(["events", "tail", "job.*", "artifact.#"])
    assert (args.patterns, args.after, args.start, args.json) == (
        ["job.*", "artifact.#"],
        None,
        "latest",
        False,
    )
    assert parser().parse_args(["events", "tail", "#", "--from-start"]).start == "earliest"
    assert parser().parse_args(["events", "tail", "#", "--latest"]).start == "latest"
    args = parser().parse_args(["events", "tail", "#", "--after", "CUR", "--json"])
    assert (args.after, args.json) == ("CUR", True)
    for bad in (
        ["events", "tail"],
        ["events", "tail", "#", "--after", "c", "--from-start"],
        ["events", "tail", "#", "--from-start", "--latest"],
        ["events"],
    ):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)


def test_events_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JOBPLANE_API_KEY", raising=False)
    args = parser().parse_args(["events", "tail", "#", "--address", "127.0.0.1:1"])
    assert args.func(args) == 2
    assert "API key" in capsys.readouterr().err

    args = parser().parse_args(["events", "publish", "a.b", "--api-key", "k", "--payload", "[]"])
    assert args.func(args) == 2
    assert capsys.readouterr().err == "error: --payload must be a JSON object, got an array\n"

    args = parser().parse_args(
        [
            *("events", "publish", "a.b", "--api-key", "k"),
            *("--address", "127.0.0.1:1", "--call-timeout", "0.3"),
        ]
    )
    assert args.func(args) == 1
    err = capsys.readouterr().err
    # Refused at once, or (on a loaded machine) not connected within the
    # 0.3 s deadline: either way one line naming the status.
    assert re.match(r"error: (UNAVAILABLE|DEADLINE_EXCEEDED): ", err), err
    assert err.count("\n") == 1


def test_event_lines_and_json() -> None:
    event = Event(
        event_id=uuid.UUID(int=7),
        event_type="artifact.created",
        timestamp=NOW,
        tenant_id=TENANT,
        project_id="web",
        correlation_id="chain",
        payload={"b": "\x1b[2Jcafé\u202e", "a": [1, 2]},
    )
    line = cli.domain_event_line(event)
    assert line == (
        "2026-11-30T12:00:00.123456Z  artifact.created  00000000-0000-0000-0000-000000000007  "
        '{"a":[1,2],"b":"\\u001b[2Jcaf\\u00e9\\u202e"}'
    )
    assert line.isprintable() and line.isascii()
    as_json = cli.subscribed_to_json(SubscribedEvent(event, "CUR"))
    assert as_json == {
        "event_id": "00000000-0000-0000-0000-000000000007",
        "event_type": "artifact.created",
        "timestamp": "2026-11-30T12:00:00.123456Z",
        "tenant_id": str(TENANT),
        "project_id": "web",
        "correlation_id": "chain",
        "causation_id": None,
        "payload": {"b": "\x1b[2Jcafé\u202e", "a": [1, 2]},
        "cursor": "CUR",
    }
    assert json.loads(json.dumps(as_json)) == as_json
    details = cli.domain_event_details(event)
    assert "project:" in details and "causation id" not in details
    assert details.splitlines()[0] == "event id:       00000000-0000-0000-0000-000000000007"
