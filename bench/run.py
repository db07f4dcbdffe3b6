"""`make bench`: jobplane's figures against real Postgres and RabbitMQ, with floors.

Runs `jobplane serve`, `relay` and `worker` as separate processes on a fresh
database and vhost, drives them from this process through the SDK, and
prints a table plus one JSON line per figure. Every figure is also given as a
ratio to its floor (what Postgres or RabbitMQ alone does here), since the
machines are shared and absolute numbers drift. Nothing here fails on a slow
machine: these are measurements, not tests.

    python -m bench.run [--jobs N] [--clients C] [--workers W] [--concurrency K]
                        [--watchers N] [--seconds S] [--blob-mib M] [--only NAME ...]
                        [--skip NAME ...]
                        [--only ingest --ingest-docs N --ingest-words W]
                        [--only ingest-fanout --fanout-pages P --fanout-ms-per-chunk MS]
                        [--only peers --peer-jobs N --peer-rounds R]

``--only peers`` runs the same no-op workload on Celery and Procrastinate, each in
a virtualenv of its own, beside ``jobplane dev`` and the separate processes (bench/peers.py).
``--only metrics`` compares throughput with metrics off and on (bench/metrics.py).
``--only trees --base-tree DIR`` compares this checkout with another, both running
at once and loaded in turn (bench/trees.py).
``--only batch`` measures jobs accepted through BatchSubmitJobs and the drain
of that backlog beside the single-job closed loop (bench/batch.py).
``--only blobs`` measures a blob's upload and download through jobplane
beside the S3 server's own figures ($JOBPLANE_S3_URL, else a moto_server).
``--only delayed`` measures how late delayed jobs start with
``--delayed-waiting N`` (10,000; 100,000 for the full figure) scheduled far
ahead, and the relay's claim with and without them (bench/delayed.py).
``--only wal`` measures WAL bytes, HOT updates, index writes and transactions
per job, no-op and running jobs (bench/wal.py).
``ingest-fanout`` (part of the default run, about a minute; ``--skip
ingest-fanout`` leaves it out) ingests one long PDF with one and with two
embed workers (the embed stage fans out) and prints the speed-up
(bench/ingest_fanout.py).
``--only fairness`` compares fair dispatch off and on: a tenant behind another's
``--fair-jobs`` backlog, a high queue behind a low one, throughput, a lone
tenant's latency (bench/fairness.py).
``--only scaling`` grows servers, relays and workers together from 1 to
``--scaling-max`` each, submitting no-op jobs flat out, and finds the step where
jobs/s stops rising while Postgres's CPU keeps growing (bench/scaling.py,
docs/scaling.md).
``pooling`` runs ``--only scaling``'s first step against the fleet's Patroni
leader, directly and through PgBouncer, ``--rounds`` times (default 3), the
order reversed each round, and prints the pgbouncer/direct ratio
(bench/pooling.py). It needs `make fleet-postgres`; without the fleet it
says so in one line and is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import grpc
from sqlalchemy import text

from bench import procstat
from bench.blobs import MiB, s3_env, straight_to_s3, through_jobplane, write_file
from bench.handlers import MAX_ROUNDS
from bench.targets import verdicts
from jobplane import broker
from jobplane.blobs.store import PART_BYTES
from jobplane.client import AsyncClient
from jobplane.store import claims, event_feed, job_reads, outbox, sweeps
from jobplane.store.engine import asyncpg_dsn, create_engine, migrate
from jobplane.store.keys import KeyStore
from jobplane.store.machine import MACHINE, Cause, Transition
from jobplane.topics import EVENTS_EXCHANGE
from jobplane.topology import load_topology
from jobplane.v1 import events_pb2, events_pb2_grpc
from tests.support import services
from tests.support.plans import relay_claims
from tests.support.ports import free_port
from tests.support.s3 import MotoServer

ROOT = Path(__file__).resolve().parent.parent
#: The commands that serve an ops listener (/metrics, /livez, /readyz).
OPS_COMMANDS = frozenset({"serve", "relay", "worker"})


async def wait_ready(client: AsyncClient, server: asyncio.subprocess.Process | None = None) -> bool:
    """Until the server answers a call (True): at most about 10 s, or until its
    process, when given, has exited (False)."""
    for _ in range(200):
        if server is not None and server.returncode is not None:
            return False
        try:
            await client.list(page_size=1)
        except Exception:
            await asyncio.sleep(0.05)
        else:
            return True
    return False


@dataclass
class Figure:
    """One measured number, the configuration it ran under, and its floor."""

    name: str
    value: float
    unit: str
    config: dict[str, Any] = field(default_factory=dict)
    floor: str | None = None
    ratio: float | None = None

    def line(self) -> str:
        """The JSON line of the figure."""
        return json.dumps(
            {
                "figure": self.name,
                "value": round(float(self.value), 3),
                "unit": self.unit,
                "floor": self.floor,
                "ratio_to_floor": None if self.ratio is None else round(self.ratio, 3),
                "config": self.config,
            },
            sort_keys=True,
        )


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered)) - 1))
    return ordered[rank]


class Bench:
    """A fresh database, vhost and jobplane processes for one benchmark run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run = services.run_id()
        self.database = f"jp_bench_{self.run}"
        self.vhost = f"jp_bench_{self.run}"
        self.database_url = services.pg_url(self.database)
        self.amqp_url = ""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.key = ""
        self.tenant = uuid.UUID(int=0)
        self.workdir = Path(tempfile.mkdtemp(prefix="jobplane-bench-"))
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.figures: list[Figure] = []
        # Lines printed after the table (e.g. the peers' arms and targets).
        self.notes: list[str] = []
        # Set for the processes started next (e.g. lifecycle events off).
        self.extra_env: dict[str, str] = {}
        # True: each server, relay and worker started next gets its ops
        # listener on a port picked here, kept by process name in ops_ports.
        self.pin_ops_ports = False
        self.ops_ports: dict[str, int] = {}
        self._warmed = 0
        # The S3 server of the blob figures: $JOBPLANE_S3_URL's, else a moto_server.
        self.s3: MotoServer | None = None
        self.s3_env: dict[str, str] = {}
        self.s3_kind = ""
        self._conn: asyncpg.Connection | None = None
        self._conn_lock = asyncio.Lock()

    async def __aenter__(self) -> Bench:
        await migrate(self.database_url)
        self.amqp_url = await asyncio.to_thread(services.create_vhost, self.vhost)
        engine = create_engine(self.database_url, pool_size=1)
        try:
            self.key, self.tenant = await KeyStore(engine).create_key("bench")
        finally:
            await engine.dispose()
        return self

    def use_s3(self) -> None:
        """Give the processes an object store: ``$JOBPLANE_S3_URL``, else moto_server."""
        url = os.environ.get("JOBPLANE_S3_URL")
        self.s3_kind = "JOBPLANE_S3_URL" if url else "moto_server"
        if not url:
            self.s3 = MotoServer()
            self.s3.start()
            url = self.s3.url
        self.s3_env = s3_env(url, f"jp-bench-{self.run}".lower().replace("_", "-")[:63])
        self.extra_env.update(self.s3_env)

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                # SIGTERM first: a process under --profile writes its stats as it stops.
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        if self.s3 is not None:
            self.s3.stop()
        if self._conn is not None:
            await self._conn.close()
        await services.drop_database(self.database)
        await asyncio.to_thread(services.delete_vhost, self.vhost)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "JOBPLANE_DATABASE_URL": self.database_url,
            "JOBPLANE_AMQP_URL": self.amqp_url,
            "JOBPLANE_LISTEN": self.address,
            "JOBPLANE_LOG_LEVEL": "warning",
            # Each process's ops listener on a port of its own (--only metrics picks them).
            "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
            # The bench measures capacity, not the per-tenant limits: its one
            # tenant opens 10,000 streams and submits as fast as it can.
            "JOBPLANE_TENANT_MAX_STREAMS": "0",
            "JOBPLANE_TENANT_SUBMITS_PER_SECOND": "0",
            # This checkout's jobplane, whichever checkout the installed one is.
            "PYTHONPATH": os.pathsep.join((str(ROOT / "core"), str(ROOT))),
            **self.extra_env,
        }

    async def spawn(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        pipe: bool = False,
    ) -> asyncio.subprocess.Process:
        """Start ``argv`` as process ``name`` (its output in the run's log of that
        name; with ``pipe``, its stdin and stdout are pipes instead). It is
        stopped with ``stop`` or killed at the end of the run."""
        log = (self.workdir / f"{name}.log").open("ab")
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=self.env if env is None else env,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE if pipe else None,
            stdout=asyncio.subprocess.PIPE if pipe else log,
            stderr=log,
        )
        self.procs[name] = proc
        return proc

    async def start(self, name: str, *args: str) -> asyncio.subprocess.Process:
        """Start `jobplane ARGS` as process ``name`` (under cProfile with --profile)."""
        if self.pin_ops_ports and args and args[0] in OPS_COMMANDS:
            self.ops_ports[name] = free_port()
            args = (*args, "--metrics-listen", f"127.0.0.1:{self.ops_ports[name]}")
        profile: Path | None = self.args.profile
        if profile is None:
            return await self.spawn(name, [sys.executable, "-m", "jobplane", *args])
        out = str(profile / f"{name}.prof")
        return await self.spawn(name, [sys.executable, "-m", "bench.profiled", out, *args])

    async def stop(self, name: str) -> None:
        """SIGTERM process ``name`` and wait for it."""
        proc = self.procs.pop(name)
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()

    async def stop_all(self) -> None:
        """Stop every process this run started and still runs."""
        for name in list(self.procs):
            await self.stop(name)

    async def start_server(self) -> None:
        """``jobplane serve``, on another port if it cannot bind its own: the port was
        free when it was picked, and another process (another arm's, another
        run's) may have taken it since."""
        for _ in range(5):
            server = await self.start("server", "serve")
            async with AsyncClient(self.address, self.key) as client:
                if await wait_ready(client, server) or server.returncode is None:
                    return  # answering, or slow to answer but not dead: ready() waits on
            del self.procs["server"]
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
        raise RuntimeError(f"jobplane serve did not start: see {self.workdir / 'server.log'}")

    async def ready(self) -> None:
        """Once the server answers and the workers have had time to consume."""
        async with AsyncClient(self.address, self.key) as client:
            await wait_ready(client)
        await asyncio.sleep(1.0)  # workers declare and consume

    async def start_all(self) -> None:
        """Server, relay and the workers; returns when the server answers."""
        await self.start_server()
        await self.start("relay", "relay")
        for i in range(self.args.workers):
            await self.start(
                f"worker{i}",
                "worker",
                "--handlers",
                "bench.handlers:registry",
                "--concurrency",
                str(self.args.concurrency),
            )
        await self.ready()

    async def warm_up(self) -> None:
        """Run :data:`WARM_UP_JOBS` no-op jobs through the processes just started.

        For the on/off comparisons: a process that is still importing, or
        connecting, or paying a first use (a first export of spans, a first
        statement prepared) when the measured loop starts would count that
        once-a-process cost against the jobs of the half it starts, and the
        halves differ in what they load.
        """
        await submit_closed_loop(
            self.address, self.key, WARM_UP_TYPE, WARM_UP_JOBS, self.args.clients, {}
        )
        self._warmed += WARM_UP_JOBS
        await self.wait_done(self._warmed, WARM_UP_TYPE)

    async def sql(self, query: str, *params: Any) -> list[asyncpg.Record]:
        # One connection for the run's queries: a connection a poll (wait_done
        # polls ten times a second) fails the run when the shared server is
        # at max_connections for a moment.
        async with self._conn_lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(asyncpg_dsn(self.database_url))
            return list(await self._conn.fetch(query, *params))

    async def use_database(self, url: str) -> str:
        """Point the run's own queries and the processes started next at ``url`` (a
        database another figure made, e.g. on the fleet's Postgres); the URL before."""
        async with self._conn_lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
        before, self.database_url = self.database_url, url
        return before

    async def ended(self, job_type: str) -> int:
        """The bench tenant's jobs of ``job_type`` (or of the bench's pipeline) that ended."""
        column = "pipeline" if job_type == PIPELINE else "type"
        # By tenant and type: an index range, not a scan of preloaded history.
        rows = await self.sql(
            "SELECT count(*) AS n FROM jobs"
            f" WHERE tenant_id = $1 AND {column} = $2 AND end_time IS NOT NULL",
            self.tenant,
            job_type,
        )
        return int(rows[0]["n"])

    async def wait_done(self, count: int, job_type: str, timeout: float = 600) -> None:
        """Until ``count`` jobs of ``job_type`` (or of the bench's pipeline) have ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.ended(job_type) >= count:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{job_type}: not all {count} jobs ended")

    def add(self, figure: Figure) -> None:
        self.figures.append(figure)
        print(f"measured {figure.name}: {figure.value:,.1f} {figure.unit}", file=sys.stderr)


async def submit_closed_loop(
    address: str, key: str, job_type: str, count: int, clients: int, payload: dict[str, Any]
) -> float:
    """Submit ``count`` jobs from ``clients`` concurrent callers; seconds taken."""
    channels = [AsyncClient(address, key) for _ in range(max(1, clients // 16))]

    async def caller(i: int) -> None:
        client = channels[i % len(channels)]
        for _ in range(count // clients + (1 if i < count % clients else 0)):
            await client.submit(job_type, payload)

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    for client in channels:
        await client.close()
    return elapsed


#: The no-op jobs :meth:`Bench.warm_up` runs, and their type.
WARM_UP_JOBS = 300
WARM_UP_TYPE = "bench.warm_up"


async def closed_loop_rate(bench: Bench, job_type: str) -> float:
    """``--jobs`` no-op jobs of ``job_type`` from ``--clients`` callers: jobs/s from
    the first create to the last end."""
    n, clients = bench.args.jobs, bench.args.clients
    await submit_closed_loop(bench.address, bench.key, job_type, n, clients, {})
    await bench.wait_done(n, job_type)
    rows = await bench.sql(
        "SELECT extract(epoch FROM max(end_time) - min(create_time)) AS span, count(*) AS n "
        "FROM jobs WHERE tenant_id = $1 AND type = $2",
        bench.tenant,
        job_type,
    )
    return float(rows[0]["n"]) / float(rows[0]["span"])


def _publish_all_topology(bench: Bench) -> Path:
    """The default topology with every lifecycle event published (``job.#``), as a file."""
    text = resources.files("jobplane").joinpath("topologies/default.toml").read_text()
    text = text.replace("[events]\n", '[events]\npublish_lifecycle = ["job.#"]\n', 1)
    path = bench.workdir / "lifecycle_all.toml"
    path.write_text(text)
    return path


async def fig_lifecycle_cost(bench: Bench) -> None:
    """The end-to-end no-op figure with lifecycle events off, as by default, and all
    published, in one run.

    Three arms running at once (:mod:`bench.paired`): JOBPLANE_LIFECYCLE_EVENTS=0
    (no rows), the default (rows written, none published: ADR-0052) and
    ``publish_lifecycle = ["job.#"]`` (every one published, as before
    ADR-0052), loaded in turn for :func:`rounds_of` rounds of ``--jobs``
    each, the order reversed every other round. The cost is the median of
    the rounds' ratios: the default's against off must be at most 15 %;
    all published against the default is what publishing them adds. An
    arm's loop ends when its relay's feed has passed every event, so what
    publishing (or passing) them costs is in its CPU figures.
    """
    from bench.paired import Arm, cpu_split, paired_rounds, round_ratios, rounds_of

    arms = {
        "off": Arm("off", {"JOBPLANE_LIFECYCLE_EVENTS": "0"}),
        "on": Arm("on", {}),
        "all": Arm("all", {"JOBPLANE_TOPOLOGY": str(_publish_all_topology(bench))}),
    }
    await paired_rounds(bench, list(arms.values()), "lifecycle events", settled=_events_published)
    config = {
        "jobs": bench.args.jobs,
        "rounds": rounds_of(bench),
        "clients": bench.args.clients,
        "arms": "running at once, loaded in turn",
        **_procs(bench),
    }
    for state, arm in arms.items():
        bench.add(
            Figure(
                f"e2e_throughput_lifecycle_{state}", statistics.median(arm.rates), "jobs/s", config
            )
        )
        for component, ms in sorted(arm.cpu.items()):
            name = component.replace(" ", "_")
            bench.add(Figure(f"cpu_per_job_lifecycle_{state}_{name}", ms, "ms", {}))
    for measured, base in (("on", "off"), ("all", "on")):
        split = cpu_split(arms[measured], arms[base])
        print(f"lifecycle events, CPU ms per job {base} → {measured}: {split}", file=sys.stderr)
    for name, measured, base, what in (
        ("lifecycle_events_cost", "on", "off", "lifecycle events as by default (none published)"),
        ("lifecycle_publish_all_cost", "all", "on", "publishing every lifecycle event"),
    ):
        ratios = round_ratios(arms[measured], arms[base])
        ratio = statistics.median(ratios)
        bench.add(
            Figure(
                name,
                (1 - ratio) * 100,
                "% of jobs/s",
                {"rounds": len(ratios), "ratios": [round(r, 3) for r in ratios]},
            )
        )
        print(
            f"{what}: median ratio {measured}/{base} {ratio:.3f} over {len(ratios)} rounds, "
            f"cost {(1 - ratio) * 100:.1f} %"
            + (" (at most 15 %)" if name == "lifecycle_events_cost" else ""),
            file=sys.stderr,
        )


async def fig_throughput(bench: Bench) -> float:
    """Figure 1 (closed loop): jobs/s from the first create to the last end."""
    n, clients = bench.args.jobs, bench.args.clients
    cpu_before = cpu_seconds(bench)
    rate = await closed_loop_rate(bench, "bench.noop")
    cpu_after = cpu_seconds(bench)
    bench.add(
        Figure(
            "e2e_throughput_closed_loop",
            rate,
            "jobs/s",
            {"jobs": n, "clients": clients, **_procs(bench)},
        )
    )
    # Where the CPU went: milliseconds of CPU per job, by component.
    for component in sorted(cpu_after):
        used = cpu_after[component] - cpu_before.get(component, 0.0)
        bench.add(Figure(f"cpu_per_job_{component.replace(' ', '_')}", used * 1000 / n, "ms", {}))
    lag = await bench.sql(
        "SELECT extract(epoch FROM o.published_at - o.create_time) * 1000 AS ms "
        "FROM outbox o JOIN jobs j ON j.id = o.job_id WHERE j.type = 'bench.noop'"
    )
    bench.add(
        Figure(
            "relay_commit_to_confirm_p99",
            percentile([float(r["ms"]) for r in lag], 99),
            "ms",
            {"jobs": n, **_procs(bench)},
        )
    )
    return float(rate)


#: The latency targets (p50, p99 in ms): submit → start at half the closed
#: loop's rate, and progress → watcher.
LATENCY_TARGETS = {"submit_to_start": (5.0, 25.0), "progress_to_watcher": (10.0, 50.0)}


def latency_targets(
    bench: Bench, name: str, values: list[float], targets: tuple[float, float]
) -> None:
    """Each percentile of ``values`` against its target, as a line after the table."""
    for p, bound in zip((50, 99), targets, strict=True):
        value = percentile(values, p)
        verdict = "met" if value <= bound else "missed"
        bench.notes.append(f"{name}_p{p}: {value:.1f} ms (target <= {bound:g} ms): {verdict}")


#: Seconds of quiet before the open loop (see fig_open_loop).
OPEN_LOOP_PAUSE = 5.0


async def fig_open_loop(bench: Bench, rate: float) -> None:
    """Figures 1 (open loop) and 2: a fixed submit rate; submit → start latency.

    In the steady state at that rate: after the relay has published the
    lifecycle events of what ran before (a closed loop leaves thousands, and
    every dispatch would wait behind them) and a pause for the autovacuum
    and checkpoint work they leave.
    """
    seconds = bench.args.seconds
    await _events_published(bench)
    await asyncio.sleep(OPEN_LOOP_PAUSE)
    rows = await open_loop(bench, "bench.noop", rate, seconds)
    start = [float(r["start_ms"]) for r in rows]
    span = (max(r["end_time"] for r in rows) - min(r["create_time"] for r in rows)).total_seconds()
    config = {"rate": round(rate, 1), "seconds": seconds, **_procs(bench)}
    bench.add(Figure("e2e_throughput_open_loop", len(rows) / span, "jobs/s", config))
    bench.add(Figure("submit_to_start_p50", percentile(start, 50), "ms", config))
    bench.add(Figure("submit_to_start_p99", percentile(start, 99), "ms", config))
    latency_targets(bench, "submit_to_start", start, LATENCY_TARGETS["submit_to_start"])
    # Where it went: the dispatch's mark (after the broker's confirm) is the relay's share.
    marked = await bench.sql(
        "SELECT extract(epoch FROM o.published_at - j.create_time) * 1000 AS ms "
        "FROM jobs j JOIN outbox o ON o.job_id = j.id AND o.kind = 'job.dispatch' "
        "WHERE j.tenant_id = $1 AND j.type = 'bench.noop' AND j.payload = '{\"open\": true}'",
        bench.tenant,
    )
    relayed = [float(r["ms"]) for r in marked]
    if relayed:
        bench.add(Figure("submit_to_relay_mark_p50", percentile(relayed, 50), "ms", config))
        bench.add(Figure("submit_to_relay_mark_p99", percentile(relayed, 99), "ms", config))


async def open_loop(
    bench: Bench, job_type: str, rate: float, seconds: float
) -> list[asyncpg.Record]:
    """Submit ``job_type`` at ``rate`` for ``seconds``; once all have ended, their
    ``start_ms`` (submit → start), ``create_time`` and ``end_time``.

    A pipeline's name reads its jobs (``start_ms``: its first stage's start).
    """
    total = max(1, int(rate * seconds))
    marker = time.time()
    async with AsyncClient(bench.address, bench.key) as client:
        tasks = []
        started = time.perf_counter()
        for i in range(total):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.submit(job_type, {"open": True})))
        await asyncio.gather(*tasks)
    column = "pipeline" if job_type == PIPELINE else "type"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rows = await bench.sql(
            "SELECT extract(epoch FROM start_time - create_time) * 1000 AS start_ms, "
            f"create_time, end_time FROM jobs WHERE tenant_id = $1 AND {column} = $2 "
            "AND create_time >= to_timestamp($3)",
            bench.tenant,
            job_type,
            marker,
        )
        if len(rows) >= total and all(r["end_time"] is not None for r in rows):
            return rows
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{job_type}: not all {total} open-loop jobs ended")


PIPELINE_TOPOLOGY = ROOT / "bench" / "pipeline.toml"
PIPELINE = "bench.pipeline"
QUIET_SECONDS = 15.0


async def fig_pipeline(bench: Bench) -> None:
    """A three-stage no-op pipeline beside the single-stage no-op job, in one configuration.

    Every process is restarted on bench/pipeline.toml (each stage on a queue
    of its own). Closed loop: ``--jobs`` single-stage jobs, then ``--jobs / 3``
    pipelines (as many handler runs), each rate from the first create to the
    last end; after each, an open loop at half its closed-loop rate: a single
    job's submit → start, a pipeline's submit → last stage start, and the
    stage handoff (a stage's commit → the next stage's start).
    """
    await bench.stop_all()
    bench.extra_env = {"JOBPLANE_TOPOLOGY": str(PIPELINE_TOPOLOGY)}
    await bench.start_all()
    try:
        seconds = bench.args.seconds
        single = await closed_loop_rate(bench, "bench.noop_single")
        # Each open loop after its own closed loop, once the relay has
        # published that loop's lifecycle events (a backlog of them would
        # delay every dispatch behind it) and a quiet pause: for about ten
        # seconds after a closed loop of pipelines, whatever runs next waits
        # (docs/performance.md, "Pipelines"); these figures are the steady state.
        await _events_published(bench)
        await asyncio.sleep(QUIET_SECONDS)
        single_rows = await open_loop(bench, "bench.noop_single", single / 2, seconds)
        single_start = [float(r["start_ms"]) for r in single_rows]
        n = max(3, bench.args.jobs // 3)
        await submit_closed_loop(bench.address, bench.key, PIPELINE, n, bench.args.clients, {})
        await bench.wait_done(n, PIPELINE)
        span = await bench.sql(
            "SELECT extract(epoch FROM max(end_time) - min(create_time)) AS span, count(*) AS n "
            "FROM jobs WHERE tenant_id = $1 AND pipeline = 'bench.pipeline'",
            bench.tenant,
        )
        pipelines = float(span[0]["n"]) / float(span[0]["span"])
        config = {"jobs": n, "stages": 3, "clients": bench.args.clients, **_procs(bench)}
        bench.add(Figure("pipeline3_e2e_throughput_closed_loop", pipelines, "pipelines/s", config))
        bench.add(Figure("pipeline3_stage_runs_closed_loop", pipelines * 3, "stages/s", config))
        bench.add(
            Figure(
                "pipeline_single_stage_e2e_throughput_closed_loop",
                single,
                "jobs/s",
                {"jobs": bench.args.jobs, "clients": bench.args.clients, **_procs(bench)},
            )
        )
        await _events_published(bench)
        await asyncio.sleep(QUIET_SECONDS)
        marker = time.time()
        await open_loop(bench, PIPELINE, pipelines / 2, seconds)
        rows = await bench.sql(
            """
            SELECT extract(epoch FROM last.start_time - j.create_time) * 1000 AS last_start_ms
            FROM jobs j JOIN job_stages last ON last.job_id = j.id AND last.idx = 2
            WHERE j.pipeline = 'bench.pipeline' AND j.create_time >= to_timestamp($1)
            """,
            marker,
        )
        handoffs = await bench.sql(
            """
            SELECT extract(epoch FROM nxt.start_time - s.end_time) * 1000 AS ms
            FROM jobs j
            JOIN job_stages s ON s.job_id = j.id
            JOIN job_stages nxt ON nxt.job_id = j.id AND nxt.idx = s.idx + 1
            WHERE j.pipeline = 'bench.pipeline' AND j.create_time >= to_timestamp($1)
            """,
            marker,
        )
        last_start = [float(r["last_start_ms"]) for r in rows]
        handoff = [float(r["ms"]) for r in handoffs]
        open_config = {"seconds": seconds, **_procs(bench)}
        for p in (50, 99):
            bench.add(
                Figure(
                    f"pipeline_single_submit_to_start_p{p}",
                    percentile(single_start, p),
                    "ms",
                    {"rate": round(single / 2, 1), **open_config},
                )
            )
            bench.add(
                Figure(
                    f"pipeline3_submit_to_last_stage_start_p{p}",
                    percentile(last_start, p),
                    "ms",
                    {"rate": round(pipelines / 2, 1), **open_config},
                )
            )
            bench.add(
                Figure(
                    f"pipeline3_stage_handoff_p{p}",
                    percentile(handoff, p),
                    "ms",
                    {"handoffs": len(handoff), "rate": round(pipelines / 2, 1), **open_config},
                )
            )
    finally:
        await bench.stop_all()
        bench.extra_env = {}
        await bench.start_all()


async def fig_progress(bench: Bench) -> None:
    """Figure 3: progress event → watcher latency, and progress events/s stored."""
    jobs, steps = 20, 300
    latencies: list[float] = []
    # Split at the event's write (the transaction's start time): the worker's
    # side (window + waiting for the write) and the rest (commit, NOTIFY,
    # server read, gRPC).
    to_write: list[float] = []
    from_write: list[float] = []
    cpu_before = cpu_seconds(bench)
    async with AsyncClient(bench.address, bench.key) as client:
        # Every stream is open before the first step (start_delay_ms), so no
        # event is read as history instead of live.
        submitted = [
            await client.submit(
                "bench.progress", {"steps": steps, "interval_ms": 10, "start_delay_ms": 1000}
            )
            for _ in range(jobs)
        ]

        async def watch(name: str) -> None:
            async for event in client.watch(name):
                stamp = event.data.get("t")
                if isinstance(stamp, float | int):
                    now = time.time()
                    latencies.append((now - stamp) * 1000)
                    written = event.event_time.timestamp()
                    to_write.append((written - stamp) * 1000)
                    from_write.append((now - written) * 1000)

        await asyncio.gather(*(watch(j.name) for j in submitted))
    cpu_after = cpu_seconds(bench)
    rows = await bench.sql(
        """
        SELECT count(*) AS n, extract(epoch FROM max(event_time) - min(event_time)) AS span
        FROM job_events e JOIN jobs j ON j.id = e.job_id
        WHERE j.type = 'bench.progress' AND e.type = 'progress'
        """
    )
    config = {"jobs": jobs, "steps": steps, "interval_ms": 10, **_procs(bench)}
    for component in sorted(cpu_after):
        used = cpu_after[component] - cpu_before.get(component, 0.0)
        bench.add(Figure(f"progress_cpu_{component.replace(' ', '_')}", used, "s", config))
    bench.add(Figure("progress_to_watcher_p50", percentile(latencies, 50), "ms", config))
    bench.add(Figure("progress_to_watcher_p99", percentile(latencies, 99), "ms", config))
    latency_targets(bench, "progress_to_watcher", latencies, LATENCY_TARGETS["progress_to_watcher"])
    bench.add(Figure("progress_stamp_to_write_p50", percentile(to_write, 50), "ms", config))
    bench.add(Figure("progress_write_to_watcher_p50", percentile(from_write, 50), "ms", config))
    bench.add(Figure("progress_stamp_to_write_p99", percentile(to_write, 99), "ms", config))
    bench.add(Figure("progress_write_to_watcher_p99", percentile(from_write, 99), "ms", config))
    bench.add(
        Figure(
            "progress_events_stored",
            float(rows[0]["n"]) / float(rows[0]["span"]),
            "events/s",
            config,
        )
    )


async def fig_relay(bench: Bench) -> None:
    """Figure 5: confirmed publishes/s of one relay process over a backlog."""
    n = bench.args.jobs
    await bench.stop("relay")
    await submit_closed_loop(bench.address, bench.key, "bench.relay", n, bench.args.clients, {})
    started = time.perf_counter()
    await bench.start("relay", "relay")
    while True:
        rows = await bench.sql("SELECT count(*) AS n FROM outbox WHERE published_at IS NULL")
        if rows[0]["n"] == 0:
            break
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - started
    bench.add(
        Figure(
            "relay_publishes",
            n / elapsed,
            "msgs/s",
            {"backlog": n, "relays": 1},
            floor="rabbitmq_confirmed_publish",
        )
    )
    await bench.wait_done(n, "bench.relay")


async def publish_closed_loop(address: str, key: str, count: int, clients: int) -> float:
    """PublishEvent ``count`` events from ``clients`` concurrent callers; seconds taken."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, clients // 16))]
    stubs = [events_pb2_grpc.EventServiceStub(channel) for channel in channels]
    metadata = (("authorization", f"Bearer {key}"),)

    async def caller(i: int) -> None:
        stub = stubs[i % len(stubs)]
        for n in range(count // clients + (1 if i < count % clients else 0)):
            request = events_pb2.PublishEventRequest(
                event_id=str(uuid.uuid4()), event_type="bench.happened"
            )
            request.payload.update({"caller": i, "n": n})
            await stub.PublishEvent(request, metadata=metadata, timeout=30)

    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    return elapsed


async def _events_published(bench: Bench, timeout: float = 600) -> None:
    """Until the relay has published every event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await bench.sql(
            "SELECT count(*) AS n FROM events e, event_relay r "
            "WHERE (e.txid, e.seq) > (r.txid, r.seq)"
        )
        if rows[0]["n"] == 0:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"the relay did not publish every event within {timeout:g}s")


async def fig_events(bench: Bench) -> None:
    """Figure 6: domain events/s, PublishEvent → events table → relay's feed → broker confirm.

    With a queue bound to every event, so the broker routes and stores each
    one as a consumer's queue would. Then the relay alone over a backlog.
    """
    n = bench.args.jobs
    connection = await aio_pika.connect(bench.amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(
            f"bench-events-{bench.run}", durable=True, arguments={"x-queue-type": "quorum"}
        )
        await queue.bind(exchange, routing_key="#")
        # End to end: from the first call to the last event behind the feed's position.
        started = time.perf_counter()
        called = await publish_closed_loop(bench.address, bench.key, n, bench.args.clients)
        await _events_published(bench)
        elapsed = time.perf_counter() - started
        bench.add(
            Figure(
                "events_published",
                n / elapsed,
                "events/s",
                {"events": n, "clients": bench.args.clients, "relays": 1, "calls_s": called},
                floor="rabbitmq_confirmed_publish",
            )
        )
        # The relay alone: a backlog of events, then one relay process.
        await bench.stop("relay")
        await publish_closed_loop(bench.address, bench.key, n, bench.args.clients)
        started = time.perf_counter()
        await bench.start("relay", "relay")
        await _events_published(bench)
        elapsed = time.perf_counter() - started
        bench.add(
            Figure(
                "relay_event_publishes",
                n / elapsed,
                "events/s",
                {"backlog": n, "relays": 1},
                floor="rabbitmq_confirmed_publish",
            )
        )
        await queue.delete(if_unused=False, if_empty=False)


async def fig_watchers(bench: Bench) -> None:
    """Figure 4: idle watch streams on one server process; RSS and delivery p99.

    The jobs wait (relay stopped) while every stream opens and goes idle; then
    the relay starts, each job emits one stamped event, and every stream must
    deliver it.
    """
    count = bench.args.watchers
    server = bench.procs["server"]
    rss_empty = _rss_kib(server.pid)
    await bench.stop("relay")
    async with AsyncClient(bench.address, bench.key) as control:
        jobs = [
            await control.submit("bench.progress", {"steps": 1, "interval_ms": 10})
            for _ in range(50)
        ]
    received: list[float] = []
    failures: collections.Counter[str] = collections.Counter()
    opened = 0
    all_open = asyncio.Event()
    clients = [
        AsyncClient(bench.address, bench.key)
        for _ in range(max(1, count // bench.args.streams_per_channel))
    ]

    async def watch(i: int) -> None:
        nonlocal opened
        client = clients[i % len(clients)]
        first = True
        try:
            async for event in client.watch(jobs[i % len(jobs)].name):
                if first:
                    first = False
                    opened += 1
                    if opened == count:
                        all_open.set()
                stamp = event.data.get("t")
                if isinstance(stamp, float | int):
                    received.append((time.time() - stamp) * 1000)
        except Exception as exc:
            failures[f"{type(exc).__name__}: {str(exc)[:120]} (opened: {not first})"] += 1
            raise

    tasks = [asyncio.create_task(watch(i)) for i in range(count)]
    config = {
        "watchers": count,
        "jobs": len(jobs),
        "server_rss_before_mib": round(rss_empty / 1024, 1),
        **_procs(bench),
    }
    try:
        await asyncio.wait_for(all_open.wait(), timeout=bench.args.open_timeout)
    except TimeoutError:
        # Report how far it got instead of nothing: that is the finding.
        bench.add(Figure("watch_streams_open_at_timeout", opened, "streams", config))
        for reason, times in failures.most_common(5):
            print(f"watch failed {times}x: {reason}", file=sys.stderr)
        bench.add(Figure("watch_server_rss_at_timeout", _rss_kib(server.pid) / 1024, "MiB", config))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.close()
        return
    await asyncio.sleep(1.0)
    rss_idle = _rss_kib(server.pid)
    cpu_before = cpu_seconds(bench)
    await bench.start("relay", "relay")
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    cpu_after = cpu_seconds(bench)
    # Who was busy while the events went out (the relay's start-up included).
    for component in ("server", "bench client", "worker", "postgres"):
        used = cpu_after.get(component, 0.0) - cpu_before.get(component, 0.0)
        bench.add(Figure(f"watch_delivery_cpu_{component.replace(' ', '_')}", used, "s", config))
    for client in clients:
        await client.close()
    bench.add(Figure("watch_idle_server_rss", rss_idle / 1024, "MiB", config))
    bench.add(Figure("watch_delivery_p50", percentile(received, 50), "ms", config))
    bench.add(Figure("watch_delivery_p99", percentile(received, 99), "ms", config))
    bench.add(Figure("watch_events_delivered", len(received), "events", config))


async def fig_blobs(bench: Bench) -> dict[str, float]:
    """Figure: a blob's upload and download MiB/s through jobplane, and the S3
    server's own with the same file (its figures are the floor of these)."""
    size = bench.args.blob_mib * MiB
    path = bench.workdir / "blob.bin"
    await asyncio.to_thread(write_file, path, size)
    config = {"mib": bench.args.blob_mib, "part_mib": PART_BYTES // MiB, "s3": bench.s3_kind}
    raw_up, raw_down = await straight_to_s3(bench.s3_env, path)
    up, down = await through_jobplane(bench.address, bench.key, path)
    mib = size / MiB
    raw = {"s3_upload": mib / raw_up, "s3_download": mib / raw_down}
    bench.add(Figure("s3_upload", raw["s3_upload"], "MiB/s", config))
    bench.add(Figure("s3_download", raw["s3_download"], "MiB/s", config))
    bench.add(Figure("blob_upload", mib / up, "MiB/s", config))
    bench.add(Figure("blob_download", mib / down, "MiB/s", config))
    return raw


async def floors(bench: Bench) -> dict[str, float]:
    """Figure 6: Postgres and RabbitMQ alone, from Python, on this machine."""
    result: dict[str, float] = {}
    dsn = asyncpg_dsn(bench.database_url)
    tenant = (await bench.sql("SELECT id FROM tenants LIMIT 1"))[0]["id"]
    seconds = 5.0
    conns = [await asyncpg.connect(dsn) for _ in range(8)]
    count = 0

    async def submit_tx(conn: asyncpg.Connection) -> None:
        job_id, dispatch = uuid.uuid4(), uuid.uuid4()
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts,"
                " request_id, request_hash, dispatch_id, last_seq) VALUES"
                " ($1, $2, 'floor.x', 'q', 'queued', '{}', 3, $3, '\\x00', $4, 1)",
                job_id,
                tenant,
                str(job_id),
                dispatch,
            )
            await conn.execute(
                "INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress,"
                " attempt) VALUES ($1, 1, $2, 'queued', 'queued', 0, 0)",
                job_id,
                tenant,
            )
            await conn.execute(
                "INSERT INTO outbox (id, tenant_id, job_id, routing_key) VALUES ($1, $2, $3, 'x')",
                dispatch,
                tenant,
                job_id,
            )

    async def insert_loop(conn: asyncpg.Connection) -> None:
        nonlocal count
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            await submit_tx(conn)
            count += 1

    await asyncio.gather(*(insert_loop(c) for c in conns))
    # The latency floor: the same transaction, one at a time.
    one_by_one: list[float] = []
    for _ in range(300):
        began = time.perf_counter()
        await submit_tx(conns[0])
        one_by_one.append((time.perf_counter() - began) * 1000)
    for conn in conns:
        await conn.close()
    result["postgres_tx_ms"] = percentile(one_by_one, 50)
    bench.add(Figure("floor_postgres_submit_tx_latency_p50", result["postgres_tx_ms"], "ms"))
    await bench.sql("DELETE FROM jobs WHERE type = 'floor.x'")
    result["postgres_submit_tx"] = count / seconds
    bench.add(Figure("floor_postgres_submit_tx", count / seconds, "tx/s", {"connections": 8}))

    connection = await broker.connect(bench.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(
            f"floor-{bench.run}", durable=True, arguments={"x-queue-type": "quorum"}
        )
        n = 5000
        body = b'{"v":1}' * 20
        started = time.perf_counter()
        for start in range(0, n, 200):
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                        routing_key=queue.name,
                    )
                    for _ in range(min(200, n - start))
                )
            )
        rate = n / (time.perf_counter() - started)
        result["rabbitmq_confirmed_publish"] = rate
        bench.add(
            Figure(
                "floor_rabbitmq_confirmed_publish",
                rate,
                "msgs/s",
                {"messages": n, "in_flight": 200, "queue": "quorum"},
            )
        )

        consume_channel = await connection.channel()
        await consume_channel.set_qos(prefetch_count=200)
        consume_queue = await consume_channel.get_queue(queue.name)
        done = asyncio.Event()
        got = 0

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal got
            await message.ack()
            got += 1
            if got == n:
                done.set()

        started = time.perf_counter()
        consume_queue_tag = await consume_queue.consume(on_message)
        await asyncio.wait_for(done.wait(), timeout=120)
        rate = n / (time.perf_counter() - started)
        result["rabbitmq_consume_ack"] = rate
        bench.add(
            Figure("floor_rabbitmq_consume_ack", rate, "msgs/s", {"messages": n, "prefetch": 200})
        )
        # The latency floor: publish (confirmed) → delivered to a consumer, one at a time.
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def on_timed(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            arrived.put_nowait(time.perf_counter())

        await consume_queue.cancel(consume_queue_tag)
        await consume_queue.consume(on_timed)
        round_trips: list[float] = []
        for _ in range(300):
            began = time.perf_counter()
            await channel.default_exchange.publish(
                aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=queue.name,
            )
            round_trips.append((await arrived.get() - began) * 1000)
        result["rabbitmq_round_trip_ms"] = percentile(round_trips, 50)
        bench.add(
            Figure(
                "floor_rabbitmq_publish_to_consumer_p50", result["rabbitmq_round_trip_ms"], "ms", {}
            )
        )
        await consume_queue.delete(if_unused=False, if_empty=False)
    return result


# Each figure's floor: what Postgres or RabbitMQ alone does on this machine in
# the same run. Figures with no such floor (memory, CPU) get none.
FLOORS = {
    "e2e_throughput_closed_loop": ("postgres_submit_tx",),
    "e2e_throughput_open_loop": ("postgres_submit_tx",),
    "progress_events_stored": ("postgres_submit_tx",),
    "relay_publishes": ("rabbitmq_confirmed_publish",),
    "events_published": ("rabbitmq_confirmed_publish",),
    "relay_event_publishes": ("rabbitmq_confirmed_publish",),
    # A job's path to its handler: one submit transaction, then one publish
    # delivered to a consumer.
    "submit_to_start_p50": ("postgres_tx_ms", "rabbitmq_round_trip_ms"),
    "submit_to_start_p99": ("postgres_tx_ms", "rabbitmq_round_trip_ms"),
    # A progress event's path: one write transaction, then the stream.
    "progress_to_watcher_p50": ("postgres_tx_ms",),
    "progress_to_watcher_p99": ("postgres_tx_ms",),
    "relay_commit_to_confirm_p99": ("rabbitmq_round_trip_ms",),
    # A blob's bytes through the SDK, the server and its S3 client, against
    # the S3 server taking them straight from aioboto3.
    "blob_upload": ("s3_upload",),
    "blob_download": ("s3_download",),
}


def apply_floors(figures: list[Figure], floor: dict[str, float]) -> None:
    """Set each figure's floor and its ratio to it (value / floor)."""
    for figure in figures:
        names = FLOORS.get(figure.name)
        if names and all(name in floor for name in names):
            figure.floor = " + ".join(names)
            figure.ratio = figure.value / sum(floor[name] for name in names)


async def preload(bench: Bench, count: int, chunk: int = 50_000) -> None:
    """``count`` finished jobs of the bench's tenant, with their three events
    and published outbox rows, as a long-running installation would have."""
    started = time.perf_counter()
    conn = await asyncpg.connect(asyncpg_dsn(bench.database_url))
    try:
        for first in range(0, count, chunk):
            await conn.execute(
                """
                WITH j AS (
                    INSERT INTO jobs (id, tenant_id, type, queue, state, payload, result,
                                      progress, attempt, max_attempts, request_id,
                                      request_hash, last_seq, create_time, update_time,
                                      start_time, end_time)
                    SELECT gen_random_uuid(), $1, 'bench.history', 'default', 'succeeded',
                           '{"n": 1}', '{}', 1, 1, 3, 'history-' || g, '\\x00', 3, t, t, t, t
                    FROM generate_series($2::int, $3::int) g,
                         LATERAL (SELECT now() - interval '30 days' + g * interval '1 s') AS s(t)
                    RETURNING id, create_time
                ), e AS (
                    INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress,
                                            attempt, event_time)
                    SELECT j.id, v.seq, $1, v.type, v.state, v.progress, v.attempt,
                           j.create_time
                    FROM j, (VALUES (1, 'queued', 'queued', 0.0, 0),
                                    (2, 'started', 'running', 0.0, 1),
                                    (3, 'succeeded', 'succeeded', 1.0, 1))
                            AS v(seq, type, state, progress, attempt)
                )
                INSERT INTO outbox (id, tenant_id, job_id, routing_key, create_time,
                                    available_at, published_at)
                SELECT gen_random_uuid(), $1, j.id, 'bench.history', j.create_time,
                       j.create_time, j.create_time
                FROM j
                """,
                bench.tenant,
                first + 1,
                min(count, first + chunk),
            )
        await conn.execute("VACUUM ANALYZE jobs")
        await conn.execute("VACUUM ANALYZE job_events")
        await conn.execute("VACUUM ANALYZE outbox")
        # Flush the preload's dirty pages now, not in a checkpoint mid-figure.
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    print(
        f"preloaded {count:,} finished jobs in {time.perf_counter() - started:.0f}s",
        file=sys.stderr,
    )


async def check_plans(bench: Bench) -> None:
    """EXPLAIN the statements that run all the time, on the tables as they are
    now, and report any sequential scan of jobs, job_events, outbox or events."""
    some = await bench.sql("SELECT id, tenant_id FROM jobs LIMIT 1")
    job_id, tenant = some[0]["id"], some[0]["tenant_id"]
    feed = (await bench.sql("SELECT txid::text AS txid, seq FROM event_relay"))[0]
    statements: dict[str, tuple[Any, dict[str, Any]]] = {
        "relay event feed": (
            event_feed._FEED_READ,
            {"txid": feed["txid"], "seq": feed["seq"], "limit": 500},
        ),
        "sweeper events behind": (sweeps._EVENTS_BEHIND, {"older_than": 60.0}),
        # The relay's claim as it runs it (one statement, both parts: ADR-0053),
        # fair dispatch on (the default) and off, a batch of 100 as the run's relay.
        **{f"relay claim, {name}": claim for name, claim in relay_claims(load_topology()).items()},
        "relay next due": (outbox._NEXT_DUE, {}),
        "sweeper expired leases": (sweeps._EXPIRED, {"grace": 5.0, "limit": 100}),
        "sweeper stuck outbox": (sweeps._STUCK_OUTBOX, {"older_than": 60.0}),
        "sweeper lost dispatches": (
            sweeps._REPUBLISH,
            {"after": 600.0, "limit": 1000, "cursor": uuid.UUID(int=0)},
        ),
        "watch read": (
            job_reads.READ_STREAMS,
            {"ids": [job_id], "tenants": [tenant], "afters": [0], "limit": 500},
        ),
        "worker claim": (
            MACHINE.statement(Transition.CLAIM, claims.CLAIMED),
            MACHINE.prepare(
                Transition.CLAIM,
                {
                    "id": job_id,
                    "tenant_id": tenant,
                    "dispatch_id": uuid.uuid4(),
                    "type": "bench.noop",
                    "lease_token": uuid.uuid4(),
                    "lease_seconds": 30.0,
                },
                Cause("attempt started"),
            ),
        ),
    }
    engine = create_engine(bench.database_url, pool_size=1)
    seq_scans = 0
    try:
        async with engine.connect() as conn:
            for name, (statement, params) in statements.items():
                explain = text("EXPLAIN (FORMAT JSON) " + statement.text)
                plan = (await conn.execute(explain, params)).scalar_one()
                scans = sorted(_scans(plan[0]["Plan"] if isinstance(plan, list) else plan))
                seq = [s for s in scans if s.startswith("Seq Scan on ")]
                seq_scans += len(seq)
                print(f"plan of {name}: {', '.join(scans) or 'no table scans'}", file=sys.stderr)
            await conn.rollback()
    finally:
        await engine.dispose()
    bench.add(
        Figure(
            "seq_scans_in_hot_plans",
            seq_scans,
            "scans",
            {"statements": len(statements), "finished_jobs_preloaded": bench.args.preload},
        )
    )


def _scans(node: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    relation = node.get("Relation Name")
    if relation in ("jobs", "job_events", "outbox", "events"):
        index = node.get("Index Name")
        found.add(f"{node['Node Type']} on {relation}" + (f" ({index})" if index else ""))
    for child in node.get("Plans", []):
        found |= _scans(child)
    return found


def _procs(bench: Bench) -> dict[str, Any]:
    return {
        "servers": 1,
        "relays": 1,
        "workers": bench.args.workers,
        "worker_concurrency": bench.args.concurrency,
        "prefetch": bench.args.concurrency,
        "relay_batch": 100,
        "progress_window_ms": 5,
        "finished_jobs_preloaded": bench.args.preload,
    }


def cpu_seconds(bench: Bench) -> dict[str, float]:
    """CPU seconds used so far, by component: our processes (with their children,
    e.g. a prefork pool's), Postgres, RabbitMQ.

    Postgres backends that exit take their time with them; the benchmark keeps
    its connections open while measuring, so that loss is small.
    """
    ours = {proc.pid: name.rstrip("0123456789") for name, proc in bench.procs.items()}
    trees = list(ours)
    ours[os.getpid()] = "bench client"
    tick = os.sysconf("SC_CLK_TCK")
    used = procstat.by_component(procstat.read_processes(), ours, trees)
    return {name: jiffies / tick for name, jiffies in used.items()}


def _rss_kib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1])
    return float("nan")


def table(figures: list[Figure]) -> str:
    """The human-readable summary."""
    rows = [("figure", "value", "unit", "x floor")]
    for f in figures:
        ratio = "" if f.ratio is None else f"{f.ratio:.2f} of {f.floor}"
        rows.append((f.name, f"{f.value:,.1f}", f.unit, ratio))
    return columns(rows)


def columns(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` as left-aligned columns, two spaces apart."""
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows)


#: The most sampled shares --only tracing compares in one run (bench.paired).
MAX_SHARES = 2


def _shares(value: str) -> list[float]:
    try:
        shares = [float(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("numbers between 0 and 1, comma-separated") from None
    if not shares or any(not 0 <= share <= 1 for share in shares) or len(set(shares)) < len(shares):
        raise argparse.ArgumentTypeError("distinct numbers between 0 and 1, comma-separated")
    if len(shares) > MAX_SHARES:
        # Each share is an arm beside tracing off, all running at once, each
        # with its own connections: Postgres's default 100 take three arms.
        raise argparse.ArgumentTypeError(f"at most {MAX_SHARES} shares in one run")
    return shares


def _rounds(value: str) -> int:
    rounds = int(value)
    if not 1 <= rounds <= MAX_ROUNDS:
        raise argparse.ArgumentTypeError(f"between 1 and {MAX_ROUNDS}")
    return rounds


def _steps(value: str) -> int:
    steps = int(value)
    if not 1 <= steps <= MAX_SCALING_STEPS:
        raise argparse.ArgumentTypeError(f"between 1 and {MAX_SCALING_STEPS}")
    return steps


#: The most processes of each kind --only scaling runs (bench.handlers has a type a step).
MAX_SCALING_STEPS = 16


#: The figures ``--only`` and ``--skip`` name.
FIGURES = (
    "floors",
    "throughput",
    "lifecycle",
    "open",
    "progress",
    "relay",
    "events",
    "watchers",
    "pipeline",
    "ingest",
    "ingest-fanout",
    "blobs",
    "tracing",
    "metrics",
    "ui",
    "peers",
    "batch",
    "store",
    "delayed",
    "fairness",
    "wal",
    "scaling",
    "pooling",
    "trees",
)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--watchers", type=int, default=10_000)
    parser.add_argument(
        "--streams-per-channel", type=int, default=100, help="watch streams per gRPC channel"
    )
    parser.add_argument(
        "--open-timeout", type=float, default=300.0, help="seconds for all watchers to open"
    )
    parser.add_argument("--only", nargs="*", default=[], choices=FIGURES)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=FIGURES,
        help="figures left out of the run (e.g. --skip ingest-fanout: about a minute)",
    )
    parser.add_argument(
        "--peer-jobs", type=int, default=3000, help="no-op jobs per arm of --only peers"
    )
    parser.add_argument(
        "--peer-rounds", type=int, default=2, help="rounds of --only peers, order reversed each"
    )
    parser.add_argument(
        "--rounds",
        type=_rounds,
        default=None,
        help="rounds of --only tracing, metrics, lifecycle and trees, their arms loaded in turn "
        "(the cost is the median ratio; more rounds, less of a noisy machine's spread; "
        "default 8), and of pooling (default 3; needs make fleet-postgres)",
    )
    parser.add_argument(
        "--trace-ratio",
        type=_shares,
        default=[0.1, 1.0],
        help="shares of the traces --only tracing samples, comma-separated, an arm each "
        "(1: every span, always_on; less: parentbased_traceidratio); default 0.1,1",
    )
    parser.add_argument(
        "--peer-dev-processes",
        default="auto",
        help="--processes of the jobplane dev arm of --only peers (1: all in one)",
    )
    parser.add_argument(
        "--batch-jobs", type=int, default=20_000, help="jobs --only batch submits in batches"
    )
    parser.add_argument(
        "--batch-callers", type=int, default=4, help="concurrent callers of --only batch"
    )
    parser.add_argument(
        "--delayed-waiting",
        type=int,
        default=10_000,
        help="jobs of --only delayed scheduled far ahead (100000 for the full figure)",
    )
    parser.add_argument(
        "--delayed-jobs", type=int, default=200, help="jobs of --only delayed due over 4 s"
    )
    parser.add_argument(
        "--fair-jobs", type=int, default=20_000, help="the backlog of --only fairness's figures"
    )
    parser.add_argument("--wal-jobs", type=int, default=2000, help="no-op jobs of --only wal")
    parser.add_argument(
        "--wal-running-jobs",
        type=int,
        default=200,
        help="jobs of --only wal that run 3 s each, with progress and heartbeats",
    )
    parser.add_argument(
        "--scaling-max",
        type=_steps,
        default=4,
        help="--only scaling's last step: this many servers, relays and workers each",
    )
    parser.add_argument(
        "--scaling-seconds", type=float, default=10.0, help="each --only scaling step's window"
    )
    parser.add_argument(
        "--scaling-warmup",
        type=float,
        default=3.0,
        help="seconds each --only scaling step submits before its window",
    )
    parser.add_argument(
        "--scaling-clients",
        type=int,
        default=64,
        help="closed-loop callers of --only scaling, per server (a submitter process each)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run each jobplane process under cProfile (by CPU time), its stats in "
        "DIR/NAME.prof (slower: for where the time goes, not for the figures)",
    )
    parser.add_argument(
        "--open-rate",
        type=float,
        default=0.0,
        help="jobs/s of the open loop (default: half the closed loop's); to compare "
        "two commits' latency at one load",
    )
    parser.add_argument("--ingest-docs", type=int, default=40, help="documents of --only ingest")
    parser.add_argument("--ingest-words", type=int, default=3000, help="words per document")
    parser.add_argument(
        "--fanout-pages", type=int, default=300, help="pages of the PDF of --only ingest-fanout"
    )
    parser.add_argument(
        "--fanout-ms-per-chunk",
        type=float,
        default=10.0,
        help="the embedder's wait per chunk in --only ingest-fanout (a remote API's latency)",
    )
    parser.add_argument(
        "--blob-mib", type=int, default=256, help="MiB of the blob the blob figures move"
    )
    parser.add_argument(
        "--base-tree",
        type=Path,
        default=None,
        help="the checkout --only trees compares this one with (e.g. a git worktree "
        "of the base commit)",
    )
    parser.add_argument(
        "--preload",
        type=int,
        default=0,
        help="finished jobs (with events and outbox rows) already in the tables",
    )
    args = parser.parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    want: Callable[[str], bool] = lambda name: (  # noqa: E731
        (not args.only or name in args.only) and name not in args.skip
    )
    async with Bench(args) as bench:
        floor: dict[str, float] = {}
        if want("floors"):
            floor = await floors(bench)
        if args.preload:
            await preload(bench, args.preload)
            await check_plans(bench)
        if want("blobs"):
            bench.use_s3()
        if want("ui"):
            from bench.ui import fig_ui, prepare_ui

            prepare_ui(bench)
        await bench.start_all()
        rate = 0.0
        if want("throughput") or want("open"):
            rate = await fig_throughput(bench)
        if want("lifecycle"):
            await fig_lifecycle_cost(bench)
        if want("metrics"):
            from bench.metrics import fig_metrics

            await fig_metrics(bench)
        if want("open"):
            await fig_open_loop(bench, args.open_rate or rate / 2)
        if want("pipeline"):
            await fig_pipeline(bench)
        if want("peers"):
            from bench.peers import fig_peers

            await fig_peers(bench)
        if args.only and "store" in args.only:  # not by default: a measure of parts
            from bench.store import fig_store

            await fig_store(bench)
        if args.only and "ingest" in args.only:  # not by default: needs S3 and Qdrant
            from bench.ingest import fig_ingest

            await fig_ingest(bench)
        if want("ingest-fanout"):  # moto_server and embedded Qdrant: self-contained
            from bench.ingest_fanout import fig_ingest_fanout

            await fig_ingest_fanout(bench)
        if want("progress"):
            await fig_progress(bench)
        if want("relay"):
            await fig_relay(bench)
        if want("events"):
            await fig_events(bench)
        if want("watchers"):
            await fig_watchers(bench)
        if want("blobs"):
            floor.update(await fig_blobs(bench))
        if args.only and "tracing" in args.only:
            from bench.tracing import fig_tracing

            await fig_tracing(bench)
        if want("ui"):
            await fig_ui(bench)
        if want("batch"):
            from bench.batch import fig_batch

            await fig_batch(bench)
        if args.only and "fairness" in args.only:  # its own processes and topology
            from bench.fairness import fig_fairness

            await fig_fairness(bench)
        if args.only and "wal" in args.only:  # not by default: stops the run's workers
            from bench.wal import fig_wal

            await fig_wal(bench)
        if args.only and "scaling" in args.only:  # not by default: its own processes
            from bench.scaling import fig_scaling

            await fig_scaling(bench)
        if args.only and "trees" in args.only:  # not by default: needs --base-tree
            from bench.trees import fig_trees

            await fig_trees(bench)
        if want("delayed"):  # last: its waiting jobs stay in the tables
            from bench.delayed import fig_delayed

            await fig_delayed(bench)
        if want("pooling"):  # after the rest: its own processes, on the fleet's Postgres
            from bench.pooling import fig_pooling

            await fig_pooling(bench)
        apply_floors(bench.figures, floor)
        for figure in bench.figures:
            print(figure.line())
        print()
        print(table(bench.figures))
        for note in bench.notes:
            print(note)
        print()
        print("\n".join(verdicts(bench.figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
