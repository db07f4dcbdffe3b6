"""A handler's task while the worker runs it: why the worker stopped it, and how it ended."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


class StopCause(enum.Enum):
    """Why the runtime cancelled a handler's task."""

    CANCEL_REQUESTED = "cancel_requested"
    LEASE_LOST = "lease_lost"
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"


class Running:
    """A handler task and why (if at all) the runtime stopped it."""

    def __init__(self, task: asyncio.Task[Any], on_stop: Callable[[], None] = lambda: None) -> None:
        self.task = task
        # Tells the handler's context (a thread cannot be cancelled; it reads it).
        self._on_stop = on_stop
        self.started = time.monotonic()
        self.cause: StopCause | None = None
        # Done when the task ends or the runtime stops it, whichever is first:
        # one future and a callback a job, not a task waiting on an event.
        self._woken: asyncio.Future[None] = task.get_loop().create_future()
        task.add_done_callback(self._wake)

    def _wake(self, *_: object) -> None:
        if not self._woken.done():
            self._woken.set_result(None)

    async def ended_or_stopped(self, timeout: float) -> None:
        """Until the task ended or was stopped, or ``timeout`` seconds passed."""
        if self._woken.done():
            return
        timer = self.task.get_loop().call_later(timeout, self._wake)
        try:
            await asyncio.shield(self._woken)
        finally:
            timer.cancel()

    @property
    def error(self) -> BaseException | None:
        """What the handler raised, once its task is done (None: returned, or stopped)."""
        task = self.task
        if not task.done() or task.cancelled():
            return None
        return task.exception()

    def stop(self, cause: StopCause) -> None:
        if self.cause is None and not self.task.done():
            self.cause = cause
            self._on_stop()
            self._wake()
            self.task.cancel()


@dataclass(frozen=True, slots=True)
class Ended:
    """How a handler's task ended: it returned ``result``, raised ``error``, or
    neither (it was stopped, or given up on)."""

    returned: bool = False
    result: Any = None
    error: BaseException | None = None


def spawned_and_returned(ended: Ended, spawned: list[Any]) -> Ended:
    """A fan-out's items: those the handler spawned, then those of the list it
    returned (ADR-0047). A result neither None nor a list stays as it is, for
    the stage's success to refuse."""
    if ended.result is None:
        return replace(ended, result=list(spawned))
    if isinstance(ended.result, list):
        return replace(ended, result=[*spawned, *ended.result])
    return ended
