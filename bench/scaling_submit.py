"""One submitter of ``--only scaling``: no-op jobs to one server, closed loop, for a while.

    python -m bench.scaling_submit ADDRESS JOB_TYPE SECONDS CALLERS

The key is read from ``JOBPLANE_API_KEY``. The process says ``ready`` on stdout
once its channels are open, waits for ``go`` on stdin (so that every
submitter of a step starts together, after its imports), then submits from
``CALLERS`` concurrent callers, each one call at a time, for ``SECONDS``, and
prints one JSON line: ``{"submitted": N}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from jobplane.client import AsyncClient

#: Callers sharing one gRPC channel.
CALLERS_PER_CHANNEL = 16


async def submit_for(address: str, key: str, job_type: str, seconds: float, callers: int) -> int:
    """Jobs submitted by ``callers`` closed-loop callers in ``seconds`` (after ``go``)."""
    channels = [AsyncClient(address, key) for _ in range(max(1, callers // CALLERS_PER_CHANNEL))]
    submitted = 0

    async def caller(i: int, deadline: float) -> None:
        nonlocal submitted
        client = channels[i % len(channels)]
        while time.monotonic() < deadline:
            await client.submit(job_type, {})
            submitted += 1

    try:
        for client in channels:
            await client.list(page_size=1)  # connected before the clock starts
        print("ready", flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        if line.strip() != "go":
            raise SystemExit("no go from the benchmark")
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(caller(i, deadline) for i in range(callers)))
    finally:
        for client in channels:
            await client.close()
    return submitted


def main(argv: list[str]) -> int:
    address, job_type, seconds, callers = argv
    key = os.environ["JOBPLANE_API_KEY"]
    count = asyncio.run(submit_for(address, key, job_type, float(seconds), int(callers)))
    print(json.dumps({"submitted": count}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
