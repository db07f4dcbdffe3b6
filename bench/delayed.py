"""`--only delayed`: delayed jobs are dispatched on time, whatever waits behind them.

``--delayed-waiting N`` jobs (10,000; 100,000 for the full figure) are
submitted with a schedule_time 30 days ahead, so their dispatches sit in the
outbox not yet due. Then ``--delayed-jobs`` jobs are submitted due at
staggered times over a few seconds, and the lag of each is measured: its
dispatch's publish (``published_at``) and its start (``start_time``) minus its
schedule_time, p50 and p99, against a target of p99 ≤ 1 s. The relay's
claim is timed alone (the statement as the relay runs it, fair dispatch on,
nothing due) before and after the waiting jobs go in: the ratio says whether
its cost grows with them (target: about 1).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from jobplane.client import AsyncClient, JobSpec
from jobplane.store.db import positional
from jobplane.topology import load_topology
from tests.support.plans import relay_claims

if TYPE_CHECKING:
    from bench.run import Bench

JOB_TYPE = "bench.noop"
BATCH = 1000
LAG_TARGET_MS = 1000.0
# The relay's claim, as it runs it with fair dispatch on (the default): one
# statement, its dispatches' part and the other rows', a batch of 100.
_CLAIM, _BINDS = relay_claims(load_topology())["fair"]
_SQL = positional(_CLAIM)
_CLAIMS = 300
# The due jobs: from this long after their submit, spread over this long.
_LEAD_SECONDS = 2.0
_SPREAD_SECONDS = 4.0


async def claim_ms(bench: Bench) -> tuple[float, int]:
    """The relay's claim with nothing due: the median of its execution time in Postgres
    (EXPLAIN ANALYZE's, no round trip or planning in it), and the buffers it read."""
    times, blocks = [], 0
    for _ in range(_CLAIMS):
        plan = await bench.sql(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {_SQL.text}", *_SQL.args(_BINDS)
        )
        data = _json(plan[0][0])
        times.append(float(data["Execution Time"]))
        root = data["Plan"]
        read = root.get("Shared Hit Blocks", 0), root.get("Shared Read Blocks", 0)
        blocks = max(blocks, sum(b for b in read if isinstance(b, int)))
    return statistics.median(times), blocks


def _json(value: object) -> dict[str, Any]:
    """The one plan of an EXPLAIN (FORMAT JSON) answer."""
    data = json.loads(value) if isinstance(value, str) else value
    assert isinstance(data, list)
    plan: dict[str, Any] = data[0]
    return plan


async def _submit_waiting(bench: Bench, n: int) -> None:
    """``n`` jobs due in 30 days, in batches of 1,000 by four callers."""
    far = datetime.now(UTC) + timedelta(days=30)
    clients = [AsyncClient(bench.address, bench.key) for _ in range(4)]

    async def caller(i: int) -> None:
        for start in range(i * BATCH, n, BATCH * len(clients)):
            size = min(BATCH, n - start)
            await clients[i].submit_many(
                [JobSpec(JOB_TYPE, {"w": start + k}, schedule_time=far) for k in range(size)]
            )

    try:
        await asyncio.gather(*(caller(i) for i in range(len(clients))))
    finally:
        for client in clients:
            await client.close()
    await bench.sql("ANALYZE outbox")
    await bench.sql("ANALYZE jobs")


async def _lags(bench: Bench, count: int) -> tuple[list[float], list[float]]:
    """Submit ``count`` jobs due over a few seconds; each one's publish and start lag (ms)."""
    before = await bench.ended(JOB_TYPE)
    start = datetime.now(UTC) + timedelta(seconds=_LEAD_SECONDS)
    step = _SPREAD_SECONDS / max(1, count - 1)
    specs = [
        JobSpec(JOB_TYPE, {"due": i}, schedule_time=start + timedelta(seconds=i * step))
        for i in range(count)
    ]
    async with AsyncClient(bench.address, bench.key) as client:
        jobs = await client.submit_many(specs)
    await bench.wait_done(before + count, JOB_TYPE)
    rows = await bench.sql(
        "SELECT extract(epoch FROM o.published_at - j.schedule_time) * 1000 AS publish, "
        "extract(epoch FROM j.start_time - j.schedule_time) * 1000 AS start "
        "FROM jobs j JOIN outbox o ON o.job_id = j.id AND o.kind = 'job.dispatch' "
        "WHERE j.id = ANY($1::uuid[])",
        [job.id for job in jobs],
    )
    return [float(r["publish"]) for r in rows], [float(r["start"]) for r in rows]


async def fig_delayed(bench: Bench) -> None:
    """The delayed-job figures: lag p50/p99 among many waiting, and the claim's cost ratio."""
    from bench.run import Figure, percentile

    waiting, count = bench.args.delayed_waiting, bench.args.delayed_jobs
    empty_ms, empty_blocks = await claim_ms(bench)
    await _submit_waiting(bench, waiting)
    full_ms, full_blocks = await claim_ms(bench)
    publish, start = await _lags(bench, count)
    config = {"waiting": waiting, "due_jobs": count, "spread_s": _SPREAD_SECONDS}
    for name, values in (("publish", publish), ("start", start)):
        for p in (50, 99):
            bench.add(Figure(f"delayed_{name}_lag_p{p}", percentile(values, p), "ms", config))
    bench.add(
        Figure("delayed_claim_without_waiting", empty_ms * 1000, "us", {"blocks": empty_blocks})
    )
    bench.add(
        Figure(
            "delayed_claim_with_waiting", full_ms * 1000, "us", {**config, "blocks": full_blocks}
        )
    )
    bench.add(Figure("delayed_claim_cost_ratio", full_ms / empty_ms, "x", config))
    p99 = percentile(start, 99)
    bench.notes.append(
        f"delayed jobs ({waiting:,} waiting): start lag p99 {p99:.0f} ms, target <= "
        f"{LAG_TARGET_MS:.0f} ms ({'met' if p99 <= LAG_TARGET_MS else 'MISSED'}); claim "
        f"{empty_ms * 1000:.1f} -> {full_ms * 1000:.1f} us ({full_ms / empty_ms:.2f}x), buffers "
        f"{empty_blocks} -> {full_blocks}"
    )
