"""The Procrastinate peer: one no-op task on Postgres (psycopg 3), from the environment.

Procrastinate 3's defaults: the connector's psycopg pool as it comes, the
workers woken by LISTEN/NOTIFY. The worker: ``procrastinate --app
bench.peer_apps.procrastinate_app.app worker --concurrency 16``.
"""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

app = App(connector=PsycopgConnector(conninfo=os.environ["BENCH_PROCRASTINATE_DSN"]))


async def noop() -> None:
    """Does nothing: what is left is Procrastinate's own cost per job."""


noop_task = app.task(name="bench.noop")(noop)
