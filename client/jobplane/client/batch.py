"""Many jobs at once: the specs :meth:`AsyncClient.submit_many` takes, and how
it splits them into BatchSubmitJobs calls."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from jobplane.errors import JobplaneError
from jobplane.types import ConcurrencyMode, DependencyFailurePolicy, Job
from jobplane.v1 import jobs_pb2

#: The most requests the server takes in one BatchSubmitJobs call.
MAX_BATCH_SIZE = 1000
#: The most request bytes the SDK puts in one call: half the server's bound
#: on a batch body (16 MiB), so a call never meets it. A single request larger
#: than this goes alone (as large as SubmitJob may send).
MAX_BATCH_BYTES = 8 * 1024 * 1024
# What a repeated field costs per element beyond the element: a tag and a length.
_FRAMING_BYTES = 6


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job for :meth:`~jobplane.client.AsyncClient.submit_many`: the arguments
    of :meth:`~jobplane.client.AsyncClient.submit`, with the same meanings."""

    type: str
    payload: dict[str, Any] | None = None
    request_id: str | None = None
    correlation_id: str = ""
    max_attempts: int = 0
    labels: Mapping[str, str] | None = None
    attempt_timeout: float | timedelta | None = None
    # Delayed jobs (docs/scheduling.md): at most one of the two.
    schedule_time: datetime | None = None
    schedule_delay: float | timedelta | None = None
    # Concurrency keys (docs/flow-control.md).
    concurrency_key: str = ""
    concurrency_limit: int = 0
    concurrency_mode: ConcurrencyMode | str | None = None
    # Deadlines (docs/scheduling.md#deadlines): a time, or a duration after the call.
    deadline: datetime | float | timedelta | None = None
    # Dependencies (docs/workflows.md): jobs (or their names) it runs after.
    after: Sequence[Job | str] = ()
    after_failure: DependencyFailurePolicy | str | None = None

    @classmethod
    def of(cls, spec: JobSpec | Mapping[str, Any]) -> JobSpec:
        """``spec`` itself, or the spec a mapping of the same names describes."""
        if isinstance(spec, JobSpec):
            return spec
        unknown = set(spec) - _FIELDS
        if unknown:
            raise TypeError(f"a job spec has no field {sorted(unknown)[0]!r}")
        return cls(**spec)


_FIELDS = frozenset(f.name for f in fields(JobSpec))
_MODES = {
    ConcurrencyMode.QUEUE: jobs_pb2.CONCURRENCY_MODE_QUEUE,
    ConcurrencyMode.REJECT: jobs_pb2.CONCURRENCY_MODE_REJECT,
}


def with_concurrency(request: jobs_pb2.SubmitJobRequest, spec: JobSpec) -> None:
    """Set ``spec``'s concurrency key, limit and mode on ``request`` (the server
    checks them: a limit or mode without a key is refused)."""
    request.concurrency_key = spec.concurrency_key
    request.concurrency_limit = spec.concurrency_limit
    if spec.concurrency_mode is not None:
        request.concurrency_mode = _MODES[ConcurrencyMode(spec.concurrency_mode)]


_POLICIES = {
    DependencyFailurePolicy.FAIL: jobs_pb2.DEPENDENCY_FAILURE_POLICY_FAIL,
    DependencyFailurePolicy.CANCEL: jobs_pb2.DEPENDENCY_FAILURE_POLICY_CANCEL,
    DependencyFailurePolicy.RUN_ANYWAY: jobs_pb2.DEPENDENCY_FAILURE_POLICY_RUN_ANYWAY,
}


def with_after(request: jobs_pb2.SubmitJobRequest, spec: JobSpec) -> None:
    """Set the jobs ``spec`` runs after, and its policy, on ``request``."""
    request.after.extend(a.name if isinstance(a, Job) else str(a) for a in spec.after)
    if spec.after_failure is not None:
        request.after_failure = _POLICIES[DependencyFailurePolicy(spec.after_failure)]


def batches(
    requests: Iterable[jobs_pb2.SubmitJobRequest],
    *,
    size: int = MAX_BATCH_SIZE,
    max_bytes: int = MAX_BATCH_BYTES,
) -> Iterator[list[jobs_pb2.SubmitJobRequest]]:
    """``requests`` in order, in calls of at most ``size`` requests and ``max_bytes``."""
    batch: list[jobs_pb2.SubmitJobRequest] = []
    used = 0
    for request in requests:
        cost = request.ByteSize() + _FRAMING_BYTES
        if batch and (len(batch) >= size or used + cost > max_bytes):
            yield batch
            batch, used = [], 0
        batch.append(request)
        used += cost
    if batch:
        yield batch


_ITEM = re.compile(r"requests\[(\d+)\]")


def shifted(error: JobplaneError, offset: int) -> JobplaneError:
    """``error`` of a call whose first request is the caller's ``offset``-th,
    naming the request by its index among all the caller's (``requests[i]``)."""
    if offset == 0 or "index" not in error.metadata:
        return error
    index = int(error.metadata["index"]) + offset

    def renumber(text: str) -> str:
        return _ITEM.sub(lambda m: f"requests[{int(m.group(1)) + offset}]", text, count=1)

    return type(error)(
        renumber(error.message),
        field=renumber(error.field) if error.field else error.field,
        metadata={**error.metadata, "index": str(index)},
        retry_delay=error.retry_delay,
    )
