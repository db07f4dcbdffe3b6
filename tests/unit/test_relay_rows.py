"""Where the relay sends each outbox row of a batch, with what, and what it makes of
the broker's answer (the publish itself faked at relay_messages' seam)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.events.envelope import Event, encode
from jobplane.faults import FaultPoints
from jobplane.store.deployment import Deployment
from jobplane.store.outbox import OutboxKind, OutboxRow
from jobplane.topology import load_topology
from jobplane.workers import relay_outbox
from jobplane.workers.relay import Relay
from jobplane.workers.relay_messages import PublishFailed, Returned, Unpublishable
from jobplane.workers.relay_record import Fate
from tests.support.logs import module_lines

TENANT = uuid.uuid4()
TOPOLOGY = load_topology()


class _Exchange:
    def __init__(self, name: str) -> None:
        self.name = name


JOBS, EVENTS = _Exchange(TOPOLOGY.exchange), _Exchange(TOPOLOGY.events_exchange)


class _Broker:
    """What each publish was handed; a row's job id (or event type) may name its fate."""

    def __init__(self, fates: dict[str, BaseException | float]) -> None:
        self.fates = fates
        self.dispatches: list[tuple[str, Envelope, dict[str, str], float]] = []
        self.events: list[dict[str, Any]] = []

    async def _fate(self, key: str) -> None:
        fate = self.fates.get(key)
        if isinstance(fate, float):
            await asyncio.sleep(fate)
        elif fate is not None:
            raise fate

    async def publish_dispatch(
        self, exchange: _Exchange, envelope: Envelope, headers: Any, *, timeout: float
    ) -> None:
        self.dispatches.append((exchange.name, envelope, dict(headers), timeout))
        await self._fate(str(envelope.job_id))

    async def underlay(self, exchange: _Exchange) -> str:
        return f"channel of {exchange.name}"

    async def send_event(self, channel: str, exchange: str, *args: Any, **kwargs: Any) -> None:
        routing_key, event, body = args
        self.events.append(
            {"channel": channel, "exchange": exchange, "type": routing_key, "body": body, **kwargs}
        )
        assert event.event_type == routing_key
        await self._fate(routing_key)


def _faked(monkeypatch: pytest.MonkeyPatch, fates: dict[str, BaseException | float]) -> _Broker:
    broker = _Broker(fates)
    for name in ("publish_dispatch", "underlay", "send_event"):
        monkeypatch.setattr(relay_outbox, name, getattr(broker, name))
    return broker


FAULTS = FaultPoints()


def _relay(**kwargs: Any) -> Relay:
    relay = Relay(
        cast(AsyncEngine, None),
        "postgresql://unused@127.0.0.1:1/unused",
        "amqp://unused",
        TOPOLOGY,
        publish_timeout=2.5,
        faults=FAULTS,
        **kwargs,
    )
    relay._deployment = Deployment("deploy-1", "jobplane")
    return relay


def _dispatch(exchange: str | None = None, **kwargs: Any) -> OutboxRow:
    return OutboxRow(
        uuid.uuid4(),
        OutboxKind.JOB_DISPATCH,
        TENANT,
        "demo.echo",
        "corr-1",
        exchange=exchange,
        job_id=uuid.uuid4(),
        **kwargs,
    )


def _event(event_type: str, exchange: str | None = None, **kwargs: Any) -> OutboxRow:
    body = encode(Event.new(event_type, {"n": 1}, tenant_id=TENANT))
    values: dict[str, Any] = {"exchange": exchange, "body": body, **kwargs}
    return OutboxRow(uuid.uuid4(), OutboxKind.EVENT, TENANT, event_type, **values)


async def _outcomes(relay: Relay, rows: list[OutboxRow]) -> list[tuple[Fate, str | None]]:
    outcomes = await relay._publish_all(JOBS, EVENTS, rows)  # type: ignore[arg-type]
    assert [o.row for o in outcomes] == rows
    return [(o.fate, None if o.error is None else str(o.error)) for o in outcomes]


async def test_each_row_goes_to_its_kinds_exchange_unless_it_names_one_of_the_topologys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = _faked(monkeypatch, {})
    traced = {"traceparent": "00-aa-bb-01", "tracestate": "k=v"}
    rows = [
        _dispatch(),
        _dispatch(exchange=JOBS.name),
        _dispatch(exchange=EVENTS.name),
        _event("thing.done", headers=traced),
        _event("thing.sent", exchange=EVENTS.name),
        _event("thing.moved", exchange=JOBS.name),
    ]
    assert await _outcomes(_relay(), rows) == [(Fate.CONFIRMED, None)] * 6
    assert [(name, env.event_id, env.deployment) for name, env, _, _ in broker.dispatches] == [
        (JOBS.name, rows[0].id, "deploy-1"),
        (JOBS.name, rows[1].id, "deploy-1"),
        (EVENTS.name, rows[2].id, "deploy-1"),
    ]
    job = rows[0].job_id
    assert job is not None
    assert broker.dispatches[0][1] == Envelope(
        rows[0].id, job, TENANT, "demo.echo", "corr-1", deployment="deploy-1"
    )
    # No interceptor: no headers added; the relay's timeout.
    assert {(str(headers), timeout) for _, _, headers, timeout in broker.dispatches} == {
        ("{}", 2.5)
    }
    sent = [(e["channel"], e["exchange"], e["type"]) for e in broker.events]
    assert sent == [
        (f"channel of {EVENTS.name}", EVENTS.name, "thing.done"),
        (f"channel of {EVENTS.name}", EVENTS.name, "thing.sent"),
        (f"channel of {JOBS.name}", JOBS.name, "thing.moved"),
    ]
    first = broker.events[0]
    assert (first["body"], first["faults"]) == (rows[3].body, FAULTS)
    assert (first["traceparent"], first["tracestate"]) == ("00-aa-bb-01", "k=v")
    assert (broker.events[1]["traceparent"], broker.events[1]["tracestate"]) == (None, None)


async def test_a_relay_of_no_deployment_names_none_in_its_dispatches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = _faked(monkeypatch, {})
    relay = _relay()
    relay._deployment = None
    assert await _outcomes(relay, [_dispatch()]) == [(Fate.CONFIRMED, None)]
    assert broker.dispatches[0][1].deployment is None


async def test_a_row_the_broker_can_never_take_is_unpublishable_and_not_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = _faked(monkeypatch, {})
    rows = [
        _dispatch(exchange="elsewhere"),
        _event("thing.done", exchange="elsewhere"),
        _event("thing.done", body=None),
        _event("thing.done", body=b"{not json"),
    ]
    with module_lines(monkeypatch, relay_outbox, "jobplane.relay") as lines:
        outcomes = await _outcomes(_relay(), rows)
    assert outcomes[:3] == [
        (Fate.UNPUBLISHABLE, "its exchange 'elsewhere' is not one of the topology's"),
        (Fate.UNPUBLISHABLE, "its exchange 'elsewhere' is not one of the topology's"),
        (Fate.UNPUBLISHABLE, "an event row without a body"),
    ]
    fate, error = outcomes[3]
    assert fate is Fate.UNPUBLISHABLE
    assert error is not None and error.startswith("its body is not an event: not JSON")
    assert (broker.dispatches, broker.events, lines) == ([], [], [])


async def test_a_row_the_broker_did_not_take_is_failed_or_returned_and_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    returned, nacked, refused = _dispatch(), _dispatch(), _dispatch()
    slow = _event("thing.slow")
    _faked(
        monkeypatch,
        {
            str(returned.job_id): Returned("not confirmed: returned unroutable"),
            str(nacked.job_id): PublishFailed("not confirmed: Nack"),
            str(refused.job_id): Unpublishable("too long"),
            "thing.slow": 5.0,
        },
    )
    relay = _relay()
    relay._publish_timeout = 0.05
    rows = [returned, nacked, refused, slow, _dispatch()]
    with module_lines(monkeypatch, relay_outbox, "jobplane.relay") as lines:
        outcomes = await _outcomes(relay, rows)
    assert outcomes == [
        (Fate.RETURNED, "not confirmed: returned unroutable"),
        (Fate.FAILED, "not confirmed: Nack"),
        (Fate.UNPUBLISHABLE, "too long"),
        (Fate.FAILED, ""),  # no confirm within the publish timeout
        (Fate.CONFIRMED, None),
    ]
    assert [dict(line) for line in lines] == [
        {
            "event": "broker.publish.failed",
            "log_level": "warning",
            "event_id": str(row.id),
            "error": error,
        }
        for row, error in [
            (returned, "Returned('not confirmed: returned unroutable')"),
            (nacked, "PublishFailed('not confirmed: Nack')"),
            (slow, "TimeoutError()"),
        ]
    ]


async def test_a_cancelled_publish_cancels_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    row = _dispatch()
    _faked(monkeypatch, {str(row.job_id): asyncio.CancelledError()})
    with pytest.raises(asyncio.CancelledError):
        await _relay()._publish_all(JOBS, EVENTS, [_dispatch(), row])  # type: ignore[arg-type]


class _Tracing:
    """Adds a trace context to each dispatch it sees published."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []

    @contextlib.contextmanager
    def publish(self, headers: dict[str, str], **kwargs: Any) -> Iterator[dict[str, str]]:
        self.seen.append((headers, kwargs))
        yield {"traceparent": "00-new-01"}


async def test_an_interceptor_sees_each_dispatch_and_adds_its_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = _faked(monkeypatch, {})
    tracing = _Tracing()
    row = _dispatch(exchange=EVENTS.name, headers={"traceparent": "00-old-01"})
    relay = _relay(interceptors=[tracing])
    assert await _outcomes(relay, [row, _event("thing.done")]) == [(Fate.CONFIRMED, None)] * 2
    assert tracing.seen == [
        (
            {"traceparent": "00-old-01"},
            {
                "exchange": EVENTS.name,
                "routing_key": "demo.echo",
                "message_id": row.id,
                "job_id": row.job_id,
                "tenant_id": TENANT,
            },
        )
    ]
    assert broker.dispatches[0][2] == {"traceparent": "00-new-01"}
