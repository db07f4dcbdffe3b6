"""The retry policy: exponential backoff with jitter."""

from __future__ import annotations

import random


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0) -> float:
    """Exponential backoff with jitter: up to base·2^(attempt-1), at least half of it."""
    ceiling = min(cap, base * 2 ** max(0, attempt - 1))
    return random.uniform(ceiling / 2, ceiling)
