"""`--only peers`: jobplane beside Celery and Procrastinate on the same machine, same workload.

Five arms, each alone on the machine (the previous arm's processes stopped
before the next one starts), each over ``--peer-jobs`` no-op jobs from
``--clients`` concurrent callers, ``--peer-rounds`` rounds with the order
reversed every other round (this machine drifts 10-20 % from one minute to
the next):

- ``celery``: Celery 5, a prefork worker of 2 processes, RabbitMQ broker on a
  vhost of its own, results in Postgres (SQLAlchemy, a database of its own),
  acks late (bench/peer_apps/celery_app.py). Callers: threads calling
  ``.delay()`` in a process of Celery's virtualenv.
- ``procrastinate``: Procrastinate 3, 2 worker processes of concurrency 16,
  a database of its own. Callers: tasks awaiting ``defer_async()`` in a
  process of its virtualenv.
- ``jobplane dev``: ``jobplane dev`` as ``make dev`` runs it, at its defaults:
  the builtin:dev topology, examples.reports' handlers (bench/dev_handlers.py
  adds the no-op types), the demos, the maintenance jobs, the dashboard, the
  tenant limits, worker slots at dev's default, ``--processes`` from
  ``--peer-dev-processes`` (its default, auto, is dev's: one process per CPU
  and one more, counted as the dev process's tree).
- ``jobplane dev c8``: the same with ``--concurrency 8``, dev's default before
  ADR-0057 (64 since), its one difference.
- ``jobplane split``: ``serve``, ``relay`` and ``worker`` as processes of their own.
  Callers for the jobplane arms: the SDK from this process.

The peers are installed into virtualenvs of their own under
.cache/bench-peers/ (pinned in bench/peer_apps/requirements-*.txt), never
into jobplane's. Every arm is measured alike: the rate is N / (the callers'
first submit → the last completion written in the system's own table:
celery_taskmeta.date_done, procrastinate_events.at of 'succeeded', jobs.end_time);
the benchmark sees the end by counting the succeeded rows of that table, on one
held connection, every ``POLL_SECONDS``; it asks no worker or broker. Beside
the rate, the closed loop's two halves: the accepted rate (N / the callers'
first submit → their last submit's return) and the jobs/s that completed by
that last return (the same table), so that a system which takes submits
faster than it runs them shows it. The CPU per job is the whole machine's
busy time (/proc/stat) over that window (the callers included) divided by N,
beside each process's own share.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from bench import procstat
from bench.targets import CELERY_TARGET, CPU_FLOOR_MS, PROCRASTINATE_TARGET
from jobplane.store.engine import asyncpg_dsn
from tests.support import services

if TYPE_CHECKING:
    from bench.run import Bench

ROOT = Path(__file__).resolve().parent.parent
PEER_VENVS = ROOT / ".cache" / "bench-peers"
REQUIREMENTS = ROOT / "bench" / "peer_apps"
ARMS = ("celery", "procrastinate", "jobplane dev", "jobplane dev c8", "jobplane split")
#: The jobplane arms, and the kind in their job types' names (bench/handlers.py).
KINDS = {"jobplane dev": "dev", "jobplane dev c8": "dev8", "jobplane split": "split"}
#: 64 worker slots, the default since ADR-0057 (so the ``jobplane dev`` and
#: ``jobplane split`` arms' too, which pass no ``--concurrency``): what the
#: ``c64`` variants of bench.peers_variants pass.
DEV_WIDE_CONCURRENCY = 64
#: The worker slots of ``jobplane dev c8``: dev's default before ADR-0057.
DEV_NARROW_CONCURRENCY = 8
POLL_SECONDS = 0.2
WARMUP_JOBS = 16
TIMEOUT = 600.0
CELERY_PROCESSES = 2
PROCRASTINATE_WORKERS = 2
PROCRASTINATE_CONCURRENCY = 16


async def peer_python(name: str) -> Path:
    """The python of peer ``name``'s virtualenv, made (or remade, when its
    requirements changed) with pip from the package registry."""
    requirements = REQUIREMENTS / f"requirements-{name}.txt"
    pins = requirements.read_bytes()
    venv = PEER_VENVS / name
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    digest = hashlib.sha256(pins).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == digest:
        return python
    print(f"peers: installing {name} into {venv}", file=sys.stderr)
    venv.parent.mkdir(parents=True, exist_ok=True)

    def install() -> None:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(requirements)],
            check=True,
        )

    await asyncio.to_thread(install)
    stamp.write_text(digest)
    return python


@dataclass
class Arm:
    """How one arm starts, submits, and says a job has completed."""

    name: str
    dsn: str
    start: Callable[[], Coroutine[Any, Any, None]]
    # Submits ``count`` jobs (the warm-up's when ``warm``) from ``callers``; returns
    # (first submit, last submit returned, the callers' CPU s when they run in a
    # process of their own, else None), wall clock.
    submit: Callable[[int, int, bool], Coroutine[Any, Any, Submitted]]
    completed: str  # SELECT count(*): the succeeded jobs so far
    last: str  # SELECT the epoch of the last completion
    # SELECT count(*): the jobs completed by an epoch (its last parameter)
    finished_by: str
    clear: str | None = None  # run after the warm-up (the peers' tables)
    params: tuple[Any, ...] = ()  # of ``completed`` and ``last``
    warm_params: tuple[Any, ...] = ()  # of ``completed`` during the warm-up


@dataclass(frozen=True)
class Submitted:
    """The callers' run: wall clock of their first submit and of their last
    submit's return, and their CPU seconds when they ran in a process of their own."""

    first: float
    last: float
    cpu_s: float | None = None


@dataclass
class Outcome:
    """One arm's run: jobs/s, whole-machine CPU ms per job, and by process.

    Beside the rate, the two halves of a closed loop: ``accepted``, the
    submits/s while the callers submitted, and ``during``, the jobs/s that
    completed in that same span (what keeps up with the callers; the rest
    drains after the last submit).
    """

    rate: float
    cpu_ms: float
    by_process: dict[str, float] = field(default_factory=dict)
    window_ms: float = 0.0  # the CPU readings' window, per job
    accepted: float = 0.0
    during: float = 0.0

    @property
    def others_cores(self) -> float:
        """How many CPUs whatever else ran on the machine kept busy meanwhile, on average."""
        return (self.cpu_ms - self.attributed_ms) / self.window_ms if self.window_ms else 0.0

    @property
    def attributed_ms(self) -> float:
        """The CPU per job of the arm's own processes, Postgres and RabbitMQ only
        (the machine's figure also holds whatever else ran on it meanwhile)."""
        return sum(self.by_process.values())


async def _count(conn: asyncpg.Connection, query: str, params: tuple[Any, ...]) -> int:
    try:
        return int(await conn.fetchval(query, *params))
    except asyncpg.UndefinedTableError:  # Celery makes its table at its first result
        return 0


async def _until(
    conn: asyncpg.Connection, arm: Arm, count: int, job: asyncio.Task[Any], params: tuple[Any, ...]
) -> None:
    """Until ``count`` jobs succeeded, read every POLL_SECONDS (one cheap count)."""
    deadline = time.monotonic() + TIMEOUT
    while await _count(conn, arm.completed, params) < count:
        if job.done() and (failed := job.exception()) is not None:
            raise failed
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arm.name}: not all {count} jobs succeeded")
        await asyncio.sleep(POLL_SECONDS)


async def measure(bench: Bench, arm: Arm, jobs: int) -> Outcome:
    """Start the arm, warm it up, then time ``jobs`` jobs from ``--clients`` callers."""
    from bench.run import cpu_seconds

    await arm.start()
    conn = await asyncpg.connect(arm.dsn)
    try:
        warm = asyncio.create_task(arm.submit(WARMUP_JOBS, 4, True))
        await _until(conn, arm, WARMUP_JOBS, warm, arm.warm_params)
        await warm
        if arm.clear:
            await conn.execute(arm.clear)
        machine_before, by_before = procstat.machine_busy_seconds(), cpu_seconds(bench)
        began = time.monotonic()
        job = asyncio.create_task(arm.submit(jobs, bench.args.clients, False))
        await _until(conn, arm, jobs, job, arm.params)
        machine_after, by_after = procstat.machine_busy_seconds(), cpu_seconds(bench)
        window = time.monotonic() - began
        sent = await job
        last = float(await conn.fetchval(arm.last, *arm.params))
        by_then = await _count(conn, arm.finished_by, (*arm.params, sent.last))
    finally:
        await conn.close()
        await bench.stop_all()
    by_process = {
        name: (used - by_before.get(name, 0.0)) * 1000 / jobs for name, used in by_after.items()
    }
    if sent.cpu_s is not None:
        by_process["peer callers"] = sent.cpu_s * 1000 / jobs
    machine = (machine_after - machine_before) * 1000 / jobs
    accepted, during = halves(jobs, sent, by_then)
    return Outcome(
        jobs / (last - sent.first),
        machine,
        by_process,
        window * 1000 / jobs,
        accepted=accepted,
        during=during,
    )


def halves(jobs: int, sent: Submitted, by_then: int) -> tuple[float, float]:
    """The closed loop's two halves: submits/s while the callers submitted
    (``jobs`` over their first submit → last return), and the jobs/s that
    completed in that same span (``by_then`` of them had by its end)."""
    submitting = sent.last - sent.first
    return jobs / submitting, by_then / submitting


async def _callers(bench: Bench, name: str, argv: list[str], env: dict[str, str]) -> Any:
    """Run a peer's caller process through its ready/go handshake; its report.

    Once it has said ready it is no longer one of the run's processes: its
    CPU is the one it reports, from go to its last call.
    """
    proc = await bench.spawn(name, argv, env, pipe=True)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
        if ready.strip() != b"ready":
            raise RuntimeError(f"{name} did not start (see {bench.workdir / name}.log)")
        bench.procs.pop(name)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        report = json.loads(await proc.stdout.readline())
        await proc.wait()
    finally:
        bench.procs.pop(name, None)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return report


def _env(python: Path) -> dict[str, str]:
    """The environment of a process of the peer whose virtualenv has ``python``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.pop("VIRTUAL_ENV", None)
    return {**env, "PATH": f"{python.parent}:{env.get('PATH', '')}", "PYTHONPATH": str(ROOT)}


class Peers:
    """The peers' databases, vhost and processes for one run, and the five arms."""

    def __init__(self, bench: Bench, celery_python: Path, procrastinate_python: Path) -> None:
        self.bench = bench
        self.celery_python = celery_python
        self.procrastinate_python = procrastinate_python
        self.celery_db = f"{bench.database}_celery"
        self.procrastinate_db = f"{bench.database}_procrastinate"
        self.vhost = f"{bench.vhost}_celery"
        self.celery_env: dict[str, str] = {}
        self.procrastinate_env: dict[str, str] = {}

    async def __aenter__(self) -> Peers:
        await services.create_database(self.celery_db)
        await services.create_database(self.procrastinate_db)
        broker = await asyncio.to_thread(services.create_vhost, self.vhost)
        url = services.pg_url(self.celery_db)
        self.celery_env = {
            **_env(self.celery_python),
            "BENCH_CELERY_BROKER": broker,
            "BENCH_CELERY_BACKEND": "db+" + url.replace("postgresql://", "postgresql+psycopg://"),
        }
        self.procrastinate_env = {
            **_env(self.procrastinate_python),
            "BENCH_PROCRASTINATE_DSN": services.pg_url(self.procrastinate_db),
        }
        await self._procrastinate_schema()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.bench.stop_all()
        await services.drop_database(self.celery_db)
        await services.drop_database(self.procrastinate_db)
        await asyncio.to_thread(services.delete_vhost, self.vhost)

    async def _procrastinate_schema(self) -> None:
        proc = await self.bench.spawn(
            "procrastinate schema",
            [*self._procrastinate_cli(), "schema", "--apply"],
            self.procrastinate_env,
        )
        if await proc.wait():
            raise RuntimeError("procrastinate schema --apply failed")
        self.bench.procs.pop("procrastinate schema")

    def _procrastinate_cli(self) -> list[str]:
        return [
            str(self.procrastinate_python),
            "-m",
            "procrastinate",
            "--app",
            "bench.peer_apps.procrastinate_app.app",
            # As jobplane's processes and Celery's worker run here: warnings only.
            "--log-level",
            "warning",
        ]

    def arm(self, name: str, round_: int) -> Arm:
        """The arm ``name`` of round ``round_``."""
        bench = self.bench
        if name == "celery":
            return Arm(
                name,
                asyncpg_dsn(services.pg_url(self.celery_db)),
                self._start_celery,
                lambda n, c, _warm: self._peer_submit("celery", n, c),
                "SELECT count(*) FROM celery_taskmeta WHERE status = 'SUCCESS'",
                # date_done is a UTC timestamp without a zone.
                "SELECT extract(epoch FROM max(date_done) AT TIME ZONE 'UTC') FROM celery_taskmeta",
                "SELECT count(*) FROM celery_taskmeta WHERE status = 'SUCCESS'"
                " AND date_done AT TIME ZONE 'UTC' <= to_timestamp($1)",
                clear="DELETE FROM celery_taskmeta",
            )
        if name == "procrastinate":
            return Arm(
                name,
                asyncpg_dsn(services.pg_url(self.procrastinate_db)),
                self._start_procrastinate,
                lambda n, c, _warm: self._peer_submit("procrastinate", n, c),
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
                "SELECT extract(epoch FROM max(at)) FROM procrastinate_events"
                " WHERE type = 'succeeded'",
                "SELECT count(*) FROM procrastinate_events"
                " WHERE type = 'succeeded' AND at <= to_timestamp($1)",
                clear="DELETE FROM procrastinate_jobs",
            )
        kind = KINDS[name]
        job_type = f"bench.noop_peers_{kind}_{round_}"
        warm_type = f"{job_type}_warmup"

        async def submit(count: int, callers: int, warm: bool) -> Submitted:
            from bench.run import submit_closed_loop

            of_type = warm_type if warm else job_type
            first = time.time()
            await submit_closed_loop(bench.address, bench.key, of_type, count, callers, {})
            return Submitted(first, time.time())

        return Arm(
            name,
            asyncpg_dsn(bench.database_url),
            self._starter(kind),
            submit,
            "SELECT count(*) FROM jobs WHERE tenant_id = $1 AND type = $2 AND state = 'succeeded'",
            "SELECT extract(epoch FROM max(end_time)) FROM jobs WHERE tenant_id = $1 AND type = $2",
            "SELECT count(*) FROM jobs WHERE tenant_id = $1 AND type = $2"
            " AND state = 'succeeded' AND end_time <= to_timestamp($3)",
            params=(bench.tenant, job_type),
            warm_params=(bench.tenant, warm_type),
        )

    async def _start_celery(self) -> None:
        await self.bench.spawn(
            "celery worker",
            [
                str(self.celery_python),
                "-m",
                "celery",
                "-A",
                "bench.peer_apps.celery_app",
                "worker",
                "-P",
                "prefork",
                "-c",
                str(CELERY_PROCESSES),
                "-l",
                "warning",
            ],
            self.celery_env,
        )

    async def _start_procrastinate(self) -> None:
        for i in range(PROCRASTINATE_WORKERS):
            await self.bench.spawn(
                f"procrastinate worker{i}",
                [
                    *self._procrastinate_cli(),
                    "worker",
                    "--concurrency",
                    str(PROCRASTINATE_CONCURRENCY),
                ],
                self.procrastinate_env,
            )

    def _starter(self, kind: str) -> Callable[[], Coroutine[Any, Any, None]]:
        """How the jobplane arm of ``kind`` starts."""
        if kind == "dev":
            return lambda: self._start_dev(None)
        if kind == "dev8":
            return lambda: self._start_dev(DEV_NARROW_CONCURRENCY)
        return self.bench.start_all

    async def _start_dev(self, concurrency: int | None) -> None:
        """``jobplane dev`` as ``make dev`` runs it: the builtin:dev topology,
        examples.reports' handlers (with the no-op types beside them), the demos
        and maintenance jobs, the dashboard, metrics, the tenant limits and
        worker slots at their defaults; ``concurrency`` slots instead, if given.
        (Not the one-off demo job and ingestion of ``make dev``'s start.)"""
        from jobplane.config import (
            DEFAULT_TENANT_MAX_STREAMS,
            DEFAULT_TENANT_SUBMIT_BURST,
            DEFAULT_TENANT_SUBMITS_PER_SECOND,
        )
        from tests.support.ports import free_port

        bench = self.bench
        slots = () if concurrency is None else ("--concurrency", str(concurrency))
        saved = dict(bench.extra_env)
        bench.extra_env = {
            **saved,
            "JOBPLANE_TOPOLOGY": "builtin:dev",
            "JOBPLANE_TENANT_MAX_STREAMS": str(DEFAULT_TENANT_MAX_STREAMS),
            "JOBPLANE_TENANT_SUBMITS_PER_SECOND": f"{DEFAULT_TENANT_SUBMITS_PER_SECOND:g}",
            "JOBPLANE_TENANT_SUBMIT_BURST": str(DEFAULT_TENANT_SUBMIT_BURST),
        }
        try:
            await bench.start(
                "dev",
                "dev",
                "--handlers",
                "bench.dev_handlers:registry",
                *slots,
                # The dashboard on, on a port of its own (8080 may be another run's).
                "--ui-listen",
                f"127.0.0.1:{free_port()}",
                "--processes",
                bench.args.peer_dev_processes,
            )
        finally:
            bench.extra_env = saved
        await bench.ready()

    async def _peer_submit(self, peer: str, count: int, callers: int) -> Submitted:
        python = self.celery_python if peer == "celery" else self.procrastinate_python
        env = self.celery_env if peer == "celery" else self.procrastinate_env
        report = await _callers(
            self.bench,
            f"{peer} callers",
            [str(python), "-m", f"bench.peer_apps.{peer}_client", str(count), str(callers)],
            env,
        )
        return Submitted(
            float(report["first_submit"]), float(report["last_submit"]), float(report["cpu_s"])
        )


def _table(outcomes: dict[str, list[Outcome]]) -> str:
    """The arms round by round, and where their CPU went (the rounds' mean)."""
    from bench.run import columns

    rows = [
        (
            "arm",
            "jobs/s",
            "accepted/s",
            "finished/s while submitting",
            "CPU ms/job: machine",
            "ours",
            "others' CPUs",
            "by process (mean)",
        )
    ]
    for arm in ARMS:
        runs = outcomes[arm]
        by_process: dict[str, float] = {}
        for run in runs:
            for name, ms in run.by_process.items():
                by_process[name] = by_process.get(name, 0.0) + ms / len(runs)
        rows.append(
            (
                arm,
                " / ".join(f"{r.rate:,.1f}" for r in runs),
                " / ".join(f"{r.accepted:,.1f}" for r in runs),
                " / ".join(f"{r.during:,.1f}" for r in runs),
                " / ".join(f"{r.cpu_ms:.2f}" for r in runs),
                " / ".join(f"{r.attributed_ms:.2f}" for r in runs),
                " / ".join(f"{r.others_cores:.2f}" for r in runs),
                ", ".join(f"{n} {ms:.2f}" for n, ms in sorted(by_process.items()) if ms >= 0.01),
            )
        )
    return columns(rows)


def _rate(outcome: Outcome) -> float:
    return outcome.rate


def _cpu(outcome: Outcome) -> float:
    return outcome.cpu_ms


def _accepted(outcome: Outcome) -> float:
    return outcome.accepted


def _during(outcome: Outcome) -> float:
    return outcome.during


async def fig_peers(bench: Bench) -> None:
    """The five arms, ``--peer-rounds`` rounds; rates, CPU per job and the targets."""
    from bench.run import Figure, _procs

    jobs, rounds = bench.args.peer_jobs, bench.args.peer_rounds
    celery_python = await peer_python("celery")
    procrastinate_python = await peer_python("procrastinate")
    await bench.stop_all()
    outcomes: dict[str, list[Outcome]] = {arm: [] for arm in ARMS}
    try:
        async with Peers(bench, celery_python, procrastinate_python) as peers:
            for round_ in range(1, rounds + 1):
                order = ARMS if round_ % 2 else tuple(reversed(ARMS))
                for name in order:
                    outcome = await measure(bench, peers.arm(name, round_), jobs)
                    outcomes[name].append(outcome)
                    print(
                        f"peers, round {round_}: {name} {outcome.rate:,.1f} jobs/s "
                        f"(accepted {outcome.accepted:,.1f}/s, finished "
                        f"{outcome.during:,.1f}/s while submitting), "
                        f"{outcome.cpu_ms:.2f} ms CPU per job (machine), "
                        f"{outcome.attributed_ms:.2f} ms (its processes, Postgres, RabbitMQ); "
                        f"the rest of the machine kept {outcome.others_cores:.2f} CPUs busy",
                        file=sys.stderr,
                    )
    finally:
        await bench.start_all()
    config: dict[str, Any] = {"jobs": jobs, "clients": bench.args.clients, "rounds": rounds}
    dev = {
        "processes": bench.args.peer_dev_processes,
        "topology": "builtin:dev",
        "handlers": "examples.reports + no-op",
        "dashboard": True,
        "tenant_limits": "default",
    }
    arm_config: dict[str, dict[str, Any]] = {
        "celery": {
            "pool": "prefork",
            "processes": CELERY_PROCESSES,
            "acks_late": True,
            "prefetch_multiplier": 4,
            "broker": "rabbitmq",
            "result_backend": "postgres via sqlalchemy",
        },
        "procrastinate": {
            "workers": PROCRASTINATE_WORKERS,
            "concurrency": PROCRASTINATE_CONCURRENCY,
        },
        "jobplane dev": {**dev, "worker_concurrency": "default (64)"},
        "jobplane dev c8": {**dev, "worker_concurrency": DEV_NARROW_CONCURRENCY},
        "jobplane split": _procs(bench),
    }
    cpu = {arm: statistics.median(o.cpu_ms for o in outcomes[arm]) for arm in ARMS}
    for arm in ARMS:
        key = arm.replace(" ", "_")
        rates = [round(o.rate, 1) for o in outcomes[arm]]
        bench.add(
            Figure(
                f"peers_{key}_rate",
                statistics.median(o.rate for o in outcomes[arm]),
                "jobs/s",
                {**config, "by_round": rates, **arm_config[arm]},
            )
        )
        for what, unit, of in (
            ("accepted", "submits/s", _accepted),
            ("finished_while_submitting", "jobs/s", _during),
        ):
            values = [of(o) for o in outcomes[arm]]
            bench.add(
                Figure(
                    f"peers_{key}_{what}",
                    statistics.median(values),
                    unit,
                    {**config, "by_round": [round(v, 1) for v in values]},
                )
            )
        cpus = [round(o.cpu_ms, 2) for o in outcomes[arm]]
        others = [round(o.others_cores, 2) for o in outcomes[arm]]
        bench.add(
            Figure(
                f"peers_{key}_cpu_per_job_machine",
                cpu[arm],
                "ms",
                {**config, "by_round": cpus, "others_cpus_by_round": others},
            )
        )
        ours = [round(o.attributed_ms, 2) for o in outcomes[arm]]
        bench.add(
            Figure(
                f"peers_{key}_cpu_per_job_ours",
                statistics.median(ours),
                "ms",
                {**config, "by_round": ours},
            )
        )

    def ratio(num: str, den: str, metric: Callable[[Outcome], float]) -> float:
        """The median of the rounds' ratios (a round's arms ran minutes apart)."""
        pairs = zip(outcomes[num], outcomes[den], strict=True)
        return statistics.median(metric(a) / metric(b) for a, b in pairs)

    verdicts = []
    for arm in KINDS:
        key = arm.replace(" ", "_")
        targets = (
            (
                f"peers_{key}_over_celery",
                "x jobs/s",
                ratio(arm, "celery", _rate),
                ">=",
                CELERY_TARGET,
            ),
            (
                f"peers_{key}_over_procrastinate",
                "x jobs/s",
                ratio(arm, "procrastinate", _rate),
                ">=",
                PROCRASTINATE_TARGET,
            ),
            (
                f"peers_{key}_cpu_over_procrastinate",
                "x CPU/job",
                ratio(arm, "procrastinate", _cpu),
                "<",
                1.0,
            ),
            (f"peers_{key}_cpu_per_job_target", "ms", cpu[arm], "<=", CPU_FLOOR_MS),
        )
        for name, unit, value, op, bound in targets:
            met = {">=": value >= bound, ">": value > bound, "<": value < bound}.get(
                op, value <= bound
            )
            target = f"{op} {bound:g}"
            extra = {"celery_ms": round(cpu["celery"], 2)} if unit == "ms" else {}
            bench.add(Figure(name, value, unit, {**config, "target": target, "met": met, **extra}))
            verdicts.append(
                f"{name}: {value:.2f} {unit} (target {target}): {'met' if met else 'missed'}"
            )
    bench.notes += ["", _table(outcomes), "", *verdicts]
