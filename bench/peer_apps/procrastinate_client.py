"""``python -m bench.peer_apps.procrastinate_client JOBS CALLERS``: ``defer_async`` from
concurrent tasks, each job deferred one at a time."""

from __future__ import annotations

import asyncio

from bench.peer_apps.callers import arguments, concurrent
from bench.peer_apps.procrastinate_app import app, noop_task


async def main() -> None:
    jobs, callers = arguments()
    async with app.open_async():
        await concurrent(noop_task.defer_async, jobs, callers)


if __name__ == "__main__":
    asyncio.run(main())
