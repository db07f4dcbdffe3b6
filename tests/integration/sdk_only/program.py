"""Run by the interpreter of a venv that holds the SDK alone (test_sdk_install.py).

Argv: ADDRESS API_KEY MODULES_JSON. Imports the SDK, then drives a job end to
end against the real server and prints one JSON object: the server-side
modules that got imported, the versions installed, and what the calls saw.
Run with ``-W error``: a warning (a gencode/runtime mismatch among them)
fails the run.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import sys
from typing import Any

from jobplane.client import AsyncClient, Client, Event, JobNotFound, JobState

ADDRESS, API_KEY, MODULES = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
DISTRIBUTIONS = ("grpcio", "grpcio-status", "protobuf", "googleapis-common-protos", "uuid6")


async def asynchronous() -> dict[str, Any]:
    async with AsyncClient(ADDRESS, API_KEY) as jobs:
        job = await jobs.submit("demo.echo", {"from": "the sdk alone"})
        done = await jobs.wait(job.name, timeout=60)
        events = [event.state.name async for event in jobs.watch(job.name)]
        try:
            await jobs.get("jobs/00000000-0000-7000-8000-000000000000")
            missing = "found"
        except JobNotFound as exc:
            missing = exc.reason
        published = await jobs.publish("sdk.checked", {"job": job.name})
    # Event.new's ids are UUIDv7 (uuid6 before Python 3.14).
    made = Event.new("sdk.made", {}, tenant_id=published.tenant_id)
    return {
        "name": job.name,
        "state": done.state.name,
        "succeeded": done.state is JobState.SUCCEEDED,
        "result": done.result,
        "events": events,
        "missing": missing,
        "published": published.event_type,
        "made_id_version": made.event_id.version,
    }


def synchronous(name: str) -> dict[str, Any]:
    with Client(ADDRESS, API_KEY) as jobs:
        job = jobs.get(name)
        return {"state": job.state.name, "result": job.result}


def main() -> None:
    imported = sorted({m.split(".")[0] for m in sys.modules} & set(MODULES))
    seen = asyncio.run(asynchronous())
    report = {
        "imported_before_calls": imported,
        "imported_after_calls": sorted({m.split(".")[0] for m in sys.modules} & set(MODULES)),
        "versions": {d: importlib.metadata.version(d) for d in DISTRIBUTIONS},
        "async": seen,
        "sync": synchronous(seen["name"]),
    }
    print(json.dumps(report))


main()
