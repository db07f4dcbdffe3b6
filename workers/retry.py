"""The retry policy: exponential backoff with jitter."""

from __future__ import annotations

import random

from jobplane.topology import Topology, TopologyError


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> float:
    """Exponential backoff with jitter: up to base·2^(attempt-1), at least half of it."""
    ceiling = min(cap, base * 2 ** max(0, attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


def retry_delay(
    topology: Topology, queue: str, attempt: int, *, base_override: float | None = None
) -> float:
    """The backoff before the attempt after ``attempt`` of a job on ``queue``.

    The queue's ``retry_base_delay`` and ``retry_max_delay`` (``base_override``
    replaces the base); plain defaults when the queue left the topology.
    """
    try:
        found = topology.queue(queue)
    except TopologyError:
        return backoff(attempt, base=base_override or 1.0)
    base = found.retry_base_delay if base_override is None else base_override
    return backoff(attempt, base=base, cap=found.retry_max_delay)
