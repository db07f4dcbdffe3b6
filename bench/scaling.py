"""`--only scaling`: where one Postgres primary stops carrying more, as processes are added.

A sweep: step n runs n servers, n relays and n workers (n = 1 .. ``--scaling-max``)
on this run's database and vhost, and one submitter process per server
(bench/scaling_submit.py: ``--scaling-clients`` closed-loop callers), all
submitting no-op jobs for ``--scaling-warmup`` + ``--scaling-seconds``. Each
step's jobs have a type of their own (``bench.scaling_N``). Per step:

- over the measured window (after the warm-up): jobs/s that *ended* in it,
  the CPU of Postgres (every ``postgres`` process of the server, by /proc:
  the backends of other databases count too, so run it on a quiet server),
  of this database's backends alone (``pg_stat_activity``'s pids), of the
  jobplane processes (servers, relays, workers) and of the submitters, each
  in cores (CPU seconds per second), and the whole machine's busy share;
- per job, over the whole step (from before the first submit until every
  job of the step has ended, so that each job is counted whole): transactions
  committed by this database (``pg_stat_database.xact_commit``; most hot
  paths run one statement a transaction; ``pg_stat_statements`` needs a
  preloaded library the bench does not assume), WAL bytes
  (``pg_current_wal_flush_lsn()``'s difference: the whole server's, other
  databases' writes included) and Postgres CPU ms.

The saturation point is the first step whose jobs/s is not at least
:data:`GAIN` above the best step before it while Postgres's CPU share still
grows; the verdict line says which resource ran out (:func:`verdict`). The
steps are printed as a Markdown table (for docs/scaling.md) after the figures.

Each process holds at most its hot pool + 2 + 1 connections
(docs/operations.md, "Connections per process"); when 3n processes at the
default pool do not fit in what ``max_connections`` leaves free, the step's
``JOBPLANE_DB_POOL_SIZE`` is lowered (:func:`pool_size`, the table's
``pool`` column), and a step that cannot get 3 is not run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from bench import procstat
from bench.scaling_report import (
    Sample,
    Step,
    markdown,
    pool_size,
    saturation,
    step_figures,
    verdict,
)
from bench.wal import snapshot
from jobplane.client import AsyncClient
from tests.support.ports import free_port

if TYPE_CHECKING:
    from bench.run import Bench

#: Connections left free for everything else (the bench's own, psql, autovacuum).
SPARE_CONNECTIONS = 10


def job_type(n: int) -> str:
    """The type of step ``n``'s jobs."""
    return f"bench.scaling_{n}"


#: The jobplane processes, by name without their number (bench.run.cpu_seconds).
JOBPLANE = ("server", "relay", "worker")


async def _db_pids(bench: Bench) -> list[int]:
    rows = await bench.sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid()"
    )
    return [int(r["pid"]) for r in rows]


def _jiffies(pids: list[int]) -> dict[int, int]:
    found = {}
    for pid in pids:
        try:
            stat = procstat.parse_pid_stat(pid, Path(f"/proc/{pid}/stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        found[pid] = stat.jiffies
    return found


#: CPU seconds a Postgres has used so far (the default: every ``postgres`` process's).
PostgresCpu = Callable[[], float]


async def sample(bench: Bench, n: int, postgres: PostgresCpu | None = None) -> Sample:
    """The counters of step ``n`` now (Postgres's CPU by ``postgres``, when given)."""
    from bench.run import cpu_seconds

    rows = await bench.sql(
        "SELECT count(end_time) AS ended FROM jobs WHERE tenant_id = $1 AND type = $2",
        bench.tenant,
        job_type(n),
    )
    cpu = cpu_seconds(bench)
    tick = os.sysconf("SC_CLK_TCK")
    return Sample(
        wall=time.monotonic(),
        ended=int(rows[0]["ended"]),
        postgres=cpu.get("postgres", 0.0) if postgres is None else postgres(),
        jobplane=sum(cpu.get(name, 0.0) for name in JOBPLANE),
        submitters=cpu.get("submit", 0.0),
        machine=procstat.machine_busy_seconds(),
        db_backends={pid: j / tick for pid, j in _jiffies(await _db_pids(bench)).items()},
        kinds={name: cpu.get(name, 0.0) for name in JOBPLANE},
    )


async def connections(bench: Bench) -> tuple[int, int, int]:
    rows = await bench.sql(
        "SELECT current_setting('max_connections')::int AS max, "
        "current_setting('superuser_reserved_connections')::int AS reserved, "
        "(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS used"
    )
    return int(rows[0]["max"]), int(rows[0]["used"]), int(rows[0]["reserved"])


async def _start_server(bench: Bench, i: int) -> str:
    """Server ``i`` on a port of its own (another if it cannot bind it); its address."""
    for _ in range(5):
        address = f"127.0.0.1:{free_port()}"
        proc = await bench.spawn(
            f"server{i}",
            [sys.executable, "-m", "jobplane", "serve"],
            {**bench.env, "JOBPLANE_LISTEN": address},
        )
        async with AsyncClient(address, bench.key) as client:
            from bench.run import wait_ready

            if await wait_ready(client, proc) or proc.returncode is None:
                return address
        del bench.procs[f"server{i}"]
    raise RuntimeError(f"server{i} did not start: see {bench.workdir / f'server{i}.log'}")


async def start_step(bench: Bench, n: int, pool: int) -> list[str]:
    """n servers, relays and workers at hot pool ``pool``, every one ready (a relay
    connected to the broker, a worker consuming); the servers' addresses."""
    bench.extra_env["JOBPLANE_DB_POOL_SIZE"] = str(pool)
    addresses = [await _start_server(bench, i) for i in range(n)]
    pinned, bench.pin_ops_ports = bench.pin_ops_ports, True
    try:
        for i in range(n):
            await bench.start(f"relay{i}", "relay")
            await bench.start(
                f"worker{i}",
                "worker",
                "--handlers",
                "bench.handlers:registry",
                "--concurrency",
                str(bench.args.concurrency),
            )
    finally:
        bench.pin_ops_ports = pinned
    for i in range(n):
        for name in (f"relay{i}", f"worker{i}"):
            await _ready(bench, name)
    return addresses


async def _ready(bench: Bench, name: str, timeout: float = 120) -> None:
    """Until process ``name``'s ``/readyz`` answers 200: on a busy machine a process
    still importing when the submitters start would miss the step's window."""
    url = f"http://127.0.0.1:{bench.ops_ports[name]}/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if bench.procs[name].returncode is not None:
            raise RuntimeError(f"{name} exited: see {bench.workdir / f'{name}.log'}")
        try:
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{name} not ready within {timeout:g}s: see {bench.workdir}")


async def _submitters(
    bench: Bench, n: int, addresses: list[str]
) -> list[asyncio.subprocess.Process]:
    seconds = bench.args.scaling_warmup + bench.args.scaling_seconds
    procs = []
    for i, address in enumerate(addresses):
        argv = [sys.executable, "-m", "bench.scaling_submit", address, job_type(n)]
        argv += [str(seconds), str(bench.args.scaling_clients)]
        env = {**bench.env, "JOBPLANE_API_KEY": bench.key}
        procs.append(await bench.spawn(f"submit{i}", argv, env, pipe=True))
    for proc in procs:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"a submitter did not start: see {bench.workdir}")
    return procs


async def _drained(bench: Bench, n: int, timeout: float = 900) -> int:
    """Until every job of step ``n`` has ended; how many there are."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await bench.sql(
            "SELECT count(*) AS n, count(end_time) AS ended FROM jobs "
            "WHERE tenant_id = $1 AND type = $2",
            bench.tenant,
            job_type(n),
        )
        if rows[0]["n"] == rows[0]["ended"]:
            return int(rows[0]["n"])
        await asyncio.sleep(0.2)
    raise TimeoutError(f"step {n}: not every job ended within {timeout:g}s")


async def run_step(
    bench: Bench, n: int, pool: int, cores: int, *, postgres: PostgresCpu | None = None
) -> Step:
    """One step of the sweep, its processes stopped at the end (``postgres``: whose
    CPU counts as Postgres's, when not every ``postgres`` process's)."""
    try:
        addresses = await start_step(bench, n, pool)
        procs = await _submitters(bench, n, addresses)
        first = await snapshot(bench)
        # After the processes have opened their pools: a backend's start is not a job's cost.
        start = await sample(bench, n, postgres)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        # The warm-up and the window are durations of the load, not waits for an event.
        await asyncio.sleep(bench.args.scaling_warmup)
        before = await sample(bench, n, postgres)
        await asyncio.sleep(bench.args.scaling_seconds)
        after = await sample(bench, n, postgres)
        submitted = 0
        for i, proc in enumerate(procs):
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            if not line:
                raise RuntimeError(f"submit{i} ended early: see {bench.workdir / f'submit{i}.log'}")
            submitted += int(json.loads(line)["submitted"])
        jobs = await _drained(bench, n)
        last = await snapshot(bench)
        end = await sample(bench, n, postgres)
    finally:
        await bench.stop_all()
    if jobs != submitted:
        print(f"step {n}: {jobs} jobs in the table, {submitted} submits counted", file=sys.stderr)
    wal = await bench.sql(
        "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn) AS d", last.lsn, first.lsn
    )
    return step_figures(
        n,
        pool,
        cores,
        (before, after),
        jobs=jobs,
        xacts=last.xacts - first.xacts,
        wal_bytes=int(wal[0]["d"]),
        postgres_step=end.postgres - start.postgres,
    )


def _figures(bench: Bench, step: Step, cores: int) -> None:
    from bench.run import Figure

    n = step.n
    config = {"servers": n, "relays": n, "workers": n, "pool": step.pool, "cores": cores}
    bench.add(Figure(f"scaling_{n}_throughput", step.jobs_per_s, "jobs/s", config))
    bench.add(Figure(f"scaling_{n}_postgres_cores", step.postgres_cores, "cores"))
    bench.add(Figure(f"scaling_{n}_machine_busy_share", step.machine_share, ""))
    bench.add(Figure(f"scaling_{n}_postgres_ms_per_job", step.postgres_ms_per_job, "ms"))
    bench.add(Figure(f"scaling_{n}_transactions_per_job", step.xacts_per_job, ""))
    bench.add(Figure(f"scaling_{n}_wal_bytes_per_job", step.wal_per_job, "B"))


async def fig_scaling(bench: Bench) -> None:
    """The sweep, its figures, the Markdown table and the verdict."""
    from bench.run import Figure

    await bench.stop_all()
    cores = os.cpu_count() or 1
    steps: list[Step] = []
    try:
        for n in range(1, bench.args.scaling_max + 1):
            pool = pool_size(*await connections(bench), processes=3 * n, spare=SPARE_CONNECTIONS)
            if pool is None:
                bench.notes.append(f"scaling: step {n} not run, max_connections too low for it")
                break
            started = time.monotonic()
            steps.append(await run_step(bench, n, pool, cores))
            print(
                f"scaling: step {n} ({3 * n} processes, pool {pool}): {steps[-1].jobs:,} jobs, "
                f"{steps[-1].jobs_per_s:,.0f} jobs/s, in {time.monotonic() - started:.0f}s; "
                "cores: " + ", ".join(f"{k} {v:.2f}" for k, v in steps[-1].kinds.items()),
                file=sys.stderr,
            )
            _figures(bench, steps[-1], cores)
    finally:
        bench.extra_env.pop("JOBPLANE_DB_POOL_SIZE", None)
    if not steps:
        return
    found = saturation(steps)
    if found is not None:
        bench.add(Figure("scaling_saturation_step", steps[found].n, "processes of each kind"))
    bench.notes.append("")
    bench.notes.append(markdown(steps, cores))
    bench.notes.append("")
    bench.notes.append(verdict(steps, found, cores))
