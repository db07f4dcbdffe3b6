"""`--only fairness`: flow-controlled dispatch (ADR-0042), fair dispatch off and on.

Each arm runs its own server, relay (``--no-fair`` for "off") and worker on a
topology of two queues, a high one (``hi.#``) and a low one (``bench.#``), and
measures, in the same run:

- **tenant B behind A**: tenant A submits ``--fair-jobs`` no-op jobs
  (BatchSubmitJobs), then tenant B submits jobs one at a time: B's
  submit-to-start p99 (target <= 2 s with fair dispatch; "off": B waits
  behind A's backlog);
- **high behind low**: ``--fair-jobs`` low jobs, then high jobs one at a
  time: their start p99 (target <= 1 s);
- **throughput**: ``--fair-jobs`` no-op jobs submitted and drained, jobs/s
  (target: on >= 90 % of off);
- **a lone tenant**: jobs one at a time, nothing else waiting: submit-to-start
  p50/p99 (target: on about as off).
"""

from __future__ import annotations

import asyncio
import time
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


async def _backlog(client: AsyncClient, job_type: str, n: int) -> None:
    for start in range(0, n, BATCH):
        await client.submit_many([JobSpec(job_type) for _ in range(min(BATCH, n - start))])


async def _one_by_one(client: AsyncClient, job_type: str, n: int = _ONE_BY_ONE) -> None:
    for _ in range(n):
        await client.submit(job_type, {})
        await asyncio.sleep(_APART_SECONDS)


async def _arm(bench: Bench, arm: str, key_b: str, n: int) -> dict[str, float]:
    """One arm's processes and figures (ms, and jobs/s for the throughput)."""
    from bench.run import percentile

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
    got: dict[str, float] = {}
    try:
        async with (
            AsyncClient(bench.address, bench.key) as a,
            AsyncClient(bench.address, key_b) as b,
        ):
            await _one_by_one(a, f"bench.fair.lone.{arm}")
            await _ended(bench, f"bench.fair.lone.{arm}", _ONE_BY_ONE)
            lone = await _start_lags(bench, f"bench.fair.lone.{arm}")
            got["lone_p50"], got["lone_p99"] = percentile(lone, 50), percentile(lone, 99)

            began = time.monotonic()
            await _backlog(a, f"bench.fair.tput.{arm}", n)
            await _ended(bench, f"bench.fair.tput.{arm}", n)
            got["throughput"] = n / (time.monotonic() - began)

            await _backlog(a, f"bench.fair.a.{arm}", n)
            await _one_by_one(b, f"bench.fair.b.{arm}")
            await _ended(bench, f"bench.fair.b.{arm}", _ONE_BY_ONE)
            got["b_p99"] = percentile(await _start_lags(bench, f"bench.fair.b.{arm}"), 99)
            await _ended(bench, f"bench.fair.a.{arm}", n)

            await _backlog(a, f"bench.fair.low.{arm}", n)
            await _one_by_one(a, f"hi.fair.{arm}")
            await _ended(bench, f"hi.fair.{arm}", _ONE_BY_ONE)
            got["high_p99"] = percentile(await _start_lags(bench, f"hi.fair.{arm}"), 99)
            await _ended(bench, f"bench.fair.low.{arm}", n)
    finally:
        await bench.stop_all()
    return got


async def fig_fairness(bench: Bench) -> None:
    """The fairness figures, off and on, with their verdicts."""
    from bench.run import Figure

    n = bench.args.fair_jobs
    topology = bench.workdir / "fairness.toml"
    topology.write_text(_TOPOLOGY, encoding="utf-8")
    await bench.stop_all()
    bench.extra_env["JOBPLANE_TOPOLOGY"] = str(topology)
    engine = create_engine(bench.database_url, pool_size=1)
    try:
        key_b, _tenant = await KeyStore(engine).create_key("bench-b")
    finally:
        await engine.dispose()
    arms = {arm: await _arm(bench, arm, key_b, n) for arm in ARMS}
    config = {"backlog": n, "concurrency": bench.args.concurrency}
    for arm, got in arms.items():
        for name, value in got.items():
            unit = "jobs/s" if name == "throughput" else "ms"
            bench.add(Figure(f"fair_{arm}_{name}", value, unit, {**config, "arm": arm}))
    on, off = arms["on"], arms["off"]
    ratio = on["throughput"] / off["throughput"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    bench.notes.append(
        f"fairness ({n:,} backlog): tenant B p99 {on['b_p99']:.0f} ms on, {off['b_p99']:.0f} ms "
        f"off, target <= {B_TARGET_MS:.0f} ms ({verdict(on['b_p99'] <= B_TARGET_MS)}); high "
        f"behind low p99 {on['high_p99']:.0f} ms on, {off['high_p99']:.0f} ms off, target <= "
        f"{HIGH_TARGET_MS:.0f} ms ({verdict(on['high_p99'] <= HIGH_TARGET_MS)}); throughput "
        f"{on['throughput']:.0f}/s on vs {off['throughput']:.0f}/s off = {ratio:.0%}, target "
        f">= {THROUGHPUT_TARGET:.0%} ({verdict(ratio >= THROUGHPUT_TARGET)}); lone tenant p50/p99 "
        f"{on['lone_p50']:.0f}/{on['lone_p99']:.0f} ms on, "
        f"{off['lone_p50']:.0f}/{off['lone_p99']:.0f} ms off"
    )
