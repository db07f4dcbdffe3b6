"""The relay's settings of flow-controlled dispatch (ADR-0042; docs/flow-control.md,
"Fairness"): plain values, importable wherever the relay's options are parsed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FairSettings:
    """The relay's flow control (docs/flow-control.md, "Fairness")."""

    #: Off: every due dispatch is claimed at once, longest due first (no credit).
    enabled: bool = True
    #: A queue's backlog never aims lower than this (a queue with no consumer yet).
    min_backlog: int = 4
    #: Ready messages per consumer of the queue.
    per_consumer: int = 2
    #: Seconds of the consumers' measured work to keep ready.
    horizon_seconds: float = 0.5
    #: A queue's backlog never aims higher than this.
    max_backlog: int = 2000
    #: A queue's counts are read at most this often.
    refresh_seconds: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_backlog <= self.max_backlog:
            raise ValueError("fair dispatch: 1 <= min_backlog <= max_backlog is required")
        if self.per_consumer < 0 or self.horizon_seconds < 0 or self.refresh_seconds <= 0:
            raise ValueError("fair dispatch: per_consumer, horizon and refresh must be positive")
