"""The schedule service: the rules of each ScheduleService call (ADR-0041).

A schedule's job template (a job type, or a pipeline) is checked as SubmitJob
checks a request, with the same limits, so a tick never submits what SubmitJob
would refuse (but for a topology changed since: that tick's refusal is the
schedule's last_error).
Nothing here knows gRPC; :mod:`jobplane.server.schedule_servicer` translates.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.errors import InvalidArgument, JobplaneError, UnroutableJobType, shown
from jobplane.names import validate_job_type
from jobplane.schedule_spec import MAX_CATCH_UP_LIMIT, Overlap, check_spec
from jobplane.schedule_types import SCHEDULE_LABEL, JobTemplate, Schedule, SchedulePage
from jobplane.server.job_requests import (
    MAX_LABELS,
    MAX_REQUEST_ID_LENGTH,
    SubmitRequest,
    check_blobs,
    check_id,
    check_labels,
    check_payload,
)
from jobplane.store.job_submit import (
    MAX_ATTEMPTS_LIMIT,
    MAX_TIMEOUT_SECONDS,
    MIN_TIMEOUT_SECONDS,
)
from jobplane.store.rows import check_payload_size
from jobplane.store.schedule_ticks import trigger
from jobplane.store.schedules import ScheduleStore
from jobplane.topology import Topology

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

__all__ = ["UPDATABLE_FIELDS", "ScheduleService", "parse_schedule_name"]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_DESCRIPTION_LENGTH = 1024
# AIP-122: a caller's id starts with a letter; a generated one is a uuid.
_GIVEN_ID = re.compile(r"[a-z]([a-z0-9-]{0,61}[a-z0-9])?")
_ANY_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
#: The update_mask paths UpdateSchedule takes.
UPDATABLE_FIELDS = frozenset(
    {
        "description",
        "job",
        "job.type",
        "job.payload",
        "job.labels",
        "job.max_attempts",
        "job.timeout",
        "spec",
        "overlap_policy",
        "catch_up_policy",
        "catch_up_limit",
    }
)
_TEMPLATE_FIELDS = {
    "job.type": "type",
    "job.payload": "payload",
    "job.labels": "labels",
    "job.max_attempts": "max_attempts",
    "job.timeout": "timeout_seconds",
}
_SCHEDULE_FIELDS = {
    "description": "description",
    "spec": "spec",
    "overlap_policy": "overlap",
    "catch_up_policy": "catch_up",
    "catch_up_limit": "catch_up_limit",
}


def parse_schedule_name(name: str, field: str = "name") -> str:
    """The id of ``schedules/{id}``; INVALID_ARGUMENT otherwise."""
    schedule_id = name.removeprefix("schedules/")
    if schedule_id == name or not _ANY_ID.fullmatch(schedule_id):
        raise InvalidArgument(f"{shown(name)} is not a schedule name", field=field)
    return schedule_id


def _under(error: JobplaneError, prefix: str) -> JobplaneError:
    """``error`` with its field under ``prefix`` (``payload`` → ``schedule.job.payload``)."""
    field = f"{prefix}.{error.field}" if error.field else prefix
    return type(error)(error.message, field=field, metadata=error.metadata)


class ScheduleService:
    """Every ScheduleService call, for one tenant at a time."""

    def __init__(
        self,
        engine: AsyncEngine,
        topology: Topology,
        *,
        max_payload_bytes: int = 256 * 1024,
        blobs: BlobStore | None = None,
    ) -> None:
        self._engine = engine
        self._store = ScheduleStore(engine)
        self._topology = topology
        self._max_payload_bytes = max_payload_bytes
        self._blobs = blobs

    def check(self, schedule: Schedule, prefix: str = "schedule") -> None:
        """Refuse a schedule that could not tick, naming the field; writes nothing."""
        if len(schedule.description) > MAX_DESCRIPTION_LENGTH or "\x00" in schedule.description:
            raise InvalidArgument(
                f"description must be at most {MAX_DESCRIPTION_LENGTH} characters, without NUL",
                field=f"{prefix}.description",
            )
        self._check_template(schedule.template, f"{prefix}.job")
        check_spec(schedule.spec, f"{prefix}.spec")
        if not 0 <= schedule.catch_up_limit <= MAX_CATCH_UP_LIMIT:
            raise InvalidArgument(
                f"catch_up_limit must be 0 (100) .. {MAX_CATCH_UP_LIMIT}",
                field=f"{prefix}.catch_up_limit",
            )

    def _check_template(self, template: JobTemplate, prefix: str) -> None:
        try:
            job_type = validate_job_type(template.type)
            # A pipeline's stages route by the topology's own check.
            pipeline = self._topology.pipeline(job_type)
            if pipeline is None and self._topology.route(job_type) is None:
                raise UnroutableJobType(
                    f"no queue of the topology takes job type {job_type!r}", field="type"
                )
            check_payload_size(template.payload, self._max_payload_bytes)
            check_payload(template.payload)
            check_labels(template.labels)
            if len(template.labels) >= MAX_LABELS or SCHEDULE_LABEL in template.labels:
                raise InvalidArgument(
                    f"at most {MAX_LABELS - 1} labels, not {SCHEDULE_LABEL!r}: each run "
                    "carries the schedule's name in it",
                    field="labels",
                )
            if not 0 <= template.max_attempts <= MAX_ATTEMPTS_LIMIT:
                raise InvalidArgument(
                    f"max_attempts must be 0 (queue default) .. {MAX_ATTEMPTS_LIMIT}",
                    field="max_attempts",
                )
            timeout = template.timeout_seconds
            if timeout is not None and not MIN_TIMEOUT_SECONDS <= timeout <= MAX_TIMEOUT_SECONDS:
                raise InvalidArgument(
                    f"timeout must be at least {MIN_TIMEOUT_SECONDS:g} and at most "
                    f"{MAX_TIMEOUT_SECONDS:g} seconds",
                    field="timeout",
                )
        except JobplaneError as exc:
            raise _under(exc, prefix) from None

    async def create(self, tenant: uuid.UUID, schedule: Schedule, schedule_id: str) -> Schedule:
        """Check ``schedule`` whole, then write it; its id is ``schedule_id`` or a new one."""
        if schedule_id and not _GIVEN_ID.fullmatch(schedule_id):
            raise InvalidArgument(
                f"schedule_id {shown(schedule_id)} must be 1 to 63 lowercase letters, digits "
                "and '-', starting with a letter",
                field="schedule_id",
            )
        self.check(schedule)
        await self._check_blobs(tenant, schedule.template)
        name = f"schedules/{schedule_id or uuid.uuid4()}"
        return await self._store.create(tenant, replace(schedule, name=name, paused=False))

    async def _check_blobs(self, tenant: uuid.UUID, template: JobTemplate) -> None:
        """Refuse a payload naming blobs the tenant does not have, as SubmitJob does."""
        request = SubmitRequest(type=template.type, payload=template.payload)
        try:
            await check_blobs(self._blobs, tenant, request)
        except JobplaneError as exc:
            raise _under(exc, "schedule.job") from None

    async def get(self, tenant: uuid.UUID, name: str) -> Schedule:
        """One schedule by name."""
        return await self._store.get(tenant, parse_schedule_name(name))

    async def list(self, tenant: uuid.UUID, *, page_size: int, page_token: str) -> SchedulePage:
        """A page of schedules, newest first, with an opaque keyset token."""
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative", field="page_size")
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _decode_token(page_token) if page_token else None
        found = await self._store.list(tenant, limit=limit + 1, after=after)
        token = ""
        if len(found) > limit:
            found = found[:limit]
            last = found[-1]
            if last.create_time is not None:
                token = _encode_token(last.create_time, last.id)
        return SchedulePage(schedules=found, next_page_token=token)

    async def update(self, tenant: uuid.UUID, schedule: Schedule, mask: Iterable[str]) -> Schedule:
        """The stored schedule with the fields ``mask`` names (all when empty) from
        ``schedule``, checked whole before it is written."""
        schedule_id = parse_schedule_name(schedule.name, "schedule.name")
        paths = set(mask) or {"description", "job", "spec", "overlap_policy"} | {
            "catch_up_policy",
            "catch_up_limit",
        }
        unknown = sorted(paths - UPDATABLE_FIELDS)
        if unknown:
            raise InvalidArgument(
                f"update_mask names {shown(unknown[0])}, which UpdateSchedule cannot change",
                field="update_mask",
            )

        if paths & {"job", "job.payload"}:
            # A blob deleted later is the ticker's refusal; one missing now is the caller's.
            await self._check_blobs(tenant, schedule.template)

        def change(current: Schedule) -> Schedule:
            merged = _merged(current, schedule, paths)
            self.check(merged)
            return merged

        return await self._store.update(tenant, schedule_id, change)

    async def set_paused(self, tenant: uuid.UUID, name: str, paused: bool) -> Schedule:
        """Pause, or resume from the first tick after now."""
        return await self._store.update(
            tenant, parse_schedule_name(name), lambda current: replace(current, paused=paused)
        )

    async def trigger(
        self, tenant: uuid.UUID, name: str, request_id: str, overlap: Overlap | None = None
    ) -> uuid.UUID:
        """Submit one run now, minding ``overlap`` (None: run whatever runs); its job's id."""
        schedule_id = parse_schedule_name(name)
        check_id(request_id, "request_id", max_chars=MAX_REQUEST_ID_LENGTH - 100)
        if overlap is Overlap.BUFFER_ONE:
            raise InvalidArgument(
                "overlap_policy BUFFER_ONE is a tick's: a trigger runs now, is refused (SKIP) "
                "or cancels the earlier runs (CANCEL_OTHER)",
                field="overlap_policy",
            )
        return await trigger(
            self._engine, tenant, schedule_id, request_id, overlap, topology=self._topology
        )

    async def delete(self, tenant: uuid.UUID, name: str) -> None:
        """Delete it; the jobs it started stay."""
        await self._store.delete(tenant, parse_schedule_name(name))


def _merged(current: Schedule, given: Schedule, paths: set[str]) -> Schedule:
    """``current`` with the fields ``paths`` name taken from ``given``."""
    template = given.template if "job" in paths else current.template
    template_changes = {
        attr: getattr(given.template, attr)
        for path, attr in _TEMPLATE_FIELDS.items()
        if path in paths and "job" not in paths
    }
    changes = {
        attr: getattr(given, attr) for path, attr in _SCHEDULE_FIELDS.items() if path in paths
    }
    return replace(current, template=replace(template, **template_changes), **changes)


def _encode_token(create_time: datetime, schedule_id: str) -> str:
    raw = json.dumps({"t": create_time.isoformat(), "id": schedule_id}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str) -> tuple[datetime, str]:
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        return datetime.fromisoformat(decoded["t"]), str(decoded["id"])
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument("page_token is not one this call gave", field="page_token") from None
