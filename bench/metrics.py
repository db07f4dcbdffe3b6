"""`--only metrics`: what counting and serving Prometheus metrics costs.

The closed-loop no-op figure with every process's metrics off
(``--metrics-listen off``: nothing counted, no listener) and on (counted, and
every process's /metrics scraped every 5 s, three times as often as
Prometheus's default), in one run. Rounds alternate the order (off-on,
on-off, off-on) so that a machine that drifts, or tables that grow, weigh on
both sides alike; the cost is the median of the rounds' ratios. The target:
at most 5 %.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import urllib.request
from typing import TYPE_CHECKING

from tests.faults.cluster import free_port

if TYPE_CHECKING:
    from bench.run import Bench

SCRAPE_SECONDS = 5.0
TARGET = 0.95


async def _start(bench: Bench, metrics: bool) -> list[int]:
    """Server, relay and workers, with metrics on or off; the ops ports when on."""
    await bench.stop_all()
    ports: list[int] = []

    def listen() -> list[str]:
        if not metrics:
            return ["--metrics-listen", "off"]
        ports.append(free_port())
        return ["--metrics-listen", f"127.0.0.1:{ports[-1]}"]

    await bench.start("server", "serve", *listen())
    await bench.start("relay", "relay", *listen())
    for i in range(bench.args.workers):
        await bench.start(
            f"worker{i}",
            "worker",
            "--handlers",
            "bench.handlers:registry",
            "--concurrency",
            str(bench.args.concurrency),
            *listen(),
        )
    await bench.ready()
    await bench.warm_up()
    return ports


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
    from bench.run import Figure, _procs, closed_loop_rate

    ratios: list[float] = []
    totals: dict[str, list[float]] = {"off": [], "on": []}
    scrapes: list[float] = []
    for round_ in range(1, bench.args.rounds + 1):
        order = ("off", "on") if round_ % 2 else ("on", "off")
        rates: dict[str, float] = {}
        for state in order:
            ports = await _start(bench, state == "on")
            scraper = asyncio.create_task(_scraper(ports, scrapes)) if ports else None
            try:
                rates[state] = await closed_loop_rate(bench, f"bench.noop_metrics_{state}_{round_}")
            finally:
                if scraper is not None:
                    scraper.cancel()
            totals[state].append(rates[state])
        ratios.append(rates["on"] / rates["off"])
        print(
            f"metrics, round {round_}: {rates['on']:,.1f} jobs/s on, {rates['off']:,.1f} off: "
            f"ratio {ratios[-1]:.3f}",
            file=sys.stderr,
        )
    config = {
        "jobs": bench.args.jobs,
        "rounds": bench.args.rounds,
        "clients": bench.args.clients,
        "scrape_every_s": SCRAPE_SECONDS,
        **_procs(bench),
    }
    for state in ("off", "on"):
        bench.add(
            Figure(
                f"e2e_throughput_metrics_{state}",
                statistics.median(totals[state]),
                "jobs/s",
                config,
            )
        )
    ratio = statistics.median(ratios)
    bench.add(
        Figure(
            "metrics_throughput_ratio",
            ratio,
            "on/off",
            {**config, "target": f">= {TARGET} (at most 5 % cost)", "met": ratio >= TARGET},
        )
    )
    bench.add(Figure("metrics_cpu_per_job", per_job_seconds() * 1e6, "us"))
    if scrapes:
        p50 = statistics.median(scrapes) * 1000
        bench.add(Figure("metrics_scrape_all_processes_p50", p50, "ms"))
