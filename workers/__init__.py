"""Workers: the handler API, the worker runtime and the outbox relay."""

from __future__ import annotations

from jobplane.workers.handlers import (
    AttemptStopped,
    EmitError,
    Handler,
    JobContext,
    PermanentError,
    Registry,
    RetryableError,
    SyncHandler,
    SyncJobContext,
)

__all__ = [
    "AttemptStopped",
    "EmitError",
    "Handler",
    "JobContext",
    "PermanentError",
    "Registry",
    "RetryableError",
    "SyncHandler",
    "SyncJobContext",
]
