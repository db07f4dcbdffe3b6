"""Handlers for the benchmarks: no work at all, or stamped progress events."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from jobplane.workers.handlers import JobContext, Registry

registry = Registry()


@registry.handler("bench.noop")
async def noop(ctx: JobContext) -> dict[str, Any]:
    """Does nothing: what is left is jobplane's own cost per job."""
    return {}


# The relay figure's backlog (figure 5): run, once published, as any no-op job.
registry.add("bench.relay", noop)
# What each comparison's processes run before they are measured (Bench.warm_up).
registry.add("bench.warm_up", noop)

#: The most rounds an on/off comparison runs (bench.run's --rounds).
MAX_ROUNDS = 20

# The same, under a type a round of the paired comparisons (bench.paired: tracing,
# metrics, lifecycle events; each arm on a database of its own, so a round's type
# counts only that round's jobs).
for _round in range(1, MAX_ROUNDS + 1):
    registry.add(f"bench.noop_paired_{_round}", noop)


#: Job types of each jobplane arm of --only peers: its rounds, or the variants
#: times the rounds of bench/peers_variants.py.
PEER_TYPES = 27

# The jobplane arms of --only peers (bench/peers.py), each round and its warm-up.
for _round in range(1, PEER_TYPES + 1):
    for _kind in ("dev", "dev8", "split"):
        registry.add(f"bench.noop_peers_{_kind}_{_round}", noop)
        registry.add(f"bench.noop_peers_{_kind}_{_round}_warmup", noop)


# The stages of the three-stage no-op pipeline (bench/pipeline.toml), and
# the single-stage job it is measured beside.
registry.add("bench.noop_single", noop)
for _stage in ("a", "b", "c"):
    registry.add(f"bench.stage.{_stage}", noop)


@registry.handler("bench.progress")
async def progress(ctx: JobContext) -> dict[str, Any]:
    """Payload ``{steps, interval_ms, start_delay_ms}``: progress events stamped
    with the wall clock, after a pause that lets every watcher connect first."""
    steps = int(ctx.payload.get("steps", 100))
    interval = float(ctx.payload.get("interval_ms", 10)) / 1000
    await asyncio.sleep(float(ctx.payload.get("start_delay_ms", 0)) / 1000)
    for step in range(1, steps + 1):
        await ctx.progress(step / steps, "", {"t": time.time()})
        await asyncio.sleep(interval)
    return {"steps": steps}


# --only fairness (bench/fairness.py): each figure's jobs under types of their own,
# the throughput's and the lone tenant's a round each (0: the warm-up).
for _type in (
    *(f"bench.fair.{k}.{a}" for k in ("a", "b", "low") for a in ("off", "on")),
    *(
        f"bench.fair.{k}.{a}.{r}"
        for k in ("lone", "tput")
        for a in ("off", "on")
        for r in range(MAX_ROUNDS + 1)
    ),
    *(f"hi.fair.{a}" for a in ("off", "on")),
):
    registry.add(_type, noop)


# --only scaling (bench/scaling.py): each step's jobs under a type of their own.
for _step in range(1, 17):
    registry.add(f"bench.scaling_{_step}", noop)
