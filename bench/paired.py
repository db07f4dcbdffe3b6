"""On/off comparisons with every arm running at once, each on a database and vhost of its own.

The figures that restart the processes for each half of a round (metrics,
lifecycle) pay for it in noise: each half has its own start, its own
warm-up, and a machine that drifts between the halves' starts (this one's
rate swings by a fifth within minutes) weighs on one side. Here each arm is
a :class:`~bench.run.Bench` of its own (server, relay and workers with the
arm's environment), started and warmed up once; the rounds then load the
arms in turn, the order reversed every other round (A-B-C, C-B-A, ...) so
a drift weighs on every arm alike, and compare them within each round. An
arm that is not being loaded idles (its relay's listen, its workers'
heartbeats, its sweeper): every arm idles as long as the others run.

Each arm's database is analyzed after its warm-up and after each of its
loops (outside what is measured). Otherwise the arms' plans differ by
chance: a statement prepared before the sweeper's first ANALYZE of a young
table keeps a plan made for an empty table until it runs, and when that
happens differs from arm to arm (one arm read seven times the rows of the
other in the same rounds). A comparison of two arms must not measure that.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.run import Bench

#: Rounds of a paired figure unless ``--rounds`` says: short loops, many
#: rounds. This machine's rate drifts by a fifth within minutes; the median
#: of eight ratios moves less with one slow phase than the median of three.
DEFAULT_ROUNDS = 8


@dataclass
class Arm:
    """One side of a comparison: its name and the environment its processes get."""

    name: str
    env: dict[str, str]
    #: jobs/s of each round, in round order.
    rates: list[float] = field(default_factory=list)
    #: CPU ms per job by component, the mean over the rounds.
    cpu: dict[str, float] = field(default_factory=dict)
    #: CPU ms per job by component, each round's (filled only when asked for).
    cpu_rounds: list[dict[str, float]] = field(default_factory=list)
    #: Each process's ops listener (/metrics) on a port picked for it, kept in
    #: its bench's ``ops_ports`` (else a port of the system's choosing).
    ops_ports: bool = False


def rounds_of(bench: Bench) -> int:
    """The rounds of a paired figure: ``--rounds``, else :data:`DEFAULT_ROUNDS`."""
    rounds: int | None = bench.args.rounds
    return DEFAULT_ROUNDS if rounds is None else rounds


async def paired_rounds(
    bench: Bench,
    arms: list[Arm],
    label: str,
    *,
    settled: Callable[[Bench], Awaitable[None]] | None = None,
    warmed: Callable[[], None] | None = None,
    during: Callable[[Arm, Bench], AbstractAsyncContextManager[object]] | None = None,
    keep_rounds: bool = False,
) -> None:
    """Start every arm, warm each up, then run :func:`rounds_of` rounds of ``--jobs`` jobs
    on each arm in turn; fills each arm's ``rates`` and ``cpu``.

    ``settled``: awaited on an arm after its warm-up and after each of its
    loops (e.g. until its relay has published every event), so what a loop
    leaves behind is counted in it and not in the next arm's. ``warmed``:
    called once every arm is warmed up and settled, before the first round.
    ``during``: entered around each of an arm's loops (e.g. a scraper of its
    metrics while it is loaded). ``keep_rounds``: keep each round's CPU per job
    too, in each arm's ``cpu_rounds``. The main bench's processes are stopped
    while the arms run and started again after.
    """
    from bench.run import Bench, closed_loop_rate, cpu_seconds

    rounds = rounds_of(bench)
    await bench.stop_all()
    async with contextlib.AsyncExitStack() as stack:
        benches: dict[str, Bench] = {}
        for arm in arms:
            args = argparse.Namespace(**vars(bench.args))
            if args.profile is not None:  # --profile: each arm's stats in a folder of its own
                args.profile = args.profile / arm.name
                args.profile.mkdir(parents=True, exist_ok=True)
            twin = await stack.enter_async_context(Bench(args))
            twin.extra_env = dict(arm.env)
            twin.pin_ops_ports = arm.ops_ports
            await twin.start_all()
            benches[arm.name] = twin
            print(f"{label}, arm {arm.name}: database {twin.database}", file=sys.stderr)
        for arm in arms:
            await benches[arm.name].warm_up()
            if settled is not None:
                await settled(benches[arm.name])
            await benches[arm.name].sql("ANALYZE")
        if warmed is not None:
            warmed()
        for round_ in range(1, rounds + 1):
            order = arms if round_ % 2 else arms[::-1]
            for arm in order:
                twin = benches[arm.name]
                before = cpu_seconds(twin)
                async with contextlib.nullcontext() if during is None else during(arm, twin):
                    # A type a round: the arm's database holds every round's jobs.
                    job_type = f"bench.noop_paired_{round_}"
                    arm.rates.append(await closed_loop_rate(twin, job_type))
                if settled is not None:
                    await settled(twin)
                after = cpu_seconds(twin)
                this_round: dict[str, float] = {}
                for component, used in after.items():
                    per_job = (used - before.get(component, 0.0)) * 1000 / bench.args.jobs
                    arm.cpu[component] = arm.cpu.get(component, 0.0) + per_job / rounds
                    this_round[component] = per_job
                if keep_rounds:
                    arm.cpu_rounds.append(this_round)
                await twin.sql("ANALYZE")
            rates = ", ".join(f"{arm.name} {arm.rates[-1]:,.1f}" for arm in arms)
            print(f"{label}, round {round_}: jobs/s {rates}", file=sys.stderr)
        for twin in benches.values():
            await twin.stop_all()  # SIGTERM: what a process holds (spans) goes out
    await bench.start_all()


def round_ratios(arm: Arm, base: Arm) -> list[float]:
    """``arm``'s rate over ``base``'s, round by round."""
    return [a / b for a, b in zip(arm.rates, base.rates, strict=True)]


def cost_ratio(arm: Arm, base: Arm) -> float:
    """The figure's ratio: the median of the rounds' ``arm`` / ``base`` rates."""
    return statistics.median(round_ratios(arm, base))


def cpu_change(arm: Arm, base: Arm) -> float:
    """How much more CPU a job costs the machine on ``arm`` than on ``base`` (0.05: 5 %)."""
    return sum(arm.cpu.values()) / sum(base.cpu.values()) - 1


def cost_note(what: str, arm: Arm, base: Arm, target: float) -> str:
    """The figure's line: ``what`` costs so much of the throughput, within or over
    ``target`` (0.05: at most 5 %), and the machine's CPU per job it adds."""
    ratio = cost_ratio(arm, base)
    verdict = "within" if ratio >= 1 - target else "over"
    return (
        f"{what}: costs {1 - ratio:.1%} of the throughput ({verdict} the {target:.0%} target), "
        f"machine CPU per job {cpu_change(arm, base):+.1%}"
    )


def cpu_split(arm: Arm, base: Arm) -> str:
    """Each component's CPU ms per job, ``base`` → ``arm``."""
    return ", ".join(f"{c} {base.cpu.get(c, 0.0):.2f} → {arm.cpu[c]:.2f}" for c in sorted(arm.cpu))
