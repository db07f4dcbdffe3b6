"""The worker's batched acks (ADR-0028, ADR-0055): what goes to the broker.

Deliveries of two channels arrive and end in any order, each committed (then
acked), nacked, or still running when the run ends; the acks of one moment
are batched. The frames written are decoded with pamqp and applied to a model
of the broker's outstanding deliveries: no ack ever settles a delivery whose
outcome was not committed before it was acked, every committed delivery is
acked exactly once, and each moment's acks of a channel go out in one write.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiormq
import pamqp.frame
import pytest
from aiormq.abc import ChannelFrame, DeliveredMessage
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp.header import ContentHeader

from jobplane.workers.group import Acks
from jobplane.workers.inbound import Delivery, ack_frame, write_acks


class Broker:
    """A channel's outstanding deliveries, as the broker keeps them."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.acked: list[int] = []

    def apply(self, frame: object, committed: set[int]) -> None:
        if isinstance(frame, aiormq.spec.Basic.Ack):
            tag = frame.delivery_tag
            assert tag in self.outstanding, f"ack of {tag}: not outstanding (acked twice?)"
            covered = {t for t in self.outstanding if t <= tag} if frame.multiple else {tag}
            uncommitted = covered - committed
            assert not uncommitted, f"acked before their commit: {sorted(uncommitted)}"
            self.outstanding -= covered
            self.acked += covered
        else:
            assert isinstance(frame, (aiormq.spec.Basic.Nack, aiormq.spec.Basic.Reject))
            assert frame.delivery_tag in self.outstanding
            self.outstanding.discard(frame.delivery_tag)


@dataclass
class Channel:
    """What Delivery and write_acks use of an aiormq channel; every write is decoded
    and applied to the broker's model at once (in the order of the writes)."""

    number: int
    committed: set[int] = field(default_factory=set)
    broker: Broker = field(default_factory=Broker)
    #: The payloads written, each one write.
    writes: list[bytes] = field(default_factory=list)
    is_closed: bool = False

    def __post_init__(self) -> None:
        self.write_queue = self

    async def put(self, frame: ChannelFrame) -> None:
        self.writes.append(frame.payload)
        data = frame.payload
        while data:
            used, channel, decoded = pamqp.frame.unmarshal(data)
            assert channel == self.number
            self.broker.apply(decoded, self.committed)
            data = data[used:]

    async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
        await self.put(ChannelFrame.marshall(self.number, [aiormq.spec.Basic.Ack(tag, multiple)]))

    async def basic_nack(self, tag: int, requeue: bool = True, wait: bool = True) -> None:
        frame = aiormq.spec.Basic.Nack(tag, requeue=requeue)
        await self.put(ChannelFrame.marshall(self.number, [frame]))


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
    #: Committed (then acked), or nacked (a handler that failed before its outcome).
    committed: bool


@st.composite
def _runs(draw: st.DrawFn) -> list[Job]:
    jobs = []
    arrives = 0
    for _ in range(draw(st.integers(min_value=1, max_value=40))):
        arrives += draw(st.integers(min_value=0, max_value=2))
        ends = draw(st.none() | st.integers(min_value=arrives, max_value=arrives + 6))
        jobs.append(Job(draw(st.sampled_from([1, 2])), arrives, ends, draw(st.booleans())))
    return jobs


async def _run(jobs: list[Job]) -> dict[int, Channel]:
    channels = {n: Channel(n) for n in (1, 2)}
    acks = Acks()
    tags = dict.fromkeys(channels, 0)
    deliveries: list[Delivery] = []
    for job in jobs:
        tags[job.channel] += 1
        deliveries.append(_delivery(channels[job.channel], tags[job.channel]))
        channels[job.channel].broker.outstanding.add(tags[job.channel])
    last = max(max(j.arrives, j.ends or 0) for j in jobs)
    for moment in range(last + 1):
        for job, delivery in zip(jobs, deliveries, strict=True):
            if job.arrives == moment:
                acks.delivered(delivery)  # in delivery order, as the consumer callback
        ending: list[asyncio.Task[None]] = []
        for job, delivery in zip(jobs, deliveries, strict=True):
            if job.ends != moment:
                continue
            if job.committed:
                channels[job.channel].committed.add(delivery.delivery_tag)
                ending.append(asyncio.create_task(acks.ack(delivery)))
            else:
                ending.append(asyncio.create_task(delivery.nack(requeue=True)))
        writes = {n: len(c.writes) for n, c in channels.items()}
        await asyncio.gather(*ending)
        for n, channel in channels.items():
            nacked = sum(1 for j in jobs if j.ends == moment and not j.committed and j.channel == n)
            assert len(channel.writes) - writes[n] <= 1 + nacked, "a moment's acks in one write"
        for job, delivery in zip(jobs, deliveries, strict=True):
            if job.ends == moment:
                acks.forget(delivery)  # the handler's task ends
    await acks.stop()
    return channels


@settings(deadline=None)
@given(_runs())
def test_acks_cover_only_committed_deliveries_and_each_once(jobs: list[Job]) -> None:
    channels = asyncio.run(_run(jobs))
    for channel in channels.values():
        assert sorted(channel.broker.acked) == sorted(channel.committed)


def test_in_order_ends_go_as_one_multiple_ack() -> None:
    jobs = [Job(1, 0, 1, True) for _ in range(5)]
    channels = asyncio.run(_run(jobs))
    assert len(channels[1].writes) == 1
    assert channels[1].writes[0] == ack_frame(1, 5, multiple=True)


def test_acks_around_a_running_delivery_go_in_one_write_and_spare_it() -> None:
    # Tag 3 still runs: 1-2 as one multiple ack, 4 and 5 alone, in one write.
    jobs = [Job(1, 0, None if i == 2 else 1, True) for i in range(5)]
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
