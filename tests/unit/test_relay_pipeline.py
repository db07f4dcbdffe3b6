"""The relay's pipeline of batches (ADR-0030): how many are in flight, and when it waits."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from jobplane.store.listen import Subscription
from jobplane.store.outbox import OutboxKind, OutboxRow
from jobplane.topology import load_topology
from jobplane.workers import relay_record
from jobplane.workers.relay import Relay
from jobplane.workers.relay_record import Recorded

BATCH = 10


class _Link:
    def __init__(self) -> None:
        self.closed = False
        self.exchange = self.events = object()


class _Script:
    """Batches of the given sizes, each published in ``publish`` seconds; then the link closes."""

    def __init__(
        self,
        relay: Relay,
        link: _Link,
        sizes: list[int],
        *,
        fail: int = -1,
        slow: dict[int, float] | None = None,
    ) -> None:
        self.sizes = sizes
        self.slow = slow or {}
        self.link = link
        self.fail = fail
        self.running = 0
        self.most = 0
        self.started = 0
        self.waited_with: list[int] = []
        relay._relay_batch = self.batch  # type: ignore[method-assign,assignment]

        async def idle() -> float:
            return 0.0

        relay._idle_seconds = idle  # type: ignore[method-assign]

    async def batch(self, _exchange: Any, _events: Any, claimed: asyncio.Future[int] | None) -> int:
        index = self.started
        self.started += 1
        if index >= len(self.sizes):
            self.link.closed = True
            size = 0
        else:
            size = self.sizes[index]
        assert claimed is not None
        claimed.set_result(size)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(self.slow.get(index, 0.02))  # published, confirmed, marked
            if index == self.fail:
                raise ConnectionResetError("the batch failed")
        finally:
            self.running -= 1
        return size


class _Wakeup(Subscription):
    def __init__(self, script: _Script) -> None:
        super().__init__()
        self.script = script

    async def wait(self, timeout: float) -> None:
        self.script.waited_with.append(self.script.running)


def _relay(in_flight: int) -> Relay:
    url = "postgresql://unused@127.0.0.1:1/unused"
    return Relay(
        cast(AsyncEngine, None),
        url,
        "amqp://unused",
        load_topology(),
        batch_size=BATCH,
        in_flight=in_flight,
    )


async def test_full_batches_keep_the_window_full() -> None:
    relay, link = _relay(in_flight=3), _Link()
    script = _Script(relay, link, [BATCH] * 12)
    await relay._pipeline(link, _Wakeup(script))  # type: ignore[arg-type]
    assert script.most == 3
    # Every batch of the backlog, then one that found nothing and ended the burst.
    assert script.started == 13


class _Silent(_Wakeup):
    """No notification ever comes: only a batch's end or the poll wakes the relay."""

    async def wait(self, timeout: float) -> None:
        self.script.waited_with.append(self.script.running)
        await asyncio.sleep(timeout)


async def test_after_a_short_batch_the_next_claim_waits_for_news() -> None:
    relay, link = _relay(in_flight=4), _Link()
    relay._poll_seconds = 10.0  # no poll within the test: a batch's end must wake it
    script = _Script(relay, link, [3, 3, 3, 0])
    await relay._pipeline(link, _Silent(script))  # type: ignore[arg-type]
    # No claim while a short batch was in flight: each waited for the one before.
    assert script.most == 1
    assert script.waited_with[:3] == [1, 1, 1]


async def test_rows_committed_during_a_short_batch_are_claimed_at_once() -> None:
    relay, link = _relay(in_flight=4), _Link()
    script = _Script(relay, link, [3, 3, 3, 0])
    # Every wait finds a notification already there: the next claim overlaps.
    await relay._pipeline(link, _Wakeup(script))  # type: ignore[arg-type]
    assert script.most > 1


async def test_one_in_flight_is_one_batch_after_the_other() -> None:
    relay, link = _relay(in_flight=1), _Link()
    script = _Script(relay, link, [BATCH] * 5)
    await relay._pipeline(link, _Wakeup(script))  # type: ignore[arg-type]
    assert script.most == 1


async def test_a_failed_batch_ends_the_pipeline_with_its_error() -> None:
    relay, link = _relay(in_flight=4), _Link()
    script = _Script(relay, link, [BATCH] * 50, fail=2)
    with pytest.raises(ConnectionResetError):
        await relay._pipeline(link, _Wakeup(script))  # type: ignore[arg-type]
    # The others were stopped with it: nothing runs on.
    await asyncio.sleep(0.05)
    assert script.running == 0
    assert script.started < 50


async def test_an_empty_claim_beside_a_batch_in_flight_waits_for_news() -> None:
    relay, link = _relay(in_flight=4), _Link()
    relay._poll_seconds = 10.0
    # A full batch that takes a while, then nothing due: the relay must not
    # claim again and again while it runs.
    script = _Script(relay, link, [BATCH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], slow={0: 0.3})
    task = asyncio.create_task(relay._pipeline(link, _Silent(script)))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert script.started == 2  # the full batch, and the claim that found nothing
    link.closed = True
    await asyncio.wait_for(task, 5)


class _News(_Wakeup):
    """A notification is already there whenever the relay looks."""

    @property
    def woken(self) -> bool:
        return True


async def test_news_during_an_empty_claim_is_claimed_without_asking_when_rows_fall_due() -> None:
    relay, link = _relay(in_flight=4), _Link()
    script = _Script(relay, link, [0, 0, 0])
    asked = 0

    async def idle() -> float:
        nonlocal asked
        asked += 1
        return 0.0

    relay._idle_seconds = idle  # type: ignore[method-assign]
    await relay._pipeline(link, _News(script))  # type: ignore[arg-type]
    # Each empty claim was followed by the next at once: no statement between.
    assert script.started == 4
    assert asked == 0


def test_a_job_noted_unroutable_is_logged_once_its_record_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A logger not used before: a cached one would write past capture_logs.
    monkeypatch.setattr(relay_record, "log", structlog.get_logger("jobplane.relay.noted"))
    relay = _relay(1)
    job_id = uuid.uuid4()
    row = OutboxRow(uuid.uuid4(), OutboxKind.JOB_DISPATCH, uuid.uuid4(), "demo.echo", job_id=job_id)
    with capture_logs() as logs:
        relay._report(Recorded())
        relay._report(Recorded(unroutable=[row]))
    assert logs == [
        {
            "event": "job.waiting",
            "log_level": "warning",
            "job": f"jobs/{job_id}",
            "event_id": str(row.id),
            "code": "UNROUTABLE",
            "type": "demo.echo",
            "exchange": load_topology().exchange,
        }
    ]
