"""ScheduleService over gRPC: a thin adapter between protobuf and
:class:`~jobplane.server.schedules.ScheduleService`."""

from __future__ import annotations

import uuid

from jobplane.convert import job_to_pb
from jobplane.errors import InvalidArgument
from jobplane.names import job_name
from jobplane.schedule_convert import overlap_from_pb, schedule_from_pb, schedule_to_pb
from jobplane.schedule_types import Schedule
from jobplane.server.schedules import ScheduleService
from jobplane.server.service import JobService
from jobplane.server.servicer import _unary
from jobplane.v1 import jobs_pb2, schedules_pb2, schedules_pb2_grpc


def _schedule_of(
    request: schedules_pb2.CreateScheduleRequest | schedules_pb2.UpdateScheduleRequest,
) -> Schedule:
    """The request's schedule, its output-only fields ignored; required."""
    if not request.HasField("schedule"):
        raise InvalidArgument("schedule is required", field="schedule")
    return schedule_from_pb(request.schedule, output=False)


class ScheduleServiceServicer(schedules_pb2_grpc.ScheduleServiceServicer):
    """The ScheduleService RPCs, for callers the tenant gate admitted."""

    def __init__(self, schedules: ScheduleService, jobs: JobService) -> None:
        self._schedules = schedules
        self._jobs = jobs

    @_unary
    async def CreateSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.CreateScheduleRequest
    ) -> schedules_pb2.Schedule:
        created = await self._schedules.create(tenant, _schedule_of(request), request.schedule_id)
        return schedule_to_pb(created)

    @_unary
    async def GetSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.GetScheduleRequest
    ) -> schedules_pb2.Schedule:
        return schedule_to_pb(await self._schedules.get(tenant, request.name))

    @_unary
    async def ListSchedules(
        self, tenant: uuid.UUID, request: schedules_pb2.ListSchedulesRequest
    ) -> schedules_pb2.ListSchedulesResponse:
        page = await self._schedules.list(
            tenant, page_size=request.page_size, page_token=request.page_token
        )
        return schedules_pb2.ListSchedulesResponse(
            schedules=[schedule_to_pb(s) for s in page.schedules],
            next_page_token=page.next_page_token,
        )

    @_unary
    async def UpdateSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.UpdateScheduleRequest
    ) -> schedules_pb2.Schedule:
        updated = await self._schedules.update(
            tenant, _schedule_of(request), request.update_mask.paths
        )
        return schedule_to_pb(updated)

    @_unary
    async def PauseSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.PauseScheduleRequest
    ) -> schedules_pb2.Schedule:
        return schedule_to_pb(await self._schedules.set_paused(tenant, request.name, True))

    @_unary
    async def ResumeSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.ResumeScheduleRequest
    ) -> schedules_pb2.Schedule:
        return schedule_to_pb(await self._schedules.set_paused(tenant, request.name, False))

    @_unary
    async def TriggerSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.TriggerScheduleRequest
    ) -> jobs_pb2.Job:
        job_id = await self._schedules.trigger(
            tenant,
            request.name,
            request.request_id,
            overlap_from_pb(request.overlap_policy),
        )
        return job_to_pb(await self._jobs.get(tenant, job_name(job_id)))

    @_unary
    async def DeleteSchedule(
        self, tenant: uuid.UUID, request: schedules_pb2.DeleteScheduleRequest
    ) -> schedules_pb2.DeleteScheduleResponse:
        await self._schedules.delete(tenant, request.name)
        return schedules_pb2.DeleteScheduleResponse()
