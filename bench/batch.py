"""`--only batch`: jobs accepted through BatchSubmitJobs, and the drain of that backlog.

Three figures from one run: the single-job closed-loop figure (``--jobs``
SubmitJob calls from ``--clients`` callers, first create to last end); then
``--batch-jobs`` jobs submitted with ``submit_many`` at 1,000 a call by
``--batch-callers`` concurrent callers, as jobs accepted a second (the
submits alone); and the end-to-end drain of that backlog (first create to
last end), with the CPU each part spent per job while the submits ran
(``batch_accept_cpu_per_job_*``) and over the submits and the drain
(``batch_cpu_per_job_*``). Targets: at least 10,000 jobs/s accepted, and a
drain at least as fast as the single-job closed loop (the backlog costs the
workers nothing more than jobs submitted one by one).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from jobplane.client import AsyncClient, JobSpec

if TYPE_CHECKING:
    from bench.run import Bench

JOB_TYPE = "bench.noop"
BATCH = 1000
ACCEPT_TARGET = 10_000.0


async def fig_batch(bench: Bench) -> None:
    """The batch figures, beside the single-job rate measured first in the same run."""
    from bench.run import Figure, closed_loop_rate, cpu_seconds

    single = await closed_loop_rate(bench, JOB_TYPE)
    # The jobs of this type already ended: other figures of the run (the peers')
    # leave jobs of other types, which wait_done does not count.
    before = await bench.ended(JOB_TYPE)
    n, callers = bench.args.batch_jobs, bench.args.batch_callers
    clients = [AsyncClient(bench.address, bench.key) for _ in range(callers)]
    marker = (await bench.sql("SELECT clock_timestamp() AS t"))[0]["t"]

    async def caller(i: int) -> None:
        mine = n // callers + (1 if i < n % callers else 0)
        client = clients[i]
        for start in range(0, mine, BATCH):
            specs = [JobSpec(JOB_TYPE, {}) for _ in range(min(BATCH, mine - start))]
            await client.submit_many(specs)

    used = cpu_seconds(bench)
    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    accepted = n / (time.perf_counter() - started)
    # Where the submits alone spent their CPU, per job (the drain runs beside them).
    accepting = {c: (s - used.get(c, 0.0)) * 1000 / n for c, s in cpu_seconds(bench).items()}
    for client in clients:
        await client.close()
    await bench.wait_done(before + n, JOB_TYPE)
    # Where the submit and the drain spent their CPU, per job.
    spent = {c: (s - used.get(c, 0.0)) * 1000 / n for c, s in cpu_seconds(bench).items()}
    rows = await bench.sql(
        "SELECT extract(epoch FROM max(end_time) - min(create_time)) AS span, count(*) AS n "
        "FROM jobs WHERE tenant_id = $1 AND type = $2 AND create_time >= $3",
        bench.tenant,
        JOB_TYPE,
        marker,
    )
    drained = float(rows[0]["n"]) / float(rows[0]["span"])
    config = {"jobs": n, "batch": BATCH, "callers": callers, "workers": bench.args.workers}
    bench.add(
        Figure(
            "batch_submit_closed_loop",
            single,
            "jobs/s",
            {"jobs": bench.args.jobs, "clients": bench.args.clients},
        )
    )
    bench.add(
        Figure(
            "batch_submit_accepted",
            accepted,
            "jobs/s",
            {**config, "target": ACCEPT_TARGET},
            floor="10,000 jobs/s target",
            ratio=accepted / ACCEPT_TARGET,
        )
    )
    bench.add(
        Figure(
            "batch_backlog_drain",
            drained,
            "jobs/s",
            config,
            floor="batch_submit_closed_loop",
            ratio=drained / single,
        )
    )
    for component, ms in sorted(spent.items()):
        bench.add(Figure(f"batch_cpu_per_job_{component.replace(' ', '_')}", ms, "ms", config))
    for component, ms in sorted(accepting.items()):
        name = f"batch_accept_cpu_per_job_{component.replace(' ', '_')}"
        bench.add(Figure(name, ms, "ms", config))
