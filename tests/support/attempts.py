"""An attempt as a worker holds it after its claim, and a context around it."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from jobplane.store.attempts import Attempt, ProgressUpdate
from jobplane.workers import JobContext


def an_attempt(**changes: Any) -> Attempt:
    """The first of three attempts of a job of type ``t``, with fresh ids;
    ``changes`` replace any field."""
    attempt = Attempt(
        job_id=uuid.uuid4(),
        tenant_id=uuid.uuid4(),
        type="t",
        payload={},
        attempt=1,
        max_attempts=3,
        retry_base=0,
        lease_token=uuid.uuid4(),
        correlation_id="",
        request_id="r",
    )
    return dataclasses.replace(attempt, **changes)


class ProgressSink:
    """Every progress update a context queues, in order."""

    def __init__(self) -> None:
        self.updates: list[ProgressUpdate] = []

    async def add(self, update: ProgressUpdate) -> None:
        self.updates.append(update)


def progress_context(**changes: Any) -> tuple[JobContext, ProgressSink]:
    """A handler's context over :func:`an_attempt` (``changes`` to it) that
    queues its progress into the sink returned with it."""
    sink = ProgressSink()
    return JobContext(an_attempt(**changes), sink), sink
