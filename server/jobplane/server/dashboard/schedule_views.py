"""The dashboard's schedules: the list, one schedule with its newest runs, and the
operator's actions (pause, resume, trigger now), read and done through the API's
:class:`~jobplane.server.schedules.ScheduleService` (docs/dashboard.md)."""

from __future__ import annotations

import contextlib
import json
import uuid
from urllib.parse import urlencode

from aiohttp import web

from jobplane.errors import InvalidArgument, JobNotFound, ScheduleNotFound
from jobplane.schedule_spec import Overlap
from jobplane.schedule_types import SCHEDULE_LABEL, Schedule
from jobplane.server.dashboard.app import BACKEND, render, viewer
from jobplane.server.dashboard.forms import BadField, single
from jobplane.server.schedules import ScheduleService, parse_schedule_name
from jobplane.types import Job

schedule_routes = web.RouteTableDef()

#: Schedules a page shows.
PAGE_SIZE = 50
#: Runs one schedule's page shows.
RUNS_SHOWN = 20
#: The overlap policies a trigger from the page may ask for ("" : run anyway).
TRIGGER_OVERLAPS = {
    "": None,
    Overlap.ALLOW_ALL.value: Overlap.ALLOW_ALL,
    Overlap.SKIP.value: Overlap.SKIP,
    Overlap.CANCEL_OTHER.value: Overlap.CANCEL_OTHER,
}


def _service(request: web.Request) -> ScheduleService:
    service = request.app[BACKEND].schedules
    if service is None:
        raise web.HTTPNotFound(text="schedules are not served here")
    return service


def _schedule_name(request: web.Request) -> str:
    """``schedules/{id}`` of the path; an id that names none is a 404, like a foreign one."""
    name = f"schedules/{request.match_info['id']}"
    try:
        parse_schedule_name(name)
    except InvalidArgument:
        raise ScheduleNotFound(f"{name} not found") from None
    return name


async def _newest_runs(request: web.Request, schedules: list[Schedule]) -> dict[str, Job]:
    """Each schedule's newest run, by schedule name (a run deleted since is left out)."""
    jobs = request.app[BACKEND].jobs
    tenant = viewer(request).tenant
    newest: dict[str, Job] = {}
    for schedule in schedules:
        if schedule.recent_runs:
            with contextlib.suppress(JobNotFound):
                newest[schedule.name] = await jobs.get(tenant, schedule.recent_runs[0])
    return newest


@schedule_routes.get("/schedules")
async def schedules_page(request: web.Request) -> web.StreamResponse:
    """The tenant's schedules, newest first, with each one's newest run."""
    raw = single(request.query, ("page",))
    page = await _service(request).list(
        viewer(request).tenant, page_size=PAGE_SIZE, page_token=raw.get("page", "")
    )
    next_link = "/schedules?" + urlencode({"page": page.next_page_token})
    return render(
        request,
        "schedules.html",
        schedules=page.schedules,
        newest=await _newest_runs(request, page.schedules),
        next_link=next_link if page.next_page_token else "",
    )


@schedule_routes.get("/schedules/{id}")
async def schedule_page(request: web.Request) -> web.StreamResponse:
    """One schedule: its spec, policies, state and newest runs, and its actions."""
    single(request.query, ())
    name = _schedule_name(request)
    who = viewer(request)
    schedule = await _service(request).get(who.tenant, name)
    runs = await request.app[BACKEND].jobs.list(
        who.tenant,
        page_size=RUNS_SHOWN,
        page_token="",
        state=None,
        job_type="",
        labels={SCHEDULE_LABEL: schedule.name},
    )
    return render(
        request,
        "schedule.html",
        schedule=schedule,
        runs=runs.jobs,
        runs_link="/jobs?" + urlencode({"label": f"{SCHEDULE_LABEL}={schedule.name}"}),
        overlaps=[o for o in TRIGGER_OVERLAPS if o],
        payload=json.dumps(schedule.template.payload, indent=2, sort_keys=True, ensure_ascii=False),
    )


@schedule_routes.post("/schedules/{id}/pause")
async def pause(request: web.Request) -> web.StreamResponse:
    """Stop its ticks until resumed."""
    name = _schedule_name(request)
    await _service(request).set_paused(viewer(request).tenant, name, True)
    raise web.HTTPSeeOther(f"/{name}")


@schedule_routes.post("/schedules/{id}/resume")
async def resume(request: web.Request) -> web.StreamResponse:
    """Tick again, from the first tick after now."""
    name = _schedule_name(request)
    await _service(request).set_paused(viewer(request).tenant, name, False)
    raise web.HTTPSeeOther(f"/{name}")


@schedule_routes.post("/schedules/{id}/trigger")
async def trigger(request: web.Request) -> web.StreamResponse:
    """One run now; ``overlap`` as TriggerSchedule takes it. Its job's page follows."""
    name = _schedule_name(request)
    form = await request.post()
    raw = form.get("overlap", "")
    if not isinstance(raw, str) or raw not in TRIGGER_OVERLAPS:
        raise BadField("overlap", f"must be one of {', '.join(o for o in TRIGGER_OVERLAPS if o)}")
    job_id = await _service(request).trigger(
        viewer(request).tenant, name, "", TRIGGER_OVERLAPS[raw]
    )
    raise web.HTTPSeeOther(f"/jobs/{uuid.UUID(str(job_id))}")
