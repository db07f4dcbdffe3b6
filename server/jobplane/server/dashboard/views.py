"""The dashboard's pages and streams."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from jobplane.errors import InvalidArgument, JobNotFound, TenantLimitExceeded
from jobplane.names import parse_job_name
from jobplane.server.dashboard import live
from jobplane.server.dashboard.app import (
    BACKEND,
    CODEC,
    COUNTS,
    DEPLOYMENT,
    RATES,
    SECURE,
    THROTTLE,
    TRUSTED_PROXIES,
    render,
    still_signed_in,
    viewer,
)
from jobplane.server.dashboard.forms import (
    WAITING_CODES,
    BadField,
    JobFilters,
    after_seq,
    event_patterns,
    job_filters,
    no_query,
    single,
)
from jobplane.server.dashboard.session import (
    SESSION_COOKIE,
    SIGNIN_COOKIE,
    SIGNIN_SECONDS,
    client_address,
)
from jobplane.server.events import SubscribeStart
from jobplane.store.events import Position
from jobplane.store.keys import KeyIdentity, WorkerIdentity, hash_key
from jobplane.types import EventType, JobEvent, JobState

routes = web.RouteTableDef()

MAX_KEY_LENGTH = 200
_ENDING = frozenset(
    {
        EventType.SUCCEEDED,
        EventType.FAILED,
        EventType.CANCELLED,
        EventType.RETRY_SCHEDULED,
        EventType.STAGE_SUCCEEDED,
    }
)


def _job_name(request: web.Request) -> str:
    """``jobs/{id}`` of the path; an id that names no job is a 404, like a foreign one."""
    name = f"jobs/{request.match_info['id']}"
    try:
        parse_job_name(name)
    except InvalidArgument:
        raise JobNotFound(f"{name} not found") from None
    return name


def _next_path(raw: str) -> str:
    """Where to go after signing in: a path of this site only.

    No whitespace or control character either: browsers drop tabs and line
    breaks from URLs, and ``/<tab>/host`` would become ``//host``.
    """
    if (
        raw.startswith("/")
        and not raw.startswith("//")
        and "\\" not in raw
        and len(raw) < 1024
        and all(c.isprintable() and not c.isspace() for c in raw)
    ):
        return raw
    return "/jobs"


# -- sign-in ----------------------------------------------------------------


@routes.get("/signin")
async def signin_form(request: web.Request) -> web.StreamResponse:
    """The sign-in form, bound to a fresh sign-in cookie."""
    raw = single(request.query, ("next",))
    return _signin_page(request, _next_path(raw.get("next", "/jobs")))


def _signin_page(
    request: web.Request, next_path: str, *, problem: str = "", status: int = 200
) -> web.StreamResponse:
    nonce, token = request.app[CODEC].signin_nonce(request.cookies.get(SIGNIN_COOKIE))
    response = render(
        request, "signin.html", status=status, token=token, next=next_path, problem=problem
    )
    response.set_cookie(
        SIGNIN_COOKIE,
        nonce,
        max_age=int(SIGNIN_SECONDS),
        path="/signin",
        httponly=True,
        samesite="Strict",
        secure=request.app[SECURE] or request.secure,
    )
    return response


@routes.post("/signin")
async def signin(request: web.Request) -> web.StreamResponse:
    """Check a tenant key; on success a session cookie, and the page asked for."""
    app = request.app
    client = client_address(
        request.remote, request.headers.getall("X-Forwarded-For", []), app[TRUSTED_PROXIES]
    )
    throttle = app[THROTTLE]
    form = await request.post()
    next_path = _next_path(str(form.get("next", "/jobs")))
    token, key = form.get("token"), form.get("key")
    if not isinstance(token, str) or not app[CODEC].signin_ok(
        request.cookies.get(SIGNIN_COOKIE), token
    ):
        return _signin_page(
            request, next_path, problem="The form expired; sign in again.", status=403
        )
    # Counted as a failure now, before the lookup's await, undone on success.
    wait = throttle.attempt(client)
    if wait > 0:
        response = _signin_page(
            request, next_path, problem="Too many failed sign-ins; wait a minute.", status=429
        )
        response.headers["Retry-After"] = str(max(1, round(wait)))
        return response
    identity = None
    if isinstance(key, str) and len(key) <= MAX_KEY_LENGTH:
        identity = await app[BACKEND].keys.resolve(key.strip())
    if not isinstance(identity, KeyIdentity):
        await asyncio.sleep(throttle.delay)
        problem = (
            "A worker key cannot sign in; use a tenant API key."
            if isinstance(identity, WorkerIdentity)
            else "That API key is not valid."
        )
        return _signin_page(request, next_path, problem=problem, status=401)
    throttle.succeeded(client)
    codec = app[CODEC]
    assert isinstance(key, str)
    session = codec.new(hash_key(key.strip()), identity.key_id)
    response = web.HTTPSeeOther(next_path)
    response.set_cookie(
        SESSION_COOKIE,
        codec.encode(session),
        max_age=int(codec.max_age),
        path="/",
        httponly=True,
        samesite="Strict",
        secure=app[SECURE] or request.secure,
    )
    response.del_cookie(SIGNIN_COOKIE, path="/signin")
    raise response


@routes.post("/signout")
async def signout(request: web.Request) -> web.StreamResponse:
    """End the session (here and in the browser)."""
    request.app[CODEC].end(viewer(request).session)
    response = web.HTTPSeeOther("/signin")
    response.del_cookie(SESSION_COOKIE, path="/")
    raise response


@routes.get("/favicon.ico")
async def favicon(_request: web.Request) -> web.StreamResponse:
    """None (browsers ask for one on every page)."""
    raise web.HTTPNotFound()


@routes.get("/")
async def home(request: web.Request) -> web.StreamResponse:
    """The jobs page."""
    no_query(request.query)
    raise web.HTTPSeeOther("/jobs")


# -- jobs -------------------------------------------------------------------


async def _list(request: web.Request, filters: JobFilters) -> Any:
    who = viewer(request)
    return await request.app[BACKEND].jobs.list(
        who.tenant,
        page_size=filters.size,
        page_token=filters.page,
        state=filters.state,
        job_type=filters.type,
        labels=filters.labels,
        created_after=filters.since,
        created_before=filters.until,
        waiting_code=filters.waiting,
    )


async def _counts(request: web.Request, tenant: uuid.UUID) -> dict[str, int]:
    counts = await request.app[COUNTS].get(tenant)
    return {state.value: int(n) for state, n in counts.items()}


@routes.get("/jobs")
async def jobs_page(request: web.Request) -> web.StreamResponse:
    """Jobs, newest first, filtered; live progress and counts by state."""
    filters = job_filters(request.query)
    page = await _list(request, filters)
    query = {k: v for k, v in request.query.items() if k != "page" and v}
    next_link = ""
    if page.next_page_token:
        next_link = "/jobs?" + urlencode({**query, "page": page.next_page_token})
    return render(
        request,
        "jobs.html",
        jobs=page.jobs,
        filters=filters,
        query=query,
        live_query=urlencode(dict(request.query)),
        next_link=next_link,
        counts=await _counts(request, viewer(request).tenant),
        states=[s.value for s in JobState],
        waiting_codes=WAITING_CODES,
        cap=10_000,
    )


@routes.get("/jobs/live")
async def jobs_live(request: web.Request) -> web.StreamResponse:
    """The jobs page's stream: its jobs' events, and the counts by state."""
    filters = job_filters(request.query)
    who = viewer(request)
    backend = request.app[BACKEND]
    page = await _list(request, filters)
    watched = [job for job in page.jobs if not job.state.terminal]
    limiter = backend.limiter
    taken = 0
    try:
        for _ in watched:
            limiter.acquire_stream(who.tenant)
            taken += 1
    except TenantLimitExceeded:
        for _ in range(taken):
            limiter.release_stream(who.tenant)
        raise
    try:
        stream = await live.EventStream.open(request)
        await stream.send(
            "snapshot",
            [
                {
                    "job": job.id,
                    "seq": job.last_seq,
                    "state": job.state.value,
                    "progress": round(job.progress, 4),
                    "message": job.progress_message,
                }
                for job in page.jobs
            ],
        )
        watches = {
            job.id: backend.jobs.watch(who.tenant, job.name, job.last_seq) for job in watched
        }
        await live.serve_jobs(
            stream,
            watches,
            lambda: _counts(request, who.tenant),
            lambda: still_signed_in(request, who.session),
        )
    finally:
        for _ in range(taken):
            limiter.release_stream(who.tenant)
    return stream.response


@dataclass
class AttemptRow:
    """One attempt of a job, from its events."""

    number: int
    stage: str
    worker: str
    start: datetime
    end: datetime | None = None
    outcome: str = "running"
    error: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float | None:
        """How long it ran (None while it runs)."""
        return None if self.end is None else (self.end - self.start).total_seconds()


def _attempts(milestones: Sequence[JobEvent]) -> list[AttemptRow]:
    rows: dict[int, AttemptRow] = {}
    for event in milestones:
        if event.type is EventType.STARTED:
            rows[event.attempt] = AttemptRow(
                event.attempt, event.stage, str(event.data.get("worker", "")), event.event_time
            )
        elif event.type in _ENDING:
            row = rows.get(event.attempt)
            if row is not None and row.end is None:
                row.end = event.event_time
                row.outcome = event.type.value
                error = event.data.get("error")
                row.error = error if isinstance(error, dict) else {}
    return sorted(rows.values(), key=lambda r: r.number, reverse=True)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


#: The children a job's page lists (the newest; the CLI lists them all).
CHILDREN_SHOWN = 100


@routes.get("/jobs/{id}")
async def job_page(request: web.Request) -> web.StreamResponse:
    """One job: payload, result, live progress and events, attempts, stages, errors."""
    no_query(request.query)
    name = _job_name(request)
    who = viewer(request)
    jobs = request.app[BACKEND].jobs
    job = await jobs.get(who.tenant, name)
    recent = await jobs.recent_events(who.tenant, job)
    milestones = await jobs.milestones(who.tenant, name)
    errors = [e for e in milestones if isinstance(e.data.get("error"), dict)]
    # Its child jobs, newest first: each links to its page, which shows its own.
    children = await jobs.list(
        who.tenant, page_size=CHILDREN_SHOWN, page_token="", state=None, job_type="", parent=name
    )
    return render(
        request,
        "job.html",
        job=job,
        tree=await jobs.tree(who.tenant, name),
        children=children.jobs,
        more_children=bool(children.next_page_token),
        events=list(reversed(recent)),
        attempts=_attempts(milestones),
        errors=list(reversed(errors)),
        payload=_pretty(job.payload),
        result=_pretty(job.result) if job.result is not None else "",
        can_cancel=not job.state.terminal,
        can_retry=job.state in (JobState.FAILED, JobState.CANCELLED),
    )


@routes.get("/jobs/{id}/live")
async def job_live(request: web.Request) -> web.StreamResponse:
    """One job's events after ``after`` (or Last-Event-ID), live, until it ends."""
    after = after_seq(request.query, request.headers.get("Last-Event-ID"))
    name = _job_name(request)
    who = viewer(request)
    backend = request.app[BACKEND]
    backend.limiter.acquire_stream(who.tenant)
    try:
        stream = await live.EventStream.open(request)
        await live.serve_job(
            stream,
            backend.jobs.watch(who.tenant, name, after),
            lambda: still_signed_in(request, who.session),
        )
    finally:
        backend.limiter.release_stream(who.tenant)
    return stream.response


@routes.post("/jobs/{id}/cancel")
async def cancel(request: web.Request) -> web.StreamResponse:
    """Cancel the job (a running one is asked to stop)."""
    name = _job_name(request)
    await request.app[BACKEND].jobs.cancel(
        viewer(request).tenant, name, "cancelled from the dashboard"
    )
    raise web.HTTPSeeOther(f"/jobs/{request.match_info['id']}")


@routes.post("/jobs/{id}/retry")
async def retry(request: web.Request) -> web.StreamResponse:
    """A new attempt of a failed or cancelled job."""
    name = _job_name(request)
    form = await request.post()
    stage = form.get("stage", "")
    if not isinstance(stage, str):
        raise BadField("stage", "must be a stage name")
    await request.app[BACKEND].jobs.retry(viewer(request).tenant, name, stage)
    raise web.HTTPSeeOther(f"/jobs/{request.match_info['id']}")


# -- deployment -------------------------------------------------------------


@routes.get("/queues")
async def queues_page(request: web.Request) -> web.StreamResponse:
    """Queue depth and consumers (every tenant's), and the tenant's own rates."""
    no_query(request.query)
    figures = await request.app[DEPLOYMENT].queues.get("")
    rates = await request.app[RATES].get(viewer(request).tenant)
    return render(request, "queues.html", queues=figures, rates=rates, window_minutes=5)


@routes.get("/failed")
async def failed_page(request: web.Request) -> web.StreamResponse:
    """The tenant's messages in the failed queue."""
    no_query(request.query)
    return await _failed(request)


async def _failed(request: web.Request, report: Any = None) -> web.StreamResponse:
    messages = await request.app[DEPLOYMENT].failed_of(viewer(request).tenant)
    return render(request, "failed.html", messages=messages, report=report)


@routes.post("/failed/replay")
async def replay(request: web.Request) -> web.StreamResponse:
    """Re-dispatch the jobs of the tenant's failed messages (one job's, or all)."""
    form = await request.post()
    raw = form.get("job", "")
    if not isinstance(raw, str):
        raise BadField("job", "must be a job name")
    jobs = None
    if raw:
        try:
            jobs = frozenset({parse_job_name(raw if raw.startswith("jobs/") else f"jobs/{raw}")})
        except InvalidArgument:
            raise BadField("job", "must be a job name (jobs/{id})") from None
    report = await request.app[DEPLOYMENT].replay(viewer(request).tenant, jobs)
    return await _failed(request, report)


@routes.get("/workers")
async def workers_page(request: web.Request) -> web.StreamResponse:
    """Registered workers: what they run, their load, their last heartbeat."""
    no_query(request.query)
    workers = await request.app[DEPLOYMENT].workers.get("")
    return render(request, "workers.html", workers=workers)


@routes.get("/events")
async def events_page(request: web.Request) -> web.StreamResponse:
    """The live tail of the tenant's domain events."""
    patterns = event_patterns(request.query)
    return render(
        request,
        "events.html",
        patterns=",".join(patterns),
        live_query=urlencode({"type": ",".join(patterns)}) if patterns else "",
    )


@routes.get("/events/live")
async def events_live(request: web.Request) -> web.StreamResponse:
    """The tenant's domain events from now (or from Last-Event-ID) on."""
    patterns = event_patterns(request.query) or ["#"]
    cursor = request.headers.get("Last-Event-ID", "").strip()
    if cursor:
        Position.parse(cursor, field="Last-Event-ID")
    who = viewer(request)
    backend = request.app[BACKEND]
    backend.limiter.acquire_stream(who.tenant)
    try:
        stream = await live.EventStream.open(request)
        await live.serve_domain_events(
            stream,
            backend.events.subscribe(who.tenant, patterns, cursor, SubscribeStart.LATEST),
            lambda: still_signed_in(request, who.session),
        )
    finally:
        backend.limiter.release_stream(who.tenant)
    return stream.response


routes.static("/static", str(resources.files("jobplane.server.dashboard") / "static"))
