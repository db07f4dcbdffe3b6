"""One lifecycle for every long-running part: the server, the worker, the relay
and the sweeper (ADR-0037).

A part defines ``start()`` and ``stop()``; :class:`Lifecycle` makes it an async
context manager (``async with part:`` starts it and stops it gracefully,
whatever ends the block) and gives it :meth:`Lifecycle.run`, the whole life of a
process: start, serve until cancelled, stop.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self


class Lifecycle:
    """``async with`` and ``run()`` over a part's own ``start()`` and ``stop()``.

    The stop is the part's default one (its default grace): a caller that wants
    another grace calls ``stop(grace)`` itself.
    """

    async def start(self) -> None:
        """Start the part (each part defines it)."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop the part gracefully (each part defines it)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def run(self) -> None:
        """Start, serve until cancelled, then stop: ``asyncio.run(part.run())`` or a
        task's cancel is the whole lifecycle; the cancel propagates once stopped."""
        async with self:
            await asyncio.Event().wait()
