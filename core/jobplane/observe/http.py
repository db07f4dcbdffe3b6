"""The ops listener: ``/metrics`` (Prometheus text), ``/livez`` and ``/readyz``.

One aiohttp app per process, in the process's own event loop, beside the
gRPC server, the relay or the worker (``jobplane dev``: one for all three).

- ``/livez``: 200 whenever the event loop answers; a loop blocked or dead
  answers nothing, which is what a liveness probe is for.
- ``/readyz``: 200 when every readiness check of the process passes (the
  database reachable; for relays and workers the broker channel open and
  consuming), else 503 with a JSON body naming each check that does not.
- ``/metrics``: the process's :class:`~jobplane.observe.metrics.Metrics`,
  refreshed (the scrape-time reads), as ``generate_latest`` writes it.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.aioweb import start_site
from jobplane.config import ConfigError, ListenAddress
from jobplane.observe.metrics import Metrics

log = structlog.get_logger("jobplane.ops")

#: How long one readiness check may take before it counts as not ready.
CHECK_TIMEOUT = 2.0

#: A readiness check: None when ready, else a short reason (or an awaitable of it).
Check = Callable[[], Awaitable[str | None] | str | None]


def database_check(engine: AsyncEngine) -> Check:
    """A readiness check: the database answers ``SELECT 1``."""

    async def check() -> str | None:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        return None

    return check


async def _run(check: Check) -> str | None:
    result = check()
    if inspect.isawaitable(result):
        return await asyncio.wait_for(result, CHECK_TIMEOUT)
    return result


class OpsServer:
    """``/metrics``, ``/livez``, ``/readyz`` on one address; ``start()``, then ``stop()``."""

    def __init__(
        self,
        address: ListenAddress,
        metrics: Metrics,
        *,
        setting: str = "JOBPLANE_METRICS_LISTEN",
        fallback: bool = False,
    ) -> None:
        self._address = address
        self._setting = setting
        # A default address, not one asked for: when it is taken (a second
        # worker on one host), any free port of its host does, said in the log.
        self._fallback = fallback
        self.metrics = metrics
        self._checks: dict[str, Check] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """host:port it listens on (the real port, once started)."""
        return str(ListenAddress(self._address.host, self.port or self._address.port))

    @property
    def fallback(self) -> bool:
        """Whether the address is a default, given up for a free port when taken."""
        return self._fallback

    @property
    def listen(self) -> ListenAddress:
        """The address as configured (port 0: any free one)."""
        return self._address

    def add_check(self, name: str, check: Check) -> None:
        """``/readyz`` is ready only while ``check`` passes (``name`` says which failed)."""
        self._checks[name] = check

    async def start(self) -> None:
        """Bind and serve; a taken port is a ConfigError naming the setting (a
        default one: any free port of its host, logged as ``ops.port.taken``)."""
        try:
            self._runner, self.port = await self._start_on(self._address)
        except ConfigError as exc:
            cause = exc.__cause__
            taken = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
            if not (self._fallback and taken and self._address.port != 0):
                raise
            self._runner, self.port = await self._start_on(ListenAddress(self._address.host, 0))
            log.warning(
                "ops.port.taken",
                default=str(self._address),
                address=self.address,
                hint=f"{self._setting} or --metrics-listen picks one",
            )
        log.info(
            "ops.listening",
            address=self.address,
            metrics=f"http://{self.address}/metrics",
            health=f"http://{self.address}/readyz",
        )

    async def _start_on(self, address: ListenAddress) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        return await start_site(
            app, address, setting=self._setting, access_log=None, handle_signals=False
        )

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = await self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _livez(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        names = list(self._checks)
        results = await asyncio.gather(
            *(_run(self._checks[n]) for n in names), return_exceptions=True
        )
        failing: dict[str, str] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, TimeoutError):
                failing[name] = f"no answer in {CHECK_TIMEOUT:g}s"
            elif isinstance(result, BaseException):
                failing[name] = type(result).__name__
            elif result is not None:
                failing[name] = result
        if failing:
            return web.Response(
                status=503,
                text=json.dumps({"status": "not ready", "not_ready": failing}),
                content_type="application/json",
            )
        return web.json_response({"status": "ready", "checks": names})
