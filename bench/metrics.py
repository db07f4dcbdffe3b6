"""`--only metrics`: what counting and serving Prometheus metrics costs.

The closed-loop no-op figure with every process's metrics off
(``JOBPLANE_METRICS_LISTEN=off``: nothing counted, no listener) and on
(counted, and every process's /metrics scraped every 5 s, three times as
often as Prometheus's default, while its arm is loaded), in one run: both
arms running at once and loaded in turn (:mod:`bench.paired`), the order
reversed every other round. The cost is the median of the rounds' ratios.
The target: at most 5 %.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from bench.paired import Arm, cost_note, cost_ratio, cpu_split, paired_rounds, rounds_of

if TYPE_CHECKING:
    from bench.run import Bench

SCRAPE_SECONDS = 5.0
TARGET = 0.95


def _scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return len(response.read())


async def _scraper(ports: list[int], scrapes: list[float]) -> None:
    while True:
        started = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(_scrape, p) for p in ports))
        scrapes.append(time.perf_counter() - started)
        await asyncio.sleep(SCRAPE_SECONDS)


def per_job_seconds(jobs: int = 50_000) -> float:
    """CPU seconds of the metric calls one job makes (submit, start, end, dispatch),
    timed in this process: the floor of the cost, whatever the machine's load."""
    from datetime import UTC, datetime

    from jobplane.observe.metrics import Metrics

    metrics = Metrics()
    submitted = datetime.now(UTC)
    started = time.process_time()
    for _ in range(jobs):
        metrics.submitted("bench.noop", "jobplane.default")
        metrics.relayed("job.dispatch", "confirmed")
        metrics.attempt_started("bench.noop", "jobplane.default", 1, submitted)
        metrics.attempt_ended("bench.noop", "jobplane.default", "completed", 0.001)
    return (time.process_time() - started) / jobs


async def fig_metrics(bench: Bench) -> None:
    """Throughput with metrics off and on, as a ratio (target: on at least 95 % of off)."""
    from bench.run import Figure, _procs

    off = Arm("off", {"JOBPLANE_METRICS_LISTEN": "off"})
    on = Arm("on", {}, ops_ports=True)
    scrapes: list[float] = []

    @contextlib.asynccontextmanager
    async def scraped(arm: Arm, twin: Bench) -> AsyncIterator[None]:
        if arm is not on:
            yield
            return
        scraper = asyncio.create_task(_scraper(list(twin.ops_ports.values()), scrapes))
        try:
            yield
        finally:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper

    await paired_rounds(bench, [off, on], "metrics", during=scraped)
    config = {
        "jobs": bench.args.jobs,
        "rounds": rounds_of(bench),
        "clients": bench.args.clients,
        "scrape_every_s": SCRAPE_SECONDS,
        "arms": "running at once, loaded in turn",
        **_procs(bench),
    }
    for arm in (off, on):
        bench.add(
            Figure(
                f"e2e_throughput_metrics_{arm.name}", statistics.median(arm.rates), "jobs/s", config
            )
        )
    print(f"metrics, CPU ms per job off → on: {cpu_split(on, off)}", file=sys.stderr)
    ratio = cost_ratio(on, off)
    bench.add(
        Figure(
            "metrics_throughput_ratio",
            ratio,
            "on/off",
            {**config, "target": f">= {TARGET} (at most 5 % cost)", "met": ratio >= TARGET},
        )
    )
    note = cost_note("metrics", on, off, 1 - TARGET)
    print(note, file=sys.stderr)
    bench.notes.append(note)
    bench.add(Figure("metrics_cpu_per_job", per_job_seconds() * 1e6, "us"))
    if scrapes:
        p50 = statistics.median(scrapes) * 1000
        bench.add(Figure("metrics_scrape_all_processes_p50", p50, "ms"))
