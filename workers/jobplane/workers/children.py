"""Child jobs: a child's request checked, and written under its parent's attempt.

One set of checks for both ways a handler submits a child: ``ctx.submit`` in
a Python worker (:class:`WorkerChildren`, which writes through the store)
and ``WorkerService.SubmitChildJob`` for workers in other languages (the
server's :mod:`jobplane.server.worker_protocol`). A refusal names the field
(INVALID_ARGUMENT over gRPC; ``SubmitError`` in a handler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from jobplane.errors import InvalidArgument, PayloadTooLarge, UnroutableJobType
from jobplane.names import validate_job_type
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS, schedule_time_of
from jobplane.store.attempts import Attempt
from jobplane.store.children import (
    MAX_CHILD_KEY_LENGTH,
    ChildStore,
    ParentFence,
)
from jobplane.store.job_submit import (
    MAX_ATTEMPTS_LIMIT,
    MAX_CORRELATION_ID_BYTES,
    MAX_TIMEOUT_SECONDS,
    MIN_TIMEOUT_SECONDS,
    NewJob,
    pipeline_stages,
)
from jobplane.store.rows import check_payload_size
from jobplane.topology import PipelineSpec, Topology
from jobplane.workers.values import json_problem


@dataclass(frozen=True, slots=True)
class ChildRequest:
    """A child job a handler asks for, as plain values."""

    #: Names the child among its parent's: the same key is the same child.
    key: str
    type: str
    payload: dict[str, Any]
    #: 0: the queue's (a pipeline's stages': their own).
    max_attempts: int = 0
    #: None: the queue's.
    timeout_seconds: float | None = None
    #: None: the parent's.
    correlation_id: str | None = None
    schedule_time: datetime | None = None
    schedule_delay_seconds: float | None = None


def check_key(key: object) -> str:
    """The key, or INVALID_ARGUMENT (field ``key``): 1..200 characters, no control characters."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument("key is required: it names the child among its parent's", field="key")
    if len(key) > MAX_CHILD_KEY_LENGTH:
        raise InvalidArgument(f"key is longer than {MAX_CHILD_KEY_LENGTH} characters", field="key")
    if any(c < " " or c == "\x7f" for c in key) or not _utf8(key):
        raise InvalidArgument("key has control characters or is not UTF-8", field="key")
    return key


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def child_job(
    topology: Topology,
    request: ChildRequest,
    *,
    parent_correlation_id: str,
    max_payload_bytes: int,
    horizon_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
) -> NewJob:
    """The job ``request`` asks for, checked whole; the first refusal raised.

    Its request_id and parent are set by the store (from the parent and the key).
    """
    check_key(request.key)
    job_type = validate_job_type(request.type)
    pipeline = topology.pipeline(job_type)
    queue = topology.route(job_type)
    if pipeline is not None:
        queue = topology.queue(pipeline.stages[0].queue)
    if queue is None:
        raise UnroutableJobType(
            f"no queue of the topology takes job type {job_type!r}", field="type"
        )
    payload = request.payload
    if not isinstance(payload, dict):
        raise InvalidArgument("payload must be a JSON object", field="payload")
    problem = json_problem(payload, max_bytes=max_payload_bytes)
    if problem is not None:
        if problem.startswith("larger than"):
            raise PayloadTooLarge(f"payload is {problem}", field="payload")
        raise InvalidArgument(f"payload cannot be stored: {problem}", field="payload")
    check_payload_size(payload, max_payload_bytes)
    if not 0 <= request.max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise InvalidArgument(
            f"max_attempts must be 0 (queue default) .. {MAX_ATTEMPTS_LIMIT}", field="max_attempts"
        )
    timeout = request.timeout_seconds
    if timeout is not None and not MIN_TIMEOUT_SECONDS <= timeout <= MAX_TIMEOUT_SECONDS:
        raise InvalidArgument(
            f"timeout must be at least {MIN_TIMEOUT_SECONDS:g} and at most "
            f"{MAX_TIMEOUT_SECONDS:g} seconds",
            field="timeout",
        )
    correlation = _correlation(request.correlation_id, parent_correlation_id)
    schedule = schedule_time_of(
        request.schedule_time,
        request.schedule_delay_seconds,
        now=datetime.now(UTC),
        horizon_seconds=horizon_seconds,
    )
    new = NewJob(
        type=job_type,
        queue=queue.name,
        payload=payload,
        request_id="",
        max_attempts=request.max_attempts or queue.max_attempts,
        correlation_id=correlation,
        timeout_seconds=queue.timeout_seconds if timeout is None else timeout,
        schedule_time=schedule,
    )
    return new if pipeline is None else _as_pipeline(new, pipeline, request)


def _correlation(given: str | None, parent: str) -> str:
    """The child's correlation id: ``given``, or its parent's; checked as SubmitJob's."""
    correlation = parent if given is None else given
    if (
        not _utf8(correlation)
        or len(correlation.encode()) > MAX_CORRELATION_ID_BYTES
        or any(c < " " for c in correlation)
    ):
        raise InvalidArgument(
            f"correlation_id must be at most {MAX_CORRELATION_ID_BYTES} bytes in UTF-8 "
            "without control characters",
            field="correlation_id",
        )
    return correlation


def _as_pipeline(new: NewJob, pipeline: PipelineSpec, request: ChildRequest) -> NewJob:
    """``new`` as a job of ``pipeline``: its stages, as SubmitJob's pipeline jobs have them."""
    timeout = request.timeout_seconds
    stages = pipeline_stages(pipeline, max_attempts=request.max_attempts, timeout_seconds=timeout)
    return replace(
        new,
        type=pipeline.name,
        queue=stages[0].queue,
        max_attempts=request.max_attempts,
        timeout_seconds=timeout or 0.0,
        pipeline_version=pipeline.version,
        stages=stages,
    )


def fence_of(attempt: Attempt) -> ParentFence:
    """The fence a child of ``attempt`` is submitted under."""
    return ParentFence(attempt.tenant_id, attempt.job_id, attempt.attempt, attempt.lease_token)


class WorkerChildren:
    """A Python worker's ``ctx.submit``: checks a child against the topology and writes it."""

    def __init__(
        self,
        store: ChildStore,
        topology: Topology,
        *,
        max_payload_bytes: int,
        horizon_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
        on_created: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self._store = store
        #: Told of each child created (type, queue, 1): the worker's metrics count it.
        self._on_created = on_created
        self._topology = topology
        self._max_payload_bytes = max_payload_bytes
        self._horizon_seconds = horizon_seconds

    async def submit(self, attempt: Attempt, request: ChildRequest) -> tuple[str, bool]:
        """The child's name, and whether it was created now (False: the key's child
        existed). Raises the store's refusals (``LeaseLost`` among them)."""
        new = child_job(
            self._topology,
            request,
            parent_correlation_id=attempt.correlation_id,
            max_payload_bytes=self._max_payload_bytes,
            horizon_seconds=self._horizon_seconds,
        )
        job, created = await self._store.submit(fence_of(attempt), request.key, new)
        if created and self._on_created is not None:
            self._on_created(new.type, new.queue, 1)
        return job.name, created
