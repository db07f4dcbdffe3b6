"""The tracing figure (`--only tracing`): end-to-end throughput with tracing on and off.

``--rounds`` rounds (3) of ``--jobs`` no-op jobs each, every process restarted for each
half, the order alternating (off-on, on-off, off-on) as for the lifecycle
figure. On: every process exports over OTLP/HTTP (the batch processor's
defaults) to a receiver on loopback in this process, which decodes each
request as a collector would; every span is sampled (``--trace-ratio``: a
share of the traces). Each half's processes run the warm-up jobs first
(``Bench.warm_up``) and wait for their spans' export; the spans counted are
the measured loops'. The cost is the median of the rounds' ratios; the
target is at most 5 %.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from typing import TYPE_CHECKING

from tests.otlp_receiver import Receiver

if TYPE_CHECKING:
    from bench.run import Bench

#: The most throughput tracing may cost (on / off at least 0.95).
TARGET_COST = 0.05
#: Seconds after the warm-up: past the batch span processor's schedule (5 s).
EXPORT_PAUSE = 5.5


async def fig_tracing(bench: Bench) -> None:
    """Throughput with tracing off and on, in one run (see the module's docstring)."""
    from bench.run import Figure, _procs, closed_loop_rate, cpu_seconds

    ratios: list[float] = []
    totals: dict[str, list[float]] = {"off": [], "on": []}
    # CPU ms per job by component, summed over the rounds (divided at the end).
    cpu: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    spans = 0
    warm_spans = 0
    # Every span sampled unless --trace-ratio asks for a share of the traces.
    ratio = bench.args.trace_ratio
    sampler = "always_on" if ratio >= 1 else "parentbased_traceidratio"
    with Receiver.running() as receiver:
        for round_ in range(1, bench.args.rounds + 1):
            order = ("off", "on") if round_ % 2 else ("on", "off")
            rates: dict[str, float] = {}
            for state in order:
                await bench.stop_all()
                bench.extra_env = (
                    {
                        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                        "OTEL_TRACES_SAMPLER": sampler,
                        "OTEL_TRACES_SAMPLER_ARG": str(bench.args.trace_ratio),
                    }
                    if state == "on"
                    else {}
                )
                received = len(receiver.snapshot())
                await bench.start_all()
                await bench.warm_up()
                # The warm-up's spans go out with the batch processor's next
                # export (every 5 s, both halves wait alike): before the
                # measured loop, not in it, and not counted with its spans.
                await asyncio.sleep(EXPORT_PAUSE)
                warm_spans += len(receiver.snapshot()) - received
                before = cpu_seconds(bench)
                rates[state] = await closed_loop_rate(bench, f"bench.noop_tracing_{state}_{round_}")
                after = cpu_seconds(bench)
                for c, used in after.items():
                    per_job = (used - before.get(c, 0.0)) * 1000 / bench.args.jobs
                    cpu[state][c] = cpu[state].get(c, 0.0) + per_job / bench.args.rounds
                totals[state].append(rates[state])
            ratios.append(rates["on"] / rates["off"])
            print(
                f"tracing, round {round_}: {rates['on']:,.1f} jobs/s on, "
                f"{rates['off']:,.1f} off: ratio {ratios[-1]:.3f}",
                file=sys.stderr,
            )
        await bench.stop_all()  # SIGTERM: the last spans are flushed at exit
        spans = len(receiver.snapshot()) - warm_spans
    bench.extra_env = {}
    await bench.start_all()
    config = {
        "jobs": bench.args.jobs,
        "rounds": bench.args.rounds,
        "clients": bench.args.clients,
        "sampler": sampler,
        "sampled": ratio,
    }
    for state in ("off", "on"):
        bench.add(
            Figure(
                f"e2e_throughput_tracing_{state}",
                statistics.median(totals[state]),
                "jobs/s",
                {**config, **_procs(bench)},
            )
        )
    for c in sorted(cpu["on"]):
        bench.add(
            Figure(
                f"tracing_cpu_per_job_{c.replace(' ', '_')}",
                cpu["on"][c],
                "ms/job",
                {**config, "off": round(cpu["off"].get(c, 0.0), 3)},
            )
        )
    split = ", ".join(
        f"{c} {cpu['off'].get(c, 0.0):.2f} → {cpu['on'][c]:.2f}" for c in sorted(cpu["on"])
    )
    print(f"tracing, CPU ms per job off → on: {split}", file=sys.stderr)
    ratio = statistics.median(ratios)
    bench.add(Figure("tracing_throughput_ratio", ratio, "on/off", {**config, "spans": spans}))
    verdict = "within" if ratio >= 1 - TARGET_COST else "over"
    print(
        f"tracing costs {1 - ratio:.1%} of the throughput ({verdict} the {TARGET_COST:.0%} "
        f"target); {spans:,} spans received",
        file=sys.stderr,
    )
