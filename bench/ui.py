"""Figure: the dashboard's jobs page with 1,000 jobs watched live.

One page (one browser's server-sent event stream, ``/jobs/live``) lists 1,000
running jobs and follows each of them through the server's watch feeds, as
WatchJob does; workers report progress on every job. Measured: the server
process's CPU seconds per second while the events flow, with the page open
and, for the same jobs and load, with no page open; and the delay of each
event from its row's commit time to its arrival on the page (p50, p99).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aiohttp

from tests.support.ports import free_port

if TYPE_CHECKING:
    from bench.run import Bench

JOBS = 1000
STEPS = 10
INTERVAL_MS = 1000
# Long enough for the page to open all its watches before the first report.
# Every job of a round starts reporting this long after its round began: all
# at once, and after the page has opened its watches (submitting 1,000 jobs
# takes a while on a busy machine).
LEAD_MS = 30_000
_TOKEN = re.compile(r'name="token" value="([^"]+)"')


_PORT: list[int] = []


def prepare_ui(bench: Bench) -> None:
    """Serve the dashboard in the bench's server process (before it starts)."""
    _PORT.append(free_port())
    bench.extra_env["JOBPLANE_UI_LISTEN"] = f"127.0.0.1:{_PORT[-1]}"


async def _wait_ended(bench: Bench, label: str) -> None:
    """Until the label's jobs have all ended (one connection, polled)."""
    import asyncpg

    from jobplane.store.engine import asyncpg_dsn

    for _ in range(100):  # the machine's Postgres may be full for a moment
        try:
            conn = await asyncpg.connect(asyncpg_dsn(bench.database_url))
            break
        except asyncpg.TooManyConnectionsError:
            await asyncio.sleep(0.2)
    try:
        while True:
            ended = await conn.fetchval(
                "SELECT count(*) FROM jobs WHERE tenant_id = $1 AND labels @> $2::jsonb"
                " AND end_time IS NOT NULL",
                bench.tenant,
                json.dumps({"bench": label}),
            )
            if ended >= JOBS:
                return
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


async def _submit(bench: Bench, label: str) -> float:
    """Submit the round's jobs; the wall-clock time they start reporting at."""
    from jobplane.client import AsyncClient

    start_at = time.time() + LEAD_MS / 1000
    async with AsyncClient(bench.address, bench.key) as client:
        for first in range(0, JOBS, 100):
            payload = {
                "steps": STEPS,
                "interval_ms": INTERVAL_MS,
                # The handler sleeps this long after its claim (just after the submit).
                "start_delay_ms": max(0, int((start_at - time.time()) * 1000)),
            }
            await asyncio.gather(
                *(
                    client.submit("bench.progress", payload, labels={"bench": label})
                    for _ in range(first, min(JOBS, first + 100))
                )
            )
    return start_at


async def _events(response: aiohttp.ClientResponse) -> Any:
    """(kind, data) of each server-sent event."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *frames, buffer = buffer.split(b"\n\n")
        for raw in frames:
            kind, data = "", ""
            for line in raw.decode().split("\n"):
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
            if kind:
                yield kind, json.loads(data)


async def fig_ui(bench: Bench) -> None:
    """Run the figure (a worker of its own runs all 1,000 jobs at once)."""
    from bench.run import Figure, cpu_seconds, percentile

    await bench.start(
        "uiworker",
        "worker",
        "--handlers",
        "bench.handlers:registry",
        "--concurrency",
        str(JOBS),
    )
    await asyncio.sleep(2.0)
    base = f"http://127.0.0.1:{_PORT[-1]}"
    config: dict[str, Any] = {"jobs": JOBS, "steps": STEPS, "interval_ms": INTERVAL_MS, "pages": 1}
    jar = aiohttp.CookieJar(unsafe=True)
    timeout = aiohttp.ClientTimeout(total=600, sock_read=120)
    async with aiohttp.ClientSession(base, cookie_jar=jar, timeout=timeout) as http:
        form = await (await http.get("/signin")).text()
        token = _TOKEN.search(form)
        assert token is not None, "no sign-in form"
        await http.post("/signin", data={"key": bench.key, "token": token.group(1)})

        # Without a page: what the same jobs cost the server when nobody looks.
        start_at = await _submit(bench, "ui-nopage")
        await asyncio.sleep(max(0.0, start_at - time.time()))
        before, started = cpu_seconds(bench), time.monotonic()
        await asyncio.wait_for(_wait_ended(bench, "ui-nopage"), timeout=300)
        idle_cpu = (cpu_seconds(bench).get("server", 0.0) - before.get("server", 0.0)) / (
            time.monotonic() - started
        )

        await _submit(bench, "ui-page")
        delays: list[float] = []
        ended: set[str] = set()
        opened = time.monotonic()
        async with http.get(
            "/jobs/live",
            params={"label": "bench=ui-page", "size": str(JOBS)},
            headers={"Accept": "text/event-stream"},
        ) as stream:
            assert stream.status == 200, await stream.text()
            cpu_start: dict[str, float] | None = None
            window_start = 0.0
            watched = 0
            async for kind, data in _events(stream):
                if kind == "snapshot":
                    watched = sum(1 for j in data if j["state"] in ("queued", "running"))
                    states = collections.Counter(j["state"] for j in data)
                    print(f"ui: snapshot {len(data)} jobs: {dict(states)}", flush=True)
                    print(
                        f"ui: page watches {watched} jobs, opened in "
                        f"{time.monotonic() - opened:.1f} s",
                        flush=True,
                    )
                if kind != "jobs":
                    continue
                now = time.time()
                if cpu_start is None:
                    cpu_start, window_start = cpu_seconds(bench), time.monotonic()
                for event in data:
                    delays.append((now - datetime.fromisoformat(event["time"]).timestamp()) * 1000)
                    if event["state"] in ("succeeded", "failed", "cancelled"):
                        ended.add(event["job"])
                if len(ended) >= watched:
                    break
            cpu_end, window = cpu_seconds(bench), time.monotonic() - window_start
    assert cpu_start is not None, "no event reached the page"
    config["watched"] = watched
    config["events_per_s"] = round(len(delays) / window, 1)
    config["window_s"] = round(window, 1)
    config["load_average_1m"] = os.getloadavg()[0]
    used = {k: cpu_end.get(k, 0.0) - cpu_start.get(k, 0.0) for k in ("server", "postgres")}
    bench.add(Figure("ui_server_cpu_per_s", used["server"] / window, "cpu-s/s", config))
    bench.add(Figure("ui_server_cpu_per_s_no_page", idle_cpu, "cpu-s/s", config))
    bench.add(Figure("ui_postgres_cpu_per_s", used["postgres"] / window, "cpu-s/s", config))
    bench.add(Figure("ui_event_delay_p50", percentile(delays, 50), "ms", config))
    bench.add(Figure("ui_event_delay_p99", percentile(delays, 99), "ms", config))
    bench.add(Figure("ui_events_delivered", len(delays), "events", config))
    await bench.stop("uiworker")
