"""The handler API: everything a handler author uses, and nothing else.

::

    from typing import Any
    from jobplane.workers.handlers import JobContext, PermanentError, Registry

    registry = Registry()

    @registry.handler("reports.render")
    async def render(ctx: JobContext) -> dict[str, Any]:
        if "rows" not in ctx.payload:
            raise PermanentError("no rows", code="BAD_PAYLOAD")
        await ctx.progress(0.5, "half way")
        return {"url": "..."}

``jobplane worker --handlers mypkg.handlers:registry`` runs them;
:mod:`jobplane.workers` exports the same names, and :mod:`jobplane.testing`
runs a handler in a unit test. docs/handlers.md is the long reference.

Registering
    :class:`Registry` holds handlers by job type: ``@registry.handler(type)``
    or ``registry.add(type, fn)``, once per type; ``a.merge(b)`` combines two.
    ``@registry.lifespan`` registers a factory of an async context manager
    (a :data:`Lifespan`) for what a worker process's handlers share: entered
    before its first job, left after its last.

Handlers
    A :data:`Handler` is an ``async def`` taking a :class:`JobContext`; it runs
    on the worker's event loop and must not block. A :data:`SyncHandler` is a
    plain ``def`` taking a :class:`SyncJobContext`: the worker runs it in a
    bounded pool of threads (``JOBPLANE_SYNC_THREADS``, default its
    concurrency), and its context's methods are called from that thread.
    Anything else (a class, a generator function) is refused at registration.

The context
    :class:`JobContext` has the job (``id``, ``name``, ``type``, ``payload``,
    ``tenant_id``, ``attempt``, ``max_attempts``, ``correlation_id``,
    ``request_id``), a pipeline stage's place (``pipeline``, ``stage``, their
    versions, ``inputs``, ``previous``; a fan-out's ``fans_out``, ``spawn()``
    and the join's ``results``, each an :class:`ItemResult`), ``progress()``, ``emit()`` (events
    published only if the attempt succeeds), ``submit()`` (a child job, one
    per key whatever the attempt), the tenant's blobs
    (``read_blob``, ``open_blob``, ``put_blob``) and ``cancelled``.
    :class:`SyncJobContext` has the same, called from the handler's thread
    (no ``open_blob``), and ``async_context``.

Returning and raising
    A handler returns a JSON object (its result; None means ``{}``) or raises.
    :class:`PermanentError` fails the job at once; :class:`RetryableError`, or
    any other exception, uses another attempt while the job has any left
    (after ``delay`` seconds, or the queue's backoff). :class:`EmitError` is
    ``ctx.emit`` refusing an event, :class:`SubmitError` ``ctx.submit``
    refusing a child. :class:`AttemptStopped` is raised in a
    plain handler once the worker stopped its attempt (cancelled, timed out,
    shutting down, lease lost): a cancellation, to clean up after and let go.

What the worker does with a registry (loading ``--handlers``, running plain
handlers in threads, reading an offloaded payload) lives beside this module:
:mod:`jobplane.workers.registry`, :mod:`jobplane.workers.context`,
:mod:`jobplane.workers.plain`, :mod:`jobplane.workers.errors`,
:mod:`jobplane.workers.loader`.
"""

from __future__ import annotations

from jobplane.fanout import ItemResult

# The aliased names are not the author's, so not in __all__: the runtime and
# the CLI import them from here, and an explicit re-export keeps them
# importable under mypy --strict.
from jobplane.workers.context import Handler, JobContext
from jobplane.workers.context import with_offloaded_payload as with_offloaded_payload  # noqa: PLC0414
from jobplane.workers.errors import (
    AttemptStopped,
    EmitError,
    PermanentError,
    RetryableError,
    SubmitError,
)
from jobplane.workers.loader import HandlersError as HandlersError  # noqa: PLC0414
from jobplane.workers.loader import load_registry as load_registry  # noqa: PLC0414
from jobplane.workers.plain import SyncHandler, SyncJobContext
from jobplane.workers.registry import Lifespan, Registry

__all__ = [
    "AttemptStopped",
    "EmitError",
    "Handler",
    "ItemResult",
    "JobContext",
    "Lifespan",
    "PermanentError",
    "Registry",
    "RetryableError",
    "SubmitError",
    "SyncHandler",
    "SyncJobContext",
]
