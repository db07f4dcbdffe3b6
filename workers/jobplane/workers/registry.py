"""The handler registry: handlers by job type, and the lifespans they share.

:class:`Registry` is what ``jobplane worker --handlers module:registry``
loads (:mod:`jobplane.workers.loader`). Registering classes a handler once,
by what it is (:func:`handler_kind`): an ``async def`` is kept as it is, a
plain ``def`` is wrapped in :class:`~jobplane.workers.plain.Threaded` so
that the runtime runs every handler the same way. Handlers import
:class:`Registry` from :mod:`jobplane.workers.handlers`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TypeVar, cast

from jobplane.names import validate_job_type
from jobplane.workers.context import Handler
from jobplane.workers.plain import SyncHandler, Threaded
from jobplane.workers.values import qualname

F = TypeVar("F", bound="Handler | SyncHandler")

#: What :meth:`Registry.lifespan` takes: a factory of an async context manager.
Lifespan = Callable[[], AbstractAsyncContextManager[object]]


class Registry:
    """Handlers by job type."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._lifespans: list[Lifespan] = []

    def lifespan(self, factory: Lifespan) -> Lifespan:
        """Register what the handlers share in a worker process (a client, a model).

        The worker enters ``factory()`` when it starts, before it takes a
        job, and leaves it when it stops, after its handlers have ended: the
        resource has the worker's life, not the module's (nothing opens at
        import). Usable as a decorator of an ``asynccontextmanager``.
        """
        self._lifespans.append(factory)
        return factory

    @property
    def lifespans(self) -> tuple[Lifespan, ...]:
        """The registered lifespans, in order."""
        return tuple(self._lifespans)

    def handler(self, job_type: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` (``async def`` or plain ``def``) for ``job_type``."""

        def register(fn: F) -> F:
            self.add(job_type, fn)
            return fn

        return register

    def add(self, job_type: str, fn: Handler | SyncHandler) -> None:
        """Register ``fn`` for ``job_type``: an ``async def``, or a plain ``def`` the
        worker runs in a thread (anything else: TypeError)."""
        validate_job_type(job_type)
        kind = handler_kind(fn)
        if kind not in ("async", "sync"):
            raise TypeError(
                f"the handler for {job_type!r} ({qualname(fn)}) is {kind}: handlers are "
                "`async def` or plain `def` functions taking the job's context"
            )
        if job_type in self._handlers:
            raise ValueError(f"a handler for {job_type!r} is already registered")
        if kind == "async":
            self._handlers[job_type] = cast(Handler, fn)
        else:
            self._handlers[job_type] = Threaded(cast(SyncHandler, fn))

    def get(self, job_type: str) -> Handler | None:
        """The handler of ``job_type``, or None."""
        return self._handlers.get(job_type)

    def merge(self, other: Registry) -> Registry:
        """A new registry with the handlers of both."""
        merged = Registry()
        merged._lifespans = [*self._lifespans, *other._lifespans]
        for job_type, fn in (*self._handlers.items(), *other._handlers.items()):
            merged.add(job_type, fn)
        return merged

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)


def handler_kind(fn: object) -> str:
    """``"async"``, ``"sync"``, or why the runtime cannot run ``fn``."""
    if _is_async(fn):
        return "async"
    if not callable(fn):
        return "not callable"
    if inspect.isclass(fn):
        return "a class (calling it makes an instance, not a result)"
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        return "a generator function (it must return its result)"
    call = inspect.getattr_static(type(fn), "__call__", None)
    if inspect.isasyncgenfunction(call) or inspect.isgeneratorfunction(call):
        return "a generator function (it must return its result)"
    return "sync"


def _is_async(fn: object) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    # An instance whose __call__ is an async def (a class itself is not).
    if inspect.isclass(fn) or not callable(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)
