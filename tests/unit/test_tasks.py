"""Stopping a task: cancelled again until it ends; its own errors still surface."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from jobplane.tasks import cancel_and_wait


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again() -> None:
    ended = asyncio.Event()

    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # swallowed once
            await asyncio.sleep(60)
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, again_after=0.05), 5)
    assert ended.is_set() and task.cancelled()


async def test_errors_of_the_task_still_surface() -> None:
    async def broken() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("while stopping") from None

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await cancel_and_wait(task)
