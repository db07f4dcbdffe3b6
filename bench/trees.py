"""`--only trees --base-tree DIR`: this checkout against another, both running at once.

Two arms (:mod:`bench.paired`), each a server, relay and workers on a
database and vhost of its own: ``base`` runs the jobplane of ``DIR`` (its
``core`` and root on ``PYTHONPATH``, as a ``git worktree add DIR COMMIT``
lays it out), ``change`` runs this checkout's. They are loaded in turn for
``--rounds`` rounds of ``--jobs`` no-op jobs, the order reversed every
other round; each round's jobs/s and each component's CPU per job (from
/proc) are printed, round by round, then the median ratio of the rates and
each component's mean CPU per job, base → change.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.paired import Arm, cpu_split, paired_rounds, round_ratios, rounds_of

if TYPE_CHECKING:
    from bench.run import Bench


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that runs the jobplane of checkout ``tree``."""
    root = tree.resolve()
    if not (root / "core" / "jobplane").is_dir():
        raise SystemExit(f"--base-tree {tree}: no core/jobplane there")
    return {"PYTHONPATH": os.pathsep.join((str(root / "core"), str(root)))}


async def fig_trees(bench: Bench) -> None:
    """Throughput and CPU per job of ``--base-tree``'s checkout and of this one."""
    from bench.run import Figure

    tree: Path | None = bench.args.base_tree
    if tree is None:
        raise SystemExit("--only trees needs --base-tree DIR")
    base = Arm("base", tree_env(tree))
    change = Arm("change", {})
    await paired_rounds(bench, [base, change], "trees", keep_rounds=True)
    for arm in (base, change):
        for i, used in enumerate(arm.cpu_rounds, 1):
            split = ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(used.items()))
            print(f"trees, {arm.name} round {i}: CPU ms per job: {split}", file=sys.stderr)
    ratios = round_ratios(change, base)
    print(f"trees, CPU ms per job base → change: {cpu_split(change, base)}", file=sys.stderr)
    print(
        f"trees, jobs/s change/base by round: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f} over {rounds_of(bench)} rounds)",
        file=sys.stderr,
    )
    for arm in (base, change):
        bench.add(Figure(f"trees_{arm.name}_throughput", statistics.median(arm.rates), "jobs/s"))
        for component, ms in sorted(arm.cpu.items()):
            name = component.replace(" ", "_")
            bench.add(Figure(f"trees_{arm.name}_cpu_per_job_{name}", ms, "ms"))
