"""The errors of the handler API: what a handler raises, and what it may be given.

Defined apart from :class:`~jobplane.workers.context.JobContext` and the
runner of plain handlers, which raise them too; a handler imports them from
:mod:`jobplane.workers.handlers` (or :mod:`jobplane.workers`).
"""

from __future__ import annotations

import asyncio


class PermanentError(Exception):
    """The job cannot succeed; do not try again."""

    code = "HANDLER_FAILED"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code


class RetryableError(Exception):
    """This attempt failed, a later one may succeed; ``delay`` overrides the backoff."""

    code = "HANDLER_RETRYABLE"

    def __init__(self, message: str, *, delay: float | None = None, code: str | None = None):
        super().__init__(message)
        self.delay = delay
        if code:
            self.code = code


class AttemptStopped(asyncio.CancelledError):
    """The worker stopped this attempt (its job was cancelled, it ran past its
    timeout, the worker is shutting down or lost the lease).

    Raised in a plain ``def`` handler at its next call of a context method; an
    ``async def`` handler gets the :class:`asyncio.CancelledError` of its task
    instead. A cancellation, not an error: catch it only to clean up, then
    let it go on.
    """


class EmitError(ValueError):
    """``ctx.emit`` refused an event; ``field`` names what is wrong with it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


class SubmitError(ValueError):
    """``ctx.submit`` refused a child job; ``field`` names what is wrong with it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)
