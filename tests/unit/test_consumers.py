"""The worker's consumers (ADR-0055) once stopped: nothing subscribed again,
no channel closed under the handlers still in their grace period.

Fakes of the robust channel and of aiormq's channel record each
``basic.consume`` and ``basic.cancel``; one of them holds ``basic.consume``
open, as a broker that has not answered yet.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq
import pamqp.commands
import pamqp.frame
import pytest
import structlog
from aiormq.abc import ChannelFrame, DeliveredMessage
from pamqp.header import ContentHeader
from structlog.testing import capture_logs

from jobplane.topology import QueueSpec
from jobplane.workers import consumers as consumers_module
from jobplane.workers.consumers import Consumers


class Raw(aiormq.Channel):
    """What the consumers use of an aiormq channel (no connection under it)."""

    def __init__(self) -> None:  # aiormq's would open a channel
        self.consumers: dict[str, Any] = {}
        self.on_consumer_cancel_callbacks: set[Any] = set()
        self.consumed: list[str] = []
        self.cancelled: list[str] = []
        self.nacked: list[tuple[int, bool]] = []
        #: Set: basic.consume waits for it (the broker's consume-ok).
        self.answer: asyncio.Event | None = None
        #: True once a basic.consume was cancelled mid-RPC (aiormq closes the channel).
        self.closed_mid_rpc = False
        self.connection: Any = Probe()
        #: Loop turns basic.consume takes (the round trip to the broker).
        self.turns = 0

    @property
    def is_closed(self) -> bool:
        return self.closed_mid_rpc

    async def basic_consume(  # type: ignore[override]
        self, queue: str, callback: Any, consumer_tag: str
    ) -> None:
        self.consumers[consumer_tag] = callback
        self.consumed.append(consumer_tag)
        for _ in range(self.turns):
            await asyncio.sleep(0)
        if self.answer is not None:
            try:
                await self.answer.wait()
            except asyncio.CancelledError:
                self.closed_mid_rpc = True
                raise

    # The connection's write queue, as the settling writes use it (jobplane.workers.inbound).
    number = 1

    @property
    def write_queue(self) -> Raw:  # type: ignore[override]
        return self

    def full(self) -> bool:
        return False

    def put_nowait(self, frame: ChannelFrame) -> None:
        _, _, method = pamqp.frame.unmarshal(frame.payload)
        assert isinstance(method, pamqp.commands.Basic.Nack)
        self.nacked.append((method.delivery_tag, method.requeue))

    async def basic_cancel(self, consumer_tag: str) -> None:  # type: ignore[override]
        del self.consumers[consumer_tag]
        self.cancelled.append(consumer_tag)


class Probe:
    """The connection under a channel: its probe channel finds every queue.

    Records how each probe channel was opened, what it declared, and its closes.
    """

    def __init__(self) -> None:
        self.opened: list[dict[str, Any]] = []
        self.declared: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.closed = 0

    async def channel(self, **kwargs: Any) -> Probe:
        self.opened.append(kwargs)
        return self

    async def queue_declare(self, *args: Any, **kwargs: Any) -> None:
        self.declared.append((args, kwargs))

    async def close(self) -> None:
        self.closed += 1


class Robust:
    """A robust channel: its aiormq channel now, and its reopen callbacks."""

    def __init__(self, raw: Raw) -> None:
        self.raw = raw
        self.reopen_callbacks: set[Any] = set()

    async def get_underlay_channel(self) -> Raw:
        await asyncio.sleep(0)
        return self.raw

    async def set_qos(self, prefetch_count: int) -> None:
        pass

    async def get_queue(self, name: str) -> None:
        pass

    async def reopen(self, raw: Raw) -> None:
        """Reopened on ``raw``, as aio-pika calls back after a reconnect."""
        self.raw = raw
        for callback in list(self.reopen_callbacks):
            await callback(self)


class Connection:
    def __init__(self, channel: Robust) -> None:
        self._channel = channel

    async def channel(self) -> Robust:
        return self._channel


class Slots:
    def class_of(self, priority: str) -> str:
        return priority


def _taken(_: object) -> None:
    pass


def _refused(_: object) -> None:
    raise RuntimeError("no room")


async def _started(robust: Robust, queues: int = 3, on_delivery: Any = _taken) -> Consumers:
    consumers = Consumers(on_delivery)
    specs = [QueueSpec(f"q{i}", ("x",)) for i in range(queues)]
    await consumers.start(Connection(robust), specs, Slots(), prefetch=8)  # type: ignore[arg-type]
    return consumers


async def test_a_channel_reopening_while_stopping_subscribes_nothing() -> None:
    robust = Robust(Raw())
    consumers = await _started(robust)
    assert len(robust.raw.consumers) == 3
    reopened = Raw()
    reopened.turns = 5
    reopening = asyncio.create_task(robust.reopen(reopened))
    await asyncio.sleep(0)  # the first consumer's subscribe is under way
    await consumers.cancel()
    await reopening
    assert reopened.consumers == {}, "subscribed after stop"


async def test_stopping_lets_a_restore_finish_its_consume_and_cancels_that_consumer() -> None:
    robust = Robust(Raw())
    consumers = await _started(robust, queues=1)
    (tag,) = consumers.tags
    raw = robust.raw
    del raw.consumers[tag]  # the broker cancelled it (its queue deleted)
    raw.answer = asyncio.Event()
    (cancelled,) = raw.on_consumer_cancel_callbacks
    cancelled(aiormq.spec.Basic.Cancel(consumer_tag=tag))
    for _ in range(200):  # the restore's first pause, then its consume
        if raw.consumed.count(tag) == 2:
            break
        await asyncio.sleep(0.01)
    assert raw.consumed.count(tag) == 2, "the restore did not consume again"
    stopping = asyncio.create_task(consumers.cancel())
    await asyncio.sleep(0.05)
    assert not raw.closed_mid_rpc, "the restore was cancelled in its basic.consume"
    raw.answer.set()
    await asyncio.wait_for(stopping, timeout=5)
    assert not raw.closed_mid_rpc
    assert raw.cancelled == [tag] and raw.consumers == {}


async def test_a_delivery_the_worker_could_not_take_is_nacked_back_to_its_queue() -> None:
    robust = Robust(Raw())
    consumers = await _started(robust, queues=1, on_delivery=_refused)
    (tag,) = consumers.tags
    deliver = aiormq.spec.Basic.Deliver(tag, 7, False, "jobs", "q0")
    message = DeliveredMessage(deliver, ContentHeader(), b"{}", robust.raw)
    await robust.raw.consumers[tag](message)
    assert robust.raw.nacked == [(7, True)]


class Refusing(Raw):
    """A channel whose connection went away: no settling frame can be written."""

    def put_nowait(self, frame: ChannelFrame) -> None:
        raise ConnectionResetError("connection reset by peer")


async def test_a_nack_that_cannot_be_written_is_logged_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumers_module, "log", structlog.get_logger("jobplane.worker"))
    robust = Robust(Refusing())
    consumers = await _started(robust, queues=1, on_delivery=_refused)
    (tag,) = consumers.tags
    deliver = aiormq.spec.Basic.Deliver(tag, 7, False, "jobs", "q0")
    message = DeliveredMessage(deliver, ContentHeader(), b"{}", robust.raw)
    with capture_logs() as lines:
        await robust.raw.consumers[tag](message)
    (line,) = [entry for entry in lines if entry["event"] == "job.message.settle_failed"]
    assert line["error"] == "connection reset by peer"


async def test_consumers_started_again_after_a_cancel_consume() -> None:
    """A worker whose start failed and was cancelled, then started again, consumes."""
    robust = Robust(Raw())
    consumers = await _started(robust, queues=2)
    await consumers.cancel()
    assert not robust.raw.consumers
    specs = [QueueSpec(f"q{i}", ("x",)) for i in range(2)]
    await consumers.start(Connection(robust), specs, Slots(), prefetch=8)  # type: ignore[arg-type]
    assert len(robust.raw.consumers) == 2
    assert consumers


async def test_a_restore_looks_for_its_queue_on_a_probe_channel_it_closes() -> None:
    """The probe declares passively on a channel of its own without publisher
    confirms (nothing is published on it), each step bounded in time."""
    robust = Robust(Raw())
    consumers = await _started(robust, queues=1)
    (tag,) = consumers.tags
    raw = robust.raw
    del raw.consumers[tag]  # the broker cancelled it (its queue deleted)
    (cancelled,) = raw.on_consumer_cancel_callbacks
    cancelled(aiormq.spec.Basic.Cancel(consumer_tag=tag))
    for _ in range(200):
        if raw.consumed.count(tag) == 2:
            break
        await asyncio.sleep(0.01)
    assert raw.consumed.count(tag) == 2, "the restore did not consume again"
    probe = raw.connection
    assert probe.opened == [{"publisher_confirms": False, "timeout": 5}]
    assert probe.declared == [(("q0",), {"passive": True, "timeout": 5})]
    assert probe.closed == 1
    await consumers.cancel()
