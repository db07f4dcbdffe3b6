"""The retry policy by its old names: exponential backoff with jitter.

The policy itself, and the decision it serves, live in
:mod:`jobplane.attempt_end`.
"""

from __future__ import annotations

from jobplane.attempt_end import RetryPolicy
from jobplane.topology import Topology


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> float:
    """Exponential backoff with jitter: up to base·2^(attempt-1), at least half of it."""
    return RetryPolicy(base, cap).delay(attempt)


def retry_delay(
    topology: Topology, queue: str, attempt: int, *, base_override: float | None = None
) -> float:
    """The backoff before the attempt after ``attempt`` of a job on ``queue``.

    The queue's ``retry_base_delay`` and ``retry_max_delay`` (``base_override``
    replaces the base); plain defaults when the queue left the topology.
    """
    return RetryPolicy.of_queue(topology, queue, base_override=base_override).delay(attempt)
