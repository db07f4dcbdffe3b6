"""Small asyncio helpers shared by the long-running parts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None, *, again_after: float = 1.0) -> None:
    """Cancel ``task`` (if any) and wait until it has finished.

    A cancellation can be lost: on Python 3.11 ``asyncio.timeout`` may
    swallow one that races its own expiry, and the task then runs on. So the
    task is cancelled again every ``again_after`` seconds until it has ended.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=again_after)
    with contextlib.suppress(asyncio.CancelledError):
        await task
