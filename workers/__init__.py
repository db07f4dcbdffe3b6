"""Workers: the handler API, the worker runtime and the outbox relay."""

from __future__ import annotations

from jobplane.workers.handlers import (
    EmitError,
    Handler,
    JobContext,
    PermanentError,
    Registry,
    RetryableError,
)

__all__ = ["EmitError", "Handler", "JobContext", "PermanentError", "Registry", "RetryableError"]
