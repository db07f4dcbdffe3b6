"""The speed targets, each judged against the figure of this run that measures it.

``make bench`` ends with this list: each target, the figure that measures it,
its value and the verdict (met, missed, or not measured when the run left
that figure out with ``--only`` or ``--skip``). The figures themselves are
computed where they are measured; this module only names which figure a
target reads and the bound, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Measured(Protocol):
    """What a target reads of a figure (``bench.run.Figure``)."""

    name: str
    value: float
    unit: str


@dataclass(frozen=True)
class Target:
    """``figure`` compared with ``bound`` by ``op`` (``>=`` or ``<=``)."""

    what: str
    figure: str
    op: str
    bound: float
    # The figure that measures it, named for --only.
    only: str

    def met(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return value >= self.bound if self.op == ">=" else value <= self.bound


#: The jobplane arm of the peers that runs the shipped defaults: ``jobplane dev``
#: as installed, fair dispatch and the default tenant limits on.
DEFAULTS_ARM = "peers_jobplane_dev"
#: The rate against Celery the shipped defaults are to reach (bench.peers reads it too).
CELERY_TARGET = 4.0
#: The rate against Procrastinate the shipped defaults are to reach.
PROCRASTINATE_TARGET = 1.5
#: The CPU per job jobplane aims at, whole machine, ms.
CPU_FLOOR_MS = 2.0

TARGETS = (
    Target(
        "rate against Celery, shipped defaults",
        f"{DEFAULTS_ARM}_over_celery",
        ">=",
        CELERY_TARGET,
        "peers",
    ),
    Target(
        "rate against Procrastinate, shipped defaults",
        f"{DEFAULTS_ARM}_over_procrastinate",
        ">=",
        PROCRASTINATE_TARGET,
        "peers",
    ),
    Target(
        "whole-machine CPU per job, shipped defaults",
        f"{DEFAULTS_ARM}_cpu_per_job_machine",
        "<=",
        CPU_FLOOR_MS,
        "peers",
    ),
    Target("submit → start p50 at half load", "submit_to_start_p50", "<=", 5.0, "open"),
    Target("submit → start p99 at half load", "submit_to_start_p99", "<=", 25.0, "open"),
    Target("BatchSubmitJobs accepted", "batch_submit_accepted", ">=", 10_000.0, "batch"),
    Target(
        "lifecycle events as by default, cost in throughput",
        "lifecycle_events_cost",
        "<=",
        15.0,
        "lifecycle",
    ),
    Target(
        "every lifecycle event published, cost in throughput",
        "lifecycle_publish_all_cost",
        "<=",
        15.0,
        "lifecycle",
    ),
    Target("progress → watcher p50", "progress_to_watcher_p50", "<=", 10.0, "progress"),
    Target("progress → watcher p99", "progress_to_watcher_p99", "<=", 50.0, "progress"),
)


def verdicts(figures: Iterable[Measured], targets: Iterable[Target] = TARGETS) -> list[str]:
    """One line a target: its figure's value and the verdict, or why there is none."""
    by_name = {figure.name: figure for figure in figures}
    lines = ["targets (each against its figure in this run):"]
    for target in targets:
        figure = by_name.get(target.figure)
        bound = f"{target.op} {target.bound:g}"
        if figure is None:
            lines.append(
                f"  {target.what}: not measured in this run (--only {target.only}); target {bound}"
            )
            continue
        verdict = "met" if target.met(figure.value) else "missed"
        lines.append(
            f"  {target.what}: {figure.value:,.2f} {figure.unit} ({target.figure}), "
            f"target {bound}: {verdict}"
        )
    return lines
