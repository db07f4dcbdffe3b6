"""``python -m bench.peer_apps.celery_client JOBS CALLERS``: ``noop.delay()`` from threads."""

from __future__ import annotations

from bench.peer_apps.callers import arguments, threaded
from bench.peer_apps.celery_app import noop_task

if __name__ == "__main__":
    jobs, callers = arguments()
    threaded(noop_task.delay, jobs, callers)
