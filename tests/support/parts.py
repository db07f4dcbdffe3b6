"""The ``started`` fixture's factory: what a test starts is stopped at its end.

As arq's ``worker`` fixture hands a test a function that makes workers and
closes each one after it, :class:`Started` starts the parts a test makes (a
server, worker, relay, sweeper, a whole stack, a client) and the fixture stops
every one of them at teardown, the last started first, whether the test passed
or not. A test of the stop itself calls ``stop()`` on its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Protocol, TypeVar, overload

T = TypeVar("T")


class Closes(Protocol):
    """Made started (``start_stack``'s stack); ``close()`` stops it."""

    async def close(self) -> None: ...


class Stops(Protocol):
    """A part with a grace to stop in (the server, the worker)."""

    async def start(self) -> None: ...

    async def stop(self, grace: float) -> None: ...


C = TypeVar("C", bound=Closes)
S = TypeVar("S", bound=Stops)


class Started:
    """``await started(part)``: starts ``part`` and returns it, stopped at teardown.

    ``part`` is an async context manager (``async with`` starts it: the server,
    the worker, the relay, the sweeper, a client, a pool) or an awaitable of
    something already started with a ``close()`` (``start_stack(...)``).
    ``grace=`` stops a server or worker with that grace instead of its default.
    :meth:`callback` adds a closing step of the test's own to the same order.
    """

    def __init__(self, stack: AsyncExitStack) -> None:
        self._stack = stack

    @overload
    async def __call__(self, part: S, *, grace: float) -> S: ...

    @overload
    async def __call__(self, part: AbstractAsyncContextManager[T]) -> T: ...

    @overload
    async def __call__(self, part: Awaitable[C]) -> C: ...

    async def __call__(self, part: Any, *, grace: float | None = None) -> Any:
        if grace is not None:
            await part.start()
            self._stack.push_async_callback(part.stop, grace)
            return part
        if inspect.isawaitable(part):
            made = await part
            self._stack.push_async_callback(made.close)
            return made
        return await self._stack.enter_async_context(part)

    def callback(self, close: Callable[..., Awaitable[object]], *args: object) -> None:
        """Also await ``close(*args)`` at teardown, in its place among the parts: for
        what a test opened that is no part (an engine it made, a proxy it cut)."""
        self._stack.push_async_callback(close, *args)
