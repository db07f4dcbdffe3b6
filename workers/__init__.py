"""Workers: the handler API, the worker runtime and the outbox relay."""

from __future__ import annotations

from jobplane.workers.handlers import (
    Handler,
    JobContext,
    PermanentError,
    Registry,
    RetryableError,
)

__all__ = ["Handler", "JobContext", "PermanentError", "Registry", "RetryableError"]
