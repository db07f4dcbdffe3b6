"""A job as the store reads it back and the client SDK hands it over (the same
:class:`~jobplane.types.Job`), any field changed."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any

from jobplane.types import Job, JobState

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def stored_job(name: str = "", **changes: Any) -> Job:
    """A QUEUED ``demo.echo`` job with an empty payload, not started yet (of three
    attempts), created and updated at :data:`NOW`, named ``name`` (a new random
    name unless given); ``changes`` replace any other field."""
    job = Job(
        name=name or f"jobs/{uuid.uuid4()}",
        type="demo.echo",
        state=JobState.QUEUED,
        payload={},
        result=None,
        error=None,
        progress=0.0,
        progress_message="",
        attempt=0,
        max_attempts=3,
        request_id="",
        correlation_id="",
        labels={},
        create_time=NOW,
        update_time=NOW,
        last_seq=0,
    )
    return dataclasses.replace(job, **changes)
