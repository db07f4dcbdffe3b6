"""The schedule calls of :class:`~jobplane.client.AsyncClient`: recurring schedules
(create, get, list, update, pause, resume, trigger, delete; docs/scheduling.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Mapping
from datetime import datetime, timedelta
from typing import Any

from google.protobuf import field_mask_pb2

from jobplane.client._channel import ChannelBase
from jobplane.convert import job_from_pb
from jobplane.schedule_convert import overlap_to_pb, schedule_from_pb, schedule_to_pb
from jobplane.schedule_types import CatchUp, JobTemplate, Overlap, Schedule, SchedulePage, Spec
from jobplane.types import Job
from jobplane.v1 import schedules_pb2, schedules_pb2_grpc

__all__ = ["ScheduleCalls", "schedule_name_of"]

# The keyword arguments of update_schedule that are fields of the spec.
_SPEC_FIELDS = {
    "cron": "cron",
    "time_zone": "time_zone",
    "interval": "interval_seconds",
    "start_time": "start_time",
    "end_time": "end_time",
    "jitter": "jitter_seconds",
}
_TEMPLATE_FIELDS = {
    "type": ("job.type", "type"),
    "payload": ("job.payload", "payload"),
    "labels": ("job.labels", "labels"),
    "max_attempts": ("job.max_attempts", "max_attempts"),
    "attempt_timeout": ("job.timeout", "timeout_seconds"),
}
_SCHEDULE_FIELDS = {
    "description": ("description", "description"),
    "overlap": ("overlap_policy", "overlap"),
    "catch_up": ("catch_up_policy", "catch_up"),
    "catch_up_limit": ("catch_up_limit", "catch_up_limit"),
}


def schedule_name_of(schedule: str | Schedule) -> str:
    """The resource name of a schedule given as a name, an id or a :class:`Schedule`."""
    if isinstance(schedule, Schedule):
        return schedule.name
    return schedule if schedule.startswith("schedules/") else f"schedules/{schedule}"


def _seconds(value: float | timedelta | None) -> float | None:
    return value.total_seconds() if isinstance(value, timedelta) else value


class ScheduleCalls(ChannelBase):
    """The ScheduleService calls."""

    def _schedule_stub(self) -> schedules_pb2_grpc.ScheduleServiceAsyncStub:
        return schedules_pb2_grpc.ScheduleServiceStub(self._get_channel())

    async def create_schedule(
        self,
        type: str,
        payload: dict[str, Any] | None = None,
        *,
        cron: str = "",
        time_zone: str = "",
        interval: float | timedelta | None = None,
        start_time: datetime | None = None,
        end_time: datetime | None = None,
        jitter: float | timedelta | None = None,
        overlap: Overlap = Overlap.SKIP,
        catch_up: CatchUp = CatchUp.SKIP,
        catch_up_limit: int = 0,
        labels: Mapping[str, str] | None = None,
        max_attempts: int = 0,
        attempt_timeout: float | timedelta | None = None,
        description: str = "",
        schedule_id: str = "",
    ) -> Schedule:
        """A schedule that submits a job of ``type`` with ``payload`` on every tick.

        Exactly one of ``cron`` (five fields, in ``time_zone``; UTC when
        empty) and ``interval`` (seconds or a timedelta, at least 1 s).
        ``schedule_id`` names it (``schedules/{schedule_id}``); empty: a
        generated id. The other arguments are SubmitJob's and the policies'
        (docs/scheduling.md).
        """
        schedule = Schedule(
            name="",
            template=JobTemplate(
                type=type,
                payload=dict(payload or {}),
                labels=dict(labels or {}),
                max_attempts=max_attempts,
                timeout_seconds=_seconds(attempt_timeout),
            ),
            spec=Spec(
                cron=cron,
                time_zone=time_zone,
                interval_seconds=_seconds(interval) or 0.0,
                start_time=start_time,
                end_time=end_time,
                jitter_seconds=_seconds(jitter) or 0.0,
            ),
            description=description,
            overlap=overlap,
            catch_up=catch_up,
            catch_up_limit=catch_up_limit,
        )
        request = schedules_pb2.CreateScheduleRequest(
            schedule=schedule_to_pb(schedule), schedule_id=schedule_id
        )
        return schedule_from_pb(await self._call(self._schedule_stub().CreateSchedule, request))

    async def get_schedule(self, name: str | Schedule) -> Schedule:
        """The schedule as stored now (its next and last run, its newest jobs)."""
        request = schedules_pb2.GetScheduleRequest(name=schedule_name_of(name))
        reply = await self._call(self._schedule_stub().GetSchedule, request, repeatable=True)
        return schedule_from_pb(reply)

    async def list_schedules(self, *, page_size: int = 0, page_token: str = "") -> SchedulePage:
        """One page of the caller's schedules, newest first (``page_size`` 0: 50)."""
        request = schedules_pb2.ListSchedulesRequest(page_size=page_size, page_token=page_token)
        reply = await self._call(self._schedule_stub().ListSchedules, request, repeatable=True)
        return SchedulePage(
            schedules=[schedule_from_pb(s) for s in reply.schedules],
            next_page_token=reply.next_page_token,
        )

    async def iter_schedules(self, *, page_size: int = 0) -> AsyncGenerator[Schedule, None]:
        """Every schedule of the caller, page after page."""
        token = ""
        while True:
            page = await self.list_schedules(page_size=page_size, page_token=token)
            for schedule in page.schedules:
                yield schedule
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def update_schedule(self, name: str | Schedule, **changes: Any) -> Schedule:
        """Change the fields given (the keyword arguments of :meth:`create_schedule` but
        ``schedule_id``); the others stay. A :class:`Schedule` without changes is
        written whole. A change to the spec replaces the spec: the fields not given
        are the stored ones (read first)."""
        unknown = set(changes) - set(_SPEC_FIELDS) - set(_TEMPLATE_FIELDS) - set(_SCHEDULE_FIELDS)
        if unknown:
            raise TypeError(f"update_schedule() got unknown fields: {sorted(unknown)}")
        if isinstance(name, Schedule) and not changes:
            return await self._update(name, [])
        current = await self.get_schedule(name)
        paths: list[str] = []
        spec_changes = {_SPEC_FIELDS[k]: v for k, v in changes.items() if k in _SPEC_FIELDS}
        for key in ("interval_seconds", "jitter_seconds"):
            if key in spec_changes:
                spec_changes[key] = _seconds(spec_changes[key]) or 0.0
        spec = dataclasses.replace(current.spec, **spec_changes)
        if spec_changes:
            paths.append("spec")
        template_changes: dict[str, Any] = {}
        for key, (path, attr) in _TEMPLATE_FIELDS.items():
            if key in changes:
                value = changes[key]
                template_changes[attr] = _seconds(value) if key == "attempt_timeout" else value
                paths.append(path)
        template = dataclasses.replace(current.template, **template_changes)
        others: dict[str, Any] = {}
        for key, (path, attr) in _SCHEDULE_FIELDS.items():
            if key in changes:
                others[attr] = changes[key]
                paths.append(path)
        updated = dataclasses.replace(current, spec=spec, template=template, **others)
        return await self._update(updated, paths)

    async def _update(self, schedule: Schedule, paths: list[str]) -> Schedule:
        request = schedules_pb2.UpdateScheduleRequest(
            schedule=schedule_to_pb(schedule), update_mask=field_mask_pb2.FieldMask(paths=paths)
        )
        return schedule_from_pb(await self._call(self._schedule_stub().UpdateSchedule, request))

    async def pause_schedule(self, name: str | Schedule) -> Schedule:
        """Stop its ticks until :meth:`resume_schedule`."""
        request = schedules_pb2.PauseScheduleRequest(name=schedule_name_of(name))
        reply = await self._call(self._schedule_stub().PauseSchedule, request, repeatable=True)
        return schedule_from_pb(reply)

    async def resume_schedule(self, name: str | Schedule) -> Schedule:
        """Tick again, from the first tick after now."""
        request = schedules_pb2.ResumeScheduleRequest(name=schedule_name_of(name))
        reply = await self._call(self._schedule_stub().ResumeSchedule, request, repeatable=True)
        return schedule_from_pb(reply)

    async def trigger_schedule(
        self, name: str | Schedule, *, request_id: str = "", overlap: Overlap | None = None
    ) -> Job:
        """Submit one run now, whatever its spec and pause say; the job.

        ``overlap``: None (or ``ALLOW_ALL``) runs whatever runs; ``SKIP``
        raises :class:`~jobplane.errors.FailedPrecondition` naming the running
        job while one is QUEUED or RUNNING; ``CANCEL_OTHER`` cancels those
        first. The same ``request_id`` again returns the same job.
        """
        request = schedules_pb2.TriggerScheduleRequest(
            name=schedule_name_of(name),
            request_id=request_id,
            overlap_policy=overlap_to_pb(overlap),
        )
        reply = await self._call(
            self._schedule_stub().TriggerSchedule, request, repeatable=bool(request_id)
        )
        return job_from_pb(reply)

    async def delete_schedule(self, name: str | Schedule) -> None:
        """Delete it; the jobs it started stay."""
        request = schedules_pb2.DeleteScheduleRequest(name=schedule_name_of(name))
        await self._call(self._schedule_stub().DeleteSchedule, request)
