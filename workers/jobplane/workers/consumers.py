"""The worker's consumers: subscribed through aiormq, kept across reconnects.

Each queue is consumed with ``basic.consume`` on the aiormq channel under a
robust aio-pika channel, with a callback that receives aiormq's
``DeliveredMessage`` and hands the worker a :class:`~jobplane.workers.inbound.Delivery`:
no aio-pika ``IncomingMessage`` and no task of aio-pika's for a delivery.
aio-pika still owns the connection and the channels: it reconnects, reopens
each channel and restores its prefetch and its queue (declared passively).
What it no longer knows of are these consumers, so they are restored here:

- when a channel reopens (after a lost connection, or a channel the broker
  closed), each of its consumers is subscribed again, with its tag, on the
  new aiormq channel (``reopen_callbacks``);
- when the broker cancels a consumer (its queue deleted, its node gone), the
  consumer is subscribed again once a passive declare on a channel of its
  own finds the queue, retried with a growing pause, as aio-pika does for
  the consumers it knows.

A consumer cancelled by :meth:`Consumers.cancel` is never restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiormq
import structlog
from aio_pika.abc import AbstractConnection, AbstractRobustChannel
from aiormq.abc import DeliveredMessage

from jobplane.topology import QueueSpec
from jobplane.workers.inbound import Delivery, nack, settle_lock
from jobplane.workers.priority import Slots

log = structlog.get_logger("jobplane.worker")

#: The longest pause between two tries to restore a cancelled consumer, seconds.
MAX_RETRY = 5.0


@dataclass(eq=False)
class Consumer:
    """One queue consumed on one channel, under one tag."""

    channel: AbstractRobustChannel
    queue: str
    tag: str
    #: The priority class of the queue's deliveries.
    priority: str


class Consumers:
    """The worker's consumers; each delivery goes to ``on_delivery`` as a :class:`Delivery`."""

    def __init__(self, on_delivery: Callable[[Delivery], Any]) -> None:
        self._on_delivery = on_delivery
        self._consumers: dict[str, Consumer] = {}
        self._channels: list[AbstractRobustChannel] = []
        self._restoring: dict[str, asyncio.Task[None]] = {}
        #: Set by :meth:`cancel`: nothing is subscribed (again) from then on.
        self._closed = False
        self._stopping = asyncio.Event()

    def __bool__(self) -> bool:
        """Whether anything is consumed."""
        return bool(self._consumers)

    @property
    def tags(self) -> dict[str, str]:
        """The queue of each consumer, by tag."""
        return {tag: c.queue for tag, c in self._consumers.items()}

    async def start(
        self,
        connection: AbstractConnection,
        queues: Sequence[QueueSpec],
        slots: Slots,
        *,
        prefetch: int | None = None,
    ) -> None:
        """Consume ``queues``, each with its class's prefetch (or ``prefetch`` for all).

        A per-consumer prefetch is restored on reconnect only as its channel's
        last ``basic.qos``: queues of one prefetch share a channel, one channel
        for each. On an error the consumers started so far stay (the caller
        cancels them).
        """
        # Started again after a cancel (a worker's start that failed, retried).
        self._closed = False
        self._stopping = asyncio.Event()
        channels: dict[int, AbstractRobustChannel] = {}
        for spec in queues:
            count = prefetch if prefetch is not None else slots.prefetch(spec.priority)
            channel = channels.get(count)
            if channel is None:
                opened: Any = await connection.channel()
                channel = channels[count] = opened
                self._channels.append(channel)
                channel.reopen_callbacks.add(self._reopened)
                await channel.set_qos(prefetch_count=count)
            # Passive: the robust channel restores it passively on reconnect too.
            await channel.get_queue(spec.name)
            consumer = Consumer(
                channel, spec.name, f"jobplane.{uuid.uuid4().hex}", slots.class_of(spec.priority)
            )
            self._consumers[consumer.tag] = consumer
            await self._subscribe(consumer)

    async def cancel(self) -> None:
        """Stop consuming (deliveries already received are the caller's to settle).

        A restore in progress is not cancelled: cancelled inside an RPC,
        aiormq closes the channel (504), and with it the acks of the handlers
        still running. It is woken, sees the flag and ends; one already in
        ``basic.consume`` registered its tag first, so it is cancelled below.
        """
        self._closed = True
        self._stopping.set()
        consumers = list(self._consumers.values())
        self._consumers.clear()
        restoring = list(self._restoring.values())
        if restoring:
            await asyncio.wait(restoring, timeout=MAX_RETRY)
        for consumer in consumers:
            with contextlib.suppress(Exception):
                raw = await _underlay(consumer.channel)
                if consumer.tag in raw.consumers and not raw.is_closed:
                    await raw.basic_cancel(consumer.tag)
        for channel in self._channels:
            callbacks: Any = channel.reopen_callbacks
            callbacks.discard(self._reopened)
        self._channels.clear()

    async def _subscribe(self, consumer: Consumer) -> None:
        raw = await _underlay(consumer.channel)
        # Stopped meanwhile: subscribe nothing (checked with no await before
        # basic_consume, which registers the tag at once for cancel to find).
        if self._closed or self._consumers.get(consumer.tag) is not consumer:
            return
        if consumer.tag in raw.consumers:
            return
        raw.on_consumer_cancel_callbacks.add(self._cancelled)
        await raw.basic_consume(
            consumer.queue, partial(self._deliver, consumer), consumer_tag=consumer.tag
        )

    async def _deliver(self, consumer: Consumer, message: DeliveredMessage) -> None:
        # A coroutine: aiormq runs it in a task of its own without a wrapper.
        delivery: Delivery | None = None
        try:
            delivery = Delivery(message, consumer.queue, consumer.priority)
            self._on_delivery(delivery)
        except Exception as exc:
            # Unsettled, it would hold a prefetch slot for the channel's life.
            log.error("broker.delivery.failed", queue=consumer.queue, error=str(exc), exc_info=exc)
            try:
                if delivery is not None:
                    await delivery.nack(requeue=True)
                else:
                    tag: Any = message.delivery
                    raw: Any = message.channel
                    async with settle_lock(raw):
                        await nack(raw, tag.delivery_tag, requeue=True)
            except Exception as nack_exc:
                log.warning("job.message.settle_failed", error=str(nack_exc))

    async def _reopened(self, channel: AbstractRobustChannel) -> None:
        """``channel`` reopened (its prefetch and queues restored): consume again."""
        for consumer in [c for c in self._consumers.values() if c.channel is channel]:
            try:
                await self._subscribe(consumer)
            except Exception as exc:
                log.warning("broker.consumer.restore_failed", queue=consumer.queue, error=str(exc))
                self._restore_later(consumer.tag)

    def _cancelled(self, frame: aiormq.spec.Basic.Cancel) -> None:
        """The broker cancelled a consumer: restore it once its queue is there."""
        tag = frame.consumer_tag or ""
        if tag in self._consumers:
            log.warning("broker.consumer.cancelled", queue=self._consumers[tag].queue)
            self._restore_later(tag)

    def _restore_later(self, tag: str) -> None:
        if not self._closed and tag not in self._restoring:
            task = asyncio.create_task(self._restore(tag))
            self._restoring[tag] = task
            task.add_done_callback(lambda _: self._restoring.pop(tag, None))

    async def _restore(self, tag: str) -> None:
        pause = 0.5
        while (consumer := self._consumers.get(tag)) is not None:
            # A pause that cancel() ends early, instead of cancelling the task.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause)
            if self._closed:
                return
            try:
                raw = await _underlay(consumer.channel)
                if raw.is_closed:
                    # The channel's reopening subscribes it; look again later.
                    pause = min(pause * 2, MAX_RETRY)
                    continue
                # Consuming a missing queue would close the channel: look first.
                probe = await raw.connection.channel(publisher_confirms=False, timeout=5)
                try:
                    await probe.queue_declare(consumer.queue, passive=True, timeout=5)
                finally:
                    with contextlib.suppress(Exception):
                        await probe.close()
                await self._subscribe(consumer)
            except Exception as exc:
                log.warning("broker.consumer.restore_failed", queue=consumer.queue, error=str(exc))
                pause = min(pause * 2, MAX_RETRY)
            else:
                if not self._closed:
                    log.info("broker.consumer.restored", queue=consumer.queue)
                return


async def _underlay(channel: AbstractRobustChannel) -> aiormq.Channel:
    """The aiormq channel under ``channel`` now (another after each reopening)."""
    raw = await channel.get_underlay_channel()
    if not isinstance(raw, aiormq.Channel):
        raise TypeError(f"an aiormq channel was expected, not {type(raw).__name__}")
    return raw
