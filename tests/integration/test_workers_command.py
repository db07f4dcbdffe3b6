"""What ``jobplane workers`` prints, run in-process on a real database.

docs/operations.md: live workers first, then those stopped ('stopped': they said so)
or lost ('lost': they stopped beating) within ``--dead-for`` seconds, newest start
first; a table with each worker's id, status, host:pid, slots, last beat, types and
queues, or with ``--json`` one object a worker. No worker: a line on stderr.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.cli import build_parser
from jobplane.server import admin
from jobplane.store.workers import WorkerStore
from tests.support.commands import environment

LIVE = uuid.UUID("00000000-0000-4000-8000-00000000000a")
STOPPED = uuid.UUID("00000000-0000-4000-8000-00000000000b")
LOST = uuid.UUID("00000000-0000-4000-8000-00000000000c")
LONG_LOST = uuid.UUID("00000000-0000-4000-8000-00000000000d")

# Each worker's times, fixed: (start, heartbeat, expiry) as SQL expressions.
_TIMES = {
    LIVE: ("'2031-05-06 07:08:09.5+00'", "'2031-05-06 07:18:09.9+00'", "now() + interval '1 hour'"),
    STOPPED: ("'2031-05-06 06:00:00+00'", "'2031-05-06 06:30:00+00'", "now() + interval '1 hour'"),
    LOST: ("'2031-05-06 05:00:00+00'", "'2031-05-06 05:10:00+00'", "now() - interval '1 minute'"),
    LONG_LOST: (
        "'2031-05-06 08:00:00+00'",
        "'2031-05-06 08:01:00+00'",
        "now() - interval '2 hours'",
    ),
}


@pytest.fixture
async def workers(
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Any:
    """``jobplane workers ARGV`` in this process: its exit status, stdout and stderr."""
    environment(monkeypatch, {"JOBPLANE_DATABASE_URL": database_url})

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await admin._workers(build_parser().parse_args(["workers", *argv]))
        out, err = capsys.readouterr()
        return code, out, err

    return run


async def _four_workers(engine: AsyncEngine) -> None:
    store = WorkerStore(engine)
    for n, worker_id in enumerate(_TIMES, start=1):
        await store.register(
            worker_id,
            host=f"host-{n}",
            pid=100 + n,
            types=["reports.render", "demo.echo"] if n == 1 else [],
            queues=["jobplane.default", "jobplane.bulk"] if n == 1 else ["jobplane.default"],
            concurrency=8 * n,
            version=f"1.{n}.0",
            ttl=3600,
        )
    await store.stop(STOPPED)
    async with engine.begin() as conn:
        for worker_id, (start, beat, expiry) in _TIMES.items():
            stop = "now() - interval '20 seconds'" if worker_id == STOPPED else "stop_time"
            await conn.execute(
                text(
                    f"UPDATE workers SET start_time = {start}, heartbeat_time = {beat}, "
                    f"expire_time = {expiry}, stop_time = {stop} WHERE id = :id"
                ),
                {"id": worker_id},
            )


async def test_the_table_lists_live_workers_first_then_recent_ends(
    engine: AsyncEngine, workers: Any
) -> None:
    await _four_workers(engine)
    code, out, err = await workers()
    assert (code, err) == (0, "")
    header = f"{'ID':<36}  {'STATUS':<7}  {'HOST:PID':<24}  {'CONC':>4}  {'LAST BEAT':<20}  TYPES"
    assert out.splitlines() == [
        header,
        f"{LIVE}  live     host-1:101                   8  2031-05-06T07:18:09Z  "
        "reports.render, demo.echo  (queues: jobplane.default, jobplane.bulk)",
        f"{STOPPED}  stopped  host-2:102                  16  2031-05-06T06:30:00Z  "
        "-  (queues: jobplane.default)",
        f"{LOST}  lost     host-3:103                  24  2031-05-06T05:10:00Z  "
        "-  (queues: jobplane.default)",
    ]


async def test_dead_for_reaches_back_as_far_as_asked(engine: AsyncEngine, workers: Any) -> None:
    await _four_workers(engine)
    code, out, _ = await workers("--dead-for", "10800")
    assert code == 0
    ids = [line.split()[0] for line in out.splitlines()[1:]]
    # Live first; the rest newest start first: the long-lost one started last.
    assert ids == [str(LIVE), str(LONG_LOST), str(STOPPED), str(LOST)]
    code, out, _ = await workers("--dead-for", "0")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [str(LIVE)]


async def test_json_is_one_object_a_worker(engine: AsyncEngine, workers: Any) -> None:
    await _four_workers(engine)
    code, out, err = await workers("--json")
    assert (code, err) == (0, "")
    objects = [json.loads(line) for line in out.splitlines()]
    assert [o["id"] for o in objects] == [str(LIVE), str(STOPPED), str(LOST)]
    live, stopped, lost = objects
    assert live == {
        "id": str(LIVE),
        "status": "live",
        "host": "host-1",
        "pid": 101,
        "types": ["reports.render", "demo.echo"],
        "queues": ["jobplane.default", "jobplane.bulk"],
        "concurrency": 8,
        "version": "1.1.0",
        "start_time": "2031-05-06T07:08:09.500000+00:00",
        "heartbeat_time": "2031-05-06T07:18:09.900000+00:00",
        "stop_time": None,
    }
    assert (stopped["status"], stopped["types"], stopped["version"]) == ("stopped", [], "1.2.0")
    assert stopped["stop_time"] is not None and stopped["stop_time"].endswith("+00:00")
    assert (lost["status"], lost["stop_time"], lost["concurrency"]) == ("lost", None, 24)
    # Keys sorted: the same worker prints the same line.
    assert out.splitlines()[0] == json.dumps(live, sort_keys=True)


async def test_no_worker_is_a_line_on_stderr(workers: Any) -> None:
    assert await workers() == (0, "", "no live workers\n")
    assert await workers("--json") == (0, "", "")
