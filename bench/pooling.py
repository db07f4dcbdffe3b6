"""`--only pooling`: one primary's throughput through PgBouncer beside direct connections.

Needs the fleet's Postgres pair and PgBouncer (`make fleet-postgres`,
docs/fleet.md); when they do not run, the figure says so in one line and is
skipped.

The workload is ``--only scaling``'s first step (bench/scaling.py,
:func:`~bench.scaling.run_step`): one server, one relay and one worker, and one
submitter process of ``--scaling-clients`` closed-loop callers submitting
no-op jobs for ``--scaling-warmup`` + ``--scaling-seconds``, on a database of
its own on the Patroni leader. Each round runs it twice, the order reversed
each round (``--rounds``, default 3):

- ``direct``: every pool on the leader's port;
- ``pgbouncer``: every pool through PgBouncer in transaction pooling
  (``pgbouncer=true``), LISTEN by JOBPLANE_DATABASE_DIRECT_URL on the
  leader's port.

Each arm of each round has a tenant of its own, so that its jobs are counted
apart. Per arm and round: jobs/s that ended in the window; the CPU of the
leader's Postgres (its postmaster and every process under it: backends, WAL
writer, WAL senders to the synchronous standby) in ms per job over the whole
step; and PgBouncer's own (its one process) likewise. The summary is the
median over the rounds of each round's pgbouncer/direct ratio, beside the
machine's load average before and after: the fleet shares the machine's
cores with whatever else runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import asyncpg

from bench import procstat
from bench.scaling import SPARE_CONNECTIONS, connections, run_step
from bench.scaling_report import Step, pool_size
from jobplane.store.engine import create_engine, ensure_database, migrate
from jobplane.store.keys import KeyStore
from tests.fleet import patroni

if TYPE_CHECKING:
    from bench.run import Bench

#: The arms of a round, in the first round's order.
ARMS = ("direct", "pgbouncer")
#: Rounds when ``--rounds`` is not given.
ROUNDS = 3


@dataclass(frozen=True)
class Arm:
    """One arm of one round: the step's figures and PgBouncer's CPU per job."""

    name: str
    round: int
    step: Step
    bouncer_ms_per_job: float


def leader_url(leader: str, database: str) -> str:
    """``database`` on the leading node's own port (no PgBouncer, no other host)."""
    return f"postgresql://{patroni.AUTH}@127.0.0.1:{patroni.NODES[leader][0]}/{database}"


def _bouncer_pid() -> int:
    return int((patroni.FLEET_DIR / "run" / "pgbouncer.pid").read_text().split()[0])


async def fleet_down() -> str | None:
    """Why the fleet cannot be measured now; None when a leader and PgBouncer answer."""
    if await asyncio.to_thread(patroni.leader) is None:
        rest = ", ".join(str(rest) for _pg, rest in patroni.NODES.values())
        return f"no Patroni leader answers on 127.0.0.1:{rest}"
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", patroni.BOUNCER_PORT)
    except OSError:
        return f"PgBouncer does not answer on 127.0.0.1:{patroni.BOUNCER_PORT}"
    writer.close()
    await writer.wait_closed()
    return None


def tree_seconds(root: int) -> float:
    """CPU seconds used so far by ``root`` and the processes under it that still run."""
    used = procstat.by_component(procstat.read_processes(), {root: "tree"}, [root])
    return used.get("tree", 0) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def on_leader(bench: Bench) -> AsyncIterator[str]:
    """A fresh, migrated database on the fleet's leader, the bench pointed at it
    (its direct URL) until the block ends; then dropped, the bench pointed back."""
    await patroni.wait_healthy()
    leader = await asyncio.to_thread(patroni.leader)
    assert leader is not None
    name = f"{bench.database}_pooling"
    await ensure_database(patroni.direct_url(name))
    for node in patroni.NODES:  # the multi-host URL may try the standby first
        await patroni.wait_database(node, name)
    url = leader_url(leader, name)
    await migrate(url, create=False)
    before = await bench.use_database(url)
    saved = bench.key, bench.tenant
    try:
        yield url
    finally:
        await bench.use_database(before)
        bench.key, bench.tenant = saved
        for variable in ("JOBPLANE_DATABASE_URL", "JOBPLANE_DATABASE_DIRECT_URL"):
            bench.extra_env.pop(variable, None)
        admin = await asyncpg.connect(leader_url(leader, "postgres"))
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def _tenant(url: str, name: str) -> tuple[str, uuid.UUID]:
    engine = create_engine(url, pool_size=1)
    try:
        return await KeyStore(engine).create_key(name)
    finally:
        await engine.dispose()


async def run_arm(bench: Bench, arm: str, round_: int, direct: str, pool: int) -> Arm:
    """The scaling sweep's first step with every pool ``arm`` (direct or through PgBouncer)."""
    bench.key, bench.tenant = await _tenant(direct, f"pooling-{arm}-{round_}")
    if arm == "pgbouncer":
        database = direct.rsplit("/", 1)[1]
        bench.extra_env["JOBPLANE_DATABASE_URL"] = patroni.bouncer_url(database)
        bench.extra_env["JOBPLANE_DATABASE_DIRECT_URL"] = direct
    else:
        bench.extra_env["JOBPLANE_DATABASE_URL"] = direct
        bench.extra_env.pop("JOBPLANE_DATABASE_DIRECT_URL", None)
    leader = await asyncio.to_thread(patroni.leader)
    assert leader is not None
    postmaster = patroni.postmaster_pid(leader)
    bouncer = _bouncer_pid()
    bouncer_before = tree_seconds(bouncer)
    step = await run_step(
        bench, 1, pool, os.cpu_count() or 1, postgres=lambda: tree_seconds(postmaster)
    )
    bouncer_ms = (tree_seconds(bouncer) - bouncer_before) * 1000 / max(step.jobs, 1)
    return Arm(arm, round_, step, bouncer_ms)


def ratios(arms: list[Arm], measure: str) -> list[float]:
    """Each round's pgbouncer/direct ratio of ``measure`` (a :class:`Step` field)."""
    by_round: dict[int, dict[str, float]] = {}
    for arm in arms:
        by_round.setdefault(arm.round, {})[arm.name] = getattr(arm.step, measure)
    return [
        r["pgbouncer"] / r["direct"]
        for r in by_round.values()
        if r.get("direct") and "pgbouncer" in r
    ]


def markdown(arms: list[Arm], load: tuple[float, float]) -> str:
    """The arms as a Markdown table (docs/scaling.md), the medians and the load after it."""
    rows = [
        "| round | arm | jobs/s | Postgres CPU ms / job | PgBouncer CPU ms / job "
        "| transactions / job | machine busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        rows.append(
            f"| {a.round + 1} | {a.name} | {a.step.jobs_per_s:,.0f} "
            f"| {a.step.postgres_ms_per_job:.2f} | {a.bouncer_ms_per_job:.2f} "
            f"| {a.step.xacts_per_job:.1f} | {a.step.machine_share:.0%} |"
        )
    jobs = statistics.median(ratios(arms, "jobs_per_s"))
    cpu = statistics.median(ratios(arms, "postgres_ms_per_job"))
    rows.append("")
    rows.append(
        f"pooling: pgbouncer/direct, median of {len(ratios(arms, 'jobs_per_s'))} rounds: "
        f"jobs/s {jobs:.2f}x, Postgres CPU ms/job {cpu:.2f}x; load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after"
    )
    return "\n".join(rows)


async def fig_pooling(bench: Bench) -> None:
    """Both arms, ``--rounds`` times, alternating; their figures, the table and the ratio."""
    from bench.run import Figure

    down = await fleet_down()
    if down is not None:
        line = (
            f"pooling: skipped, the fleet's Postgres is not running ({down}): make fleet-postgres"
        )
        print(line, file=sys.stderr)
        bench.notes.append(line)
        return
    await bench.stop_all()
    rounds = bench.args.rounds or ROUNDS
    before = os.getloadavg()[0]
    arms: list[Arm] = []
    async with on_leader(bench) as direct:
        pool = pool_size(*await connections(bench), processes=3, spare=SPARE_CONNECTIONS)
        assert pool is not None, "the fleet's leader has no connections to spare"
        for round_ in range(rounds):
            for name in ARMS if round_ % 2 == 0 else ARMS[::-1]:
                arms.append(await run_arm(bench, name, round_, direct, pool))
                step = arms[-1].step
                print(
                    f"pooling: round {round_ + 1} {name}: {step.jobs_per_s:,.0f} jobs/s, "
                    f"Postgres {step.postgres_ms_per_job:.2f} ms/job, PgBouncer "
                    f"{arms[-1].bouncer_ms_per_job:.2f} ms/job",
                    file=sys.stderr,
                )
    load = (before, os.getloadavg()[0])
    config = {"rounds": rounds, "pool": pool, "load_average": [round(x, 2) for x in load]}
    for name in ARMS:
        mine = [a for a in arms if a.name == name]
        jobs = statistics.median(a.step.jobs_per_s for a in mine)
        cpu = statistics.median(a.step.postgres_ms_per_job for a in mine)
        bench.add(Figure(f"pooling_{name}_throughput", jobs, "jobs/s", config))
        bench.add(Figure(f"pooling_{name}_postgres_ms_per_job", cpu, "ms"))
    bouncer = statistics.median(a.bouncer_ms_per_job for a in arms if a.name == "pgbouncer")
    bench.add(Figure("pooling_pgbouncer_own_ms_per_job", bouncer, "ms"))
    bench.add(
        Figure("pooling_throughput_ratio", statistics.median(ratios(arms, "jobs_per_s")), "x")
    )
    bench.notes.append("")
    bench.notes.append(markdown(arms, load))
