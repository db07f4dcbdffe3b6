"""A handler's task as the worker holds it: the first reason to stop it wins,
its waiter wakes at the end, the stop or the timeout, and its error is kept."""

from __future__ import annotations

import asyncio
import time

import pytest

from jobplane.workers.running import Running, StopCause


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_the_first_stop_is_the_cause_and_tells_the_context_once() -> None:
    told: list[str] = []
    running = Running(asyncio.create_task(_forever()), lambda: told.append("stop"))
    assert running.cause is None and running.error is None
    running.stop(StopCause.CANCEL_REQUESTED)
    running.stop(StopCause.SHUTDOWN)
    assert running.cause is StopCause.CANCEL_REQUESTED
    assert told == ["stop"]
    await running.ended_or_stopped(60)  # at once: it was stopped
    with pytest.raises(asyncio.CancelledError):
        await running.task
    assert running.error is None  # stopped: nothing raised by the handler


async def test_a_task_that_ended_is_not_stopped() -> None:
    told: list[str] = []

    async def fails() -> None:
        raise ValueError("bad input")

    running = Running(asyncio.create_task(fails()), lambda: told.append("stop"))
    await running.ended_or_stopped(60)
    assert running.task.done()
    assert isinstance(running.error, ValueError)
    running.stop(StopCause.TIMEOUT)
    assert (running.cause, told) == (None, [])


async def test_the_wait_ends_at_the_timeout_and_again_at_once_after_the_end() -> None:
    running = Running(asyncio.create_task(_forever()))
    assert running.error is None  # not done yet
    began = time.monotonic()
    await running.ended_or_stopped(0.05)
    assert time.monotonic() - began >= 0.04
    assert not running.task.done() and running.cause is None
    running.task.cancel()
    await asyncio.gather(running.task, return_exceptions=True)
    began = time.monotonic()
    await running.ended_or_stopped(60)
    assert time.monotonic() - began < 5
    assert running.error is None  # cancelled: no error


async def test_a_returned_task_has_no_error() -> None:
    async def returns() -> int:
        return 3

    running = Running(asyncio.create_task(returns()))
    await running.ended_or_stopped(60)
    assert running.error is None and running.task.result() == 3


async def test_a_stop_wakes_the_waiter_even_while_the_handler_goes_on() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        # What a handler that swallows its cancellation (or runs in a thread) does.
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()

    running = Running(asyncio.create_task(stubborn()))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(running.ended_or_stopped(60))
    await asyncio.sleep(0)
    running.stop(StopCause.LEASE_LOST)
    await asyncio.wait_for(waiter, 5)
    assert not running.task.done()
    release.set()
    await running.task
