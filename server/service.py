"""The job service: request validation and the rules of each call.

Servicers translate protobuf to these calls and back; nothing here knows gRPC.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jobplane.errors import InvalidArgument, PayloadTooLarge, UnroutableJobType
from jobplane.names import parse_job_name, validate_job_type
from jobplane.server.feeds import FeedHub
from jobplane.store.jobs import JobStore, ListCursor, NewJob
from jobplane.store.listen import Listener
from jobplane.store.rows import dumps
from jobplane.topology import Topology
from jobplane.types import Job, JobEvent, JobPage, JobState

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_ATTEMPTS_LIMIT = 100
MAX_ID_LENGTH = 256
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?$")
MAX_LABEL_VALUE = 256
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0


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


class JobService:
    """Every JobService call, for one tenant at a time."""

    def __init__(
        self,
        store: JobStore,
        hub: Listener,
        topology: Topology,
        *,
        max_payload_bytes: int = 256 * 1024,
        recheck_seconds: float = 30.0,
    ) -> None:
        self._store = store
        self._topology = topology
        self._max_payload_bytes = max_payload_bytes
        self.feeds = FeedHub(store.read_streams, hub, recheck_seconds=recheck_seconds)

    def open(self) -> None:
        """Accept watch streams (again)."""
        self.feeds.open()

    def close_streams(self) -> None:
        """End every watch stream with UNAVAILABLE, so clients resume elsewhere."""
        self.feeds.close()

    async def submit(self, tenant: uuid.UUID, request: SubmitRequest) -> Job:
        """Validate whole, then write job + first event + outbox row at once."""
        job_type = validate_job_type(request.type)
        queue = self._topology.route(job_type)
        if queue is None:
            raise UnroutableJobType(
                f"no queue of the topology takes job type {job_type!r}", field="type"
            )
        size = len(dumps(request.payload).encode())
        if size > self._max_payload_bytes:
            raise PayloadTooLarge(
                f"payload is {size} bytes serialized; the limit is {self._max_payload_bytes}",
                field="payload",
                metadata={"limit": str(self._max_payload_bytes), "size": str(size)},
            )
        if request.max_attempts < 0 or request.max_attempts > MAX_ATTEMPTS_LIMIT:
            raise InvalidArgument(
                f"max_attempts must be 0 (queue default) .. {MAX_ATTEMPTS_LIMIT}",
                field="max_attempts",
            )
        _check_id(request.request_id, "request_id")
        _check_id(request.correlation_id, "correlation_id")
        _check_labels(request.labels)
        timeout = queue.timeout_seconds
        if request.timeout_seconds is not None:
            if not 0 < request.timeout_seconds <= MAX_TIMEOUT_SECONDS:
                raise InvalidArgument(
                    f"timeout must be more than 0 and at most {MAX_TIMEOUT_SECONDS:g} seconds",
                    field="timeout",
                )
            timeout = request.timeout_seconds
        new = NewJob(
            type=job_type,
            queue=queue.name,
            payload=request.payload,
            request_id=request.request_id or str(uuid.uuid4()),
            max_attempts=request.max_attempts or queue.max_attempts,
            correlation_id=request.correlation_id,
            labels=dict(request.labels),
            timeout_seconds=timeout,
        )
        job, _created = await self._store.submit(tenant, new)
        return job

    async def get(self, tenant: uuid.UUID, name: str) -> Job:
        """One job by name."""
        return await self._store.get(tenant, parse_job_name(name))

    async def list(
        self,
        tenant: uuid.UUID,
        *,
        page_size: int,
        page_token: str,
        state: JobState | None,
        job_type: str,
    ) -> JobPage:
        """A page of jobs, newest first, with an opaque keyset token."""
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative", field="page_size")
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        if job_type:
            validate_job_type(job_type)
        filters = _filter_key(state, job_type)
        cursor = _decode_token(page_token, filters) if page_token else None
        jobs = await self._store.list_jobs(
            tenant, limit=limit + 1, after=cursor, state=state, job_type=job_type or None
        )
        next_token = ""
        if len(jobs) > limit:
            jobs = jobs[:limit]
            last = jobs[-1]
            next_token = _encode_token(ListCursor(last.create_time, uuid.UUID(last.id)), filters)
        return JobPage(jobs=jobs, next_page_token=next_token)

    async def cancel(self, tenant: uuid.UUID, name: str, reason: str) -> Job:
        """Cancel a queued job, or ask a running one to stop."""
        if len(reason) > 1024:
            raise InvalidArgument("reason is longer than 1024 characters", field="reason")
        return await self._store.cancel(tenant, parse_job_name(name), reason)

    async def retry(self, tenant: uuid.UUID, name: str) -> Job:
        """A new attempt of a FAILED or CANCELLED job."""
        return await self._store.retry(tenant, parse_job_name(name))

    async def watch(self, tenant: uuid.UUID, name: str, after_seq: int) -> AsyncIterator[JobEvent]:
        """Events with seq > after_seq in order, then live ones, until the end.

        The stream ends after the terminal event, or at once when that event is
        at or before ``after_seq``.
        """
        job_id = parse_job_name(name)
        if after_seq < 0:
            raise InvalidArgument("after_seq must not be negative", field="after_seq")
        async for event in self.feeds.watch(tenant, job_id, after_seq):
            yield event


def _check_id(value: str, field_name: str) -> None:
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(
            f"{field_name} is longer than {MAX_ID_LENGTH} characters", field=field_name
        )
    if any(ord(c) < 32 for c in value):
        raise InvalidArgument(f"{field_name} has control characters", field=field_name)


def _check_labels(labels: dict[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels", field="labels")
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise InvalidArgument(
                f"label key {key!r} must be 1..63 lowercase letters, digits, '.', '_', '-', '/'",
                field=f"labels[{key}]",
            )
        if len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(
                f"label {key!r} is longer than {MAX_LABEL_VALUE} characters",
                field=f"labels[{key}]",
            )


def _filter_key(state: JobState | None, job_type: str) -> str:
    raw = f"{state.value if state else ''}|{job_type}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _encode_token(cursor: ListCursor, filters: str) -> str:
    raw = json.dumps(
        {"t": cursor.create_time.isoformat(), "i": str(cursor.job_id), "f": filters},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_token(token: str, filters: str) -> ListCursor:
    bad = InvalidArgument("page_token is not a token this server created", field="page_token")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        cursor = ListCursor(datetime.fromisoformat(data["t"]), uuid.UUID(data["i"]))
        created_for = data["f"]
    except (ValueError, KeyError, TypeError):
        raise bad from None
    if cursor.create_time.tzinfo is None:
        raise bad
    if created_for != filters:
        raise InvalidArgument(
            "page_token was created for other filters; keep state and type the same",
            field="page_token",
        )
    return cursor
