"""A submit request and its checks: the limits a job must keep, and what refuses it.

:class:`~jobplane.server.service.JobService` checks every SubmitJob and
BatchSubmitJobs request here before it writes anything; the domain events'
service checks a payload the same way (:func:`check_payload`).
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jobplane.blobs.names import parse_blob_name, referenced_digests
from jobplane.config import MAX_OFFLOADED_JSON_BYTES
from jobplane.errors import (
    BlobNotFound,
    BlobReferenceNotFound,
    BlobsDisabled,
    InvalidArgument,
    PayloadTooLarge,
    shown,
)
from jobplane.store.jobs import NewJob, pipeline_stages
from jobplane.topology import PipelineSpec
from jobplane.types import BlobRef, JobState

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

#: The most requests one BatchSubmitJobs call may hold (AIP-233's usual bound).
MAX_BATCH_SUBMIT = 1000
#: The largest BatchSubmitJobs body the server reads (the SDK splits its
#: batches below half of it): 1,000 jobs of 8 KiB payloads fit.
MAX_BATCH_REQUEST_BYTES = 16 * 1024 * 1024
MAX_REQUEST_ID_LENGTH = 256
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?")
# What an id may not hold: the C0 control characters.
_CONTROL = re.compile(r"[\x00-\x1f]")
MAX_LABEL_VALUE = 256
MAX_BLOB_REFERENCES = 10_000
# Objects and arrays on the deepest path of a payload, the payload itself
# counted. protobuf refuses to decode messages nested more than 100 deep, and
# every object level of a Struct costs three of those (Struct, map entry,
# Value): a Job inside a ListJobsResponse holds 33 object levels at most, so
# 32 leaves one to spare, for the client that decodes the list.
MAX_PAYLOAD_DEPTH = 32

# The Struct encoding of a payload is at most 5.5 times its JSON: a list of
# one-digit numbers costs 2 bytes a number in JSON ("0,") and 11 in a Struct
# (a Value of a tag and 8 bytes, framed as a list element). Everything else a
# SubmitJobRequest holds at its limits (64 labels of 256 four-byte characters,
# the ids, the type) takes less than 72 KiB.
STRUCT_BYTES_PER_JSON_BYTE = 5.5
REQUEST_OVERHEAD_BYTES = 128 * 1024


def max_request_bytes(max_payload_bytes: int) -> int:
    """The largest body a valid request can need, for the server's receive limit."""
    return math.ceil(max_payload_bytes * STRUCT_BYTES_PER_JSON_BYTE) + REQUEST_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A SubmitJob call, as plain values."""

    type: str
    payload: dict[str, Any]
    request_id: str = ""
    correlation_id: str = ""
    max_attempts: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float | None = None
    #: ``blobs/{sha256}`` of the caller's blob holding the payload; ``payload`` empty.
    payload_blob: str = ""
    #: Names of blobs the job uses that the payload does not show.
    blob_references: tuple[str, ...] = ()
    # Delayed jobs (docs/scheduling.md): at most one of the two.
    #: When the job may first start.
    schedule_time: datetime | None = None
    #: Seconds after the server accepts the request.
    schedule_delay_seconds: float | None = None
    # Concurrency keys (checked by jobplane.server.key_requests).
    concurrency_key: str = ""
    concurrency_limit: int = 0
    #: ConcurrencyMode's number in jobs.proto.
    concurrency_mode: int = 0
    # Deadlines (docs/scheduling.md#deadlines): at most one of the two.
    #: When the job must have ended.
    deadline: datetime | None = None
    #: Seconds after the server accepts the request.
    deadline_after_seconds: float | None = None
    # Dependencies (checked by jobplane.server.after_requests).
    #: Names (``jobs/{id}``) of the jobs it runs after.
    after: tuple[str, ...] = ()
    #: DependencyFailurePolicy's number in jobs.proto.
    after_failure: int = 0


async def check_blobs(
    blobs: BlobStore | None, tenant: uuid.UUID, request: SubmitRequest
) -> tuple[BlobRef | None, tuple[str, ...]]:
    """Refuse references to blobs the tenant does not have; the payload's blob, if
    any, and the digests of ``blob_references``.

    The references are recorded with the job, in the statement that inserts
    it: the payload's names by the table's trigger (migration 0013), the
    others by the machine's BlobReferences hook.
    """
    digests = referenced_digests(request.payload)
    if request.payload_blob and request.payload:
        raise InvalidArgument(
            "payload_blob replaces payload: send one of them", field="payload_blob"
        )
    if len(request.blob_references) > MAX_BLOB_REFERENCES:
        raise InvalidArgument(
            f"at most {MAX_BLOB_REFERENCES} blob_references", field="blob_references"
        )
    extra: set[str] = set()
    for name in request.blob_references:
        try:
            extra.add(parse_blob_name(name))
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="blob_references") from None
    references = tuple(sorted(extra - digests))
    if not digests and not extra and not request.payload_blob:
        return None, ()
    if blobs is None:
        raise BlobsDisabled(
            "this server has no object store: a payload cannot reference blobs",
            field="payload_blob" if request.payload_blob else "payload",
        )
    missing = (digests | extra) - await blobs.owned(tenant, digests | extra)
    if missing:
        raise BlobReferenceNotFound(
            f"the job references blobs/{min(missing)}, which does not exist",
            field="payload" if missing & digests else "blob_references",
        )
    if not request.payload_blob:
        return None, references
    try:
        parse_blob_name(request.payload_blob)
        info = await blobs.stat(tenant, request.payload_blob)
    except (ValueError, BlobNotFound) as exc:
        raise BlobReferenceNotFound(
            f"payload_blob: {exc}"
            if isinstance(exc, ValueError)
            else f"payload_blob {shown(request.payload_blob)} does not exist",
            field="payload_blob",
        ) from None
    if info.size > MAX_OFFLOADED_JSON_BYTES:
        raise PayloadTooLarge(
            f"a payload by reference may have at most {MAX_OFFLOADED_JSON_BYTES} bytes "
            f"(the worker reads it whole), not {info.size}",
            field="payload_blob",
        )
    return BlobRef(info.name, info.digest, info.size), references


def pipeline_job(
    request: SubmitRequest,
    pipeline: PipelineSpec,
    payload_blob: BlobRef | None = None,
    references: tuple[str, ...] = (),
) -> NewJob:
    """A pipeline job: its stages, as the topology declares them now, go with it.

    A request's max_attempts or timeout, when set, is every stage's.
    """
    stages = pipeline_stages(
        pipeline, max_attempts=request.max_attempts, timeout_seconds=request.timeout_seconds
    )
    return NewJob(
        type=pipeline.name,
        queue=stages[0].queue,
        payload=request.payload,
        request_id=request.request_id or str(uuid.uuid4()),
        max_attempts=request.max_attempts,
        correlation_id=request.correlation_id,
        labels=dict(request.labels),
        timeout_seconds=request.timeout_seconds or 0.0,
        pipeline_version=pipeline.version,
        stages=stages,
        payload_blob=payload_blob,
        blob_references=references,
    )


def check_id(
    value: str, field_name: str, *, max_chars: int | None = None, max_bytes: int | None = None
) -> None:
    """Refuse an id longer than its limit or holding control characters."""
    if max_chars is not None and len(value) > max_chars:
        raise InvalidArgument(
            f"{field_name} is longer than {max_chars} characters", field=field_name
        )
    if max_bytes is not None and len(value.encode()) > max_bytes:
        raise InvalidArgument(
            f"{field_name} is longer than {max_bytes} bytes in UTF-8", field=field_name
        )
    if _CONTROL.search(value):
        raise InvalidArgument(f"{field_name} has control characters", field=field_name)


#: The request_ids of the jobs the system submits: a fan-out's children
#: (``fan:{job}:{stage}:{attempt}:{item}``, ADR-0047) and a job's child jobs
#: (``child:{job}:{key}``, ADR-0046). A caller's job with one would be
#: taken for that child (or make its spawn fail).
SYSTEM_REQUEST_ID_PREFIXES = ("fan:", "child:")


def check_request_id(value: str, max_chars: int) -> None:
    """Refuse a request_id :func:`check_id` refuses, or one in the system's space."""
    check_id(value, "request_id", max_chars=max_chars)
    if value.startswith(SYSTEM_REQUEST_ID_PREFIXES):
        raise InvalidArgument(
            f"request_id {shown(value)} starts with {shown(value.split(':', 1)[0] + ':')}, "
            f"which is the system's (its prefixes: {', '.join(SYSTEM_REQUEST_ID_PREFIXES)})",
            field="request_id",
        )


_WAITING_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def check_waiting_code(code: str, state: JobState | None) -> None:
    """Refuse a list's ``waiting_code`` that is no code (UPPER_SNAKE, at most 64
    characters), or one with a state other than QUEUED (only queued jobs wait)."""
    if not code:
        return
    if not _WAITING_CODE.fullmatch(code):
        raise InvalidArgument(
            f"waiting_code {shown(code)} must be a code such as SCHEDULED or "
            "CONCURRENCY_LIMIT (UPPER_SNAKE, at most 64 characters)",
            field="waiting_code",
        )
    if state is not None and state is not JobState.QUEUED:
        raise InvalidArgument(
            f"waiting_code names why a QUEUED job waits: not with state {state.value}",
            field="waiting_code",
        )


def check_labels(labels: dict[str, str]) -> None:
    """Refuse too many labels, a key that is no label key, or a value too long or with NUL."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels", field="labels")
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            # The field names the map, not the key: the key is what is wrong,
            # and it may be of any length.
            raise InvalidArgument(
                f"label key {shown(key)} must be 1..63 lowercase letters, digits, "
                "'.', '_', '-', '/'",
                field="labels",
            )
        if len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(
                f"label {key!r} is longer than {MAX_LABEL_VALUE} characters",
                field=f"labels[{key}]",
            )
        if "\x00" in value:
            raise InvalidArgument(f"label {key!r} has a NUL character", field=f"labels[{key}]")


def check_payload(payload: dict[str, Any]) -> None:
    """Refuse what JSON, Postgres' jsonb or a client's decoder cannot carry.

    Postgres refuses NUL in jsonb strings and keys, JSON has no NaN or
    Infinity, and a payload nested deeper than :data:`MAX_PAYLOAD_DEPTH` could
    be stored and read alone but not inside a list of jobs.
    """
    # Iterative, so no payload can exhaust the interpreter's stack here; each
    # entry keeps its parent's trail rather than a path string, which would
    # copy every ancestor's key for every value.
    pending: list[tuple[Any, int, _Trail]] = [(payload, 1, None)]
    while pending:
        value, depth, trail = pending.pop()
        if isinstance(value, dict | list) and depth > MAX_PAYLOAD_DEPTH:
            raise InvalidArgument(
                f"payload is nested more than {MAX_PAYLOAD_DEPTH} objects or arrays deep "
                f"at {_path(trail)}",
                field="payload",
                metadata={"limit": str(MAX_PAYLOAD_DEPTH)},
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    raise InvalidArgument(
                        f"payload has a key with a NUL character at {_path((trail, key))}",
                        field="payload",
                    )
                pending.append((item, depth + 1, (trail, key)))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, (trail, i)) for i, item in enumerate(value))
        elif isinstance(value, str) and "\x00" in value:
            raise InvalidArgument(f"payload has a NUL character at {_path(trail)}", field="payload")
        elif isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(
                f"payload has {value} at {_path(trail)}; JSON numbers are finite",
                field="payload",
            )


# Where a value sits in a payload: (the parent's trail, key or index), None at the top.
_Trail = tuple[Any, str | int] | None


def _path(trail: _Trail) -> str:
    """Where ``trail`` points in the payload, for an error message."""
    steps: list[str] = []
    while trail is not None:
        trail, step = trail
        steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return shown("payload" + "".join(reversed(steps)))
