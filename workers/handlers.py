"""The handler API: a registry of async functions taking a :class:`JobContext`.

::

    registry = Registry()

    @registry.handler("reports.render")
    async def render(ctx: JobContext) -> dict[str, Any]:
        await ctx.progress(0.5, "half way")
        return {"url": "..."}

A handler returns a JSON object (the result) or raises. :class:`PermanentError`
fails the job at once; :class:`RetryableError` (or any other exception) uses
another attempt while the job has any left.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol

from jobplane.names import job_name, validate_job_type
from jobplane.store.attempts import Attempt, ProgressUpdate


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


class ProgressSink(Protocol):
    """Where a context's progress reports go (the worker's coalescing writer)."""

    async def add(self, update: ProgressUpdate) -> None:
        """Queue one update for writing."""


class JobContext:
    """What a handler gets: the job, and a way to report progress."""

    def __init__(self, attempt: Attempt, sink: ProgressSink) -> None:
        self._attempt = attempt
        self._sink = sink

    @property
    def name(self) -> str:
        """``jobs/{id}``"""
        return job_name(self._attempt.job_id)

    @property
    def id(self) -> str:
        """The job id."""
        return str(self._attempt.job_id)

    @property
    def type(self) -> str:
        """The job type."""
        return self._attempt.type

    @property
    def payload(self) -> dict[str, Any]:
        """The submitted payload (a fresh copy is not made: do not mutate it)."""
        return self._attempt.payload

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self._attempt.attempt

    @property
    def max_attempts(self) -> int:
        """Attempts the job may use."""
        return self._attempt.max_attempts

    @property
    def correlation_id(self) -> str:
        """The caller's correlation id."""
        return self._attempt.correlation_id

    @property
    def request_id(self) -> str:
        """The idempotency key the job was submitted with."""
        return self._attempt.request_id

    async def progress(
        self, fraction: float, message: str = "", data: dict[str, Any] | None = None
    ) -> None:
        """Report progress (0..1) with a message and optional JSON data.

        Reports are written in order, a few milliseconds later, many in one
        transaction. Raises :class:`~jobplane.store.attempts.LeaseLost` when
        this attempt no longer owns the job.
        """
        if not isinstance(fraction, int | float) or not math.isfinite(fraction):
            raise ValueError("progress fraction must be a finite number")
        await self._sink.add(
            ProgressUpdate(
                progress=min(1.0, max(0.0, float(fraction))),
                message=str(message)[:4096],
                data=dict(data or {}),
            )
        )


Handler = Callable[[JobContext], Coroutine[Any, Any, dict[str, Any]]]


class Registry:
    """Handlers by job type."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def handler(self, job_type: str) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` for ``job_type``."""

        def register(fn: Handler) -> Handler:
            self.add(job_type, fn)
            return fn

        return register

    def add(self, job_type: str, fn: Handler) -> None:
        """Register ``fn`` for ``job_type``."""
        validate_job_type(job_type)
        if job_type in self._handlers:
            raise ValueError(f"a handler for {job_type!r} is already registered")
        self._handlers[job_type] = fn

    def get(self, job_type: str) -> Handler | None:
        """The handler of ``job_type``, or None."""
        return self._handlers.get(job_type)

    def merge(self, other: Registry) -> Registry:
        """A new registry with the handlers of both."""
        merged = Registry()
        for job_type, fn in (*self._handlers.items(), *other._handlers.items()):
            merged.add(job_type, fn)
        return merged

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)


def load_registry(spec: str) -> Registry:
    """Import ``package.module:attribute`` and check it is a :class:`Registry`."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"handlers must look like package.module:registry, got {spec!r}")
    module = importlib.import_module(module_name)
    registry = getattr(module, attribute, None)
    if not isinstance(registry, Registry):
        raise TypeError(f"{spec} is not a jobplane.workers.Registry")
    return registry
