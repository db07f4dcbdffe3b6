"""The worker's batched acks (ADR-0028, ADR-0055): what goes to the broker.

Deliveries of two channels arrive and end in any order, each committed (then
acked, with the others of its moment or alone), nacked, rejected, or still
running when the run ends; the acks of one moment are batched. The frames
written are decoded with pamqp and applied to a model of the broker's
outstanding deliveries: no ack ever settles a delivery whose outcome was not
committed before it was acked (a nacked or rejected one above all), no tag
is settled twice, every committed delivery is acked exactly once and every
nack and reject arrives.

Applied as written, each moment's acks of a channel go out in one write.
Through a bounded write queue that a slow writer drains (aiormq's holds ten
frames, and an ``asyncio.Queue`` lets a new writer overtake one waiting for
room), with moments that overlap, the frames must still reach the broker in
an order it accepts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiormq
import pamqp.frame
import pytest
from aiormq.abc import ChannelFrame, DeliveredMessage
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp.header import ContentHeader

from jobplane.workers.group import Acks
from jobplane.workers.inbound import Delivery, ack_frame, write_acks
from jobplane.workers.interceptors import Delivered

#: How a job ends: committed and acked with its moment's group, committed and
#: acked alone, nacked (its handler failed), rejected (a poison message).
GROUP, ALONE, NACK, REJECT = "group", "alone", "nack", "reject"


class Broker:
    """A channel's outstanding deliveries, as the broker keeps them."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.acked: list[int] = []
        self.refused: list[int] = []

    def apply(self, frame: object, committed: set[int]) -> None:
        if isinstance(frame, aiormq.spec.Basic.Ack):
            tag = frame.delivery_tag
            assert tag in self.outstanding, f"ack of {tag}: not outstanding (settled already?)"
            covered = {t for t in self.outstanding if t <= tag} if frame.multiple else {tag}
            uncommitted = covered - committed
            assert not uncommitted, f"acked before their commit: {sorted(uncommitted)}"
            self.outstanding -= covered
            self.acked += covered
        else:
            assert isinstance(frame, (aiormq.spec.Basic.Nack, aiormq.spec.Basic.Reject))
            refused = frame.delivery_tag
            assert refused in self.outstanding, f"nack of {refused}: not outstanding"
            self.outstanding.discard(refused)
            self.refused.append(refused)


@dataclass(eq=False)
class Channel:
    """What Delivery and write_acks use of an aiormq channel.

    Without ``bound`` every write is decoded and applied to the broker's
    model at once; with it, writes go to a real ``asyncio.Queue`` of that
    size, which :meth:`writer` drains, each write ``delay`` loop turns apart.
    """

    number: int
    bound: int | None = None
    delay: int = 0
    committed: set[int] = field(default_factory=set)
    broker: Broker = field(default_factory=Broker)
    #: The payloads written, each one write.
    writes: list[bytes] = field(default_factory=list)
    is_closed: bool = False
    #: The broker's objection to a frame the writer drained (it drains on).
    error: AssertionError | None = None

    def __post_init__(self) -> None:
        self.write_queue: Channel | asyncio.Queue[ChannelFrame | None] = (
            self if self.bound is None else asyncio.Queue(maxsize=self.bound)
        )

    async def put(self, frame: ChannelFrame) -> None:
        self.apply(frame)

    def full(self) -> bool:
        return False

    def put_nowait(self, frame: ChannelFrame) -> None:
        self.apply(frame)

    def apply(self, frame: ChannelFrame) -> None:
        self.writes.append(frame.payload)
        data = frame.payload
        while data:
            used, channel, decoded = pamqp.frame.unmarshal(data)
            assert channel == self.number
            self.broker.apply(decoded, self.committed)
            data = data[used:]

    async def writer(self) -> None:
        """Drain the bounded write queue, as aiormq's connection writer does, slowly."""
        assert isinstance(self.write_queue, asyncio.Queue)
        while (frame := await self.write_queue.get()) is not None:
            for _ in range(self.delay):
                await asyncio.sleep(0)
            if self.error is None:
                try:
                    self.apply(frame)
                except AssertionError as exc:
                    self.error = exc

    async def _write(self, frame: object) -> None:
        await self.write_queue.put(ChannelFrame.marshall(self.number, [frame]))  # type: ignore[list-item]

    async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
        await self._write(aiormq.spec.Basic.Ack(tag, multiple))

    async def basic_nack(self, tag: int, requeue: bool = True, wait: bool = True) -> None:
        await self._write(aiormq.spec.Basic.Nack(tag, requeue=requeue))

    async def basic_reject(self, tag: int, *, requeue: bool = True, wait: bool = True) -> None:
        await self._write(aiormq.spec.Basic.Reject(tag, requeue=requeue))


def _delivery(channel: Channel, tag: int) -> Delivery:
    deliver = aiormq.spec.Basic.Deliver("ctag", tag, False, "jobs", "q")
    message = DeliveredMessage(deliver, ContentHeader(), b"{}", channel)  # type: ignore[arg-type]
    return Delivery(message, "q", "normal")


@dataclass
class Job:
    channel: int
    #: The moment it arrives and the moment it ends (None: still running at the end).
    arrives: int
    ends: int | None
    #: How it ends (GROUP, ALONE, NACK or REJECT).
    outcome: str


@st.composite
def _runs(draw: st.DrawFn) -> list[Job]:
    jobs = []
    arrives = 0
    for _ in range(draw(st.integers(min_value=1, max_value=40))):
        arrives += draw(st.integers(min_value=0, max_value=2))
        ends = draw(st.none() | st.integers(min_value=arrives, max_value=arrives + 6))
        outcome = draw(st.sampled_from([GROUP, GROUP, ALONE, NACK, REJECT]))
        jobs.append(Job(draw(st.sampled_from([1, 2])), arrives, ends, outcome))
    return jobs


async def _end(acks: Acks, job: Job, delivery: Delivery) -> None:
    """The end of a job's handler: its settling, then its task's end."""
    if job.outcome == GROUP:
        await acks.ack(delivery)
    elif job.outcome == ALONE:
        await delivery.ack()
    elif job.outcome == NACK:
        await delivery.nack(requeue=True)
    else:
        await delivery.reject(requeue=False)
    acks.forget(delivery)


async def _run(
    jobs: list[Job], *, bound: int | None = None, delay: int = 0, turns: int = 0
) -> dict[int, Channel]:
    """Run ``jobs``; with ``bound``, through bounded write queues, each moment
    ``turns`` loop turns after the last (its settling may still wait)."""
    channels = {n: Channel(n, bound, delay) for n in (1, 2)}
    writers = [asyncio.create_task(c.writer()) for c in channels.values() if bound is not None]
    acks = Acks()
    tags = dict.fromkeys(channels, 0)
    deliveries: list[Delivery] = []
    for job in jobs:
        tags[job.channel] += 1
        deliveries.append(_delivery(channels[job.channel], tags[job.channel]))
        channels[job.channel].broker.outstanding.add(tags[job.channel])
    last = max(max(j.arrives, j.ends or 0) for j in jobs)
    ending: list[asyncio.Task[None]] = []
    for moment in range(last + 1):
        for job, delivery in zip(jobs, deliveries, strict=True):
            if job.arrives == moment:
                acks.delivered(delivery)  # in delivery order, as the consumer callback
        started = len(ending)
        for job, delivery in zip(jobs, deliveries, strict=True):
            if job.ends == moment:
                if job.outcome in (GROUP, ALONE):
                    channels[job.channel].committed.add(delivery.delivery_tag)
                ending.append(asyncio.create_task(_end(acks, job, delivery)))
        if bound is not None:
            for _ in range(turns):
                await asyncio.sleep(0)
            continue
        writes = {n: len(c.writes) for n, c in channels.items()}
        await asyncio.gather(*ending[started:])
        for n, channel in channels.items():
            alone = sum(
                1 for j in jobs if j.ends == moment and j.outcome != GROUP and j.channel == n
            )
            assert len(channel.writes) - writes[n] <= 1 + alone, "a moment's acks in one write"
    await asyncio.gather(*ending)
    await acks.stop()
    for channel in channels.values():
        if isinstance(channel.write_queue, asyncio.Queue):
            await channel.write_queue.put(None)
    await asyncio.gather(*writers)
    for channel in channels.values():
        if channel.error is not None:
            raise channel.error
    return channels


def _check(jobs: list[Job], channels: dict[int, Channel]) -> None:
    """Every committed delivery acked once; every nack and reject arrived."""
    for n, channel in channels.items():
        assert sorted(channel.broker.acked) == sorted(channel.committed)
        ours = [j for j in jobs if j.channel == n]
        refused = [
            tag
            for tag, j in enumerate(ours, 1)
            if j.ends is not None and j.outcome in (NACK, REJECT)
        ]
        assert sorted(channel.broker.refused) == refused


@settings(deadline=None)
@given(_runs())
def test_acks_cover_only_committed_deliveries_and_each_once(jobs: list[Job]) -> None:
    _check(jobs, asyncio.run(_run(jobs)))


@settings(deadline=None, max_examples=300)
@given(
    _runs(),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=0, max_value=4),
)
def test_settling_through_a_full_write_queue_keeps_an_order_the_broker_accepts(
    jobs: list[Job], bound: int, delay: int, turns: int
) -> None:
    _check(jobs, asyncio.run(_run(jobs, bound=bound, delay=delay, turns=turns)))


# Runs the old order of marking and writing got wrong, as the search found them.
_OVERTAKEN = {
    # Tag 3's nack waits for room; the group of 4 that follows is not to
    # ack 4 with multiple (covering 3) ahead of it.
    "nack": (
        [Job(1, 0, 2, ALONE), Job(1, 0, 1, GROUP), Job(1, 1, 3, NACK), Job(1, 1, 1, GROUP)],
        0,
        0,
    ),
    "reject": (
        [
            Job(1, 1, 3, ALONE),
            Job(1, 1, 2, GROUP),
            Job(1, 2, 3, GROUP),
            Job(1, 2, 3, REJECT),
            Job(1, 3, 3, GROUP),
        ],
        0,
        0,
    ),
    # Tag 3's single ack waits for room; a multiple ack is not to cover it first.
    "ack": (
        [Job(1, 1, 4, GROUP), Job(1, 2, 3, GROUP), Job(1, 2, 5, ALONE), Job(1, 3, 4, GROUP)],
        2,
        1,
    ),
}


@pytest.mark.parametrize("waiting", sorted(_OVERTAKEN))
def test_a_settling_waiting_for_room_is_not_overtaken(waiting: str) -> None:
    jobs, delay, turns = _OVERTAKEN[waiting]
    _check(jobs, asyncio.run(_run(jobs, bound=1, delay=delay, turns=turns)))


def test_in_order_ends_go_as_one_multiple_ack() -> None:
    jobs = [Job(1, 0, 1, GROUP) for _ in range(5)]
    channels = asyncio.run(_run(jobs))
    assert len(channels[1].writes) == 1
    assert channels[1].writes[0] == ack_frame(1, 5, multiple=True)


def test_one_delivery_of_a_moment_is_acked_alone() -> None:
    # One to ack: a plain ack, as the broker sees most (multiple=False).
    channels = asyncio.run(_run([Job(1, 0, 1, GROUP)]))
    assert channels[1].writes == [ack_frame(1, 1)]


def test_acks_around_a_running_delivery_go_in_one_write_and_spare_it() -> None:
    # Tag 3 still runs: 1-2 as one multiple ack, 4 and 5 alone, in one write.
    jobs = [Job(1, 0, None if i == 2 else 1, GROUP) for i in range(5)]
    channels = asyncio.run(_run(jobs))
    assert channels[1].writes == [
        ack_frame(1, 2, multiple=True) + ack_frame(1, 4) + ack_frame(1, 5)
    ]
    assert channels[1].broker.outstanding == {3}


@pytest.mark.parametrize("multiple", [False, True])
@pytest.mark.parametrize("tag", [1, 255, 2**32 + 7, 2**63 - 1])
@pytest.mark.parametrize("number", [1, 2047])
def test_an_ack_frame_is_pamqps(number: int, tag: int, multiple: bool) -> None:
    spec = aiormq.spec.Basic.Ack(delivery_tag=tag, multiple=multiple)
    assert ack_frame(number, tag, multiple=multiple) == pamqp.frame.marshal(spec, number)


async def test_acks_on_a_closed_channel_raise_and_write_nothing() -> None:
    channel = Channel(1, is_closed=True)
    with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
        await write_acks(channel, 3, [5])  # type: ignore[arg-type]
    assert channel.writes == []


async def test_acks_after_aiormq_answered_the_brokers_close_raise_and_write_nothing() -> None:
    # A real aiormq channel of a connection never opened: the broker's
    # channel.close arrives, aiormq queues close-ok, and the channel is not
    # is_closed yet for a few loop turns. An ack queued then would follow the
    # close-ok: a method on a closed channel, which closes the connection.
    connection = aiormq.Connection("amqp://guest:guest@127.0.0.1/")
    connection.connection_tune = aiormq.spec.Connection.Tune(frame_max=131072)
    channel = aiormq.Channel(connection, 1, publisher_confirms=False)
    close = aiormq.spec.Channel.Close(reply_code=406, reply_text="PRECONDITION_FAILED")
    await channel.frames.put((0, close))
    for _ in range(100):
        if not connection.write_queue.empty():
            break
        await asyncio.sleep(0)
    close_ok = connection.write_queue.get_nowait()
    assert pamqp.frame.unmarshal(close_ok.payload)[2].name == "Channel.CloseOk"
    assert not channel.is_closed
    with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
        await write_acks(channel, 3, [5])
    assert connection.write_queue.empty()
    for _ in range(100):
        if channel.is_closed:
            break
        await asyncio.sleep(0)
    assert channel.is_closed


def test_a_delivery_reads_what_an_interceptor_may_ask_of_it() -> None:
    deliver = aiormq.spec.Basic.Deliver("ctag", 9, True, "jobs", "q.key")
    properties = aiormq.spec.Basic.Properties(correlation_id="c-1", message_id="m-1")
    header = ContentHeader(body_size=2, properties=properties)
    message = DeliveredMessage(deliver, header, b"{}", Channel(1))  # type: ignore[arg-type]
    delivered: Delivered = Delivery(message, "q", "normal")
    assert (delivered.body, delivered.delivery_tag, delivered.exchange) == (b"{}", 9, "jobs")
    assert (delivered.correlation_id, delivered.message_id) == ("c-1", "m-1")
    assert (delivered.routing_key, delivered.redelivered) == ("q.key", True)


async def test_a_settle_waiting_for_room_on_a_dead_writer_ends_when_its_channel_closes() -> None:
    """A write queue nobody drains (its connection's writer died while it was
    full): a settle waiting for room must give up once the channel closes,
    and so must the settles queued behind it on the channel's lock, instead
    of holding the lock, and their handlers' slots, forever."""
    channel = Channel(1, bound=1)
    assert isinstance(channel.write_queue, asyncio.Queue)
    channel.write_queue.put_nowait(None)  # full, and nothing takes from it
    first, second = _delivery(channel, 1), _delivery(channel, 2)
    waiting = [
        asyncio.ensure_future(first.ack()),
        asyncio.ensure_future(second.nack(requeue=True)),
    ]
    await asyncio.sleep(0.02)
    assert not any(task.done() for task in waiting)
    channel.is_closed = True
    done, pending = await asyncio.wait(waiting, timeout=1)
    assert not pending, "a settle still waits on a closed channel"
    for task in done:
        assert isinstance(task.exception(), aiormq.exceptions.ChannelInvalidStateError)
    assert channel.write_queue.qsize() == 1


async def test_a_nack_and_a_reject_carry_the_requeue_asked_for_once() -> None:
    channel = Channel(1, committed={5})
    asked = [
        ("nack", {}),
        ("nack", {"requeue": False}),
        ("reject", {}),
        ("reject", {"requeue": True}),
        ("ack", {}),
    ]
    for tag, (how, kwargs) in enumerate(asked, start=1):
        channel.broker.outstanding.add(tag)
        delivery = _delivery(channel, tag)
        await getattr(delivery, how)(**kwargs)
        assert delivery.processed
        # Settled: a second settling of any kind writes nothing.
        await delivery.nack(requeue=True)
        await delivery.reject(requeue=False)
        await delivery.ack()
    frames: list[Any] = [pamqp.frame.unmarshal(write)[2] for write in channel.writes]
    assert [(type(f).__name__, f.delivery_tag, getattr(f, "requeue", None)) for f in frames] == [
        ("Nack", 1, True),
        ("Nack", 2, False),
        ("Reject", 3, False),
        ("Reject", 4, True),
        ("Ack", 5, None),
    ]
    assert all(not getattr(f, "multiple", False) for f in frames)
