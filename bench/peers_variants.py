"""``python -m bench.peers_variants V [V ...]``: the ``jobplane dev`` arm of
``--only peers`` in variants that differ from one another by one setting, loaded
in turn in one run (the order reversed every other round), to find which
setting makes a difference; medians and the median of each round's ratio to
the first variant.

Variants (``--list``): ``c64``, the dev arm of ``--only peers`` before
2026-12-07 (64 slots, no dashboard, bench.handlers on the default topology);
``c8``/``c16`` (its slots: 8 was dev's default before ADR-0057); ``ui`` (the
dashboard on); ``topology`` (builtin:dev and examples.reports' handlers);
``limits`` (the tenant limits at their defaults); ``defaults`` (all of these,
with 8 slots: the ``jobplane dev c8`` arm, dev's defaults before ADR-0057);
``defaults_c64`` (the same with 64 slots, dev's default since ADR-0057: the
``jobplane dev`` arm); ``procrastinate`` (that peer's arm). Every variant
passes its slots with ``--concurrency``, so none follows a change of the
default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from bench import peers
from bench.handlers import PEER_TYPES
from bench.run import Bench

#: Each variant: what it changes from ``c64``.
VARIANTS: dict[str, dict[str, Any]] = {
    "c64": {},
    "c8": {"concurrency": peers.DEV_NARROW_CONCURRENCY},
    "c16": {"concurrency": 16},
    "ui": {"ui": True},
    "topology": {"topology": True},
    "limits": {"limits": True},
    "defaults": {
        "concurrency": peers.DEV_NARROW_CONCURRENCY,
        "ui": True,
        "topology": True,
        "limits": True,
    },
    "defaults_c64": {"ui": True, "topology": True, "limits": True},
}


def _starter(bench: Bench, variant: dict[str, Any]) -> Callable[[], Coroutine[Any, Any, None]]:
    """How the dev arm starts in ``variant``."""
    from jobplane.config import DEFAULT_TENANT_MAX_STREAMS, DEFAULT_TENANT_SUBMITS_PER_SECOND
    from tests.support.ports import free_port

    async def start() -> None:
        env: dict[str, str] = {}
        handlers = "bench.handlers:registry"
        if variant.get("topology"):
            env["JOBPLANE_TOPOLOGY"] = "builtin:dev"
            handlers = "bench.dev_handlers:registry"
        if variant.get("limits"):
            env["JOBPLANE_TENANT_MAX_STREAMS"] = str(DEFAULT_TENANT_MAX_STREAMS)
            env["JOBPLANE_TENANT_SUBMITS_PER_SECOND"] = f"{DEFAULT_TENANT_SUBMITS_PER_SECOND:g}"
        concurrency = variant.get("concurrency", peers.DEV_WIDE_CONCURRENCY)
        slots = () if concurrency is None else ("--concurrency", str(concurrency))
        ui = f"127.0.0.1:{free_port()}" if variant.get("ui") else "off"
        saved, bench.extra_env = bench.extra_env, {**bench.extra_env, **env}
        try:
            args = ("--handlers", handlers, *slots, "--ui-listen", ui, "--processes", "auto")
            await bench.start("dev", "dev", *args)
        finally:
            bench.extra_env = saved
        await bench.ready()

    return start


def _line(round_: int, name: str, o: peers.Outcome, load: float) -> str:
    return (
        f"round {round_} {name:14s} {o.rate:7.1f} jobs/s, accepted {o.accepted:7.1f}/s, "
        f"finished {o.during:7.1f}/s while submitting, {o.cpu_ms:5.2f} ms CPU/job (machine), "
        f"others' CPUs {o.others_cores:.2f}, load average {load:.2f}"
    )


def _summary(results: dict[str, list[peers.Outcome]]) -> list[str]:
    lines = []
    for name, runs in results.items():
        lines.append(
            f"median {name:14s} {statistics.median(o.rate for o in runs):7.1f} jobs/s, "
            f"accepted {statistics.median(o.accepted for o in runs):7.1f}/s, finished "
            f"{statistics.median(o.during for o in runs):7.1f}/s while submitting, "
            f"{statistics.median(o.cpu_ms for o in runs):5.2f} ms CPU/job"
        )
    base = next(iter(results))
    for name, runs in results.items():
        if name != base:
            rates = [a.rate / b.rate for a, b in zip(runs, results[base], strict=True)]
            cpus = [a.cpu_ms / b.cpu_ms for a, b in zip(runs, results[base], strict=True)]
            lines.append(
                f"{name} / {base}: jobs/s {statistics.median(rates):.2f} "
                f"(rounds {', '.join(f'{r:.2f}' for r in rates)}), "
                f"CPU/job {statistics.median(cpus):.2f}"
            )
    return lines


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench.peers_variants", description=__doc__)
    parser.add_argument("variants", nargs="+", choices=[*VARIANTS, "procrastinate"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3000)
    a = parser.parse_args(argv)
    if a.rounds * len(a.variants) > PEER_TYPES:
        parser.error(f"at most {PEER_TYPES} arms in all (variants x rounds)")
    args = argparse.Namespace(
        clients=64, concurrency=64, profile=None, peer_dev_processes="auto", workers=1
    )
    results: dict[str, list[peers.Outcome]] = {v: [] for v in a.variants}
    kinds = len(a.variants)
    async with Bench(args) as bench:
        celery = await peers.peer_python("celery")
        procrastinate = await peers.peer_python("procrastinate")
        async with peers.Peers(bench, celery, procrastinate) as arms:
            for round_ in range(1, a.rounds + 1):
                order = a.variants if round_ % 2 else a.variants[::-1]
                for i, name in enumerate(order):
                    # A job type of its own each.
                    slot = (round_ - 1) * kinds + i + 1
                    arm = arms.arm(
                        "procrastinate" if name == "procrastinate" else "jobplane dev", slot
                    )
                    if name != "procrastinate":
                        arm.start = _starter(bench, VARIANTS[name])
                    load = os.getloadavg()[0]
                    outcome = await peers.measure(bench, arm, a.jobs)
                    results[name].append(outcome)
                    print(_line(round_, name, outcome, load), flush=True)
    print("\n".join(_summary(results)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
