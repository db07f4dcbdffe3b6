"""The worker protocol's requests: their values, their limits and their checks.

:class:`~jobplane.server.worker_protocol.WorkerService` takes what a worker
in any language sends (an envelope to claim, a fence, progress reports, a
registration) through these, refused with INVALID_ARGUMENT naming the bad
field before anything is written.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobplane.envelope import Envelope
from jobplane.errors import InvalidArgument, shown
from jobplane.names import job_name, parse_job_name, validate_job_type
from jobplane.store.attempts import ClaimResult, ProgressUpdate
from jobplane.topology import Topology, TopologyError
from jobplane.workers.context import MAX_PROGRESS_DATA_BYTES, MAX_PROGRESS_MESSAGE
from jobplane.workers.values import TOO_LARGE, json_problem, json_size

#: Progress reports one call may carry.
MAX_REPORTS = 100
#: A registration's renewal interval and lifetime: the Python worker's presence
#: (jobplane.workers.presence) beats every 5 s and may miss three beats.
RENEW_INTERVAL = 5.0
REGISTRATION_TTL = RENEW_INTERVAL * 3 + 1.0
MAX_TYPES = 1000
MAX_QUEUES = 100
MAX_CONCURRENCY = 10_000
MAX_WORKER_LABEL = 255
_WORKER_PREFIX = "workers/"


def worker_name(worker_id: uuid.UUID) -> str:
    """``workers/{id}``"""
    return f"{_WORKER_PREFIX}{worker_id}"


def parse_worker_name(name: str, *, field: str = "name") -> uuid.UUID:
    """The id in ``workers/{id}``; INVALID_ARGUMENT when malformed."""
    bad = InvalidArgument(f"{field} must look like workers/{{id}}, got {shown(name)}", field=field)
    raw = name.removeprefix(_WORKER_PREFIX)
    if raw == name:
        raise bad
    try:
        parsed = uuid.UUID(raw)
    except ValueError:
        raise bad from None
    if str(parsed) != raw.lower():
        raise bad
    return parsed


@dataclass(frozen=True, slots=True)
class Registration:
    """What a worker says of itself when it registers."""

    types: list[str]
    queues: list[str]
    concurrency: int
    host: str = ""
    pid: int = 0
    version: str = ""


@dataclass(frozen=True, slots=True)
class Fence:
    """What a worker holds of its attempt: (job, attempt, lease token)."""

    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID

    @classmethod
    def parse(cls, job: str, attempt: int, lease_token: str, *, field: str = "attempt") -> Fence:
        """From a request's AttemptRef; INVALID_ARGUMENT naming the bad part."""
        job_id = parse_job_name(job, field=f"{field}.job")
        if attempt < 1:
            raise InvalidArgument(
                f"{field}.attempt must be at least 1, got {attempt}", field=f"{field}.attempt"
            )
        return cls(job_id, attempt, parse_uuid(lease_token, f"{field}.lease_token"))


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claim's answer: the store's result, and how long lease and wait are.

    ``other_deployment``: no such job here, and the message names another
    deployment (ADR-0006): it is that deployment's to run.
    """

    result: ClaimResult
    lease_seconds: float
    retry_after: float
    other_deployment: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """What a FailJob did: a retry scheduled after ``delay`` seconds, or FAILED."""

    retry_scheduled: bool
    delay: float | None = None


def check_envelope(
    body: bytes, *, event_id: str, job_id: str, tenant_id: str, job_type: str
) -> Envelope:
    """The envelope a claim names: the message body, or its four fields."""
    fields = {"event_id": event_id, "job_id": job_id, "tenant_id": tenant_id, "type": job_type}
    if body:
        given = next((name for name, value in fields.items() if value), None)
        if given is not None:
            raise InvalidArgument(
                f"give message_body or the envelope's fields, not both ({given} is set)",
                field=given,
            )
        try:
            return Envelope.decode(body)
        except ValueError as exc:
            raise InvalidArgument(
                f"message_body is not a dispatch envelope: {shown(str(exc), 160)}",
                field="message_body",
            ) from None
    for name, value in fields.items():
        if not value:
            raise InvalidArgument(
                f"{name} is required (or message_body instead of the fields)", field=name
            )
    return Envelope(
        event_id=parse_uuid(event_id, "event_id"),
        job_id=parse_uuid(job_id, "job_id"),
        tenant_id=parse_uuid(tenant_id, "tenant_id"),
        job_type=validate_job_type(job_type),
    )


def check_reports(
    reports: Sequence[tuple[float, str, dict[str, Any]]],
    *,
    field: str = "reports",
    required: bool = False,
) -> list[ProgressUpdate]:
    """Checked progress reports; INVALID_ARGUMENT naming the first bad one's field."""
    if required and not reports:
        raise InvalidArgument(f"{field} needs at least one report", field=field)
    if len(reports) > MAX_REPORTS:
        raise InvalidArgument(f"{field} holds more than {MAX_REPORTS} reports", field=field)
    updates = []
    for i, (progress, message, data) in enumerate(reports):
        at = f"{field}[{i}]"
        if not math.isfinite(progress):
            raise InvalidArgument(f"{at}.progress must be a finite number", field=f"{at}.progress")
        check_text(message, MAX_PROGRESS_MESSAGE, f"{at}.message")
        problem = json_problem(data, max_bytes=MAX_PROGRESS_DATA_BYTES)
        if problem is None and json_size(data) > MAX_PROGRESS_DATA_BYTES:
            problem = TOO_LARGE.format(max_bytes=MAX_PROGRESS_DATA_BYTES)
        if problem is not None:
            raise InvalidArgument(
                f"{at}.data cannot be stored: {shown(problem, 160)}", field=f"{at}.data"
            )
        updates.append(ProgressUpdate(min(1.0, max(0.0, progress)), message, data))
    return updates


def check_registration(topology: Topology, registration: Registration) -> Registration:
    """``registration`` checked; INVALID_ARGUMENT naming the first bad field."""
    if not 1 <= len(registration.types) <= MAX_TYPES:
        raise InvalidArgument(f"types must hold 1..{MAX_TYPES} job types", field="types")
    for i, job_type in enumerate(registration.types):
        validate_job_type(job_type, field=f"types[{i}]")
    if not 1 <= len(registration.queues) <= MAX_QUEUES:
        raise InvalidArgument(f"queues must hold 1..{MAX_QUEUES} queues", field="queues")
    for i, queue in enumerate(registration.queues):
        try:
            topology.queue(queue)
        except TopologyError:
            raise InvalidArgument(
                f"queues[{i}] {shown(queue)} is no queue of the topology",
                field=f"queues[{i}]",
            ) from None
    if not 1 <= registration.concurrency <= MAX_CONCURRENCY:
        raise InvalidArgument(f"concurrency must be 1..{MAX_CONCURRENCY}", field="concurrency")
    for name in ("host", "version"):
        value = getattr(registration, name)
        if len(value) > MAX_WORKER_LABEL or any(ord(c) < 32 for c in value):
            raise InvalidArgument(
                f"{name} must be at most {MAX_WORKER_LABEL} characters, no control characters",
                field=name,
            )
    if registration.pid < 0:
        raise InvalidArgument("pid must not be negative", field="pid")
    return registration


def lost_message(fence: Fence) -> str:
    return (
        f"{job_name(fence.job_id)} attempt {fence.attempt} does not hold the job with this "
        "lease token (the lease ran out and another attempt took it, or the job moved on); "
        "nothing was written"
    )


def parse_uuid(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidArgument(f"{field} {shown(value)} is not a UUID", field=field) from None


def check_text(value: str, limit: int, field: str) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{field} is longer than {limit} characters", field=field)
    if "\x00" in value:
        raise InvalidArgument(f"{field} has a NUL character", field=field)
