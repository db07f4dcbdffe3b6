"""The topology and handlers of the queue-priority tests (ADR-0019)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from jobplane.client import AsyncClient
from jobplane.topology import Topology
from jobplane.workers.handlers import Handler, JobContext, Registry

#: A reserve of one slot for the high queues.
CONCURRENCY = 4


def mixed_topology(topology: Topology) -> Topology:
    """Two high queues (``hi.a.#``, ``hi.b.#``) and a low one (``lo.#``), named as ``topology``."""
    base = topology.queues[0]
    queues = (
        replace(base, name=f"{base.name}.hi-a", bindings=("hi.a.#",), priority="high"),
        replace(base, name=f"{base.name}.hi-b", bindings=("hi.b.#",), priority="high"),
        replace(base, name=f"{base.name}.lo", bindings=("lo.#",), priority="low"),
    )
    return replace(topology, queues=queues)


def two_class_topology(topology: Topology) -> Topology:
    """One high queue (``hi.a.#``) and one low queue (``lo.#``), named as ``topology``."""
    base = topology.queues[0]
    queues = (
        replace(base, name=f"{base.name}.hi-a", bindings=("hi.a.#",), priority="high"),
        replace(base, name=f"{base.name}.lo", bindings=("lo.#",), priority="low"),
    )
    return replace(topology, queues=queues)


@dataclass
class Board:
    """What the handlers saw: who runs now, the most at once, every start."""

    running: Counter[str] = field(default_factory=Counter)
    peak: int = 0
    starts: list[tuple[str, float]] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    ended: Counter[str] = field(default_factory=Counter)

    def registry(self, seconds: dict[str, float]) -> Registry:
        """Handlers of the three job types that sleep ``seconds`` of their class."""
        registry = Registry()
        for cls, job_type in (("high", "hi.a.work"), ("high", "hi.b.work"), ("low", "lo.work")):
            registry.add(job_type, self._handler(cls, seconds[cls]))
        return registry

    def _handler(self, cls: str, seconds: float) -> Handler:
        async def handle(ctx: JobContext) -> dict[str, Any]:
            self.running[cls] += 1
            self.peak = max(self.peak, sum(self.running.values()))
            self.starts.append((cls, time.monotonic()))
            self.started[ctx.id] = time.monotonic()
            try:
                await asyncio.sleep(seconds)
            finally:
                self.running[cls] -= 1
            self.ended[cls] += 1
            return {}

        return handle


async def submit(client: AsyncClient, job_type: str, n: int) -> list[str]:
    """Submit ``n`` jobs of ``job_type`` at once; their ids."""
    jobs = await asyncio.gather(*(client.submit(job_type, {}) for _ in range(n)))
    return [job.id for job in jobs]
