"""A jobplane with its dashboard for a test module, and a signed-in HTTP client."""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from jobplane.server.dashboard import Backend, Dashboard
from jobplane.store.engine import create_engine
from jobplane.topology import Topology, load_topology
from tests.support import services
from tests.support.stack import Stack, start_stack

_modules = itertools.count(1)
_TOKEN = re.compile(r'name="token" value="([^"]+)"')
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class UiStack:
    """The stack, its dashboard, and the dashboard's base URL."""

    stack: Stack
    dashboard: Dashboard

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return self.dashboard.url.rstrip("/")


@asynccontextmanager
async def ui_stack(
    template_db: str,
    run_id: str,
    amqp_url: str,
    *,
    topology: Topology | None = None,
    **dashboard_options: object,
) -> AsyncIterator[UiStack]:
    """A database, topology (the default one, unless given; its names are the
    stack's own either way), server + relay + worker and a dashboard of their own."""
    n = next(_modules)
    name = f"jp_{run_id}_ui{n}"
    await services.create_database(name, template=template_db)
    database_url = services.pg_url(name)
    engine = create_engine(database_url, pool_size=10)
    topology = (topology or load_topology()).prefixed(f"ui{n}.")
    stack = await start_stack(engine, database_url, amqp_url, topology)
    dashboard = Dashboard(
        Backend.of_server(stack.server, amqp_url),
        listen="127.0.0.1:0",
        cache_seconds=0.2,
        counts_seconds=0.2,
        signin_delay=0.1,
        **{"failed_seconds": 0.2, **dashboard_options},  # type: ignore[arg-type]
    )
    try:
        await dashboard.start()
        yield UiStack(stack, dashboard)
    finally:
        await dashboard.stop()
        await stack.close()
        await engine.dispose()
        await services.delete_topology(amqp_url, topology)
        await services.drop_database(name)


def form_token(page: str) -> str:
    """The sign-in form's token."""
    found = _TOKEN.search(page)
    assert found, "no sign-in token in the page"
    return found.group(1)


def csrf_token(page: str) -> str:
    """The session's CSRF token, as a page's forms carry it."""
    found = _CSRF.search(page)
    assert found, "no CSRF token in the page"
    return found.group(1)


@asynccontextmanager
async def browserless(base: str, key: str | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client with a cookie jar (signed in with ``key``, when given)."""
    jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1
    async with aiohttp.ClientSession(base, cookie_jar=jar) as http:
        if key is not None:
            await sign_in(http, key)
        yield http


async def sign_in(http: aiohttp.ClientSession, key: str) -> aiohttp.ClientResponse:
    """Sign in with ``key`` through the form; the final response."""
    async with http.get("/signin") as form:
        token = form_token(await form.text())
    async with http.post("/signin", data={"key": key, "token": token, "next": "/jobs"}) as done:
        await done.read()
        return done
