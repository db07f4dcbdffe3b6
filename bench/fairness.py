"""`--only fairness`: flow-controlled dispatch (ADR-0042), fair dispatch off and on.

Both arms run at once, each a :class:`~bench.run.Bench` of its own (database,
vhost, server, relay — ``--no-fair`` for "off" — and one worker) on a
topology of two queues, a high one (``hi.#``) and a low one (``bench.#``),
and are loaded in turn (:mod:`bench.paired`'s way: the order reversed every
other round, so a machine that drifts weighs on both alike). Each round
measures, on each arm:

- **throughput**: ``--fair-jobs`` no-op jobs submitted (BatchSubmitJobs)
  and drained, jobs/s from the first create to the last end (target: the
  median of the rounds' on/off ratios >= 90 %);
- **a lone tenant**: jobs one at a time, nothing else waiting:
  submit-to-start p50/p99 over every round (target: on about as off).

Then once per arm, in turn:

- **tenant B behind A**: tenant A submits ``--fair-jobs`` no-op jobs, then
  tenant B submits jobs one at a time: B's submit-to-start p99 (target
  <= 2 s with fair dispatch; "off": B waits behind A's backlog), its p50,
  and the p99 of how many of A's jobs started between a B job's submit and
  its start (a count a busy machine does not inflate);
- **high behind low**: ``--fair-jobs`` low jobs, then high jobs one at a
  time: their start p99 (target <= 1 s).

``--rounds`` sets the rounds (default :data:`bench.paired.DEFAULT_ROUNDS`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobplane.client import AsyncClient, JobSpec
from jobplane.store.engine import create_engine
from jobplane.store.keys import KeyStore

if TYPE_CHECKING:
    from bench.run import Bench

ARMS = ("off", "on")
BATCH = 1000
# Jobs submitted one at a time (B's, the high ones, the lone tenant's), this far apart.
_ONE_BY_ONE = 50
_APART_SECONDS = 0.02
B_TARGET_MS = 2000.0
HIGH_TARGET_MS = 1000.0
THROUGHPUT_TARGET = 0.9

_TOPOLOGY = """
[exchange]
name = "jobplane.jobs"

[events]
exchange = "jobplane.events"

[dead_letter]
exchange = "jobplane.jobs.dlx"
queue = "jobplane.failed"

[[queues]]
name = "bench.fair.high"
bindings = ["hi.#"]
priority = "high"

[[queues]]
name = "bench.fair.low"
bindings = ["bench.#"]
priority = "low"
"""


@dataclass
class _Arm:
    """One side: its bench, tenant B's key there, and what its rounds measured."""

    name: str
    bench: Bench
    key_b: str
    rates: list[float] = field(default_factory=list)
    lone: list[float] = field(default_factory=list)
    #: CPU ms per throughput job of the arm's own processes, summed over the rounds.
    cpu: dict[str, float] = field(default_factory=dict)
    once: dict[str, float] = field(default_factory=dict)


async def _ended(bench: Bench, job_type: str, count: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await bench.sql(
            "SELECT count(*) AS n FROM jobs WHERE type = $1 AND end_time IS NOT NULL", job_type
        )
        if rows[0]["n"] >= count:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{count} jobs of {job_type} did not end within {timeout:g}s")


async def _start_lags(bench: Bench, job_type: str) -> list[float]:
    rows = await bench.sql(
        "SELECT extract(epoch FROM start_time - create_time) * 1000 AS ms FROM jobs "
        "WHERE type = $1 AND start_time IS NOT NULL",
        job_type,
    )
    return [float(r["ms"]) for r in rows]


async def _b_parts(bench: Bench, b_type: str, a_type: str) -> dict[str, float]:
    """Tenant B's wait: its p50, and how many of A's jobs started between a B
    job's submit and its start (p99): how far behind A's backlog B's jobs go,
    in jobs rather than time (a busy machine slows the rate, not the order)."""
    from bench.run import percentile

    rows = await bench.sql(
        "SELECT extract(epoch FROM b.start_time - b.create_time) * 1000 AS start_ms, "
        "(SELECT count(*) FROM jobs a WHERE a.type = $2 AND a.start_time > b.create_time "
        "  AND a.start_time < b.start_time) AS ahead "
        "FROM jobs b WHERE b.type = $1 AND b.start_time IS NOT NULL",
        b_type,
        a_type,
    )
    return {
        "b_p50": percentile([float(r["start_ms"]) for r in rows], 50),
        "b_ahead_p99": percentile([float(r["ahead"]) for r in rows], 99),
    }


async def _backlog(client: AsyncClient, job_type: str, n: int) -> None:
    for start in range(0, n, BATCH):
        await client.submit_many([JobSpec(job_type) for _ in range(min(BATCH, n - start))])


async def _one_by_one(client: AsyncClient, job_type: str, n: int = _ONE_BY_ONE) -> None:
    for _ in range(n):
        await client.submit(job_type, {})
        await asyncio.sleep(_APART_SECONDS)


async def _start(bench: Bench, arm: str) -> None:
    await bench.start_server()
    await bench.start("relay", "relay", *(["--no-fair"] if arm == "off" else []))
    await bench.start(
        "worker",
        "worker",
        "--handlers",
        "bench.handlers:registry",
        "--concurrency",
        str(bench.args.concurrency),
    )
    await bench.ready()


async def _lone(arm: _Arm, tag: str) -> list[float]:
    """A lone tenant's jobs, one at a time: their submit-to-start lags (ms)."""
    job_type = f"bench.fair.lone.{tag}"
    async with AsyncClient(arm.bench.address, arm.bench.key) as a:
        await _one_by_one(a, job_type)
    await _ended(arm.bench, job_type, _ONE_BY_ONE)
    return await _start_lags(arm.bench, job_type)


async def _throughput(arm: _Arm, tag: str, n: int) -> float:
    """``n`` no-op jobs submitted as a backlog and drained: jobs/s, first create to last end."""
    job_type = f"bench.fair.tput.{tag}"
    async with AsyncClient(arm.bench.address, arm.bench.key) as a:
        await _backlog(a, job_type, n)
    await _ended(arm.bench, job_type, n)
    rows = await arm.bench.sql(
        "SELECT extract(epoch FROM max(end_time) - min(create_time)) AS span FROM jobs "
        "WHERE type = $1",
        job_type,
    )
    return n / float(rows[0]["span"])


async def _behind(arm: _Arm, n: int) -> None:
    """Tenant B behind A's backlog, and high jobs behind a low backlog: their start p99s."""
    from bench.run import percentile

    bench, tag = arm.bench, arm.name
    async with (
        AsyncClient(bench.address, bench.key) as a,
        AsyncClient(bench.address, arm.key_b) as b,
    ):
        await _backlog(a, f"bench.fair.a.{tag}", n)
        await _one_by_one(b, f"bench.fair.b.{tag}")
        await _ended(bench, f"bench.fair.b.{tag}", _ONE_BY_ONE)
        arm.once["b_p99"] = percentile(await _start_lags(bench, f"bench.fair.b.{tag}"), 99)
        arm.once.update(await _b_parts(bench, f"bench.fair.b.{tag}", f"bench.fair.a.{tag}"))
        await _ended(bench, f"bench.fair.a.{tag}", n)

        await _backlog(a, f"bench.fair.low.{tag}", n)
        await _one_by_one(a, f"hi.fair.{tag}")
        await _ended(bench, f"hi.fair.{tag}", _ONE_BY_ONE)
        arm.once["high_p99"] = percentile(await _start_lags(bench, f"hi.fair.{tag}"), 99)
        await _ended(bench, f"bench.fair.low.{tag}", n)


async def _arms(bench: Bench, stack: contextlib.AsyncExitStack) -> list[_Arm]:
    """Both arms' benches, started and warmed up (a lone run and a small backlog each)."""
    from bench.run import Bench

    topology = bench.workdir / "fairness.toml"
    topology.write_text(_TOPOLOGY, encoding="utf-8")
    arms: list[_Arm] = []
    for name in ARMS:
        twin = await stack.enter_async_context(Bench(argparse.Namespace(**vars(bench.args))))
        twin.extra_env = {"JOBPLANE_TOPOLOGY": str(topology)}
        engine = create_engine(twin.database_url, pool_size=1)
        try:
            key_b, _tenant = await KeyStore(engine).create_key("bench-b")
        finally:
            await engine.dispose()
        await _start(twin, name)
        arms.append(_Arm(name, twin, key_b))
        print(f"fairness, arm {name}: database {twin.database}", file=sys.stderr)
    for arm in arms:
        await _lone(arm, f"{arm.name}.0")
        await _throughput(arm, f"{arm.name}.0", min(bench.args.fair_jobs, 1000))
        await arm.bench.sql("ANALYZE")
    return arms


async def _measure(bench: Bench) -> list[_Arm]:
    from bench.paired import rounds_of
    from bench.run import cpu_seconds

    n = bench.args.fair_jobs
    await bench.stop_all()
    async with contextlib.AsyncExitStack() as stack:
        arms = await _arms(bench, stack)
        for round_ in range(1, rounds_of(bench) + 1):
            for arm in arms if round_ % 2 else arms[::-1]:
                arm.lone.extend(await _lone(arm, f"{arm.name}.{round_}"))
                before = cpu_seconds(arm.bench)
                arm.rates.append(await _throughput(arm, f"{arm.name}.{round_}", n))
                for part, used in cpu_seconds(arm.bench).items():
                    if part in ("server", "relay", "worker"):
                        spent = (used - before.get(part, 0.0)) * 1000 / n
                        arm.cpu[part] = arm.cpu.get(part, 0.0) + spent
                await arm.bench.sql("ANALYZE")
            rates = ", ".join(f"{arm.name} {arm.rates[-1]:,.1f}" for arm in arms)
            print(f"fairness, round {round_}: jobs/s {rates}", file=sys.stderr)
        for arm in arms:
            await _behind(arm, n)
        for arm in arms:
            await arm.bench.stop_all()
    await bench.start_all()
    return arms


async def fig_fairness(bench: Bench) -> None:
    """The fairness figures, off and on, with their verdicts."""
    from bench.paired import rounds_of
    from bench.run import Figure, percentile

    n = bench.args.fair_jobs
    off, on = await _measure(bench)
    config = {
        "backlog": n,
        "concurrency": bench.args.concurrency,
        "rounds": rounds_of(bench),
        "arms": "running at once, loaded in turn",
    }
    got: dict[str, dict[str, float]] = {}
    for arm in (off, on):
        got[arm.name] = {
            "throughput": statistics.median(arm.rates),
            "lone_p50": percentile(arm.lone, 50),
            "lone_p99": percentile(arm.lone, 99),
            **arm.once,
        }
        for name, value in got[arm.name].items():
            unit = {"throughput": "jobs/s", "b_ahead_p99": "jobs"}.get(name, "ms")
            bench.add(Figure(f"fair_{arm.name}_{name}", value, unit, {**config, "arm": arm.name}))
    ratios = [a / b for a, b in zip(on.rates, off.rates, strict=True)]
    ratio = statistics.median(ratios)
    g_on, g_off = got["on"], got["off"]
    cpu = "; ".join(
        f"{part} {off.cpu[part] / len(ratios):.2f} → {on.cpu[part] / len(ratios):.2f}"
        for part in sorted(on.cpu)
    )

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    bench.notes.append(
        f"fairness ({n:,} backlog, {len(ratios)} rounds): tenant B p99 {g_on['b_p99']:.0f} ms "
        f"on, {g_off['b_p99']:.0f} ms off, target <= {B_TARGET_MS:.0f} ms "
        f"({verdict(g_on['b_p99'] <= B_TARGET_MS)}; on: p50 {g_on['b_p50']:.0f} ms, "
        f"{g_on['b_ahead_p99']:.0f} of A's jobs started ahead p99); high behind low p99 "
        f"{g_on['high_p99']:.0f} ms on, {g_off['high_p99']:.0f} ms off, target <= "
        f"{HIGH_TARGET_MS:.0f} ms ({verdict(g_on['high_p99'] <= HIGH_TARGET_MS)}); throughput "
        f"{g_on['throughput']:.0f}/s on vs {g_off['throughput']:.0f}/s off, median ratio "
        f"{ratio:.0%} (rounds {', '.join(f'{r:.0%}' for r in ratios)}), target >= "
        f"{THROUGHPUT_TARGET:.0%} ({verdict(ratio >= THROUGHPUT_TARGET)}); lone tenant p50/p99 "
        f"{g_on['lone_p50']:.0f}/{g_on['lone_p99']:.0f} ms on, "
        f"{g_off['lone_p50']:.0f}/{g_off['lone_p99']:.0f} ms off; CPU ms per job off → on: {cpu}"
    )
