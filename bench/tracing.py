"""The tracing figure (`--only tracing`): end-to-end throughput with tracing on and off.

One arm with tracing off and one with it on for each share of traces
sampled (``--trace-ratio``, 0.1 and 1 by default: one trace in ten,
``parentbased_traceidratio``, and every span, ``always_on``), all running
at once and loaded in turn (:mod:`bench.paired`): ``--rounds`` rounds (8) of
``--jobs`` no-op jobs on each arm. On, every process exports over OTLP/HTTP
(the batch processor's defaults) to a receiver on loopback in this
process, one receiver an arm, which keeps each request as a collector
would receive it. After each loop every arm waits past the batch
processor's schedule, so a loop's spans are exported (and their CPU
counted) before the next loop starts. The cost is the median of the
rounds' ratios; the target is at most 5 %.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
from typing import TYPE_CHECKING

from bench.paired import Arm, cost_note, cost_ratio, cpu_split, paired_rounds, rounds_of
from tests.otlp_receiver import Receiver

if TYPE_CHECKING:
    from bench.run import Bench

#: The most throughput tracing may cost (on / off at least 0.95).
TARGET_COST = 0.05
#: Seconds after a warm-up or a loop: past the batch span processor's schedule (5 s).
EXPORT_PAUSE = 5.5


def _label(ratio: float) -> str:
    return "all" if ratio >= 1 else f"{ratio:g}"


def _sampler(ratio: float) -> dict[str, str]:
    if ratio >= 1:
        return {"OTEL_TRACES_SAMPLER": "always_on"}
    return {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(ratio),
    }


async def _exported(_: Bench) -> None:
    await asyncio.sleep(EXPORT_PAUSE)


async def fig_tracing(bench: Bench) -> None:
    """Throughput with tracing off and on, in one run (see the module's docstring)."""
    from bench.run import Figure, _procs

    ratios: list[float] = bench.args.trace_ratio
    with contextlib.ExitStack() as stack:
        receivers = {r: stack.enter_context(Receiver.running()) for r in ratios}
        off = Arm("off", {})
        on = {
            r: Arm(
                f"on_{_label(r)}",
                {"OTEL_EXPORTER_OTLP_ENDPOINT": receivers[r].endpoint, **_sampler(r)},
            )
            for r in ratios
        }
        warm: dict[float, int] = {}

        def warmed() -> None:
            warm.update({r: len(receiver.snapshot()) for r, receiver in receivers.items()})

        await paired_rounds(bench, [off, *on.values()], "tracing", settled=_exported, warmed=warmed)
        spans = {r: len(receivers[r].snapshot()) - warm[r] for r in ratios}
    config = {
        "jobs": bench.args.jobs,
        "rounds": rounds_of(bench),
        "clients": bench.args.clients,
        "arms": "running at once, loaded in turn",
        **_procs(bench),
    }
    bench.add(Figure("e2e_throughput_tracing_off", statistics.median(off.rates), "jobs/s", config))
    for r, arm in on.items():
        label = _label(r)
        sampled = {**config, "sampled": r}
        bench.add(
            Figure(
                f"e2e_throughput_tracing_{arm.name}",
                statistics.median(arm.rates),
                "jobs/s",
                sampled,
            )
        )
        for c in sorted(arm.cpu):
            bench.add(
                Figure(
                    f"tracing_{label}_cpu_per_job_{c.replace(' ', '_')}",
                    arm.cpu[c],
                    "ms/job",
                    {**sampled, "off": round(off.cpu.get(c, 0.0), 3)},
                )
            )
        split = cpu_split(arm, off)
        print(f"tracing {label}, CPU ms per job off → on: {split}", file=sys.stderr)
        ratio = cost_ratio(arm, off)
        name = "tracing_throughput_ratio" if r < 1 else "tracing_throughput_ratio_all_sampled"
        bench.add(Figure(name, ratio, "on/off", {**sampled, "spans": spans[r]}))
        sampling = "every trace" if r >= 1 else f"{r:.0%} of traces"
        note = f"{cost_note(f'tracing, {sampling} sampled', arm, off, TARGET_COST)}; "
        note += f"{spans[r]:,} spans received"
        print(note, file=sys.stderr)
        bench.notes.append(note)
