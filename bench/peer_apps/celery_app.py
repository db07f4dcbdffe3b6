"""The Celery peer: one no-op task; broker and result backend from the environment.

Celery 5's defaults but for what a production job system expects: the
message is acknowledged after the task ran (``task_acks_late``), and the
result is stored in Postgres through SQLAlchemy (``db+postgresql+psycopg://``)
and kept (``result_persistent``). ``worker_prefetch_multiplier`` is Celery's
default (4). The worker: ``celery -A bench.peer_apps.celery_app worker -P
prefork -c 2``.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery(
    "bench_peer",
    broker=os.environ["BENCH_CELERY_BROKER"],
    backend=os.environ["BENCH_CELERY_BACKEND"],
)
app.conf.update(
    task_acks_late=True,
    result_persistent=True,
    broker_connection_retry_on_startup=True,
)


def noop() -> None:
    """Does nothing: what is left is Celery's own cost per task."""


noop_task = app.task(name="bench.noop")(noop)
