"""The dashboard's aiohttp application: who is signed in, security headers,
error pages, and its lifetime beside the gRPC server.

It holds no state of its own beyond caches: jobs are read through the API's
:class:`~jobplane.server.service.JobService` (so tenant scoping is the API's),
live updates come from the server's feeds, keys are resolved by the server's
:class:`~jobplane.store.keys.KeyStore` cache.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import jinja2
import structlog
from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.aioweb import start_site
from jobplane.config import ConfigError, ListenAddress, Network, parse_listen
from jobplane.errors import (
    FailedPrecondition,
    InvalidArgument,
    JobNotFound,
    ScheduleNotFound,
    TenantLimitExceeded,
    Unavailable,
)
from jobplane.server.dashboard.forms import BadField
from jobplane.server.dashboard.session import (
    SESSION_COOKIE,
    Session,
    SessionCodec,
    SignInThrottle,
)
from jobplane.server.dashboard.shared import FAILED_SECONDS, Cached, Deployment
from jobplane.server.events import EventService
from jobplane.server.limits import TenantLimiter
from jobplane.server.schedules import ScheduleService
from jobplane.server.service import JobService
from jobplane.store.down import database_unavailable
from jobplane.store.keys import KeyIdentity, KeyStore
from jobplane.topology import Topology

log = structlog.get_logger("jobplane.server.dashboard")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: under it a browser sends "Origin: null" with its forms,
    # and the origin check below could not tell them from another site's.
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
# Paths served without a session.
_PUBLIC = ("/signin", "/static/")


@dataclass(frozen=True, slots=True)
class Backend:
    """What the dashboard reads through: the server process's own services."""

    jobs: JobService
    events: EventService
    keys: KeyStore
    limiter: TenantLimiter
    engine: AsyncEngine
    topology: Topology
    amqp_url: str
    #: The schedules page's service (None: no schedules page).
    schedules: ScheduleService | None = None

    @classmethod
    def of_server(cls, server: Any, amqp_url: str) -> Backend:
        """The backend of a running :class:`~jobplane.server.JobplaneServer`."""
        return cls(
            server.service,
            server.events,
            server.keys,
            server.limiter,
            server._engine,
            server._topology,
            amqp_url,
            server.schedules,
        )


@dataclass(frozen=True, slots=True)
class Viewer:
    """The signed-in caller of a request."""

    identity: KeyIdentity
    session: Session
    csrf: str

    @property
    def tenant(self) -> uuid.UUID:
        """The tenant every read is scoped to."""
        return self.identity.tenant_id


BACKEND = web.AppKey("backend", Backend)
CODEC = web.AppKey("codec", SessionCodec)
TEMPLATES = web.AppKey("templates", jinja2.Environment)
THROTTLE = web.AppKey("throttle", SignInThrottle)
DEPLOYMENT = web.AppKey("deployment", Deployment)
COUNTS = web.AppKey("counts", Cached)
RATES = web.AppKey("rates", Cached)
SECURE = web.AppKey("secure", bool)
#: The public origin forms must come from ("": judged per request).
ORIGIN = web.AppKey("origin", str)
#: Proxies whose X-Forwarded-For names the client (the sign-in throttle's key).
TRUSTED_PROXIES = web.AppKey("trusted_proxies", tuple[Network, ...])
VIEWER = web.RequestKey("viewer", Viewer)


def viewer(request: web.Request) -> Viewer:
    """The request's signed-in caller (the guard let no other request through)."""
    return request[VIEWER]


def render(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    """A page from ``template`` with the caller (if any) in its context."""
    env = request.app[TEMPLATES]
    who = request.get(VIEWER)
    page = env.get_template(template).render(viewer=who, path=request.path, **context)
    return web.Response(text=page, status=status, content_type="text/html", charset="utf-8")


def error_page(
    request: web.Request, status: int, title: str, detail: str = "", **extra: Any
) -> web.Response:
    """The one error page (a 404 is the same for an unknown and a foreign id)."""
    return render(request, "error.html", status=status, title=title, detail=detail, **extra)


async def still_signed_in(request: web.Request, session: Session) -> bool:
    """True while the session is within its age, not signed out, and its key still
    resolves to the same tenant key."""
    if not request.app[CODEC].still_valid(session):
        return False
    identity = await request.app[BACKEND].keys.resolve_hash(session.key_hash)
    return isinstance(identity, KeyIdentity) and identity.key_id == session.key_id


@web.middleware
async def guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Resolve the session, refuse what needs one without it, check CSRF, map errors."""
    try:
        return await _guarded(request, handler)
    except web.HTTPException:
        raise
    except BadField as exc:
        return error_page(
            request, 400, "Bad request", f"{exc.field}: {exc.reason}", field=exc.field
        )
    except JobNotFound:
        return error_page(request, 404, "Not found", "There is no such job.")
    except ScheduleNotFound:
        return error_page(request, 404, "Not found", "There is no such schedule.")
    except InvalidArgument as exc:
        name = exc.field or "request"
        return error_page(request, 400, "Bad request", f"{name}: {exc.message}", field=name)
    except FailedPrecondition as exc:
        return error_page(request, 409, "Not possible now", exc.message)
    except TenantLimitExceeded as exc:
        response = error_page(request, 429, "Too many", exc.message)
        response.headers["Retry-After"] = str(max(1, round(exc.retry_delay or 1)))
        return response
    except Unavailable as exc:
        return error_page(request, 503, "Unavailable", exc.message)
    except Exception as exc:
        if not database_unavailable(exc):
            raise
        return error_page(request, 503, "Unavailable", "The database cannot be reached now.")


async def _guarded(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    app = request.app
    session = app[CODEC].decode(request.cookies.get(SESSION_COOKIE))
    identity = None
    if session is not None:
        resolved = await app[BACKEND].keys.resolve_hash(session.key_hash)
        if isinstance(resolved, KeyIdentity) and resolved.key_id == session.key_id:
            identity = resolved
    if session is not None and identity is not None:
        request[VIEWER] = Viewer(identity, session, app[CODEC].csrf(session))
    public = request.path in ("/signin", "/favicon.ico") or request.path.startswith("/static/")
    if request.method == "POST" and not _same_origin(request):
        return error_page(request, 403, "Forbidden", "The form came from another site.")
    if not public and VIEWER not in request:
        if request.headers.get("Accept", "").startswith("text/event-stream"):
            raise web.HTTPUnauthorized(text="sign in first")
        target = request.path_qs if request.method == "GET" else "/jobs"
        response = web.HTTPSeeOther(f"/signin?next={_quoted(target)}")
        if session is None and request.cookies.get(SESSION_COOKIE):
            response.del_cookie(SESSION_COOKIE, path="/")
        raise response
    if request.method == "POST" and not public:
        form = await request.post()
        token = form.get("csrf")
        if not isinstance(token, str) or not app[CODEC].csrf_ok(viewer(request).session, token):
            return error_page(request, 403, "Forbidden", "The form's CSRF token is not valid.")
    return await handler(request)


def _same_origin(request: web.Request) -> bool:
    """Whether a POST may have come from the dashboard's own pages.

    With ``JOBPLANE_UI_ORIGIN`` set, a given ``Origin`` must be exactly it.
    Otherwise the browser's ``Sec-Fetch-Site`` decides when it is sent; when it
    is not, a given ``Origin`` must name this host (over http or https: behind a
    TLS-terminating proxy the socket's scheme is not the browser's). The CSRF
    token and the SameSite=Strict cookie stay the main defence.
    """
    origin = request.headers.get("Origin")
    public = request.app[ORIGIN]
    if public:
        return origin is None or origin.lower() == public
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site == "same-origin"
    return origin is None or origin.lower() in (
        f"http://{request.host}".lower(),
        f"https://{request.host}".lower(),
    )


def _quoted(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="")


async def _security_headers(_request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    response.headers.setdefault("Cache-Control", "no-store")


class Dashboard:
    """The dashboard's web server: ``await start()``, then ``await stop()``."""

    def __init__(
        self,
        backend: Backend,
        *,
        listen: str | ListenAddress = "127.0.0.1:8080",
        setting: str = "JOBPLANE_UI_LISTEN",
        secret: bytes | None = None,
        session_seconds: float = 8 * 3600.0,
        secure_cookie: bool = False,
        cache_seconds: float = 5.0,
        failed_seconds: float = FAILED_SECONDS,
        counts_seconds: float = 2.0,
        signin_delay: float = 0.5,
        origin: str | None = None,
        trusted_proxies: tuple[Network, ...] = (),
    ) -> None:
        from jobplane.server.dashboard.schedule_views import schedule_routes
        from jobplane.server.dashboard.views import routes

        address = parse_listen(listen, name=setting) if isinstance(listen, str) else listen
        if address is None:
            raise ConfigError(f"{setting}: the dashboard is off; give host:port")
        self._listen = address
        self._setting = setting
        self.backend = backend
        app = web.Application(middlewares=[guard], client_max_size=64 * 1024)
        app[BACKEND] = backend
        app[CODEC] = SessionCodec(secret or secrets.token_bytes(32), max_age=session_seconds)
        app[TEMPLATES] = jinja2.Environment(
            loader=jinja2.PackageLoader("jobplane.server.dashboard", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        app[THROTTLE] = SignInThrottle(delay=signin_delay)
        app[DEPLOYMENT] = Deployment(
            backend.engine,
            backend.amqp_url,
            backend.topology,
            ttl=cache_seconds,
            failed_ttl=failed_seconds,
        )
        app[COUNTS] = Cached(backend.jobs.count_states, counts_seconds)
        app[RATES] = Cached(backend.jobs.queue_rates, cache_seconds)
        app[SECURE] = secure_cookie
        app[TRUSTED_PROXIES] = tuple(trusted_proxies)
        app[ORIGIN] = origin.lower().rstrip("/") if origin else ""
        app.on_response_prepare.append(_security_headers)
        app.add_routes(routes)
        app.add_routes(schedule_routes)
        self.app = app
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """host:port it listens on (the real port once started)."""
        return str(ListenAddress(self._listen.host, self.port or self._listen.port))

    @property
    def url(self) -> str:
        """The address to open in a browser."""
        return f"http://{self.address}/"

    async def start(self) -> None:
        """Bind and serve; logs ``ui.listening``."""
        # A client that goes away cancels its handler: a live stream's
        # watches end with the browser tab, not at the next write.
        self._runner, self.port = await start_site(
            self.app,
            self._listen,
            setting=self._setting,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=1.0,
        )
        log.info("ui.listening", address=self.address, url=self.url)

    async def stop(self) -> None:
        """Stop serving (open streams end)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def standalone_backend(
    stack: AsyncExitStack,
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    *,
    limiter: TenantLimiter,
    max_payload_bytes: int,
    db_pool_size: int = 10,
    listen_url: str | None = None,
) -> Backend:
    """A backend of its own for ``jobplane ui`` (no gRPC server in the process):
    the same services and listeners a server has, closed with ``stack``."""
    from jobplane.store.db import Database
    from jobplane.store.events import EventStore
    from jobplane.store.jobs import JobStore
    from jobplane.store.keys import KEYS_CHANNEL
    from jobplane.store.listen import Listener
    from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, EVENTS_CHANNEL

    listen_url = listen_url or database_url  # past PgBouncer (ADR-0048)
    hub = Listener(listen_url, EVENTS_CHANNEL)
    event_hub = Listener(listen_url, DOMAIN_EVENTS_CHANNEL)
    key_events = Listener(listen_url, KEYS_CHANNEL)
    keys = KeyStore(engine)
    key_events.on_notify(keys.forget)
    key_events.on_reset(keys.clear_cache)
    db = await stack.enter_async_context(Database(database_url, size=db_pool_size))
    jobs = JobService(JobStore(engine, db), hub, topology, max_payload_bytes=max_payload_bytes)
    events = EventService(EventStore(engine), event_hub, max_payload_bytes=max_payload_bytes)
    jobs.open()
    events.open()
    stack.push_async_callback(keys.close)
    for listener in (hub, event_hub, key_events):
        await listener.start()
        stack.push_async_callback(listener.stop)
    stack.push_async_callback(jobs.feeds.stop)
    stack.callback(events.close_streams)
    schedules = ScheduleService(engine, topology, max_payload_bytes=max_payload_bytes)
    return Backend(jobs, events, keys, limiter, engine, topology, amqp_url, schedules)
